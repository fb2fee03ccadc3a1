"""Parallel parallelizer queries (paper §5.1, Fig. 6): a process pool per search, infeasible answers dropped early.

Queries are independent, so a search answers them in up to ``max_workers`` processes (default ``min(2, cpu
count)``): the planning process itself and ``max_workers - 1`` forked workers (``QueryPool``). The parallelizer
keeps caches per process (stage tables, grid lists), and filling them is most of a query's cost; so each island's
queries always go to the same process (its home), the workers live as long as the search and keep their caches
warm across batches, and no two processes fill the same island's entries. Workers start at most once, in the first
batch of ``_POOL_FROM`` queries or more over two islands or more whose measured cost makes the rest of it look worth
them (``worth_workers``) while a CPU is idle (``idle_cpus``), forked then with the caches filled so far. Until
then, with one worker, without the ``fork`` start method or with queries that cannot be pickled, queries run in this
process. Answers come back in query order whichever process gave them, so plans do not depend on the worker count
(nor on the machine's load). Progress goes to stderr, only when stderr is a terminal and the run is long.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Sequence

from tangram_launch.costmodel.slice_plan import (LazySlicePlan, SliceNumbers, latency_floor_s, numbers_fit,
                                                 score_floor_s)
from tangram_launch.parallelizers.base import Parallelizer, SliceQuery, SliceResult, capacity_bytes
from tangram_launch.text import plural

logger = logging.getLogger(__name__)

_PROGRESS_AFTER_S = 1.0  # only runs longer than this show progress
_PROGRESS_EVERY_S = 0.25

# workers start in a batch of _POOL_FROM queries or more, once its queries left look worth _POOL_WORTH_S CPU seconds
# (at its CPU seconds per query so far): below that, forking and sending answers back cost more than the parallel
# queries save (many cheap queries, or small batches, run faster in one process). Small searches (tests, examples)
# never fork.
_POOL_FROM = 128
_POOL_WORTH_S = 0.5
_POOL_AFTER_S = 0.1  # the batch's CPU seconds measured before judging (one slow query, a collection, is no trend)
# and only while a CPU is idle: on a busy machine a worker takes turns with the other work and saves no wall time,
# and each process runs slower beside the other (on a loaded machine a worker costs more CPU than answering the
# same queries one process after the other)
_IDLE_CPUS = 0.5  # of a CPU: the planning process itself is in the load
_STOP = b""  # the message that ends a worker
_JOIN_S = 5.0  # a stopped worker gets this long to exit before it is terminated


class QueryWorkerError(RuntimeError):
    """A query worker process died (killed, out of memory) or could not send its answers back."""


def default_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def idle_cpus() -> float:
    """CPUs this process may run on less the machine's load (its 1-minute average; all of them where unknown)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        return cpus - os.getloadavg()[0]
    except (AttributeError, OSError):
        return float(cpus)


def worth_workers(spent_s: float, done: int, left: int) -> bool:
    """Whether a batch's ``left`` queries look worth starting workers for, its first ``done`` having taken
    ``spent_s`` CPU seconds (judged after ``_POOL_AFTER_S`` of them)."""
    return spent_s >= _POOL_AFTER_S and spent_s * left >= _POOL_WORTH_S * done


def answer(parallelizer: Parallelizer, q: SliceQuery) -> SliceResult:
    """Query, then drop plans that cannot fit anywhere (not even as the last stage), and plans that cannot beat the
    query's latency bound (any parallelizer: the built-in ones skip those before costing them), before they travel
    back. An answer its parallelizer marks ``screened`` passes as it is."""
    r = parallelizer.query(q)
    if r.screened:
        return r
    cap = capacity_bytes(q.island, q.training)
    m = q.num_microbatches
    keep = tuple(p for p in r.plans if numbers_fit(p.numbers(), 0, m, cap))  # lazy plans stay unbuilt
    bounded = 0
    if q.bounded:
        n = len(keep)
        keep = tuple(p for p in keep
                     if not q.beyond_bound(latency_floor_s(p.numbers(), m), score_floor_s(p.numbers(), m),
                                           len(p.numbers().tail_s)))
        bounded = n - len(keep)
    if len(keep) == len(r.plans):
        return r
    return dataclasses.replace(r, plans=keep, bounded=r.bounded + bounded)


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


