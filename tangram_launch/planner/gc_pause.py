"""No cyclic garbage collections while planning.

A search allocates millions of short-lived tuples (composer entries, options, front points) and holds hundreds of
thousands of long-lived ones (answers, lazy plans), and it makes no reference cycles: every object it drops is
freed by its reference count (tests/test_planner_gc_pause.py collects after a search and finds nothing). The
cyclic collector then only rescans the long-lived objects to find nothing:
- With CPython's default thresholds (700, 10, 10) that is a sizeable share of planning CPU on the planner-scale rows
  (benchmarks/bench_planner_scale.py).
- With raised thresholds it still costs some: raising them further moves nothing, as each long-lived object is
  scanned about twice whatever the thresholds.

So the collector is off for the search, and back on afterwards as it was, with what the search kept moved to the
oldest generation unscanned (no_collections). Worker processes forked meanwhile inherit that: they serve this
search only. A parallelizer plugin that does make cycles leaves them for the next full collection.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """Run the block with the cyclic garbage collector off, then turn it back on if it was on.

    What the block allocated and kept joins the oldest generation unscanned (gc.freeze then gc.unfreeze, where
    nothing was frozen before): left in the youngest, the first collection afterwards would scan it all at once
    (after a large search, more than raised thresholds' collections cost). Like every long-lived object, it is
    scanned by the next full collection, which also frees any cycle among it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # (a caller's frozen objects stay frozen)
            gc.freeze()
            gc.unfreeze()
        if was_on:
            gc.enable()
