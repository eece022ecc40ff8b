"""Pieces of the DeepSpeed adapter that need no running job."""
import torch

from ftmem_deepspeed.checkpoint_engine import STUB_MAGIC, apply_map_location, file_key, is_stub


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


def test_stub_files_are_told_apart_from_real_checkpoints(tmp_path):
    real, stub = tmp_path / "global_step3" / "real.pt", tmp_path / "global_step3" / "stub.pt"
    real.parent.mkdir()
    torch.save({"module": {}}, real)
    stub.write_bytes(STUB_MAGIC.encode() + b"...")
    assert not is_stub(str(real)) and is_stub(str(stub))
    assert file_key(str(real)) == "global_step3/real.pt"
