"""``ftmem bench peers`` (or ``python -m benchmarks.bench_peers``): one GPT's model and AdamW
state through what its users would otherwise checkpoint with, side by side with ftmem:
``torch.save`` to ``/dev/shm`` (blocking), ``torch.distributed.checkpoint.async_save`` with
its strongest stager (``DefaultStager``: shared memory, staging in the background, pinned
memory and non-blocking copies where CUDA is present) into a directory in ``/dev/shm``, and
ftmem's in-memory save (one rank, one node). For each: the save call, the iteration time
with a save after every iteration against none, and the restore into a model and optimizer
built anew, each as a ratio to ftmem's.

The saves follow iterations in a steady loop; every wait a save causes is billed to the
block of iterations that caused it: torch.save blocks; DCP's next optimizer step waits for
its staging and its next save for the last one's write, and a block ends when its last write
is done; ftmem's next optimizer step waits for its copy, and a block ends when its last save
is protected. Blocks with and without saves take turns. Each restore runs in a process
started anew (so none reuses memory another paged in), is timed from before the first
checkpointing call to the model and optimizer loaded (ftmem's engine start included), and is
checked bitwise against the state saved last. The model runs on CUDA where present, else on
the CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from examples.deepspeed.gpt import GPT, GPTConfig, batch
from ftmem._shm import jobs

PEERS = ("torch_save", "dcp_async", "ftmem")
MODEL = {"hidden": 768, "layers": 8, "seq_len": 64}  # ~57M parameters
TINY = {"hidden": 64, "layers": 2, "seq_len": 32}
MICRO_BATCH = 4
FIGURES = "PEERS-FIGURES "


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _build(shape: dict):
    model = GPT(GPTConfig(vocab_size=4096, dropout=0.0, heads=4, **shape)).to(_device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, optimizer, cfg: GPTConfig, step: int, before_the_step: Callable[[], None]) -> None:
    x, y = batch(cfg, step, 0, MICRO_BATCH)
    model(x.to(_device()), y.to(_device())).backward()
    before_the_step()  # a snapshot in flight must be done reading the state
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _digest(model, optimizer) -> str:
    """A digest of the model's and optimizer's tensors, for the bitwise check of a restore."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ftmem.adapter import tensors

    h = hashlib.sha256()
    for t in tensors(get_state_dict(model, optimizer)):
        h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Peer:
    """One way to checkpoint: ``save`` starts one (returning when the training may go on, but
    for what ``before_the_step`` and ``drain`` still wait for)."""

    def __init__(self, shm_dir: str, job: str):
        self.shm_dir, self.job = shm_dir, job

    def save(self, model, optimizer, step: int) -> None:
        raise NotImplementedError

    def before_the_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class _TorchSave(_Peer):
    def save(self, model, optimizer, step: int) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(self.shm_dir, f"{self.job}.pt"))


class _DcpAsync(_Peer):
    def __init__(self, *args):
        super().__init__(*args)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                    use_async_staging=True, use_non_blocking_copy=cuda))
        self._last = None

    def save(self, model, optimizer, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.drain()  # one write at a time: the last one ends before the next starts
        model_state, optimizer_state = get_state_dict(model, optimizer)
        self._last = dcp.async_save({"model": model_state, "optimizer": optimizer_state},
                                    checkpoint_id=os.path.join(self.shm_dir, f"{self.job}-dcp"),
                                    async_stager=self._stager, no_dist=True)

    def before_the_step(self) -> None:
        if self._last is not None:
            self._last.staging_completion.result()

    def drain(self) -> None:
        if self._last is not None:
            self._last.upload_completion.result()
            self._last = None

    def close(self) -> None:
        self.drain()
        self._stager.close()


class _Ftmem(_Peer):
    def __init__(self, *args):
        super().__init__(*args)
        from ftmem import SnapshotEngine

        self.engine = SnapshotEngine(_ftmem_config(self.shm_dir, self.job), rank=0, world_size=1)
        self._last = None

    def save(self, model, optimizer, step: int) -> None:
        self._last = self.engine.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)

    def before_the_step(self) -> None:
        if self._last is not None:
            self._last.wait_reusable()

    def drain(self) -> None:
        self.engine.wait_protected()

    def close(self) -> None:
        self.engine.close(job_finished=False)  # the snapshots stay for the restore, as after a crash


