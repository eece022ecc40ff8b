"""DeepSpeed examples: a small GPT, its trainer, the ``make demo`` run; not imported by the library."""
