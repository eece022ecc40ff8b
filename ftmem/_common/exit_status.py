"""How this process is ending: a finish, or a failure that the job must treat as one.

A job's end frees its memory only when every rank finished, and the failure detector reports
a rank that ends because it failed (:mod:`ftmem._engine.failure_detector`). Python tells an
exit hook neither how the process ends nor with which code, so this module notes the ways a
failing end shows, from the moment ftmem starts (:func:`watch`):

* an uncaught exception in the main thread: ``sys.excepthook`` sees it; where the
  application replaced that hook afterwards, the interpreter still keeps the exception it
  printed as ``sys.last_value``;
* ``sys.exit`` (or the builtin ``exit``/``quit``) with a code that is not 0 or None (a
  message is 1), called in the main thread. A ``sys.exit`` in another thread ends only that
  thread. Nothing Python keeps tells a
  ``SystemExit`` that ended the main thread from one a ``try`` caught (an argument parser's
  exit the script handles), so one the script carries on after counts no more once it saves
  again (:func:`carried_on`);
* an end the code says is one (:func:`note_failure`), a rank that stops for a reason of its
  own (``destroy_process_group()`` in a ``finally:`` after an exception, say).

What is not seen: ``raise SystemExit(code)``, which bypasses both (it counts as a finish, as
it did before ftmem), and ``os._exit`` (it runs no exit hook at all: the job's memory stays,
as after a crash).
"""
from __future__ import annotations

import builtins
import sys
import threading
from typing import Optional

_failure: Optional[str] = None
_exit_code = None  # that of the main thread's last sys.exit with a failing code, since it last saved
_watching = False


def watch() -> None:
    """Start noting failures (idempotent): wraps ``sys.excepthook``, ``sys.exit`` and the
    builtin ``exit``/``quit`` (the site module's, where Python has it), each of which goes on
    to do what it did."""
    global _watching
    if _watching:
        return
    _watching = True
    stock_hook, stock_exit = sys.excepthook, sys.exit

    def excepthook(kind, value, traceback):
        note_failure(f"an uncaught exception ({kind.__name__})")
        stock_hook(kind, value, traceback)

    def exit(status=None):
        _note_exit(status)
        stock_exit(status)

    sys.excepthook, sys.exit = excepthook, exit
    quitter = type(getattr(builtins, "exit", None))  # the site module's Quitter (NoneType under python -S)
    if "__call__" in vars(quitter) and isinstance(getattr(builtins, "quit", None), quitter):
        stock_quit = quitter.__call__

        def quit(self, code=None):
            _note_exit(code)
            return stock_quit(self, code)

        quitter.__call__ = quit


def _note_exit(code) -> None:
    global _exit_code
    if threading.current_thread() is threading.main_thread():
        _exit_code = code if code not in (0, None) else None


def note_failure(why: str) -> None:
    """This process ends as a failure (the first reason given holds)."""
    global _failure
    if _failure is None:
        _failure = why


def carried_on() -> None:
    """The main thread went on after a ``sys.exit`` it caught (it saves a version again)."""
    global _exit_code
    if threading.current_thread() is threading.main_thread():
        _exit_code = None


def failure() -> Optional[str]:
    """Why this process is ending as a failure; None while nothing says it does."""
    if _failure is not None:
        return _failure
    if getattr(sys, "last_value", None) is not None:  # printed by the interpreter: an uncaught exception
        return f"an uncaught exception ({type(sys.last_value).__name__})"
    if _exit_code is not None:
        return f"a non-zero exit ({_exit_code!r})"
    return None
