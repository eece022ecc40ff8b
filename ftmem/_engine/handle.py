"""The handle of a save in flight, with its two completion points."""
from __future__ import annotations

import threading
import time
from typing import Optional

from ftmem._shm.slots import VersionRef


class SaveHandle:
    """A save of ``version`` in flight.

    * ``wait_reusable()``: this rank's bytes are in shared memory (checksumming and
      committing them follow on the copy thread); the source tensors may be modified
      again (call it before the optimizer step).
    * ``wait_committed()``: every rank of the job has committed the version. Until
      then no rank overwrites its older version, so that a crash at any moment
      leaves one version that all ranks hold.

    ``copy_s`` and ``commit_s`` say how long each part took (None until it is done):
    from the start of the copy to reusable, and from reusable to committed (checksum,
    commit marker, parity, agreement).
    """

    def __init__(self, version: int, ref: Optional[VersionRef] = None):
        self.version = version
        self.ref = ref  # the save, told apart from any other of the same number (what stubs record)
        self._reusable = threading.Event()
        self._committed = threading.Event()
        self._error: Optional[BaseException] = None
        self._started = time.monotonic()
        self.copy_s: Optional[float] = None
        self.commit_s: Optional[float] = None

    def reusable(self) -> bool:
        return self._reusable.is_set()

    def committed(self) -> bool:
        return self._committed.is_set()

    def wait_reusable(self, timeout: Optional[float] = None) -> None:
        self._wait(self._reusable, timeout, "copying")

    def wait_committed(self, timeout: Optional[float] = None) -> None:
        self._wait(self._committed, timeout, "waiting for the other ranks to commit it")

    def _wait(self, event: threading.Event, timeout: Optional[float], doing: str) -> None:
        if not event.wait(timeout):
            raise TimeoutError(f"ftmem: save of version {self.version} still {doing} after {timeout} s")
        if self._error is not None:
            raise self._error

    # -- set by the engine's copy thread ---------------------------------------
    def _set_reusable(self) -> None:
        self.copy_s = time.monotonic() - self._started
        self._reusable.set()

    def _set_committed(self) -> None:
        self.commit_s = time.monotonic() - self._started - self.copy_s
        self._committed.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._reusable.set()
        self._committed.set()