def _ftmem_config(shm_dir: str, job: str) -> dict:
    return {"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}


PEER_CLASSES = {"torch_save": _TorchSave, "dcp_async": _DcpAsync, "ftmem": _Ftmem}


def saves(shape: dict, blocks: int, block_steps: int, shm_dir: str, job: str) -> dict:
    """The save calls and the iteration times, each peer with a model of its own; every
    peer's last save is of the same state, whose digest the restores check."""
    figures = {}
    cfg = GPTConfig(vocab_size=4096, dropout=0.0, heads=4, **shape)
    for name in PEERS:
        model, optimizer = _build(shape)
        peer = PEER_CLASSES[name](shm_dir, job)
        calls, per_step = [], {"save": [], "nosave": []}
        step = 0
        for block in range(1 + blocks):  # block 0 warms up (first allocations, page mappings)
            for kind in ("nosave", "save"):
                t0 = time.perf_counter()
                for _ in range(block_steps):
                    _step(model, optimizer, cfg, step, peer.before_the_step)
                    if kind == "save":
                        c0 = time.perf_counter()
                        peer.save(model, optimizer, step)
                        calls.append(time.perf_counter() - c0)
                    step += 1
                if kind == "save":
                    peer.drain()
                if block:
                    per_step[kind].append((time.perf_counter() - t0) / block_steps)
        figures[f"{name}_call_s"] = statistics.median(calls[block_steps:])
        figures[f"{name}_step_s"] = statistics.median(per_step["nosave"])
        figures[f"{name}_cycle_s"] = statistics.median(per_step["save"])
        figures[f"{name}_digest"] = _digest(model, optimizer)
        figures["params"] = sum(p.numel() for p in model.parameters())
        peer.close()
        del model, optimizer
    return figures


def restore(name: str, shape: dict, shm_dir: str, job: str) -> dict:
    """One peer's restore into a model and optimizer built anew (in this process, started for it)."""
    model, optimizer = _build(shape)
    t0 = time.perf_counter()
    if name == "torch_save":
        state = torch.load(os.path.join(shm_dir, f"{job}.pt"), map_location=_device(), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    elif name == "dcp_async":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)  # the optimizer's state, made to load into
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=os.path.join(shm_dir, f"{job}-dcp"), no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        from ftmem import SnapshotEngine

        engine = SnapshotEngine(_ftmem_config(shm_dir, job), rank=0, world_size=1)
        # Into the model's own tensors (state_dict() views them); Adam's moments, which a new
        # optimizer does not have yet, into new memory, as torch.load's.
        restored = engine.restore(device=_device(), into=lambda saved: {"model": model.state_dict()})
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
    took = time.perf_counter() - t0
    if name == "ftmem":
        engine.close(job_finished=True)
    return {"restore_s": took, "digest": _digest(model, optimizer)}


def bench_peers(shape: dict = MODEL, blocks: int = 3, block_steps: int = 4, shm_dir: str = "/dev/shm") -> dict:
    job = f"bench-peers-{os.getpid()}"
    argv = ["--hidden", str(shape["hidden"]), "--layers", str(shape["layers"]), "--seq-len", str(shape["seq_len"]),
            "--shm-dir", shm_dir, "--job", job]
    try:
        f = _phase(["--phase", "saves", "--blocks", str(blocks), "--block-steps", str(block_steps), *argv])
        for name in PEERS:
            got = _phase(["--phase", f"restore-{name}", *argv])
            if got["digest"] != f[f"{name}_digest"]:
                raise RuntimeError(f"{name}'s restore is not the state it saved last (digests differ)")
            f[f"{name}_restore_s"] = got["restore_s"]
    finally:
        jobs.clean(shm_dir, job)
        for leftover in (f"{job}.pt", f"{job}-dcp"):
            path = os.path.join(shm_dir, leftover)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (
                os.path.exists(path) and os.unlink(path))
    result = {"params_n": f["params"]}
    for name in PEERS:
        cost = f[f"{name}_cycle_s"] - f[f"{name}_step_s"]
        result.update({f"{name}_call_s": f[f"{name}_call_s"], f"{name}_step_s": f[f"{name}_step_s"],
                       f"{name}_cycle_s": f[f"{name}_cycle_s"], f"{name}_overhead_x": f[f"{name}_cycle_s"] /
                       f[f"{name}_step_s"], f"{name}_cycle_cost_s": cost, f"{name}_restore_s": f[f"{name}_restore_s"]})
    for name in PEERS[:-1]:
        result.update({f"{name}_call_vs_ftmem_x": result[f"{name}_call_s"] / result["ftmem_call_s"],
                       f"{name}_restore_vs_ftmem_x": result[f"{name}_restore_s"] / result["ftmem_restore_s"]})
    print(f"GPT of {f['params'] / 1e6:.1f}M parameters with AdamW on {_device().type} ({shape}, micro batch "
          f"{MICRO_BATCH}); a save after every iteration; each restore in a process started anew, checked bitwise:")
    print(f"  {'':12s} {'save call':>12s} {'iteration':>12s} {'with saves':>12s} {'overhead':>9s} "
          f"{'restore':>10s}   (ratios: to ftmem's)")
    for name in PEERS:
        call_x = "" if name == "ftmem" else f" ({result[f'{name}_call_vs_ftmem_x']:.1f}x)"
        restore_x = "" if name == "ftmem" else f" ({result[f'{name}_restore_vs_ftmem_x']:.2f}x)"
        print(f"  {name:12s} {result[f'{name}_call_s'] * 1e3:9.2f} ms{call_x:9s} "
              f"{result[f'{name}_step_s'] * 1e3:9.1f} ms {result[f'{name}_cycle_s'] * 1e3:9.1f} ms "
              f"{(result[f'{name}_overhead_x'] - 1) * 100:+8.1f}% {result[f'{name}_restore_s'] * 1e3:8.1f} ms"
              f"{restore_x}")
    print("RESULT " + " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.6g}" for k, v in result.items()))
    return result


