"""Keep the training's torch-function modes out of the save call's look at its tensors.

A ``TorchFunctionMode`` that the training thread has on (``torch.device`` used as a context
manager, a profiler's, the CPU support's device rewrite in :mod:`ftmem_megatron.cpu`) makes
every tensor attribute and method a Python call through the mode. A save call asks each of
thousands of tensors for its address, shape, dtype, strides, device and ``requires_grad``, and
clones the few that the next forward writes: under one such mode that made the core's part of
the call about five times slower (52 ms against 10 ms at 3,860 tensors, on the project's CPU
machine). ftmem reads only plain tensors there (it refuses subclasses, whose own
``__torch_function__`` this would skip), whose metadata no mode may answer otherwise, and its
clones are its own, so it runs those steps with torch-function handling off. Modes of torch's
dispatcher (``TorchDispatchMode``) are not affected; nor is any thread but the caller's.
"""
from __future__ import annotations

# A private name (declared in ftmem._common.compat); torch's own code switches the handling off with it.
from torch._C import DisableTorchFunction as modes_off
