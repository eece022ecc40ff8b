"""``make test-peer``: DeepSpeed's own checkpoint tests, stock and with ftmem forced through the
JSON alone, on the DeepSpeed the Makefile pins and on the oldest the compatibility matrix
supports. One table comes out: each test, its outcome stock and with ftmem.

    python tests/harness/peer_suite.py [--sets NAME ...] [--tests PATH ...] [-k EXPR]

For each set:

* the test tree: DeepSpeed's ``tests/`` at the set's pinned tag, fetched once from
  ``DEEPSPEED_GIT`` (default DeepSpeed's GitHub repository; a local clone or mirror works) into
  ``build/peer/<set>/tree``, and refused if the tag does not resolve to the pinned commit;
  nothing is fetched while tests run;
* an environment: ``build/peer/<set>/venv`` with the set's torch and DeepSpeed, the pytest
  DeepSpeed's tests are written for (< 8.4), and ftmem from this checkout; DeepSpeed's CPU
  Adam op is built there before any test (into the set's own ``torch_extensions``), so that no
  test is stopped while it holds the build's lock;
* the tests (default ``unit/checkpoint``) run twice, in pytest sessions started with
  ``tests/harness/peer_site`` on PYTHONPATH (see its ``sitecustomize``): stock, and with every
  config selecting ``"engine": "ftmem"``. A test that runs past DeepSpeed's own bound on its
  ranks (``DS_UNITTEST_TIMEOUT``) ends its session (DeepSpeed's harness calls ``pytest.exit``):
  it is recorded as a hang and the session starts again with the tests left. ``--timeout``
  (pytest-timeout) stops one whose main process waits elsewhere. Shortly before DeepSpeed's
  bound, every thread's stack of each process of the run is written to
  ``build/peer/<set>/stacks/<mode>-<run>.<session>/hang-<n>.txt``, which the table names.

Every test that passes stock must pass with ftmem, but for the exceptions :data:`EXCEPTIONS`
names, each with its reason (docs/deepspeed.md); no test may hang with ftmem. A test that broke
either rule in the first runs is run :data:`RERUNS` more times in both modes, taking turns: one
that did not pass stock in one of its runs is DeepSpeed's own flake (its ZeRO-3 universal cases
on 0.17.1, docs/deepspeed.md), reported with every outcome and not held against ftmem; one that
passed stock every time is a regression. The exit status says whether the rules held. The
table goes to ``build/peer/table.md``.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compat_matrix import REPO, environment  # noqa: E402

from ftmem._shm import jobs  # noqa: E402

BUILD = os.path.join(REPO, "build", "peer")
SITE = os.path.join(REPO, "tests", "harness", "peer_site")
SOURCE = os.environ.get("DEEPSPEED_GIT", "https://github.com/deepspeedai/DeepSpeed.git")
PACKAGES = ["pytest>=7.2,<8.4", "pytest-timeout>=2.2", "numpy>=1.24", "xxhash>=3.0", "pyeclib>=1.6"]
DS_TIMEOUT_S = 240  # DeepSpeed's own bound on a test's ranks: past it, its harness ends the session
TEST_TIMEOUT_S = 300  # pytest-timeout's, for a test whose main process waits outside DeepSpeed's bound
LOCAL_SIZE = 4
# More runs of each mode for a test that passed stock and not with ftmem, or hung with ftmem:
# DeepSpeed's harness turns an assertion that fails on some ranks into a hang, so one run of a
# flaky test says little.
RERUNS = 2
PYTEST_RAN_NOTHING = (4, 5)  # pytest's exit statuses for a usage error and for no test collected


@dataclass(frozen=True)
class PeerSet:
    name: str
    torch: str
    deepspeed: str
    tag: str  # whose tests/ runs
    commit: str  # what the tag must resolve to


SETS = (
    # The Makefile's DeepSpeed. Its own tag (v0.19.8) was not reachable where this tier was
    # written (the newest tag there was v0.19.5, whose tests/unit/checkpoint 0.19.8 still
    # passes stock); point DEEPSPEED_GIT at a repository that has it and pin it here.
    PeerSet("pinned", "2.13.0", "0.19.8", "v0.19.5", "cf44300453eb0af79ed84ed8f1cb49d57478bd76"),
    # The oldest the compatibility matrix supports (docs/compatibility.md), with its own tests.
    PeerSet("oldest", "2.5.1", "0.17.1", "v0.17.1", "2ce55057999bdf1c9bf26cb5f000a8a9fb97e2d9"),
)

# Tests that pass stock and not with ftmem by design: (pattern on "<class or module>::<test>",
# the reason), each said in docs/deepspeed.md.
EXCEPTIONS = (
    (r"::test_save_exclude_frozen_weights\b",
     "compares the sizes of checkpoint files on disk, where ftmem writes stubs"),
)


def tree(ps: PeerSet, log) -> str:
    """The set's ``tests/`` folder, fetched once at its pinned commit."""
    folder = os.path.join(BUILD, ps.name, "tree")
    marker = os.path.join(folder, "COMMIT")
    if os.path.exists(marker) and open(marker).read() == ps.commit:
        return os.path.join(folder, "tests")
    if os.path.isdir(SOURCE):  # a local repository (a mirror may lack blobs outside tests/: read it in place)
        repo = SOURCE
    else:
        repo = os.path.join(BUILD, "deepspeed.git")
        if not os.path.isdir(repo):
            _run(["git", "init", "--quiet", "--bare", repo], log)
        _run(["git", "--git-dir", repo, "fetch", "--quiet", "--depth", "1", SOURCE,
              f"refs/tags/{ps.tag}:refs/tags/{ps.tag}"], log)
    got = subprocess.run(["git", "--git-dir", repo, "rev-parse", f"{ps.tag}^{{commit}}"], capture_output=True,
                         text=True).stdout.strip()
    if got != ps.commit:
        raise RuntimeError(f"{SOURCE}'s {ps.tag} is commit {got or '(none)'}, not the pinned {ps.commit}: refusing to "
                           f"run another tree than the one recorded")
    subprocess.run(["rm", "-rf", folder], check=True)
    os.makedirs(folder)
    archive = subprocess.Popen(["git", "--git-dir", repo, "archive", ps.tag, "tests"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", folder], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {ps.tag} tests failed")
    with open(marker, "w") as f:
        f.write(ps.commit)
    return os.path.join(folder, "tests")


def _run(cmd: list[str], log, **kwargs) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, **kwargs)


