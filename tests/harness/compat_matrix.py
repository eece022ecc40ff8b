"""``make test-compat``: the compatibility matrix's smoke tier, on every version set it names.

For each set, a fresh virtual environment under ``build/compat/<set>`` gets that set's torch,
DeepSpeed and megatron-core from the package index (with ftmem from this checkout, editable),
then runs the tests marked ``compat`` (pytest ``-m compat``) with that environment's Python:
DeepSpeed ZeRO-1 with a node killed (the failure detector ends the survivors) and ZeRO-3 with
a node lost, each resumed bitwise against that DeepSpeed's default engine; the preemption
flush; the JSON alone switching ftmem on; megatron-core TP2 x DP2 with a node lost; and the
check that every private name ftmem uses exists there. A set below a floor instead checks that
ftmem refuses it at import, naming what it lacks. One table comes out, each test against each
set, with the time each set took; it is also written to ``build/compat/matrix.md``.

    python tests/harness/compat_matrix.py [SET ...]   # default: every set

An environment is reused while its pins are unchanged (``build/compat/<set>/pins``); delete
the folder for a fresh one. Megatron-LM's own loop is tested on the suite's one version only
(``make megatron-lm``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, "build", "compat")
# The suite's pytest and its helpers (pyproject.toml's "test" extra, without the framework extras:
# the set's pins are the frameworks).
TEST_PACKAGES = ["pytest>=7.4", "pytest-timeout>=2.2", "pybind11>=2.10", "numpy>=1.24", "xxhash>=3.0", "pyeclib>=1.6"]
SET_TIMEOUT_S = 3600  # one set's smoke tier: about 6 minutes on 2 idle cores


@dataclass(frozen=True)
class VersionSet:
    name: str
    torch: str
    deepspeed: str
    megatron_core: str
    refused: Optional[str] = None  # where ftmem must refuse the set: the text its refusal contains

    @property
    def pins(self) -> list[str]:
        return [f"torch=={self.torch}", f"deepspeed=={self.deepspeed}", f"megatron-core=={self.megatron_core}"]


SETS = (
    # The suite's own (the Makefile's pins; `make test` runs it all).
    VersionSet("newest", "2.13.0", "0.19.8", "0.16.1"),
    VersionSet("ds-0.17", "2.13.0", "0.17.6", "0.13.1"),
    # DeepSpeed 0.18.9 fails ZeRO-1 on the CPU without ftmem, on every torch tried (its
    # all-gather into views of a split: docs/compatibility.md). torch 2.5.1 is a CUDA wheel here;
    # it runs on the CPU.
    VersionSet("ds-0.18", "2.5.1", "0.18.9", "0.14.0"),
    # The floors (pyproject.toml): the oldest torch with the torch.backends entry points (2.5),
    # the first DeepSpeed with its checkpoint-engine interface (0.17.1), megatron-core 0.12.
    VersionSet("oldest", "2.5.1", "0.17.1", "0.12.3"),
    # Below the DeepSpeed floor: refused at import, naming why.
    VersionSet("ds-0.16", "2.13.0", "0.16.9", "0.12.3", refused="ftmem needs deepspeed >= 0.17.1"),
)


def _run(cmd: list[str], log, env: Optional[dict] = None, timeout: float = SET_TIMEOUT_S) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=timeout).returncode


def prepare(vs: VersionSet, log) -> str:
    """The set's environment, made anew where missing or pinned otherwise; its Python."""
    return environment(os.path.join(BUILD, vs.name), vs.name, vs.torch, vs.pins + TEST_PACKAGES, log)


