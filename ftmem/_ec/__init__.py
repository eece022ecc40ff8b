"""Erasure coding across nodes: the codec (XOR, Reed-Solomon), the placement of parity, protecting and rebuilding versions, and the survival figures.

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
