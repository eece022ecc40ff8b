"""ftmem's one logger, and the user-facing log lines of the contract (see docs/operations.md).

Library code logs through :data:`log` (the ``ftmem`` logger), never ``print``. Unless
the application has configured that logger itself, it gets one handler writing
``ftmem: <message>`` to stderr at INFO (``FTMEM_LOG_LEVEL`` changes the level), so the
lines a user and the tests look for appear without any logging setup.

Two kinds of lines:

* job lines (:func:`job_info`) are about the job as a whole and are logged once, by
  rank 0;
* rank lines (:func:`rank_info`, :func:`rank_warning`) are about one rank and name it.

The contract lines that scripts and monitoring parse are formatted only here
(:func:`restored_from_memory`, :func:`restored_from_disk`), and tests match them
through the same functions.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

log = logging.getLogger("ftmem")

_PREFIX = "ftmem: "


def _install_default_handler() -> None:
    """A handler of our own only where the application set up none for ``ftmem``."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_PREFIX + "%(message)s"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("FTMEM_LOG_LEVEL", "INFO").upper())
    log.propagate = False  # the application's root handlers would print each line twice


_install_default_handler()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def job_info(message: str, *args) -> None:
    """A line about the whole job: logged by rank 0 only."""
    if _rank() == 0:
        log.info(message, *args)


def rank_info(rank: int, message: str, *args) -> None:
    """A line about one rank, named as such."""
    log.info("rank %d: " + message, rank, *args)


def rank_warning(rank: int, message: str, *args) -> None:
    log.warning("rank %d: " + message, rank, *args)


def rank_error(rank: int, message: str, *args) -> None:
    log.error("rank %d: " + message, rank, *args)


def flush_logs() -> None:
    """Write out what the log handlers and the standard streams hold: before a process ends
    without running its exit handlers (``os._exit``, a signal's default action)."""
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush(), sys.stderr.flush()


# -- the contract lines ----------------------------------------------------------------
def restored_from_memory(iteration: int, rank: int, detail: str = "", rebuilt: bool = False) -> str:
    """``ftmem: restored iteration N from memory (rank R[, detail][, rebuilt from parity])``."""
    parts = [f"rank {rank}"] + ([detail] if detail else []) + (["rebuilt from parity"] if rebuilt else [])
    return f"{_PREFIX}restored iteration {iteration} from memory ({', '.join(parts)})"


def restored_from_disk(iteration: int, directory: str, rank: int, reason: Optional[str]) -> str:
    """``ftmem: restored iteration N from disk <dir> (rank R; memory could not serve: <reason>)``."""
    why = f"; memory could not serve: {reason}" if reason else ""
    return f"{_PREFIX}restored iteration {iteration} from disk {directory} (rank {rank}{why})"


def announce(line: str) -> None:
    """Log a contract line (already prefixed) on every rank it concerns."""
    log.info("%s", line.removeprefix(_PREFIX))
