"""The search's query pool (planner/query_pool.py): answers equal to one process's, each island's queries in one
process, workers that live as long as the pool and no longer, and clear errors when a worker fails or dies.

Multi-process tests start real forked workers (``distributed``); the parallelizer is the real megatron one, so the
answers are lazy slice plans whose StageCosts are built back in the planning process."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

if __name__ == "__main__":  # planning-process mode: make the repository importable without pytest's rootdir handling
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.capabilities import MEGATRON, TORCH
from tangram_launch.islands import build_islands
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner import query_pool as query_pool_mod
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.query_pool import QueryPool, QueryWorkerError, answer, worth_workers
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

MODEL = ModelSpec(name="t8", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                  vocab_size=1000, max_seq_len=128)
TRAIN = TrainingSpec(global_batch=16, seq_len=128, dtype="fp16")
HET = ClusterSpec.from_dict({
    "name": "pool-test", "network": {"default": {"bandwidth_GBps": 3.125, "latency_us": 30}},
    "nodes": [{"name": "a100-0", "gpu": "a100-80gb", "count": 4}, {"name": "v100-0", "gpu": "v100-32gb", "count": 8},
              {"name": "v100-1", "gpu": "v100-16gb", "count": 4}]})
ISLANDS = build_islands(HET, dtype="fp16").islands


def queries(b: int = 2, caps=TORCH) -> list[SliceQuery]:
    """Every (island, slice) of a few slice lengths at micro-batch size b: queries on all three islands."""
    out = []
    for isl in ISLANDS:
        for layers in ((0, 8), (0, 4), (4, 8), (2, 6)):
            out.append(SliceQuery(model=MODEL, training=TRAIN, layers=layers, island=isl, microbatch_sequences=b,
                                  capabilities=caps, max_stages=caps.max_stages, pipelined=layers != (0, 8)))
    return out


def in_one_process(qs) -> list:
    par = MegatronParallelizer()
    return [answer(par, q) for q in qs]


def same_answers(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.query_key == w.query_key and g.infeasible == w.infeasible
        assert (g.configs_evaluated, g.bounded) == (w.configs_evaluated, w.bounded)
        assert [p.numbers() for p in g.plans] == [p.numbers() for p in w.plans]
        assert [p.stages for p in g.plans] == [p.stages for p in w.plans]  # built here, bit for bit theirs


def no_children_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name == "tangram-query-worker"]


@pytest.fixture
def eager(monkeypatch):
    """Workers start at the first query of a batch over two islands (however small and cheap the batch, however
    busy the machine)."""
    monkeypatch.setattr(query_pool_mod, "idle_cpus", lambda: 64.0)
    monkeypatch.setattr(query_pool_mod, "_POOL_FROM", 1)
    monkeypatch.setattr(query_pool_mod, "_POOL_WORTH_S", 0.0)
    monkeypatch.setattr(query_pool_mod, "_POOL_AFTER_S", 0.0)


# --- in this process (unit) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("caps", [TORCH, MEGATRON])
def test_a_screened_answer_is_what_answers_own_screen_keeps(caps):
    """The megatron parallelizer's answers come marked screened, and answer() passes them as they are: its own
    screen (fits as the last stage; under bounds, beyond neither bound at the plan's stage count) keeps every
    plan of them, unbounded and at bounds that cut some plans and not others."""
    from dataclasses import replace

    from tangram_launch.costmodel.slice_plan import capacity_bytes, latency_floor_s, numbers_fit, score_floor_s

    par = MegatronParallelizer()
    checked = cut = 0
    for q in queries(2, caps):
        full = par.query(q)
        assert full.screened
        m = q.num_microbatches
        floors = sorted((latency_floor_s(p.numbers(), m), score_floor_s(p.numbers(), m)) for p in full.plans)
        bounds = [replace(q, latency_bound_s=lat, score_bound_s=score) for lat, score in floors[len(floors) // 2:][:2]]
        for bq in [q, *bounds]:
            r, got = par.query(bq), answer(par, bq)
            assert r.screened and (got.bounded, [p.numbers() for p in got.plans]) == (
                r.bounded, [p.numbers() for p in r.plans])
            for p in r.plans:
                assert numbers_fit(p.numbers(), 0, m, capacity_bytes(bq.island, bq.training))
                assert not (bq.bounded and bq.beyond_bound(latency_floor_s(p.numbers(), m),
                                                           score_floor_s(p.numbers(), m), len(p.numbers().tail_s)))
                checked += 1
            cut += r.bounded > 0
    assert checked > 50 and cut > 0


def test_workers_start_only_for_what_looks_worth_them():
    assert (query_pool_mod._POOL_AFTER_S, query_pool_mod._POOL_WORTH_S) == (0.1, 0.5)  # the figures below
    assert not worth_workers(0.05, 10, 100_000)  # too early to judge: one slow query is no trend
    assert not worth_workers(0.2, 100, 200)  # 0.4 s left at 2 ms a query: less than a fork and the answers' trip
    assert worth_workers(0.2, 100, 250)  # 0.5 s left
    assert worth_workers(0.1, 1, 200)  # a cold first query, 200 like it to come


def test_small_batches_stay_in_the_planning_process(monkeypatch):
    monkeypatch.setattr(query_pool_mod, "_POOL_WORTH_S", 0.0)  # however costly they look
    monkeypatch.setattr(query_pool_mod, "_POOL_AFTER_S", 0.0)
    with QueryPool(MegatronParallelizer(), 2) as pool:
        pool.run(queries())
        assert pool.worker_pids == ()


def test_no_worker_starts_while_no_cpu_is_idle(eager, monkeypatch):
    monkeypatch.setattr(query_pool_mod, "idle_cpus", lambda: 0.3)  # 2 CPUs, load 1.7
    with QueryPool(MegatronParallelizer(), 2) as pool:
        pool.run(queries())
        assert pool.worker_pids == ()


def test_idle_cpus_are_at_most_those_this_process_may_use():
    assert query_pool_mod.idle_cpus() <= len(os.sched_getaffinity(0))


def test_one_worker_never_forks(eager):
    with QueryPool(MegatronParallelizer(), 1) as pool:
        pool.run(queries())
        assert pool.worker_pids == ()


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, len(ISLANDS) - 1), max_size=30), min_size=1, max_size=4),
       processes=st.integers(2, 4))
def test_every_island_has_one_home_and_every_query_one_process(batches, processes):
    qs_of = [[queries()[4 * k] for k in batch] for batch in batches]
    pools = [QueryPool(MegatronParallelizer(), processes) for _ in range(2)]
    homes: dict[str, int] = {}
    for qs in qs_of:
        todo = list(range(len(qs)))
        a, b = (p._shares(qs, todo) for p in pools)
        assert a == b  # the same batches give the same shares
        assert sorted(i for share in a for i in share) == todo
        for k, share in enumerate(a):
            assert share == sorted(share)  # query order kept within a process
            for i in share:
                assert homes.setdefault(qs[i].island.name, k) == k
    if len(homes) >= 2:
        assert len(set(homes.values())) >= 2  # islands spread over processes


# --- with workers (distributed) ------------------------------------------------------------------------------------

@pytest.mark.distributed
def test_workers_stay_warm_across_batches_and_answer_as_one_process(eager):
    first, second = queries(2), queries(4, MEGATRON)
    with QueryPool(MegatronParallelizer(), 3) as pool:
        got1 = pool.run(first)
        pids = pool.worker_pids
        assert len(pids) == 2 and os.getpid() not in pids
        got2 = pool.run(second)
        assert pool.worker_pids == pids  # the same workers, not a pool per batch
        homes = dict(pool._home)
        assert sorted(homes) == sorted(i.name for i in ISLANDS) and set(homes.values()) == {0, 1, 2}
    assert no_children_left()
    same_answers(got1, in_one_process(first))
    same_answers(got2, in_one_process(second))


@pytest.mark.distributed
def test_a_worker_builds_its_answers_stage_costs_while_the_pool_lives(eager, monkeypatch):
    qs = queries(2)
    again: list = []  # queries answered a second time in this process
    answered_here = query_pool_mod.answer
    monkeypatch.setattr(query_pool_mod, "answer", lambda par, q: again.append(q) or answered_here(par, q))
    with QueryPool(MegatronParallelizer(), 2) as pool:
        got = pool.run(qs)
        (worker,) = pool._workers
        assert worker.sent > 0  # some answers came from the worker
        n_here = len(again)  # (this process's own share)
        same_answers(got, in_one_process(qs))  # each plan's StageCosts, built by the worker that answered it
        assert len(again) == n_here
    with QueryPool(MegatronParallelizer(), 2) as pool:
        late = pool.run(qs)
        n_here = len(again)
    same_answers(late, in_one_process(qs))  # the pool closed: its workers' answers are answered again here
    assert len(again) > n_here
    assert no_children_left()


@pytest.mark.distributed
def test_a_search_plans_the_same_with_workers(eager, monkeypatch):
    started = []
    start = QueryPool._start

    def spy(self, sample):
        ok = start(self, sample)
        started.append(ok)
        return ok

    monkeypatch.setattr(QueryPool, "_start", spy)
    one = search(HET, MODEL, TRAIN, runtime="torch", parallelizer=MegatronParallelizer(),
                 options=PlannerOptions(max_workers=1))
    assert started == []
    two = search(HET, MODEL, TRAIN, runtime="torch", parallelizer=MegatronParallelizer(),
                 options=PlannerOptions(max_workers=2))
    assert started == [True]  # one pool for the whole search
    assert no_children_left()
    d1, d2 = one.plan.to_dict(), two.plan.to_dict()
    for d in (d1, d2):
        d.pop("planner")
    assert d1 == d2
    assert one.plan.predicted == two.plan.predicted


class _Unrebuildable(Exception):
    """Pickles, but cannot be rebuilt from its pickle (a keyword-only argument)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def _plan_in_a_daemon(out) -> None:
    with QueryPool(MegatronParallelizer(), 2) as pool:
        answers = pool.run(queries())
        out.send((pool.worker_pids, len(answers), sum(len(a.plans) for a in answers)))


@pytest.mark.distributed
def test_a_daemonic_process_answers_alone(eager):
    # e.g. planning inside a multiprocessing pool's worker, which may not start processes of its own
    here, there = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_plan_in_a_daemon, args=(there,), daemon=True)
    proc.start()
    assert here.poll(SUBPROCESS_TIMEOUT_S)
    pids, n, plans = here.recv()
    proc.join(SUBPROCESS_TIMEOUT_S)
    assert proc.exitcode == 0 and pids == ()
    want = in_one_process(queries())
    assert (n, plans) == (len(want), sum(len(a.plans) for a in want))