@dataclasses.dataclass(frozen=True)
class _Shipped:
    """A lazy slice plan as it travels from a worker: its numbers and its place in the answer. Its StageCosts are
    built only for the few plans the planning process places, on request (_Reanswer): building and pickling every
    answered plan's cost almost half as much CPU as answering."""

    island: str
    layers: tuple[int, int]
    parallelizer: str
    numbers: SliceNumbers


def _ship(r: SliceResult) -> SliceResult:
    if not any(isinstance(p, LazySlicePlan) for p in r.plans):
        return r
    return dataclasses.replace(r, plans=tuple(_Shipped(p.island, p.layers, p.parallelizer, p.numbers())
                                              if isinstance(p, LazySlicePlan) else p for p in r.plans))


@dataclasses.dataclass(frozen=True)
class _Build:
    """A request to a worker: the StageCosts of plan ``index`` of its answer to the ``serial``-th query it was
    sent (the worker keeps its answers while the pool lives)."""

    serial: int
    index: int


class _Reanswer:
    """Builds a shipped plan's StageCosts: the worker that answered the query builds them from the answer it kept,
    while the pool lives and the worker is idle; else the query is answered again in this process (answers are
    deterministic, so the same plan at the same place; its numbers are checked), once for all its plans. Asking the
    worker first spares the planning process answering its placed queries again on a large cluster."""

    def __init__(self, parallelizer: Parallelizer, query: SliceQuery, worker: "_Worker | None" = None,
                 serial: int = -1) -> None:
        self.parallelizer = parallelizer
        self.query = query
        self.worker = worker
        self.serial = serial
        self.answer: SliceResult | None = None

    def stages(self, index: int, numbers: SliceNumbers):
        w = self.worker
        if self.answer is None and w is not None and w.can_build():
            try:
                stages = w.build(_Build(self.serial, index))
            except QueryWorkerError:
                self.worker = None  # (a worker that died: the next batch says so) answered again here instead
            else:
                if len(stages) == len(numbers.shapes):
                    return stages
                raise QueryWorkerError(f"{self.query.island.name} layers {self.query.layers}: the query worker "
                                       f"built {len(stages)} stages for a plan of {len(numbers.shapes)}")
        if self.answer is None:
            self.answer = answer(self.parallelizer, self.query)
        plans = self.answer.plans
        if index >= len(plans) or plans[index].numbers() != numbers:
            raise QueryWorkerError(f"{self.query.island.name} layers {self.query.layers}: the answer in this "
                                   "process differs from the query worker's (a parallelizer that is not "
                                   "deterministic)")
        return plans[index].stages


def _unship(r: SliceResult, parallelizer: Parallelizer, query: SliceQuery, worker: "_Worker | None" = None,
            serial: int = -1) -> SliceResult:
    if not any(isinstance(p, _Shipped) for p in r.plans):
        return r
    again = _Reanswer(parallelizer, query, worker, serial)
    return dataclasses.replace(r, plans=tuple(
        LazySlicePlan(p.island, p.layers, parallelizer=p.parallelizer, numbers=p.numbers,
                      build=functools.partial(again.stages, j, p.numbers)) if isinstance(p, _Shipped) else p
        for j, p in enumerate(r.plans)))


