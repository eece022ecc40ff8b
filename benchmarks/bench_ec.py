"""``ftmem bench ec``: erasure-coding throughput per core against a memory copy of
the same bytes, and, for a job of three virtual nodes, the bytes each rank copies
with DP sharding, the time from "copy done" to "protected", and the memory
overhead it holds — all in one run.

Throughputs count the k data pieces' bytes (what a memory copy of the data moves).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from ftmem._shm import jobs
from ftmem.cli import Parser, positive_int, shm_dir_arg
from ftmem._ec.codec import Codec
from ftmem import SnapshotEngine
from ftmem._shm.slots import DATA, PARITY

from examples.launch import report_figures, run_for_figures

PIECE_MB = 64
REPEAT = 3


def _best_gbps(fn, nbytes: int) -> float:
    fn()  # warm: page faults of the outputs
    times = []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def codec_throughput(k: int, m: int, piece: int) -> tuple[float, float]:
    """(encode, rebuild of m lost data pieces) in GB/s of data, on this thread."""
    rng = np.random.default_rng(0)
    codec = Codec(k, m)
    data = [rng.integers(0, 256, piece, dtype=np.uint8) for _ in range(k)]
    parity = [np.empty(piece, np.uint8) for _ in range(m)]
    encode = _best_gbps(lambda: codec.encode(data, parity), k * piece)
    available = {i: data[i] for i in range(m, k)} | {k + q: parity[q] for q in range(m)}
    lost = {i: np.empty(piece, np.uint8) for i in range(m)}
    rebuild = _best_gbps(lambda: codec.rebuild(available, lost), k * piece)
    assert all(np.array_equal(lost[i], data[i]) for i in lost), "rebuilt data differs"
    return encode, rebuild


def memcpy_throughput(nbytes: int) -> float:
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return _best_gbps(lambda: np.copyto(dst, src), nbytes)


def protect_worker(argv=None) -> None:
    """One rank of the protect benchmark (run by bench_ec through run_for_figures)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, required=True)
    parser.add_argument("--shm-dir", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    engine = SnapshotEngine({"shm_dir": args.shm_dir, "ranks_per_node": 1, "ec": {"k": 2, "m": 1}})
    # 3/4 of --mb unique to each rank and 3/4 replicated on all three (same seed): with DP
    # sharding each rank copies 3/4 + 1/4 = --mb MiB of the 1.5x --mb it holds.
    quarter_floats = args.mb << 16
    torch.manual_seed(1 + engine.rank)
    unique = [torch.randn(quarter_floats) for _ in range(3)]
    torch.manual_seed(0)
    replicated = [torch.randn(quarter_floats) for _ in range(3)]
    state = {"unique": unique, "replicated": replicated}
    shared = {id(t) for t in replicated}
    protect_s = []
    for version in range(1 + REPEAT):  # version 0 allocates and maps the slots
        handle = engine.save(state, version, replicated=lambda t: id(t) in shared)
        handle.wait_reusable()
        t0 = time.perf_counter()
        handle.wait_protected()
        protect_s.append(time.perf_counter() - t0)
    store = engine.store
    data = store.read_commit(REPEAT).plan.nbytes
    held = sum(t.numel() * t.element_size() for t in unique + replicated)
    parity = store.capacity(PARITY)
    meta = sum(os.path.getsize(os.path.join(store.node_dir, f)) for f in os.listdir(store.node_dir)
               if f.startswith(f"rank{engine.rank:05d}.v") and not f.endswith((DATA, PARITY)))
    if engine.rank == 0:
        report_figures({"protect_s": statistics.median(protect_s[1:]), "data": data, "parity": parity, "meta": meta,
                        "held": held})
    engine.close(job_finished=True)
    dist.destroy_process_group()


def protect_time(mb_per_node: int, shm_dir: str) -> dict:
    """Three virtual nodes, one rank each, one DP group, k=2, m=1: copy-done-to-protected time."""
    job = f"bench-ec-{os.getpid()}"
    try:
        with tempfile.TemporaryDirectory(prefix="ftmem-bench-ec-") as logs:
            return run_for_figures("benchmarks.bench_ec", ["--mb", str(mb_per_node), "--shm-dir", shm_dir], 3, job,
                                   logs, "protect", 1800)
    finally:
        jobs.clean(shm_dir, job)


def bench_ec(mb_per_node: int = 1024, piece_mb: int = PIECE_MB, shm_dir: str = "/dev/shm") -> dict:
    piece = piece_mb << 20
    xor_enc, xor_reb = codec_throughput(4, 1, piece)
    rs_enc, rs_reb = codec_throughput(4, 2, piece)
    memcpy = memcpy_throughput(4 * piece)
    print(f"one core, {4 * piece_mb} MiB of data per call:")
    print(f"  memory copy          {memcpy:6.2f} GB/s")
    print(f"  XOR (4+1)   encode   {xor_enc:6.2f} GB/s ({xor_enc / memcpy:.2f}x copy, target >= 0.8x)   "
          f"rebuild {xor_reb:6.2f} GB/s")
    print(f"  RS  (4+2)   encode   {rs_enc:6.2f} GB/s ({rs_enc / memcpy:.2f}x copy, target >= 0.5x)   "
          f"rebuild {rs_reb:6.2f} GB/s")
    p = protect_time(mb_per_node, shm_dir)
    overhead = (p["parity"] + p["meta"]) / p["data"]
    print(f"3 virtual nodes, one DP group: with DP sharding each rank copies {p['data'] / 2**20:.0f} MiB of the "
          f"{p['held'] / 2**20:.0f} MiB it holds ({p['held'] / p['data']:.2f}x fewer bytes)")
    print(f"k=2 m=1 over them: copy done -> protected in {p['protect_s']:.3f} s; held parity + metadata = "
          f"{overhead:.4f}x the data (m/k = 0.5, target within 1%)")
    result = {"encode_gbps": rs_enc, "rebuild_gbps": rs_reb, "xor_encode_gbps": xor_enc, "xor_rebuild_gbps": xor_reb,
              "memcpy_gbps": memcpy, "xor_vs_memcpy_x": xor_enc / memcpy, "rs_vs_memcpy_x": rs_enc / memcpy,
              "protect_s": p["protect_s"], "overhead_x": overhead, "dp_copied_mb": p["data"] / 2**20,
              "dp_held_mb": p["held"] / 2**20, "dp_shard_saving_x": p["held"] / p["data"]}
    print("RESULT " + " ".join(f"{k}={v:.6g}" for k, v in result.items()))
    return result


def main(argv=None) -> int:
    """``ftmem bench ec``. (Run as ``python -m benchmarks.bench_ec`` this module is one
    rank of the protect benchmark, started by :func:`protect_time`.)"""
    parser = Parser(prog="ftmem bench ec", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mb", type=positive_int, default=None, help="state size in MiB per node (default 1024)")
    parser.add_argument("--piece-mb", type=positive_int, default=PIECE_MB,
                        help=f"MiB per piece in the throughput runs (default {PIECE_MB})")
    parser.add_argument("--shm-dir", type=shm_dir_arg, default="/dev/shm",
                        help="shared-memory directory (default /dev/shm)")
    args = parser.parse_args(argv)
    bench_ec(mb_per_node=args.mb or 1024, piece_mb=args.piece_mb, shm_dir=args.shm_dir)
    return 0


if __name__ == "__main__":
    protect_worker()
