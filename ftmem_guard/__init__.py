"""Turns a silent misconfiguration into a clear error: ``"checkpoint": {"engine": "ftmem"}``
in a DeepSpeed config, but neither ``import ftmem_deepspeed`` nor the DeepSpeed patch.

DeepSpeed ignores engine names it does not know and would save with ``torch.save``,
so the user would believe they had in-memory checkpoints and have none. DeepSpeed has
no plugin hook to catch this, so ftmem registers :func:`arm` under torch's
``torch.backends`` entry-point group, which ``import torch`` calls (set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to switch all such hooks off). :func:`arm` only
adds an import watcher: when ``deepspeed.runtime.engine`` is first imported, its
``create_checkpoint_engine`` gets a check in front. It costs nothing otherwise.

This package imports neither torch nor DeepSpeed nor the rest of ftmem: it runs in
the middle of ``import torch``.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import warnings

WATCHED_MODULE = "deepspeed.runtime.engine"
ENGINE_NAME = "ftmem"


class FtmemNotInstalled(RuntimeError):
    """The config selects ftmem, but nothing in this process installed it."""


def missing_import_message() -> str:
    return ("the DeepSpeed config sets \"checkpoint\": {\"engine\": \"ftmem\"}, but ftmem's DeepSpeed engine "
            "is not installed in this process, so DeepSpeed would silently save every checkpoint with "
            "torch.save instead. Add `import ftmem_deepspeed` to the training script before "
            "deepspeed.initialize (or run a DeepSpeed with patches/deepspeed-0.19.8-ftmem.patch applied).")


def selects_ftmem(config_params) -> bool:
    checkpoint = (getattr(config_params, "_param_dict", None) or {}).get("checkpoint") or {}
    return checkpoint.get("engine") == ENGINE_NAME


def guard_engine_factory(module) -> None:
    """Put the check in front of ``module.create_checkpoint_engine``.

    ``import ftmem_deepspeed`` later wraps this name again and answers "ftmem" itself,
    so the check only ever sees "ftmem" when that import never happened. A patched
    DeepSpeed (``FTMEM_NATIVE``) knows the engine and is left alone.
    """
    factory = module.create_checkpoint_engine
    factory_module = sys.modules.get(getattr(factory, "__module__", ""), None)
    if getattr(factory_module, "FTMEM_NATIVE", False):
        return

    @functools.wraps(factory)
    def create_checkpoint_engine(config_params, *args, **kwargs):
        if selects_ftmem(config_params):
            raise FtmemNotInstalled(missing_import_message())
        return factory(config_params, *args, **kwargs)

    module.create_checkpoint_engine = create_checkpoint_engine


class _GuardingLoader(importlib.abc.Loader):
    """Runs the real loader, then guards the factory it defined."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            guard_engine_factory(module)
        except Exception as e:  # DeepSpeed must import whatever happens to the guard
            warnings.warn(f"ftmem_guard could not guard DeepSpeed's checkpoint engine factory ({e!r}); "
                          f"\"engine\": \"ftmem\" now needs `import ftmem_deepspeed` to take effect.")

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and tools
        return getattr(self.loader, name)


class _EngineImportWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != WATCHED_MODULE:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        except Exception:  # let the import system report it, without the guard in the way
            return None
        if spec is not None and spec.loader is not None:
            spec.loader = _GuardingLoader(spec.loader)
        return spec


def arm() -> None:
    """Entry point called by ``import torch``; idempotent. It never raises: whatever
    goes wrong here must not break ``import torch``, so it becomes a warning."""
    try:
        if not any(isinstance(finder, _EngineImportWatcher) for finder in sys.meta_path):
            sys.meta_path.insert(0, _EngineImportWatcher())
    except Exception as e:
        warnings.warn(f"ftmem_guard could not arm ({e!r}); \"engine\": \"ftmem\" now needs "
                      f"`import ftmem_deepspeed` to take effect.")
