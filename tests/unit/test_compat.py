"""The names of torch's, DeepSpeed's and Megatron's that ftmem relies on without their promise
(ftmem/_common/compat.py): every one ftmem's code reaches is declared, each is present in the
versions under test (this tier runs on every set of `make test-compat`), the users' table lists
them, and a missing one stops ftmem at its start, naming it."""
import ast
import logging
import os
import subprocess
import sys

import pytest

from ftmem._common import compat

pytestmark = pytest.mark.compat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("ftmem", "ftmem_deepspeed", "ftmem_megatron", "ftmem_guard")
FOREIGN = ("torch", "deepspeed", "megatron")
MEGATRON_LM = os.path.join(REPO, ".mlm", "stock")  # make megatron-lm's unpatched tree


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _foreign_private_names(path: str) -> set[str]:
    """The dotted names a module reaches through a name it imported from torch, DeepSpeed or
    Megatron, where any part of the name is private (``dist.distributed_c10d._set_pg_timeout``
    -> ``torch.distributed.distributed_c10d._set_pg_timeout``). What it reaches through a
    variable (``options._devices``) is not seen here: those are declared by hand."""
    with open(path) as f:
        tree = ast.parse(f.read())
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                dotted = ".".join([bound[inner.id], *reversed(parts)])
                if any(_private(p) for p in dotted.split(".")):
                    found.add(dotted)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if any(_private(p) for p in f"{node.module}.{a.name}".split("."))}
    return found


def _product_modules():
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            yield from (os.path.join(root, f) for f in files if f.endswith(".py"))


def test_every_private_name_ftmem_reaches_in_torch_deepspeed_or_megatron_is_declared():
    declared = {n.dotted for n in compat.NAMES}
    reached = {(name, os.path.relpath(path, REPO)) for path in _product_modules() for name in _foreign_private_names(path)}
    # A name reached below a declared one is declared by it (the class's attribute by the class's
    # name, a private module's members by the member).
    undeclared = sorted((name, where) for name, where in reached
                        if not any(name == d or name.startswith(d + ".") for d in declared))
    assert not undeclared, f"private names used but not declared in ftmem/_common/compat.py NAMES: {undeclared}"


def test_the_rule_above_sees_a_private_name_reached_through_an_imported_module(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch.distributed as dist\nfrom deepspeed.utils import groups\n"
                      "dist.distributed_c10d._get_default_store()\ngroups._get_x()\n")
    assert _foreign_private_names(str(module)) == {"torch.distributed.distributed_c10d._get_default_store",
                                                   "deepspeed.utils.groups._get_x"}


@pytest.mark.parametrize("package", ["torch", "deepspeed", "megatron-core"])
def test_every_name_ftmem_needs_everywhere_or_on_the_cpu_is_present_in_the_versions_under_test(package):
    """The names of one part of ftmem (the distributed optimizer's, with megatron-core >= 0.15)
    may be absent: the smoke tier shows that part refused there (docs/compatibility.md)."""
    needed = (compat.EVERYWHERE, compat.CPU_SUPPORT)
    assert not [n.dotted for n in compat.NAMES if n.package == package and n.needed_by in needed and not n.present()]


@pytest.mark.skipif(not os.path.isdir(MEGATRON_LM), reason="make megatron-lm builds Megatron-LM's tree")
def test_every_declared_megatron_lm_name_is_present_in_megatron_lm_s_tree():
    names = [n.dotted for n in compat.NAMES if n.package == "megatron-lm"]
    code = ("import sys; from ftmem._common import compat; "
            "print([n.dotted for n in compat.NAMES if n.package == 'megatron-lm' and not n.present()])")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=MEGATRON_LM + os.pathsep + REPO),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert names and out.stdout.strip().splitlines()[-1] == "[]"


def test_the_users_table_lists_every_declared_name():
    with open(os.path.join(REPO, "docs", "compatibility.md")) as f:
        table = f.read()
    assert not [n.dotted for n in compat.NAMES if f"`{n.dotted}`" not in table]


def test_a_torch_without_a_name_ftmem_needs_is_refused_at_the_engine_s_start_naming_it(tmp_path):
    """As an older or newer torch without ``_set_pg_timeout`` would be: the engine stops before
    it makes a group or touches shared memory, with the name and what to install."""
    code = ("import torch.distributed.distributed_c10d as c10d; del c10d._set_pg_timeout\n"
            "from ftmem import SnapshotEngine, FtmemError\n"
            f"try:\n    SnapshotEngine({{'shm_dir': {str(tmp_path)!r}, 'job_id': 'compat'}}, rank=0, world_size=1)\n"
            "except FtmemError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "REFUSED ftmem needs torch.distributed.distributed_c10d._set_pg_timeout" in out.stdout, out.stderr[-2000:]
    assert "docs/compatibility.md" in out.stdout and not os.listdir(tmp_path)


def test_a_version_not_tested_gets_one_warning_line_and_a_floor_a_refusal(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_checked", set())
    monkeypatch.setitem(compat.TESTED, "torch", ("2.5",))
    monkeypatch.setattr(compat, "version", lambda package: "2.7.1")
    with caplog.at_level(logging.WARNING, logger="ftmem"):
        compat.check("torch")
        compat.check("torch")
    assert [r.getMessage() for r in caplog.records] == [
        "ftmem was not tested with torch 2.7.1 (tested: 2.5.x); see docs/compatibility.md"]
    monkeypatch.setattr(compat, "_checked", set())
    monkeypatch.setattr(compat, "version", lambda package: "2.4.1")
    with pytest.raises(compat.FtmemError, match=r"ftmem needs torch >= 2.5; this process has 2.4.1"):
        compat.check("torch")
