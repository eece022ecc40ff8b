"""Examples on the bare engine: a toy trainer and the ``ftmem demo`` run; not imported by the library."""
