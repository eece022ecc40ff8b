"""The engine: a rank's save and restore, the commit protocol, the save handle, the job-wide rendezvous, and versions of other jobs (ownership, elastic adoption).

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
