"""``megatron``: the exhaustive analytical parallelizer (the default).

For a slice/island query it enumerates every configuration Megatron-style 3D/5D parallelism allows on the island:

    GPUs used   n: powers of two and whole nodes up to the island (the plan's num_gpus says how many); with
                gpu_counts="all", every n up to the island (stages_placeable says which stage grids)
    pp          stages inside the slice (n % pp == 0, pp <= layers, <= q.max_stages / the runtime's max_stages);
                a stage's GPUs divide a node or are whole nodes, so stages tile the island's nodes
    tp          divides the GPUs per node (TP stays on NVLink/PCIe inside a node) and the attention heads
    cp          context parallel (seq_len divisible by 2 cp), dp = n / (pp tp cp), mbs = b / dp must be whole
    ep          MoE only: divides dp x cp and the number of experts
    memory      ZeRO 0-3 x recompute none/selective/full x offload on/off

Stages of a slice share one grid and the same memory savers; layers are split over them balanced by time
(costmodel.breakdown.balanced_split), the first/last stage lighter when they carry the embedding/head. Only what
``q.capabilities`` can run is costed. What is kept is, per class of the runtime's cross-stage constraints (one
(tp, dp, cp) grid / one TP size / one DP size, so that the planner can still find plans that agree across islands),
the plans no other plan stands for under the score the planner ranks by, the plain 1F1B event simulation
(exact_front): one plan stands for another only on the same ports (stages, grid, GPUs) and stage by stage no
slower, with no more DP sync + optimizer tail and fitting as deep in the pipeline (``SlicePlan.max_stages_after``).
That holds the closed form's Pareto front over (bottleneck, sum of stage times, tail, fit depth, stages, GPUs)
(pareto_front) and every grid's own. Nothing fits: an ``InfeasibleSlice`` with the smallest peak memory any
configuration needs and where it goes.

A query that carries the planner's bounds so far (``SliceQuery.latency_bound_s``, ``score_bound_s``) is answered
only with configurations that could be part of a pipeline that beats one of them: a grid is skipped before its
stages are costed when its floor (compute plus the TP/CP/EP communication no memory saver removes;
(m - 1) x floor / pp + floor against the closed form, m x floor / pp against the predicted iteration; then with
the split's heaviest stage) cannot, and a configuration when its own (m - 1) x bottleneck + fill + tail and
m x bottleneck + tail cannot (the score bound read at the grid's pp: SliceQuery.score_bound_at). A grid with a stage
that fits no memory-saver combination at its place is dropped before its combinations are judged; the rest are
judged from per-signature columns (grid.judge_columns).

The answer's plans are ``LazySlicePlan``s: their ``SliceNumbers`` come from the judged rows, their StageCosts (with
the explained breakdown) are built on first read, so a planning run builds only the plans its composition places.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import operator
import pickle
from typing import Any, Callable, Hashable, Iterator, NamedTuple

import numpy as np

from tangram_launch.capabilities import StageShape
from tangram_launch.costmodel.breakdown import ZERO_STAGES, ParallelConfig, SliceCoster
from tangram_launch.costmodel.compute import RECOMPUTE_MODES
from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.costmodel.host_memory import stage_host_problems
from tangram_launch.costmodel.grid import (
    GridIndex,
    SaverColumns,
    StageTable,
    StageTables,
    fills_of,
    judge_fill,
    judge_heads,
    least_heads,
    peak_memory,
)
from tangram_launch.costmodel.grid import fit_depth as grid_fit_depth
from tangram_launch.costmodel.grid import least_fill as least_fill_of
from tangram_launch.costmodel.slice_floors import (layers_held, least_bottlenecks_s, memory_floor_bytes,
                                                   stage_need_parts, stage_need_terms, time_floors)
from tangram_launch.costmodel.slice_bounds import beyond_array, beyond_each, beyond_floors, slack_cut
from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import (
    GPU_COUNTS,
    InfeasibleSlice,
    LazySlicePlan,
    SliceNumbers,
    SliceQuery,
    SliceResult,
    StageCost,
)

logger = logging.getLogger(__name__)

MAX_CP = 16
_MAX_GRID_LISTS = 4096  # grid lists kept per parallelizer (a planning run needs a few hundred)
_MAX_CONTEXT_IDS = 256  # query contexts whose key is remembered by the objects' identity


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_gpu_counts(num_gpus: int, gpus_per_node: int, every: bool = False) -> list[int]:
    """Powers of two that divide a node, and whole nodes: subsets whose stages tile the island's nodes; ``every``:
    every count up to the island (stages_placeable then says which stage grids of each count can be placed)."""
    if every:
        return list(range(1, num_gpus + 1))
    out = {k * gpus_per_node for k in range(1, num_gpus // gpus_per_node + 1)}
    p = 1
    while p <= gpus_per_node:
        if gpus_per_node % p == 0:
            out.add(p)
        p *= 2
    return sorted(x for x in out if x <= num_gpus)


def stages_placeable(n: int, pp: int, gpus_per_node: int, every: bool = False) -> bool:
    """Whether ``pp`` stages of n / pp GPUs each are offered. The default: a stage's GPUs divide a node or are
    whole nodes, so the stages tile the island's nodes. ``every`` adds stages of fewer GPUs than a node that do not
    divide it, when, placed as allocation.allocate_gpus places them (the island's GPUs in node order, stage after
    stage), none straddles two nodes. That is what the cost model prices: a stage of at most a node's GPUs has
    its DP/CP groups and its p2p inside the node (communication.group_link). A stage across part of two nodes
    would share a node's network interface with its neighbour and run its DP ring over the network, which no
    stage cost prices, so it is not offered (nor is a stage of more than a node that is not whole nodes); a
    hand-written plan may still place one (manual.py costs it as given)."""
    g = gpus_per_node
    sg = n // pp
    if sg % g == 0 or g % sg == 0:
        return True
    return every and sg < g and all((j * sg) // g == ((j + 1) * sg - 1) // g for j in range(pp))


def query_key(q: SliceQuery, kinds: tuple[str, ...] | None = None) -> tuple:
    """(island, layers, their kinds, embedding, head, b); ``kinds``: the slice's layer kinds, where known."""
    if kinds is None:
        kinds = tuple(q.model.layer_kind(i) for i in range(*q.layers))
    return (q.island.name, q.num_layers, kinds, q.has_embedding, q.has_head, q.microbatch_sequences)


def _memo(owner: object, name: str, key: Hashable, make: Callable[[], Any], limit: int | None = None) -> Any:
    """``make()`` kept under ``key`` in the dict ``owner`` holds as ``name`` (made on first use; a process-local
    cache, which __getstate__ leaves out); with ``limit``, the dict is emptied before it would grow past it."""
    cache = owner.__dict__.get(name)
    if cache is None:
        cache = owner.__dict__[name] = {}
    hit = cache.get(key)
    if hit is None:
        if limit is not None and len(cache) >= limit:
            cache.clear()
        hit = cache[key] = make()
    return hit


def cross_stage_class(q: SliceQuery, cfg: ParallelConfig) -> tuple:
    """Plans in different classes are never compared: the runtime needs one grid / TP / DP size across stages."""
    caps = q.capabilities
    if caps.uniform_grid:
        return ("grid", cfg.tp, cfg.dp, cfg.cp)
    key: tuple = ()
    if caps.uniform_tp:
        key += ("tp", cfg.tp)
    if caps.uniform_dp:
        key += ("dp", cfg.dp * cfg.cp)
    return key


def _front(points: dict[tuple, list[tuple]], stage_times: Callable[[tuple], tuple],
           alike: Callable[[tuple], tuple] | None = None) -> list[tuple]:
    """The answer's points: per cross-stage class, those no other point of the same ports stands for under the
    plain 1F1B score (exact_front). ``stage_times``: a point -> its stages' (forward_s, backward_s), front to back;
    ``alike``: see exact_front."""
    out: list[tuple] = []
    for bucket in points.values():
        out += exact_front(bucket, stage_times, alike)
    return out


