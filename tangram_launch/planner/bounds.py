"""Every pruning bound of the planner, each once: a floor under the objective of every plan it rules out, and why
that floor is safe. A bound is a claim; each has a test that checks it against brute force (``reference.py``
enumerates every composition of a small instance) or against the search without it.

The slice-level floors (``costmodel/slice_bounds.py``) sit below the parallelizers, which prune with them and cannot
import the planner; they are re-exported here. The DP's per-option and per-entry floors are the rows "DP option" and
"DP entry": compose._add_options and compose._add_entries compute them inline (the DP's hot loop), from the terms
below (PrefixBounds, front_link_s, round_trips_s, cycles_s, score_floor_terms). Scalar and array forms stand side by
side: latency_floor_of / score_floor_of take floats or numpy arrays alike, beyond / beyond_array (beyond_floors:
both floors and beyond in one call, for loops over many plans; beyond_each: the same over parallel lists).

m micro-batches; a pipeline's closed form is (m - 1) x period + fill + tail (compose.py), its score the Plan's
simulated iteration (plain or interleaved 1F1B).

Each bound: its floor; where it prunes; why it is safe; the test that checks it against brute force.

slice closed form: latency_floor_of: (m - 1) x bottleneck + fill + tail
    prunes: SliceQuery.beyond_bound (query_pool.py), megatron _GridSearch (per grid: floor / pp, heaviest stage; per
            saver combination), grid.least_floors
    safe:   a pipeline's period is at least any stage's time, its fill the sum of its stages', its tail any stage's tail
    test:   test_planner_bound.py::test_a_bounded_answer_keeps_exactly_the_plans_that_can_beat_the_bound,
            ::test_bounded_search_finds_the_full_searchs_optimum_on_generated_clusters;
            tests/test_planner_bounds.py::test_a_slice_plans_floors_are_under_every_pipeline_holding_it

slice score: score_floor_of: m x bottleneck + tail
    prunes: as above (beyond: both must fail)
    safe:   the slowest stage runs m forwards and backwards in any schedule, then the tail
    test:   test_planner_bound.py::test_a_bounded_answer_reads_the_score_bound_at_each_plans_stages;
            tests/test_planner_bounds.py::test_a_slice_plans_floors_are_under_every_pipeline_holding_it

grid compute floors: slice_floors.time_floors(with_comm): compute + TP/CP/EP comm per layer kind
    prunes: megatron bound_grids, bound_one_kind_grids (a stage of ceil(layers / pp)), _heaviest_floor
    safe:   stage times only add recompute, p2p and exposed ZeRO to these
    test:   test_planner_bound.py::test_compute_floors_are_below_every_stage_time;
            test_megatron_fast_paths.py::test_a_one_kind_split_has_a_stage_of_ceil_layers_over_pp

grid memory floors: slice_floors.memory_floor_bytes, stage_need_terms / _parts
    prunes: megatron too_big_grids, _stage_misfit
    safe:   least model-state and activation bytes per layer under the savers; working sets and edges only add
    test:   test_megatron_fast_paths.py::test_memory_floors_are_under_the_heaviest_stages_least_need,
            ::test_answers_with_the_memory_floor_are_the_answers_without

size floor: size_floors.SizeFloor: closed form and score of any plan at one micro-batch size
    prunes: size_search (micro-batch sizes skipped)
    safe:   least compute per layer over every grid and island, spread over all GPUs
    test:   test_planner_bound.py::test_size_floor_is_below_the_best_plan_at_that_size

spread floor: size_floors.spread_floors_s (SizeFloor.spread_s): closed form and score of any plan at one size
    prunes: size_search (micro-batch sizes skipped, with the size floor; not their order)
    safe:   a plan running x_k layers on island k has a slowest stage >= x_k x least GPU-seconds / GPUs of k and a
            fill >= sum x_k x least seconds on k: the least over every fractional x of (m - 1) P + F and max(m P, F)
    test:   test_c3_speed_more.py::
            test_spread_floors_lie_under_every_placement_of_the_layers_and_above_the_capacity_floor,
            ::test_a_size_floor_with_the_spread_lies_under_the_best_plan_at_that_size,
            ::test_the_spread_floor_skips_sizes_without_moving_the_plan

compute chain: chain_score_floor_s: a score floor, or the layers' least forward + backward seconds if larger
    prunes: size_floors.SizeFloor.score_s, pair_floors.PairFloors.floor (sizes with few micro-batches)
    safe:   micro-batch 0 runs every layer's forward and backward in turn, plain 1F1B or every chunk of every
            stage interleaved (interleaved_schedule.interleaved_floor_s)
    test:   test_planner_bounds.py::test_one_micro_batch_chain_is_under_every_schedules_score,
            ::test_interleaving_needs_the_micro_batches_to_be_a_multiple_of_the_stages,
            ::test_the_schedule_the_plan_reports_lies_above_the_compute_chain;
            test_planner_bound.py::test_size_floor_is_below_the_best_plan_at_that_size

pair floors: pair_floors.PairFloors.floor / beyond
    prunes: size_search (queries skipped)
    safe:   the pair's GPU-seconds on its island, the rest's on the others' capacity; links at its ends
    test:   test_planner_pair_floors.py::test_pair_floors_are_under_every_pipeline_holding_the_pair,
            ::test_skipping_pairs_finds_the_full_searchs_optimum_and_drops_the_same_islands

bottleneck floors: megatron bottleneck_floors (slice_floors.layers_held, least_bottlenecks_s); spread over islands:
                   pair_floors.spread_bottlenecks_s, spread_behind_s
    prunes: size_search (sizes skipped: SizeFloor's period; queries skipped: PairFloors.floor's own period and the
            rest's period)
    safe:   stage i + 1 from a slice's end holds min(i + 1 + D, m) micro-batches in flight (D stages behind the
            slice), so a grid holds x layers only under the recompute modes whose stages have room for them, and
            its slowest stage runs ceil(x / stages) of them at least, each for its least seconds plus that mode's
            recompute; D >= 1 for a slice that does not end at L. A placement of n layers whose slowest stage is P
            puts at most X_o(P) layers on island o (the most with a floor <= P), so the n-th least floor of all
            islands' suffix minima is under P; every island but the one holding layer L has a stage behind it
    test:   test_bottleneck_floors.py::test_bottleneck_floors_lie_under_every_slice_plan_that_fits,
            ::test_spread_bottlenecks_lie_under_every_placement_and_meet_it_where_tables_rise,
            ::test_spread_with_a_stage_behind_every_island_but_the_last_lies_under_every_placement,
            ::test_pair_floors_with_bottleneck_floors_are_under_every_pipeline_holding_the_pair,
            ::test_a_size_floor_with_bottleneck_floors_lies_under_the_best_plan_at_that_size

pipeline reach: pair_floors.PipelineReach.usable / prune / kill
    prunes: size_search (classes asked at no size; per size, pairs whose every way to layer 0 or L passes a class
            whose answer holds no plan: slices at layer 0 asked first, then those at L, then the rest)
    safe:   a pipeline covers [0, L) with pairs on distinct islands, each once; an answer without a plan kept every
            plan of its class that could beat bounds no tighter than the search's now (they only tighten)
    test:   test_planner_pipeline_reach.py::test_every_class_in_a_pipeline_of_live_pairs_stays_usable,
            ::test_with_two_islands_a_middle_slice_is_in_no_pipeline_and_a_dead_complement_rules_out_its_pair

class floors: classes.class_floors_s: (m - 1) x P* + F + least tail
    prunes: size_composition (classes composed most promising first, skipped)
    safe:   distinct islands' slices must add up to L layers
    test:   test_planner_classes.py::test_class_floor_is_under_every_composition_the_class_admits,
            ::test_class_score_floor_is_under_every_compositions_predicted_floor

cover floors: cover_floors.island_floors_s, promising
    prunes: class_composition / dropped.py (islands and options left out)
    safe:   covers of the layers in front and behind, ignoring islands, links, memory
    test:   test_planner_dropped.py::test_island_floor_is_under_every_plan_using_the_island,
            ::test_options_left_out_as_unpromising_change_no_composition

option-set floor: lower_bound: (m - 1) x least cover period + least cover fill
    prunes: not called by the search (classes.class_floors_s ranks and skips classes)
    safe:   any plan is a cover of [0, L)
    test:   tests/test_planner_bounds.py::test_lower_bound_is_under_every_composition

compose early out: (m - 1) x period_lb + max(period_lb, fill_lb); m x stage_lb
    prunes: compose (no DP run)
    safe:   the same covers over every island; fill >= period
    test:   test_planner_compose.py::test_incumbent_prunes_without_changing_the_optimum

DP prefix covers: PrefixBounds(mask), front_link_s
    prunes: DP option and entry floors (in front of an option)
    safe:   the layers in front are covered by the free islands, once each, across a link
    test:   test_planner_compose.py::test_covers_per_island_set_are_the_least_over_every_cover,
            ::test_prefix_bounds_with_links_lie_under_every_front_cover_by_distinct_islands

DP fitting fronts: FitPrefixBounds(n)(mask): PrefixBounds over the options that fit with n stages after them
    prunes: compose._add_options (an offer's floors read the fronts that fit in front of its fewest stages behind;
            _fit_end drops the entries with so many stages behind that m x the slowest stage of any front that fits
            + the tail cannot beat the best score), where only the score floor judges
    safe:   an option in front of n stages has n or more after it, and the DP keeps only sequences that fit
    test:   test_planner_compose.py::test_fit_prefix_bounds_lie_under_every_front_that_fits_in_front_of_n_stages,
            ::test_a_plain_score_finds_the_least_score_of_every_composition,
            ::test_a_deferred_complete_pass_finds_the_least_score_under_a_later_bound

DP option: (m - 1) x max(period_lb, pre_period, own, link) + pre_fill + own + least fill behind + max tail
    prunes: compose._by_floor (group cut), _add_options
    safe:   the entries it fits in front of have at least the least fill and tail of the front's prefix
    test:   test_planner_compose.py::test_dp_matches_brute_force_on_random_instances,
            ::test_incumbent_prunes_without_changing_the_optimum

DP entry: the same with the entry's own fill, tail and period (its bucket's least with a quantum)
    prunes: compose._add_entries
    safe:   a completion adds only what the prefix covers floor
    test:   test_planner_compose.py::test_dp_matches_brute_force_on_random_instances,
            ::test_bound_step_is_never_better_than_exact_and_close

DP score floors: score_floor_terms: max(m x stage, fill, m x stage + w x fill in front) + tail
    prunes: _add_options / _option_score_floor, _add_entries
    safe:   every rank runs m micro-batches; micro-batch 0 passes every stage and link both ways; interleaved with
            at most 1/w chunks per stage, a stage waits for 1/v of the stages in front (interleaved_floor_s).
            Not m x period: a period may be a link, and the simulations take a link as latency
    test:   test_planner_compose.py::test_the_chosen_plan_has_the_least_score_of_every_candidate,
            ::test_an_interleaved_only_score_with_its_fill_weight_finds_the_least_score,
            ::test_each_option_caps_the_chunks_of_any_pipeline_holding_it

plain 1F1B floor: plain_1f1b_floor_s; round_trips_s, cycles_s per boundary
    prunes: _option_score_floor, _add_entries (schedules "plain")
    safe:   each stage's m micro-batches after the fill in front; the round trips the simulation waits for
    test:   test_planner_compose.py::test_the_plain_1f1b_floor_is_under_the_simulation_and_prunes_nothing_that_wins,
            ::test_round_trips_floor_lies_under_the_plain_simulation_but_m_links_need_not,
            ::test_cycles_across_a_boundary_lie_under_the_plain_simulation,
            ::test_stage_times_at_the_edges_tighten_the_plain_floor_and_choose_the_same

plain 1F1B paths: costmodel.plain_1f1b_paths.path_floor_1f1b_s; plain_complete.behind_path_s, own_stages_s,
                  floor_stage_times
    prunes: class_composition.ClassScores.floor_s / fine_floor_s; compose's passes where a plain score counts
            (_add_entries, _option_score_floor: the stages behind an option and its own other stages, micro-batch
            0's way to a boundary), the exact ones as the complete one
    safe:   four paths through each stage of the schedule (all its ops; after micro-batch 0's way behind it; before
            micro-batch m - 1's; both), each a chain of the ops' dependencies; island-matrix p2p lies under the
            exact boundaries', and a path grows with every time
    test:   test_planner_compose.py::test_the_path_floor_lies_under_the_plain_simulation,
            ::test_a_plain_score_finds_the_least_score_of_every_composition,
            ::test_the_default_search_finds_the_best_single_size_plan_on_a_plain_schedule,
            ::test_the_dp_path_floor_of_an_option_lies_under_the_plain_simulation

The DP's floors in full (compose._add_options, _option_score_floor, _add_entries). A sequence covering [j, L) is
dropped as soon as even its cheapest completion cannot beat the closed form to beat:
  (m - 1) x max(its period, pre_period[start]) + its fill + pre_fill[start] + max(its tail, pre_tail[start])
where the pre_* are the least of any cover of [0, start) by distinct islands free in front of it (PrefixBounds).
With a score to beat a sequence is kept too while the largest of m x the least slowest stage of any cover
(PrefixCovers.stage_period_s), its fill (micro-batch 0's way through every stage and link and back) and m x the
option's slowest stage + w x the fill in front of it, + its tail, can beat it: that floor lies under any score
(compose's score_floor; w = 0), and a score can rank a plan well below its closed form (the interleaved schedule
shrinks the bubble). A fill weight w > 0 holds for scores that only interleaved schedules with at most 1/w chunks
per stage can reach (a stage waits for 1/v of each stage in front and each link both ways: interleaved_floor_s),
where an option of n layers in s stages weighs more: a chunk holds a layer at least, so a pipeline holding it
interleaves in at most n // s chunks (its least stage has no more layers), and not at all below 2, where the plain
floor alone holds. Not m x the period: the period may be a link, which the simulations take as latency. Where the score is the plain 1F1B simulation
(schedules hold "plain"), its floor is instead the largest of pre_fill[start] + plain_s (a stage runs its m forwards
and backwards after the first micro-batch's forward reached it and before the last one's backward left the stages in
front: plain_1f1b_floor_s), m x the least slowest stage of any cover (PrefixCovers.stage_period_s, without links: the
simulation takes a link as latency, so m x a link is not under it) and the round trips across the boundary an
option adds and the one in front of it (round_trips_s), + tail; with both schedules the lesser of that and the
interleaved floor. With edge times (per option: its first and its last stage's forward + backward seconds) each such
boundary's round trips count the stage times they pass too (cycles_s): per two micro-batches the two stages beside
it and the link both ways, so a slow link between islands costs a plain 1F1B pipeline what it costs in the
simulation. With such a known score and a score to beat, the score floor alone prunes (the closed form is only a
proxy). Exact: a sequence that beats the bound is represented at every step by an entry with no more of anything,
whose completion with the same front part beats it too.
"""
from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

