"""Island orders for compositions with more islands than the exact search takes (bounded, not exact).

The exact composer keeps the set of used islands in its state, so it grows as 2^K. Beyond ``exact_islands`` (and
where the islands' link classes would leave the exact search more than class_composition.MERGED_EXACT_STATES keys)
the planner searches pipelines in a fixed island order instead (compose's ``island_order``: polynomial in K, exact for
that order) over a bounded set of orders:

1. the seed orders the driver passes (by memory per GPU and by speed, both directions: island_orders);
2. one greedy chain per start island that always steps to the island behind the fastest link from the current
   one -- on a topology where a single chain of fast links joins the islands, one of them is that chain;
3. local search from the best order found: move one island to another position or swap two (about 1.5 K^2
   neighbours), keep the best improvement, for at most ``passes`` rounds.

``benchmarks/bench_island_order.py`` measures the gap to the exact search on random 6-8-island instances.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from tangram_launch.islands import compute_tflops

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island

DEFAULT_PASSES = 5


def link_chains(present: Sequence[int], link_s: Sequence[Sequence[float]]) -> list[list[int]]:
    """For each start island, the greedy chain through the fastest remaining link (ties: lower index)."""
    out = []
    for start in present:
        order = [start]
        left = [k for k in present if k != start]
        while left:
            cur = order[-1]
            nxt = min(left, key=lambda k: (link_s[cur][k], k))
            order.append(nxt)
            left.remove(nxt)
        out.append(order)
    return out


def search_orders(run: Callable[[list[int]], float | None], present: Sequence[int],
                  link_s: Sequence[Sequence[float]], seeds: Sequence[Sequence[int]] = (), *,
                  passes: int = DEFAULT_PASSES) -> tuple[list[int] | None, int]:
    """The best island order found and how many orders were tried. ``run(order)`` composes in that order and
    returns the latency (None: no plan)."""
    seen: set[tuple[int, ...]] = set()
    best: tuple[float, list[int]] | None = None

    def trial(order: list[int]) -> None:
        nonlocal best
        key = tuple(order)
        if key in seen:
            return
        seen.add(key)
        lat = run(order)
        if lat is not None and (best is None or lat < best[0]):
            best = (lat, list(order))

    for order in [list(s) for s in seeds] + link_chains(present, link_s):
        trial(order)
    for _ in range(passes):
        if best is None:
            break
        start = best[0]
        base = best[1]
        for i in range(len(base)):
            for j in range(len(base)):
                if i == j:
                    continue
                order = base[:i] + base[i + 1:]  # move island i to position j
                order.insert(j, base[i])
                trial(order)
                if i < j:  # swap islands i and j
                    order = list(base)
                    order[i], order[j] = order[j], order[i]
                    trial(order)
        if best[0] >= start:
            break
    return (best[1] if best else None), len(seen)


def fastest_first(islands: Sequence["Island"], present: Sequence[int], dtype: str) -> list[int]:
    """``present`` by peak TFLOPS in ``dtype``, fastest first (ties: more memory per GPU, then index)."""
    return sorted(present, key=lambda k: (-compute_tflops(islands[k].gpu, dtype), -islands[k].gpu.memory_gib, k))


def island_orders(islands: Sequence["Island"], present: Sequence[int], dtype: str) -> list[list[int]]:
    """Pipeline orders tried when there are too many islands for the exact search: most memory per GPU first
    (early stages hold the most in-flight activations under 1F1B), fastest first, slowest first, and least
    memory first; each is searched exactly."""

    def mem(k: int) -> float:
        return islands[k].gpu.memory_gib

    def speed(k: int) -> float:
        return compute_tflops(islands[k].gpu, dtype)

    candidates = [sorted(present, key=lambda k: (-mem(k), -speed(k), k)),
                  fastest_first(islands, present, dtype),
                  sorted(present, key=lambda k: (speed(k), -mem(k), k)),
                  sorted(present, key=lambda k: (mem(k), -speed(k), k))]
    out: list[list[int]] = []
    for o in candidates:
        if o not in out:
            out.append(o)
    return out