def exact_front(points: list[tuple], stage_times: Callable[[tuple], tuple],
                alike: Callable[[tuple], tuple] | None = None) -> list[tuple]:
    """Points no other point stands for under the score the planner ranks plans by, the plain 1F1B event simulation
    plus the tail (build.Candidates.simulated_s), not the closed form (m - 1) x bottleneck + fill + tail.

    The simulation is a longest path through the pipeline's ops: each op ends at max(its stage's previous op's end,
    its dependency's end + the link) + its duration, so it never decreases as a stage's forward or backward grows,
    and a slice plan enters it as its stages' forward and backward seconds (their p2p inside) and the links at its
    two ends. So P may stand for Q (in any pipeline, whatever the rest of it, P in place of Q scores no more) when

        P and Q have the same ports: the same stages and (tp, cp, dp) on the same GPUs, so the same links to the
            slices beside it (boundary.boundary_s reads a stage's grid and nodes) and the same micro-batches in
            flight in front of it (each stage of a slice adds one to every earlier stage);
        at every stage P's forward <= Q's and P's backward <= Q's;
        P's tail (DP sync + optimizer, a max over stages) <= Q's, and P fits at least as deep (depth >= Q's).

    Fewer stages with the same bottleneck and less fill (the closed form's dominance) is not enough: a slow
    stage in front of this slice runs (m - w) x its time with w stages behind it, so the plan of more, shorter
    stages can simulate faster. Nor is the same stage count with closed-form dominance: the simulation reads where
    in the slice the slow stage sits and its forward and backward apart. Every point the closed form's front of the
    class keeps (pareto_front) is kept here too (this dominance implies that one), and so is each grid's own
    front, which a one-grid interleaved pipeline draws on (grid_classes.GridClass).

    Not ordered by this: the interleaved simulation, where it is faster, reads each stage's layers (the chunks it
    may take) and its static and activation bytes (what each virtual-stage count needs: interleave.py). Equal
    layers per stage and no more bytes at every stage as well would make the front exact there too; it keeps many
    more plans (a faster plan with more activations no longer stands for a leaner one) and planning of the largest
    benchmark cluster under torch took several times the CPU, so it is not done. Nor are measured wake-up charges,
    which go to the slowest stage (costmodel/wake.py).

    ``alike``, where given: a point -> (what its stages are, their distinct stages' (forward_s, backward_s) in one
    order, flat): two points whose stages are the same object (one grid's saver combinations: stage j of each is
    its signature's) compare stage by stage exactly when they compare those, each distinct stage once."""
    by_ports: dict[tuple, list[tuple]] = {}
    for pt in points:
        g = pt[6]
        by_ports.setdefault((g.tp, g.cp, g.dp, pt[4], pt[5]), []).append(pt)
    kept: list[tuple] = []
    for group in by_ports.values():
        kept += _ported_front(group, stage_times, alike)
    return kept


def _ported_front(points: list[tuple], stage_times: Callable[[tuple], tuple],
                  alike: Callable[[tuple], tuple] | None = None) -> list[tuple]:
    """exact_front of points with the same ports: sorted by (bottleneck, fill, tail, -depth), which the dominance
    respects (stage by stage <= gives max and front-to-back sums <=, rounding being monotone), so a point's
    dominators come first; a point's stage times are read once its closed-form terms make it a possible dominator
    or dominated, then kept flat (forward, backward, forward, ...: compared element by element in one C loop)."""
    if len(points) == 1:
        return points
    pts = sorted(points, key=lambda p: (p[0], p[1], p[2], -p[3]))
    # per kept point: [fill_s, tail_s, depth, its flat stage times (None until read), the point, alike(point) (None
    # until read)]
    terms: list[list] = []
    le, flat = operator.le, itertools.chain.from_iterable
    for p in pts:
        fill, tail, depth = p[1], p[2], p[3]
        mine = mine_alike = None
        for c in terms:
            if c[0] <= fill and c[1] <= tail and c[2] >= depth:
                if alike is not None:
                    if mine_alike is None:
                        mine_alike = alike(p)
                    theirs = c[5]
                    if theirs is None:
                        theirs = c[5] = alike(c[4])
                    if theirs[0] is mine_alike[0]:  # the same stages: their distinct ones decide
                        if all(map(le, theirs[1], mine_alike[1])):
                            break
                        continue
                if mine is None:
                    mine = tuple(flat(stage_times(p)))
                theirs = c[3]
                if theirs is None:
                    theirs = c[3] = tuple(flat(stage_times(c[4])))
                if all(map(le, theirs, mine)):
                    break
        else:
            terms.append([fill, tail, depth, mine, p, mine_alike])
    return [t[4] for t in terms]


def fit_depth(numbers: list[tuple], m: int, cap: float) -> tuple[int, float]:
    """grid.fit_depth for SliceCoster.fast_stage tuples (static and activation bytes at positions 2 and 3)."""
    return grid_fit_depth([(x[2], x[3]) for x in numbers], m, cap)


def pareto_front(points: list[tuple]) -> list[tuple]:
    """Points not dominated in (bottleneck min, fill min, tail min, depth max, stages min, gpus min): the closed
    form's front, which exact_front's answer holds (not the answer itself: see there why).

    A point is (bottleneck_s, fill_s, tail_s, depth, num_stages, num_gpus, payload...). The criteria are the terms
    of the 1F1B iteration time of any pipeline the slice ends up in, (m - 1) x max bottleneck + sum of stage times
    + max(DP sync + optimizer), plus what the composer needs for memory: how many later stages the plan tolerates,
    and how many stages it adds in front of them (each makes the earlier slices hold one more micro-batch).
    """
    # lexicographic order with every criterion as 'smaller is better' extends dominance: dominators come first
    pts = sorted(points, key=lambda p: (p[0], p[1], p[2], -p[3], p[4], p[5]))
    kept: list[tuple] = []
    crit: list[tuple] = []  # kept points' other criteria, unpacked once (the loop below is the hot path)
    # the kept point that dominated the last dominated one is tried first: dominated points come in runs (a grid's
    # saver combinations), and which dominator is found does not change whether there is one
    last = (math.inf, math.inf, -math.inf, math.inf, math.inf)
    for p in pts:
        fill, tail, depth, stages, gpus = p[1], p[2], p[3], p[4], p[5]
        kf, kt, kd, ks, kg = last
        if kf <= fill and kt <= tail and kd >= depth and ks <= stages and kg <= gpus:
            continue
        for c in crit:
            kf, kt, kd, ks, kg = c
            if kf <= fill and kt <= tail and kd >= depth and ks <= stages and kg <= gpus:
                last = c  # an earlier point (bottleneck <=) is at least as good on every other criterion
                break
        else:
            kept.append(p)
            crit.append((fill, tail, depth, stages, gpus))
    return kept


