"""Why the plan leaves an island out: the reason each dropped island gets in the Plan's ``islands_dropped``.

Pruned islands and islands without a usable slice plan say so. For an island whose slice plans were composed but
lost, the reason quotes a floor under the predicted iteration of every plan using it (cover_floors.island_floor_s:
m x slowest stage + tail, the layers around each of its options covered by the other islands), computed from the
options alone. Only when that floor is below the chosen plan does the reason need the search itself: up to
``exact_islands`` islands one exact composition that must use the island prices its best plan; beyond that (an
island-order search per dropped island would cost as much as the planning itself) the reason says the floor and
that the search found nothing faster.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from tangram_launch.planner.compose import Composition
from tangram_launch.planner.cover_floors import island_floor_s

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.islands import Island
    from tangram_launch.planner.build import Candidates
    from tangram_launch.planner.slices import PairSet


def dropped_islands(cand: "Candidates", idx: Sequence[int], best: Composition, islands: Sequence["Island"],
                    pairset: "PairSet", num_layers: int, caps: "RuntimeCapabilities", exact_islands: int,
                    compose_with: Callable[[int], Composition | None]) -> list[dict]:
    """Each island the plan leaves out, with the reason (pruned, never fits, or only adds a bottleneck).
    ``idx``: the chosen plan's class (option indices into ``cand``); ``compose_with(k)``: the best composition of
    that class that uses island k (None: none), asked only where the floor cannot tell."""
    used = {cand.options[i].island for i in best.options}
    present = {cand.options[i].island for i in idx}
    m = cand.num_microbatches
    out = []
    for k, isl in enumerate(islands):
        if k in used:
            continue
        costed = (" (of the plans costed: the bound skipped those that could not beat the chosen one)"
                  if cand.bounded.get(isl.name) else "")
        if isl.name in pairset.island_notes:
            reason = pairset.island_notes[isl.name]
        elif k not in present:
            why = cand.infeasible.get(isl.name)
            reason = (_bounded(isl.name, best) if cand.bounded.get(isl.name) else
                      f"{isl.name}: no slice plan fits on it ({why[0]})" if why else
                      f"{isl.name}: none of its slice plans can run with the other stages under {caps.name}")
        else:
            floor_s = island_floor_s(cand.options, idx, k, num_layers, m)
            if floor_s == math.inf:
                reason = (f"{isl.name}: no feasible plan uses it: for none of its slice plans do the other islands' "
                          f"slice plans cover the layers in front of and behind it"
                          + (" (of the slice plans costed: the bound skipped those that could not beat the chosen "
                             "plan)" if any(cand.bounded.values()) else ""))
            elif floor_s > best.objective_s:
                reason = (f"{isl.name}: every plan using it is slower: each takes at least {floor_s:.3g} s per "
                          f"iteration (m x its slowest stage + DP sync and optimizer step, at the least the other "
                          f"islands allow), the chosen plan takes {best.objective_s:.3g} s" + costed)
            elif len(present) > exact_islands:
                reason = (f"{isl.name}: every plan using it is slower: the search over more than {exact_islands} "
                          f"islands (exact over island sets where their links allow it, else over island orders) "
                          f"found none that beats the chosen plan ({best.objective_s:.3g} s per iteration, slowest "
                          f"stage or link "
                          f"{best.metrics.period_s:.3g} s per micro-batch)"
                          f"; a plan using it takes at least {floor_s:.3g} s" + costed)
            else:
                reason = _priced(isl.name, compose_with(k), best, bool(cand.bounded.get(isl.name)), costed)
        out.append({"island": isl.name, "reason": reason})
    return out


def _bounded(name: str, best: Composition) -> str:
    """The search's bound (SliceQuery.latency_bound_s) left the island's slice plans out before they were costed."""
    return (f"{name}: every plan using it is slower: none of its slice plans can be part of a pipeline faster than "
            f"the chosen plan ({best.objective_s:.3g} s per iteration): each one's own (m - 1) x slowest stage + "
            f"stage times + DP sync is already longer")


def _priced(name: str, comp: Composition | None, best: Composition, bounded: bool, costed: str) -> str:
    """The reason from the best composition that uses the island (exact search)."""
    if comp is None and bounded:
        return _bounded(name, best)
    if comp is None:
        return (f"{name}: no feasible plan uses it (its slices do not fit in memory at any pipeline position that "
                f"leaves room for the rest of the model)")
    return (f"{name}: every plan using it is slower: the best one takes {comp.objective_s:.3g} s per iteration "
            f"(slowest stage or link {comp.metrics.period_s:.3g} s per micro-batch), the best plan without it "
            f"takes {best.objective_s:.3g} s (slowest stage or link {best.metrics.period_s:.3g} s)" + costed)