def _phase(argv: list) -> dict:
    """Run one phase in a process started anew; its figures."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_peers", *argv], capture_output=True, text=True,
                         timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(FIGURES)), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"the peers benchmark's phase {argv[1]} failed (exit {out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len(FIGURES):])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="ftmem bench peers", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shm-dir", default="/dev/shm", help="shared-memory directory (default /dev/shm)")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny GPT ({TINY}), 2 blocks of 2 iterations")
    parser.add_argument("--hidden", type=int, default=MODEL["hidden"])
    parser.add_argument("--layers", type=int, default=MODEL["layers"])
    parser.add_argument("--seq-len", type=int, default=MODEL["seq_len"])
    parser.add_argument("--blocks", type=int, default=3, help="timed blocks of each kind (default 3)")
    parser.add_argument("--block-steps", type=int, default=4, help="iterations per block (default 4)")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else {"hidden": args.hidden, "layers": args.layers, "seq_len": args.seq_len}
    if args.phase is None:
        blocks, steps = (2, 2) if args.tiny else (args.blocks, args.block_steps)
        bench_peers(shape, blocks, steps, args.shm_dir)
        return 0
    if args.phase == "saves":
        figures = saves(shape, args.blocks, args.block_steps, args.shm_dir, args.job)
    else:
        figures = restore(args.phase.removeprefix("restore-"), shape, args.shm_dir, args.job)
    print(FIGURES + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
