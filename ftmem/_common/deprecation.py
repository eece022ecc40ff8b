"""Renamed parts of the public API (``ftmem``, ``ftmem.adapter``, ``ftmem.errors``) keep their
old name for one minor release, as an alias that warns, before it goes (CHANGELOG.md,
docs/compatibility.md). A script written against the previous release goes on working, and
says what to change."""
from __future__ import annotations

import warnings

#: every alias made here, for the rule that each is gone by the release it names (tests)
ALIASES: list["Renamed"] = []


class Renamed:
    """A class attribute under its old name: what the new name gives, with a DeprecationWarning
    pointing at the caller's line."""

    def __init__(self, new: str, since: str, removed_in: str):
        self.new, self.since, self.removed_in = new, since, removed_in
        self.old = self.owner = ""
        ALIASES.append(self)

    def __set_name__(self, owner, name: str) -> None:
        self.owner, self.old = owner.__name__, name

    def __get__(self, obj, objtype=None):
        warnings.warn(f"{self.owner}.{self.old} is deprecated since ftmem {self.since}, and goes in {self.removed_in}: "
                      f"use {self.owner}.{self.new}", DeprecationWarning, stacklevel=2)
        return getattr(objtype if obj is None else obj, self.new)