def environment(folder: str, name: str, torch: str, packages: list[str], log) -> str:
    """A virtual environment in ``folder``/venv with torch ``torch`` and ``packages`` from the
    package index and ftmem from this checkout (editable), made anew where missing or made
    with other packages; its Python."""
    venv = os.path.join(folder, "venv")
    python = os.path.join(venv, "bin", "python")
    pins_file = os.path.join(folder, "pins")
    pins = " ".join([f"torch=={torch}", *packages])
    if os.path.exists(pins_file) and open(pins_file).read() == pins:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    env = dict(os.environ, DS_BUILD_OPS="0")
    steps = [[sys.executable, "-m", "venv", venv],
             [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip", "setuptools>=77", "wheel"],
             [python, "-m", "pip", "install", "--quiet", f"torch=={torch}"],
             # torch pinned again: nothing the frameworks ask for may move it.
             [python, "-m", "pip", "install", "--quiet", f"torch=={torch}", *packages],
             [python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", REPO]]
    for step in steps:
        if _run(step, log, env) != 0:
            raise RuntimeError(f"set {name}: {' '.join(step)} failed; see {log.name}")
    with open(pins_file, "w") as f:
        f.write(pins)
    return python


def smoke(vs: VersionSet, python: str, log) -> dict[str, str]:
    """Each compat test's outcome in this set ('passed', 'failed', 'skipped', 'error')."""
    if vs.refused is not None:
        code = "import ftmem_deepspeed"
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                             env=dict(os.environ, DS_ACCELERATOR="cpu"))
        log.write(out.stdout + out.stderr)
        refused = out.returncode != 0 and vs.refused in out.stderr
        return {"import ftmem_deepspeed is refused, naming why": "refused" if refused else "NOT refused"}
    junit = os.path.join(BUILD, vs.name, "junit.xml")
    _run([python, "-m", "pytest", "-q", "-ra", "-m", "compat", "-p", "no:cacheprovider", f"--junitxml={junit}",
          "tests"], log)
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag: child.get("message", "") for child in case}
        outcomes[name] = ("fails stock" if "StockFailed" in kinds.get("failure", "") else
                          "failed" if "failure" in kinds else "error" if "error" in kinds
                          else "skipped" if "skipped" in kinds else "passed")
    return outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", help=f"sets to run (default all: {' '.join(s.name for s in SETS)})")
    args = parser.parse_args(argv)
    chosen = [s for s in SETS if not args.sets or s.name in args.sets]
    os.makedirs(BUILD, exist_ok=True)
    results, took, ok = {}, {}, True
    for vs in chosen:
        t0 = time.monotonic()
        os.makedirs(os.path.join(BUILD, vs.name), exist_ok=True)
        with open(os.path.join(BUILD, vs.name, "log.txt"), "w") as log:
            print(f"== {vs.name}: {' '.join(vs.pins)}", flush=True)
            try:
                results[vs.name] = smoke(vs, prepare(vs, log), log)
            except (RuntimeError, subprocess.TimeoutExpired, ElementTree.ParseError, FileNotFoundError) as e:
                results[vs.name] = {"(the set)": f"error: {e}"}
        took[vs.name] = time.monotonic() - t0
        good = {"passed", "refused", "skipped", "fails stock"}  # "fails stock": the framework alone fails
        ok &= all(v in good for v in results[vs.name].values()) and bool(results[vs.name])
        print(f"   {took[vs.name]:.0f} s: " + ", ".join(f"{sum(1 for v in results[vs.name].values() if v == kind)} {kind}"
                                               for kind in sorted(set(results[vs.name].values()))), flush=True)
    table = _table(chosen, results, took)
    with open(os.path.join(BUILD, "matrix.md"), "w") as f:
        f.write(table)
    print(table)
    return 0 if ok else 1


def _table(chosen: list[VersionSet], results: dict, took: dict) -> str:
    tests = sorted({t for r in results.values() for t in r})
    head = ["test"] + [f"{s.name}<br>torch {s.torch}, DeepSpeed {s.deepspeed}, megatron-core {s.megatron_core}"
                       for s in chosen]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in tests:
        lines.append("| " + " | ".join([f"`{t}`"] + [results[s.name].get(t, "-") for s in chosen]) + " |")
    lines.append("| time | " + " | ".join(f"{took[s.name]:.0f} s" for s in chosen) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
