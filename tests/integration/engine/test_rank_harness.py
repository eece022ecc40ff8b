"""The test harness's fork server (tests/harness/zygote.py, ranks.py) against the kernel's
reuse of pids: a suite's run forks tens of thousands of processes and threads, and pids wrap
at pid_max. A rank forked with the pid of a rank that ended before was taken for ended at
once (its predecessor's exit code), and a test failed waiting for ranks that were running."""
import os
import time

from harness import ranks

LAST_PID = "/proc/sys/kernel/ns_last_pid"  # the pid the kernel gave last: the next fork gets the one after


def test_a_rank_given_the_pid_of_one_that_ended_is_not_taken_for_ended():
    server = ranks._ForkServer(ranks._import_env(os.environ), "torch")
    try:
        ended = server.fork("timeit", ["-n", "1", "-r", "1", "pass"], dict(os.environ), os.devnull)
        assert ranks.ForkedRank(server, ended).wait(60) == 0
        for _ in range(50):  # another process of the machine may take the pid first: try again
            with open(LAST_PID, "w") as f:
                f.write(str(ended - 1))
            again = server.fork("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(2)"], dict(os.environ),
                                os.devnull)
            if again == ended:
                break
            ranks.ForkedRank(server, again).wait(60)
        assert again == ended, f"the kernel did not give pid {ended} again in 50 forks"
        rank = ranks.ForkedRank(server, again)
        assert rank.poll() is None  # running: not the exit code of the rank that had its pid before
        started = time.monotonic()
        assert rank.wait(60) == 0 and time.monotonic() - started > 1.0
    finally:
        server.close()
