"""A renamed part of the public API keeps its old name for one minor release, as an alias
that warns and does what the new name does (ftmem/_common/deprecation.py), and is gone by the
release it names; and ``ftmem --version`` says what is installed."""
import re
from importlib import metadata

import pytest

from ftmem import FtmemError, SaveHandle, SnapshotEngine
from ftmem._common import compat, deprecation
from harness.common import run_cli


def _release(text: str) -> tuple:
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)\.(\d+)", text).groups())


def test_wait_committed_warns_with_its_new_name_and_waits_as_wait_protected():
    handle = SaveHandle(7)
    with pytest.warns(DeprecationWarning, match=r"SaveHandle.wait_committed is deprecated since ftmem 0.2.0, and "
                                                r"goes in 0.3.0: use SaveHandle.wait_protected"):
        with pytest.raises(TimeoutError, match="version 7 still waiting to be protected"):
            handle.wait_committed(0.01)
    handle._fail(FtmemError("the protection failed"))
    with pytest.warns(DeprecationWarning), pytest.raises(FtmemError, match="the protection failed"):
        handle.wait_committed()


def test_snapshot_engine_wait_warns_with_its_new_name_and_is_wait_protected():
    with pytest.warns(DeprecationWarning, match=r"SnapshotEngine.wait is deprecated since ftmem 0.2.0, and goes in "
                                                r"0.3.0: use SnapshotEngine.wait_protected"):
        assert SnapshotEngine.wait is SnapshotEngine.wait_protected


def test_every_alias_is_gone_by_the_release_it_names():
    release = _release(metadata.version("ftmem"))
    due = [f"{a.owner}.{a.old} (goes in {a.removed_in})" for a in deprecation.ALIASES if release >= _release(a.removed_in)]
    assert deprecation.ALIASES and not due, f"ftmem {metadata.version('ftmem')} still has aliases due for removal: {due}"


def test_version_names_ftmem_and_the_installed_frameworks_with_whether_they_were_tested():
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [f"ftmem {metadata.version('ftmem')}", compat.installed()]
    for package in ("torch", "deepspeed", "megatron-core"):
        assert re.search(rf"{package} {re.escape(compat.version(package))} \((tested|not tested)\)", lines[1])
