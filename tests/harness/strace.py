"""What a process asked the kernel to do, read off a real run by ``strace``: the calls as the
kernel sees them, each file and directory named by its descriptor's path, each call with the
thread that made it."""
import os
import re
import shutil
from typing import NamedTuple, Sequence

# The calls that make a file durable, publish it, or delete it.
CALLS = "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,rmdir"
# One call as ``strace -f -y`` writes it: the thread, the call and its arguments, descriptors with their paths;
# or, where another thread's call came between, its start and, later, its end.
_LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
_STARTED = re.compile(r"^(\d+)\s+(\w+)\((.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>(.*)\)\s+=\s+(-?\d+)")
_ARGS = re.compile(r'<([^<>]*)>|"([^"]*)"')


class Call(NamedTuple):
    tid: int  # the thread that made it
    name: str
    paths: list[str]


def strace(trace: str) -> list[str]:
    """The command prefix that traces :data:`CALLS` of a process and its threads into ``trace``
    (only those calls stop the process: ``--seccomp-bpf``). A program it starts is not traced
    (``-b execve``): an SMP outlives its rank, and strace would wait for it."""
    assert shutil.which("strace"), "strace is part of this project's test machines (DESIGN: the machine)"
    return ["strace", "-f", "-b", "execve", "-y", "-qq", "--seccomp-bpf", "-e", f"trace={CALLS}", "-o", trace]


def calls_in(trace: str) -> list[Call]:
    """Every successful call in ``trace``, in the order they started."""
    started: list = []  # per call: [tid, name, arguments, result], the result None until it ends
    running: dict[int, list] = {}  # per thread, its call that another thread's came into
    with open(trace) as f:
        for line in f.read().splitlines():
            if m := _LINE.match(line):
                started.append([int(m[1]), m[2], m[3], m[4]])
            elif m := _STARTED.match(line):
                running[int(m[1])] = call = [int(m[1]), m[2], m[3], None]
                started.append(call)
            elif (m := _RESUMED.match(line)) and int(m[1]) in running:
                call = running.pop(int(m[1]))
                call[2], call[3] = call[2] + m[3], m[4]
    return [Call(tid, name, _paths(args)) for tid, name, args, result in started if result == "0"]


def _paths(args: str) -> list[str]:
    """The paths a call names: a descriptor's path (fsync), a path given (rename), or a name
    in the directory of the descriptor before it (unlinkat, renameat)."""
    paths, folder = [], None
    for fd, name in _ARGS.findall(args):
        if fd:
            if folder is not None:
                paths.append(folder)
            folder = fd
        else:
            paths.append(os.path.join(folder, name) if folder is not None else name)
            folder = None
    return paths + ([folder] if folder is not None else [])


def first(calls: Sequence[Call], kind: str, *paths: str, after: int = -1, near: str = "") -> int:
    """The index of the first call of ``kind`` (a prefix: "rename" matches renameat2) after
    ``after`` that names paths ending as the patterns ``paths`` say, in order; fails naming it
    if none does, with the calls that name ``near``."""
    for i, call in enumerate(calls):
        ends = iter(call.paths)
        if i > after and call.name.startswith(kind) and all(any(re.search(f"{p}$", n) for n in ends) for p in paths):
            return i
    named = [f"{i}: {c.tid} {c.name} {c.paths}" for i, c in enumerate(calls) if near in " ".join(c.paths)]
    raise AssertionError(f"no {kind}({', '.join(paths)}) after call {after}; the calls naming {near!r} (the last "
                         f"200):\n" + "\n".join(named[-200:]))
