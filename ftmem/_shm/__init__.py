"""Shared memory and the snapshot management process (SMP): a rank's slots, their allocation, the SMP and its client, the job's node directories, and the integrity check of held versions.

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
