"""Balanced contiguous partition of a slice's layers into pipeline stages (the embedding on the first stage, the
head on the last): the split the cost model assumes for a pipeline inside one island."""
from __future__ import annotations

from typing import Sequence


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


def _balanced_split(weights: Sequence[float], parts: int, *, first_extra: float = 0.0,
                    last_extra: float = 0.0) -> tuple[int, ...]:
    """Split ``weights`` into ``parts`` contiguous non-empty groups minimising the heaviest group, where the first
    group also carries ``first_extra`` (embedding) and the last ``last_extra`` (head). Returns the group sizes.

    Bisection on the bottleneck with a greedy feasibility check (exact for contiguous partitions with non-negative
    weights), then groups are split further, largest first, when the greedy used fewer than ``parts``.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    if parts == 1:
        return (n,)
    w = [float(x) for x in weights]
    w_first = w[0] + first_extra

    back_to_front = w[:0:-1] + [w_first]  # the greedy's visiting order, built once for its ~25 calls

    def greedy(bound: float) -> list[int] | None:
        """Fill groups from the back (the last one starts with the head); None if more than ``parts`` needed."""
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

    lo = max(max(w[1:-1], default=0.0), w_first, w[-1] + last_extra, (sum(w) + first_extra + last_extra) / parts)
    hi = sum(w) + first_extra + last_extra
    best = greedy(hi)
    at_lo = greedy(lo)
    if at_lo is not None:
        best = at_lo
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
    while len(sizes) < parts:  # split the largest group (sums only shrink, so the bottleneck does not grow)
        j = max(range(len(sizes)), key=lambda k: (sizes[k], -k))
        first = sizes[j] // 2
        sizes[j: j + 1] = [first, sizes[j] - first]
    return _smooth(w, sizes, first_extra, last_extra)


def _smooth(w: list[float], sizes: list[int], first_extra: float, last_extra: float) -> tuple[int, ...]:
    """Even out neighbouring groups without raising the bottleneck: move a boundary layer from the heavier to the
    lighter group while that narrows their gap (greedy fills leave the front groups light)."""
    parts = len(sizes)
    for _ in range(4 * len(w)):
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        sums = [sum(w[bounds[k]:bounds[k + 1]]) for k in range(parts)]
        sums[0] += first_extra
        sums[-1] += last_extra
        moved = False
        for k in range(parts - 1):
            a, b = sums[k], sums[k + 1]
            if a > b and sizes[k] > 1:
                x = w[bounds[k + 1] - 1] + (first_extra if bounds[k + 1] - 1 == 0 else 0.0)
                if b + x < a - 1e-12:
                    sizes[k] -= 1
                    sizes[k + 1] += 1
                    moved = True
                    break
            elif b > a and sizes[k + 1] > 1:
                x = w[bounds[k + 1]]
                if a + x < b - 1e-12:
                    sizes[k] += 1
                    sizes[k + 1] -= 1
                    moved = True
                    break
        if not moved:
            break
    return tuple(sizes)
