"""Imported at start-up by every Python process of a `make test-peer` run (its folder is on
PYTHONPATH): pytest, and the ranks DeepSpeed's test harness starts from a forkserver, which
import no conftest.

* DeepSpeed's shared-memory communication op is not JIT-built (training on gloo does not use
  it), as in the suite's own DeepSpeed jobs.
* With ``FTMEM_PEER_MODE=ftmem``, every config handed to ``deepspeed.initialize`` selects
  ftmem through the JSON alone: ``"checkpoint": {"engine": "ftmem"}`` and an ``"ftmem"``
  section naming ``FTMEM_PEER_SHM_DIR``. Nothing imports ftmem_deepspeed: its torch.backends
  entry point does, as for a user who only edits the JSON. A test that sets its own
  ``"checkpoint"`` section (``{"load_universal": true}``) keeps it, with the engine added.
* With ``FTMEM_PEER_STACKS`` (a folder), SIGUSR1 makes the process write every thread's stack
  to ``<folder>/<pid>.txt`` (faulthandler, which answers even with the main thread stuck in C):
  the plugin sends it to a test's processes as the test runs out of time. A forked rank
  writes to a file of its own pid, and what a rank of DeepSpeed's harness raises goes to
  ``<folder>/raised-<pid>.txt``.
"""
import copy
import faulthandler
import functools
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import traceback


def _force_ftmem(config: dict) -> dict:
    config = copy.deepcopy(config)
    config["checkpoint"] = dict(config.get("checkpoint") or {}, engine="ftmem")
    config["ftmem"] = dict(config.get("ftmem") or {}, shm_dir=os.environ["FTMEM_PEER_SHM_DIR"])
    return config


def _wrapped_initialize(initialize):
    @functools.wraps(initialize)
    def wrapper(*args, **kwargs):
        config = kwargs.get("config")
        if isinstance(config, str):  # a path to the JSON
            with open(config) as f:
                config = json.load(f)
        if isinstance(config, dict):
            kwargs["config"] = _force_ftmem(config)
        else:
            # The config comes as args.deepspeed_config (a file): a forced copy beside it.
            ds_args = kwargs.get("args") if kwargs.get("args") is not None else (args[0] if args else None)
            path = getattr(ds_args, "deepspeed_config", None)
            if path:
                with open(path) as f:
                    forced = _force_ftmem(json.load(f))
                path = f"{path}.ftmem.json"
                with open(path, "w") as f:
                    json.dump(forced, f)
                ds_args.deepspeed_config = path
        return initialize(*args, **kwargs)

    return wrapper


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``adjust`` with the module ``name`` once it has been imported."""

    def __init__(self, name: str, adjust):
        self.name, self.adjust = name, adjust

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_adjust(module):
            exec_module(module)
            self.adjust(module)

        spec.loader.exec_module = exec_then_adjust
        return spec


def _adjust_deepspeed(deepspeed) -> None:
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if os.environ.get("FTMEM_PEER_MODE") == "ftmem":
        deepspeed.initialize = _wrapped_initialize(deepspeed.initialize)


def _note_what_a_rank_raises(common) -> None:
    """A rank of DeepSpeed's harness that raises leaves the pool, and its exception is read only
    once every rank is done: where the others then wait for it in a collective, the test hangs
    and the exception is never seen. Each is written to ``<FTMEM_PEER_STACKS>/raised-<pid>.txt``."""
    stock = common.DistributedExec._dist_run

    @functools.wraps(stock)
    def _dist_run(self, *args, **kwargs):
        try:
            return stock(self, *args, **kwargs)
        except BaseException:
            with open(os.path.join(os.environ["FTMEM_PEER_STACKS"], f"raised-{os.getpid()}.txt"), "w") as f:
                traceback.print_exc(file=f)
            raise

    common.DistributedExec._dist_run = _dist_run


def _stacks_on_sigusr1() -> None:
    folder = os.environ["FTMEM_PEER_STACKS"]
    os.makedirs(folder, exist_ok=True)
    # faulthandler keeps the file's descriptor, not the object: the file stays open with it.
    _stacks_on_sigusr1.file = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stacks_on_sigusr1.file, all_threads=True)


if os.environ.get("FTMEM_PEER_MODE"):
    sys.meta_path.insert(0, _AfterImport("deepspeed", _adjust_deepspeed))
if os.environ.get("FTMEM_PEER_STACKS"):
    _stacks_on_sigusr1()
    os.register_at_fork(after_in_child=_stacks_on_sigusr1)
    sys.meta_path.insert(0, _AfterImport("unit.common", _note_what_a_rank_raises))
