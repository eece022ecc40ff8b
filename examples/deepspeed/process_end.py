"""How the DeepSpeed scripts end their process: without Python's finalization.

DeepSpeed keeps its gloo groups past ``destroy_process_group()``: the world group in
``deepspeed.utils.groups`` and one in every parameter's ``_dp_group``, which stay alive
after the engine is destroyed and collected. So each group's two gloo worker threads
still run while the interpreter finalizes. A worker that then drops the last reference
to a tensor whose Python object PyTorch keeps alive for C++ must take the GIL; after
finalization has begun, Python ends such a thread with ``pthread_exit``, whose unwinding
through PyTorch's ``noexcept`` code calls ``std::terminate``: the rank aborts at a clean
exit ("terminate called without an active exception", exit -6), now and then, more
often on a loaded machine. A two-rank gloo script that keeps one group and ends right
after a collective on a temporary tensor shows it (4 aborts in 30 processes here);
``shutdown()`` and ``abort()`` of the group leave the threads running. Leaving with
``os._exit`` once everything is written skips the finalization those threads race with.
"""
import logging
import os
import sys

import torch


def end_process(engine) -> None:
    """Destroy ``engine`` and the process groups (ftmem's end of the job runs there, when
    ftmem checkpoints), flush what the process wrote, and exit with status 0."""
    engine.destroy()
    torch.distributed.destroy_process_group()  # as PyTorch asks
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