class MegatronParallelizer:
    """Exhaustive analytical parallelizer over DP x TP x PP x CP x EP, ZeRO, recompute, offload."""

    name = "megatron"

    def __init__(self, *, flash_attention: bool | None = None, gpu_subsets: bool = True,
                 gpu_counts: str = "tiling") -> None:
        """``gpu_subsets``: offer slices on part of the island; ``gpu_counts``: which parts, "tiling" (powers of two
        within a node and whole nodes: stages tile the nodes) or "all" (every count, stages_placeable)."""
        if gpu_counts not in GPU_COUNTS:
            raise SpecError("unknown GPU-count search space", field="gpu_counts", value=gpu_counts,
                            valid=", ".join(GPU_COUNTS))
        self.flash_attention = flash_attention
        self.gpu_subsets = gpu_subsets
        self.gpu_counts = gpu_counts

    # ------------------------------------------------------------------------------------------ enumeration
    def grids(self, q: SliceQuery, coster: SliceCoster) -> Iterator[ParallelConfig]:
        """Every (tp, pp, dp, cp, ep) grid the island, the slice and the runtime allow (memory savers unset).

        The grids depend on a few numbers only (not on the slice's place or the island's GPU type), and a planning
        run asks for the same ones hundreds of times: they are enumerated once per key, for every micro-batch size
        at once, and each size's (those whose dp divides b, in the same order) handed out again."""
        isl, model, caps = q.island, q.model, q.capabilities
        max_pp = q.num_layers
        for limit in (q.max_stages, caps.max_stages):
            if limit is not None:
                max_pp = min(max_pp, limit)
        key = (isl.num_gpus, isl.gpus_per_node, max_pp, caps.tensor_parallel, caps.context_parallel,
               caps.expert_parallel, coster.seq_len, model.num_heads, model.num_kv_heads, model.is_moe,
               model.num_experts, self.gpu_subsets, self.gpu_counts)
        every = _memo(self, "_grid_lists", key, lambda: tuple(self._enumerate_grids(q, coster, max_pp)),
                      limit=_MAX_GRID_LISTS)
        b = q.microbatch_sequences
        return iter(_memo(self, "_grid_lists", (key, b), lambda: tuple(g for g in every if b % g.dp == 0),
                          limit=_MAX_GRID_LISTS))

    def _enumerate_grids(self, q: SliceQuery, coster: SliceCoster, max_pp: int) -> Iterator[ParallelConfig]:
        """grids() at every micro-batch size (any dp)."""
        isl, model, caps = q.island, q.model, q.capabilities
        g = isl.gpus_per_node
        every = self.gpu_counts == "all"
        counts = candidate_gpu_counts(isl.num_gpus, g, every) if self.gpu_subsets else [isl.num_gpus]
        for n in counts:
            for pp in divisors(n):
                if pp > max_pp or not stages_placeable(n, pp, g, every):
                    continue
                sg = n // pp
                for tp in divisors(math.gcd(sg, g)):
                    if tp > 1 and not caps.tensor_parallel:
                        continue
                    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
                        continue
                    for cp in divisors(sg // tp):
                        if cp > 1 and (not caps.context_parallel or cp > MAX_CP
                                       or coster.seq_len % (2 * cp)):
                            continue
                        dp = sg // (tp * cp)
                        eps = [1]
                        if model.is_moe and caps.expert_parallel:
                            eps = [e for e in divisors(dp * cp) if model.num_experts % e == 0]
                        for ep in eps:
                            yield ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)

    def savers(self, q: SliceQuery, grid: ParallelConfig) -> list[tuple[int, int, bool]]:
        """(zero stage, recompute index, offload) combinations for a grid that the runtime can run. Duplicates are
        skipped: without a data-parallel group ZeRO 1-3 change nothing (offload moves the optimizer state only)."""
        caps = q.capabilities
        pipelined = q.pipelined or grid.pp > 1
        shard = grid.dp * grid.cp
        # a CPU "device" keeps its state in host memory already: offloading it would move nothing off the device
        offloads = (False, True) if caps.offload and q.island.gpu.type != "cpu" else (False,)
        out = []
        for r, recompute in enumerate(RECOMPUTE_MODES):
            for zero in ZERO_STAGES:
                for offload in offloads:
                    if shard == 1 and zero:
                        continue
                    shape = StageShape(tp=grid.tp, dp=grid.dp, cp=grid.cp, ep=grid.ep, zero_stage=zero,
                                       recompute=recompute, offload=offload)
                    if caps.allows_stage(shape, pipelined=pipelined):
                        out.append((zero, r, offload))
        return out

    def compute_floors(self, q: SliceQuery) -> dict[str, tuple[float, float]]:
        """Per layer kind, and for "embedding" / "head": the least (GPU-seconds, seconds) of forward + backward
        compute per micro-batch, with the TP / CP / EP communication every stage pays whatever its memory savers
        (slice_floors.time_floors with_comm), over every grid this parallelizer offers for q's island and
        micro-batch size (no recompute, no p2p: floors that every slice plan's stage times are at least). The
        planner turns them into floors under any plan at one micro-batch size (size_floors.size_floor) and under any
        pipeline holding a pair (pair_floors.py)."""
        table, coster = self._floor_coster(q)
        if coster is None:
            return {}
        out: dict[str, tuple[float, float]] = {}
        # the distinct (tp, cp, ep, dp) of the grids that have no shape problem and fit the slice: the queries'
        # grid list (GridIndex.fkeys, the same one the queries at this micro-batch size take)
        index = self._grid_index(table, q, coster, self.grids, self.gpu_counts == "tiling")[1]
        fits = set(index.fkey_ids[index.pp <= q.num_layers].tolist())
        for f, key in enumerate(index.fkeys):
            if f not in fits:
                continue
            n = key[0] * key[1] * key[3]
            per_kind, emb_s, head_s = _time_floors(table, coster, key)
            for k, t in (*per_kind.items(), ("embedding", emb_s), ("head", head_s)):
                gs, ts = out.get(k, (math.inf, math.inf))
                out[k] = (min(gs, t * n), min(ts, t))
        return out

    def bottleneck_floors(self, q: SliceQuery, stages_after: tuple[int, ...] = (0, 1)) -> dict[int, list[float]]:
        """Per D of ``stages_after``: out[D][x], x = 0 .. the model's layers, a floor under the slowest stage's
        forward + backward seconds per micro-batch of any slice plan of x layers on q's island at q's micro-batch
        size with D or more pipeline stages behind it (inf: none fits). Memory decides it: stage i + 1 from the
        slice's end holds min(i + 1 + D, m) micro-batches in flight (1F1B), so a grid runs x layers only under
        the recompute modes whose stages hold them, and each mode's layers cost its recompute on top of
        compute_floors' seconds (slice_floors.least_bottlenecks_s; the saver combinations of a grid pipelined or
        not, the layer kinds' least needs and seconds, the embedding and head left out: floors). {} without a
        device."""
        table, coster = self._floor_coster(q)
        if coster is None:
            return {}
        gkey, index = self._grid_index(table, q, coster, self.grids, self.gpu_counts == "tiling")
        m, L = q.num_microbatches, q.model.num_layers
        room = coster.capacity_bytes * (1.0 + 1e-9) - coster.overhead_bytes  # as _GridSearch.too_big_grids
        stage_counts = table.floors.get(("stage counts", gkey))
        if stage_counts is None:  # per (tp, cp, ep, dp) of the grid list, its stage counts, ascending
            counts: dict[int, set[int]] = {}
            for f, pp in zip(index.fkey_list, index.pp_list):
                counts.setdefault(f, set()).add(index.pp_values[pp])
            stage_counts = table.floors["stage counts", gkey] = {f: sorted(pps) for f, pps in counts.items()}
        any_savers = table.saver_lists.setdefault((getattr(self.savers, "__qualname__", None), "either"), {})
        options, needs, starts = [], [], []  # per (grid, mode): (seconds per layer, its stage counts); their needs
        for f, pps in stage_counts.items():
            for seconds, rows in self._layer_modes(q, coster, table, index.fkeys[f], any_savers):
                starts.append(len(needs))
                options.append((seconds, pps))
                needs += rows
        out = {d: [0.0] + [math.inf] * L for d in stages_after}
        if not options:
            return out
        top = min(max(max(pps) for pps in stage_counts.values()) + max(stages_after), m)
        # held[o, k - 1]: the most layers a stage of option o holds with k micro-batches in flight (k <= top)
        held = np.maximum.reduceat(layers_held(np.array(needs), room, np.arange(1, top + 1), L), starts, axis=0)
        for d in stages_after:
            out[d] = least_bottlenecks_s(*_stage_room(options, held, d, m), L)
        return out

    def _layer_modes(self, q: SliceQuery, coster: SliceCoster, table: StageTable, key: tuple[int, int, int, int],
                     any_savers: dict) -> list[tuple[float, list[tuple[float, float, float]]]]:
        """Per recompute mode a stage of (tp, cp, ep, dp) = ``key`` may run (its saver combinations, pipelined or
        not): (a layer's least seconds under it: time_floors with_comm + its recompute, the least over the layer
        kinds; per combination of that mode, stage_need_parts' (states, activations, working sets) per layer, the
        least over the kinds). ``any_savers``: the combinations by the grid flags they depend on, kept by the
        caller."""
        tp, cp, ep, dp = key
        flags = (tp > 1, cp > 1, ep > 1, dp * cp == 1)  # what savers() reads of a grid (GridIndex.saver_keys)
        savers = any_savers.get(flags)
        if savers is None:
            grid = ParallelConfig(tp=tp, pp=1, dp=dp, cp=cp, ep=ep)
            savers = any_savers[flags] = []
            for pipelined in (False, True):
                savers += [s for s in self.savers(dataclasses.replace(q, pipelined=pipelined), grid)
                           if s not in savers]
        per_kind = _time_floors(table, coster, key)[0]
        mbs = q.microbatch_sequences // dp
        kinds = list(per_kind)
        terms = [coster.layer_terms(k, tp, cp, ep, dp, mbs) for k in kinds]
        parts = [stage_need_parts(coster, tp, cp, ep, dp, savers, k, states=table.state_floors)[0] for k in kinds]
        by_mode: dict[int, list[tuple[float, float, float]]] = {}
        for s, (_zero, r, _off) in enumerate(savers):
            if len(parts) == 1:
                state, act, working, _per_param = parts[0][s]
                by_mode.setdefault(r, []).append((state, act, working))
            else:
                by_mode.setdefault(r, []).append(tuple(min(p[s][i] for p in parts) for i in range(3)))
        return [(min(per_kind[k] + t.recompute_s[r] for k, t in zip(kinds, terms)), by_mode[r])
                for r in sorted(by_mode)]

    # ------------------------------------------------------------------------------------------ query
    def query(self, q: SliceQuery) -> SliceResult:
        return self._search(q, self.grids, self.savers)

    def _search(self, q: SliceQuery, grids, savers, *, memory_floor: bool = True) -> SliceResult:
        """The query's answer over ``grids`` x ``savers``. ``memory_floor``: skip, before costing its stages, a grid
        that fits no saver combination by a floor: its stages on average (slice_floors.memory_floor_bytes), a
        one-kind slice's stage of ceil(layers / pp) layers (stage_need_terms), or, once split, its first or
        largest stage (_stage_misfit); off when nothing fits, to name the least memory needed (the answer's reason
        reads every grid's).

        The steps: _GridSearch.bound_grids (the grids whose floors cannot beat the planner's bounds, at once),
        .too_big_grids (those that fit no combination by a memory floor), .judge_grids (each remaining grid's
        combinations, kept as FrontPoints), then the answer from the points (_answer)."""
        table = self._table(q)
        kinds = table.model_kinds(q.model)[q.layers[0]:q.layers[1]]
        key = query_key(q, kinds)
        coster = SliceCoster(q, flash_attention=self.flash_attention, layer_kinds=kinds, device=table.device)
        if coster.device_error:
            return SliceResult(key, (), InfeasibleSlice((coster.device_error,)))
        table.device = coster.dev  # the context's: later queries take it instead of building it again
        b = q.microbatch_sequences
        if b < 1 or q.training.global_batch % b:
            return SliceResult(key, (), InfeasibleSlice(
                (f"global batch {q.training.global_batch} is not a multiple of the micro-batch of {b} sequences",)))
        table.attach(coster)
        search = _GridSearch(q, table, coster, grids, savers, tiling=self.gpu_counts == "tiling")
        if search.bound:
            search.bound_grids()
        if memory_floor:
            search.too_big_grids()
        search.judge_grids(np.flatnonzero(search.keep).tolist())
        return self._answer(search, key, memory_floor)

    def _answer(self, search: "_GridSearch", key: tuple, memory_floor: bool) -> SliceResult:
        """The query's answer from a finished search: its front points as lazy slice plans, or why there are none."""
        q, coster, m, cap = search.q, search.coster, search.m, search.cap
        points = {k: v for k, v in search.points.items() if v}
        if not points:
            if search.bounded:  # something fits, nothing beats the bound
                return SliceResult(key, (), None, search.evaluated, bounded=search.bounded)
            if search.too_big:  # nothing fits: judge every grid for the least memory the answer names
                return self._search(q, search.grids, search.savers, memory_floor=False)
            reason = self._infeasible(q, coster, search.least_memory(), search.shape_reasons, m, cap)
            return SliceResult(key, (), reason, search.evaluated)
        # the answer's order: by bottleneck, then GPUs (SlicePlan.bottleneck_s and num_gpus of the plans)
        front = sorted(_front(points, search.stage_times, search.alike), key=lambda pt: (pt[0], pt[5]))
        layers = tuple(q.layers)
        plans = tuple(self._lazy_plan(search.table, coster, layers, (m, cap), pt) for pt in front)
        coster.clear_grid_cache()  # lazy plans keep the coster; its per-grid sums are in the table already
        logger.debug("%s: %s layers %s on %s: %d configs, %d on the front", self.name, q.model.name, q.layers,
                     q.island.name, search.evaluated, len(plans))
        # its points fit (depth >= 0) and, under bounds, are not beyond them (_keep_points): screened
        return SliceResult(key, plans, None, search.evaluated, bounded=search.bounded, screened=True)

    @staticmethod
    def _grid_index(table: StageTable, q: SliceQuery, coster: SliceCoster, grids,
                    tiling: bool = True) -> tuple[tuple, GridIndex]:
        """(its key, the GridIndex) of the grids ``grids`` lists for q's context and micro-batch size.

        The grids and their shape problems depend on the context and b, and on the slice's length only through its
        cap on pp: listed once for the whole model under the cap of q.max_stages and the runtime's (the same list
        whichever of them sets it), each query takes those with pp up to its layers."""
        cap = q.capabilities.max_stages
        if q.max_stages is not None:
            cap = q.max_stages if cap is None else min(cap, q.max_stages)
        gkey = (getattr(grids, "__qualname__", None), q.microbatch_sequences, cap)
        index = table.grid_lists.get(gkey)
        if index is None:
            whole = dataclasses.replace(q, layers=(0, q.model.num_layers))
            # not ``tiling`` (gpu_counts="all"): the tiling rule is the enumeration's (stages_placeable), not a
            # shape problem
            index = table.grid_lists[gkey] = GridIndex([(g, tuple(coster.check(g, slice_layers=False,
                                                                               search_space=tiling)))
                                                        for g in grids(whole, coster)])
        return gkey, index

    def _lazy_plan(self, table: StageTable, coster: SliceCoster, layers: tuple[int, int], judged: tuple[int, float],
                   point: tuple) -> LazySlicePlan:
        """A front point as a slice plan: its numbers from the judged rows (those its built stages carry, bit for
        bit), its StageCosts built only if someone reads them."""
        grid, zero, r, off, (sizes, sigs, by_sid, _halves, heads), s = point[6:]  # after the six objectives
        pp = len(sizes)
        mbs = coster.q.microbatch_sequences // grid.dp
        shapes, mbss = self._shapes(grid, zero, r, off, pp, mbs)
        if len(sigs) > 8:  # a long pipeline: each distinct stage's row looked up once
            rows = {sid: by_sid[sid][s] for sid, _ in heads}
            times, static, act, tails = zip(*map(rows.__getitem__, sigs))  # (time, static, act, sync+opt)
        else:
            times, static, act, tails = zip(*[by_sid[sid][s] for sid in sigs])
        # (SliceNumbers made as its class's __new__ does; the hint: m, capacity and fit_depth's depth)
        numbers = tuple.__new__(SliceNumbers, (shapes, mbss, times, static, act, tails, (*judged, point[3])))
        return LazySlicePlan.of_numbers(coster.island.name, layers, self.name, numbers,
                                        lambda: self._stages(table, coster, _config(grid, zero, r, off),
                                                             coster.stage_ranges(sizes), sigs))

    def _shapes(self, grid: ParallelConfig, zero: int, r: int, off: bool, pp: int, mbs: int) -> tuple[tuple, tuple]:
        """A configuration's stage shapes and micro-batch sizes: one pair of tuples per configuration across
        queries (grid_classes.judge_templates judges a shared pair once)."""
        key = (grid.tp, grid.dp, grid.cp, grid.ep, zero, r, off, pp, mbs)
        cache = self.__dict__.get("_shape_cache")
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            return hit
        # the stage shape itself is one object per (grid, savers), whatever the stages and micro-batch size
        shape = _memo(self, "_shape_cache", key[:7], lambda: StageShape(
            tp=grid.tp, dp=grid.dp, cp=grid.cp, ep=grid.ep, zero_stage=zero, recompute=RECOMPUTE_MODES[r],
            offload=off))
        return _memo(self, "_shape_cache", key, lambda: ((shape,) * pp, (mbs,) * pp))

    def _floor_coster(self, q: SliceQuery) -> tuple[StageTable, SliceCoster | None]:
        """The query context's stage table and a coster of the whole slice attached to it (None where q's island
        has no device model: the floors then are none)."""
        table = self._table(q)
        coster = SliceCoster(q, flash_attention=self.flash_attention, device=table.device)
        if coster.device_error:
            return table, None
        table.device = coster.dev
        table.attach(coster)
        return table, coster

    def _table(self, q: SliceQuery) -> StageTable:
        """The stage table of the query's context: island, model, training, runtime and cost-model options."""
        tables = self.__dict__.get("_tables")
        if tables is None:
            tables = self._tables = StageTables()
        # the same objects come with every query of a planning run: their pickle is taken once (they are frozen;
        # the entry holds them, so their ids stay theirs)
        ids = (id(q.island), id(q.model), id(q.training), id(q.capabilities), self.flash_attention)
        parts = (q.island, q.model, q.training, q.capabilities, self.flash_attention)
        hit = _memo(self, "_contexts", ids, lambda: (pickle.dumps(parts, protocol=4), parts), limit=_MAX_CONTEXT_IDS)
        return tables.get(hit[0])

    def _stages(self, table: StageTable, coster: SliceCoster, cfg: ParallelConfig,
                ranges: tuple[tuple[int, int], ...], sigs: tuple) -> tuple[StageCost, ...]:
        """The StageCosts of one configuration from the context's costed stages (SliceCoster.materialize's
        numbers, its stages' layer ranges)."""
        mbs = coster.q.microbatch_sequences // cfg.dp
        shape = cfg.shape()
        stages = []
        for layers, sig in zip(ranges, sigs):
            fwd, bwd, static, act, sync, opt_s, bd, p2p_bytes = table.explained_stage(coster, sig, cfg)
            stages.append(StageCost(layers=layers, shape=shape, micro_batch_size=mbs, forward_s=fwd,
                                    backward_s=bwd, static_bytes=static, activation_bytes=act, dp_sync_s=sync,
                                    optimizer_s=opt_s, p2p_bytes=p2p_bytes, breakdown=dict(bd)))
        return tuple(stages)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_tables", None)  # caches stay in the process that built them
        state.pop("_shape_cache", None)
        state.pop("_grid_lists", None)
        state.pop("_contexts", None)
        return state

    def _infeasible(self, q: SliceQuery, coster: SliceCoster, best, shape_reasons: set[str], m: int,
                    cap: float) -> InfeasibleSlice:
        where = f"{q.model.name} layers {q.layers[0]}:{q.layers[1]} on island {q.island.name}"
        if best is None:
            reasons = sorted(shape_reasons) or [f"{self.name}: no configuration the runtime "
                                                f"'{q.capabilities.name}' can run"]
            return InfeasibleSlice(tuple(f"{where}: {r}" for r in reasons[:8]))
        peak, grid, zero, r, off = best
        cfg = _config(grid, zero, r, off)
        # (its shape passed the grid list's check: materialized without check's tiling rule, which "all" lifts)
        plan = coster.materialize(cfg, coster.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep),
                                  parallelizer=self.name)
        n = len(plan.stages)
        j = max(range(n), key=lambda k: plan.stages[k].memory_bytes(n - 1 - k, m))
        st = plan.stages[j]
        inflight = min(n - j, m)
        bd = {k: st.breakdown[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes",
                                             "autocast_held_copies_bytes", "working_bytes", "overhead_bytes")}
        bd["activations_bytes"] = st.activation_bytes * inflight
        bd["micro_batches_in_flight"] = inflight
        bd["config"] = cfg.describe()
        bd["stage"] = j
        parts = ", ".join(f"{_PART_NAMES.get(k, k.replace('_bytes', ''))} {v / GIB:.1f} GiB" for k, v in bd.items()
                          if k.endswith("_bytes") and v)
        reason = (f"{where} needs at least {peak / GIB:.1f} GiB per GPU (capacity {cap / GIB:.1f} GiB) even with "
                  f"{cfg.describe()}: {parts}")
        return InfeasibleSlice((reason, *self._host_reasons(q, coster, grid, m, cap, where)), peak, bd)

    def _host_reasons(self, q: SliceQuery, coster: SliceCoster, grid: ParallelConfig, m: int, cap: float,
                      where: str) -> tuple[str, ...]:
        """Where the host memory is what rules out offload (its combinations fit at no depth, fast_stage): why, for
        the least GPU memory an offloaded combination of ``grid`` (the grid that came nearest to fitting) needs,
        when that would fit the GPUs. Only read when nothing fits, so its few materialized plans cost nothing."""
        if q.island.host_memory is None:
            return ()
        sums = coster.stage_sums(grid.tp, grid.pp, grid.dp, grid.cp, grid.ep)
        plans = [coster.materialize(_config(grid, zero, r, off), sums, parallelizer=self.name)
                 for zero, r, off in self.savers(q, grid) if off]
        plans = [p for p in plans if p.fits(0, m, cap)]
        if not plans:
            return ()
        n = len(plans[0].stages)
        plan = min(plans, key=lambda p: max(st.memory_bytes(n - 1 - k, m) for k, st in enumerate(p.stages)))
        problems = stage_host_problems(plan.stages, q.island.host_memory)
        shape = plan.stages[0].shape
        return tuple(f"{where}: with zero={shape.zero_stage} recompute={shape.recompute} offload=yes it fits in GPU "
                     f"memory, but {p}" for p in problems[:1])


