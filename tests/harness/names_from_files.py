"""Print the command prefix under which the test suite runs: its processes resolve host names
and addresses from /etc/hosts alone (``benchmarks.bench_control_plane.names_from_files``), or
nothing where this process cannot arrange that (not root).

torch's TCP store looks up the address of every new connection by name on the one thread that
serves every request, and the project's CPU machine's resolver drops about one query in 30 to
50, each then costing its 5 s timeout: the whole store stalls for 5 s, longer than the 4 s
failure-detector timeouts some tests run at, and every rank of the job ends on "the job's store
has not answered" (seen with two runs of the suite side by side, which make twice the
connections). Usage: ``python -m tests.harness.names_from_files DIRECTORY`` (where the
nsswitch.conf it mounts is written)."""
import os
import shlex
import sys

from benchmarks.bench_control_plane import names_from_files

if __name__ == "__main__":
    directory = sys.argv[1]
    os.makedirs(directory, exist_ok=True)
    print(shlex.join(names_from_files(os.path.abspath(directory))))