def _serve(conn, parallelizer: Parallelizer, theirs: Sequence) -> None:
    """A worker's loop: answer each batch of pickled queries it is sent with its own copy of the parallelizer
    (forked, so its caches stay warm from batch to batch), until it is told to stop or the planning process goes.
    ``theirs``: the planning process's pipe ends, inherited by the fork: closed, so that its death reads as end of
    file here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the planning process's to handle: it stops us
    for c in theirs:
        c.close()
    kept: dict[int, SliceResult] = {}  # serial -> an answer with lazy plans, whose stages _Build asks for
    serial = 0  # queries received so far
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the planning process is gone
        if msg == _STOP:
            return
        try:
            req = pickle.loads(msg)
            if isinstance(req, _Build):
                payload = kept[req.serial].plans[req.index].stages
            else:
                payload = []
                for q in req:
                    r = answer(parallelizer, q)
                    if any(isinstance(p, LazySlicePlan) for p in r.plans):
                        kept[serial] = r
                    serial += 1
                    payload.append(_ship(r))
            out = pickle.dumps(("ok", payload, ""), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - it goes back to the planning process, which raises it
            tb = traceback.format_exc()
            try:
                out = pickle.dumps(("error", exc, tb), protocol=pickle.HIGHEST_PROTOCOL)
                pickle.loads(out)  # some exceptions pickle but cannot be rebuilt (keyword-only arguments)
            except Exception:  # noqa: BLE001 - an exception that cannot travel goes as its traceback
                out = pickle.dumps(("error", None, tb), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.send_bytes(out)
        except OSError:
            return


@dataclasses.dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: "multiprocessing.connection.Connection"
    owner: int = dataclasses.field(default_factory=os.getpid)  # the planning process: only it talks to the worker
    sent: int = 0  # queries sent so far: the next one's serial
    busy: bool = False  # a batch is out: its answers come next on the pipe
    closed: bool = False  # told to stop (the pool closed)

    def can_build(self) -> bool:
        return not (self.busy or self.closed) and os.getpid() == self.owner

    def build(self, request: _Build):
        """The StageCosts of one plan the worker answered (while it is idle)."""
        try:
            self.conn.send_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise self.died(0, []) from None
        return self.receive([])

    def died(self, n: int, islands: Sequence[str]) -> QueryWorkerError:
        self.process.join(_JOIN_S)
        code = self.process.exitcode
        how = ("still running" if code is None else f"killed by {signal.Signals(-code).name}" if code < 0
               else f"exit code {code}")
        doing = (f"answering {n} queries on {plural(len(islands), 'island')} {', '.join(islands)}" if n
                 else "building the stage costs of one of its answers")
        return QueryWorkerError(f"query worker pid {self.process.pid} died ({how}) while {doing}; planning stopped")

    def send(self, queries: list[SliceQuery]) -> int:
        """Send a batch; the serial of its first query."""
        data = pickle.dumps(queries, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.conn.send_bytes(data)
        except OSError:
            raise self.died(len(queries), sorted({q.island.name for q in queries})) from None
        first, self.sent, self.busy = self.sent, self.sent + len(queries), True
        return first

    def receive(self, queries: list[SliceQuery]) -> list[SliceResult]:
        try:
            kind, payload, tb = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self.died(len(queries), sorted({q.island.name for q in queries})) from None
        self.busy = False
        if kind == "ok":
            return payload
        if payload is None:
            raise QueryWorkerError(f"query worker pid {self.process.pid} failed:\n{tb}")
        payload.add_note(f"raised in query worker pid {self.process.pid}:\n{tb}")
        raise payload


class QueryPool:
    """The processes that answer one search's queries: this one and up to ``max_workers - 1`` forked workers, each
    island's queries always in the same one. A context manager: leaving the block (an error or Ctrl-C included)
    stops the workers; a worker that dies raises QueryWorkerError."""

    def __init__(self, parallelizer: Parallelizer, max_workers: int | None = None, *, progress: bool | None = None,
                 label: str = "parallelizer") -> None:
        self.parallelizer = parallelizer
        self.processes = default_workers() if max_workers is None else max(1, int(max_workers))
        self.progress = progress
        self.label = label
        self._workers: list[_Worker] = []
        self._home: dict[str, int] = {}  # island name -> its process (0: this one; k: self._workers[k - 1])
        self._load = [0] * self.processes  # queries sent to each process so far
        self._closed = False
        self._may_start = self.processes > 1  # False once started, closed, or found unable to
        self._owner = os.getpid()

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return tuple(w.process.pid for w in self._workers)

    def __enter__(self) -> "QueryPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(now=exc_type is not None)

    def run(self, queries: Sequence[SliceQuery]) -> list[SliceResult]:
        """Every query's answer, in query order."""
        n = len(queries)
        bar = _Progress(n, self.label, self.progress)
        results: list[SliceResult | None] = [None] * n
        try:
            left = self._here_until_worth_workers(queries, results, bar) if not self._workers else range(n)
            if left:
                self._spread(queries, left, results, bar)
        except BaseException:
            self.close(now=True)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _here_until_worth_workers(self, queries: Sequence[SliceQuery], results: list, bar: _Progress) -> list[int]:
        """Answer in this process until the rest of a batch of ``_POOL_FROM`` queries or more looks worth workers
        (at this batch's CPU seconds per query after ``_POOL_AFTER_S`` of them, at least ``_POOL_WORTH_S`` over two
        islands or more), then start them; the indices left."""
        n = len(queries)
        spread = [False] * n  # spread[k]: queries k + 1.. are on two islands or more
        if self._may_start and n >= _POOL_FROM and idle_cpus() >= _IDLE_CPUS:
            seen: set[str] = set()
            for k in range(n - 1, 0, -1):
                seen.add(queries[k].island.name)
                spread[k - 1] = len(seen) > 1
        t0 = time.process_time()
        for k, q in enumerate(queries):
            results[k] = answer(self.parallelizer, q)
            bar.update(k + 1)
            if (spread[k] and self._may_start and worth_workers(time.process_time() - t0, k + 1, n - k - 1)
                    and self._start(q)):
                return list(range(k + 1, n))
        return []

    def _spread(self, queries: Sequence[SliceQuery], todo: Sequence[int], results: list, bar: _Progress) -> None:
        """Answer queries ``todo``, each at its island's home: the workers' sent first, this process's answered
        while they work."""
        own, *theirs = self._shares(queries, todo)
        sent = []
        for w, idx in zip(self._workers, theirs):
            if idx:
                batch = [queries[i] for i in idx]
                sent.append((w, idx, batch, w.send(batch)))
        done = len(queries) - len(todo)
        for i in own:
            results[i] = answer(self.parallelizer, queries[i])
            done += 1
            bar.update(done)
        for w, idx, batch, first in sent:
            for k, (i, r) in enumerate(zip(idx, w.receive(batch), strict=True)):
                results[i] = _unship(r, self.parallelizer, queries[i], w, first + k)
            done += len(idx)
            bar.update(done)

    def _shares(self, queries: Sequence[SliceQuery], todo: Sequence[int]) -> list[list[int]]:
        """Query indices per process (this one first): each island's at its home, new islands homed where the
        fewest queries went so far (deterministic: the same batches give the same homes)."""
        counts: dict[str, int] = {}
        for i in todo:
            name = queries[i].island.name
            counts[name] = counts.get(name, 0) + 1
        for name, c in counts.items():
            if name in self._home:
                self._load[self._home[name]] += c
        for name in sorted((s for s in counts if s not in self._home), key=lambda s: (-counts[s], s)):
            k = self._home[name] = min(range(self.processes), key=lambda k: (self._load[k], k))
            self._load[k] += counts[name]
        shares: list[list[int]] = [[] for _ in range(self.processes)]
        for i in todo:
            shares[self._home[queries[i].island.name]].append(i)
        return shares

    def _start(self, sample: SliceQuery) -> bool:
        """Fork the workers (now: they start with the caches filled so far); False where queries stay here."""
        self._may_start = False
        if "fork" not in multiprocessing.get_all_start_methods():
            logger.info("no fork start method: %s queries run in one process", self.label)
            return False
        if not _picklable(sample):
            logger.warning("%s queries cannot be pickled: querying in one process", self.label)
            return False
        if multiprocessing.current_process().daemon:
            logger.info("%s: a daemonic process may not start workers: querying in one process", self.label)
            return False
        ctx = multiprocessing.get_context("fork")
        for _ in range(self.processes - 1):
            here, there = ctx.Pipe()
            theirs = [here, *(w.conn for w in self._workers)]
            proc = ctx.Process(target=_serve, args=(there, self.parallelizer, theirs), name="tangram-query-worker",
                               daemon=True)
            self._workers.append(_Worker(proc, here))
            proc.start()
            there.close()  # the worker's end: its death reads as end of file here
        return True

    def close(self, *, now: bool = False) -> None:
        """Stop the workers: told to stop and waited for, or (``now``, on an error) terminated; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._may_start = False
        workers, self._workers = self._workers, []
        for w in workers:
            w.closed = True  # its answers' stages are built here from now on
        if os.getpid() != self._owner:
            return  # a copy in a forked process: the workers are not its own
        for w in workers:
            if now or w.process.pid is None:
                if w.process.pid is not None:
                    w.process.terminate()
                continue
            try:
                w.conn.send_bytes(_STOP)
            except OSError:
                pass
        for w in workers:
            if w.process.pid is not None:
                w.process.join(_JOIN_S)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join()
            w.conn.close()


def run_queries(parallelizer: Parallelizer, queries: Sequence[SliceQuery], *, max_workers: int | None = None,
                progress: bool | None = None, label: str = "parallelizer") -> list[SliceResult]:
    """Answer every query (in order) in a pool of its own. ``progress``: None = only on a terminal, True/False to
    force. A search asks through one QueryPool for all its batches instead, so its workers stay warm."""
    with QueryPool(parallelizer, max_workers, progress=progress, label=label) as pool:
        return pool.run(queries)
