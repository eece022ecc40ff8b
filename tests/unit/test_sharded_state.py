"""Joining a tensor that the DP replicas split (the distributed optimizer's dp_reshardable
buckets) from an old world's pieces, on megatron-core's own ShardedTensor: after a DP
change each new piece is copied from the old pieces that overlap it, by key and global
offset, and a piece they do not cover exactly once is refused, never filled with garbage.
(The end-to-end check, bitwise against Megatron's own load, is in test_megatron.py.)"""
import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from ftmem import LayoutMismatch
from ftmem_megatron.sharded_state import from_snapshot, pieces_by_key, to_snapshot

BUCKET = torch.arange(10, dtype=torch.float32) * 1.5  # one bucket's global 1-D tensor
KEY = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_0.exp_avg"


def piece(start: int, stop: int, data=None) -> ShardedTensor:
    """A bucket piece as megatron-core describes it (data: the bucket's values unless given)."""
    data = BUCKET[start:stop].clone() if data is None else data
    return ShardedTensor(KEY, data, data.dtype, (stop - start,), (len(BUCKET),), (start,), None,
                         flattened_range=None, allow_shape_mismatch=False, replica_id=(0, 0, 0))


def rank_state(ranges, empty=False) -> dict:
    """One rank's optimizer state: a bucket's pieces, each a dict, as dp_reshardable lists them."""
    return {"param_state": [{"exp_avg": piece(a, b, torch.empty(b - a) if empty else None)} for a, b in ranges]}


def snapshots(*old_ranks) -> list:
    return [to_snapshot(rank_state(ranges))[:2] for ranges in old_ranks]


def joined(template_ranges, old) -> list[torch.Tensor]:
    """The new rank's pieces, joined from the old ranks' snapshots (the first as its source)."""
    data, places = old[0]
    filled = from_snapshot(rank_state(template_ranges, empty=True), data, places, pieces_by_key(old))
    return [entry["exp_avg"] for entry in filled["param_state"]]


@pytest.mark.parametrize("old_ranks, new_ranges", [
    ([[(0, 3), (3, 5)], [(5, 8), (8, 10)]], [(5, 6), (6, 7), (7, 8)]),  # DP 2 -> 4: within old pieces, more of them
    ([[(0, 3), (3, 5)], [(5, 8), (8, 10)]], [(0, 4), (4, 10)]),  # DP 2 -> 1: across old ranks' pieces, fewer
    ([[(0, 2)], [(2, 4)], [(4, 7)], [(7, 10)]], [(1, 9)]),  # DP 4 -> 1, one piece across all four
], ids=["grown", "shrunk", "shrunk across four"])
def test_a_new_piece_is_copied_from_the_old_pieces_that_overlap_it(old_ranks, new_ranges):
    for (start, stop), tensor in zip(new_ranges, joined(new_ranges, snapshots(*old_ranks))):
        assert torch.equal(tensor, BUCKET[start:stop])


def test_a_piece_the_old_ranks_do_not_cover_is_refused():
    with pytest.raises(LayoutMismatch, match="cover 4 of its 6 elements"):
        joined([(4, 10)], snapshots([(0, 3), (3, 5)], [(5, 8)]))  # old [8, 10) absent


def test_old_pieces_that_overlap_are_refused_not_counted_twice():
    # [0, 5) and [3, 8) count 10 elements, as many as [0, 10) has, yet leave [8, 10) unwritten:
    # a count alone would accept them.
    with pytest.raises(LayoutMismatch, match="overlap"):
        joined([(0, 10)], snapshots([(0, 5)], [(3, 8)]))


def test_without_the_old_pieces_another_place_is_refused():
    data, places, _ = to_snapshot(rank_state([(0, 5)]))
    with pytest.raises(LayoutMismatch, match="does not fit this job"):
        from_snapshot(rank_state([(0, 4)], empty=True), data, places)


