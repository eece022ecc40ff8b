"""What makes a checkpoint on disk survive a power loss, not only a crash of processes.

A rename is atomic for processes, but a machine that loses power (or a VM that is reclaimed)
right after it may keep the new name over files whose bytes never reached the disk, and an
older checkpoint deleted on the strength of it is gone too. So a checkpoint is published in
the order a database writes its log:

1. every rank fsyncs the files it wrote into the staging directory, then the directories that
   name them, up to the staging directory itself (:class:`Written`);
2. once every rank has, one renames the staging directory into place and fsyncs the directory
   that holds it;
3. the pointer the framework reads (DeepSpeed's ``latest``, Megatron's tracker) and the
   manifest are each written under a temporary name, fsynced, renamed, and their directory
   fsynced (:func:`ftmem._shm.private.write_atomically`);
4. only then are the checkpoints beyond ``keep`` deleted.

``"persist": {"fsync": false}`` leaves out the fsyncs of step 1 and 2 and of the manifest (the
costly part: every byte of the checkpoint), for file systems where they are pointless (a
RAM disk) or costly beyond what a power loss risks; the pointer files, a few bytes each, are
always synced.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

from ftmem._shm.private import sync


class Written:
    """The files one rank wrote into ``staging``, as its format reports each one (this is the
    format's ``wrote`` callback): counted for progress reports (``on_bytes``), and synced with
    the directories that name them by :meth:`sync`."""

    def __init__(self, staging: str, on_bytes: Optional[Callable[[int], None]] = None):
        self.staging, self.nbytes = os.path.normpath(staging), 0
        self._paths: list[str] = []
        self._on_bytes = on_bytes

    def __call__(self, path: str) -> None:
        size = os.path.getsize(path)
        self._paths.append(path)
        self.nbytes += size
        if self._on_bytes is not None:
            self._on_bytes(size)

    def sync(self) -> float:
        """fsync every file reported, then every directory from each file's own up to the
        staging directory, each once, the deepest first; the seconds it took."""
        started = time.monotonic()
        folders = set()
        for path in self._paths:
            sync(path)
            folder = os.path.dirname(os.path.normpath(path))
            while (folder == self.staging or folder.startswith(self.staging + os.sep)) and folder not in folders:
                folders.add(folder)
                folder = os.path.dirname(folder)
        for folder in sorted(folders, key=lambda f: f.count(os.sep), reverse=True):
            sync(folder)
        return time.monotonic() - started
