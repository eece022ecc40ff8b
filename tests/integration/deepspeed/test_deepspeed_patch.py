"""patches/deepspeed-0.19.8-ftmem.patch applies to the installed DeepSpeed's sources
(on a copy), and the patched factory selects ftmem without importing ftmem_deepspeed."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import deepspeed
import torch

from harness.common import REPO, job_id, logged
from harness.ranks import free_port
from ftmem import restored_from_memory
from harness.ds_jobs import ENV, STOCK_ENV, TIMEOUT, config_pair, stock_script

PATCH = os.path.join(REPO, "patches", "deepspeed-0.19.8-ftmem.patch")


def patched_deepspeed(root) -> str:
    """A copy of the installed DeepSpeed with the patch applied, under ``root``; the
    directory to put first on PYTHONPATH."""
    assert deepspeed.__version__ == "0.19.8"
    shutil.copytree(os.path.dirname(deepspeed.__file__), root / "deepspeed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["patch", "-p1", "--forward", "-i", PATCH], cwd=root, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return str(root)


def test_patch_applies_and_selects_ftmem_natively(tmp_path, shm_dir):
    patched_deepspeed(tmp_path)
    probe = textwrap.dedent(f"""
        import os, sys
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.engine import create_checkpoint_engine
        from deepspeed.utils import groups
        assert deepspeed.__file__.startswith({str(tmp_path)!r}), deepspeed.__file__
        deepspeed.init_distributed(dist_backend="gloo")
        base = {{"train_batch_size": 1, "ftmem": {{"shm_dir": {shm_dir!r}, "job_id": {job_id()!r}}}}}
        chosen = create_checkpoint_engine(DeepSpeedConfig(dict(base, checkpoint={{"engine": "ftmem"}})),
                                          groups, 1, False, True)
        stock = create_checkpoint_engine(DeepSpeedConfig(base), groups, 1, False, True)
        print("SELECTED", type(chosen).__name__, type(stock).__name__, "ftmem_deepspeed" in sys.modules)
        import inspect
        from deepspeed.runtime.engine import DeepSpeedEngine
        load = inspect.getsource(DeepSpeedEngine.load_checkpoint)
        print("HOOKS", "resume_point" in load, "checkpoint_engine.loaded()" in load,
              "wait_reusable" in inspect.getsource(DeepSpeedEngine._take_model_step))
        from examples.process_end import end_process  # DeepSpeed keeps its gloo group: see there
        end_process()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]), DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SELECTED FtmemCheckpointEngine TorchCheckpointEngine" in out.stdout
    assert "HOOKS True True True" in out.stdout


def test_a_file_read_by_path_after_training_resumed_is_the_checkpoint_s_not_the_trained_state(shm_dir, tmp_path):
    """On the patched DeepSpeed (the guard off: no hook of the import), a job resumes from
    memory, trains a step and saves, then reads the checkpoint it resumed from by path.
    A torch optimizer keeps the state tensors a load gives it and trains them in place, so
    the read must come from memory again, not from what the load handed out. It equals,
    bitwise, the default engine's file of the same step."""
    config, stock = config_pair("zero0.json", shm_dir, ec={"k": 1, "m": 1})
    patched = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": patched_deepspeed(tmp_path / "ds")}
    world, job = 2, job_id()
    read_back = ["--read-back", "torch-load-all", "--read-back-tag", "global_step3"]
    assert stock_script(tmp_path, "reference", stock, STOCK_ENV, world, job_id(), 3,
                        *read_back).wait(TIMEOUT) == [0] * world
    assert stock_script(tmp_path, "ftmem", config, patched, world, job, 3).wait(TIMEOUT) == [0] * world
    resumed = stock_script(tmp_path, "ftmem", config, patched, world, job, 4, *read_back)
    assert resumed.wait(TIMEOUT) == [0] * world, resumed.log(0)[-5000:]
    # It trained a step past the version it resumed from, and saved it, before the read:
    # else the read could not tell the checkpoint from the trained state.
    assert (tmp_path / "ftmem" / "ckpt" / "latest").read_text().strip() == "global_step4"
    for rank in range(world):
        assert f"rank {rank}: checkpoint engine FtmemCheckpointEngine" in resumed.log(rank)
        assert logged(restored_from_memory(3, rank, "tag global_step3"), resumed.log(rank)), resumed.log(rank)[-3000:]
        with open(tmp_path / "ftmem" / f"rank{rank}.losses.jsonl") as f:
            assert [json.loads(line)["it"] for line in f] == [0, 1, 2, 3]
        mine, theirs = (torch.load(str(tmp_path / name / f"rank{rank}.read-back.pt"), weights_only=True)
                        for name in ("ftmem", "reference"))
        assert any("exp_avg" in key for key in theirs)  # the optimizer's state is in the file, and compared
        assert mine.keys() == theirs.keys()
        assert [key for key in theirs if not torch.equal(mine[key], theirs[key])] == []