# the infeasible answer's memory parts, as its reason names them (the others: the key less "_bytes")
_PART_NAMES = {"autocast_held_copies_bytes": "16-bit weight copies"}


class StagesCosted(NamedTuple):
    """A grid's costed stages: layers per stage, each stage's signature, per signature its judged rows and its
    combinations' (forward_s, backward_s) (StageTable.halves)."""

    sizes: tuple[int, ...]
    sigs: tuple
    by_sid: dict
    halves: dict
    heads: list[tuple[int, int]]  # each distinct signature, front to back, with its first stage (grid.heads)


class FrontPoint(NamedTuple):
    """One saver combination of one grid, judged: the six criteria pareto_front compares, then what the plan is."""

    bottleneck_s: float
    fill_s: float
    tail_s: float
    depth: int  # following stages it still fits with (grid.fit_depth)
    num_stages: int
    num_gpus: int
    grid: ParallelConfig
    zero: int
    recompute: int  # index into RECOMPUTE_MODES
    offload: bool
    stages: StagesCosted
    saver: int  # its index among the grid's allowed combinations (the judged rows' column)


class _Misfit(NamedTuple):
    """A judged grid with combinations that fit nowhere (depth None: all of them)."""

    grid: ParallelConfig
    sigs: tuple
    by_sid: dict
    allowed: tuple
    depth: list[int] | None


