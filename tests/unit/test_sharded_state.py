"""Joining a tensor that the DP replicas split (the distributed optimizer's dp_reshardable
buckets) from an old world's pieces, on megatron-core's own ShardedTensor: after a DP
change each new piece is copied from the old pieces that overlap it, by key and global
offset, and a piece they do not cover exactly once is refused, never filled with garbage.
(The end-to-end check, bitwise against Megatron's own load, is in test_megatron.py.)"""
import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

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
    return [to_snapshot(rank_state(ranges)) for ranges in old_ranks]


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
    data, places = to_snapshot(rank_state([(0, 5)]))
    with pytest.raises(LayoutMismatch, match="does not fit this job"):
        from_snapshot(rank_state([(0, 4)], empty=True), data, places)


def test_a_list_of_plain_values_of_another_length_is_refused_even_when_joining():
    old = snapshots([(0, 5)], [(5, 10)])
    data, places = old[0]
    data["steps"] = [1, 2]
    with pytest.raises(LayoutMismatch, match="another length"):
        from_snapshot({**rank_state([(0, 10)], empty=True), "steps": [1, 2, 3]}, data, places, pieces_by_key(old))
