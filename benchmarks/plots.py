"""matplotlib for the benchmarks' ``--plot``, which only they need (the ``bench`` extra)."""
from __future__ import annotations


def pyplot():
    """matplotlib's pyplot, drawing to files (no display); a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'ftmem[bench]' (or pip install matplotlib).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
