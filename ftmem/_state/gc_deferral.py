"""Keep Python's cyclic garbage collector out of a save call.

A save builds tens of thousands of short-lived objects (megatron-core's sharded state
dicts, the skeleton's pickle). With the collector on, every collection during the call
moves the ones still alive into an older generation, and the count of objects moved there
is what triggers a full collection of the training process (about 0.1 s) every few saves.
With it off for the call, they die by reference counting when the call returns and are
never moved (docs/benchmarks.md has the collections counted with and without it).
Megatron-LM's ``--manual-gc`` turns the collector off for the same reason; then this does nothing.
"""
from __future__ import annotations

import gc
from typing import Callable, TypeVar

T = TypeVar("T")


def with_collection_deferred(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` with the collector off, if it was on; it is on again once ``fn``
    has returned, and the objects only its frame held are gone. (A block of code would still
    hold its objects as the collector came on, and the first allocation after would have a
    collection scan them all: a few milliseconds of a Megatron save call.)"""
    if not gc.isenabled():
        return fn(*args, **kwargs)
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        gc.enable()
