"""costmodel/partition.py: the closed-form greedy for slices of one layer weight answers exactly what the general
greedy and bisection answer (a slice of identical layers is the common case: Llama-3 405B's 63 atoms of 2 layers)."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.partition import (_balanced_split, _search_sizes, _smooth, _smooth_uniform,
                                                _UniformGreedy, balanced_split_uniform, greedy_split)

# the split's caller (SliceCoster.split) rounds layer weights to 4 decimals and the embedding/head extras to 3
_WEIGHT = st.one_of(st.just(1.0), st.integers(1, 30000).map(lambda k: k / 10000))
_EXTRA = st.one_of(st.just(0.0), st.integers(0, 40000).map(lambda k: k / 1000))


@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(2, 130), u=_WEIGHT, fe=_EXTRA, le=_EXTRA)
def test_closed_form_split_equals_the_general_split(data, n, u, fe, le):
    parts = data.draw(st.integers(2, n))
    w = [u] * n
    got = _balanced_split(w, parts, first_extra=fe, last_extra=le)
    assert got == _balanced_split(w, parts, first_extra=fe, last_extra=le, closed_form=False)
    assert sum(got) == n and len(got) == parts and min(got) >= 1


@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(1, 130), u=_WEIGHT, fe=_EXTRA, le=_EXTRA)
def test_split_by_one_weight_equals_the_general_split(data, n, u, fe, le):
    """balanced_split_uniform (remembered by the weight and the layer count) answers what the general path
    answers for n copies of the weight."""
    parts = data.draw(st.integers(1, n))
    got = balanced_split_uniform(u, n, parts, first_extra=fe, last_extra=le)
    assert got == _balanced_split([u] * n, parts, first_extra=fe, last_extra=le, closed_form=False)
    assert balanced_split_uniform(u, n, parts, first_extra=fe, last_extra=le) is got  # remembered


@settings(max_examples=120, deadline=None)
@given(groups=st.lists(st.integers(1, 12), min_size=1, max_size=40), more=st.integers(0, 60))
def test_groups_split_largest_first_as_one_at_a_time(groups, more):
    """_search_sizes splits the first of the largest groups until there are enough, a size at a time: the same
    groups as splitting them one at a time."""
    parts = len(groups) + min(more, sum(groups) - len(groups))
    expected = list(groups)
    while len(expected) < parts:
        j = expected.index(max(expected))
        first = expected[j] // 2
        expected[j: j + 1] = [first, expected[j] - first]
    assert _search_sizes(lambda bound: list(groups), None, 0.0, 1.0, parts) == expected


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(2, 60), u=_WEIGHT, fe=_EXTRA, le=_EXTRA)
def test_smoothing_one_weight_equals_the_general_smoothing(data, n, u, fe, le):
    """_smooth_uniform makes the moves _smooth makes on n layers of one weight, from any starting groups."""
    parts = data.draw(st.integers(2, n))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=parts - 1, max_size=parts - 1)))
    sizes = [z - a for a, z in zip([0, *cuts], [*cuts, n])]
    assert _smooth_uniform(u, n, list(sizes), fe, le) == _smooth([u] * n, list(sizes), fe, le)


@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(2, 130), u=_WEIGHT, fe=_EXTRA, le=_EXTRA)
def test_closed_form_greedy_equals_the_layer_by_layer_greedy(data, n, u, fe, le):
    """For any bound, not only those the bisection visits (greedy_split is the general path's greedy)."""
    parts = data.draw(st.integers(2, n))
    w_first = u + fe
    total = u * n + fe + le
    bound = data.draw(st.floats(0.0, total * 1.1, allow_nan=False))
    back_to_front = [u] * (n - 1) + [w_first]
    fast = _UniformGreedy.of([u] * n, w_first, le, parts)
    assert fast(bound) == greedy_split(back_to_front, bound, le, parts)


def test_mixed_weights_take_the_general_path():
    w = [3.0, 1.0, 4.0, 1.0, 5.0]
    assert _UniformGreedy.of(w, 3.0, 0.0, 2) is None
    a = _balanced_split(w, 2)[0]
    assert max(sum(w[:a]), sum(w[a:])) == min(max(sum(w[:i]), sum(w[i:])) for i in range(1, 5))  # brute force


def test_uniform_split_is_even_with_lighter_edges():
    assert _balanced_split([1.0] * 126, 63) == (2,) * 63
    sizes = _balanced_split([1.0] * 126, 8, first_extra=2.5, last_extra=4.0)
    assert sum(sizes) == 126 and sizes[0] < max(sizes) and sizes[-1] < max(sizes)
    with pytest.raises(ValueError):
        _balanced_split([1.0] * 3, 4)


def _smooth_reference(w, sizes, fe, le):
    """The plain smoothing: every group's sum taken again after every move."""
    sizes = list(sizes)
    for _ in range(4 * len(w)):
        ends = list(itertools.accumulate(sizes, initial=0))
        sums = [sum(w[a:z]) for a, z in zip(ends, ends[1:])]
        sums[0] += fe
        sums[-1] += le
        for k in range(len(sizes) - 1):
            a, b, cut = sums[k], sums[k + 1], ends[k + 1]
            if a > b and sizes[k] > 1 and b + w[cut - 1] + (fe if cut - 1 == 0 else 0.0) < a - 1e-12:
                sizes[k:k + 2] = [sizes[k] - 1, sizes[k + 1] + 1]
                break
            if not a > b and b > a and sizes[k + 1] > 1 and a + w[cut] < b - 1e-12:
                sizes[k:k + 2] = [sizes[k] + 1, sizes[k + 1] - 1]
                break
        else:
            break
    return tuple(sizes)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), fe=_EXTRA, le=_EXTRA)
def test_smoothing_that_resums_two_groups_equals_resumming_all(data, n, fe, le):
    """_smooth keeps the groups' sums and takes again only the two a move touches: the same moves as taking every
    sum again (the same slice sums, so the same floats)."""
    w = [data.draw(_WEIGHT) for _ in range(n)]
    parts = data.draw(st.integers(1, n))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=parts - 1, max_size=parts - 1))) if n > 1 else []
    sizes = [z - a for a, z in zip([0, *cuts], [*cuts, n])]
    assert _smooth(w, list(sizes), fe, le) == _smooth_reference(w, sizes, fe, le)
