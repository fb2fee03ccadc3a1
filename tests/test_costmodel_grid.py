"""costmodel/grid.judge_columns (each distinct stage signature judged once, from precomputed columns) answers
exactly what the plain per-combination computation does: max / Python sum / max of the stage rows and
grid.fit_depth."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.grid import (
    StageTable,
    fills_of,
    fit_depth,
    judge_columns,
    least_floors,
    peak_memory,
)

_SECONDS = st.floats(0.0, 5.0, allow_nan=False)
_BYTES = st.floats(0.0, 40e9, allow_nan=False)


def _reference(rows, m, cap):
    out = ([], [], [], [], [])
    for stages in zip(*rows):
        times = [x[0] for x in stages]
        depth, peak0 = fit_depth([(x[1], x[2]) for x in stages], m, cap)
        for acc, v in zip(out, (max(times), sum(times), max(x[3] for x in stages), depth, peak0)):
            acc.append(v)
    return out


def _judged_by_columns(pool, picks, m, cap):
    """judge_columns over StageTable.stage_columns of stages drawn from a pool of signatures (shared rows)."""
    table = StageTable()
    savers = tuple((0, 0, False) for _ in pool[0])  # any key: the rows are put in by hand
    table.rows[savers] = dict(enumerate(pool))
    sids = list(picks)
    return judge_columns(table.stage_columns(sids, savers, m, cap), sids, m)


@pytest.mark.slow
@settings(max_examples=50, deadline=None)
@given(data=st.data(), stages=st.integers(1, 40), kinds=st.integers(1, 6), savers=st.integers(1, 24),
       m=st.integers(1, 40), cap=st.floats(1e9, 80e9))
def test_judge_columns_answers_what_the_plain_computation_does(data, stages, kinds, savers, m, cap):
    """The parallelizer judges grids from per-signature columns (the most micro-batches that fit, precomputed per
    signature; the stages of a long pipeline share a few signatures; from two distinct ones and 8 saver
    combinations on, judged as arrays):
    bottleneck, tail and fill to the last bit (fill added front to back), depth wherever it is >= 0 (below 0 both
    say 'fits nowhere'), fill left out only for combinations that fit nowhere; peak_memory is fit_depth's peak."""
    act = st.one_of(st.just(0.0), st.floats(1.0, 8e9))
    pool = [[(data.draw(_SECONDS), data.draw(_BYTES), data.draw(act), data.draw(_SECONDS))
             for _ in range(savers)] for _ in range(kinds)]
    picks = [data.draw(st.integers(0, kinds - 1)) for _ in range(stages)]
    rows = [pool[k] for k in picks]
    bn, fill, tail, depth, peak0 = _reference(rows, m, cap)
    assert [peak_memory(rows, s, m) for s in range(savers)] == peak0
    judged = _judged_by_columns(pool, picks, m, cap)
    if judged is None:  # a stage that fits no combination at its place: nothing to judge
        assert max(depth) < 0
        return
    got_bn, got_fill, got_tail, got_depth = judged
    assert (got_bn, got_tail) == (bn, tail)
    assert [d < 0 for d in got_depth] == [d < 0 for d in depth]
    assert [d for d in got_depth if d >= 0] == [d for d in depth if d >= 0]
    if got_fill is None:
        assert max(depth) < 0
    else:
        assert [f for f, d in zip(got_fill, depth) if d >= 0] == [f for f, d in zip(fill, depth) if d >= 0]


@settings(max_examples=50, deadline=None)
@given(data=st.data(), stages=st.integers(1, 60), kinds=st.integers(1, 6), savers=st.integers(1, 24))
def test_fills_of_some_combinations_are_python_sums(data, stages, kinds, savers):
    """grid.fills_of (the fills of the combinations a bound has not ruled out) adds each one's stage times front
    to back, as Python's sum of 3.11 does, to the last bit."""
    pool = [[(data.draw(_SECONDS), 0.0, 0.0, 0.0) for _ in range(savers)] for _ in range(kinds)]
    picks = [data.draw(st.integers(0, kinds - 1)) for _ in range(stages)]
    combos = sorted(data.draw(st.sets(st.integers(0, savers - 1), min_size=1)))
    table = StageTable()
    key = tuple((0, 0, False) for _ in range(savers))
    table.rows[key] = dict(enumerate(pool))
    columns = table.stage_columns(picks, key, 4, 80e9)
    expected = []
    for s in combos:
        total = 0.0
        for k in picks:
            total += pool[k][s][0]
        expected.append(total)
    assert fills_of(columns, picks, combos) == expected


@settings(max_examples=60, deadline=None)
@given(static=_BYTES, act=st.floats(1.0, 8e9), m=st.integers(1, 200), cap=st.floats(1e9, 80e9))
def test_stage_columns_threshold_is_the_memory_check(static, act, m, cap):
    """A stage fits k micro-batches exactly when static + act x k <= capacity (the check fit_depth makes at each
    position), for every k: the precomputed threshold stands in for that comparison."""
    table = StageTable()
    table.rows[("s",)] = {0: [(1.0, static, act, 0.0)]}
    most = table.stage_columns([0], ("s",), m, cap)[0][2]
    assert [k <= most[0] for k in range(1, m + 1)] == [static + act * k <= cap for k in range(1, m + 1)]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), stages=st.integers(1, 30), kinds=st.integers(1, 4), savers=st.integers(1, 6),
       m=st.integers(1, 40))
def test_least_floors_are_below_every_combinations_floors(data, stages, kinds, savers, m):
    """The parallelizer skips a grid when the floors built from each stage's least time and tail cannot beat the
    bounds: they must be at most every combination's own (m - 1) x bottleneck + fill + tail and
    m x bottleneck + tail, added as the plain computation adds them, to the last bit."""
    pool = [[(data.draw(_SECONDS), data.draw(_BYTES), data.draw(st.floats(1.0, 8e9)), data.draw(_SECONDS))
             for _ in range(savers)] for _ in range(kinds)]
    picks = [data.draw(st.integers(0, kinds - 1)) for _ in range(stages)]
    table = StageTable()
    key = tuple((0, 0, False) for _ in range(savers))
    table.rows[key] = dict(enumerate(pool))
    lat, score = least_floors(table.stage_columns(picks, key, m, 1e12), picks, m)
    bn, fill, tail, _depth, _peak = _reference([pool[k] for k in picks], m, 1e12)
    for s in range(savers):
        assert lat <= (m - 1) * bn[s] + fill[s] + tail[s]
        assert score <= m * bn[s] + tail[s]
