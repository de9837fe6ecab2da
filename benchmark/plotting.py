"""matplotlib for the benchmarks' PNGs, headless; None when it is not installed (the PNG is skipped)."""

from __future__ import annotations


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
