"""The composer's cheaper ways to the same plans (the c3 rows of benchmarks/bench_planner_scale.py): an offer whose
cheap floor already loses needs no finer floor (compose's ``score_floor_cut``), and a complete pass scored by the
least of plain and interleaved 1F1B leaves out the sequences that cannot interleave and whose plain floor cannot
beat the best score. Both are checked against the search without them and against brute force."""
from __future__ import annotations

import math
import random

import pytest

from helpers_compose import random_options, scheduled, stage_seconds, with_bottleneck
from tangram_launch.costmodel.plain_1f1b_paths import path_floor_1f1b_s
from tangram_launch.planner.bounds import plain_1f1b_floor_s
import tangram_launch.planner.compose as kernel
from tangram_launch.planner.compose import ComposeStats, Option, compose
from tangram_launch.planner.reference import every_composition


def _instance(rng: random.Random, most_layers: int = 6,
              most_islands: int = 3) -> tuple[list[Option], list[list[float]], int, int]:
    """Options on up to ``most_islands`` islands and ``most_layers`` layers, with stage counts that often do not
    divide m."""
    L, K = rng.randint(2, most_layers), rng.randint(1, most_islands)
    m = rng.choice([4, 6, 8, 12, 16])
    options = random_options(rng, L, K, fits=[0, 1, 3, 1 << 30], tail_max_s=2.0)
    link = [[0.0 if i == j else rng.uniform(0, 1.0) for j in range(K)] for i in range(K)]
    return options, link, L, m


@pytest.mark.parametrize("seed", range(3))
def test_a_complete_pass_under_plain_or_interleaved_scores_returns_every_sequence_that_beats(seed):
    """The complete pass under the least of plain and interleaved 1F1B (the stages must divide m to interleave)
    returns every composition whose score beats its bound, those whose stages do not divide m included (their
    score is the plain simulation, above the plain floor by which _candidates leaves out the others), the bound
    drawn among the compositions' scores so that many beat it and many do not; and compose's plan, with the best
    score found elsewhere at or just above the least, scores the least of every composition."""
    rng = random.Random(5200 + seed)
    kept = 0
    for _ in range(60):
        options, link, L, m = _instance(rng, 8, 4)
        score = scheduled(options, link, m, schedules=("plain", "interleaved"), most_chunks=2)
        scored = [(score(c.options, c.metrics), c.options) for c in every_composition(options, link, L, m)]
        if not scored:
            continue
        beat = sorted(s for s, _ in scored)[len(scored) // 2]
        prep = kernel._prepare(options, link, L, m - 1, (1 << 4) - 1, None)
        found = {c.options for c in kernel._dp(options, prep, link, L, m, 0, None, math.inf, ComposeStats(),
                                               score_beat=beat, fill_weight=0.5, schedules=("plain", "interleaved"),
                                               complete=True)}
        wins = [seq for s, seq in scored if s < beat]
        assert set(wins) <= found
        kept += sum(m % sum(options[oi].num_stages for oi in seq) != 0 for seq in wins)
        least = min(s for s, _ in scored)
        for incumbent in (math.inf, least * rng.uniform(1.0, 1.05)):
            got = compose(options, link, L, m, score=score, score_schedules=("plain", "interleaved"),
                          score_fill_weight=0.5, score_incumbent_s=incumbent)
            assert got is not None or least >= incumbent
            assert got is None or got.score_s == pytest.approx(least, rel=1e-12)
    assert kept > 20  # sequences that cannot interleave among those that beat


@pytest.mark.parametrize("seed", range(3))
def test_a_cut_score_floor_scores_the_same_offers_in_the_same_order(seed):
    """compose with ``score_floor_cut`` (the plain floor's first term where it is above the cut, the floor with the
    round trips of every stage otherwise) returns the same plan and scores the same compositions, in the same
    order, as with ``score_floor`` alone."""
    rng = random.Random(5300 + seed)
    compared = 0
    for _ in range(60):
        options, link, L, m = _instance(rng)
        score = scheduled(options, link, m, schedules=("plain",))

        def floor(seq, metrics):
            first = plain_1f1b_floor_s(seq, options, link, m, metrics.tail_s)
            times = stage_seconds(options, link, seq, with_bottleneck)
            return max(first, path_floor_1f1b_s(*times, m) * (1.0 - 1e-9) + metrics.tail_s)

        def floor_cut(seq, metrics, cut):
            first = plain_1f1b_floor_s(seq, options, link, m, metrics.tail_s)
            return first if first > cut else floor(seq, metrics)

        runs = []
        for cut in (None, floor_cut):
            stats = ComposeStats()
            got = compose(options, link, L, m, score=score, score_schedules=("plain",), score_floor=floor,
                          score_floor_cut=cut, stats=stats)
            runs.append((got, [(c.options, c.score_s) for c in stats.scored]))
        assert runs[0] == runs[1]
        compared += runs[0][0] is not None
    assert compared > 30
