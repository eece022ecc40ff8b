"""The shape of the code, checked on its import graph (static, by parsing every module):

* the core (``ftmem/``) imports no adapter, no framework and none of the tools;
* an adapter reaches the core only through what ``ftmem`` exports, never a submodule;
* no class of the core grows much past 200 lines;
* library code logs; only the ``ftmem`` command prints.
"""
import ast
import os

import pytest

from harness.common import REPO

CORE, ADAPTERS = "ftmem", ("ftmem_deepspeed", "ftmem_megatron")
NOT_FOR_THE_CORE = ("ftmem_deepspeed", "ftmem_megatron", "examples", "benchmarks", "deepspeed", "megatron")
MAX_CLASS_LINES = 220


def modules(package: str) -> list[str]:
    root = os.path.join(REPO, package)
    return sorted(os.path.join(root, name) for name in os.listdir(root) if name.endswith(".py"))


def parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def imported(path: str, package: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in the module, lazy ones included."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", modules(CORE), ids=os.path.basename)
def test_the_core_imports_no_adapter_framework_or_tool(path):
    wrong = [f"line {line}: {module}" for line, module, _ in imported(path, CORE)
             if module.split(".")[0] in NOT_FOR_THE_CORE]
    assert not wrong, f"{os.path.relpath(path, REPO)} imports {wrong}"


@pytest.mark.parametrize("path", [p for a in ADAPTERS for p in modules(a)], ids=lambda p: os.path.relpath(p, REPO))
def test_adapters_use_only_what_ftmem_exports(path):
    package = os.path.basename(os.path.dirname(path))
    wrong = [f"line {line}: {module}" for line, module, _ in imported(path, package)
             if module.startswith(CORE + ".")]
    assert not wrong, f"{os.path.relpath(path, REPO)} imports private core modules: {wrong}"
    import ftmem

    for line, module, names in imported(path, package):
        if module == CORE:
            missing = [n for n in names if n not in ftmem.__all__]
            assert not missing, f"{os.path.relpath(path, REPO)} line {line}: {missing} not exported by ftmem"


@pytest.mark.parametrize("path", modules(CORE), ids=os.path.basename)
def test_core_classes_stay_small(path):
    big = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(parse(path))
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"{os.path.relpath(path, REPO)}: {big}"


@pytest.mark.parametrize("path", [p for pkg in (CORE,) + ADAPTERS for p in modules(pkg)
                                  if os.path.basename(p) != "cli.py"], ids=lambda p: os.path.relpath(p, REPO))
def test_library_code_logs_instead_of_printing(path):
    prints = [node.lineno for node in ast.walk(parse(path))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert not prints, f"{os.path.relpath(path, REPO)} prints at lines {prints}"
