"""Build the test environment for Megatron-LM 0.19.2's own training package on this
machine's Python 3.11 (``make megatron-lm``; ``make test`` builds it first).

It is a test environment only: on a cluster, Megatron-LM is installed as usual, on
Python >= 3.12. Megatron-LM's ``megatron/training`` ships in the megatron-core 0.19.2
wheel, which declares Python >= 3.12 but parses under 3.11. Into ``OUT`` go two source
trees of that wheel's ``megatron/`` package, each a directory to put first on PYTHONPATH
(before the installed megatron-core 0.16.1):

* ``OUT/stock``: unpatched, for ``ftmem_megatron.install()`` and for reference runs;
* ``OUT/patched``: with ``patches/megatron-lm-0.19.2-ftmem.patch`` (its output in
  ``OUT/patch.log``; the build fails if it does not apply cleanly).

Each tree gets what 3.11 and a machine without Triton need, and nothing else:

* ``sitecustomize.py`` (imported at start-up from PYTHONPATH): ``typing.override``, the
  one Python 3.12 name the package uses (``megatron/training/models``), taken from
  typing_extensions; and, without Triton, a stand-in for the module of Triton kernels
  that ``megatron.core.transformer.moe.paged_stash`` imports (GPU MoE kernels that a
  dense GPT never runs: calling one raises);
* ``megatron/core/datasets/helpers_cpp`` built for this Python from the ``helpers.cpp``
  the wheel ships (its compiled module is for 3.12), with a Makefile, since Megatron-LM
  runs ``make`` in that directory at start-up.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

VERSION = "0.19.2"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PATCH = os.path.join(REPO, "patches", "megatron-lm-0.19.2-ftmem.patch")

SITECUSTOMIZE = '''\
"""Megatron-LM 0.19.2's training package on Python 3.11, for ftmem's tests (tests/harness/megatron_lm/build_env.py)."""
import importlib.util
import sys
import types
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

if importlib.util.find_spec("triton") is None:
    _ops = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    _ops.GLOBAL_BLOCK_SIZE = 1024

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("this Triton kernel is not available in ftmem's Megatron-LM test environment")

    _ops.paged_stash_copy_kernel = _ops.paged_stash_pop_kernel = _needs_triton
    sys.modules[_ops.__name__] = _ops
'''

# Megatron-LM runs `make` here at start-up (megatron.core.datasets.utils.compile_helpers).
HELPERS_MAKEFILE = '''\
EXT := $(shell {python} -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
helpers_cpp$(EXT): helpers.cpp
\tc++ -O3 -shared -std=c++17 -fPIC $(shell {python} -m pybind11 --includes) $< -o $@
'''


def download_wheel(dest: str) -> str:
    """The megatron-core wheel (cp312, no dependencies), downloaded once into ``dest``."""
    found = [w for w in glob.glob(os.path.join(dest, f"megatron_core-{VERSION}-*.whl")) if zipfile.is_zipfile(w)]
    if found:
        return found[0]
    os.makedirs(dest, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", f"megatron-core=={VERSION}", "-d", dest],
                   check=True)
    return glob.glob(os.path.join(dest, f"megatron_core-{VERSION}-*.whl"))[0]


def build_tree(wheel: str, tree: str) -> None:
    """Unpack the wheel's ``megatron/`` into ``tree`` and make it run here."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tree, [n for n in z.namelist() if n.startswith("megatron/")])
    with open(os.path.join(tree, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    datasets = os.path.join(tree, "megatron", "core", "datasets")
    with open(os.path.join(datasets, "Makefile"), "w") as f:
        f.write(HELPERS_MAKEFILE.format(python=sys.executable))
    subprocess.run(["make", "--quiet", "-C", datasets], check=True)
    built = os.path.join(datasets, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert os.path.exists(built), f"{built} was not built"


def apply_patch(tree: str, log: str) -> None:
    applied = subprocess.run(["patch", "-p1", "--forward", "-i", PATCH], cwd=tree, capture_output=True, text=True)
    with open(log, "w") as f:
        f.write(applied.stdout + applied.stderr)
    if applied.returncode != 0 or any(w in (applied.stdout + applied.stderr).lower()
                                      for w in ("offset", "fuzz", "reversed", ".rej")):
        raise SystemExit(f"{PATCH} does not apply cleanly to Megatron-LM {VERSION}:\n{applied.stdout}{applied.stderr}")


def main(out: str) -> None:
    wheel = download_wheel(os.path.join(out, "wheel"))
    for name in ("stock", "patched"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=out) as scratch:  # whole trees appear, or none
        for name in ("stock", "patched"):
            build_tree(wheel, os.path.join(scratch, name))
        apply_patch(os.path.join(scratch, "patched"), os.path.join(out, "patch.log"))
        for name in ("stock", "patched"):
            os.replace(os.path.join(scratch, name), os.path.join(out, name))


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
