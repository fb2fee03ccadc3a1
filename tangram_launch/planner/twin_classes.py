"""Twin compatibility classes: classes whose options are the same numbers under other process grids.

A uniform-grid runtime (Megatron) has one compatibility class per (tp, dp, cp), and the driver composes each. Grids with
the same tp and the same dp x cp give every GPU the same tokens (b / dp sequences of seq / cp tokens); where the
context-parallel exchange hides under attention, the cost model prices their slices the same to the bit, and the classes
hold the same options (on a large cluster a good share of the classes repeat another's). Every pipeline of a twin has
the same closed form, the same simulated 1F1B and the same interleaving choice as the same pipeline of the class it
repeats; composed after that class, under bounds no looser, it can only find plans that tie the ones found there, and a
tie does not replace the best plan. So each set of twins is composed once, and the plan is the one the full search
picks.

Twins: the same options (compose.Option and edge times) in the same order, with the same score schedules, whose
slice plans have the same numbers (SliceNumbers: stage times, memory, tails; shapes with the same tp, ep, memory
savers and dp x cp). The plain 1F1B simulation reads a stage's forward and backward apart, which the numbers hold
as one sum: the cost model splits the same tokens the same way (tests/test_planner_twin_classes.py builds twins' stages
and checks it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from tangram_launch.planner.compose import pick

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.costmodel.slice_plan import SlicePlan
    from tangram_launch.planner.build import Candidates
    from tangram_launch.specs.shape import StageShape


class TwinClasses:
    """The classes one composition round at one micro-batch size has handled, to pass over their twins."""

    def __init__(self, cand: "Candidates") -> None:
        self._cand = cand
        # (schedules, options, first option, last option) -> option indices of the classes handled
        self._handled: dict[tuple, list[Sequence[int]]] = {}
        self._same_plans: dict[tuple[int, int], bool] = {}  # (id, id) of two slice plans -> same numbers

    def twin_of(self, idx: Sequence[int], schedules: Hashable) -> Sequence[int] | None:
        """The options of a class handled before in this round that the class of options ``idx`` is a twin of;
        None if there is none, and the class counts as handled from now on."""
        if not idx:
            return None
        options = self._cand.options
        key = (schedules, len(idx), options[idx[0]], options[idx[-1]])
        handled = self._handled.setdefault(key, [])
        for other in handled:
            if self._twins(other, idx):
                return other
        handled.append(idx)
        return None

    def _twins(self, a: Sequence[int], b: Sequence[int]) -> bool:
        cand = self._cand
        options, edges, sources = cand.options, cand.edges, cand.sources
        if len(a) != len(b) or pick(options, a) != pick(options, b):
            return False
        if edges and pick(edges, a) != pick(edges, b):
            return False
        same = self._same_plans
        slots_a, slots_b = sources.plan_slots(a), sources.plan_slots(b)
        if slots_a is None or slots_b is None:  # options added one by one: each option's plan
            pairs = ((sources[i][1], sources[j][1]) for i, j in zip(a, b))
        else:  # pairs of one answer share its plans: each distinct pair of slots once (in any order: all must match)
            distinct = dict.fromkeys(map(tuple, np.concatenate([slots_a, slots_b], axis=1).tolist()))
            pairs = ((sources.plan_at(s, i), sources.plan_at(t, j)) for s, i, t, j in distinct)
        for p, q in pairs:
            key = (id(p), id(q))
            hit = same.get(key)
            if hit is None:
                hit = same[key] = _same_numbers(p, q)
            if not hit:
                return False
        return True


def _same_numbers(p: "SlicePlan", q: "SlicePlan") -> bool:
    """Whether two slice plans have the same numbers but for their stages' dp / cp split and micro-batch size."""
    if p is q:
        return True
    n, o = p.numbers(), q.numbers()
    return (n.time_s == o.time_s and n.static_bytes == o.static_bytes and n.activation_bytes == o.activation_bytes
            and n.tail_s == o.tail_s and len(n.shapes) == len(o.shapes)
            and all(_same_shape(s, t) for s, t in zip(n.shapes, o.shapes)))


def _same_shape(s: "StageShape", t: "StageShape") -> bool:
    return s is t or (s.tp == t.tp and s.ep == t.ep and s.dp * s.cp == t.dp * t.cp and s.zero_stage == t.zero_stage
                      and s.recompute == t.recompute and s.offload == t.offload)
