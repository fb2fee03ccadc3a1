"""Fewer cyclic garbage collections while planning.

A search allocates millions of short-lived tuples (composer entries, options, front points) and holds hundreds of
thousands of long-lived ones (answers, lazy plans). With CPython's default thresholds (700, 10, 10) the collector
keeps rescanning the long-lived ones: 10-30 % of planning CPU on the planner-scale rows (OPT-350M on 512 GPUs under
torch, 4.8 -> 3.2 CPU-s in one run each). Young collections still run, a full one rarely; the thresholds come
back afterwards, and worker processes forked meanwhile inherit them.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

PLANNING_THRESHOLDS = (50_000, 20, 100)  # gen0 allocations, gen0 runs per gen1, gen1 runs per gen2 (gc.set_threshold)


@contextlib.contextmanager
def fewer_collections(thresholds: tuple[int, int, int] = PLANNING_THRESHOLDS) -> Iterator[None]:
    """Run the block with ``thresholds`` (never lower than the current ones), then restore the current ones."""
    old = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(thresholds, old)))
    try:
        yield
    finally:
        gc.set_threshold(*old)
