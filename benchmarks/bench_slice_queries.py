"""The ``megatron`` parallelizer's share of planning at cluster scale (issue 12): one row's slice queries, replayed.

    python benchmarks/bench_slice_queries.py --only opt350m-512gpu --runtimes megatron
    python benchmarks/bench_slice_queries.py --reps 5                      # every row of bench_planner_scale

Per row and runtime it plans once in this process (one worker) with a parallelizer that records the queries the
planner asks, then answers that same stream again with fresh parallelizers (``cold``: every stage costed anew, as
in a planning run; the least CPU seconds over ``--reps``) and once more on a parallelizer that has answered it
(``warm``: stage costs cached, what is left is judging grids; CPU microseconds per query, least over ``--reps``).
CPU time (``time.process_time``) is robust to other processes on a shared machine; the least of a few repetitions
more so. Replays run with the cyclic garbage collector off, as planning runs (planner/gc_pause.py): its
collections would otherwise land in whichever query allocates when they fall due. ``digest`` hashes every answer's numbers: two versions of the parallelizer that print the same digest
answer the stream bit for bit alike (and so plan alike).
"""
from __future__ import annotations

import argparse
import hashlib
import time

from bench_planner_common import cluster_path
from bench_planner_scale import CASES, RUNTIMES

from tangram_launch.islands import build_islands  # noqa: E402 (bench_planner_common puts the repo on the path)
from tangram_launch.parallelizers.megatron import MegatronParallelizer  # noqa: E402
from tangram_launch.planner import PlannerOptions, search  # noqa: E402
from tangram_launch.planner.gc_pause import no_collections  # noqa: E402
from tangram_launch.planner.query_pool import answer  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec  # noqa: E402
from tangram_launch.specs.model import load_model  # noqa: E402
from tangram_launch.specs.training import TrainingSpec  # noqa: E402


class RecordingParallelizer(MegatronParallelizer):
    """The megatron parallelizer, keeping every query it is asked (queries run in this process: one worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list = []

    def query(self, q):
        self.asked.append(q)
        return super().query(q)


def digest(answers) -> str:
    h = hashlib.sha256()
    for r in answers:
        h.update(repr((r.query_key, r.configs_evaluated, r.bounded, r.infeasible and r.infeasible.reasons,
                       [(p.island, p.layers, tuple(p.numbers())) for p in r.plans])).encode())
    return h.hexdigest()[:16]


def replay(queries, reps: int) -> tuple[float, float, str]:
    """(least cold CPU seconds for the stream, least warm CPU microseconds per query, digest)."""
    with no_collections():
        return _replay(queries, reps)


def _replay(queries, reps: int) -> tuple[float, float, str]:
    cold, answers, par = float("inf"), None, None
    for _ in range(reps):
        par = MegatronParallelizer()
        t0 = time.process_time()
        answers = [answer(par, q) for q in queries]
        cold = min(cold, time.process_time() - t0)
    warm = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for q in queries:
            par.query(q)
        warm = min(warm, (time.process_time() - t0) / max(1, len(queries)) * 1e6)
    return cold, warm, digest(answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="cluster names (default: every row but the 4,096-GPU one)")
    ap.add_argument("--runtimes", nargs="*", default=list(RUNTIMES))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print("| cluster | runtime | queries | cold CPU s | warm CPU us/query | digest |")
    print("|---|---|---|---|---|---|")
    for c, m, g, s, d, _target in CASES:
        if (args.only and c not in args.only) or (not args.only and c == "llama3-405b-4096gpu"):
            continue
        cluster = ClusterSpec.load(cluster_path(c))
        model = load_model(m)
        training = TrainingSpec(global_batch=g, seq_len=s, dtype=d)
        islands = build_islands(cluster, dtype=d)
        for rt in args.runtimes:
            rec = RecordingParallelizer()
            search(cluster, model, training, runtime=rt, parallelizer=rec, islands=islands,
                   options=PlannerOptions(max_workers=1, progress=False))
            cold, warm, dig = replay(rec.asked, args.reps)
            print(f"| {c} | {rt} | {len(rec.asked)} | {cold:.2f} | {warm:.0f} | {dig} |", flush=True)


if __name__ == "__main__":
    main()
