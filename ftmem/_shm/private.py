"""Directories and files ftmem keeps in shared memory, private to the user who runs the job.

The shared-memory filesystem (/dev/shm) is writable by every local user, so whatever
ftmem finds there and did not create this instant may have been planted by another.
Hence:

* every directory ftmem uses there is owned by this user, is no symbolic link, and is
  writable by nobody else; one that is not is refused with the reason
  (:class:`~ftmem.errors.UnsafeSharedMemory`), never used or repaired;
* directories are created 0700 and files 0600, whatever the umask;
* no file is opened through a symbolic link (``O_NOFOLLOW``), and new files are created
  exclusively (``O_EXCL``) or written under a temporary name and renamed into place.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import stat
from typing import Iterator, Optional

from ftmem.errors import UnsafeSharedMemory

DIR_MODE = 0o700
FILE_MODE = 0o600
# Where another user's hand would let it change what ftmem reads.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:  # a uid with no name here
        return f"uid {uid}"


def check_private_dir(path: str) -> None:
    """Refuse ``path`` unless it is a real directory of this user that nobody else may
    write; tighten it to 0700 if others may only read it (snapshots hold RNG state and
    configs). FileNotFoundError if it does not exist."""
    st = os.lstat(path)
    remedy = (f"ftmem keeps a job's memory only in directories of its own user. Remove it (`rm -r {path}`, "
              f"as its owner or root), or give the job another \"shm_dir\" / --ftmem-shm-dir / --shm-dir.")
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSharedMemory(f"{path} is a symbolic link (to {os.readlink(path)}), not a directory: {remedy}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSharedMemory(f"{path} is not a directory: {remedy}")
    if st.st_uid != os.geteuid():
        raise UnsafeSharedMemory(f"{path} belongs to {_owner(st.st_uid)}, not to this user ({_owner(os.geteuid())}): "
                                 f"its owner could plant what ftmem reads there. {remedy}")
    if st.st_mode & _OTHERS_WRITE:
        raise UnsafeSharedMemory(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may write in it and "
                                 f"plant what ftmem reads there. {remedy}")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def private_dir(path: str) -> None:
    """Create ``path`` 0700 unless it exists, and check it (:func:`check_private_dir`)."""
    try:
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass  # someone's: checked below like any directory found
    check_private_dir(path)


def open_private(path: str, flags: int) -> int:
    """A descriptor of ``path``, never through a symbolic link; a file it creates is 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    if flags & os.O_CREAT:
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have taken bits from the mode, never added any
        except BaseException:
            os.close(fd)
            raise
    return fd


def read_private(path: str) -> bytes:
    """The bytes of ``path``, not read through a symbolic link (ELOOP if it is one)."""
    with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:
        return f.read()


def write_new(path: str, data: bytes) -> None:
    """Create ``path`` (0600) holding ``data``; FileExistsError if anything has the name."""
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
        f.write(data)


def write_first(path: str, data: bytes, scratch: str) -> None:
    """Create ``path`` holding ``data`` unless something has the name (the first writer's
    stays): written whole under ``scratch``, a name of this writer's own, then linked, so that a
    reader sees all of it or none."""
    write_new(scratch, data)
    try:
        os.link(scratch, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(scratch)


def write_atomically(path: str, data: bytes, private: bool = False, durable: Optional[bool] = None) -> None:
    """Replace ``path`` by a file holding ``data``: readers see the old or the new bytes,
    never part of them. A symbolic link at ``path`` is replaced, not followed. The file
    is 0600 if ``private`` (shared memory), else as the umask makes it (a checkpoint on
    disk, which other users of the cluster may be meant to read). A ``durable`` write (a
    file on disk, by default) survives a power loss once this returns: its bytes are synced
    before the rename and its directory after, or a machine that loses power could keep the
    new name over an empty file."""
    durable = not private if durable is None else durable
    tmp = f"{path}.tmp.{os.getpid()}"
    unlink_if_present(tmp)  # left by a killed process whose pid this one reuses
    with writing_temporary(tmp):
        if private:
            write_new(tmp, data)
        else:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666),
                           "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        sync(os.path.dirname(path) or ".")


def sync(path: str) -> None:
    """fsync a file, or a directory (its entries: the names of what was made, renamed or
    removed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing_temporary(tmp: str) -> Iterator[None]:
    """Around the writing of ``tmp``, a file renamed into place once whole: a failure
    removes it, and an OSError without a file name gets ``tmp`` as its name (a full disk
    that the close of a buffered file finds is raised without one)."""
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            raise OSError(e.errno, e.strerror, tmp) from e
        raise


def unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
