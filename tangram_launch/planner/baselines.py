"""Baselines for ``tangram-launch plan --compare``, all under the same cost model and the same 1F1B latency formula.

* ``homogeneous``: the parallelizer over the whole cluster as one island, every GPU treated as the slowest one
  (element-wise minimum of compute, memory and bandwidths; node sizes as their greatest common divisor, the slowest
  link between any two nodes) -- what a homogeneous planner does on a heterogeneous cluster.
* ``best-island``: the best plan on a single island (the composer restricted to one island).
* ``uniform-split``: one stage group per island with layers proportional to the island's GPU count, every GPU
  counted alike (Sailor-style uniform partitioning), each slice planned by the parallelizer.
* ``one-grid``: where the runtime lets stages have their own TP and DP sizes, the same search restricted to one TP
  and one DP size for every stage (what the runtime can run without per-stage grids).
* ``ideal``: all training FLOPs over the sum of all GPUs' peak FLOP/s (a bound, not a plan).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram_launch.islands import Island, compute_tflops, least_host_memory
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.plan import Plan
from tangram_launch.planner.build import Candidates, build_plan, gpu_peak_flops, make_candidates
from tangram_launch.planner.compose import ComposeStats, Composition, compose
from tangram_launch.planner.query_pool import run_queries
from tangram_launch.planner.allocation import LinkModel, activation_bytes
from tangram_launch.planner.slices import Pair, dtype_problem
from tangram_launch.planner.grid_classes import class_members
from tangram_launch.specs.cluster import GPUSpec, LinkSpec
from tangram_launch.text import plural

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.planner.options import PlannerOptions
    from tangram_launch.planner.plan_search import SearchResult
    from tangram_launch.specs.cluster import ClusterSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Baseline:
    name: str
    description: str
    plan: Plan | None
    reason: str = ""  # why there is no plan
    iteration_time_s: float | None = None  # for bounds without a plan (ideal)

    @property
    def time_s(self) -> float | None:
        return self.plan.predicted.iteration_time_s if self.plan is not None else self.iteration_time_s

    def to_dict(self, tangram_s: float) -> dict:
        t = self.time_s
        return {"name": self.name, "description": self.description, "iteration_time_s": t,
                "speedup_of_tangram": (t / tangram_s) if t else None, "reason": self.reason or None}


def whole_cluster_island(cluster: "ClusterSpec", dtype: str) -> Island:
    """The cluster as one homogeneous island of its slowest GPU."""
    gpus = [g for _, g in cluster.iter_gpus()]
    dtypes = sorted({d for g in gpus for d in g.tflops})
    tflops = {d: (None if any(g.tflops.get(d) is None for g in gpus) else min(g.tflops[d] for g in gpus))
              for d in dtypes}
    slow = min(gpus, key=lambda g: (compute_tflops(g, dtype), g.memory_gib))
    # the slowest GPU's measured figures too: the cost model prices a profiled GPU from them, not the spec sheet
    rep = GPUSpec(type=slow.type, tflops=tflops, memory_gib=min(g.memory_gib for g in gpus),
                  memory_bandwidth_GBps=min(g.memory_bandwidth_GBps for g in gpus),
                  intra_node_bandwidth_GBps=min(g.intra_node_bandwidth_GBps for g in gpus), measured=slow.measured)
    per_node = math.gcd(*[n.num_gpus for n in cluster.nodes])
    # an 8-GPU node next to 4-GPU nodes counts as two 4-GPU nodes (so TP stays inside a real node)
    nodes = tuple(n.name for n in cluster.nodes for _ in range(n.num_gpus // per_node))
    names = cluster.node_names
    links = [cluster.link(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    link = (LinkSpec(min(lk.bandwidth_GBps for lk in links), max(lk.latency_us for lk in links))
            if links else (LinkSpec(rep.intra_node_bandwidth_GBps / 2, 0.0) if len(nodes) > 1 else None))
    return Island(name=f"all-as-{slow.type}", nodes=nodes, gpus=tuple(r for r, _ in cluster.iter_gpus()),
                  gpus_per_node=per_node, gpu=rep, inter_node_link=link,
                  host_memory=least_host_memory(cluster, range(len(cluster.nodes))))


def ideal_time_s(result: "SearchResult", cluster: "ClusterSpec") -> float:
    """All training FLOPs (causal attention, no recompute) over the sum of every GPU's peak FLOP/s."""
    tr = result.atoms.training
    model = result.atoms.model
    flops = 3.0 * model.forward_flops_per_token(tr.seq_len, causal=True) * tr.global_batch * tr.seq_len
    peak = sum(gpu_peak_flops(cluster, r.node, r.local_index, tr.dtype) for r, _ in cluster.iter_gpus())
    return flops / peak


