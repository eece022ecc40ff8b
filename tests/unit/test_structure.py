"""The shape of the code, checked on its import graph (static, by parsing every module):

* the core's layers depend downwards only: each package of ``ftmem/`` imports from its own
  layer and the layers below it (LAYERS), never from one above;
* the core imports no adapter, no framework and none of the tools;
* an adapter reaches the core only through the public namespaces (``ftmem``,
  ``ftmem.adapter``, ``ftmem.errors``) and only names they export;
* library code logs; only the ``ftmem`` command prints.
"""
import ast
import importlib
import os

import pytest

from harness.common import REPO

CORE, ADAPTERS = "ftmem", ("ftmem_deepspeed", "ftmem_megatron", "ftmem_guard")
NOT_FOR_THE_CORE = ("ftmem_deepspeed", "ftmem_megatron", "ftmem_guard", "examples", "benchmarks", "tests",
                    "deepspeed", "megatron")
PUBLIC = ("ftmem", "ftmem.adapter", "ftmem.errors")
# The core's layers, bottom first: a part of ftmem may import from its own layer and those below.
LAYERS = [
    {"ftmem.errors", "ftmem.config", "ftmem._common"},
    {"ftmem._state"},  # state <-> bytes
    {"ftmem._shm"},  # shared memory and the SMP
    {"ftmem._ec"},  # erasure coding across nodes
    {"ftmem._disk"},  # persistent tier and export
    {"ftmem._engine"},  # save and restore
    {"ftmem.adapter"},  # the adapter seam and runtime
    {"ftmem.cli", "ftmem"},  # the command, and the application's namespace
]


def modules(package: str) -> list[str]:
    found = []
    for root, _, files in os.walk(os.path.join(REPO, package)):
        found += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(found)


def dotted(path: str) -> str:
    name = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def imported(path: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in the module, lazy ones included."""
    package = dotted(path) if path.endswith("__init__.py") else dotted(path).rpartition(".")[0]
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


def layer(module: str) -> int:
    """The layer of a module of ftmem: that of the longest part of LAYERS it falls in."""
    best = max((part for parts in LAYERS for part in parts if module == part or module.startswith(part + ".")),
               key=len)
    return next(i for i, parts in enumerate(LAYERS) if best in parts)


def is_module(name: str) -> bool:
    path = os.path.join(REPO, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def targets(module: str, names: list[str]) -> list[str]:
    """What an import depends on: the modules it names (``from ftmem import errors``), else the module."""
    return [f"{module}.{n}" for n in names if is_module(f"{module}.{n}")] or [module]


@pytest.mark.parametrize("path", modules(CORE), ids=lambda p: os.path.relpath(p, REPO))
def test_the_core_s_layers_depend_downwards_only(path):
    mine = layer(dotted(path))
    upwards = [f"line {line}: {target}" for line, module, names in imported(path) for target in targets(module, names)
               if target.split(".")[0] == CORE and layer(target) > mine]
    assert not upwards, f"{os.path.relpath(path, REPO)} (layer {mine}) imports from layers above it: {upwards}"


@pytest.mark.parametrize("path", modules(CORE), ids=lambda p: os.path.relpath(p, REPO))
def test_the_core_imports_no_adapter_framework_or_tool(path):
    wrong = [f"line {line}: {module}" for line, module, _ in imported(path)
             if module.split(".")[0] in NOT_FOR_THE_CORE]
    assert not wrong, f"{os.path.relpath(path, REPO)} imports {wrong}"


@pytest.mark.parametrize("path", [p for a in ADAPTERS for p in modules(a)], ids=lambda p: os.path.relpath(p, REPO))
def test_adapters_use_only_the_public_namespaces_and_what_they_export(path):
    for line, module, names in imported(path):
        if module.split(".")[0] != CORE:
            continue
        where = f"{os.path.relpath(path, REPO)} line {line}"
        assert module in PUBLIC, f"{where}: imports the internal module {module}; use {', '.join(PUBLIC)}"
        exported = getattr(importlib.import_module(module), "__all__", None)
        missing = [n for n in names if n not in (exported or dir(importlib.import_module(module)))]
        assert not missing, f"{where}: {missing} not exported by {module}"


@pytest.mark.parametrize("path", [p for pkg in (CORE,) + ADAPTERS for p in modules(pkg)
                                  if os.path.basename(p) != "cli.py"], ids=lambda p: os.path.relpath(p, REPO))
def test_library_code_logs_instead_of_printing(path):
    prints = [node.lineno for node in ast.walk(parse(path))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert not prints, f"{os.path.relpath(path, REPO)} prints at lines {prints}"


def test_every_error_is_exported_by_the_application_namespace_too():
    import ftmem
    import ftmem.errors

    classes = {name for name, value in vars(ftmem.errors).items()
               if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == "ftmem.errors"}
    assert classes == set(ftmem.errors.__all__)
    assert set(ftmem.errors.__all__) <= set(ftmem.__all__), set(ftmem.errors.__all__) - set(ftmem.__all__)
