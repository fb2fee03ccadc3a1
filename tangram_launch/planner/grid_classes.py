"""Which of a query's slice plans the composer can use, judged from their ``SliceNumbers`` alone.

A parallelizer's answer is a Pareto front over what any consumer of a slice plan may care about (GPUs used among
them); the composer keeps plans the runtime can run in a pipeline, whose stages fit the island's nodes and that fit
in memory at some pipeline position. None stands for another here: what the composer sees of a plan (stages, room,
time, bottleneck, tail) does not order the plain 1F1B simulation plans are scored by (megatron.exact_front says what
does, and its answer is that front already). Nothing here reads a StageCost, so
a parallelizer may answer with lazy plans (costmodel.slice_plan.LazySlicePlan) whose stages are built only for
the few plans a composition places.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Hashable, NamedTuple, Sequence

import numpy as np

from tangram_launch.costmodel.grid import SATURATED, fit_depth
from tangram_launch.costmodel.slice_plan import SliceNumbers, numbers_fit
from tangram_launch.planner.allocation import fits_island, node_sizes

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.islands import Island
    from tangram_launch.specs.shape import StageShape


class Template(NamedTuple):
    """A usable slice plan as the composer sees it; ``index`` is its place in the list judged."""

    index: int
    num_stages: int
    max_after: int  # following global stages it still fits with (grid.SATURATED: any)
    time_s: float  # sum of stage times
    bottleneck_s: float
    tail_s: float  # max DP sync + optimizer step
    group: Hashable  # cross-stage compatibility class


class GridClass(NamedTuple):
    """The class of a slice plan under a runtime that runs stages with their own grids but interleaves only one grid
    (torch): ``base`` is its compatibility class, ``grid`` its (tp, dp, cp) where all its stages share one, else
    None. The driver composes each base class whole and, apart, each one-grid class (whose pipelines may
    interleave: a plan a mixed-grid option beats under 1F1B can win with virtual stages)."""

    base: Hashable
    grid: tuple[int, int, int] | None


def class_members(groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The option indices of each class a driver composes (``groups[i]`` is option i's class): each compatibility
    class; with GridClass, each base class whole and each one-grid class apart."""
    by_group: dict[Hashable, list[int]] = {}  # a few distinct classes among up to hundreds of thousands of options
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    parts: dict[Hashable, list[list[int]]] = {}
    for g, idx in by_group.items():
        for key in composed_in(g):
            parts.setdefault(key, []).append(idx)
    return {g: idx[0] if len(idx) == 1 else sorted(itertools.chain.from_iterable(idx)) for g, idx in parts.items()}


def composed_in(group: Hashable) -> tuple[Hashable, ...]:
    """The classes the driver composes an option of class ``group`` in, in class_members' order: the class itself;
    for a GridClass, the free class, then its one-grid class where it names a grid."""
    if not isinstance(group, GridClass):
        return (group,)
    free = GridClass(group.base, None)
    return (free, group) if group.grid is not None else (free,)


def class_members_of_parts(parts: Sequence[Sequence[tuple]]) -> dict[Hashable, list[int]]:
    """class_members of the options that ``parts`` make in their order (make_candidates: a pair's options are its
    answer's templates, (fields, plan, class, edges) each), the same dict in the same order, from each distinct
    list's classes read once (a large cluster's options come from far fewer distinct lists): an option is in
    its class (a GridClass: the free class) and, for a one-grid GridClass, its grid's."""
    keys: dict[Hashable, int] = {}  # a class the driver composes -> its code
    codes: dict[Hashable, tuple[int, int]] = {}  # an option's class -> (first key's code, second's), -1: none
    lists: dict[int, tuple] = {}  # id(templates) -> (first codes, second codes) of its options
    firsts, seconds = [], []
    for temps in parts:  # (all alive: an id names one list)
        hit = lists.get(id(temps))
        if hit is None:
            pairs = []
            for t in temps:
                c = codes.get(t[2])
                if c is None:  # the classes' codes as their first options come: class_members' order
                    c = codes[t[2]] = (*(keys.setdefault(k, len(keys)) for k in composed_in(t[2])), -1, -1)[:2]
                pairs.append(c)
            arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
            hit = lists[id(temps)] = (arr[:, 0], arr[:, 1])
        firsts.append(hit[0])
        seconds.append(hit[1])
    if not keys:
        return {}
    members: list[list] = [[] for _ in keys]
    for code in (np.concatenate(firsts), np.concatenate(seconds)):
        order = np.argsort(code, kind="stable")  # each code's options in increasing order
        bounds = np.searchsorted(code[order], np.arange(-1, len(keys) + 1))
        for k in range(len(keys)):
            if bounds[k + 2] > bounds[k + 1]:
                members[k].append(order[bounds[k + 1]:bounds[k + 2]])
    out: dict[Hashable, list[int]] = {}
    for name, m in zip(keys, members):
        out[name] = (m[0] if len(m) == 1 else np.sort(np.concatenate(m))).tolist()
    return out


def compatibility_group(shapes: Sequence["StageShape"], caps: "RuntimeCapabilities") -> Hashable | None:
    """The class of slice plans that may share one pipeline under ``caps``; None if the plan itself mixes grids.

    uniform_grid: one (tp, dp, cp) for all stages; uniform_tp: one tp; uniform_dp: one dp*cp; uniform_ep: one ep;
    uniform_zero: one ZeRO stage. A free runtime puts everything in one class.
    """
    def key(s: "StageShape") -> tuple:
        grid = (s.tp, s.dp, s.cp) if caps.uniform_grid else (s.tp if caps.uniform_tp else None,
                                                             s.dp * s.cp if caps.uniform_dp else None)
        if caps.uniform_ep or caps.uniform_zero:  # the runtime's one EP size or one optimizer for the whole job
            grid += (s.ep if caps.uniform_ep else None, s.zero_stage if caps.uniform_zero else None)
        return grid

    keys = {key(s) for s in shapes}
    return next(iter(keys)) if len(keys) == 1 else None