def _env(ps: PeerSet, mode: str) -> dict:
    # LOCAL_SIZE: the CPU accelerator's device count, which DeepSpeed's harness checks against a
    # test's world size (up to 4 in unit/checkpoint); its ranks set their own.
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(LOCAL_SIZE), DS_UNITTEST_TIMEOUT=str(DS_TIMEOUT_S),
               FTMEM_PEER_MODE=mode,
               PYTHONPATH=SITE, TORCH_EXTENSIONS_DIR=os.path.join(BUILD, ps.name, "torch_extensions"),
               FTMEM_PEER_SHM_DIR=_shm_dir(ps))
    env.pop("FTMEM_JOB_ID", None)
    if mode == "stock":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # not even ftmem_guard's torch.backends hook
    return env


def _shm_dir(ps: PeerSet) -> str:
    return f"/dev/shm/ftmem-peer-{ps.name}"


def build_ops(ps: PeerSet, python: str, log) -> None:
    """DeepSpeed's CPU Adam op, built before any test (its build holds a lock that a stopped
    test would leave behind)."""
    code = ("import torch, deepspeed; from deepspeed.ops.adam import FusedAdam; "
            "FusedAdam([torch.nn.Parameter(torch.zeros(1))])")
    _run([python, "-c", code], log, env=_env(ps, "stock"), timeout=1800)


def collect(ps: PeerSet, python: str, tests_dir: str, paths: list[str], k: Optional[str], log) -> list[str]:
    listing = os.path.join(BUILD, ps.name, "collected.txt")
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "ftmem_peer_plugin",
           *paths] + (["-k", k] if k else [])
    out = subprocess.run(cmd, cwd=tests_dir, env=dict(_env(ps, "stock"), FTMEM_PEER_COLLECT_TO=listing),
                         capture_output=True, text=True, timeout=600)
    log.write(out.stdout + out.stderr)
    ids = open(listing).read().splitlines() if os.path.exists(listing) else []  # an id may hold spaces
    skipped = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).splitlines()
               if re.search(r"\b\d+ skipped\b", line)]
    if not ids and skipped:
        # A module that skips itself at collection (test_mics_optimizer on torch > 2.0): nothing to run.
        print(f"   nothing to run: {skipped[0]}", flush=True)
    elif not ids:
        raise RuntimeError(f"no test collected by {' '.join(cmd)}; see {log.name}")
    return ids