import numpy as np

from tangram_launch.costmodel.interleaved_schedule import FLOOR_ROUNDING
from tangram_launch.costmodel.slice_bounds import (BOUND_SLACK, beyond, beyond_array, beyond_each, beyond_floors,
                                                   latency_floor_of, score_floor_of, slack_cut)

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.planner.compose import Option

__all__ = ["BOUND_SLACK", "Covers", "PrefixBounds", "PrefixCovers", "beyond", "beyond_array", "beyond_each",
           "beyond_floors",
           "chain_score_floor_s", "covers", "covers_of", "interleaved_1f1b_floor_s",
           "cycles_s", "front_link_s", "latency_floor_of", "least_links", "lower_bound", "pair_minima",
           "plain_1f1b_floor_s", "round_trips_s", "row_minima", "score_floor_of", "score_floor_terms", "slack_cut"]


def plain_1f1b_floor_s(seq: Sequence[int], options: Sequence[Option], link_s: Sequence[Sequence[float]],
                       num_microbatches: int, tail_s: float) -> float:
    """A floor under the plain 1F1B simulation of a sequence (costmodel.pipeline.simulated_1f1b_s + tail):
    each option's slowest stage runs m forwards and backwards, after micro-batch 0's forward got through the
    stages in front of it and before the last backward went back through them, so the iteration is at least
    max over options o of (m x o's bottleneck + the times and both-way links of the options in front) + tail."""
    best = front = 0.0
    for k, oi in enumerate(seq):
        o = options[oi]
        best = max(best, front + num_microbatches * o.bottleneck_s)
        if k + 1 < len(seq):
            front += o.time_s + 2.0 * link_s[o.island][options[seq[k + 1]].island]
    return best + tail_s


