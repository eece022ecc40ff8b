"""patches/deepspeed-0.19.8-ftmem.patch applies to the installed DeepSpeed's sources
(on a copy), and the patched factory selects ftmem without importing ftmem_deepspeed."""
import os
import shutil
import subprocess
import sys
import textwrap

import deepspeed

from conftest import job_id

PATCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches",
                     "deepspeed-0.19.8-ftmem.patch")


def test_patch_applies_and_selects_ftmem_natively(tmp_path, shm_dir):
    assert deepspeed.__version__ == "0.19.8"
    shutil.copytree(os.path.dirname(deepspeed.__file__), tmp_path / "deepspeed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["patch", "-p1", "--forward", "-i", PATCH], cwd=tmp_path, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
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
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SELECTED FtmemCheckpointEngine TorchCheckpointEngine" in out.stdout
    assert "HOOKS True True True" in out.stdout