def key(node_id: str) -> str:
    """``<class or module>::<test>`` of a node id, as junit's classname and name give it too."""
    parts = node_id.split("::")
    return "::".join([parts[-2] if len(parts) > 2 else os.path.splitext(os.path.basename(parts[0]))[0], parts[-1]])


def run_mode(ps: PeerSet, python: str, tests_dir: str, ids: list[str], mode: str, log,
             attempt: int = 1) -> dict[str, str]:
    """Each test's outcome ('passed', 'failed', 'error', 'skipped', 'hang') in ``mode``, in its
    ``attempt``-th run."""
    outcomes: dict[str, str] = {}
    remaining, session = list(ids), 0
    if attempt == 1:  # an earlier run's stacks and junit files: the table names this run's
        for old in glob.glob(os.path.join(BUILD, ps.name, "stacks", f"{mode}-*")):
            shutil.rmtree(old)
        for old in glob.glob(os.path.join(BUILD, ps.name, f"{mode}-*.xml")):
            os.remove(old)
    while remaining:
        session += 1
        _free_shm(ps)
        os.makedirs(_shm_dir(ps), exist_ok=True)
        for lock in glob.glob(os.path.join(BUILD, ps.name, "torch_extensions", "*", "*", "lock")):
            os.remove(lock)  # left by a session stopped mid-build (nothing of this run is running now)
        junit = os.path.join(BUILD, ps.name, f"{mode}-{attempt}.{session}.xml")
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--timeout={TEST_TIMEOUT_S}",
               f"--junitxml={junit}", "-p", "ftmem_peer_plugin", *remaining]
        log.write(f"$ {mode} run {attempt} session {session}: {len(remaining)} tests\n")
        log.flush()
        stacks = os.path.join(BUILD, ps.name, "stacks", f"{mode}-{attempt}.{session}")
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=dict(_env(ps, mode), FTMEM_PEER_STACKS=stacks), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=(TEST_TIMEOUT_S + 60) * len(remaining))
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:  # pytest and DeepSpeed's ranks (their forkserver and pool are in its session)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for own in glob.glob(os.path.join(stacks, "[0-9]*.txt")):
            os.remove(own)  # each process's own file: what a hang's file gathered from them is kept
        ran = _junit(junit)
        if not ran and proc.returncode in PYTEST_RAN_NOTHING:
            raise RuntimeError(f"pytest ran none of the {len(remaining)} tests (exit {proc.returncode}); see {log.name}")
        outcomes.update({node: ran[key(node)] for node in remaining if key(node) in ran})
        left = [node for node in remaining if node not in outcomes]
        if left:
            outcomes[left[0]] = "hang"  # the session ended (DeepSpeed's pytest.exit) or was stopped during it
        remaining = left[1:]
    _free_shm(ps)
    return outcomes


def _free_shm(ps: PeerSet) -> None:
    """Every ftmem job the tests left in the set's shared-memory directory freed, and it removed."""
    if os.path.isdir(_shm_dir(ps)):
        for job in jobs.list_jobs(_shm_dir(ps)):
            jobs.clean(_shm_dir(ps), job)
        shutil.rmtree(_shm_dir(ps), ignore_errors=True)


def _junit(path: str) -> dict[str, str]:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    found = {}
    for case in root.iter("testcase"):
        kinds = {child.tag: (child.get("message") or "") for child in case}
        said = " ".join(kinds.values())
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        found[name] = ("hang" if "Timeout" in said or "hung" in said else "failed" if "failure" in kinds else
                       "error" if "error" in kinds else "skipped" if "skipped" in kinds else "passed")
    return found


def hang_stacks(set_name: str, mode: str) -> dict[str, list[str]]:
    """The files of stacks taken as each test of ``mode`` ran out of time, by node id, in the
    order of its runs."""
    found: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(BUILD, set_name, "stacks", f"{mode}-*", "hang-*.txt"))):
        with open(path) as f:
            found.setdefault(f.readline().split(": still running", 1)[0], []).append(os.path.relpath(path, REPO))
    return found


def excepted(node_id: str) -> Optional[str]:
    return next((reason for pattern, reason in EXCEPTIONS if re.search(pattern, key(node_id))), None)


