"""Pieces of the DeepSpeed adapter that need no running job."""
import collections

import pytest
import torch

from ftmem.adapter import VersionRef, apply_map_location
from ftmem_deepspeed.loads import file_key
from ftmem_deepspeed.stub import EntryPickles, is_stub, read_stub, version_of, write_stub
from ftmem_guard import FtmemStubFile


def test_map_location_as_string_device_or_callable():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)[:, 1:]  # a view with an offset and strides
    state = {"a": t, "b": [t, 3], "c": {"d": torch.ones(2)}}
    for where in ("cpu", torch.device("cpu"), None):
        out = apply_map_location(state, where)
        assert torch.equal(out["a"], t) and out["b"][1] == 3 and torch.equal(out["c"]["d"], torch.ones(2))
    same = apply_map_location(state, lambda storage, loc: storage)  # DeepSpeed's own lambda
    assert same["a"] is t
    cloned = apply_map_location(state, lambda storage, loc: storage.clone())
    assert torch.equal(cloned["a"], t) and cloned["a"].data_ptr() != t.data_ptr()
    assert cloned["a"].stride() == t.stride() and cloned["a"].storage_offset() == t.storage_offset()


def test_stub_files_are_told_apart_from_real_checkpoints_and_say_what_they_are(tmp_path):
    real, stub, other = (tmp_path / "global_step3" / name for name in ("real.pt", "stub.pt", "other.bin"))
    real.parent.mkdir()
    torch.save({"module": {"w": torch.ones(3)}, "param_shapes": [{"w": torch.Size([3])}]}, real)
    metadata = {"global_steps": 3, "param_shapes": [{"w": torch.Size([3])}]}
    saved = VersionRef("job-a", 3, "0123456789abcdef.3", "0123456789abcdef")
    write_stub(str(stub), "global_step3/stub.pt", saved, EntryPickles()("stub.pt", metadata), (4, 2))
    other.write_bytes(b"not a torch archive")
    assert is_stub(str(stub)) and not is_stub(str(real)) and not is_stub(str(other))
    assert not is_stub(str(tmp_path / "missing.pt"))
    assert read_stub(str(stub)) == {"format": 5, "tag_file": "global_step3/stub.pt", "job": "job-a",
                                    "metadata": metadata, "world": [4, 2],
                                    "version": {"job": "job-a", "version": 3, "uid": "0123456789abcdef.3",
                                                "timeline": "0123456789abcdef"}}
    assert version_of(read_stub(str(stub))) == saved
    with pytest.raises(ValueError, match="is not an ftmem stub"):
        read_stub(str(real))
    assert file_key(str(real)) == "global_step3/real.pt"
    # Read as a checkpoint file, with torch's default weights_only or without it: what it is.
    for weights_only in (True, False):
        with pytest.raises(FtmemStubFile, match=r"global_step3/stub.pt is a stub of ftmem's in-memory checkpoint of "
                                                r"job job-a: .* `ftmem export --job job-a --out DIR`"):
            torch.load(stub, weights_only=weights_only)


def test_a_stub_s_kept_entries_follow_every_change_of_the_entries_they_stand_for(tmp_path):
    """The stubs' long entries (param_shapes) are pickled once and kept while equal; a change,
    even in place in the caller's own object, or of type alone, is written anew."""
    pickles = EntryPickles()

    def written(step: int, metadata: dict) -> dict:
        tag_file = f"global_step{step}/mp_rank_00_model_states.pt"
        (tmp_path / f"global_step{step}").mkdir()
        write_stub(str(tmp_path / tag_file), tag_file, VersionRef("job-a", step, f"run.{step}", "run"),
                   pickles("mp_rank_00_model_states.pt", metadata), (1, 1))
        return read_stub(str(tmp_path / tag_file))["metadata"]

    shapes = [{f"layer{i}.weight": torch.Size([i + 1, 16]) for i in range(400)}]
    assert written(1, {"param_shapes": shapes, "global_steps": 1}) == {"param_shapes": shapes, "global_steps": 1}
    fresh = [dict(shapes[0])]  # equal, built anew (as DeepSpeed builds it at every save): kept
    assert pickles("mp_rank_00_model_states.pt", {"param_shapes": fresh}) == \
        pickles("mp_rank_00_model_states.pt", {"param_shapes": shapes})
    assert pickles("mp_rank_00_model_states.pt", {"param_shapes": fresh})["param_shapes"] is \
        pickles("mp_rank_00_model_states.pt", {"param_shapes": shapes})["param_shapes"]
    shapes[0]["layer7.weight"] = torch.Size([9, 9])  # changed in place, in the object pickled before
    assert written(2, {"param_shapes": shapes, "global_steps": 2})["param_shapes"][0]["layer7.weight"] == (9, 9)
    ordered = collections.OrderedDict(shapes[0])
    assert type(written(3, {"param_shapes": ordered, "global_steps": 3})["param_shapes"]) is collections.OrderedDict
    plain = dict(shapes[0])  # equal to the OrderedDict, of another type
    assert type(written(4, {"param_shapes": plain, "global_steps": 4})["param_shapes"]) is dict
