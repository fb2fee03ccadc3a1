"""User-written plans, validated and costed by the planner's own code path (``tangram-launch plan --plan FILE``).

A manual plan names the stages; everything it leaves out is filled in by the parallelizer (the fastest
configuration of that stage's layers on that island that fits at the stage's pipeline position)::

    # my-plan.yaml
    microbatch_sequences: 4          # optional: sequences per micro-batch (b); default: the best the planner tries
    stages:
      - layers: [0, 24]              # [start, stop) over transformer layers, contiguous from 0 to the last layer
        island: a100-80gb            # an island name from `tangram-launch islands`
        tp: 4                        # optional: tp, dp, cp, ep, zero_stage, recompute, offload, micro_batch_size,
      - layers: [24, 40]             #           num_gpus
        island: v100-32gb

Several stages may share an island where its GPUs suffice, in pipeline order on its nodes (the search's plans that
split an island in two place its parts apart in the pipeline where that is faster). A stage that gives any of tp, dp,
cp and no num_gpus runs on tp x dp x cp GPUs (those left out count 1); without any, it takes its share of the
island. Each stage is costed as a one-stage slice plan (the parallelizer's answer filtered by the fields given; if
the exact configuration is not among its answers, the cost model prices it directly: any grid the runtime runs,
such as dp 2 on two GPUs of a three-GPU node, which the search itself leaves out), and a stage that cannot run is
refused naming its fields and why. Consecutive stages on one island with one configuration are one slice, as the
search plans them: their p2p in the stages' times, a link only between slices. Then stages, GPUs, p2p and the
iteration time go through the same ``build_plan`` and latency formula as Tangram's plans, so the two compare like
for like.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import yaml

from tangram_launch.capabilities import DEFAULT_RUNTIME
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.islands import IslandSet, build_islands
from tangram_launch.parallelizers.base import GIB, SlicePlan, SliceQuery, SliceResult, StageCost, capacity_bytes
from tangram_launch.plan import RECOMPUTE_MODES, Plan
from tangram_launch.planner.options import PlannerOptions
from tangram_launch.planner.resolve import resolve_capabilities, resolve_parallelizer
from tangram_launch.planner.size_search import candidate_sizes
from tangram_launch.planner.build import Candidates, build_plan
from tangram_launch.planner.compose import Composition, Option, evaluate
from tangram_launch.planner.query_pool import run_queries
from tangram_launch.planner.allocation import LinkModel, activation_bytes, allocate_gpus
from tangram_launch.planner.slices import Pair
from tangram_launch.planner.grid_classes import compatibility_group
from tangram_launch.specs.yamlio import check_keys, closest, load_yaml_file

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.parallelizers.base import Parallelizer
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)

_CONFIG_KEYS = ("tp", "dp", "cp", "ep", "zero_stage", "recompute", "offload", "micro_batch_size", "num_gpus")
_STAGE_KEYS = ("layers", "island") + _CONFIG_KEYS


@dataclass(frozen=True)
class ManualStage:
    layers: tuple[int, int]
    island: str
    fixed: Mapping[str, Any]  # the configuration fields the user gave
    num_gpus: int | None = None  # given, or implied by tp x dp x cp (_implied_gpus); None: left to the planner


@dataclass(frozen=True)
class ManualPlan:
    stages: tuple[ManualStage, ...]
    microbatch_sequences: int | None = None
    source: str | None = None


def parse_manual_plan(data: Mapping, *, num_layers: int, island_names: Sequence[str],
                      source: str | None = None) -> ManualPlan:
    """Validate a manual plan's structure; errors name the field (``stages[1].layers``) and what is valid."""
    check_keys(data, ("stages", "microbatch_sequences"), where="", source=source)
    raw = data.get("stages")
    if not isinstance(raw, list) or not raw:
        raise SpecError("a manual plan needs a non-empty list of stages", source=source, field="stages", value=raw)
    b = data.get("microbatch_sequences")
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise SpecError("must be a positive integer", source=source, field="microbatch_sequences", value=b)
    stages = []
    expect = 0
    for i, st in enumerate(raw):
        where = f"stages[{i}]"
        if not isinstance(st, Mapping):
            raise SpecError("expected a mapping", source=source, field=where, value=st)
        check_keys(st, _STAGE_KEYS, where=where, source=source)
        for key in ("layers", "island"):
            if key not in st:
                raise SpecError("missing required field", source=source, field=f"{where}.{key}")
        layers = st["layers"]
        if (not isinstance(layers, (list, tuple)) or len(layers) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
            raise SpecError("expected [start, stop)", source=source, field=f"{where}.layers", value=layers,
                            valid=f"two integers, e.g. [{expect}, {num_layers}]")
        start, stop = int(layers[0]), int(layers[1])
        if start != expect:
            raise SpecError(f"stages must cover the layers contiguously: this stage should start at {expect}",
                            source=source, field=f"{where}.layers", value=list(layers))
        if not start < stop <= num_layers:
            raise SpecError(f"stop must be in ({start}, {num_layers}]", source=source, field=f"{where}.layers",
                            value=list(layers))
        expect = stop
        island = str(st["island"])
        if island not in island_names:
            hint = closest(island, island_names)
            raise SpecError("unknown island", source=source, field=f"{where}.island", value=island,
                            valid=(f"did you mean '{hint}'? " if hint else "") + ", ".join(island_names))
        fixed = {k: st[k] for k in _CONFIG_KEYS if k in st}
        for k, v in fixed.items():
            if k == "recompute":
                if v not in RECOMPUTE_MODES:
                    raise SpecError("unknown recompute mode", source=source, field=f"{where}.recompute", value=v,
                                    valid=", ".join(RECOMPUTE_MODES))
            elif k == "offload":
                if not isinstance(v, bool):
                    raise SpecError("expected true or false", source=source, field=f"{where}.offload", value=v)
            elif k == "zero_stage":
                if isinstance(v, bool) or not isinstance(v, int) or v not in (0, 1, 2, 3):  # 1.0 is not a stage
                    raise SpecError("unknown ZeRO stage", source=source, field=f"{where}.zero_stage", value=v,
                                    valid="0, 1, 2, 3")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError("must be a positive integer", source=source, field=f"{where}.{k}", value=v)
        stages.append(ManualStage((start, stop), island, fixed, _implied_gpus(fixed, where=where, source=source)))
    if expect != num_layers:
        raise SpecError(f"stages cover layers [0, {expect}) but the model has {num_layers}", source=source,
                        field=f"stages[{len(raw) - 1}].layers", value=expect, valid=str(num_layers))
    return ManualPlan(tuple(stages), b, source)


def _implied_gpus(fixed: Mapping[str, Any], *, where: str, source: str | None) -> int | None:
    """The stage's GPUs: num_gpus where given, else tp x dp x cp where any of them is given (those left out count
    1), else None. A num_gpus that is not a multiple of the grid given is refused."""
    grid = [k for k in ("tp", "dp", "cp") if k in fixed]
    n = math.prod(fixed.get(k, 1) for k in ("tp", "dp", "cp"))
    if "num_gpus" not in fixed:
        return n if grid else None
    if grid and fixed["num_gpus"] % n:
        given = " x ".join(f"{k}={fixed[k]}" for k in grid)
        raise SpecError(f"must be a multiple of {given} = {n} GPUs", source=source, field=f"{where}.num_gpus",
                        value=fixed["num_gpus"], valid=f"{n}, or leave num_gpus out")
    return fixed["num_gpus"]


def load_manual_plan(path: str | os.PathLike, *, num_layers: int, island_names: Sequence[str]) -> ManualPlan:
    path = os.fspath(path)
    return parse_manual_plan(load_yaml_file(path), num_layers=num_layers, island_names=island_names, source=path)


def written_form(plan: Plan) -> dict[str, Any]:
    """A plan's layout in the hand-written format, every field given (``plan --stages-out``): what a user edits,
    and what ``--plan`` prices as the plan was priced (an interleaved plan's stages hold their plain share of layers;
    the schedule is chosen as the search chose it, by ``--schedule``)."""
    first = plan.stages[0]  # sequences per micro-batch: every stage's micro_batch_size x dp
    return {"microbatch_sequences": first.micro_batch_size * first.dp,
            "stages": [{"layers": list(st.layers), "island": st.island, **{k: getattr(st, k) for k in _CONFIG_KEYS}}
                       for st in plan.stages]}


def written_yaml(plan: Plan) -> str:
    """written_form as the README writes a hand-written plan: one line per stage."""
    form = written_form(plan)
    lines = ["# the plan's stages as a hand-written plan (tangram-launch plan --plan FILE costs it; edit any field)"]
    if plan.schedule != "1F1B":
        lines.append(f"# planned as {plan.schedule}, {plan.virtual_stages} model chunks per stage: cost it with "
                     f"--schedule auto or {plan.schedule}")
    lines += [f"microbatch_sequences: {form['microbatch_sequences']}", "stages:"]
    lines += ["  - " + yaml.safe_dump(st, sort_keys=False, default_flow_style=True, width=10_000).strip()
              for st in form["stages"]]
    return "\n".join(lines) + "\n"


def _matches(st: StageCost, fixed: Mapping[str, Any]) -> bool:
    sh = st.shape
    have = {"tp": sh.tp, "dp": sh.dp, "cp": sh.cp, "ep": sh.ep, "zero_stage": sh.zero_stage,
            "recompute": sh.recompute, "offload": sh.offload, "micro_batch_size": st.micro_batch_size,
            "num_gpus": st.num_gpus}
    return all(have[k] == v for k, v in fixed.items())


def _describe(st: StageCost) -> str:
    sh = st.shape
    return (f"tp={sh.tp} dp={sh.dp} cp={sh.cp} ep={sh.ep} zero_stage={sh.zero_stage} recompute={sh.recompute} "
            f"micro_batch_size={st.micro_batch_size}")


def _exact_config(q: SliceQuery, fixed: Mapping[str, Any]):
    """The one configuration ``fixed`` names at this query's micro-batch, or None where it leaves a grid size to the
    parallelizer: dp from dp, micro_batch_size or num_gpus / (tp x cp); tp from tp or num_gpus / (dp x cp)."""
    from tangram_launch.costmodel.breakdown import ParallelConfig  # floor 2: the shared cost model

    b, cp, n = q.microbatch_sequences, fixed.get("cp", 1), fixed.get("num_gpus")
    dp, tp = fixed.get("dp"), fixed.get("tp")
    if dp is None and "micro_batch_size" in fixed and b % fixed["micro_batch_size"] == 0:
        dp = b // fixed["micro_batch_size"]
    if dp is None and tp is not None and n is not None and n % (tp * cp) == 0:
        dp = n // (tp * cp)
    if tp is None and dp is not None:
        tp = n // (dp * cp) if n is not None and n % (dp * cp) == 0 else 1
    if dp is None or tp is None:
        return None
    return ParallelConfig(tp=tp, pp=1, dp=dp, cp=cp, ep=fixed.get("ep", 1), zero_stage=fixed.get("zero_stage", 0),
                          recompute=fixed.get("recompute", "none"), offload=fixed.get("offload", False))


def _exact(q: SliceQuery, fixed: Mapping[str, Any], parallelizer: "Parallelizer") -> tuple[SlicePlan | None, list[str]]:
    """Price the user's exact configuration with the cost model when the parallelizer's answer lacks it (the
    planner's search offers only grids that tile nodes; a hand-written stage may take any the runtime runs).
    Returns the plan, or None and why the configuration cannot run (empty where ``fixed`` names none)."""
    cfg = _exact_config(q, fixed)
    if cfg is None:
        return None, []
    from tangram_launch.costmodel.breakdown import SliceCoster  # floor 2: the shared cost model
    from tangram_launch.costmodel.host_memory import stage_host_problems

    coster = SliceCoster(q, flash_attention=getattr(parallelizer, "flash_attention", None))
    problems = coster.check(cfg, search_space=False)  # a hand-written stage may take any GPUs (dp 2 of 3 on a node)
    if problems:
        return None, problems
    sums = coster.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)
    plan = coster.materialize(cfg, sums, parallelizer=getattr(parallelizer, "name", ""))
    mismatch = [f"{k}={v}" for k, v in fixed.items() if not _matches(plan.stages[0], {k: v})]
    if mismatch:
        return None, [f"{', '.join(mismatch)} does not match tp={cfg.tp} dp={cfg.dp} cp={cfg.cp}"]
    # the search drops an offload its node's host memory cannot hold; priced here, it is refused for that reason
    host = stage_host_problems(plan.stages, q.island.host_memory)
    if host:
        return None, host
    return plan, []


