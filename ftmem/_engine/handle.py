"""The handle of a save in flight, with its two completion points."""
from __future__ import annotations

import threading
import time
from typing import Optional

from ftmem._common.deprecation import Renamed
from ftmem.errors import FtmemError
from ftmem._shm.slots import VersionRef


class SaveHandle:
    """A save of ``version`` in flight.

    * ``wait_reusable()``: this rank's bytes are in shared memory (checksumming and
      committing them follow on the copy thread), or the save was skipped; the source
      tensors may be modified again (call it before the optimizer step). Without a
      ``timeout``, at most ``copy_bound_s`` (:func:`ftmem._state.copier.copy_bound_s`): a copy
      that takes longer is stuck (a device or the machine), and the wait says so.
    * ``wait_protected()``: the job is done with the save: every rank protected it
      (``protected`` is True), or it protected a newer save first, or skipped this one
      (:mod:`ftmem._engine.commit`). The training never needs to wait for this.

    ``copy_s`` and ``protect_s`` say how long each part took (None until it is done): from
    the start of the copy to reusable, and from reusable to protected (checksum, commit
    marker, the wait behind an older version's protection, parity, agreement). ``cpu_s``
    is the CPU time ftmem's threads spent on the save's bytes until it was committed: the
    copy, the checksum (on every thread that took part) and the commit marker (None until
    then, and for a save skipped).
    """

    def __init__(self, version: int, ref: Optional[VersionRef] = None, copy_bound_s: Optional[float] = None,
                 tensors: int = 0):
        self.version = version
        self.tensors = tensors  # in the saved state, each view of the same elements counted once
        self.copy_bound_s = copy_bound_s
        self.ref = ref  # the save, told apart from any other of the same number (what stubs record)
        self._reusable = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._started = time.monotonic()
        self.copy_s: Optional[float] = None
        self.protect_s: Optional[float] = None
        self.cpu_s: Optional[float] = None
        self.skipped = False  # no slot was free: nothing was copied (two slots, a protection running)
        self.protected = False  # this very save was protected (not only a newer one)

    def reusable(self) -> bool:
        return self._reusable.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait_reusable(self, timeout: Optional[float] = None) -> None:
        if timeout is None and self.copy_bound_s is not None:
            if not self._reusable.wait(self.copy_bound_s):
                raise FtmemError(f"the copy of version {self.version} into shared memory has not ended within "
                                 f"{self.copy_bound_s:.0f} s (FTMEM_COPY_TIMEOUT_S, plus a second per 50 MB): a device "
                                 f"or the machine is stuck. The training cannot go on safely; restart the job.")
        self._wait(self._reusable, timeout, "copying")

    def wait_protected(self, timeout: Optional[float] = None) -> None:
        self._wait(self._done, timeout, "waiting to be protected")

    # 0.1.0's wait for this rank's commit of the save; waiting for its protection waits for that too.
    wait_committed = Renamed("wait_protected", since="0.2.0", removed_in="0.3.0")

    def _wait(self, event: threading.Event, timeout: Optional[float], doing: str) -> None:
        if not event.wait(timeout):
            raise TimeoutError(f"ftmem: save of version {self.version} still {doing} after {timeout} s")
        if self._error is not None:
            raise self._error

    # -- set by the engine's threads -------------------------------------------------
    def _set_reusable(self) -> None:
        self.copy_s = time.monotonic() - self._started
        self._reusable.set()

    def _skip(self) -> None:
        self.skipped = True
        self.copy_s = 0.0
        self._reusable.set()

    def _set_done(self, protected: bool) -> None:
        self.protected = protected
        if protected:
            self.protect_s = time.monotonic() - self._started - self.copy_s
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._reusable.set()
        self._done.set()