def _plan_fixed(result: "SearchResult", cluster: "ClusterSpec", islands: tuple[Island, ...],
                pairs: list[Pair], *, name: str) -> tuple[Plan | None, str]:
    """Query exactly ``pairs`` (for every micro-batch size the planner tried) and compose the best plan of them."""
    atoms, caps, par = result.atoms, result.capabilities, result.parallelizer
    model, training = atoms.model, atoms.training
    L = model.num_layers
    bs = result.stats["microbatch_sequences_tried"]
    queries, where = [], []
    for b in bs:
        for p in pairs:
            queries.append(SliceQuery(model=model, training=training, layers=p.layers, island=islands[p.island],
                                      microbatch_sequences=b, capabilities=caps, max_stages=caps.max_stages,
                                      pipelined=p.layers != (0, L)))
            where.append((b, p))
    answers = run_queries(par, queries, max_workers=result.stats.get("workers"), progress=False)
    best: tuple[float, Candidates, Composition] | None = None
    reasons: list[str] = []
    for b in bs:
        res = {p.key: r for (bb, p), r in zip(where, answers) if bb == b}
        links = LinkModel(cluster, islands, activation_bytes(b, training.seq_len, model.hidden_size,
                                                             training.param_bytes))
        cand = make_candidates(b, L, pairs, res, islands, caps, links, training.global_batch // b,
                               dtype=training.dtype, training=training)
        for msgs in cand.infeasible.values():
            reasons.extend(m for m in msgs if m not in reasons)
        for idx in class_members(cand.groups).values():
            sub = [cand.options[i] for i in idx]
            comp = compose(sub, cand.link_matrix, L, cand.num_microbatches, max_stages=caps.max_stages,
                           stats=ComposeStats())
            if comp is not None and (best is None or comp.latency_s < best[0]):
                best = (comp.latency_s, cand, Composition(tuple(idx[i] for i in comp.options), comp.metrics,
                                                         comp.bound_s))
    if best is None:
        return None, (reasons[0] if reasons else f"{name}: no configuration fits")
    _, cand, comp = best
    plan = build_plan(cand, comp, cluster=cluster, model=model, training=training, runtime=caps.name,
                      planner={"parallelizer": result.stats["parallelizer"], "baseline": name, "b": cand.b})
    return plan, ""


def homogeneous(result: "SearchResult", cluster: "ClusterSpec") -> Baseline:
    training = result.atoms.training
    isl = whole_cluster_island(cluster, training.dtype)
    desc = f"{result.stats['parallelizer']} over all {isl.num_gpus} GPUs as {isl.gpu.type}"
    problem = dtype_problem(isl, training.dtype)
    if problem:
        return Baseline("homogeneous", desc, None, problem)
    L = result.atoms.num_layers
    kinds = result.atoms.kinds
    pair = Pair((0, L), 0, (isl.name, L, kinds, True, True))
    plan, why = _plan_fixed(result, cluster, (isl,), [pair], name="homogeneous")
    return Baseline("homogeneous", desc, plan, why)


