"""The composer on one compatibility class of one micro-batch size (compose_group): the class's options worth
composing (class_options, cover_floors.promising), the islands some winning plan can use (hopeful_islands), the
exact search over island subsets or, above exact_islands islands, the merged search over island sets (exact for
the closed form, not for the score: it has no complete pass, compose.py) or a bounded set of island orders
(orders.py); and how a class's pipelines are scored (ClassScores: the predicted iteration the Plan
will report, and the floors under it the composer prunes by)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Sequence

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.interleaved_schedule import FLOOR_ROUNDING
from tangram_launch.costmodel.pipeline import cycle_floor_1f1b_s
from tangram_launch.costmodel.plain_1f1b_paths import path_floor_1f1b_s
from tangram_launch.planner.bounds import interleaved_1f1b_floor_s, plain_1f1b_floor_s
from tangram_launch.planner.build import Candidates
from tangram_launch.planner.compose import SCORE_ANY, Composition, ComposeStats, Option, compose, merged_states, pick
from tangram_launch.planner.cover_floors import island_floors_s, promising
from tangram_launch.planner.interleave import MAX_VIRTUAL_STAGES
from tangram_launch.planner.options import PlannerOptions
from tangram_launch.planner.orders import island_orders, search_orders
from tangram_launch.planner.plain_complete import can_interleave, floor_stage_times

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np


# above exact_islands, the search still covers every island set and order where its DP keys per layer, with front
# islands merged by link class (compose.merged_states), are this few: up to 8 islands that talk over one spine. It is
# exact for the closed form only: without a complete pass (its states would hold every island set's sequences,
# far too many on a large cluster) the DP's dominance can drop a near tie that simulates faster, and which one depends
# on the options and bounds a class is composed with, so on the order micro-batch sizes are visited (docs/planner.md)
MERGED_EXACT_STATES = 256


@dataclass
class ClassScores:
    """How the composer ranks the pipelines of one compatibility class (``idx``: its options in ``cand``; ``sub``:
    those options, which a pipeline ``seq`` indexes): the predicted iteration build_plan will report, and floors
    under it for pruning. ``schedules``: the schedules whose predictions can matter in this class
    (size_composition._score_schedules)."""

    cand: Candidates
    idx: Sequence[int]
    sub: Sequence[Option]
    m: int
    caps: RuntimeCapabilities
    opts: PlannerOptions
    schedules: tuple[str, ...]
    scores: dict = field(default_factory=dict)  # the island orders meet the same plans again and again
    stage_times: dict = field(default_factory=dict)  # option -> its stages' times (plain_complete.floor_stage_times)

    def predicted_s(self, seq: tuple[int, ...], metrics) -> float:
        """What build_plan will report for the pipeline (Candidates.schedule_choice)."""
        hit = self.scores.get(seq)
        if hit is None:
            hit = self.scores[seq] = self.cand.schedule_choice([self.idx[i] for i in seq], metrics,
                                                               schedule=self.opts.schedule,
                                                               capabilities=self.caps).latency_s
        return hit

    def one_grid(self, seq: tuple[int, ...]) -> bool:
        """Whether build_plan may interleave the sequence although only its plain 1F1B counts in this class (a free
        torch class under "auto": a pipeline whose stages share one grid)."""
        if self.opts.schedule == "1F1B" or "interleaved-1F1B" not in self.caps.schedules:
            return False
        grids = {getattr(self.cand.groups[self.idx[i]], "grid", None) for i in seq}
        return len(grids) == 1 and None not in grids

    def plain_floor_s(self, seq: tuple[int, ...], metrics, *, round_trips: bool, exact: bool = True,
                      cut: float = math.inf) -> float:
        """Under the plain 1F1B simulation + tail: bounds.plain_1f1b_floor_s, with ``round_trips`` the largest of
        it, costmodel.pipeline.cycle_floor_1f1b_s and costmodel.plain_1f1b_paths.path_floor_1f1b_s over the
        sequence's stages; ``exact`` False: with the island matrix's p2p (plain_complete.floor_stage_times, no GPU
        placement), not the exact boundaries'. Where the first is above ``cut``, it alone (a caller that only asks
        whether the floor is above ``cut`` needs no stage times); where the larger of the first two is, that (no
        path floor: it could only raise it)."""
        floor = plain_1f1b_floor_s(seq, self.sub, self.cand.link_matrix, self.m, metrics.tail_s)
        if round_trips and floor <= cut:
            at = [self.idx[i] for i in seq]
            stage_times = self.cand.stage_times(at) if exact else floor_stage_times(self.cand, at, self.stage_times)
            floor = max(floor, cycle_floor_1f1b_s(*stage_times, self.m) + metrics.tail_s)
            if floor <= cut:
                floor = max(floor, path_floor_1f1b_s(*stage_times, self.m) * (1.0 - FLOOR_ROUNDING) + metrics.tail_s)
        return floor

    def floor_s(self, seq: tuple[int, ...], metrics) -> float:
        """Under predicted_s where it can matter: plain 1F1B, the larger of bounds.plain_1f1b_floor_s and the
        round trips across its stage boundaries (costmodel.pipeline.cycle_floor_1f1b_s: where a slow link lies
        between islands, most candidates' simulations are far above the former); interleaved,
        bounds.interleaved_1f1b_floor_s with v <= MAX_VIRTUAL_STAGES; either, the lesser; anything, the slowest
        stage's m forwards and backwards and the tail."""
        return self.floor_cut_s(seq, metrics, math.inf)

    def floor_cut_s(self, seq: tuple[int, ...], metrics, cut: float) -> float:
        """floor_s, or where the plain floor's first term and the interleaved floor (where it counts) are above
        ``cut``, a value above ``cut`` under floor_s, without the round trips (compose's ``score_floor_cut``: an
        offer whose floor is above the best score needs no finer one, and most near ties of a complete pass are).
        Nor are the round trips read where that first term is above the interleaved floor: the lesser is that."""
        if self.schedules == SCORE_ANY:
            return self.m * max(self.sub[i].bottleneck_s for i in seq) + metrics.tail_s
        inter = math.inf
        # (where a plain score counts and the pipeline cannot interleave, its score is the plain one)
        if "interleaved" in self.schedules and ("plain" not in self.schedules
                                                or can_interleave(seq, self.sub, self.m)):
            inter = interleaved_1f1b_floor_s(seq, self.sub, self.cand.link_matrix, self.m, metrics.fill_s,
                                             metrics.tail_s, MAX_VIRTUAL_STAGES)
        floor = math.inf
        if "plain" in self.schedules:
            # (with only plain counted, a one-grid pipeline's score may be interleaved: not under the round trips;
            # nor for a plan of one slice plan, whose stages would have to be built: the fine floor reads them,
            # for those this floor lets through, and a size's first ranking meets thousands of such plans)
            floor = self.plain_floor_s(seq, metrics, round_trips=len(seq) > 1 and (
                "interleaved" in self.schedules or not self.one_grid(seq)), exact=False, cut=min(cut, inter))
        return min(floor, inter)

    def fine_floor_s(self, seq: tuple[int, ...], metrics) -> float:
        """Under predicted_s, asked only before scoring: the lesser of the plain 1F1B's floors (compose's and the
        round trips across its stage boundaries) and the best interleaved schedule's own floor
        (interleaved_schedule.interleaved_floor_s of its stages), which needs no simulation. Under any schedule and
        class (an interleaved score is the interleaved prediction): floor_s's interleaved floor is the least over
        every number of virtual stages and memory, this one the schedule build_plan would choose, so far fewer
        candidates are simulated."""
        plain = self.plain_floor_s(seq, metrics, round_trips=True)
        if self.opts.schedule == "1F1B":
            return plain
        inter = self.cand.interleaved_choice([self.idx[i] for i in seq], metrics, schedule=self.opts.schedule,
                                             capabilities=self.caps)
        return min(plain, inter.latency_s) if inter.virtual_stages > 1 else plain


class ClassOptions(NamedTuple):
    """The options of a class worth composing (class_options): their indices in the Candidates, those options,
    their rows (Candidates.option_rows) where known, and the islands a pipeline may use, as a list and a mask."""

    idx: Sequence[int]
    sub: Sequence[Option]
    rows: "np.ndarray | None"
    present: list[int]
    allowed_mask: int | None


def class_options(cand: Candidates, idx: Sequence[int], L: int, m: int, opts: PlannerOptions, *,
                  allowed_mask: int | None, required_mask: int, incumbent_s: float, score_incumbent_s: float,
                  schedules: tuple[str, ...], searched: Sequence[Option] | None,
                  rows: "np.ndarray | None") -> ClassOptions | None:
    """The class's options that some plan beating the incumbents can hold (cover_floors.promising: compose would
    prune the others at every use, but they cost it time in each of up to hundreds of island orders), and the
    islands to compose over; None where every promising option was ``searched`` before (every plan that could beat
    the bounds holds only options searched before: it was found then)."""
    # with the floors of the class's own schedules where it is composed in many island orders or by the merged exact
    # search (above exact_islands): there an option dropped saves more than its floors cost
    weight = 1.0 / MAX_VIRTUAL_STAGES if "interleaved" in schedules else 0.0
    many = len(cand.islands) > opts.exact_islands
    idx = promising(cand.options, idx, L, m, incumbent_s, score_incumbent_s, cand.link_matrix,
                    schedules=schedules if many else SCORE_ANY, fill_weight=weight if many else 0.0,
                    rows=rows[idx] if rows is not None else None)
    sub_rows = rows[idx] if rows is not None else None  # (the kept options' rows: compose prepares by them)
    sub = pick(cand.options, idx)
    if searched is not None and _all_in(sub, searched):
        return None
    if sub_rows is not None:
        present = sorted(k for k in set(sub_rows[:, 2].astype(int).tolist())
                         if allowed_mask is None or allowed_mask >> k & 1)
    else:
        present = sorted({o.island for o in sub if allowed_mask is None or allowed_mask >> o.island & 1})
    if allowed_mask is None and present:  # (what compose takes by default, from these options: every island)
        allowed_mask = (1 << (1 + present[-1])) - 1
    if len(present) > opts.exact_islands and merged_states(cand.link_matrix, present) > MERGED_EXACT_STATES:
        # (where the exact search over every island set runs anyway, its floors per set of free islands prune what
        # an island left out would)
        present = hopeful_islands(sub, present, required_mask, L, m, score_incumbent_s)
        allowed_mask = sum(1 << k for k in present)
    return ClassOptions(idx, sub, sub_rows, present, allowed_mask)


def _all_in(sub: Sequence[Option], searched: Sequence[Option]) -> bool:
    """Whether every option of ``sub`` is one of ``searched`` (set(sub) <= set(searched), without hashing the rest
    of ``sub`` once one is new: a round at a size mostly brings new options)."""
    have = set(searched)
    return all(o in have for o in sub)


def compose_group(cand: Candidates, idx: Sequence[int], L: int, m: int, caps: RuntimeCapabilities,
                  opts: PlannerOptions, stats: ComposeStats, *, allowed_mask: int | None = None,
                  required_mask: int = 0, incumbent_s: float = float("inf"),
                  score_incumbent_s: float = float("inf"),
                  schedules: tuple[str, ...] = SCORE_ANY,
                  searched: Sequence[Option] | None = None,
                  rows: "np.ndarray | None" = None, deferred: list | None = None) -> Composition | None:
    """The composer on one compatibility class: exact over island subsets up to ``opts.exact_islands`` islands,
    beyond that over a bounded set of island orders (polynomial; see orders.search_orders). ``incumbent_s``: the
    closed form to beat; ``score_incumbent_s``: the best predicted iteration found elsewhere (winners that cannot
    beat it are not simulated); ``schedules``: the schedules whose predictions can matter here
    (size_composition._score_schedules), so that the composer prunes by their floors; ``searched``: options of this
    class already composed under bounds no tighter, whose plans already count in the incumbents: None is returned
    unless a promising option is new.
    ``rows``: every option of ``cand`` as Candidates.option_rows (promising then reads the class's rows), or None;
    ``deferred``: where a list, complete passes are left to the caller: (compose's _Search.complete_later, the
    option indices in ``cand`` of its plan's) appended."""
    chosen = class_options(cand, idx, L, m, opts, allowed_mask=allowed_mask, required_mask=required_mask,
                           incumbent_s=incumbent_s, score_incumbent_s=score_incumbent_s, schedules=schedules,
                           searched=searched, rows=rows)
    if chosen is None:
        return None
    idx, sub, present = chosen.idx, chosen.sub, chosen.present
    edges = pick(cand.edges, idx) if len(cand.edges) == len(cand.options) else None
    weight = 1.0 / MAX_VIRTUAL_STAGES if "interleaved" in schedules else 0.0
    scorer = ClassScores(cand, idx, sub, m, caps, opts, schedules)
    best = None
    later: list | None = [] if deferred is not None else None

    def run(order: list[int] | None, merge_fronts: bool = False, quick_plan: bool = True) -> float | None:
        nonlocal best
        comp = compose(sub, cand.link_matrix, L, m, allowed_mask=chosen.allowed_mask, required_mask=required_mask,
                       max_stages=caps.max_stages, bound_step=opts.bound_step, island_order=order,
                       incumbent_s=min(incumbent_s, stats.threshold_s(best.objective_s if best else None,
                                                                      opts.score_band)),
                       stats=stats, deferred=later, score=scorer.predicted_s, score_band=opts.score_band,
                       score_floor=scorer.floor_s, score_floor_fine=scorer.fine_floor_s,
                       score_floor_cut=scorer.floor_cut_s,
                       score_incumbent_s=min(score_incumbent_s, best.objective_s if best else float("inf")),
                       score_fill_weight=weight, score_schedules=schedules, merge_fronts=merge_fronts,
                       edge_s=edges,
                       quick_plan=quick_plan, rows=chosen.rows)
        if comp is None:
            return None
        if best is None or comp.objective_s < best.objective_s:  # without the band, compose gates nothing
            best = comp
        return comp.objective_s

    if len(present) <= opts.exact_islands:
        run(None)
    elif merged_states(cand.link_matrix, present) <= MERGED_EXACT_STATES:
        # the DP over every island set and order (compose.front_classes; exact for the closed form only:
        # MERGED_EXACT_STATES), after one seed order whose plan
        # bounds it (unbounded, it costs several times the CPU); the seed's plan bounds it as the DP's quick plan
        # would, so it has none
        run(island_orders(cand.islands, present, cand.training_dtype)[0])
        run(None, merge_fronts=True, quick_plan=False)
    else:
        search_orders(run, present, cand.link_matrix, island_orders(cand.islands, present, cand.training_dtype))
    if later:
        deferred.extend((finish, idx) for finish in later)
    if best is None:
        return None
    return Composition(tuple(idx[i] for i in best.options), best.metrics, best.bound_s, best.score_s)


def hopeful_islands(sub: Sequence[Option], present: Sequence[int], required_mask: int, L: int, m: int,
                    score_incumbent_s: float) -> list[int]:
    """The islands some plan through which could still beat the best predicted iteration found elsewhere: an
    island under whose every plan the score floor (dropped.island_floor_s) is no lower is left out, until none is
    (each one left out raises the others' floors). Every plan through such an island loses to the incumbent, so
    none that could win is lost, and fewer islands can bring the search back to the exact one (<= exact_islands)."""
    keep = list(present)
    if score_incumbent_s == math.inf:
        return keep
    while True:
        idx = [i for i, o in enumerate(sub) if o.island in keep]
        floors = island_floors_s(sub, idx, [k for k in keep if not required_mask >> k & 1], L, m)
        out = [k for k in keep if required_mask >> k & 1 or floors[k] < score_incumbent_s]
        if len(out) == len(keep):
            return out
        keep = out
