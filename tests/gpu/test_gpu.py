"""The engine's CUDA path, on a real GPU (`make test-gpu`; skipped without CUDA): CUDA
tensors saved into pinned shared memory and restored bitwise, a process SIGKILLed while
its device-to-host copies are in flight, and the side-stream copy running beside the
training stream's kernels, read off CUDA events on that stream, not inferred from sleeps."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from harness.common import REPO, logged, read_json
from ftmem._shm import jobs
from ftmem._engine.engine import SnapshotEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: run `make test-gpu` on a machine with an NVIDIA GPU"),
]


def engine(shm_dir: str, job: str) -> SnapshotEngine:
    return SnapshotEngine({"shm_dir": shm_dir, "job_id": job, "ranks_per_node": 1}, rank=0, world_size=1)


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randn(512, 384, device="cuda", generator=g)
    return {
        "fp32": torch.randn(1000, device="cuda", generator=g),
        "bf16": torch.randn(257, 33, device="cuda", generator=g).to(torch.bfloat16),
        "transposed": weights.t(),  # non-contiguous views of one storage
        "strided": weights[::3, 5:200],
        "cpu": torch.arange(10, dtype=torch.int64),
        "step": 7,
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def assert_bitwise(got: dict, want: dict, device: str) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        if not isinstance(w, torch.Tensor):
            assert got[key] == w, key
            continue
        g = got[key]
        assert (g.dtype, g.shape, g.device.type) == (w.dtype, w.shape, device), key
        assert torch.equal(_bytes(g), _bytes(w)), key


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_tensors_are_restored_bitwise(device, shm_dir):
    """fp32, bf16 and non-contiguous CUDA views go to pinned shared memory on the side
    stream and come back bitwise, to the CPU and to the device."""
    state = cuda_state()
    e = engine(shm_dir, f"gpu-roundtrip-{device}")
    try:
        e.save(state, 1).wait_protected()
        restored = e.restore(device=device)
        assert restored.version == 1
        assert_bitwise(restored.state, state, device)
    finally:
        e.close(job_finished=True)
        jobs.clean(shm_dir, f"gpu-roundtrip-{device}")


def test_a_kill_while_device_copies_are_in_flight_leaves_the_older_version(shm_dir):
    """Version 1 is committed; the process is SIGKILLed halfway through launching version
    2's device-to-host copies. A new process restores version 1, bitwise."""
    job = "gpu-kill-mid-copy"
    script = textwrap.dedent(f"""
        import torch
        from tests.gpu.test_gpu import cuda_state, engine
        e = engine({shm_dir!r}, {job!r})
        state = cuda_state()
        e.save(state, 1).wait_protected()
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.add_(1)  # version 2 differs from version 1
        e.save(state, 2).wait_protected()
        print("not killed")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),  # test_gpu's conftest
               FTMEM_TEST_HOOK="mid_copy:kill:rank=0:version=2")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == -9, out.stdout + out.stderr
    e = engine(shm_dir, job)
    try:
        restored = e.restore(device="cuda")
        assert restored.version == 1
        assert_bitwise(restored.state, cuda_state(), "cuda")
    finally:
        e.close(job_finished=True)
        jobs.clean(shm_dir, job)


def test_the_snapshot_copy_runs_beside_the_training_stream_s_kernels(shm_dir):
    """A save of 1 GiB of CUDA tensors, then matrix products on the training (default)
    stream. On the CUDA timeline (events on that stream): the snapshot is copied while
    the products still run, and the products take no longer than without the save.
    (torch.profiler's CUPTI tracing was tried for this: under it the products do stall
    behind the copies, which they do not without it.)"""
    job = "gpu-overlap"
    state = {f"w{i}": torch.randn(32 << 20, device="cuda") for i in range(8)}  # 1 GiB
    a = torch.randn(4096, 4096, device="cuda")

    def products(save=None):
        nonlocal a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        handle = save() if save else None
        for _ in range(100):
            a = (a @ a) * 1e-3
        end.record()
        if handle:
            handle.wait_reusable()
            copied_while_running = not end.query()
        torch.cuda.synchronize()
        return start.elapsed_time(end), (copied_while_running if handle else None), handle

    e = engine(shm_dir, job)
    try:
        # Allocate and pin both slots first: the first copy into a just-pinned slot holds up
        # the training thread's kernel launches (docs/limits.md).
        for version in range(2):
            e.save(state, version).wait_protected()
        products()  # cuBLAS's kernels load lazily (over 100 ms)
        alone_ms, _, _ = products()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.save(state, 2).wait_reusable()
        copy_ms = (time.perf_counter() - t0) * 1e3
        e.wait_protected()
        with_save_ms, copied_while_running, handle = products(lambda: e.save(state, 3))
        handle.wait_protected()
        assert copied_while_running, (alone_ms, copy_ms, with_save_ms)
        assert with_save_ms < alone_ms + 0.5 * copy_ms, (alone_ms, copy_ms, with_save_ms)
    finally:
        e.close(job_finished=True)
        jobs.clean(shm_dir, job)


@pytest.mark.parametrize("config", ["zero1.json", "zero3.json"])
def test_deepspeed_on_the_gpu_resumes_bitwise_after_a_crash(config, shm_dir, tmp_path):
    """One rank on the GPU (NCCL), examples/deepspeed/train_gpt.py saving every step:
    SIGKILLed after step 3's snapshot, relaunched, it resumes from memory, and its losses
    and final weights equal, bitwise, the same script's uninterrupted run on DeepSpeed's
    default checkpoint engine."""
    pytest.importorskip("deepspeed")
    from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, reference
    from harness.toy import assert_same_training

    from ftmem import restored_from_memory

    env = {"DS_ACCELERATOR": "cuda", "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    ref = reference(config, 1, str(tmp_path / "reference"), env)
    job = DSJob(config, 1, shm_dir, str(tmp_path / "run"), ftmem={"ec": {"k": 1, "m": 0}}, env=env)
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: "stopped after" in run.log(0), TIMEOUT, f"step {STOP}")
        run.kill_all()
    assert job.run("--load") == [0], job.log(0)[-5000:]
    assert "checkpoint engine FtmemCheckpointEngine" in job.log(0)
    assert logged(restored_from_memory(STOP + 1, 0, f"tag global_step{STOP + 1}"), job.log(0)), job.log(0)[-3000:]
    assert_same_training(job.out, ref, 1, ITERS)


@pytest.mark.parametrize("config", ["zero1.json", "zero3.json"])
def test_deepspeed_ranks_sharing_the_gpu_resume_bitwise_after_losing_a_node(config, shm_dir, tmp_path):
    """Three ranks on the one GPU, each a virtual node (k=2 m=1), over gloo (NCCL wants a
    device per rank; gloo reduces and gathers CUDA tensors). SIGKILLed after step 3's
    snapshot, a node's shared memory lost, relaunched: every rank resumes from memory
    (the lost node's rebuilt), and losses and final weights equal, bitwise, the same
    script's uninterrupted run on DeepSpeed's default engine, on the same GPU and backend."""
    pytest.importorskip("deepspeed")
    from harness.ds_jobs import ITERS, STOP, TIMEOUT, DSJob, reference
    from harness.toy import assert_same_training

    from ftmem import restored_from_memory

    world, lost = 3, 1
    # Every rank on cuda:0: DeepSpeed takes the device from LOCAL_RANK.
    env = {"DS_ACCELERATOR": "cuda", "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    gloo = ("--dist-backend", "gloo")
    ref = reference(config, world, str(tmp_path / "reference"), env, extra=gloo)
    job = DSJob(config, world, shm_dir, str(tmp_path / "run"), env=env)
    with job.start(*gloo, "--stop-after", str(STOP)) as run:
        run.wait_for(lambda: all("stopped after" in run.log(r) for r in range(world)), TIMEOUT, f"step {STOP}")
        run.kill_all()
    jobs.lose_node(shm_dir, job.job, lost)
    assert job.run(*gloo, "--load") == [0] * world, job.log(0)[-5000:]
    for rank in range(world):
        assert "checkpoint engine FtmemCheckpointEngine, device cuda:0, backend gloo" in job.log(rank)
        assert logged(restored_from_memory(STOP + 1, rank, f"tag global_step{STOP + 1}", rebuilt=rank == lost),
                      job.log(rank)), job.log(rank)[-3000:]
    assert_same_training(job.out, ref, world, ITERS)


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_megatron_core_on_the_gpu_resumes_bitwise_after_a_crash(precision, shm_dir, tmp_path):
    """One rank on the GPU (NCCL, TP 1), the megatron-core driver without its CPU support, an
    in-memory save every iteration: SIGKILLed after iteration 3's snapshot, relaunched
    with the same command, it restores from memory, and its losses and final parameters
    and optimizer state equal, bitwise, an uninterrupted run without ftmem. In fp32, and
    in bf16 with fp32 main parameters (megatron-core's mixed-precision optimizer)."""
    pytest.importorskip("megatron.core")
    from harness.megatron_jobs import ITERS, STOP, TIMEOUT, MegatronJob, reference

    from ftmem import restored_from_memory

    parallel = ["--tensor-model-parallel-size", "1", *precision]
    ref = reference(1, parallel, str(tmp_path / "reference"))
    job = MegatronJob(1, parallel, ["--ftmem-ranks-per-node", "1", "--ftmem-ec-k", "1", "--ftmem-ec-m", "0"],
                      shm_dir, str(tmp_path / "run"))
    with job.start("--stop-after", str(STOP)) as run:
        run.wait_for(lambda: "stopped after" in run.log(0), TIMEOUT, f"iteration {STOP}")
        run.kill_all()
    assert "starting at iteration 0, on CUDA" in job.log(0), job.log(0)[-3000:]
    assert f"{'bf16' if precision else 'fp32'} parameters, starting at iteration 0" in job.log(0)
    job.run(str(tmp_path / "resumed.json"))
    assert logged(restored_from_memory(STOP, 0), job.log(0)), job.log(0)[-3000:]
    resumed = read_json(str(tmp_path / "resumed.json"))
    assert resumed["losses"] == {str(i): ref["losses"][str(i)] for i in range(STOP + 1, ITERS + 1)}
    assert resumed["digests"] == ref["digests"]