@dataclass(frozen=True)
class _Manual:
    """What costing one manual plan reads at every size: the plan, its islands, the specs and the runtime."""

    manual: ManualPlan
    isl_of: tuple  # per stage, its Island
    cluster: "ClusterSpec"
    model: "ModelSpec"
    training: "TrainingSpec"
    caps: "RuntimeCapabilities"
    parallelizer: "Parallelizer"
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.manual.stages)

    def budget(self, k: int) -> int:
        """The GPUs stage k may take: its own (given or implied), else an even split of its island among the stages
        that share it."""
        st = self.manual.stages[k]
        share = sum(1 for x in self.manual.stages if x.island == st.island)
        return st.num_gpus or self.isl_of[k].num_gpus // share


class _ManualBest(NamedTuple):
    score_s: float  # what the Plan reports (Candidates.schedule_choice)
    candidates: Candidates
    composition: Composition


def cost_manual_plan(manual: ManualPlan, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
                     runtime: "str | RuntimeCapabilities" = DEFAULT_RUNTIME,
                     parallelizer: "str | Parallelizer" = "megatron", islands: IslandSet | None = None,
                     options: PlannerOptions | None = None) -> Plan:
    """The Plan for a manual layout, costed like Tangram's; InfeasibleError names the stage that does not fit."""
    opts = options or PlannerOptions()
    caps = resolve_capabilities(runtime).for_model(model.num_experts)
    par = resolve_parallelizer(parallelizer, opts.gpu_counts)
    iset = islands or build_islands(cluster, dtype=training.dtype)
    G = training.global_batch
    src = manual.source
    if manual.microbatch_sequences is not None:
        if G % manual.microbatch_sequences:
            raise SpecError(f"must divide the global batch {G}", source=src, field="microbatch_sequences",
                            value=manual.microbatch_sequences)
        bs: tuple[int, ...] = (manual.microbatch_sequences,)
    else:
        bs = candidate_sizes(G, opts.microbatch_sequences)
    ctx = _Manual(manual, tuple(iset.by_name(st.island) for st in manual.stages), cluster, model, training, caps,
                  par, opts.schedule)
    S = ctx.num_stages
    queries = [SliceQuery(model=model, training=training, layers=st.layers, island=isl, microbatch_sequences=b,
                          capabilities=caps, max_stages=1, pipelined=S > 1)
               for b in bs for st, isl in zip(manual.stages, ctx.isl_of)]
    answers = run_queries(par, queries, max_workers=opts.max_workers, progress=opts.progress, label="manual plan")
    best: _ManualBest | None = None
    problems: list[str] = []
    for bi, b in enumerate(bs):
        per_stage: list[list[StageCost]] = []
        for k in range(S):
            fits = _stage_fits(ctx, k, queries[bi * S + k], answers[bi * S + k], G // b)
            if isinstance(fits, str):
                problems.append(fits)
                break
            per_stage.append(fits)
        if len(per_stage) == S:
            best = _best_in_classes(ctx, b, G // b, per_stage, best, problems)
    if best is None:
        raise InfeasibleError(f"the manual plan {src or ''} cannot run".replace("  ", " "), problems)
    cand = best.candidates
    return build_plan(cand, best.composition, cluster=cluster, model=model, training=training, runtime=caps.name,
                      planner={"parallelizer": getattr(par, "name", ""), "manual": src or True, "b": cand.b,
                               "microbatch_sequences_tried": list(bs)}, schedule=opts.schedule)


def _stage_fits(ctx: _Manual, k: int, q: SliceQuery, res: SliceResult, m: int) -> list[StageCost] | str:
    """Stage k's configurations at q's micro-batch size that match its fields, run under the runtime and fit at its
    pipeline position: the parallelizer's, else the exact one its fields name, priced by the cost model; or why
    there are none (naming the stage and its fields)."""
    st, isl, caps, S = ctx.manual.stages[k], ctx.isl_of[k], ctx.caps, ctx.num_stages
    b, budget = q.microbatch_sequences, ctx.budget(k)
    cands = [p.stages[0] for p in res.plans if len(p.stages) == 1
             and p.stages[0].micro_batch_size * p.stages[0].shape.dp == b and _matches(p.stages[0], st.fixed)
             and p.stages[0].num_gpus <= budget and st.num_gpus in (None, p.stages[0].num_gpus)
             and not caps.stage_problems(p.stages[0].shape, pipelined=S > 1)]
    why: list[str] = []
    if not cands and st.fixed:
        exact, why = _exact(q, st.fixed, ctx.parallelizer)
        if exact is not None and exact.stages[0].num_gpus > budget:
            why = [f"num_gpus={exact.stages[0].num_gpus}: the stage may take {budget} of {st.island}'s "
                   f"{isl.num_gpus} GPUs"]
        elif exact is not None:
            why = caps.stage_problems(exact.stages[0].shape, pipelined=S > 1)
            cands = [] if why else [exact.stages[0]]
    where = f"stages[{k}] (layers {st.layers[0]}-{st.layers[1]} on {st.island}, b={b})"
    if not cands:
        offered = sorted({_describe(p.stages[0]) for p in res.plans if len(p.stages) == 1})
        if why:
            return f"{where} {dict(st.fixed)}: " + "; ".join(why)
        if res.infeasible is not None and not res.plans:
            return f"{where}: {res.infeasible.message()}"
        return (f"{where}: no configuration with {dict(st.fixed)} on at most {budget} GPUs that {caps.name} can run"
                + (f"; the parallelizer offers: {'; '.join(offered[:4])}" if offered else ""))
    cap = capacity_bytes(isl, ctx.training)
    fits = [c for c in cands if c.memory_bytes(S - 1 - k, m) <= cap]
    if not fits:
        c = min(cands, key=lambda c: c.memory_bytes(S - 1 - k, m))
        return (f"{where}: needs {c.memory_bytes(S - 1 - k, m) / GIB:.1f} GiB per GPU at pipeline position {k} of "
                f"{S} ({_describe(c)}) > {cap / GIB:.1f} GiB")
    return fits


def _best_in_classes(ctx: _Manual, b: int, m: int, per_stage: Sequence[Sequence[StageCost]],
                     best: _ManualBest | None, problems: list[str]) -> _ManualBest | None:
    """The runtime's cross-stage constraints: per compatibility class, every stage's fastest configuration in it,
    as one pipeline scored as the search scores; the better of ``best`` and those. Appends why a class cannot
    run to ``problems``."""
    caps, S = ctx.caps, ctx.num_stages
    classes = {compatibility_group((c.shape,), caps) for fits in per_stage for c in fits}
    for cls in classes:
        chosen = []
        for fits in per_stage:
            mine = [c for c in fits if compatibility_group((c.shape,), caps) == cls]
            if not mine:
                break
            # a stage's own share of the iteration: m micro-batches, then its DP sync and optimizer step (an
            # offloaded optimizer saves little per micro-batch and costs seconds per iteration)
            chosen.append(min(mine, key=lambda c: (m * c.time_s + c.dp_sync_s + c.optimizer_s, c.time_s)))
        if len(chosen) < S:
            continue
        cand = _manual_candidates(ctx, b, m, chosen)
        if isinstance(cand, str):
            problems.append(cand)
            continue
        seq = tuple(range(len(cand.options)))
        metrics = evaluate(seq, cand.options, cand.link_matrix, m)
        if metrics is None:  # a run priced as one slice holds what its stages alone did: no stage grew
            problems.append(f"b={b}: the stages do not fit at their pipeline positions")
            continue
        # ranked as the search ranks: by what the Plan reports (the simulated 1F1B, or interleaved where the
        # runtime runs it and it is faster)
        score = cand.schedule_choice(seq, metrics, schedule=ctx.schedule, capabilities=caps).latency_s
        if best is None or score < best.score_s:
            best = _ManualBest(score, cand, Composition(seq, metrics, metrics.period_s, score))
    if best is None and len(classes) > 1 and not any(p.startswith(f"b={b}") for p in problems):
        problems.append(f"b={b}: the stages' configurations cannot share one {caps.name} pipeline "
                        f"(cross-stage constraints: one grid/TP/DP size)")
    return best


def _one_slice(isl_of: Sequence, chosen: Sequence[StageCost], k: int) -> bool:
    """Whether stages k and k + 1 are what the search plans as one slice (one island, one grid and memory savers,
    one micro-batch size): priced as one (_run_slice), their p2p lies in the sender's forward and the receiver's
    backward and a tied embedding's sync goes between their own GPUs, as a slice plan's stage times hold them
    (costmodel/breakdown.py), not on a link between options. The same stages priced either way would make one plan
    two predictions, a hand-written one and the search's."""
    a, z = chosen[k], chosen[k + 1]
    return (isl_of[k].name == isl_of[k + 1].name and a.shape == z.shape
            and a.micro_batch_size == z.micro_batch_size)


def _run_slice(ctx: _Manual, b: int, run: Sequence[int], chosen: Sequence[StageCost]) -> SlicePlan:
    """A run of consecutive stages of one configuration on one island, costed as the search costs a slice plan of
    them: the cost model's stages of that grid at the run's own layer split."""
    from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster  # floor 2: the shared cost model

    stages = [ctx.manual.stages[k] for k in run]
    isl, sh = ctx.isl_of[run[0]], chosen[run[0]].shape
    q = SliceQuery(model=ctx.model, training=ctx.training, layers=(stages[0].layers[0], stages[-1].layers[1]),
                   island=isl, microbatch_sequences=b, capabilities=ctx.caps, max_stages=len(run),
                   pipelined=ctx.num_stages > 1)
    coster = SliceCoster(q, flash_attention=getattr(ctx.parallelizer, "flash_attention", None))
    cfg = ParallelConfig(tp=sh.tp, pp=len(run), dp=sh.dp, cp=sh.cp, ep=sh.ep, zero_stage=sh.zero_stage,
                         recompute=sh.recompute, offload=sh.offload)
    sums = coster.stage_sums(sh.tp, len(run), sh.dp, sh.cp, sh.ep,
                             sizes=[st.layers[1] - st.layers[0] for st in stages])
    return coster.materialize(cfg, sums, parallelizer=getattr(ctx.parallelizer, "name", ""))


def _manual_candidates(ctx: _Manual, b: int, m: int, chosen: Sequence[StageCost]) -> Candidates | str:
    """One option per run of consecutive stages the search would plan as one slice (_one_slice, _run_slice), each
    with its own slot in the link matrix (options may share an island), the p2p between options priced from the
    GPUs their stages get, as the search prices them."""
    manual, isl_of, caps, training = ctx.manual, ctx.isl_of, ctx.caps, ctx.training
    S = len(chosen)
    shapes = [c.shape for c in chosen]
    problems = caps.pipeline_problems(shapes)
    if problems:
        return f"b={b}: " + "; ".join(problems)
    links = LinkModel(ctx.cluster, list(isl_of), activation_bytes(b, training.seq_len, ctx.model.hidden_size,
                                                                   training.param_bytes))
    taken: dict[str, set] = {}
    gpus = []
    for k, (isl, c) in enumerate(zip(isl_of, chosen)):
        g = allocate_gpus(isl, [c.shape], taken=taken.setdefault(isl.name, set()))
        if g is None:
            used = sum(chosen[j].num_gpus for j in range(k + 1) if isl_of[j].name == isl.name)
            return (f"stages[{k}]: island {isl.name} has {isl.num_gpus} GPUs ({isl.gpus_per_node} per node); its "
                    f"stages up to here need {used} (tp={c.shape.tp} groups must fit inside a node)")
        gpus.append(g[0])
    runs = [[0]]  # the options: runs of stage indices
    boundaries = []  # the p2p between consecutive options
    for k in range(S - 1):
        if _one_slice(isl_of, chosen, k):
            runs[-1].append(k + 1)
        else:
            boundaries.append(links.stage_s(shapes[k], gpus[k], shapes[k + 1], gpus[k + 1]))
            runs.append([k + 1])
    matrix = [[0.0] * len(runs) for _ in runs]
    for n, p2p_s in enumerate(boundaries):
        matrix[n][n + 1] = matrix[n + 1][n] = p2p_s
    cand = Candidates(b=b, num_microbatches=m, islands=tuple(isl_of[run[0]] for run in runs), links=links,
                      link_matrix=tuple(tuple(r) for r in matrix))
    for n, run in enumerate(runs):
        isl = isl_of[run[0]]
        plan = (SlicePlan(isl.name, manual.stages[run[0]].layers, (chosen[run[0]],)) if len(run) == 1
                else _run_slice(ctx, b, run, chosen))
        stages = plan.stages
        cand.options.append(Option(plan.layers[0], plan.layers[1], n, len(stages),
                                   plan.max_stages_after(m, capacity_bytes(isl, training)),
                                   sum(st.time_s for st in stages), max(st.time_s for st in stages),
                                   max(st.dp_sync_s + st.optimizer_s for st in stages)))
        cand.sources.append((Pair(plan.layers, n, (isl.name,)), plan))
        cand.groups.append(None)
    return cand
