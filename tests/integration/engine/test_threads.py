"""ftmem's threads in the training process block the signals the process gets from outside
(ftmem/_common/threads.py): the kernel hands a process-directed signal to any thread that does
not block it, and one of ftmem's would keep it from interrupting what the main thread waits in.
Read from the kernel's own record of each thread's mask, in an engine that saved, protected and
checksummed."""
import re
import signal
import threading

import torch

from ftmem._common.threads import FROM_OUTSIDE
from harness.common import make_engine

# Two checksum chunks (ftmem._state.checksum.DATA_CHUNK): the checksum's pool threads take part.
STATE_BYTES = 2 * (64 << 20) + 4096


def _blocked(native_id: int) -> set:
    with open(f"/proc/self/task/{native_id}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return {s for s in signal.valid_signals() if mask >> (int(s) - 1) & 1}


def test_every_thread_of_ftmem_blocks_the_signals_from_outside_and_leaves_the_main_thread_s_mask_alone(shm_dir):
    main_before = _blocked(threading.main_thread().native_id)
    engine = make_engine(shm_dir)
    try:
        engine.save({"w": torch.ones(STATE_BYTES // 4)}, 1).wait_protected()
        ours = [t for t in threading.enumerate() if t.name.startswith("ftmem-")]
        kinds = {re.sub(r"_\d+$", "", t.name) for t in ours}
        assert {"ftmem-copy", "ftmem-checksum", "ftmem-preemption"} <= kinds, kinds
        for thread in ours:
            blocked = _blocked(thread.native_id)
            assert FROM_OUTSIDE <= blocked, (thread.name, sorted(FROM_OUTSIDE - blocked))
            assert signal.SIGSEGV not in blocked  # a fault in the thread's own code stays its own
        assert _blocked(threading.main_thread().native_id) == main_before
    finally:
        engine.close(job_finished=True)