class _FailsInWorkers(MegatronParallelizer):
    """Megatron, except in a forked worker: raises, or (``die``) exits at once."""

    def __init__(self, parent: int, die: bool = False, error: type = ValueError) -> None:
        super().__init__()
        self.parent, self.die, self.error = parent, die, error

    def query(self, q):
        if os.getpid() != self.parent:
            if self.die:
                os._exit(3)
            if self.error is _Unrebuildable:
                raise _Unrebuildable(f"no answer for {q.island.name}", field="island")
            raise self.error(f"no answer for {q.island.name}")
        return super().query(q)


@pytest.mark.distributed
def test_a_worker_error_is_raised_here_with_its_traceback(eager):
    pool = QueryPool(_FailsInWorkers(os.getpid()), 3)
    with pytest.raises(ValueError, match="no answer for (a100|v100)") as err:
        pool.run(queries())
    assert any("raised in query worker pid" in n and "raise self.error" in n for n in err.value.__notes__)
    assert no_children_left()  # the pool stopped its workers on the way out


@pytest.mark.distributed
def test_a_worker_error_that_cannot_travel_comes_as_its_traceback(eager):
    with pytest.raises(QueryWorkerError, match=r"(?s)query worker pid \d+ failed:.*_Unrebuildable: no answer for"):
        with QueryPool(_FailsInWorkers(os.getpid(), error=_Unrebuildable), 2) as pool:
            pool.run(queries())
    assert no_children_left()