def suspect(stock: list[str], ftmem: list[str], node: str) -> bool:
    """Whether a test broke a rule in its runs so far: it passed stock (in its first run) and not
    with ftmem, or it hung with ftmem; an exception by design is not."""
    return ((stock[0] == "passed" and any(o != "passed" for o in ftmem)) or "hang" in ftmem) and not excepted(node)


def verdict(stock: list[str], ftmem: list[str], node: str) -> tuple[str, bool]:
    """The table's note on a test, from its outcomes in each run of each mode, and whether it
    keeps the rules."""
    if stock[0] == "passed" and ftmem[0] != "passed" and excepted(node):
        return f" (by design: {excepted(node)})", True
    if not suspect(stock, ftmem, node):
        return "", True
    if any(o != "passed" for o in stock):  # failed on some ranks, it hangs; on all, it fails
        return " (DeepSpeed's own flake: it did not pass stock either)", True
    return " **regression**", False


def table(results: dict[str, dict[str, dict[str, list[str]]]], took: dict[str, float]) -> tuple[str, bool]:
    """The table (markdown) and whether every test that passed stock passed with ftmem, or is
    an exception, and none hung with ftmem, but for DeepSpeed's own flakes."""
    lines, ok = [], True
    for name, modes in results.items():
        ps = next(s for s in SETS if s.name == name)
        stock, ftmem = modes["stock"], modes["ftmem"]
        lines += [f"## {name}: DeepSpeed {ps.deepspeed}, torch {ps.torch}, tests of {ps.tag} ({ps.commit[:8]}); "
                  f"{took[name]:.0f} s", "", "| test | stock | ftmem |", "|---|---|---|"]
        stacks = {mode: hang_stacks(name, mode) for mode in modes}
        for node in stock:
            note, kept = verdict(stock[node], ftmem.get(node, ["-"]), node)
            ok &= kept
            said = {mode: ", ".join(got.get(node, ["-"])) + "".join(f" (stacks: `{path}`)"
                                                                    for path in stacks[mode].get(node, []))
                    for mode, got in modes.items()}
            lines.append(f"| `{node}` | {said['stock']} | {said['ftmem']}{note} |")
        counts = {mode: {o: sum(1 for v in got.values() if v[0] == o) for o in sorted({v[0] for v in got.values()})}
                  for mode, got in modes.items()}
        lines += ["", "first runs: " + "; ".join(f"{mode}: " + ", ".join(f"{n} {o}" for o, n in c.items())
                                                 for mode, c in counts.items()), ""]
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="*", default=[s.name for s in SETS], help="sets to run (default all)")
    parser.add_argument("--tests", nargs="*", default=["unit/checkpoint"], help="paths in DeepSpeed's tests/")
    parser.add_argument("-k", default=None, help="pytest's -k, to run some of them")
    args = parser.parse_args(argv)
    os.makedirs(BUILD, exist_ok=True)
    results, took = {}, {}
    for ps in (s for s in SETS if s.name in args.sets):
        t0 = time.monotonic()
        os.makedirs(os.path.join(BUILD, ps.name), exist_ok=True)
        with open(os.path.join(BUILD, ps.name, "log.txt"), "w") as log:
            print(f"== {ps.name}: DeepSpeed {ps.deepspeed}, torch {ps.torch}, tests of {ps.tag}", flush=True)
            tests_dir = tree(ps, log)
            python = environment(os.path.join(BUILD, ps.name), ps.name, ps.torch,
                                 [f"deepspeed=={ps.deepspeed}", *PACKAGES], log)
            build_ops(ps, python, log)
            ids = collect(ps, python, tests_dir, args.tests, args.k, log)
            print(f"   {len(ids)} tests", flush=True)
            runs = {mode: {node: [outcome] for node, outcome in run_mode(ps, python, tests_dir, ids, mode, log).items()}
                    for mode in ("stock", "ftmem")}
            again = [node for node in ids
                     if suspect(runs["stock"].get(node, ["-"]), runs["ftmem"].get(node, ["-"]), node)]
            for attempt in range(2, 2 + RERUNS if again else 0):
                print(f"   run {attempt} of {len(again)} tests that broke a rule", flush=True)
                for mode in ("stock", "ftmem"):
                    for node, outcome in run_mode(ps, python, tests_dir, again, mode, log, attempt).items():
                        runs[mode][node].append(outcome)
            results[ps.name] = runs
        took[ps.name] = time.monotonic() - t0
    text, ok = table(results, took)
    with open(os.path.join(BUILD, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