def test_a_snapshot_records_its_places_as_plain_tuples_and_one_an_older_ftmem_pickled_as_places_still_fits():
    """A save records thousands of places, which a tuple pickles and compares in C; a
    snapshot taken before holds Place objects, and restores as it did."""
    from ftmem_megatron.sharded_state import Place, local_tensors

    data, places, _ = to_snapshot(rank_state([(0, 5), (5, 10)]))
    assert all(type(place) is tuple for place in places.values())
    older = {path: Place(*place) for path, place in places.items()}
    for recorded in (places, older):
        template = rank_state([(0, 5), (5, 10)], empty=True)
        assert [t is not None for t in local_tensors(template, recorded)["param_state"][0].values()] == [True]
        filled = from_snapshot(template, data, recorded)
        assert all(torch.equal(e["exp_avg"], BUCKET[a:b]) for e, (a, b) in zip(filled["param_state"], [(0, 5), (5, 10)]))
        with pytest.raises(LayoutMismatch, match=r"saved as Place\(key="):
            from_snapshot(rank_state([(0, 4), (4, 10)], empty=True), data, recorded)


def gated_fc1(weight: torch.Tensor) -> dict:
    """A gated MLP's fc1 weight as megatron-core's sharded state dict holds it: a factory that
    saves its two halves as two pieces of one global tensor and joins them again at a load."""
    whole = ShardedTensor.from_rank_offsets("decoder.mlp.linear_fc1.weight", weight, replica_id=(0, 0, 0))
    return {"model": {"linear_fc1": {"weight": apply_swiglu_sharded_factory(whole, ())}}}


def test_a_factory_is_snapshotted_as_what_it_builds_and_joined_again_at_the_restore():
    weight = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    data, places, placed = to_snapshot(gated_fc1(weight))
    halves = ["model/linear_fc1/weight/0", "model/linear_fc1/weight/1"]
    assert sorted(places) == halves
    assert [places[p][2] for p in halves] == [(0, 0), (3, 0)]  # each half's global offset
    assert torch.equal(placed[halves[0]], weight[:3]) and torch.equal(placed[halves[1]], weight[3:])
    assert [id(t) for t in data["model"]["linear_fc1"]["weight"]] == [id(placed[p]) for p in halves]
    restored = from_snapshot(gated_fc1(torch.empty(6, 4)), data, places)
    assert torch.equal(restored["model"]["linear_fc1"]["weight"], weight)


def test_a_list_of_plain_values_of_another_length_is_refused_even_when_joining():
    old = snapshots([(0, 5)], [(5, 10)])
    data, places = old[0]
    data["steps"] = [1, 2]
    with pytest.raises(LayoutMismatch, match="another length"):
        from_snapshot({**rank_state([(0, 10)], empty=True), "steps": [1, 2, 3]}, data, places, pieces_by_key(old))


def _replicated_paths_at_each_save(rank: int, store_path: str, saves: list, out) -> None:
    import datetime

    import torch.distributed as dist

    from ftmem_megatron import sharded_state

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    gathers = []
    stock = sharded_state.replicated_paths
    sharded_state.replicated_paths = lambda *a: gathers.append(1) or stock(*a)
    paths = sharded_state.ReplicatedPaths()
    out.put((rank, [sorted(paths.of(places[rank], dist.group.WORLD)) for places in saves], len(gathers)))
    dist.destroy_process_group()


def test_the_replicated_paths_are_gathered_again_when_any_replica_s_places_change():
    """From one save to the next the places stay, and the replicas skip the gather; where one
    replica's change (and only its own), every replica gathers again, and none keeps paths
    that are no longer the same on all (seen failing where each replica looked at its own)."""
    import multiprocessing
    import tempfile

    def place(offset: int) -> tuple:  # as to_snapshot records it
        return ("w", (8,), (offset,), None, "torch.float32", (4,))

    same = {"a": place(0), "b": place(4)}
    moved = {"a": place(0), "b": place(0)}
    saves = [(same, same), (dict(same), dict(same)), (dict(same), moved), (dict(same), dict(moved))]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [context.Process(target=_replicated_paths_at_each_save, args=(r, f"{tmp}/store", saves, out))
                 for r in range(2)]
        for p in ranks:
            p.start()
        try:  # a rank that gathers alone waits out gloo's 20 s, then fails
            results = dict((rank, (paths, gathers)) for rank, paths, gathers in (out.get(timeout=60) for _ in ranks))
        finally:
            for p in ranks:
                p.join(30)
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank in range(2):
        paths, gathers = results[rank]
        assert paths == [["a", "b"], ["a", "b"], ["a"], ["a"]], rank
        assert gathers == 2, rank  # the first save's, and the one after rank 1's places moved
