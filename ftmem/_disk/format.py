"""The seam between the engine and a framework adapter.

The engine snapshots opaque state; three things about that state only the framework
knows, and an adapter tells them through this seam:

* **what is replicated across DP**: the ``replicated(t)`` predicate handed to each
  :meth:`ftmem.SnapshotEngine.save` (through :meth:`ftmem.adapter.AdapterRuntime.save`): tensors
  identical on every replica of the rank's DP group, of which each replica keeps 1/D;
* **how a held version is written to disk in the framework's own layout**, for the
  persistent tier's flushes (:mod:`ftmem._disk.persist`) and ``ftmem export``
  (:mod:`ftmem._disk.export`): a :class:`FrameworkFormat`;
* **RNG capture and restore**: :meth:`FrameworkFormat.capture_rng` /
  :meth:`FrameworkFormat.restore_rng`, which a framework extends with its own
  generators (Megatron's model-parallel tracker), and :meth:`FrameworkFormat.read_rng`
  from a checkpoint on disk, where the framework's own load does not restore them.

A version records its format's :attr:`FrameworkFormat.name` in its commit record, and
export finds the class again through the ``ftmem.formats`` entry-point group, so the
core imports no adapter.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable, ClassVar, Sequence

from ftmem._state import rng
from ftmem.errors import FtmemError

ENTRY_POINT_GROUP = "ftmem.formats"

# Called with the path of each file written, once it is whole: for progress and throughput
# reports, and so that the persistent tier can sync it before it publishes the checkpoint.
Wrote = Callable[[str], None]


class FrameworkFormat:
    """A framework's checkpoint layout on disk, and its RNG. Subclass it per framework;
    it must be constructible without arguments (export builds one from its name)."""

    name: ClassVar[str]  # recorded in every version; the key of its ftmem.formats entry point

    def capture_rng(self) -> Any:
        """This rank's RNG states, saved with every version."""
        return rng.rng_states()

    def restore_rng(self, states: Any) -> None:
        rng.set_rng_states(states)

    def read_rng(self, directory: str, rank: int) -> Any:
        """``rank``'s RNG states from the checkpoint in ``directory`` that :meth:`write_rank`
        wrote, for a resume from it; None where the framework's own load restores them."""
        return None

    def checkpoint_name(self, version: int, state: Any) -> str:
        """The checkpoint's directory name under the persist dir (DeepSpeed: the tag)."""
        raise NotImplementedError

    def write_rank(self, state: Any, directory: str, rank: int, first_replica: bool, wrote: Wrote) -> None:
        """Write rank ``rank``'s files of ``state`` (a whole version of that rank) into
        ``directory``. Files every DP replica holds alike are written by the
        ``first_replica`` only."""
        raise NotImplementedError

    def write_group(self, group: Sequence[int], read_state: Callable[[int], Any], directory: str,
                    wrote: Wrote) -> str:
        """``ftmem export``: write the files of the DP group ``group`` (``read_state(rank)``
        gives a rank's whole version) into ``directory``; return the checkpoint's name.
        By default each rank's files in turn, one rank's state in memory at a time."""
        name = None
        for index, rank in enumerate(group):
            state = read_state(rank)
            self.write_rank(state, directory, rank, first_replica=index == 0, wrote=wrote)
            name = self.checkpoint_name(-1, state)
        return name

    def publish(self, root: str, name: str) -> None:
        """On one rank, after ``<root>/<name>`` is complete: point the framework at it
        (DeepSpeed's ``latest``, Megatron's tracker file)."""
        raise NotImplementedError


def format_named(name: str) -> FrameworkFormat:
    """The installed format of that name (entry points of group ``ftmem.formats``)."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        raise FtmemError(f"this version was saved through the {name!r} format, which is not installed here "
                         f"(installed: {', '.join(sorted(found)) or 'none'}). Install ftmem with that "
                         f"framework's extra, e.g. pip install \"ftmem[{name}]\".")
    return found[name].load()()