@pytest.mark.distributed
def test_a_dead_worker_is_a_clear_error_and_leaves_no_process(eager):
    with pytest.raises(QueryWorkerError, match=r"pid \d+ died \(exit code 3\) while answering \d+ queries on "
                                               r"\d+ islands? (a100|v100)"):
        with QueryPool(_FailsInWorkers(os.getpid(), die=True), 3) as pool:
            pool.run(queries())
    assert no_children_left()


class _InterruptedHere(MegatronParallelizer):
    """Megatron, except that the planning process is interrupted (Ctrl-C) at its last query of a batch."""

    def __init__(self, parent: int, last: tuple[str, tuple[int, int]]) -> None:
        super().__init__()
        self.parent, self.last = parent, last

    def query(self, q):
        if os.getpid() == self.parent and (q.island.name, q.layers) == self.last:
            raise KeyboardInterrupt
        return super().query(q)


@pytest.mark.distributed
def test_ctrl_c_while_workers_answer_stops_them(eager):
    qs = queries()
    pool = QueryPool(MegatronParallelizer(), 2)
    pool.run(qs)  # starts the worker and homes every island: one here, two there (or the other way round)
    here = [q for q in qs if pool._home[q.island.name] == 0]
    pool.parallelizer = _InterruptedHere(os.getpid(), (here[-1].island.name, here[-1].layers))
    with pytest.raises(KeyboardInterrupt):
        pool.run(qs)
    assert pool.worker_pids == () and no_children_left()
    assert pool.run(qs[:2])  # a stopped pool still answers, in this process


def _killed_planning_process() -> None:
    """Planning-process mode: start two workers, print their pids, then die at once (SIGKILL: no clean-up)."""
    query_pool_mod._POOL_FROM, query_pool_mod._POOL_WORTH_S, query_pool_mod._POOL_AFTER_S = 1, 0.0, 0.0
    query_pool_mod.idle_cpus = lambda: 64.0
    pool = QueryPool(MegatronParallelizer(), 3)
    pool.run(queries())
    print(*pool.worker_pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for its (new) parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_workers_of_a_killed_planning_process_exit():
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "killed"], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == -signal.SIGKILL, res.stderr
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), f"orphan query workers: {[p for p in pids if not _gone(p)]}"


if __name__ == "__main__":
    if sys.argv[1:] == ["killed"]:
        _killed_planning_process()
    else:
        sys.exit("usage: test_query_pool.py killed")
