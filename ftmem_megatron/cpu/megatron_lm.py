"""Run Megatron-LM's own training loop (``megatron.training.pretrain``, 0.19.2) on a
machine without CUDA: CPU tensors, gloo. For tests; on GPUs, Megatron-LM runs as it is.

:func:`enable` first enables :mod:`ftmem_megatron.cpu.core` (megatron-core's CUDA
assumptions), then redirects the few calls of Megatron-LM's loop that assume a GPU and
have nothing to do with the model's arithmetic. Each is a wrapper of a module global that
Megatron-LM looks up at call time, or a stand-in for a ``torch.cuda`` function that
raises without CUDA:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless called with
  ``allow_no_cuda``, which ``pretrain`` does not pass: it gets it.
* ``_initialize_distributed`` sets a CUDA device and creates the model-parallel groups
  only where ``torch.cuda.device_count() > 0``, and ``_set_random_seed`` seeds the
  model-parallel RNG tracker on the same condition. The process group (the
  ``--distributed-backend``, gloo) is created first, and inside these two functions the
  device count answers 1: the groups and the tracker (the CPU tracker of cpu.core) are
  made as on a GPU.
* ``torch.cuda.synchronize`` (Megatron's timers, around every timed region): the CPU
  runs in order, there is nothing to wait for.
* ``torch.cuda.Stream`` and ``current_stream`` (``get_model`` wraps the model in DDP on a
  stream of its own): a stand-in stream whose waits do nothing, for the same reason.
* ``torch.cuda.get_rng_state`` / ``set_rng_state`` (Megatron's checkpoints carry the CUDA
  generator's state): no CUDA generator exists, its state is empty.
* ``megatron.training.arguments.get_device_arch_version`` (which asks for the
  properties of ``cuda:0``): answers 0, no GPU architecture; with TP > 1 Megatron-LM then
  asks for ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as on a GPU before Blackwell.
* The training data loader gets a torch generator of its own. Each iterator of a torch
  DataLoader draws a seed from its generator, by default the global one. On a GPU that
  draw leaves dropout's randomness alone (CUDA generators); on the CPU, dropout draws from
  the global generator, so a resumed job, which makes its iterator after the checkpoint's
  RNG state is restored, would draw other masks than the uninterrupted job.

Besides these, Megatron-LM needs flags that select its CPU-capable paths:
``--distributed-backend gloo --use-cpu-initialization --transformer-impl local
--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion
--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --rerun-mode disabled``
(the rerun state machine saves the CUDA RNG state before each step).
"""
from __future__ import annotations

import contextlib
import functools
from datetime import timedelta

import torch

from ftmem.adapter import CPU_SUPPORT, require_for

from . import core as cpu_core

_enabled = False


def enable() -> None:
    """Install the shims (idempotent); a no-op where CUDA is available."""
    global _enabled
    if _enabled or torch.cuda.is_available():
        return
    require_for(CPU_SUPPORT, "megatron-lm")
    cpu_core.enable()
    import megatron.training.arguments as mlm_arguments
    import megatron.training.initialize as mlm_initialize
    import megatron.training.training as mlm_training

    mlm_training.initialize_megatron = _allowing_no_cuda(mlm_training.initialize_megatron)
    mlm_initialize._initialize_distributed = _process_group_first(mlm_initialize._initialize_distributed)
    mlm_initialize._set_random_seed = cpu_core.within(_one_device, mlm_initialize._set_random_seed)
    mlm_training.build_pretraining_data_loader = _with_own_generator(mlm_training.build_pretraining_data_loader)
    mlm_arguments.get_device_arch_version = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _InOrderStream
    torch.cuda.current_stream = lambda *args, **kwargs: _InOrderStream()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    _enabled = True


def _allowing_no_cuda(initialize_megatron):
    @functools.wraps(initialize_megatron)
    def wrapper(*args, **kwargs):
        return initialize_megatron(*args, **dict(kwargs, allow_no_cuda=True))
    return wrapper


@contextlib.contextmanager
def _one_device():
    count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = count


def _process_group_first(initialize_distributed):
    @functools.wraps(initialize_distributed)
    def wrapper(*args, **kwargs):
        from megatron.training.global_vars import get_args

        megatron_args = get_args()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                backend=megatron_args.distributed_backend, world_size=megatron_args.world_size,
                rank=megatron_args.rank, timeout=timedelta(minutes=megatron_args.distributed_timeout_minutes))
        with _one_device():
            return initialize_distributed(*args, **kwargs)
    return wrapper


def _with_own_generator(build_data_loader):
    @functools.wraps(build_data_loader)
    def wrapper(*args, **kwargs):
        loader = build_data_loader(*args, **kwargs)
        if loader is not None:
            loader.generator = torch.Generator()
        return loader
    return wrapper


class _InOrderStream:
    """What Megatron-LM's loop asks of a CUDA stream, on the CPU, where work runs in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass
