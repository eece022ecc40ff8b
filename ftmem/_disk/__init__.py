"""The persistent tier and export: the framework's format on disk (the seam), the background flushes, and ftmem export.

Internal to ftmem: applications use ``ftmem``, adapters ``ftmem.adapter``."""