def interleaved_1f1b_floor_s(seq: Sequence[int], options: Sequence[Option], link_s: Sequence[Sequence[float]],
                             num_microbatches: int, fill_s: float, tail_s: float, most_chunks: int) -> float:
    """A floor under the interleaved 1F1B simulation of a sequence with at most ``most_chunks`` chunks per stage
    (and at most n // s for an option of n layers in s stages: a chunk holds a layer) + tail, from the options'
    numbers: interleaved_schedule.interleaved_floor_s, each option's slowest stage running its m micro-batches after
    1/v of the times and links in front of it, and micro-batch 0's way: ``fill_s`` (the stages, each link twice),
    each link twice more (v >= 2 chunks cross it each way)."""
    best, front, links = 0.0, 0.0, 0.0
    for k, oi in enumerate(seq):
        o = options[oi]
        q = (o.stop - o.start) // o.num_stages
        v = q if 2 <= q < most_chunks else most_chunks
        best = max(best, num_microbatches * o.bottleneck_s + front / v)
        if k + 1 < len(seq):
            link = link_s[o.island][options[seq[k + 1]].island]
            front += o.time_s + 2.0 * link
            links += link
    way = fill_s + 2.0 * links
    return ((way if way > best else best) + tail_s) * (1.0 - FLOOR_ROUNDING)


