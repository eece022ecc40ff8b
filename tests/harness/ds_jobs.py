"""Jobs of examples.deepspeed.train_gpt with and without ftmem, the uninterrupted
reference runs the DeepSpeed tests compare with, and stock DeepSpeed loading what ftmem wrote."""
import json
import os
import textwrap

from .common import StockFailed, job_id, run_once
from .ranks import REPO, LocalJob

ITERS, STOP, TIMEOUT = 6, 3, 300
CONFIGS = os.path.join(REPO, "configs")
ENV = {"DS_ACCELERATOR": "cpu"}
# A run without ftmem: DeepSpeed's default engine, and not even ftmem_guard's torch hook loaded.
STOCK_ENV = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


class DSJob:
    """One job identity of the trainer: with ftmem (``ftmem`` merged into the config's
    section), or ``stock``: the same training with DeepSpeed's default checkpoint engine
    saving every step (``--checkpoint-engine default``: no "ftmem" section, no ftmem module)."""

    def __init__(self, config, world, shm_dir, root, ftmem=None, stock=False, env=None):
        self.world, self.shm_dir, self.job = world, shm_dir, job_id()
        self.out, self.save_dir = os.path.join(root, "out"), os.path.join(root, "ckpt")
        os.makedirs(self.out, exist_ok=True)
        self.env = {**(STOCK_ENV if stock else ENV), **(env or {})}
        engine = (["--checkpoint-engine", "default"] if stock
                  else ["--ftmem", json.dumps({"shm_dir": shm_dir, **(ftmem or {})})])
        self.args = ["--deepspeed-config", os.path.join(CONFIGS, config), "--save-dir", self.save_dir,
                     "--iters", str(ITERS), "--out", self.out, *engine]

    def start(self, *extra, rank_env=None, launcher=LocalJob) -> LocalJob:
        """The job's ranks, started by ``launcher`` (a LocalJob, or one of its subclasses)."""
        return launcher("examples.deepspeed.train_gpt", self.args + list(extra), self.world, self.job, self.out,
                        env=self.env, rank_env=rank_env)

    def run(self, *extra, launcher=LocalJob) -> list[int]:
        return self.start(*extra, launcher=launcher).wait(TIMEOUT)

    def log(self, rank) -> str:
        return LocalJob.read_log(self.out, rank)


def reference(config, world, root, env=None, extra=()):
    """An uninterrupted run without ftmem (DeepSpeed's default engine saving every
    step), with the trainer's flags ``extra``; the folder of its per-step losses and
    final weights. Run once per session for the same arguments (``root`` is the first's)."""
    return run_once(("deepspeed", config, world, tuple(sorted((env or {}).items())), tuple(extra)),
                    lambda: _reference(config, world, root, env, extra))


def _reference(config, world, root, env, extra):
    job = DSJob(config, world, None, root, stock=True, env=env)
    if job.run(*extra) != [0] * world:
        raise StockFailed(f"DeepSpeed's default engine ({config}, {world} ranks)", job.log(0))
    for rank in range(world):
        assert "checkpoint engine TorchCheckpointEngine" in job.log(rank), job.log(rank)[-3000:]
        assert f"rank {rank}: ftmem modules loaded: none" in job.log(rank), job.log(rank)[-3000:]
    iters = int(extra[list(extra).index("--iters") + 1]) if "--iters" in extra else ITERS
    with open(os.path.join(job.save_dir, "latest")) as f:
        assert f.read() == f"global_step{iters}"  # the default engine saved every step
    return job.out



def stock_script(root, name: str, config, env: dict, world: int, job: str, iters: int, *extra) -> LocalJob:
    """tests/harness/stock_deepspeed_train.py (which never mentions ftmem) with ``config`` (a
    list: each rank's own), in ``root/name``; saves into ``root/name/ckpt``."""
    root.mkdir(parents=True, exist_ok=True)
    configs = config if isinstance(config, list) else [config] * world
    for rank, each in enumerate(configs):
        (root / f"{name}.{rank}.json").write_text(json.dumps(each))
    out = root / name
    out.mkdir(exist_ok=True)
    return LocalJob("tests.harness.stock_deepspeed_train", ["--config", str(root / f"{name}.{{rank}}.json"),
                                                            "--save-dir", str(out / "ckpt"), "--iters", str(iters),
                                                            "--out", str(out), *extra], world, job, str(out), env=env)


def latest_tag(directory: str) -> str:
    """The tag DeepSpeed's ``latest`` in ``directory`` names."""
    with open(os.path.join(directory, "latest")) as f:
        return f.read()


def rank0_copy_held(hooks) -> dict:
    """Ranks' environments that hold rank 0's copy of version 3 until the test lets it go
    (the rest of the job waits for it); ``hooks`` is the test hooks' folder."""
    return {0: {"FTMEM_TEST_HOOK": "mid_copy:hold:rank=0:version=3", "FTMEM_TEST_HOOK_DIR": str(hooks)}}


def config_pair(name: str, shm_dir: str, **ftmem) -> tuple[dict, dict]:
    """A config of configs/ with ftmem (its "ftmem" section updated), and without."""
    with open(os.path.join(CONFIGS, name)) as f:
        config = json.load(f)
    config["ftmem"].update(shm_dir=shm_dir, **ftmem)
    return config, {k: v for k, v in config.items() if k not in ("checkpoint", "ftmem")}


def stock_deepspeed_load(config: str, checkpoint_dir: str, logs: str) -> list[str]:
    """Load ``checkpoint_dir`` with stock DeepSpeed (its default engine, 3 ranks, no ftmem
    module loaded); each rank's line ``STOCK LOADED <path> <global_steps> <next_step>``."""
    stock_config = json.load(open(os.path.join(CONFIGS, config)))
    del stock_config["checkpoint"], stock_config["ftmem"]
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, "stock_load.py"), "w") as f:
        f.write(textwrap.dedent(f"""
        import sys
        import torch
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        import deepspeed
        from examples.deepspeed.gpt import GPT, GPTConfig
        from examples.process_end import end_process
        deepspeed.init_distributed(dist_backend="gloo")
        model = GPT(GPTConfig())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={stock_config!r})
        path, client_state = engine.load_checkpoint({checkpoint_dir!r})
        assert not [m for m in sys.modules if m.startswith("ftmem")], [m for m in sys.modules if "ftmem" in m]
        print("STOCK LOADED", path, engine.global_steps, client_state["next_step"], flush=True)
        # Only what stock DeepSpeed loaded is under test here: once every rank has loaded,
        # end as the DeepSpeed scripts do (examples/process_end.py says why).
        torch.distributed.barrier()
        end_process()
    """))
    stock = LocalJob("stock_load", [], 3, job_id(), logs,
                     env={"PYTHONPATH": os.pathsep.join([logs, REPO]), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **ENV})
    assert stock.wait(TIMEOUT) == [0] * 3, stock.tails()
    return [next(ln for ln in LocalJob.read_log(logs, rank).splitlines() if ln.startswith("STOCK LOADED"))
            for rank in range(3)]
