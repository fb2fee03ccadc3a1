"""Parallel parallelizer queries (paper §5.1, Fig. 6): a bounded process pool, infeasible answers dropped early.

Queries are independent, so they run in a ``concurrent.futures`` process pool (default ``min(2, cpu count)``
workers), in chunks so that the parallelizer and the shared model/island objects are pickled once per chunk, not
once per query. With one worker, or a parallelizer that cannot be pickled, queries run in this process. Progress
goes to stderr, only when stderr is a terminal and the run is long.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import pickle
import sys
import time
from typing import Callable, Sequence

from tangram_launch.costmodel.slice_plan import latency_floor_s, numbers_fit, score_floor_s
from tangram_launch.parallelizers.base import Parallelizer, SliceQuery, SliceResult, capacity_bytes

logger = logging.getLogger(__name__)

_PROGRESS_AFTER_S = 1.0  # only runs longer than this show progress
_PROGRESS_EVERY_S = 0.25


# fewer queries than this run in the calling process: forking a pool whose workers start with cold caches (the
# parallelizer's stage tables) cost more CPU than it saves wall time (OPT-350M on 128 GPUs, batches of 1-33 queries:
# 1.8 CPU-s with a pool per batch, 0.8 in-process)
_POOL_FROM = 128


def default_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def answer(parallelizer: Parallelizer, q: SliceQuery) -> SliceResult:
    """Query, then drop plans that cannot fit anywhere (not even as the last stage), and plans that cannot beat the
    query's latency bound (any parallelizer: the built-in ones skip those before costing them), before they travel
    back."""
    r = parallelizer.query(q)
    cap = capacity_bytes(q.island, q.training)
    m = q.num_microbatches
    keep = tuple(p for p in r.plans if numbers_fit(p.numbers(), 0, m, cap))  # lazy plans stay unbuilt
    bounded = 0
    if q.bounded:
        n = len(keep)
        keep = tuple(p for p in keep
                     if not q.beyond_bound(latency_floor_s(p.numbers(), m), score_floor_s(p.numbers(), m)))
        bounded = n - len(keep)
    if len(keep) == len(r.plans):
        return r
    return dataclasses.replace(r, plans=keep, bounded=r.bounded + bounded)


def _query_chunk(parallelizer: Parallelizer, queries: Sequence[SliceQuery]) -> list[SliceResult]:
    return [answer(parallelizer, q) for q in queries]


class _Progress:
    """A one-line counter on a terminal's stderr; silent when stderr is not a terminal."""

    def __init__(self, total: int, label: str, enabled: bool | None) -> None:
        self.total = total
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < _PROGRESS_AFTER_S or (now - self.last < _PROGRESS_EVERY_S and done < self.total):
            return
        self.last = now
        self.shown = True
        sys.stderr.write(f"\r[tangram] {self.label}: {done}/{self.total} queries, {now - self.t0:.1f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except Exception:  # noqa: BLE001 - any pickling failure means "run in this process"
        return False


def run_queries(parallelizer: Parallelizer, queries: Sequence[SliceQuery], *, max_workers: int | None = None,
                progress: bool | None = None, label: str = "parallelizer",
                on_result: Callable[[int, SliceResult], None] | None = None) -> list[SliceResult]:
    """Answer every query (in order). ``progress``: None = only on a terminal, True/False to force."""
    n = len(queries)
    workers = default_workers() if max_workers is None else max(1, int(max_workers))
    bar = _Progress(n, label, progress)
    results: list[SliceResult | None] = [None] * n
    try:
        if workers == 1 or n < _POOL_FROM or not _picklable((parallelizer, queries[0])):
            if workers > 1 and n >= _POOL_FROM:
                logger.warning("parallelizer %r cannot be pickled: querying in one process",
                               getattr(parallelizer, "name", parallelizer))
            for i, q in enumerate(queries):
                results[i] = answer(parallelizer, q)
                if on_result:
                    on_result(i, results[i])
                bar.update(i + 1)
            return results  # type: ignore[return-value]
        # ~4 chunks per worker balances load; at most 64 queries per chunk keeps progress moving
        chunk = max(1, min(64, -(-n // (workers * 4))))
        spans = [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
        ctx = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        done = 0
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {pool.submit(_query_chunk, parallelizer, list(queries[a:b])): (a, b) for a, b in spans}
            for fut in cf.as_completed(futures):
                a, b = futures[fut]
                for i, r in enumerate(fut.result(), start=a):
                    results[i] = r
                    if on_result:
                        on_result(i, r)
                done += b - a
                bar.update(done)
        return results  # type: ignore[return-value]
    finally:
        bar.close()