def chain_score_floor_s(score_floor_s: float, compute_fill_s: float) -> float:
    """A score floor raised to the floor under the sum of a pipeline's stages' forward + backward seconds (links
    left out), which lies under any pipeline's predicted iteration: plain 1F1B runs micro-batch 0's forwards and
    backwards through every stage one after another, and interleaved 1F1B every chunk of every stage (the second
    term of interleaved_schedule.interleaved_floor_s). With many micro-batches m x the period dominates and this
    adds nothing; with few, the compute of one micro-batch's way is the larger."""
    return score_floor_s if score_floor_s > compute_fill_s else compute_fill_s


def round_trips_s(link_s: float, behind: int, num_microbatches: int) -> float:
    """A floor under the plain 1F1B simulation from one stage boundary with ``behind`` stages after it and a link
    of ``link_s`` seconds one way: costmodel.pipeline.cycle_floor_1f1b_s's round trips, c = (m - behind) // 2 of
    them and one more, each at least the link there and back (the stage times dropped). Not m x the link: the
    simulation takes a link as latency, and with many stages behind it the schedule's warm-up hides some trips."""
    if link_s <= 0.0 or behind > num_microbatches:
        return 0.0
    return ((num_microbatches - behind) // 2 + 1) * 2.0 * link_s


def cycles_s(link_s: float, behind: int, num_microbatches: int, front_s: float, back_s: float) -> float:
    """round_trips_s with the stage times the round trips pass: costmodel.pipeline.cycle_floor_1f1b_s's path
    across one boundary, c = (m - behind) // 2 cycles of the link both ways, the stage behind it (forward and
    backward, ``back_s``) and the stage in front of it (``front_s``), then one more trip, without the forwards
    and backwards it drops (micro-batch 0's way there, the warm-up, the way back): each is >= 0. The DP reads it
    as tables over n (its c1 and c0)."""
    if behind > num_microbatches:
        return 0.0
    c = (num_microbatches - behind) // 2
    return round_trips_s(link_s, behind, num_microbatches) + (c + 1) * back_s + c * front_s


def least_links(link_s: Sequence[Sequence[float]], present: Iterable[int],
                default: float = math.inf) -> tuple[dict[int, float], dict[int, float]]:
    """Per island of ``present``: the least link into it from another island of ``present``, and the least out of
    it (``default`` where there is no other). A slice that does not start at layer 0 crosses at least the first in
    any pipeline, one that does not end at L at least the second."""
    present = list(present)
    into = {k: min((link_s[x][k] for x in present if x != k), default=default) for k in present}
    out_of = {k: min((link_s[k][x] for x in present if x != k), default=default) for k in present}
    return into, out_of


def front_link_s(link_s: Sequence[Sequence[float]], mask: int, island: int, cache: dict) -> float:
    """The least link into ``island`` from an island of ``mask``: an option that does not start at layer 0 has the
    last island of its front's cover in front of it, so its pipeline's slowest stage is at least that link and its
    fill at least twice that (inf: no island in the mask)."""
    key = ("link", mask, island)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = min((link_s[x][island] for x in range(len(link_s)) if mask >> x & 1 and x != island),
                               default=math.inf)
    return hit


def score_floor_terms(schedules: tuple[str, ...], fill_weight: float) -> tuple[bool, bool, float]:
    """How the DP's score floor reads compose's ``score_schedules`` and ``score_fill_weight``: (plain, only_plain,
    w). plain: the plain 1F1B floor counts (plain_s); only_plain: nothing else does; w: the weight of the fill in
    front of a stage in the floor under every score, max(m x slowest stage, fill, m x a stage + w x the fill in
    front of it) + tail (interleaved_schedule.interleaved_floor_s with at most 1 / w chunks; 0: under every
    score). With "any", or both schedules and no weight, w = 0 is all (it lies under the plain floor too)."""
    plain = "plain" in schedules
    if "any" in schedules or (plain and "interleaved" in schedules and fill_weight == 0.0):
        return False, False, 0.0
    return plain, plain and "interleaved" not in schedules, fill_weight


class Covers(NamedTuple):
    """Per layer boundary j: the least fill, period and tail of any cover of [0, j) (front) or [j, L) (back)."""

    fill_s: list[float]
    period_s: list[float]
    tail_s: list[float]


def covers(options: Sequence[Option], idx: Sequence[int], num_layers: int, *, back: bool) -> Covers:
    """Least fill, period and tail of any cover by ``options[idx]`` of [0, j) (back=False) or [j, L) (back=True),
    each minimised on its own; inf where there is no cover."""
    return covers_of(pair_minima(options, idx), num_layers, back=back)


def pair_minima(options: Sequence[Option], idx: Sequence[int]) -> dict[tuple[int, int], list[float]]:
    """Per layers (start, stop): the least time, bottleneck and tail of ``options[idx]`` there, each on its own.
    That is all a least cover reads of them, so covers over several sets of options (front and back, or many sets
    of islands) pass over the options once: a few thousand pairs stand for up to hundreds of thousands of options."""
    out: dict[tuple[int, int], list[float]] = {}
    for oi in idx:
        start, stop, _island, _stages, _after, time_s, bottleneck_s, tail_s = options[oi]
        cur = out.get((start, stop))
        if cur is None:
            out[start, stop] = [time_s, bottleneck_s, tail_s]
            continue
        if time_s < cur[0]:
            cur[0] = time_s
        if bottleneck_s < cur[1]:
            cur[1] = bottleneck_s
        if tail_s < cur[2]:
            cur[2] = tail_s
    return out


def row_minima(rows: np.ndarray, num_layers: int, *, islands: bool = False) -> tuple[np.ndarray, ...]:
    """pair_minima of options given as rows of Option's 8 fields (Candidates.option_rows): per (start, stop), in
    their order, the starts, the stops and the least (time, bottleneck, tail) as an (n, 3) array (minima are
    exact in any order). ``islands``: per (island, start, stop) instead, in that order, and the islands fourth
    (every island's pairs in one sort)."""
    n1 = num_layers + 1
    s_at, t_at = rows[:, 0].astype(np.intp), rows[:, 1].astype(np.intp)
    key = s_at * n1 + t_at
    if islands:
        key += rows[:, 2].astype(np.intp) * (n1 * n1)
    order = np.argsort(key, kind="stable")
    k = key[order]
    first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, dtype=np.intp)
    least = (np.minimum.reduceat(rows[order][:, 5:8], first, axis=0) if len(k)
             else np.zeros((0, 3), dtype=np.float64))
    out = (s_at[order][first], t_at[order][first], least)
    return out + (k[first] // (n1 * n1),) if islands else out


def covers_of(minima: dict[tuple[int, int], list[float]], num_layers: int, *, back: bool) -> Covers:
    """covers from pair_minima."""
    fill = [float("inf")] * (num_layers + 1)
    period = [float("inf")] * (num_layers + 1)
    tail = [float("inf")] * (num_layers + 1)
    edge = num_layers if back else 0
    fill[edge] = period[edge] = tail[edge] = 0.0
    by_end: dict[int, list[tuple]] = {}
    for (start, stop), (time_s, bottleneck_s, tail_s) in minima.items():
        if back:
            by_end.setdefault(start, []).append((stop, time_s, bottleneck_s, tail_s))
        else:
            by_end.setdefault(stop, []).append((start, time_s, bottleneck_s, tail_s))
    for j in (range(num_layers - 1, -1, -1) if back else range(1, num_layers + 1)):
        best_f = best_p = best_t = float("inf")
        for rest, time_s, bottleneck_s, tail_s in by_end.get(j, ()):
            v = fill[rest] + time_s
            if v < best_f:
                best_f = v
            v = period[rest] if period[rest] > bottleneck_s else bottleneck_s
            if v < best_p:
                best_p = v
            v = tail[rest] if tail[rest] > tail_s else tail_s
            if v < best_t:
                best_t = v
        fill[j], period[j], tail[j] = best_f, best_p, best_t
    return Covers(fill, period, tail)


class PrefixCovers(NamedTuple):
    """PrefixBounds' covers of [0, j): least fill and period with the links crossed (the closed form's), least
    tail, and the least slowest stage without links (what the plain 1F1B simulation's m x slowest stage reads:
    it takes a link as latency, not as a stage)."""

    fill_s: list[float]
    period_s: list[float]
    tail_s: list[float]
    stage_period_s: list[float]


class PrefixBounds:
    """Per set of islands (a bit mask), computed on first use: the least fill, period and tail of any cover of
    [0, j) by DISTINCT islands of the set (each island holds one contiguous slice, as in a pipeline), each
    minimised on its own. The layers in front of an option can be covered only by the islands the sequence behind
    it leaves free, once each: when the fast islands are already behind, or when one fast island would have to
    hold the whole front, that cover is much slower than the least over all islands.

        G[S][j] = min over islands k in S and options o of k with o.stop = j of G[S - k][o.start] (+) o
        G[S][0] = 0

    where (+) adds times and takes the larger bottleneck and tail: the last slice of the cover is some island's,
    the rest covers [0, o.start) with the other islands. Where o.start > 0 a link from one of S - k into k lies
    between them, so (+) also takes the larger of the period and the least such link, and adds twice that link to
    the fill (as the DP does per boundary). Each island's options are reduced to their pair_minima once, so a set
    costs its islands' (start, stop) pairs."""

    def __init__(self, options: Sequence[Option], idx: Sequence[int], num_layers: int,
                 link_s: Sequence[Sequence[float]] | None = None, rows: np.ndarray | None = None):
        """``rows``: the options as Candidates.option_rows (rows[i] is options[i]), where the caller has them: each
        island's pair minima are then taken over its rows at once (row_minima)."""
        self._num_layers = num_layers
        self._link_s = link_s
        self._links: dict = {}  # front_link_s' cache
        # island -> (start, stop, least time, least bottleneck, least tail) of its (start, stop) pairs, as arrays,
        # and where start > 0
        self._pairs: dict[int, tuple] = {}
        if rows is not None:
            starts, stops, least, island = row_minima(rows[np.asarray(idx, dtype=np.intp)], num_layers, islands=True)
            cut = np.flatnonzero(np.r_[True, island[1:] != island[:-1]]).tolist() + [len(island)] if len(island) \
                else []
            for a, b in zip(cut, cut[1:]):  # each island's pairs, islands ascending
                s = starts[a:b]
                self._pairs[int(island[a])] = (s, stops[a:b], least[a:b, 0].copy(), least[a:b, 1].copy(),
                                               least[a:b, 2].copy(), s > 0)
        else:
            by_island: dict[int, list[int]] = {}
            for oi in idx:
                by_island.setdefault(options[oi].island, []).append(oi)
            for k, lst in sorted(by_island.items()):
                minima = [(a, b, *v) for (a, b), v in pair_minima(options, lst).items()]
                starts, stops = (np.array([r[i] for r in minima], dtype=np.intp) for i in (0, 1))
                times, bottlenecks, tails = (np.array([r[i] for r in minima], dtype=np.float64) for i in (2, 3, 4))
                self._pairs[k] = (starts, stops, times, bottlenecks, tails, starts > 0)
        self.islands = sum(1 << k for k in self._pairs)  # the islands with options, as a mask
        none = np.full(num_layers + 1, np.inf)
        none[0] = 0.0
        self._arrays: dict[int, tuple] = {0: (none,) * 4}  # mask -> the covers as arrays (fill, period, tail, stage)
        self._cache: dict[int, PrefixCovers] = {0: PrefixCovers(*(none.tolist() for _ in range(4)))}

    def __call__(self, mask: int) -> "PrefixCovers":
        mask &= self.islands
        hit = self._cache.get(mask)
        if hit is not None:
            return hit
        self._covers(mask)
        return self._cache[mask]

    def _covers(self, mask: int) -> tuple:
        """The covers by ``mask`` as arrays (and, in the cache, as the lists the DP reads): per island k of the
        set, its pairs (+) the covers by the rest, the least per stop (the same float operations, element by
        element, as a loop over the pairs, and min is exact in any order)."""
        hit = self._arrays.get(mask)
        if hit is not None:
            return hit
        fill, period, tail, stage = (a.copy() for a in self._arrays[0])
        for k, (starts, stops, times, bottlenecks, tails, later) in self._pairs.items():
            if not mask >> k & 1:
                continue
            rest = mask & ~(1 << k)
            sf, sp, st, ss = self._covers(rest)
            # (inf with no island left in front: then sf[start] is inf for every start > 0 too)
            lk = 0.0 if self._link_s is None else front_link_s(self._link_s, rest, k, self._links)
            v = sf[starts] + times
            if lk != 0.0:  # (+ 0.0 elsewhere, which changes no sum)
                v[later] += 2.0 * lk
            np.minimum.at(fill, stops, v)
            sps = sp[starts]
            v = np.where(sps > bottlenecks, sps, bottlenecks)
            if lk > 0.0:  # (the periods are >= 0: a link of 0 raises none)
                np.putmask(v, later & (lk > v), lk)
            np.minimum.at(period, stops, v)
            sss = ss[starts]
            np.minimum.at(stage, stops, np.where(sss > bottlenecks, sss, bottlenecks))
            sts = st[starts]
            np.minimum.at(tail, stops, np.where(sts > tails, sts, tails))
        hit = self._arrays[mask] = (fill, period, tail, stage)
        self._cache[mask] = PrefixCovers(fill.tolist(), period.tolist(), tail.tolist(), stage.tolist())
        return hit


class FitPrefixBounds:
    """PrefixBounds per least number of stages behind the front: ``self(n)`` covers [0, j) only by the options that
    fit with n stages or more after them (max_after >= min(n, saturated), compose.Option), computed on first use.
    Every option in front of a sequence of n stages has at least those n after it, and the DP keeps only
    sequences whose every option fits, so a front in front of n stages is such a cover. Where memory binds (a large
    model's first stages hold the most micro-batches in flight) the options that fit there are slower, fewer or
    have a larger tail, and the covers by every option lie far below what any front can reach. Above 4 stages, n
    is taken down to 2^k or 1.5 x 2^k (a few dozen sets at most, each costing its islands' pairs), and the sets of
    options change only at their max_after values: the n between two share one PrefixBounds."""

    def __init__(self, options: Sequence[Option], idx: Sequence[int], num_layers: int,
                 link_s: Sequence[Sequence[float]] | None, saturated: int, rows: np.ndarray | None = None,
                 whole: PrefixBounds | None = None):
        """``idx``: the options that fit somewhere (max_after >= 0); ``rows``: as PrefixBounds' (made here from the
        options where None); ``whole``: the PrefixBounds of every option of ``idx``, where the caller has it."""
        self._options, self._num_layers, self._link_s, self._saturated = options, num_layers, link_s, saturated
        self._rows = rows if rows is not None else np.array([tuple(o) for o in options], dtype=np.float64).reshape(
            -1, 8)
        self._idx = np.asarray(idx, dtype=np.intp)
        self._after = np.minimum(self._rows[self._idx, 4], saturated) if len(self._idx) else np.zeros(0)
        self._values = sorted(set(self._after.tolist()))  # the thresholds at which the set of options changes
        self._by_value: dict = {self._values[0]: whole} if whole is not None and self._values else {}
        self._by_n: dict = {}

    def __call__(self, n: int) -> PrefixBounds:
        hit = self._by_n.get(n)
        if hit is None:
            k = min(n, self._saturated)
            if k > 4:  # two sets an octave (fewer stages behind: fewer options left out, covers no higher)
                top = 1 << (k.bit_length() - 1)
                k = top + (top >> 1) if k >= top + (top >> 1) else top
            at = bisect.bisect_left(self._values, k)
            v = self._values[at] if at < len(self._values) else math.inf  # the least max_after that fits
            hit = self._by_value.get(v)
            if hit is None:
                sub = self._idx[self._after >= v].tolist()
                hit = self._by_value[v] = PrefixBounds(self._options, sub, self._num_layers, self._link_s,
                                                       self._rows)
            self._by_n[n] = hit
        return hit


def lower_bound(options: Sequence[Option], num_layers: int, num_microbatches: int,
                allowed_mask: int | None = None) -> float:
    """A cheap lower bound on the latency of any plan from these options: (m - 1) x the least period of any cover
    + the least fill of any cover (both ignoring islands and memory). Lets a driver try the most promising option
    sets first and skip those that cannot beat a plan already found."""
    idx = [i for i, o in enumerate(options)
           if (allowed_mask is None or allowed_mask >> o.island & 1) and o.max_after >= 0
           and 0 <= o.start < o.stop <= num_layers]
    if not idx:
        return float("inf")
    whole = covers(options, idx, num_layers, back=False)
    return (num_microbatches - 1) * whole.period_s[num_layers] + whole.fill_s[num_layers]
