"""The pipeline simulations are kept by the stage times' values: a kept answer is the one the simulation gives,
bit for bit, whatever container (list, tuple, numpy array) the same numbers come in and in whatever order the
shapes are asked for."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.interleaved_schedule import _run, simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import _run_1f1b, simulated_1f1b_s

_SECONDS = st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def _pipelines(draw):
    """(forward, backward, p2p seconds, m, v) with m a multiple of S, from a small pool of values so that the
    same stage times come back (the cache hits) next to near misses."""
    S = draw(st.integers(1, 14))
    m = S * draw(st.integers(1, 3))
    pool = draw(st.lists(_SECONDS, min_size=1, max_size=3))
    fwd = draw(st.lists(st.sampled_from(pool), min_size=S, max_size=S))
    bwd = draw(st.lists(st.sampled_from(pool), min_size=S, max_size=S))
    p2p = draw(st.lists(st.sampled_from([0.0, 0.3]), min_size=S - 1, max_size=S - 1))
    return fwd, bwd, p2p, m, draw(st.integers(2, 4))


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(st.lists(_pipelines(), min_size=1, max_size=6), st.sampled_from([list, tuple, np.array]))
def test_kept_simulations_equal_fresh_ones_bit_for_bit(cases, container):
    for fwd, bwd, p2p, m, v in cases + cases[::-1]:  # every shape asked twice, in both orders
        args = [container(x) if x else x for x in (fwd, bwd, p2p)]
        fresh = _run(fwd, bwd, p2p, m, v, None)
        kept = simulated_interleaved_1f1b_s(*args, m, v)
        assert kept == fresh and kept.hex() == float(fresh).hex() and type(kept) is float
        fresh = _run_1f1b(fwd, bwd, p2p, m, None)
        kept = simulated_1f1b_s(*args, m)
        assert kept == fresh and kept.hex() == float(fresh).hex()
