"""``--non-persistent-ckpt-type in_memory`` for an unpatched Megatron-LM: call
``ftmem_megatron.install()`` at the top of ``pretrain_gpt.py``, before Megatron parses
its args. ``patches/megatron-lm-0.19.2-ftmem.patch`` makes the same hooks native, for
those who keep a Megatron-LM fork; ``install()`` then changes nothing.

The hooks, each a wrapper of a module global that Megatron-LM looks up at call time:

* ``arguments._add_checkpointing_args`` also adds the ``--ftmem-*`` flags.
* ``arguments.validate_args`` lets ``in_memory`` through its check of the type (which
  knows "global" and "local" only) and then checks the ftmem flags with
  :func:`~ftmem_megatron.arguments.validate_ftmem_args`.
* ``checkpointing.save_checkpoint`` hands non-persistent saves to ftmem, and persistent
  ones too where ftmem writes them from memory (``--ckpt-format torch`` without the
  distributed optimizer, see :mod:`ftmem_megatron.format`); ``checkpointing.load_checkpoint``
  asks ftmem first. When memory has nothing newer than the disk, Megatron loads from
  ``--load`` as usual, with no non-persistent checkpoint of its own to look for, and
  ftmem logs why memory could not serve.
* ``async_utils.maybe_finalize_async_save``, which Megatron-LM calls with
  ``blocking=True`` before it exits, also waits for ftmem's flush in progress.

Every name is also replaced where a module imported it by name (``megatron.training.training``).
"""
from __future__ import annotations

import functools
import inspect
import sys

import megatron.training.arguments as mlm_arguments
import megatron.training.async_utils as mlm_async_utils
import megatron.training.checkpointing as mlm_checkpointing
from megatron.training.global_vars import get_args

from ftmem.adapter import check_versions

from . import checkpointing as ftmem_checkpointing
from .arguments import IN_MEMORY, add_ftmem_args, in_memory, validate_ftmem_args
from .format import flushes_from_memory

# Set on args while Megatron-LM's own validate_args runs with the type hidden.
_HIDDEN = "_ftmem_hidden_ckpt_type"


def install() -> None:
    """Install the hooks (idempotent; nothing to do on a Megatron-LM with the patch)."""
    if getattr(mlm_checkpointing, "FTMEM_NATIVE", False) or getattr(mlm_arguments.validate_args, "_ftmem", False):
        return
    check_versions("megatron-lm")
    _install_arguments()
    _install_checkpointing()


def _unhide(args) -> None:
    if vars(args).pop(_HIDDEN, False):
        args.non_persistent_ckpt_type = IN_MEMORY


def _install_arguments() -> None:
    stock_add = mlm_arguments._add_checkpointing_args
    stock_validate = mlm_arguments.validate_args
    stock_print = mlm_arguments._print_args

    @functools.wraps(stock_add)
    def _add_checkpointing_args(parser):
        return add_ftmem_args(stock_add(parser))

    @functools.wraps(stock_validate)
    def validate_args(args, defaults={}):
        # The stock check accepts "global", "local" and None; nothing else in it, nor in
        # parse_and_validate_args after it, differs between None and in_memory.
        if in_memory(args):
            args.non_persistent_ckpt_type = None
            setattr(args, _HIDDEN, True)
        try:
            result = stock_validate(args, defaults)
        finally:
            _unhide(args)
        validate_ftmem_args(args)
        return result

    @functools.wraps(stock_print)
    def _print_args(title, args):
        _unhide(args)  # the printout shows the type the job runs with
        return stock_print(title, args)

    validate_args._ftmem = True
    mlm_arguments._add_checkpointing_args = _add_checkpointing_args
    mlm_arguments.validate_args = validate_args
    mlm_arguments._print_args = _print_args


def _install_checkpointing() -> None:
    stock_save = mlm_checkpointing.save_checkpoint
    stock_load = mlm_checkpointing.load_checkpoint
    save_signature = inspect.signature(stock_save)

    @functools.wraps(stock_save)
    def save_checkpoint(*args, **kwargs):
        megatron_args = get_args()
        bound = save_signature.bind(*args, **kwargs)
        persistent = not bound.arguments.get("non_persistent_ckpt", False)
        if in_memory(megatron_args) and (not persistent or flushes_from_memory(megatron_args)):
            a = bound.arguments
            ftmem_checkpointing.save_checkpoint(a["iteration"], a["model"], a["optimizer"], a["opt_param_scheduler"],
                                                a["num_floating_point_operations_so_far"], megatron_args,
                                                persistent=persistent)
            return None
        return stock_save(*args, **kwargs)

    @functools.wraps(stock_load)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *args, **kwargs):
        megatron_args = get_args()
        if not (in_memory(megatron_args) and load_arg == "load"):
            return stock_load(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        loaded = ftmem_checkpointing.load_checkpoint(ddp_model, optimizer, opt_param_scheduler, megatron_args)
        if loaded is not None:
            _loaded_from_memory(loaded[0], megatron_args)
            return loaded  # (iteration, num_floating_point_operations_so_far)
        loaded = stock_load(ddp_model, optimizer, opt_param_scheduler, load_arg, *args, **kwargs)
        ftmem_checkpointing.report_disk_load(loaded[0], megatron_args)
        return loaded

    # The disk load after ftmem found nothing newer: no non-persistent checkpoint of
    # Megatron's own to look for (the stock function fails on an unknown type).
    stock_iteration = getattr(mlm_checkpointing, "_get_non_persistent_iteration", None)
    if stock_iteration is not None:
        @functools.wraps(stock_iteration)
        def _get_non_persistent_iteration(non_persistent_global_dir, args, *rest, **kwargs):
            if in_memory(args):
                return -1
            return stock_iteration(non_persistent_global_dir, args, *rest, **kwargs)

        mlm_checkpointing._get_non_persistent_iteration = _get_non_persistent_iteration

    stock_finalize = mlm_async_utils.maybe_finalize_async_save

    @functools.wraps(stock_finalize)
    def maybe_finalize_async_save(blocking: bool = False, *args, **kwargs):
        if blocking and in_memory(get_args()):
            ftmem_checkpointing.wait_flushed()
        return stock_finalize(blocking, *args, **kwargs)

    _replace_everywhere({stock_save: save_checkpoint, stock_load: load_checkpoint,
                         stock_finalize: maybe_finalize_async_save})


def _replace_everywhere(replacements: dict) -> None:
    """Every module that holds a stock function by its name (megatron.training.training
    imports them so), and the defining modules themselves, for modules imported later."""
    for module in list(sys.modules.values()):
        names = vars(module) if module is not None and hasattr(module, "__dict__") else {}
        for stock, wrapper in replacements.items():
            if names.get(stock.__name__) is stock:
                setattr(module, stock.__name__, wrapper)


def _loaded_from_memory(iteration: int, args) -> None:
    """What Megatron-LM's load_checkpoint does besides restoring state (version-dependent)."""
    mlm_checkpointing.set_checkpoint_version(3.0)
    if hasattr(mlm_checkpointing, "set_loaded_iteration"):
        mlm_checkpointing.set_loaded_iteration(iteration)
    update_num_microbatches = getattr(mlm_checkpointing, "update_num_microbatches", None)
    if update_num_microbatches is not None:
        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
