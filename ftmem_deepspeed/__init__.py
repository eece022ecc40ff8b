"""ftmem for DeepSpeed: ``import ftmem_deepspeed`` before ``deepspeed.initialize`` and
set ``"checkpoint": {"engine": "ftmem"}`` in the JSON config.

The import installs three small hooks (``patches/deepspeed-0.19.8-ftmem.patch`` makes
all three native, for those who keep a DeepSpeed fork; the import then changes nothing):

* DeepSpeed imports ``create_checkpoint_engine`` by name into
  ``deepspeed.runtime.engine``; that name is wrapped so that ``"engine": "ftmem"``
  selects :class:`FtmemCheckpointEngine`. Without it DeepSpeed behaves as before.
* ``DeepSpeedEngine._take_model_step`` (the optimizer step of both the plain and the
  pipeline engine) first waits until the last snapshot's copy is done, since the
  step overwrites what it copies.
* ``DeepSpeedEngine.load_checkpoint`` without a tag asks ftmem what to resume from
  (:meth:`FtmemCheckpointEngine.resume_point`) instead of trusting ``latest``, which
  DeepSpeed writes before the snapshot is committed, and not atomically. It names the
  engine's tensors that the restore may write straight into (:mod:`ftmem_deepspeed.targets`);
  the patch's native hook names none, and restores into fresh memory.

And one that the patch does not make native: ``torch.load`` of a stub in a live engine's
save dir is served from memory (:mod:`ftmem_deepspeed.serve`), for the DeepSpeed paths
and user scripts that read checkpoint files themselves (zero_to_fp32, ZeRO-3 loads
without optimizer states, a model-states file loaded by path).
"""
from __future__ import annotations

import functools
import inspect

from ftmem.adapter import check_versions

# Before anything of DeepSpeed's that a release may lack is imported: a DeepSpeed too old or
# too new for ftmem is refused here, naming what it lacks, not by an ImportError further down.
check_versions("deepspeed")

import deepspeed.runtime.checkpoint_engine.utils as ds_utils  # noqa: E402
import deepspeed.runtime.engine as ds_engine  # noqa: E402

from ftmem_guard import selects_ftmem  # noqa: E402

from .checkpoint_engine import FtmemCheckpointEngine  # noqa: E402
from .serve import install_torch_load_hook  # noqa: E402
from .targets import restore_targets  # noqa: E402


def install() -> None:
    """Install the hooks (idempotent; on a DeepSpeed with the patch, only the torch.load one)."""
    install_torch_load_hook()
    if getattr(ds_engine.create_checkpoint_engine, "_ftmem", False) or getattr(ds_utils, "FTMEM_NATIVE", False):
        return
    stock_factory = ds_engine.create_checkpoint_engine

    @functools.wraps(stock_factory)
    def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
        if selects_ftmem(config_params):
            return FtmemCheckpointEngine(config_params, zero_stage=zero_stage)
        return stock_factory(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state)

    create_checkpoint_engine._ftmem = True
    ds_engine.create_checkpoint_engine = create_checkpoint_engine

    stock_step = ds_engine.DeepSpeedEngine._take_model_step

    @functools.wraps(stock_step)
    def _take_model_step(self, *args, **kwargs):
        if isinstance(self.checkpoint_engine, FtmemCheckpointEngine):
            self.checkpoint_engine.wait_reusable()
        return stock_step(self, *args, **kwargs)

    ds_engine.DeepSpeedEngine._take_model_step = _take_model_step

    stock_load = ds_engine.DeepSpeedEngine.load_checkpoint

    @functools.wraps(stock_load)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        if not isinstance(self.checkpoint_engine, FtmemCheckpointEngine):
            return stock_load(self, load_dir, tag, *args, **kwargs)
        try:
            if tag is None:
                asked = inspect.signature(stock_load).bind(self, load_dir, tag, *args, **kwargs)
                asked.apply_defaults()
                point = self.checkpoint_engine.resume_point(load_dir, restore_targets(
                    self, asked.arguments["load_optimizer_states"], asked.arguments["load_module_only"],
                    asked.arguments["custom_load_fn"]))
                if point is None:
                    return None, None  # nothing to resume from: as stock DeepSpeed without a `latest`
                load_dir, tag = point
            return stock_load(self, load_dir, tag, *args, **kwargs)
        finally:
            self.checkpoint_engine.loaded()

    ds_engine.DeepSpeedEngine.load_checkpoint = load_checkpoint


install()

__all__ = ["FtmemCheckpointEngine", "install"]
