"""The pure helpers of ``ftmem bench scale`` (the benchmark itself needs root and minutes: it is
run by hand, docs/benchmarks.md)."""
import json

import torch

from benchmarks.bench_scale import compare
from benchmarks.cluster import tbf


def test_the_token_bucket_holds_the_rate_and_a_burst_of_2_ms_at_least_32_kib():
    assert tbf(200) == ["tbf", "rate", "200mbit", "burst", "50000", "latency", "50ms"]
    assert tbf(10)[4] == str(32 << 10)


def _run(root, name, losses, weight):
    (root / name).mkdir()
    with open(root / name / "rank0.losses.jsonl", "w") as f:
        for it, loss in losses.items():
            f.write(json.dumps({"it": it, "loss": loss.hex()}) + "\n")
    torch.save({"w": weight}, root / name / "rank0.final.pt")


def test_compare_is_bitwise_and_counts_only_the_steps_after_the_resume(tmp_path):
    w = torch.tensor([1.0, 2.0])
    _run(tmp_path, "reference", {0: 1.0, 1: 0.5, 2: 0.25}, w)
    _run(tmp_path, "same", {1: 0.5, 2: 0.25}, w.clone())
    assert compare(str(tmp_path), "same", "reference", 1, 1) == []
    _run(tmp_path, "off", {1: 0.5, 2: 0.25 + 2 ** -54}, torch.nextafter(w, torch.tensor(3.0)))
    assert compare(str(tmp_path), "off", "reference", 1, 1) == [
        "rank 0 step 2: loss 0.25000000000000006 vs 0.25", "rank 0: final w differs"]
