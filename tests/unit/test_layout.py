import pytest
import torch

from ftmem._state.plan import ALIGN, SnapshotPlan


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_replica_shards_cover_the_replicated_stream_exactly_once(count):
    tensors = [torch.zeros(n) for n in (7, 1000, 3, 0, 64)] + [torch.zeros(5, dtype=torch.uint8)]
    flags = [True, True, False, True, True, False]
    plans = [SnapshotPlan.for_tensors(tensors, flags, (i, count)) for i in range(count)]
    shards = [p.shard for p in plans]
    assert shards[0].start == 0 and shards[-1].end == shards[0].stream_nbytes
    assert all(a.end == b.start for a, b in zip(shards, shards[1:]))
    # Unique tensors keep whole slots of their own; the shard follows them.
    unique = [e for e in plans[0].entries if not e.replicated]
    assert [e.offset for e in unique] == [0, ALIGN]
    assert shards[0].offset == 2 * ALIGN
    assert plans[0].nbytes >= shards[0].offset + shards[0].nbytes


def test_without_replicated_tensors_there_is_no_shard():
    plan = SnapshotPlan.for_tensors([torch.zeros(3)])
    assert plan.shard is None and plan.nbytes == ALIGN
