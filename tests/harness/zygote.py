"""A fork server for rank processes: ``python -m tests.harness.zygote deepspeed|megatron|megatron-lm|torch``
imports torch and that framework (or torch alone) once, then forks one child per rank on
request. Each child
becomes ``python -m <module> <args>`` with its own environment, working directory and
log, and is a real process of its own: SIGKILLed for real, its memory its own, ending
through the interpreter's ordinary exit (atexit handlers, ``sys.excepthook``, exit code).

Starting a rank this way skips the 2–6 s of imports a cold interpreter spends on every
rank, which was most of the suite's time in multi-process tests (tests/harness/ranks.py
says which jobs may start this way).

Protocol, one JSON object per line: requests on stdin ``{"module", "args", "env", "cwd",
"log"}`` (fork a rank) or ``{"kill": P}`` (SIGKILL child P, unless it has ended); on
stdout, for each request in order ``{"pid": P}``, and for each child that
ended ``{"pid": P, "code": C}`` (C as ``subprocess.Popen.returncode``: ``-N`` for signal N).
An ended child is reaped only when it is reported, and the test kills a child through the
server, which kills only a child it has not reaped: a pid is never reused under a kill. The
server exits when its stdin closes, killing the children left.
"""
import json
import os
import runpy
import select
import signal
import sys

#: what every forked rank finds imported; anything else it imports itself. Where the
#: server's PYTHONPATH brings the framework's own tree, it is imported from there, as the
#: rank would (Megatron-LM's with its training package); where the path may change it
#: otherwise (``torch``), only torch and numpy.
PRELOAD = {"deepspeed": ("torch", "numpy", "deepspeed"),
           "megatron": ("torch", "numpy", "megatron.core", "megatron.core.models.gpt"),
           "megatron-lm": ("torch", "numpy", "megatron.core", "megatron.core.models.gpt", "megatron.training"),
           "torch": ("torch", "numpy")}


def _preload(which: str) -> None:
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes on missing Apex: each rank prints its own
        for name in PRELOAD[which]:
            importlib.import_module(name)


def _send(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _reap(out, children: set) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _send(out, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve(requests, out) -> dict:
    """Fork a child for each request; return the request in the child (never in the server)."""
    children: set = set()
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        _reap(out, children)
        if not ready:
            continue
        chunk = os.read(requests.fileno(), 1 << 16)
        if not chunk:  # the test session ended: no child outlives the server
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            sys.exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "kill" in request:  # only a child not reaped yet: its pid is still that rank's
                if request["kill"] in children:
                    os.kill(request["kill"], signal.SIGKILL)
                continue
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            _send(out, {"pid": pid})


def _redirect_log_handlers(old, new) -> None:
    """Log handlers made at a preloaded import (DeepSpeed's logger writes to stdout) hold the
    server's stdout, which the child closed: point them at the rank's, as a cold start has them."""
    import logging

    loggers = [logging.getLogger(), *(each for each in logging.Logger.manager.loggerDict.values()
                                      if isinstance(each, logging.Logger))]
    for handler in (handler for each in loggers for handler in each.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.stream = new  # not setStream, which flushes the closed one first


def _become(request: dict, channel: list) -> None:
    """Turn this fresh child into the rank the request describes."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it; a rank does not
    for f in channel:  # the server's stdin and its replies (stdin's descriptor stays open: dup2 replaces it)
        f.close()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(log)
    os.close(devnull)
    server_stdout = sys.stdout
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    _redirect_log_handlers(server_stdout, sys.stdout)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if os.environ.get("PYTHONFAULTHANDLER"):  # read by a cold interpreter at its start
        import faulthandler

        faulthandler.enable()
    # What a cold interpreter seeds from the OS, each rank its own (``random`` reseeds at fork by itself).
    import numpy

    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = [request["module"], *request["args"]]


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the test session ends it, which closes stdin
    # The replies keep stdout's pipe to themselves: whatever the server's process prints goes to
    # stderr instead (DeepSpeed 0.17's logger writes a line to stdout at import), never into them.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload(sys.argv[1])
    channel = [sys.stdin, replies]
    rank = _serve(sys.stdin, replies)
    _become(rank, channel)
    del channel
    # As ``python -m``: an uncaught exception reaches sys.excepthook, SystemExit gives the code.
    runpy.run_module(rank["module"], run_name="__main__", alter_sys=True)