class _GridSearch:
    """One query's search over a grid list (MegatronParallelizer._search): the query's context, the bounds it
    prunes by (bounds.py's slice rows), and what it has found so far."""

    def __init__(self, q: SliceQuery, table: StageTable, coster: SliceCoster, grids, savers, *,
                 tiling: bool = True) -> None:
        self.q, self.table, self.coster, self.grids, self.savers = q, table, coster, grids, savers
        self.m = max(1, q.num_microbatches)
        self.cap = coster.capacity_bytes
        self.gpus_per_node = coster.island.gpus_per_node
        self.points: dict[tuple, list[FrontPoint]] = {}  # by cross-stage class, in the order grids are judged
        self.misfits: list[_Misfit] = []
        self.shape_reasons: set[str] = set()
        self.evaluated = 0  # combinations judged
        self.bounded = 0  # grids and combinations skipped by the bounds
        self.too_big = 0  # grids skipped by their memory floor
        self.saver_cache_key = (getattr(savers, "__qualname__", None), q.pipelined)
        self.saver_cache = table.saver_lists.setdefault(self.saver_cache_key, {})
        self.saver_columns: dict[tuple, SaverColumns] = {}  # saver key -> StageTable.saver_columns of its savers
        self.bound = q.bounded  # skip what cannot beat the planner's bounds so far
        self.lat_cut = slack_cut(q.latency_bound_s)
        self.floors: dict[int, tuple] = {}  # GridIndex.fkeys' -> (per-kind, embedding, head, slice's, one kind's)
        self.gkey, self.index = MegatronParallelizer._grid_index(table, q, coster, grids, tiling)
        self.max_pp = q.num_layers
        for pp, problems in self.index.problems:
            if pp <= self.max_pp:
                self.shape_reasons.update(problems)
        self.keep = self.index.pp <= self.max_pp  # the problem-free grids this slice can hold, in listed order
        # each listed grid's cross_stage_class (the context's capabilities and the grid's: one list per grid list)
        self.classes = table.grid_classes.get(self.gkey)
        if self.classes is None:
            self.classes = table.grid_classes[self.gkey] = [cross_stage_class(q, g) for g in self.index.grids]
        self.stage_parts = None  # (GridIndex.fkeys' index, saver key) -> slice_floors.stage_need_parts, one kind
        self.room = math.inf
        self.one_kind = None  # a one-kind slice's (kind, embedding, head, tied embeddings): StageTable.one_kind_heads
        self.knowns: list = []  # GridIndex.known's list of the slice's kind, embedding and head (_known)
        if len(coster.prefix) == 1:
            self.one_kind = (next(iter(coster.prefix)), coster.has_embedding, coster.has_head,
                             coster.model.tied_embeddings)
            # (the grid list is one micro-batch size's)
            self.knowns = self.index.known.setdefault(self.one_kind[:3], [None] * len(self.index.grids))

    def bound_grids(self) -> None:
        """Drop the grids whose floor cannot beat either bound, at once: (m - 1) x floor / pp + floor and
        m x floor / pp, for every memory saver (the same float operations as one by one). Only the grids still
        kept are read (the listed ones the slice can hold: a short slice's are few of a long list)."""
        q, coster, index, m = self.q, self.coster, self.index, self.m
        floor_key = (tuple(coster.prefix), coster.has_embedding, coster.has_head)  # what time_floors reads
        self.hits, kind_floors, emb_floors, head_floors = _floor_arrays(self.table, index, coster, self.gkey,
                                                                        floor_key)
        totals = 0  # per (tp, cp, ep, dp): the slice's floor, summed as sum() over its layer kinds would
        for k, c in coster.layer_counts():
            totals = totals + c * kind_floors[k]
        self.totals = totals = totals + emb_floors + head_floors
        kept = np.flatnonzero(self.keep)
        tot, pp = totals[index.fkey_ids[kept]], index.pp[kept]
        # the score bound at each distinct pp (SliceQuery.score_bound_at), with the slack, read per grid: those of
        # more stages than the slice has layers hold no kept grid (inf)
        held = bisect.bisect_right(index.pp_values, self.max_pp)
        bounds = q.score_bounds_at(index.pp_values[:held]) + [math.inf] * (len(index.pp_values) - held)
        cuts = slack_cut(np.array(bounds, dtype=np.float64))
        self.pp_cut = cuts.tolist()
        score_cut = cuts[index.pp_ids[kept]]
        # (the grid's floor spread over its stages, as the floors always summed it)
        beyond = beyond_array((m - 1) * tot / pp + tot, m * tot / pp, self.lat_cut, score_cut)
        self.bounded += int(np.count_nonzero(beyond))
        self.keep[kept[beyond]] = False

    def too_big_grids(self) -> None:
        """Drop the grids none of whose combinations fits, on average over their stages (and, for a one-kind slice,
        at the stage with the most layers under its best combination). Only the grids still kept are read."""
        coster, index = self.coster, self.index
        kind_mem, emb_mem, head_mem, stage_terms = _memory_arrays(self.table, index, coster, self.gkey,
                                                                  self.saver_cache_key, self.saver_cache,
                                                                  self.savers)
        kept = np.flatnonzero(self.keep)
        need = 0
        counts = coster.layer_counts()
        for k, c in counts:
            need = need + c * kind_mem[k][kept]
        if coster.has_embedding:
            need = need + emb_mem[kept]
        if coster.has_head:
            need = need + head_mem[kept]
        room = self.room = self.cap * (1.0 + 1e-9) - coster.overhead_bytes  # the floors sum in other orders
        pp = index.pp[kept]
        over = need > room * pp
        if stage_terms is not None:  # one kind: the stage with the most layers, under its best combination
            if len(kept):
                most = np.ceil(counts[0][1] / pp)
                over |= (stage_terms[0][kept] * most[:, None] + stage_terms[1][kept]).min(axis=1) > room
            self.kind = counts[0][0]
            self.stage_parts = self.table.memory_floors.setdefault(
                ("parts", self.gkey, self.saver_cache_key, self.kind, _whole(coster)), {})
            model = self.q.model  # the edges' dense parameters a first or last stage holds (before TP)
            self.edges = (model.embedding_params() if coster.has_embedding else 0,
                          model.head_params() if coster.has_head else 0)
        self.too_big = int(np.count_nonzero(over))
        self.keep[kept[over]] = False

    def judge_grids(self, indices: list[int]) -> None:
        """Each grid of ``indices``, in listed order: skipped by its bounds or memory floors, else costed and its
        combinations judged (_judge_costed). The query's hot loop: its constants are read once, not per grid."""
        index, coster, q, m = self.index, self.coster, self.q, self.m
        grids, saver_keys, all_dims, pp_list, fkey_list = (index.grids, index.saver_keys, index.dims, index.pp_list,
                                                           index.fkey_list)
        saver_cache, floors, split_sizes, b = self.saver_cache, self.floors, coster.split_sizes, q.microbatch_sequences
        bound, max_pp, lat_cut, misfits = self.bound, self.max_pp, self.lat_cut, self.stage_parts is not None
        pp_cut = self.pp_cut if bound else None
        floor = grid_cut = math.inf
        one_kind, knowns, one_kind_split = self.one_kind is not None, self.knowns, coster.one_kind_split
        for i in indices:
            skey = saver_keys[i]
            allowed = saver_cache.get(skey)
            if allowed is None:  # what savers() reads: the context, q.pipelined and these flags
                allowed = saver_cache[skey] = tuple(self.savers(q, grids[i]))
            if not allowed:
                continue
            tp, pp, dp, cp, ep = dims = all_dims[i]
            if bound:
                grid_cut = pp_cut[pp_list[i]]
                floor = floors.get(fkey_list[i]) or self._floor(fkey_list[i])
                # one kind: whatever the split, a stage holds ceil(layers / pp) layers or more, so the heaviest
                # stage's floor (_heaviest_floor) is at least that many times the kind's (the same float products,
                # rounding monotone): a grid this already bounds needs no split
                if pp > 1 and floor[4] is not None and beyond_floors(-(-max_pp // pp) * floor[4], floor[3], 0.0, m,
                                                                     lat_cut, grid_cut):
                    self.bounded += 1
                    continue
            if one_kind and pp > 1:  # (split_sizes' one-kind path, the grid's weights kept per grid list)
                sizes = one_kind_split((knowns[i] or self._known(i, dims))[3], pp)
            else:
                sizes = split_sizes(pp, tp, cp, ep, dp, b // dp)
            # the split's heaviest stage bounds the bottleneck more tightly than floor / pp
            if bound and pp > 1 and beyond_floors(_heaviest_floor(coster, sizes, floor), floor[3], 0.0, m, lat_cut,
                                                  grid_cut):
                self.bounded += 1
                continue
            if misfits and self._stage_misfit(i, skey, allowed, sizes, grids[i]):
                self.too_big += 1
                continue
            self._judge_costed(i, dims, skey, allowed, sizes, grid_cut)

    def _judge_costed(self, i: int, dims: tuple, skey: tuple, allowed: tuple, sizes: tuple[int, ...],
                      grid_cut: float) -> None:
        """Grid i, which its floors did not skip: its stages costed, then skipped by their least floors, else its
        combinations judged and kept (_keep_points)."""
        table, coster, m = self.table, self.coster, self.m
        if self.one_kind is not None and dims[1] > 2:  # (signature_heads' one-kind path, its inputs read once)
            known = self.knowns[i] or self._known(i, dims)
            sigs, heads = table.one_kind_heads(known[0], sizes, known[1], known[2], self.gpus_per_node,
                                               self.one_kind)
        else:
            sigs, heads = table.signature_heads(coster, *dims, sizes)
        saver_columns = self.saver_columns.get(skey)
        if saver_columns is None:
            saver_columns = self.saver_columns[skey] = table.saver_columns(allowed, m, self.cap)
        # each stage's rows (by_sid[its sig]) and their columns
        by_sid, columns = table.costed_columns(coster, dims, sigs, saver_columns, sizes, heads)
        least = None  # (the stages' least times added up, where summed), on the bounded path of many combinations
        if self.bound and len(allowed) > 1:
            least = [None, heads]
            least_bn, least_tail = least_heads(columns, heads)
            # the score floor first: only where it is beyond is the latency floor (and its fill) read
            if m * least_bn + least_tail > grid_cut:
                least[0] = least_fill_of(columns, sigs, heads)
                if beyond_floors(least_bn, least[0], least_tail, m, self.lat_cut, grid_cut):
                    self.bounded += 1  # no combination can beat either bound: not judged
                    return
        stages = tuple.__new__(StagesCosted, (sizes, sigs, by_sid, saver_columns.halves, heads))
        self._keep_points(i, allowed, stages, columns, judge_heads(columns, len(sigs), m, heads), grid_cut, least)

    def _known(self, i: int, dims: tuple) -> tuple:
        """Grid i's StageTable.one_kind_heads inputs (its known signatures, signature dims and stage GPUs) and its
        SliceCoster.one_kind_weights."""
        tp, _pp, dp, cp, ep = dims
        b = self.q.microbatch_sequences
        sig_dims = (b, tp, dp, cp, ep)
        known = self.knowns[i] = (self.table.known_sids(sig_dims, *self.one_kind[:3]), sig_dims, tp * cp * dp,
                                  self.coster.one_kind_weights(tp, cp, ep, dp, b // dp))
        return known

    def _floor(self, f: int) -> tuple:
        """The compute floors of GridIndex.fkeys[f]: (per-kind, embedding, head, the slice's total, its one kind's
        or None)."""
        per_kind = self.hits[f][0]
        one_kind = next(iter(per_kind.values())) if len(per_kind) == 1 else None
        floor = self.floors[f] = (*self.hits[f], float(self.totals[f]), one_kind)
        return floor

    def _stage_misfit(self, i: int, skey, allowed: tuple, sizes: tuple[int, ...], grid: ParallelConfig) -> bool:
        """One kind: whether the first stage (the most in flight) or the largest, as split, fits no combination."""
        f = self.index.fkey_list[i]
        parts = self.stage_parts.get((f, skey))
        if parts is None:
            parts = self.stage_parts[f, skey] = (*stage_need_parts(
                self.coster, grid.tp, grid.cp, grid.ep, grid.dp, allowed, self.kind, states=self.table.state_floors),
                {})
        return _stage_misfit(parts, sizes, self.m, self.room, self.edges, grid.tp)

    def _keep_points(self, i: int, allowed: tuple, stages: StagesCosted, columns: dict, judged, grid_cut: float,
                     least: list | None) -> None:
        """Judged grid i's combinations that fit and can beat a bound, as FrontPoints of its cross-stage class.
        ``judged``: grid.judge_heads' answer; ``least``: on the bounded path of many combinations, [the stages'
        least times added up (grid.least_fill) or None until summed, heads(sigs)]: a grid all of whose fitting
        combinations are beyond the bounds with it in place of their own fill (under it to the last bit) has its
        fills left unsummed."""
        self.evaluated += len(allowed)
        grid = self.index.grids[i]
        bucket = self.points.setdefault(self.classes[i], [])  # classes in the order judged
        if judged is None:  # no combination fits
            self.misfits.append(_Misfit(grid, stages.sigs, stages.by_sid, allowed, None))
            return
        bottleneck, tail, depth = judged
        if min(depth) < 0:  # what fits nowhere: the least memory it needs, should nothing fit at all
            self.misfits.append(_Misfit(grid, stages.sigs, stages.by_sid, allowed, depth))
            if max(depth) < 0:
                return
        m = self.m
        if least is not None:
            self._keep_bounded(i, allowed, stages, columns, judged, grid_cut, least)
            return
        fill = judge_fill(columns, stages.sigs, depth)
        # slice_plan.latency_floor_s and score_floor_s of the plan each combination would be, against the bounds
        beyond = beyond_each(bottleneck, fill, tail, m, self.lat_cut, grid_cut) if self.bound else None
        pp, n_gpus, new = grid.pp, grid.num_gpus, tuple.__new__  # (a FrontPoint made as its class's __new__ does)
        for s, saver in enumerate(allowed):
            d = depth[s]
            if d < 0:
                continue
            if beyond is not None and beyond[s]:
                self.bounded += 1
                continue
            bucket.append(new(FrontPoint, (bottleneck[s], fill[s], tail[s], d, pp, n_gpus, grid, *saver, stages, s)))

    def _keep_bounded(self, i: int, allowed: tuple, stages: StagesCosted, columns: dict, judged, grid_cut: float,
                      least: list) -> None:
        """_keep_points' fitting combinations under bounds, with the stages' least times added up (``least``: that
        sum, or None until a combination's score floor is beyond its cut, and the stages' heads): a combination
        beyond the bounds with it in place of its own fill (under it to the last bit) is beyond with its own, so
        only the others have their fills summed (grid.fills_of), then judged as beyond_each does."""
        bottleneck, tail, depth = judged
        m = self.m
        m1, lat_cut = m - 1, self.lat_cut
        least_fill = least[0]
        live, fitting = [], 0
        for s, d in enumerate(depth):
            if d >= 0:
                fitting += 1
                bn_s, tail_s = bottleneck[s], tail[s]
                if m * bn_s + tail_s > grid_cut:  # (only then does the latency floor decide)
                    if least_fill is None:
                        least_fill = least_fill_of(columns, stages.sigs, least[1])
                    if m1 * bn_s + least_fill + tail_s > lat_cut:
                        continue
                live.append(s)
        self.bounded += fitting - len(live)
        if not live:
            return
        grid = self.index.grids[i]
        bucket = self.points[self.classes[i]]
        pp, n_gpus, new = grid.pp, grid.num_gpus, tuple.__new__  # (a FrontPoint made as its class's __new__ does)
        for s, fill_s in zip(live, fills_of(columns, stages.sigs, live)):
            bn_s, tail_s = bottleneck[s], tail[s]
            if m1 * bn_s + fill_s + tail_s > lat_cut and m * bn_s + tail_s > grid_cut:
                self.bounded += 1
                continue
            bucket.append(new(FrontPoint, (bn_s, fill_s, tail_s, depth[s], pp, n_gpus, grid, *allowed[s], stages,
                                           s)))

    def stage_times(self, point: tuple) -> tuple[tuple[float, float], ...]:
        """A FrontPoint's stages' (forward_s, backward_s), front to back: SliceCoster.fast_stage's, the numbers its
        plan's StageCosts carry (StageTable.explained_stage), as fast_rows made them beside the rows judged."""
        halves, s = point[10].halves, point[11]
        return tuple([halves[sid][s] for sid in point[10].sigs])

    def alike(self, point: tuple) -> tuple:
        """exact_front's ``alike`` of a FrontPoint: its StagesCosted and its distinct stages' (forward_s,
        backward_s), flat (the numbers stage_times reads of them)."""
        stages, s = point[10], point[11]
        halves = stages.halves
        return stages, tuple(itertools.chain.from_iterable([halves[sid][s] for sid, _ in stages.heads]))

    def least_memory(self) -> tuple | None:
        """Nothing fits: the first of the least peak memories over the misfit combinations, in the order judged,
        as (peak bytes, grid, zero, recompute, offload)."""
        best_mem = None
        for grid, sigs, by_sid, allowed, depth in self.misfits:
            rows = [by_sid[sid] for sid in sigs]
            for s, (zero, r, off) in enumerate(allowed):
                if depth is None or depth[s] < 0:
                    peak0 = peak_memory(rows, s, self.m)
                    if best_mem is None or peak0 < best_mem[0]:
                        best_mem = (peak0, grid, zero, r, off)
        return best_mem


def _stage_room(options: list[tuple[float, list[int]]], held: np.ndarray, stages_after: int,
                m: int) -> tuple[list[float], list[int], list[int], list[int]]:
    """slice_floors.least_bottlenecks_s' options from bottleneck_floors' (``options``: (seconds per layer, stage
    counts, ascending) per grid and recompute mode; ``held``: their layers_held by micro-batches in flight,
    nonincreasing) with ``stages_after`` stages behind: a stage count is taken where its front stage (the most in
    flight) holds a layer; the most such stages and what they hold (stage i + 1 from the end: min(i + 1 + D, m) in
    flight)."""
    seconds, most, room, fewest = [], [], [], []
    d = stages_after
    holding = (held >= 1).sum(axis=1).tolist()  # per option, the most in flight under which a stage holds a layer
    cum = np.concatenate([np.zeros((len(held), 1), dtype=np.int64), np.cumsum(held, axis=1)], axis=1).tolist()
    lo = min(1 + d, m)  # in flight at the last stage
    for o, (t, pps) in enumerate(options):
        k = holding[o]
        n_valid = len(pps) if m <= k else bisect.bisect_right(pps, k - d)  # min(pp + d, m) <= k
        if not n_valid:
            continue
        pp = pps[n_valid - 1]
        hi = min(pp + d, m)  # in flight at the front stage
        row = cum[o]
        seconds.append(t)
        most.append(pp)
        room.append(row[hi] - row[lo - 1] + ((pp - (hi - lo + 1)) * (row[m] - row[m - 1]) if pp + d > m else 0))
        fewest.append(pps[0])
    return seconds, most, room, fewest


def _time_floors(table: StageTable, coster: SliceCoster, fkey: tuple[int, int, int, int]) -> tuple:
    """slice_floors.time_floors (with communication) of (tp, cp, ep, dp) = ``fkey`` for the coster's slice, kept in
    the context's table by what they read (micro-batch size, layer kinds, embedding, head)."""
    tkey = (coster.q.microbatch_sequences, fkey, (tuple(coster.prefix), coster.has_embedding, coster.has_head))
    floors = table.floors.get(tkey)
    if floors is None:
        floors = table.floors[tkey] = time_floors(coster, *fkey, with_comm=True)
    return floors


def _floor_arrays(table: StageTable, index: GridIndex, coster: SliceCoster, gkey: tuple, floor_key: tuple) -> tuple:
    """slice_floors.time_floors (with communication) of every (tp, cp, ep, dp) of a grid list, for slices alike in
    what those floors read (``floor_key``: layer kinds, embedding, head): the answers, and per layer kind, for the
    embedding and for the head, the floors as arrays over GridIndex.fkeys."""
    hit = table.floor_arrays.get((gkey, floor_key))
    if hit is None:
        hits = [_time_floors(table, coster, fkey) for fkey in index.fkeys]
        kinds = {k: np.array([h[0][k] for h in hits], dtype=np.float64) for k in coster.prefix}
        hit = table.floor_arrays[gkey, floor_key] = (
            hits, kinds, np.array([h[1] for h in hits], dtype=np.float64),
            np.array([h[2] for h in hits], dtype=np.float64))
    return hit


def _memory_arrays(table: StageTable, index: GridIndex, coster: SliceCoster, gkey: tuple, saver_key: tuple,
                   saver_cache: dict, savers) -> tuple:
    """slice_floors.memory_floor_bytes of every grid of a grid list under its saver combinations, for slices alike in
    their layer kinds and in being the whole model or not (_whole): per layer kind, for the embedding and for the
    head, as arrays over the grids (0 for a grid no combination is allowed on: the search skips it anyway)."""
    key = (gkey, saver_key, tuple(coster.prefix), _whole(coster))
    hit = table.memory_floors.get(key)
    if hit is None:
        q = coster.q
        rows = []  # per GridIndex.pairs
        terms = []  # per pair, a one-kind slice's slice_floors.stage_need_terms
        (one,) = coster.prefix if len(coster.prefix) == 1 else (None,)
        for f, skey, g in index.pairs:
            allowed = saver_cache.get(skey)
            if allowed is None:
                allowed = saver_cache[skey] = tuple(savers(q, g))
            if not allowed:
                rows.append(({k: 0.0 for k in coster.prefix}, 0.0, 0.0))
                terms.append([(0.0, 0.0)])
                continue
            row, term = _pair_floors(table, coster, index.fkeys[f], allowed, one)
            rows.append(row)
            terms.append(term)
        ids = index.pair_ids
        stage = None
        if one is not None:  # (a, b) as (grids x most combinations) arrays, padded with combinations that never fit
            width = max(map(len, terms))
            a = np.full((len(terms), width), np.inf)
            b = np.zeros((len(terms), width))
            for i, row in enumerate(terms):
                a[i, :len(row)] = [x for x, _ in row]
                b[i, :len(row)] = [y for _, y in row]
            stage = (a[ids], b[ids])
        emb = np.array([r[1] for r in rows], dtype=np.float64)[ids]
        head = np.array([r[2] for r in rows], dtype=np.float64)[ids]
        hit = table.memory_floors[key] = (
            {k: np.array([r[0][k] for r in rows], dtype=np.float64)[ids] for k in coster.prefix}, emb, head, stage)
    return hit


def _whole(coster: SliceCoster) -> bool:
    """Whether the slice is the whole model: the memory floors of its stages read that (a whole model's stages may
    or may not pipeline), so their caches are keyed by it."""
    return coster.has_embedding and coster.has_head


def _pair_floors(table: StageTable, coster: SliceCoster, fkey: tuple, allowed: tuple, one: str | None) -> tuple:
    """slice_floors.memory_floor_bytes of one (tp, cp, ep, dp) under ``allowed``, and a one-kind slice's
    stage_need_terms (else None): what they read is the micro-batch size, the slice's layer kinds and these, so
    the grid lists of one micro-batch size (under different caps on stages, pipelined or not) share them; and
    whether the slice is the whole model (its stages may not pipeline: held_under_pipelining)."""
    key = ("pair", coster.q.microbatch_sequences, fkey, allowed, tuple(coster.prefix), _whole(coster))
    hit = table.memory_floors.get(key)
    if hit is None:
        states = table.state_floors
        hit = table.memory_floors[key] = (memory_floor_bytes(coster, *fkey, allowed, states=states),
                                          stage_need_terms(coster, *fkey, allowed, one, states=states)
                                          if one is not None else None)
    return hit


def _stage_misfit(parts: tuple, sizes: tuple[int, ...], m: int, room: float, edges: tuple[int, int],
                  tp: int) -> bool:
    """Whether the split's first stage (its micro-batches in flight: min(stages, m), the embedding's parameters) or
    its largest one fits under no saver combination even by slice_floors.stage_need_parts' floors: then
    judge_columns finds no combination that fits there (it judges a stage with at least that many in flight), and
    the grid is not costed. ``parts``: stage_need_parts' answer and a dict of the needs worked out so far (a grid
    list's parts meet the same stages in many queries)."""
    rows, emb_act, head_act, needs = parts
    pp = len(sizes)
    big = sizes.index(max(sizes))  # the first of the largest
    for j in (0, big) if big else (0,):
        n, k = sizes[j], min(pp - j, m)
        first, last = j == 0 and edges[0], j == pp - 1 and edges[1]
        key = (n, k, first, last)  # (a stage's least need depends on these only: the grid's rows are its parts')
        need = needs.get(key)
        if need is None:
            edge = ((edges[0] if first else 0) + (edges[1] if last else 0)) / tp
            extra = k * ((emb_act if first else 0.0) + (head_act if last else 0.0))
            need = needs[key] = min(n * (state + k * act) + edge * per_param + working
                                    for state, act, working, per_param in rows) + extra
        if need > room:
            return True
    return False


def _heaviest_floor(coster: SliceCoster, sizes: tuple[int, ...], floor: tuple) -> float:
    """The largest compute floor of the split's stages (layers per stage: ``sizes``; slice_floors.time_floors per
    layer kind, the embedding's on the slice's first stage, the head's on its last), added up as the general loop
    always did."""
    per_kind, emb_s, head_s, _total, w = floor
    if w is not None:  # one kind: a stage's floor is its layer count times the kind's (max commutes with x w >= 0)
        heaviest = sizes[0] * w + emb_s
        if len(sizes) > 1:
            tail = sizes[-1] * w + head_s
            mid = max(sizes[1:-1], default=0) * w
            return max(heaviest, mid, tail)
        return heaviest + head_s
    first, last = coster.q.layers
    prefix = coster.prefix  # kind -> layers of that kind among the slice's first i
    heaviest = 0.0
    for a, z in coster.stage_ranges(sizes):
        f = sum((pre[z - first] - pre[a - first]) * per_kind[k] for k, pre in prefix.items())
        if a == first:
            f += emb_s
        if z == last:
            f += head_s
        if f > heaviest:
            heaviest = f
    return heaviest


def _config(grid: ParallelConfig, zero: int, r: int, offload: bool) -> ParallelConfig:
    return ParallelConfig(tp=grid.tp, pp=grid.pp, dp=grid.dp, cp=grid.cp, ep=grid.ep, zero_stage=zero,
                          recompute=RECOMPUTE_MODES[r], offload=offload)
