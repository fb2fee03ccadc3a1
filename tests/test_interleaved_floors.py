"""The planner's floors under an interleaved plan's prediction, the event simulation of the op order the runtime
runs (costmodel/interleaved_schedule.py): each lies under it for any stage times, links, m and v, where the closed
form m x period + (fill - period) / v they once assumed does not (a slow first stage never idles; a link is
latency, not a period)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.interleaved_schedule import simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import pipeline_latency_s
from tangram_launch.planner.size_floors import score_extra_s
from tangram_launch.planner.bounds import interleaved_1f1b_floor_s
from tangram_launch.planner.compose import Option, evaluate

_SECONDS = st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def pipelines(draw):
    """Options (one island each, front to back) of 1..3 stages whose times hold no p2p, the one-way links between
    them, m a multiple of the stages, v <= every stage's layers: (options, link matrix, fwd, bwd, p2p, m, v)."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    S = sum(sizes)
    m = S * draw(st.integers(1, 3))
    v = draw(st.integers(2, 8))
    K = len(sizes)
    links = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 2.0, allow_subnormal=False)), min_size=K - 1,
                          max_size=K - 1))
    link = [[0.0] * K for _ in range(K)]
    for k, p in enumerate(links):
        link[k][k + 1] = p
    fwd, bwd, p2p, options, start = [], [], [], [], 0
    for k, ns in enumerate(sizes):
        f = draw(st.lists(_SECONDS, min_size=ns, max_size=ns))
        b = draw(st.lists(_SECONDS, min_size=ns, max_size=ns))
        per_stage = draw(st.integers(v, 9))  # layers per stage: v chunks fit
        if k:
            p2p.append(links[k - 1])
        p2p.extend([0.0] * (ns - 1))
        fwd += f
        bwd += b
        times = [x + y for x, y in zip(f, b)]
        options.append(Option(start, start + ns * per_stage, k, ns, 1 << 30, sum(times), max(times), 0.0))
        start += ns * per_stage
    return options, link, fwd, bwd, p2p, m, v


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_the_composers_interleaved_floors_lie_under_the_simulation(case):
    """class_composition.ClassScores.floor_s's interleaved floor (bounds.interleaved_1f1b_floor_s) and, per option,
    m x its slowest stage + size_floors.score_extra_s of the fill in front of it (a query's score bound;
    cover_floors.promising's and compose's DP floor with the fill weight read the same) lie under the simulation with
    any v the options admit."""
    options, link, fwd, bwd, p2p, m, v = case
    seq = tuple(range(len(options)))
    metrics = evaluate(seq, options, link, m)
    sim = simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v)
    assert interleaved_1f1b_floor_s(seq, options, link, m, metrics.fill_s, 0.0, 8) <= sim
    front = 0.0
    for k, o in enumerate(options):
        if k:
            front += 2.0 * link[k - 1][k]
        assert (m * o.bottleneck_s + score_extra_s(front, math.inf, o.stop - o.start)) * (1 - 1e-9) <= sim
        front += o.time_s


def test_the_closed_form_floors_were_above_the_simulation():
    """The two cases the composer's old floors (m x period + (fill - period) / v and (m - 1/V) x period + fill / V)
    got wrong: a slow first stage (no link), and a period made of a link (8 stages, m = 8, v = 2, a 1 s link in the
    middle). The
    floors now read lie under both simulations."""
    one = [Option(0, 2, 0, 1, 1 << 30, 3.0, 3.0, 0.0), Option(2, 4, 1, 1, 1 << 30, 1.5, 1.5, 0.0)]
    flat = [[0.0, 0.0], [0.0, 0.0]]
    sim = simulated_interleaved_1f1b_s([1.0, 0.5], [2.0, 1.0], [0.0], 4, 2)
    assert sim == 12.0 < pipeline_latency_s(4, 3.0, 4.5, 0.0, 2)
    assert interleaved_1f1b_floor_s((0, 1), one, flat, 4, 4.5, 0.0, 2) <= sim
    t = 0.01  # two options of 4 stages of t s each, a 1 s link between them
    two = [Option(0, 8, 0, 4, 1 << 30, 4 * t, t, 0.0), Option(8, 16, 1, 4, 1 << 30, 4 * t, t, 0.0)]
    linked = [[0.0, 1.0], [0.0, 0.0]]
    sim = simulated_interleaved_1f1b_s([t / 3] * 8, [2 * t / 3] * 8, [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], 8, 2)
    metrics = evaluate((0, 1), two, linked, 8)
    assert metrics.period_s == 1.0 and sim < 8 * metrics.period_s
    assert (8 - 1 / 2) * metrics.period_s + metrics.fill_s / 2 > sim  # the old (m - 1/V) x P + F / V, V = 2
    assert interleaved_1f1b_floor_s((0, 1), two, linked, 8, metrics.fill_s, 0.0, 2) <= sim
