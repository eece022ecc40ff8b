"""Training state <-> bytes: the snapshot plan, the metadata skeleton, the copy into a slot, checksums, and the tensors a restore writes into.

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
