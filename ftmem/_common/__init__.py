"""What every layer of the engine uses: the job's identity and shared-memory layout, its parallel layout, the log lines of the contract, units, and the test hooks.

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