def max_stages_after(numbers: SliceNumbers, num_microbatches: int, capacity: float) -> int:
    """SlicePlan.max_stages_after from grid.fit_depth's closed form, checked against ``numbers_fit`` at the answer
    and one past it (so float rounding cannot move it): O(stages) instead of a bisection."""
    m = num_microbatches
    hint = numbers.depth_hint
    if hint is not None and hint[0] == m and hint[1] == capacity:
        depth = hint[2]  # the answer's own fit_depth of these stages (judge_columns)
    else:
        depth, _peak = fit_depth(list(zip(numbers.static_bytes, numbers.activation_bytes)), m, capacity)
    if depth == SATURATED:
        return depth
    if depth < 0:
        if not numbers_fit(numbers, 0, m, capacity):
            return -1
        depth = 0
    depth = min(depth, m - 1)
    while depth > 0 and not numbers_fit(numbers, depth, m, capacity):
        depth -= 1
    while depth + 1 < m and numbers_fit(numbers, depth + 1, m, capacity):
        depth += 1
    return depth


def unusable(numbers: SliceNumbers, b: int, caps: "RuntimeCapabilities", full_model: bool) -> str | None:
    """Why the runtime cannot run this slice plan in a pipeline (a full-model single stage may skip pipelining)."""
    pipelined = not (full_model and len(numbers.shapes) == 1)
    for shape, mbs in zip(numbers.shapes, numbers.micro_batch_sizes):
        if mbs * shape.dp != b:
            return "micro_batch_size * dp differs from the micro-batch"
        if caps.stage_problems(shape, pipelined=pipelined):
            return "runtime cannot run a stage"
    if caps.max_stages is not None and len(numbers.shapes) > caps.max_stages:
        return "more stages than the runtime runs"
    return None


def judge_templates(plans: Sequence[SliceNumbers], *, island: "Island", b: int, num_microbatches: int,
                    capacity: float, caps: "RuntimeCapabilities", full_model: bool,
                    dropped: dict[str, int], shape_cache: dict | None = None) -> list[Template]:
    """The composer's templates among ``plans`` (one query's answer), in the order the composer offers them
    (bottleneck, time, tail); counts why the others were left out into ``dropped``. ``shape_cache``: a dict the
    caller keeps across queries with the same island, b, runtime and ``full_model`` (what the judgement of stage
    shapes depends on)."""
    cache = {} if shape_cache is None else shape_cache
    sizes = cache.get("node_sizes")
    if sizes is None:
        sizes = cache["node_sizes"] = node_sizes(island)
    placeable: dict[tuple, bool] = cache.setdefault("placeable", {})  # (tp, dp * cp) per stage -> fits_island
    # (shapes, micro-batch sizes) -> (why unusable, group): plans of one configuration share these tuples across
    # queries (LazySlicePlan), so they are looked up by identity first (the entry keeps them alive), by value next
    by_id: dict[tuple[int, int], tuple] = cache.setdefault("by_id", {})
    by_value: dict[tuple, tuple[str | None, Hashable]] = cache.setdefault("by_value", {})
    temps: list[Template] = []
    for i, nb in enumerate(plans):
        hit = by_id.get((id(nb.shapes), id(nb.micro_batch_sizes)))
        if hit is None or hit[0] is not nb.shapes or hit[1] is not nb.micro_batch_sizes:
            ukey = (nb.shapes, nb.micro_batch_sizes)
            judged = by_value.get(ukey)
            if judged is None:
                judged = by_value[ukey] = _judge_shapes(nb, island, sizes, b, caps, full_model, placeable)
            by_id[id(nb.shapes), id(nb.micro_batch_sizes)] = hit = (nb.shapes, nb.micro_batch_sizes, judged)
        why, group = hit[2]
        max_after = max_stages_after(nb, num_microbatches, capacity) if why is None else -1
        if why is None and max_after < 0:
            why = "does not fit in memory"
        if why is not None:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        times = nb.time_s  # p2p inside a slice plan is in its stage times
        temps.append(Template(i, len(nb.shapes), max_after, sum(times), max(times), max(nb.tail_s), group))
    return sorted(temps, key=lambda t: (t.bottleneck_s, t.time_s, t.tail_s))


def _judge_shapes(nb: SliceNumbers, island: "Island", sizes: Sequence[int], b: int, caps: "RuntimeCapabilities",
                  full_model: bool, placeable: dict) -> tuple[str | None, Hashable]:
    """(why the plan cannot be placed or None, its compatibility class): what depends on its stage shapes only."""
    why = unusable(nb, b, caps, full_model)
    if why is None:
        shapes = tuple((s.tp, s.dp * s.cp) for s in nb.shapes)  # all placement needs
        fit = placeable.get(shapes)
        if fit is None:
            fit = placeable[shapes] = fits_island(island, nb.shapes, sizes)
        if not fit:
            why = "stages do not fit the island's nodes"
    group = compatibility_group(nb.shapes, caps) if why is None else None
    if why is None and group is None:
        why = f"{caps.name} needs one grid for all stages"
    if why is None and caps.interleaved_uniform_grid and not caps.uniform_grid \
            and "interleaved-1F1B" in caps.schedules:
        grids = {(s.tp, s.dp, s.cp) for s in nb.shapes}
        group = GridClass(group, next(iter(grids)) if len(grids) == 1 else None)
    return why, group
