"""Balanced contiguous partition of a slice's layers into pipeline stages (the embedding on the first stage, the
head on the last): the split the cost model assumes for a pipeline inside one island."""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache, partial
from typing import Sequence

import numpy as np


_MEMO_MAX = 1 << 15  # remembered splits (a planning run asks for the same few thousand from many contexts)
_memo: dict[tuple, tuple[int, ...]] = {}


def balanced_split(weights: Sequence[float], parts: int, *, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> tuple[int, ...]:
    """_balanced_split, remembered across islands and micro-batch sizes (each query context has its own split
    cache, but equal weights recur in many contexts; the bisection costs ~25 passes over the layers)."""
    key = (tuple(weights), parts, first_extra, last_extra)
    hit = _memo.get(key)
    if hit is None:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        hit = _memo[key] = _balanced_split(weights, parts, first_extra=first_extra, last_extra=last_extra)
    return hit


def balanced_split_uniform(weight: float, n: int, parts: int, *, first_extra: float = 0.0,
                           last_extra: float = 0.0) -> tuple[int, ...]:
    """balanced_split of ``n`` layers that all weigh ``weight`` (a slice of one layer kind), remembered by those
    numbers instead of the n weights: the same answer, without a list of weights to build, hash and check."""
    key = ("uniform", weight, n, parts, first_extra, last_extra)
    hit = _memo.get(key)
    if hit is None:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        u = float(weight)
        if u != u or not 1 < parts <= n:  # (NaN, or what the general path answers or refuses)
            hit = _balanced_split((weight,) * n, parts, first_extra=first_extra, last_extra=last_extra)
        else:
            w_first = u + first_extra
            uniform = _UniformGreedy(u, w_first, *_uniform_sums(u, w_first, last_extra, n), parts)
            hi = _uniform_run_sum(u, n) + first_extra + last_extra  # sum(w) + first_extra + last_extra
            lo = max(u if n > 2 else 0.0, w_first, u + last_extra, hi / parts)
            hit = _smooth_uniform(u, n, _search_sizes(uniform, uniform, lo, hi, parts), first_extra, last_extra)
        _memo[key] = hit
    return hit


def _balanced_split(weights: Sequence[float], parts: int, *, first_extra: float = 0.0,
                    last_extra: float = 0.0, closed_form: bool = True) -> tuple[int, ...]:
    """Split ``weights`` into ``parts`` contiguous non-empty groups minimising the heaviest group, where the first
    group also carries ``first_extra`` (embedding) and the last ``last_extra`` (head). Returns the group sizes.

    Bisection on the bottleneck with a greedy feasibility check (exact for contiguous partitions with non-negative
    weights), then groups are split further, largest first, when the greedy used fewer than ``parts``.
    ``closed_form``: where all weights are equal, the greedy and the bisection in closed form (_UniformGreedy:
    the same answer, faster; off only to test that).
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    if parts == 1:
        return (n,)
    w = list(map(float, weights))
    w_first = w[0] + first_extra

    uniform = _UniformGreedy.of(w, w_first, last_extra, parts) if closed_form else None
    # one layer weight: the same greedy in closed form (see _UniformGreedy); else layer by layer, visiting the
    # layers back to front (that order built once for the greedy's ~25 calls)
    greedy = uniform if uniform is not None else partial(greedy_split, w[:0:-1] + [w_first], last_extra=last_extra,
                                                         parts=parts)
    middle = (w[0] if n > 2 else 0.0) if uniform is not None else max(w[1:-1], default=0.0)  # the heaviest middle
    hi = sum(w) + first_extra + last_extra
    lo = max(middle, w_first, w[-1] + last_extra, hi / parts)
    sizes = _search_sizes(greedy, uniform, lo, hi, parts)
    if uniform is not None:
        return _smooth_uniform(w[0], len(w), sizes, first_extra, last_extra)
    return _smooth(w, sizes, first_extra, last_extra)


def _search_sizes(greedy, uniform: "_UniformGreedy | None", lo: float, hi: float, parts: int) -> list[int]:
    """_balanced_split's group sizes before smoothing: the bisection on the bottleneck between ``lo`` and ``hi``
    (``greedy``: its feasibility check), then the largest groups split until there are ``parts``."""
    best = greedy(hi)
    at_lo = greedy(lo)
    if at_lo is not None:
        best = at_lo
    elif uniform is not None and (at_opt := uniform.bisection_answer()) is not None:
        best = at_opt
    else:
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            got = greedy(mid)
            if got is None:
                lo = mid
            else:
                hi, best = mid, got
            if hi - lo <= 1e-6 * hi:
                break
    assert best is not None
    sizes = list(best)
    # split the largest group, the first of them, until there are ``parts`` (sums only shrink, so the bottleneck
    # does not grow); both halves of a group are smaller, so that takes the largest ones front to back, a size at a
    # time (one pass each)
    need = parts - len(sizes)
    while need > 0:
        top = max(sizes)
        halves = (top // 2, top - top // 2)
        out: list[int] = []
        for size in sizes:
            if size == top and need > 0:
                out += halves
                need -= 1
            else:
                out.append(size)
        sizes = out
    return sizes


def greedy_split(back_to_front: Sequence[float], bound: float, last_extra: float, parts: int) -> list[int] | None:
    """_balanced_split's feasibility check: fill groups from the back (the last one starts with ``last_extra``, the
    head), each up to ``bound``; the group sizes front to back, or None if more than ``parts`` are needed."""
    sizes: list[int] = []
    cur, count = last_extra, 0
    for x in back_to_front:
        if cur + x <= bound:
            cur += x
            count += 1
            continue
        if count == 0 or x > bound:
            return None
        sizes.append(count)
        if len(sizes) >= parts:
            return None
        cur, count = x, 1
    sizes.append(count)
    return sizes[::-1]


@lru_cache(maxsize=4096)
def _running_sums(start: float, u: float, n: int) -> tuple[float, ...]:
    """start, start + u, (start + u) + u, ...: n values, added one at a time as the greedy adds them."""
    out = [start]
    for _ in range(n - 1):
        out.append(out[-1] + u)
    return tuple(out)


@lru_cache(maxsize=4096)
def _uniform_run_sum(u: float, count: int) -> float:
    """sum() of ``count`` weights u: _smooth's slice sum of a group of that many identical layers."""
    return sum([u] * count)


