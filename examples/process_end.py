"""How our training scripts end their process: without Python's finalization.

DeepSpeed keeps its gloo groups past ``destroy_process_group()`` (the world group in
``deepspeed.utils.groups``, and one in every parameter's ``_dp_group``, alive after the
engine is destroyed and collected); Megatron-LM's ``pretrain()`` destroys none of its
groups; and in our megatron-core driver two groups' threads still run after
``destroy_model_parallel()``, ``destroy_process_group()``, the end of ``main`` and
``gc.collect()``. So gloo worker threads still run while the interpreter finalizes. A worker
that then drops the last reference to a tensor whose Python object PyTorch keeps alive
for C++ (a collective's temporary) must take the GIL; once finalization has begun,
Python ends such a thread with ``pthread_exit``, whose unwinding through PyTorch's
``noexcept`` code calls ``std::terminate``: the rank aborts after a clean run
("terminate called without an active exception", exit -6), now and then, more often on
a loaded machine. A two-rank gloo script that keeps one group and exits right after a
collective on a temporary tensor shows it (4 aborts in 30 processes here). A group's
``shutdown()`` and ``abort()`` leave its threads running; only its destructor joins them.
Leaving with ``os._exit`` once everything is written skips the finalization those
threads race with.
"""
import logging
import os
import sys

import torch


def end_process(exit_code=0) -> None:
    """Destroy the process groups (ftmem ends its job there, when it checkpoints; a
    ``SystemExit`` being handled counts as its code says), flush what the process wrote,
    and exit with ``exit_code`` (``sys.exit``'s meaning: None is 0, a message is 1)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # as PyTorch asks
    if isinstance(exit_code, str):
        print(exit_code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code if isinstance(exit_code, int) else int(exit_code is not None))
