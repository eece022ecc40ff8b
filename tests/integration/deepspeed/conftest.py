"""Fixtures of the DeepSpeed tests."""
import os
import shutil
import subprocess
import sys

import pytest

#: a JIT build of fused Adam takes about a minute on 2 idle cores; a loaded machine may take several times that
BUILD_TIMEOUT = 900


@pytest.fixture(scope="session")
def _built_fused_adam(tmp_path_factory) -> str:
    """DeepSpeed's own Adam (the fused op its CPU accelerator builds for ``"type": "Adam"``),
    JIT-built once per session, in a process of its own that no test kills: a build cut by
    SIGKILL leaves its lock held, and every later load from that directory waits for ever."""
    root = str(tmp_path_factory.mktemp("torch_extensions"))
    build = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('FusedAdamBuilder').load()")
    try:
        subprocess.run([sys.executable, "-c", build], env=dict(os.environ, TORCH_EXTENSIONS_DIR=root, DS_ACCELERATOR="cpu"),
                       check=True, timeout=BUILD_TIMEOUT, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"DeepSpeed's fused Adam did not build within {BUILD_TIMEOUT} s in {root}")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"DeepSpeed's fused Adam did not build in {root}:\n{e.stderr[-3000:]}")
    return root


@pytest.fixture
def torch_extensions(_built_fused_adam, tmp_path) -> str:
    """A ``TORCH_EXTENSIONS_DIR`` of this test's own, holding the built fused Adam: its ranks
    load it (the build is up to date) under a lock that no other test shares."""
    path = str(tmp_path / "torch_extensions")
    shutil.copytree(_built_fused_adam, path)  # modification times kept: ninja finds nothing to do
    return path