@lru_cache(maxsize=4096)
def _uniform_sums(u: float, w_first: float, last_extra: float, n: int) -> tuple[tuple[float, ...], tuple[float, ...],
                                                                               tuple[float, ...], list[int]]:
    """_UniformGreedy's sums for n layers of weight u, which do not depend on the number of parts (a planning run
    splits the same slice into many): the head's group's running sums (``last``), another group's (``other``),
    every sum the greedy compares with its bound, sorted (bisection_answer's candidates), and per candidate the
    fewest groups the greedy needs under it (_groups_needed)."""
    # last[k]: the head's group's sum after k layers, added as the greedy adds them; other[j]: another group's
    # sum after j + 1 layers
    last, other = _running_sums(last_extra, u, n), _running_sums(u, u, n)
    values = {u, w_first, *last[1:], *other, last[-1] + w_first, *(x + w_first for x in other)}
    cands = tuple(sorted(values))
    return last, other, cands, _groups_needed(u, w_first, last, other, cands)


_NEVER = 1 << 40  # _groups_needed of a bound no number of parts meets


def _groups_needed(u: float, w_first: float, last: Sequence[float], other: Sequence[float],
                   bounds: Sequence[float]) -> list[int]:
    """Per bound, the fewest parts for which _UniformGreedy's greedy returns a split (else None), for every bound
    at once: its steps as array operations (searchsorted 'right' is bisect_right; the same float sums and
    comparisons), so a bisection over the candidates reads feasibility instead of running the greedy."""
    r = len(last) - 1
    c = np.asarray(bounds, dtype=np.float64)
    last_a, other_a = np.asarray(last, dtype=np.float64), np.asarray(other, dtype=np.float64)
    k = np.searchsorted(last_a[1:r + 1], c, side="right")  # bisect_right(last, bound, 1, r + 1) - 1
    step = np.searchsorted(other_a[1:r + 1], c, side="right") + 1  # bisect_right(other, bound, 1, r + 1)
    rest = r - k
    groups = -(-rest // step)
    tail = rest - (groups - 1) * step
    front_sum = other_a[np.clip(tail - 1, 0, len(other) - 1)] + w_first  # (read only where 1 <= tail <= step)
    front = np.where(front_sum <= c, 1, np.where(w_first > c, _NEVER, 2))
    middle = np.where((k == 0) | (u > c), _NEVER, groups + front)
    head_only = np.where(last_a[r] + w_first <= c, 1, np.where((k != 0) & (w_first <= c), 2, _NEVER))
    return np.where(k == r, head_only, np.minimum(middle, _NEVER)).tolist()


class _UniformGreedy:
    """_balanced_split's greedy when every layer weighs the same (a slice of one layer kind: the common case), in
    closed form: the same answer for every bound, from the same float sums, in O(log n) instead of O(n).

    The greedy visits the layers back to front; the head's group accumulates ``last_extra + u + u ...`` (``last``
    below), every other group ``u + u ...`` (``other``), and the layer holding the embedding, visited last, weighs
    ``w_first``. So the head's group takes as many layers as ``last`` allows, every middle group the same number,
    and the front group what remains, with the embedding's layer if it still fits."""

    def __init__(self, u: float, w_first: float, last: Sequence[float], other: Sequence[float],
                 cands: Sequence[float], needed: Sequence[int], parts: int) -> None:
        self.u, self.w_first, self.last, self.other, self.parts = u, w_first, last, other, parts
        self.cands, self.needed = cands, needed  # bisection_answer's candidate bounds and their _groups_needed
        self.r = len(last) - 1  # layers of weight u (all but the first)

    @classmethod
    def of(cls, w: list[float], w_first: float, last_extra: float, parts: int) -> "_UniformGreedy | None":
        u = w[-1]
        if u != u or w.count(u) != len(w):  # some weight differs (count compares as x == u does: NaN aside)
            return None
        return cls(u, w_first, *_uniform_sums(u, w_first, last_extra, len(w)), parts)

    def __call__(self, bound: float) -> list[int] | None:
        u, w_first, last, other, parts, r = self.u, self.w_first, self.last, self.other, self.parts, self.r
        k = bisect_right(last, bound, 1, r + 1) - 1  # layers the head's group takes
        if k == r:
            if last[r] + w_first <= bound:
                return [r + 1]
            return None if k == 0 or w_first > bound or parts < 2 else [1, k]
        if k == 0 or u > bound:
            return None
        step = bisect_right(other, bound, 1, r + 1)  # layers every middle group takes (other[step - 1] <= bound)
        rest = r - k  # layers left for the middle groups
        groups = -(-rest // step)
        tail = rest - (groups - 1) * step  # layers of the front-most middle group
        if other[tail - 1] + w_first <= bound:
            front: list[int] = [tail + 1]
        elif w_first > bound:
            return None
        else:
            front = [1, tail]
        if 1 + groups - 1 + len(front) > parts:
            return None
        return front + [step] * (groups - 1) + [k]

    def bisection_answer(self) -> list[int] | None:
        """What _balanced_split's bisection ends with, from a bisection over the few sums the greedy compares with
        its bound (its answer changes only there): the smallest sum it can meet. The real bisection stops within
        a relative 1e-6 above that sum, which gives the same answer unless another sum lies in that gap: then
        None, and the caller bisects as before."""
        cands, needed, parts = self.cands, self.needed, self.parts  # self(cands[i]) is None: needed[i] > parts
        lo_i, hi_i = 0, len(cands) - 1
        if needed[hi_i] > parts:
            return None
        while lo_i < hi_i:  # feasibility is monotone in the bound
            mid = (lo_i + hi_i) // 2
            if needed[mid] > parts:
                lo_i = mid + 1
            else:
                hi_i = mid
        opt = cands[lo_i]
        if lo_i + 1 < len(cands) and cands[lo_i + 1] * (1.0 - 2e-6) <= opt:
            return None
        return self(opt)


def _smooth_uniform(u: float, n: int, sizes: list[int], first_extra: float, last_extra: float) -> tuple[int, ...]:
    """_smooth of n layers that all weigh u: a group's slice sum depends on its size only (remembered by it), and
    a moved layer is never the embedding's (the group it leaves keeps a layer), so it weighs u + 0.0 -- the same
    moves as _smooth, without its boundaries."""
    parts = len(sizes)
    x = u + 0.0  # _smooth's moved layer (w[i] + 0.0 away from layer 0)
    sums = list(map({size: _uniform_run_sum(u, size) for size in set(sizes)}.__getitem__, sizes))
    sums[0] += first_extra
    sums[-1] += last_extra
    start = 0
    for _ in range(4 * n):
        moved = False
        for k in range(start, parts - 1):
            a, b = sums[k], sums[k + 1]
            if a > b:
                if sizes[k] > 1 and b + x < a - 1e-12:
                    sizes[k] -= 1
                    sizes[k + 1] += 1
                    moved = True
            elif b > a and sizes[k + 1] > 1 and a + x < b - 1e-12:
                sizes[k] += 1
                sizes[k + 1] -= 1
                moved = True
            if moved:  # as _smooth: the two groups' sums again, and on from the pair before them
                sums[k] = _uniform_run_sum(u, sizes[k]) + (first_extra if k == 0 else 0.0)
                sums[k + 1] = _uniform_run_sum(u, sizes[k + 1]) + (last_extra if k + 1 == parts - 1 else 0.0)
                start = k - 1 if k else 0
                break
        if not moved:
            break
    return tuple(sizes)


def _smooth(w: list[float], sizes: list[int], first_extra: float, last_extra: float,
            uniform: bool = False) -> tuple[int, ...]:
    """Even out neighbouring groups without raising the bottleneck: move a boundary layer from the heavier to the
    lighter group while that narrows their gap (greedy fills leave the front groups light). A move changes only
    the two groups it touches: their sums are taken again (the same slice sums), the others kept. ``uniform``:
    every weight is w[0], so a group's slice sum depends on its size only and is remembered by it."""
    parts = len(sizes)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    run_sum = partial(_uniform_run_sum, w[0]) if uniform else None

    def group_sum(k: int) -> float:
        total = run_sum(sizes[k]) if run_sum is not None else sum(w[bounds[k]:bounds[k + 1]])
        if k == 0:
            total += first_extra
        if k == parts - 1:
            total += last_extra
        return total

    if run_sum is not None:  # group_sum of every group, its additions in its order
        sums = list(map(run_sum, sizes))
        sums[0] += first_extra
        sums[-1] += last_extra
    else:
        sums = [group_sum(k) for k in range(parts)]
    start = 0  # the pairs before it were judged with the sums they have now: none of them moves
    for _ in range(4 * len(w)):
        moved = False
        for k in range(start, parts - 1):
            a, b = sums[k], sums[k + 1]
            if a > b and sizes[k] > 1:
                x = w[bounds[k + 1] - 1] + (first_extra if bounds[k + 1] - 1 == 0 else 0.0)
                if b + x < a - 1e-12:
                    sizes[k] -= 1
                    sizes[k + 1] += 1
                    bounds[k + 1] -= 1
                    moved = True
            elif b > a and sizes[k + 1] > 1:
                x = w[bounds[k + 1]]
                if a + x < b - 1e-12:
                    sizes[k] += 1
                    sizes[k + 1] -= 1
                    bounds[k + 1] += 1
                    moved = True
            if moved:  # groups k and k + 1 changed: the pair before them is judged again, and on from there
                sums[k], sums[k + 1] = group_sum(k), group_sum(k + 1)
                start = k - 1 if k else 0
                break
        if not moved:
            break
    return tuple(sizes)
