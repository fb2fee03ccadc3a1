"""costmodel/grid.judge_grid (one loop per saver combination, fit_depth inlined) answers exactly what the plain
per-combination computation does: max / Python sum / max of the stage rows and grid.fit_depth."""
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.grid import INFEASIBLE_FILL, fit_depth, judge_grid

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


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stages=st.integers(1, 6), savers=st.integers(1, 5), m=st.integers(1, 40),
       cap=st.floats(1e9, 80e9))
def test_judge_grid_matches_the_plain_computation(data, stages, savers, m, cap):
    rows = [[(data.draw(_SECONDS), data.draw(_BYTES), data.draw(st.floats(1.0, 8e9)), data.draw(_SECONDS))
             for _ in range(savers)] for _ in range(stages)]
    assert judge_grid(rows, m, cap) == _reference(rows, m, cap)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stages=st.integers(3, 40), kinds=st.integers(1, 4), savers=st.integers(1, 5),
       m=st.integers(1, 40), cap=st.floats(1e9, 80e9))
def test_judge_grid_with_shared_stage_rows_matches_the_plain_computation(data, stages, kinds, savers, m, cap):
    """StageTable.stage_rows hands one row list per stage signature, so the stages of a long pipeline share a few
    lists; judge_grid then judges each list once at its first stage, and must still answer what the plain
    per-stage computation does (fill added front to back, to the last bit)."""
    pool = [[(data.draw(_SECONDS), data.draw(_BYTES), data.draw(st.floats(1.0, 8e9)), data.draw(_SECONDS))
             for _ in range(savers)] for _ in range(kinds)]
    rows = [pool[data.draw(st.integers(0, kinds - 1))] for _ in range(stages)]
    want = _reference(rows, m, cap)
    if max(want[3]) < 0 and len({id(r) for r in rows}) < stages:  # shared rows, nothing fits: no fill added up
        want[1][:] = [INFEASIBLE_FILL] * len(want[1])
    assert judge_grid(rows, m, cap) == want
