"""Lets the DeepSpeed JSON config alone switch ftmem on: ``"checkpoint": {"engine": "ftmem"}``
in a script that neither imports ``ftmem_deepspeed`` nor runs a patched DeepSpeed.

DeepSpeed ignores engine names it does not know and would save with ``torch.save``,
so the user would believe they had in-memory checkpoints and have none. DeepSpeed has
no plugin hook for engines, so ftmem registers :func:`arm` under torch's
``torch.backends`` entry-point group, which ``import torch`` calls (set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to switch all such hooks off). :func:`arm` only
adds an import watcher: when ``deepspeed.runtime.engine`` is first imported, its
``create_checkpoint_engine`` gets a check in front. When a config selects ftmem, the
check installs the adapter right there (``import ftmem_deepspeed``: before the engine
is built, so before any step or load) and hands over to it; if the adapter cannot be
imported, it raises :class:`FtmemNotInstalled` with the reason. It costs nothing otherwise.

This package imports neither torch nor DeepSpeed nor the rest of ftmem: it runs in
the middle of ``import torch``.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import warnings

WATCHED_MODULE = "deepspeed.runtime.engine"
ENGINE_NAME = "ftmem"


ADAPTER = "ftmem_deepspeed"


class FtmemNotInstalled(RuntimeError):
    """The config selects ftmem, but its DeepSpeed adapter cannot be installed in this process."""


def missing_adapter_message(cause: BaseException) -> str:
    return (f"the DeepSpeed config sets \"checkpoint\": {{\"engine\": \"ftmem\"}}, but ftmem's DeepSpeed engine "
            f"could not be installed in this process ({type(cause).__name__}: {cause}), and DeepSpeed would "
            f"silently save every checkpoint with torch.save instead. Check that `import {ADAPTER}` works in this "
            f"environment (pip install ftmem[deepspeed]).")


def install_adapter():
    """Import the adapter, which installs itself into ``deepspeed.runtime.engine``, and
    return the factory it put there."""
    try:
        importlib.import_module(ADAPTER)
    except Exception as e:
        raise FtmemNotInstalled(missing_adapter_message(e)) from e
    logging.getLogger("ftmem").info("the DeepSpeed config selects \"engine\": \"ftmem\": installed %s", ADAPTER)
    return sys.modules[WATCHED_MODULE].create_checkpoint_engine


def selects_ftmem(config_params) -> bool:
    checkpoint = (getattr(config_params, "_param_dict", None) or {}).get("checkpoint") or {}
    return checkpoint.get("engine") == ENGINE_NAME


def guard_engine_factory(module) -> None:
    """Put the check in front of ``module.create_checkpoint_engine``.

    ``import ftmem_deepspeed`` wraps this name again and answers "ftmem" itself, so the
    check only ever sees "ftmem" when that import has not happened yet: it happens then.
    A patched DeepSpeed (``FTMEM_NATIVE``) knows the engine and is left alone.
    """
    factory = module.create_checkpoint_engine
    factory_module = sys.modules.get(getattr(factory, "__module__", ""), None)
    if getattr(factory_module, "FTMEM_NATIVE", False):
        return

    @functools.wraps(factory)
    def create_checkpoint_engine(config_params, *args, **kwargs):
        if selects_ftmem(config_params):
            return install_adapter()(config_params, *args, **kwargs)
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
                      f"`import {ADAPTER}` to take effect.")


class FtmemStubFile(RuntimeError):
    """A DeepSpeed checkpoint file that ftmem wrote as a stub was read as a real one."""


def ftmem_in_memory_checkpoint_stub(info: dict):
    """What a stub file unpickles to outside ftmem's DeepSpeed engine: this error. A stub
    is a valid torch archive whose pickle calls this (see ftmem_deepspeed.stub), so
    ``torch.load`` of it, by DeepSpeed's own file readers (zero_to_fp32, ...) or by a
    user, says what the file is and how to get real files, not ``invalid load key``."""
    job = info.get("job", "J")
    raise FtmemStubFile(
        f"{info.get('tag_file', 'this file')} is a stub of ftmem's in-memory checkpoint of job {job}: its data "
        f"is in the job's shared memory. Only the job's own rank processes read it (not processes they fork or spawn), "
        f"while the ftmem engine that saved or restored it runs: load_checkpoint, and reads made on every rank at once "
        f"(zero_to_fp32, torch.load). For "
        f"real checkpoint files, run `ftmem export --job {job} --out DIR` while the job's memory is held, or set "
        f"ftmem's persistent tier (\"persist\" in the \"ftmem\" config), which writes them in the background.")
