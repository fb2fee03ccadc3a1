"""From parallelizer answers to composer options, and from a composition to the frozen Plan.

``make_candidates`` turns every surviving pair's slice plans (reused across a redundancy class by shifting layer
indices) into ``compose.Option`` tuples, dropping plans the runtime cannot run, plans whose micro-batch arithmetic
is inconsistent, and plans whose stages do not fit the island's nodes (``grid_classes.judge_templates``, from the
plans' numbers: lazy plans stay unbuilt). ``build_plan`` turns the chosen options back
into stages with GPUs (layout.allocate_gpus), the rank layout (plan.py derives it), and predictions computed by the
same numbers the composer's driver ranked it by (``Candidates.schedule_choice``).
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Mapping, Sequence

import numpy as np

from tangram_launch.costmodel.measured_layers import sequence_factor
from tangram_launch.costmodel.pipeline import pipeline_latency_s, simulated_1f1b_s, stage_memory_bytes
from tangram_launch.costmodel.wake import charge_wake_ups, wake_up_s, wake_up_wait_s
from tangram_launch.islands import compute_tflops
from tangram_launch.parallelizers.base import GIB, SlicePlan, SliceResult, StageCost, capacity_bytes
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction, interleaved_chunks
from tangram_launch.planner.compose import Composition, Metrics, Option, evaluate
from tangram_launch.planner import grid_classes as grid_classes_mod
from tangram_launch.planner.allocation import LinkModel, allocate_gpus
from tangram_launch.planner.interleave import ScheduleChoice, choose_virtual_stages
from tangram_launch.planner.slices import Pair
from tangram_launch.specs.cluster import math_mode

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.islands import Island
    from tangram_launch.specs.cluster import ClusterSpec, GpuRef
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)


class AnswerTemplates(list):
    """One answer's templates, in order: per template (its Option fields after (start, stop, island), its plan,
    its class, its edge times). The same object for every pair of the answer, and in every round at one size b
    until the answer changes (make_candidates' memo); ``key`` is the answer's (Pair.key), which caches of what is
    derived from the templates are keyed by (with an identity check: a changed answer has a new list)."""

    def __init__(self, key: tuple, items) -> None:
        super().__init__(items)
        self.key = key


class OptionSources(SequenceABC):
    """option index -> (its pair, its unshifted slice plan), read from the parts a size's options are made of
    (make_candidates: a pair's options are its answer's templates in order), not kept per option: at thousands of
    GPUs that would be millions of tuples. Options added one by one (manual.py) come after the parts."""

    def __init__(self) -> None:
        self._pairs: list[Pair] = []
        self._temps: list[AnswerTemplates] = []  # per part, its templates: (fields, plan, class, edges)
        self._ends: list[int] = []  # per part, the index after its last option
        self._extra: list[tuple[Pair, SlicePlan]] = []
        # (ends, starts, each part's templates list's number) as int arrays, and the distinct lists by number: made
        # by plan_slots on first use
        self._slots: tuple | None = None

    def add_part(self, pair: Pair, temps: list) -> None:
        assert not self._extra, "parts come before options added one by one"
        if not isinstance(temps, AnswerTemplates):  # a list of no answer: a part of its own
            temps = AnswerTemplates(("part", len(self._temps)), temps)
        self._pairs.append(pair)
        self._temps.append(temps)
        self._ends.append((self._ends[-1] if self._ends else 0) + len(temps))
        self._slots = None

    def plan_slots(self, idx: Sequence[int]) -> np.ndarray | None:
        """Per option of ``idx``, (its templates list's number, its place in it) as an (n, 2) int array: options
        of pairs that share an answer share their plans, so a caller compares each distinct slot once (plan_at).
        None where an option was added one by one."""
        n = self._ends[-1] if self._ends else 0
        at = np.asarray(idx, dtype=np.int64)
        if at.size and (at.min() < 0 or at.max() >= n):
            return None
        if self._slots is None:
            number: dict[tuple, int] = {}  # an answer's key -> its templates list's number
            for temps in self._temps:
                number.setdefault(temps.key, len(number))
            ends = np.array(self._ends, dtype=np.int64)
            self._slots = (ends, ends - np.array([len(t) for t in self._temps], dtype=np.int64),
                           np.array([number[t.key] for t in self._temps], dtype=np.int64),
                           list({t.key: t for t in self._temps}.values()))
        ends, starts, numbers, _distinct = self._slots
        part = np.searchsorted(ends, at, side="right")
        return np.stack([numbers[part], at - starts[part]], axis=1)

    def plan_at(self, number: int, place: int) -> SlicePlan:
        """The unshifted slice plan at a slot plan_slots gave."""
        return self._slots[3][number][place][1]

    def append(self, source: tuple[Pair, SlicePlan]) -> None:
        self._extra.append(source)

    def __len__(self) -> int:
        return (self._ends[-1] if self._ends else 0) + len(self._extra)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = self._ends[-1] if self._ends else 0
        if i < 0:
            i += len(self)
        if not 0 <= i < n + len(self._extra):
            raise IndexError(i)
        if i >= n:
            return self._extra[i - n]
        p = bisect.bisect_right(self._ends, i)
        return self._pairs[p], self._temps[p][i - (self._ends[p - 1] if p else 0)][1]


@dataclass
class Candidates:
    """The composer's input for one micro-batch size b, and the way back from an option to its slice plan."""

    b: int  # sequences per micro-batch (micro_batch_size * dp of every stage)
    num_microbatches: int
    islands: tuple["Island", ...]
    links: LinkModel
    link_matrix: tuple[tuple[float, ...], ...]  # [a][b]: one-way p2p seconds per micro-batch, island a -> b
    options: list[Option] = field(default_factory=list)
    sources: OptionSources = field(default_factory=OptionSources)  # option -> (pair, unshifted slice plan)
    groups: list[Hashable] = field(default_factory=list)  # option -> compatibility class (uniform-grid runtimes)
    # option -> its first and its last stage's forward + backward seconds (compose's edge_s); empty: not known
    edges: list[tuple[float, float]] = field(default_factory=list)
    training_dtype: str = "bf16"
    training: "TrainingSpec | None" = None  # memory headroom for the interleaving choice (schedule_choice)
    infeasible: dict[str, list[str]] = field(default_factory=dict)  # island -> parallelizer's reasons
    dropped: dict[str, int] = field(default_factory=dict)  # why slice plans were not offered: reason -> count
    bounded: dict[str, int] = field(default_factory=dict)  # island -> configurations that could not beat the bound
    # per pair with options, in their order: (island, its length in layers, the templates of its answer, whose
    # Option fields after (start, stop, island) and classes its options take in their order: the list
    # make_candidates' memo keeps, the same object for every pair of the answer, in every round at b until the
    # answer changes)
    parts: list[tuple[int, int, AnswerTemplates]] = field(default_factory=list)
    part_starts: list[int] = field(default_factory=list)  # per part, its pair's first layer
    _gpus: dict = field(default_factory=dict, repr=False)  # option -> its stages' GPUs (stage_gpus)
    # sequence -> stage_times, boundaries_s: the composer's floors and scores ask for a sequence's several times,
    # and the island orders meet the same sequences again
    _times: dict = field(default_factory=dict, repr=False)
    _boundaries: dict = field(default_factory=dict, repr=False)

    def _parts_hold_every_option(self) -> bool:
        """Whether the parts make every option (none was added by hand, manual.py)."""
        return sum(len(temps) for _k, _n, temps in self.parts) == len(self.options)

    def class_members(self) -> dict[Hashable, list[int]]:
        """grid_classes.class_members of the options' classes, read from the parts where they hold every option."""
        if not self._parts_hold_every_option():
            return grid_classes_mod.class_members(self.groups)
        return grid_classes_mod.class_members_of_parts([temps for _k, _n, temps in self.parts])

    def option_rows(self, fields: dict | None = None) -> np.ndarray | None:
        """Every option's 8 fields as one float array (a row per option, in option order), made from the parts:
        their templates' fields once each (``fields``: a dict the caller keeps, an answer's key -> (its templates,
        their fields as an array)), then the pairs' start, stop and island repeated. None where the parts do not hold
        every option (options added by hand, manual.py)."""
        if not self.options or not self._parts_hold_every_option():
            return None
        counts = [len(temps) for _k, _n, temps in self.parts]
        cache = fields if fields is not None else {}
        blocks = []
        for _k, _n, temps in self.parts:
            hit = cache.get(temps.key)
            if hit is None or hit[0] is not temps:
                hit = cache[temps.key] = (temps, np.array([t[0] for t in temps], dtype=np.float64).reshape(-1, 5))
            blocks.append(hit[1])
        rows = np.empty((len(self.options), 8))
        starts = np.repeat(np.array(self.part_starts, dtype=np.float64), counts)
        rows[:, 0] = starts
        rows[:, 1] = starts + np.repeat(np.array([n for _k, n, _t in self.parts], dtype=np.float64), counts)
        rows[:, 2] = np.repeat(np.array([k for k, _n, _t in self.parts], dtype=np.float64), counts)
        rows[:, 3:] = np.concatenate(blocks)
        return rows

    def slice_plan(self, option_index: int) -> SlicePlan:
        """The slice plan behind an option, shifted to the option's layers."""
        pair, plan = self.sources[option_index]
        return shift_plan(plan, pair.layers[0] - plan.layers[0])

    def stage_times(self, seq: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
        """Forward and backward seconds of every stage of a sequence of options, and the one-way p2p seconds at
        each stage boundary (inside a slice plan its stage times hold the p2p: 0 there). Kept per sequence: callers
        read the lists, never change them."""
        key = tuple(seq)
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = self._stage_times(key)
        return hit

    def _stage_times(self, seq: tuple[int, ...]) -> tuple[list[float], list[float], list[float]]:
        fwd: list[float] = []
        bwd: list[float] = []
        p2p: list[float] = []
        wake: list[float] = []
        waited: list[float] = []
        links = self.boundaries_s(seq)
        for n, oi in enumerate(seq):
            stages = self.sources[oi][1].stages  # shifting layers changes no time
            if n:
                p2p.append(links[n - 1])
            p2p.extend([0.0] * (len(stages) - 1))
            measured = self.islands[self.options[oi].island].gpu.measured
            factors = [sequence_factor(measured, st.micro_batch_size) for st in stages]  # parts run in sequence
            fwd.extend(st.forward_s * f for st, f in zip(stages, factors))
            bwd.extend(st.backward_s * f for st, f in zip(stages, factors))
            wake.extend([wake_up_s(measured)] * len(stages))
            waited.extend([wake_up_wait_s(measured)] * len(stages))
        if any(wake):  # a measured wake-up cost (CPU profiles): charged to the stages that wait (costmodel/wake.py)
            fwd, bwd = charge_wake_ups(fwd, bwd, wake, waited)
        return fwd, bwd, p2p

    def stage_gpus(self, seq: Sequence[int]) -> list[list[tuple[GpuRef, ...]]]:
        """Per option of a sequence, its stages' GPUs (allocation.allocate_gpus; an island holding several slice
        plans, as a hand-written plan's may, gives each its own, front to back). An option alone on its island gets
        the same GPUs in every sequence: kept per option."""
        taken: dict[str, set] = {}
        seen: set[str] = set()
        shared: set[str] = set()  # islands of more than one option: only there do the GPUs taken matter
        for oi in seq:
            name = self.islands[self.options[oi].island].name
            (shared if name in seen else seen).add(name)
        out = []
        for oi in seq:
            isl = self.islands[self.options[oi].island]
            mine = taken.get(isl.name)
            hit = self._gpus.get(oi) if not mine else None
            if hit is None:
                hit = allocate_gpus(isl, [s.shape for s in self.sources[oi][1].stages],
                                    taken=taken.setdefault(isl.name, set()) if isl.name in shared else None)
                assert hit is not None, "options are only made for slice plans whose stages fit the island"
                if not mine:
                    self._gpus[oi] = hit
            elif isl.name in shared:
                taken.setdefault(isl.name, set()).update(g for stage in hit for g in stage)
            out.append(hit)
        return out

    def boundaries_s(self, seq: Sequence[int]) -> list[float]:
        """One-way p2p seconds per micro-batch at each boundary between consecutive options of a sequence: the last
        stage of one to the first of the next, on their GPUs (LinkModel.stage_s; link_matrix holds a floor). Kept per
        sequence, like stage_times."""
        if len(seq) < 2:
            return []
        key = tuple(seq)
        hit = self._boundaries.get(key)
        if hit is None:
            hit = self._boundaries[key] = self._boundaries_s(key)
        return hit

    def _boundaries_s(self, seq: tuple[int, ...]) -> list[float]:
        gpus = self.stage_gpus(seq)
        out = []
        for n in range(1, len(seq)):
            a, b = self.sources[seq[n - 1]][1].stages[-1], self.sources[seq[n]][1].stages[0]
            out.append(self.links.stage_s(a.shape, gpus[n - 1][-1], b.shape, gpus[n][0]))
        return out

    def exact_metrics(self, seq: Sequence[int], metrics: Metrics) -> Metrics:
        """The closed form of a sequence with its exact boundaries (the composer's ``metrics`` price them at the
        island matrix's floor)."""
        exact = evaluate(seq, self.options, self.link_matrix, self.num_microbatches, links_s=self.boundaries_s(seq))
        return metrics if exact is None else exact

    def simulated_s(self, seq: Sequence[int], metrics: Metrics) -> float:
        """The plain-1F1B iteration the Plan reports for this sequence: the event simulation + the tail."""
        fwd, bwd, p2p = self.stage_times(seq)
        return simulated_1f1b_s(fwd, bwd, p2p, self.num_microbatches) + metrics.tail_s

    def schedule_choice(self, seq: Sequence[int], metrics: Metrics, *, schedule: str,
                        capabilities: "RuntimeCapabilities") -> ScheduleChoice:
        """The schedule build_plan gives this sequence and the iteration it predicts: plain 1F1B (the event
        simulation) or, under "auto" / "interleaved-1F1B", virtual stages where they are faster (interleave.py).
        The composer's ``score``, so the search picks by the number build_plan prints."""
        metrics = self.exact_metrics(seq, metrics)
        plain_s = self.simulated_s(seq, metrics)
        choice = self.interleaved_choice(seq, metrics, schedule=schedule, capabilities=capabilities,
                                         plain_latency_s=plain_s, floor_only=False)
        if schedule == "interleaved-1F1B" and choice.virtual_stages < 2:
            # insisted on, and this pipeline cannot interleave: build_plan would refuse it, so it wins nothing
            return ScheduleChoice(1, math.inf, choice.rejected)
        return choice

    def interleaved_choice(self, seq: Sequence[int], metrics: Metrics, *, schedule: str,
                           capabilities: "RuntimeCapabilities", plain_latency_s: float = math.inf,
                           floor_only: bool = True) -> ScheduleChoice:
        """choose_virtual_stages for this sequence against a plain 1F1B of ``plain_latency_s``; by default none,
        and a floor (no simulation: the interleaved schedules' floor alone, virtual_stages 1 if there is none)."""
        stages = [(st, self.islands[self.options[oi].island]) for oi in seq for st in self.slice_plan(oi).stages]
        fwd, bwd, p2p = self.stage_times(seq)  # as the plain prediction runs them
        return choose_virtual_stages(stages, num_microbatches=self.num_microbatches, period_s=metrics.period_s,
                                     fill_s=metrics.fill_s, tail_s=metrics.tail_s, schedule=schedule,
                                     capabilities=capabilities, training=self.training,
                                     plain_latency_s=plain_latency_s, p2p_s=p2p, floor_only=floor_only,
                                     fwd_s=fwd, bwd_s=bwd)


def shift_plan(plan: SlicePlan, offset: int) -> SlicePlan:
    """A redundant pair's plan: the representative's plan with layer indices moved by ``offset``."""
    if offset == 0:
        return plan
    stages = tuple(dataclasses.replace(s, layers=(s.layers[0] + offset, s.layers[1] + offset)) for s in plan.stages)
    return dataclasses.replace(plan, layers=(plan.layers[0] + offset, plan.layers[1] + offset), stages=stages)


def make_candidates(b: int, num_layers: int, pairs: Sequence[Pair], results: Mapping[tuple, SliceResult],
                    islands: Sequence["Island"], caps: "RuntimeCapabilities", links: LinkModel,
                    num_microbatches: int, *, dtype: str = "bf16",
                    training: "TrainingSpec | None" = None, judged: dict | None = None) -> Candidates:
    """Options for every pair from the answer of its redundancy class (``results`` keyed by Pair.key): the plans
    grid_classes.judge_templates keeps, judged by their numbers (lazy plans are built only when placed). ``judged``:
    a dict the caller keeps across calls with the same b (the driver rebuilds a size's options after each round of
    answers), holding answers judged by their key and each pair's options by the pair: an answer judged before is
    not judged again, nor are a pair's options made again from the same templates."""
    cand = Candidates(b=b, num_microbatches=num_microbatches, islands=tuple(islands), links=links,
                      link_matrix=links.island_matrix(), training_dtype=dtype, training=training)
    templates: dict[tuple, list] = {}
    shape_caches: dict[tuple, dict] = {}  # (island, full model): judge_templates' cache across queries
    for key, res in results.items():
        isl = next(i for i in islands if i.name == key[0])
        if res.bounded:
            cand.bounded[isl.name] = cand.bounded.get(isl.name, 0) + res.bounded
        if not res.plans:
            if res.infeasible is not None:
                cand.infeasible.setdefault(isl.name, []).append(res.infeasible.message())
            continue
        hit = judged.get(key) if judged is not None else None
        if hit is not None and hit[0] is res:
            templates[key] = hit[1]
            for why, n in hit[2].items():
                cand.dropped[why] = cand.dropped.get(why, 0) + n
            continue
        dropped: dict[str, int] = {}
        kept = grid_classes_mod.judge_templates(
            [p.numbers() for p in res.plans], island=isl, b=b, num_microbatches=num_microbatches,
            capacity=capacity_bytes(isl, training), caps=caps, full_model=key[3] and key[4], dropped=dropped,
            shape_cache=shape_caches.setdefault((isl.name, key[3] and key[4]), {}))
        for why, n in dropped.items():
            cand.dropped[why] = cand.dropped.get(why, 0) + n
        # per template: the Option fields after (start, stop, island), its plan, its class, its edge times (the
        # same for every pair of the answer)
        templates[key] = AnswerTemplates(key, [((t.num_stages, t.max_after, t.time_s, t.bottleneck_s, t.tail_s), plan,
                                                t.group, _edges(plan)) for t in kept for plan in (res.plans[t.index],)])
        if judged is not None:
            judged[key] = (res, templates[key], dropped)
    new = tuple.__new__  # Option._make without its Python frame and length check: the fields are Option's 8
    built = judged if judged is not None else {}  # pair -> (its templates, its options, classes, edges)
    for pair in pairs:
        temps = templates.get(pair.key)
        if not temps:
            continue
        hit = built.get(pair)
        if hit is None or hit[0] is not temps:
            where = (pair.layers[0], pair.layers[1], pair.island)
            hit = built[pair] = (temps, [new(Option, where + t[0]) for t in temps], [t[2] for t in temps],
                                 [t[3] for t in temps])
        cand.options.extend(hit[1])
        cand.sources.add_part(pair, temps)
        cand.groups.extend(hit[2])
        cand.edges.extend(hit[3])
        cand.parts.append((pair.island, pair.layers[1] - pair.layers[0], temps))
        cand.part_starts.append(pair.layers[0])
    return cand


def _edges(plan: SlicePlan) -> tuple[float, float]:
    """A slice plan's first and last stage's forward + backward seconds, from its numbers (lazy plans stay unbuilt)."""
    times = plan.numbers().time_s
    return times[0], times[-1]


def _stage_layout(cand: Candidates, comp: Composition) -> tuple[list[tuple[StageCost, "Island"]], list, list[float]]:
    """The composition's stages front to back: each with its island, its GPUs (allocation.allocate_gpus, islands
    holding several slice plans give each its own), and the one-way p2p seconds per boundary (inside a slice plan
    the parallelizer's stage times hold it: 0 there)."""
    slice_plans = [(cand.options[oi], cand.slice_plan(oi)) for oi in comp.options]
    stage_costs: list[tuple[StageCost, "Island"]] = []
    stage_gpus = []
    p2p: list[float] = []
    links = cand.boundaries_s(comp.options)
    for n, ((opt, sp), gpus) in enumerate(zip(slice_plans, cand.stage_gpus(comp.options))):
        isl = cand.islands[opt.island]
        if n:
            p2p.append(links[n - 1])
        p2p.extend([0.0] * (len(sp.stages) - 1))
        stage_gpus.extend(gpus)
        stage_costs.extend((s, isl) for s in sp.stages)
    return stage_costs, stage_gpus, p2p


def build_plan(cand: Candidates, comp: Composition, *, cluster: "ClusterSpec", model: "ModelSpec",
               training: "TrainingSpec", runtime: str, islands_dropped: Sequence[Mapping[str, str]] = (),
               planner: Mapping | None = None, schedule: str = "1F1B",
               capabilities: "RuntimeCapabilities | None" = None) -> Plan:
    """The frozen Plan for a composition: stages in pipeline order with GPUs, and the predicted iteration.

    ``schedule`` "auto" or "interleaved-1F1B" lets planner/interleave.py give the pipeline virtual stages."""
    m = cand.num_microbatches
    L = model.num_layers
    stage_costs, stage_gpus, p2p = _stage_layout(cand, comp)
    S = len(stage_costs)
    metrics = evaluate(comp.options, cand.options, cand.link_matrix, m, links_s=cand.boundaries_s(comp.options))
    assert metrics is not None
    # plain 1F1B as predicted: the event simulation of the stage times (the timeline draws the same run)
    plain_s = cand.simulated_s(comp.options, metrics)
    # plain 1F1B too goes through the choice: the runtime may not run it (torch's one-grid 1F1B needs m >= stages)
    from tangram_launch.capabilities import capabilities_for
    from tangram_launch.errors import InfeasibleError

    fwd_s, bwd_s, _ = cand.stage_times(comp.options)  # with the wake-up charges of the stages that wait
    choice = choose_virtual_stages(stage_costs, num_microbatches=m, period_s=metrics.period_s,
                                   fill_s=metrics.fill_s, tail_s=metrics.tail_s, schedule=schedule,
                                   capabilities=capabilities or capabilities_for(runtime), training=training,
                                   plain_latency_s=plain_s, p2p_s=p2p, fwd_s=fwd_s, bwd_s=bwd_s)
    if schedule == "interleaved-1F1B" and choice.virtual_stages < 2:
        raise InfeasibleError("no interleaved 1F1B schedule for the best pipeline",
                              list(choice.rejected) or ["no number of virtual stages fits"])
    if math.isinf(choice.latency_s):
        raise InfeasibleError(f"{runtime} cannot run the best pipeline's schedule", list(choice.rejected))
    # an interleaved choice's latency: its event simulation + the tail (the timeline draws the same run)
    v, interleave_notes, t = choice.virtual_stages, choice.rejected, choice.latency_s
    chunks = interleaved_chunks([st.layers[1] - st.layers[0] for st, _ in stage_costs], v) if v > 1 else None
    stages = []
    preds = []
    for k, ((st, isl), gpus) in enumerate(zip(stage_costs, stage_gpus)):
        sh = st.shape
        stages.append(Stage(index=k, layers=st.layers, island=isl.name,
                            gpus=tuple((g.node, g.local_index) for g in gpus),
                            tp=sh.tp, dp=sh.dp, cp=sh.cp, ep=sh.ep, zero_stage=sh.zero_stage, recompute=sh.recompute,
                            micro_batch_size=st.micro_batch_size, offload=sh.offload,
                            has_embedding=st.layers[0] == 0, has_head=st.layers[1] == L,
                            chunks=chunks[k] if chunks else (),
                            math_mode=math_mode(isl.gpu, training.dtype) if training.dtype == "tf32" else None))
        preds.append(StagePrediction(forward_s=fwd_s[k], backward_s=bwd_s[k],
                                     peak_memory_gib=stage_memory_bytes(st, S - 1 - k, S, m, v) / GIB,
                                     capacity_gib=isl.gpu.memory_gib,
                                     measured=_stage_measurement(st, isl, model, training),
                                     sync_s=st.dp_sync_s, optimizer_s=st.optimizer_s))
    peak = sum(gpu_peak_flops(cluster, node, idx, training.dtype) for st in stages for node, idx in st.gpus)
    tokens = training.global_batch * training.seq_len
    flops = 3.0 * model.forward_flops_per_token(training.seq_len, causal=True) * tokens
    formula_s = pipeline_latency_s(m, metrics.period_s, metrics.fill_s, metrics.tail_s, v)
    prediction = Prediction(
        iteration_time_s=t, tokens_per_s=tokens / t, mfu=flops / (t * peak) if peak > 0 else 0.0,
        stages=tuple(preds),
        breakdown={"period_s": metrics.period_s, "steady_s": (m - 1) * metrics.period_s,
                   "fill_s": metrics.fill_s, "p2p_s": 2.0 * sum(p2p), "tail_s": metrics.tail_s,
                   "pipeline_s": t - metrics.tail_s, "formula_s": formula_s,
                   "bubble_fraction": 1.0 - (m * sum(p.time_s for p in preds) / S) / t if S else 0.0})
    used = []
    for s in stages:
        if s.island not in used:
            used.append(s.island)
    return Plan(
        model=model.to_dict(), training=training.to_dict(moe=model.num_experts > 0), stages=tuple(stages),
        num_microbatches=m, predicted=prediction, runtime=runtime,
        schedule="interleaved-1F1B" if v > 1 else "1F1B", virtual_stages=v, islands_used=tuple(used),
        islands_dropped=tuple(dict(d) for d in islands_dropped),
        cluster={"name": cluster.name, "hash": cluster.content_hash(),
                 "nodes": [{"name": n.name, "num_gpus": n.num_gpus} for n in cluster.nodes]},
        planner={**dict(planner or {}), "p2p_s": p2p,
                 **({"schedule_notes": list(interleave_notes)} if interleave_notes else {}),
                 **({"plain_1f1b_iteration_s": plain_s} if v > 1 else {})})


def _stage_measurement(st: StageCost, isl, model: "ModelSpec", training: "TrainingSpec") -> dict | None:
    """The plan's note on a stage priced from measured layer times (None without any: plans unchanged)."""
    if not (isl.gpu.measured or {}).get("layer_forward_s"):
        return None
    from tangram_launch.costmodel.compute import stage_measurement
    from tangram_launch.costmodel.efficiency import DeviceModel

    sh = st.shape
    return stage_measurement(model, st.layers, has_embedding=st.layers[0] == 0,
                             has_head=st.layers[1] == model.num_layers, seq_len=training.seq_len,
                             mbs=st.micro_batch_size, tp=sh.tp, cp=sh.cp, ep=sh.ep,
                             dev=DeviceModel.from_gpu(isl.gpu, training.dtype,
                                                      attention_kernel=training.attention_kernel))


def gpu_peak_flops(cluster: "ClusterSpec", node: str, local: int, dtype: str) -> float:
    """Peak FLOP/s of one GPU in the training dtype's math mode (falls back like island compute when unsupported)."""
    from tangram_launch.specs.cluster import GpuRef

    g = cluster.gpu(GpuRef(node, local))
    v = g.tflops.get(math_mode(g, dtype))
    return float(v if v else compute_tflops(g, dtype)) * 1e12