def best_island(result: "SearchResult", cluster: "ClusterSpec") -> Baseline:
    """The whole model on the one island that runs it fastest. Queried here, not read from the search's answers:
    the search bounds its queries by the best plan so far, so it may not have costed the single-island plans."""
    a = result.atoms
    L = a.num_layers
    best: tuple[float, Island, Plan] | None = None
    for isl in result.usable:
        pair = Pair((0, L), 0, (isl.name, L, a.kinds, True, True))
        plan, _why = _plan_fixed(result, cluster, (isl,), [pair], name="best-island")
        if plan is not None and (best is None or plan.predicted.iteration_time_s < best[0]):
            best = (plan.predicted.iteration_time_s, isl, plan)
    if best is None:
        return Baseline("best-island", "the best single island", None, "no single island holds the model")
    _, isl, plan = best
    return Baseline("best-island", f"best single island ({isl.name}, {isl.num_gpus} GPUs)", plan)


def uniform_split(result: "SearchResult", cluster: "ClusterSpec") -> Baseline:
    islands = tuple(result.usable)
    a = result.atoms
    L = a.num_layers
    total = sum(i.num_gpus for i in islands)
    desc = f"layers split by GPU count over {plural(len(islands), 'island')}, {total} GPUs (Sailor-style)"
    if L < len(islands):
        return Baseline("uniform-split", desc, None, f"{L} layers cannot be split over {len(islands)} islands")
    exact = [L * i.num_gpus / total for i in islands]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) < L:  # largest remainders first
        k = max(range(len(islands)), key=lambda j: exact[j] - counts[j])
        counts[k] += 1
    while sum(counts) > L:
        k = max((j for j in range(len(islands)) if counts[j] > 1), key=lambda j: counts[j] - exact[j])
        counts[k] -= 1
    pairs, start = [], 0
    for k, (isl, n) in enumerate(zip(islands, counts)):
        stop = start + n
        pairs.append(Pair((start, stop), k, (isl.name, n, a.kinds[start:stop], start == 0, stop == L)))
        start = stop
    desc += " [" + ", ".join(f"{i.name}: {n}" for i, n in zip(islands, counts)) + "]"
    plan, why = _plan_fixed(result, cluster, islands, pairs, name="uniform-split")
    return Baseline("uniform-split", desc, plan, why)


def one_grid(result: "SearchResult", cluster: "ClusterSpec", options: "PlannerOptions | None" = None
             ) -> Baseline | None:
    """The search again with one TP and one DP size for all stages; None where the runtime needs that anyway."""
    import dataclasses

    from tangram_launch.errors import InfeasibleError
    from tangram_launch.planner.plan_search import search

    caps = result.capabilities
    if caps.uniform_grid or (caps.uniform_tp and caps.uniform_dp):
        return None
    one = dataclasses.replace(caps, uniform_tp=True, uniform_dp=True)
    desc = "the same search with one TP and one DP size for every stage"
    a = result.atoms
    try:
        found = search(cluster, a.model, a.training, runtime=one, parallelizer=result.parallelizer,
                       islands=result.islands, options=options)
    except InfeasibleError as exc:
        return Baseline("one-grid", desc, None, "; ".join(exc.reasons[:2]) or str(exc))
    grids = sorted({(s.tp, s.dp) for s in found.plan.stages})
    return Baseline("one-grid", f"{desc} (tp, dp) = {grids[0]}", found.plan)


def compare(result: "SearchResult", cluster: "ClusterSpec", *, options: "PlannerOptions | None" = None
            ) -> list[Baseline]:
    """Every baseline, then the ideal bound."""
    out = [homogeneous(result, cluster), best_island(result, cluster), uniform_split(result, cluster)]
    grid = one_grid(result, cluster, options)
    if grid is not None:
        out.append(grid)
    out.append(Baseline("ideal", "all FLOPs / sum of all GPUs' peak FLOP/s (a bound)", None,
                        iteration_time_s=ideal_time_s(result, cluster)))
    return out
