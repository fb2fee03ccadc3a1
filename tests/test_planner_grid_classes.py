"""The composer's choice of slice plans (planner/grid_classes.py) from lazy plans' numbers, before any plan is built,
gives the same templates, in the same order, as building every front plan first (the old eager path)."""
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import LazySlicePlan, SlicePlan, SliceQuery, capacity_bytes
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner.grid_classes import GridClass, class_members, judge_templates, max_stages_after
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, LinkSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

MODEL = load_model("gpt3-1.3b")  # 24 layers: slices of every kind (embedding, head, both, neither)


def _island(gpu_type: str, nodes: int, per_node: int) -> Island:
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}},
                                  "nodes": [{"name": "x", "gpu": gpu_type, "count": 1}]}).nodes[0].gpus[0]
    names = tuple(f"n{i}" for i in range(nodes))
    return Island(name=gpu_type, nodes=names, gpus=tuple(GpuRef(n, k) for n in names for k in range(per_node)),
                  gpus_per_node=per_node, gpu=spec, inter_node_link=LinkSpec(25.0, 2.0) if nodes > 1 else None)


def _choose(q: SliceQuery, numbers) -> tuple[list, dict]:
    dropped: dict = {}
    kept = judge_templates(numbers, island=q.island, b=q.microbatch_sequences, num_microbatches=q.num_microbatches,
                           capacity=capacity_bytes(q.island, q.training), caps=q.capabilities,
                           full_model=q.layers == (0, q.model.num_layers), dropped=dropped)
    return list(kept), dropped


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpu=st.sampled_from(["v100-16gb", "a100-40gb", "t4"]), per_node=st.sampled_from([2, 4]),
       nodes=st.integers(1, 2), start=st.integers(0, 23), length=st.integers(1, 24),
       b=st.sampled_from([1, 2, 4, 8]), caps=st.sampled_from([TORCH, DEEPSPEED, MEGATRON]))
def test_lazy_plans_give_the_templates_of_built_plans(gpu, per_node, nodes, start, length, b, caps):
    """Hypothesis over small queries: the megatron parallelizer answers with lazy plans; the composer's templates
    chosen from their numbers (nothing built) are those chosen from the built plans (the old eager path): same
    plans, same order, every number the composer reads, same reasons for the plans left out. The numbers are bit
    for bit those of the built stages, and equal plans compare equal whether built or not."""
    stop = min(24, start + length)
    tr = TrainingSpec(global_batch=32, seq_len=1024, dtype="fp16")
    q = SliceQuery(model=MODEL, training=tr, layers=(start, stop), island=_island(gpu, nodes, per_node),
                   microbatch_sequences=b, capabilities=caps, max_stages=caps.max_stages,
                   pipelined=(start, stop) != (0, 24))
    res = MegatronParallelizer().query(q)
    assert all(isinstance(p, LazySlicePlan) for p in res.plans)
    lazy, lazy_dropped = _choose(q, [p.numbers() for p in res.plans])
    assert not any(p._stages for p in res.plans), "judging built a plan"
    built = [p.built() for p in res.plans]
    assert [p.numbers() for p in built] == [p.numbers()._replace(depth_hint=None) for p in res.plans]
    assert all(p.numbers().depth_hint[:2] == (q.num_microbatches, capacity_bytes(q.island, q.training))
               for p in res.plans)  # the hint is used only at the memory it was computed for
    eager, eager_dropped = _choose(q, [p.numbers() for p in built])
    assert lazy == eager and lazy_dropped == eager_dropped
    assert built == list(res.plans) and list(res.plans) == built
    assert pickle.loads(pickle.dumps(res.plans)) == tuple(built)


def test_a_lazy_plan_is_built_once_and_only_when_read():
    calls = []
    stages = MegatronParallelizer().query(SliceQuery(
        model=MODEL, training=TrainingSpec(global_batch=32, seq_len=1024, dtype="fp16"), layers=(0, 6),
        island=_island("a100-40gb", 1, 4), microbatch_sequences=4, capabilities=TORCH)).plans[0].built().stages
    plan = LazySlicePlan("x", (0, 6), numbers=SlicePlan("x", (0, 6), stages).numbers(),
                         build=lambda: calls.append(1) or stages)
    assert plan.numbers().time_s == tuple(s.time_s for s in stages) and not calls
    assert plan.stages == stages and plan.stages is stages and calls == [1]
    assert plan.bottleneck_s == max(s.time_s for s in stages) and calls == [1]
    with pytest.raises(ValueError, match="numbers and a way to build"):
        LazySlicePlan("x", (0, 6), numbers=plan.numbers())


def test_a_depth_hint_counts_only_at_the_memory_it_was_computed_for():
    q = SliceQuery(model=MODEL, training=TrainingSpec(global_batch=64, seq_len=2048, dtype="fp16"), layers=(2, 14),
                   island=_island("v100-16gb", 1, 4), microbatch_sequences=2, capabilities=TORCH)
    m, cap = q.num_microbatches, capacity_bytes(q.island, q.training)
    for plan in MegatronParallelizer().query(q).plans[:20]:
        lazy = plan.numbers()
        want = plan.built().max_stages_after(m, cap)
        want = want if want >= (1 << 30) else min(want, m - 1)
        assert max_stages_after(lazy, m, cap) == want
        assert max_stages_after(lazy._replace(depth_hint=(m + 1, cap, 999)), m, cap) == want
        assert max_stages_after(lazy._replace(depth_hint=(m, cap * 0.5, 999)), m, cap) == want


def test_torch_templates_name_their_one_grid_and_the_driver_composes_it_apart():
    """Under torch (stages with their own grids, interleaving with one grid) a template's class is a GridClass
    naming its (tp, dp, cp) when its stages share one; class_members composes each one-grid class apart with all
    of its plans and the free class with every plan: no template stands for another (what the composer sees of
    one does not order the plain 1F1B simulation; megatron.exact_front judged the answer already), so every plan
    that can be placed and fits is kept. Megatron's classes are one per grid, each option in exactly one."""
    tr = TrainingSpec(global_batch=32, seq_len=1024, dtype="fp16")
    q = SliceQuery(model=MODEL, training=tr, layers=(0, 12), island=_island("a100-40gb", 1, 4),
                   microbatch_sequences=2, capabilities=TORCH, max_stages=TORCH.max_stages, pipelined=True)
    numbers = [p.numbers() for p in MegatronParallelizer().query(q).plans]
    kept, dropped = _choose(q, numbers)
    assert len(kept) + sum(dropped.values()) == len(numbers) and "does not fit in memory" not in dropped
    groups = [t.group for t in kept]
    assert groups and all(isinstance(g, GridClass) for g in groups)
    assert any(g.grid is not None for g in groups)
    members = class_members(groups)
    free = [k for k in members if k.grid is None]
    assert len(free) == 1 and members[free[0]] == list(range(len(groups)))
    for g in {g for g in groups if g.grid is not None}:
        assert members[g] == [i for i, h in enumerate(groups) if h == g]
    mq = SliceQuery(model=MODEL, training=tr, layers=(0, 12), island=_island("a100-40gb", 1, 4),
                    microbatch_sequences=2, capabilities=MEGATRON, max_stages=MEGATRON.max_stages, pipelined=True)
    mkept, _ = _choose(mq, [p.numbers() for p in MegatronParallelizer().query(mq).plans])
    mgroups = [t.group for t in mkept]
    assert not any(isinstance(g, GridClass) for g in mgroups)
    assert sorted(i for idx in class_members(mgroups).values() for i in idx) == list(range(len(mgroups)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=8), st.integers(0, 3))
def test_option_sources_read_from_parts_are_a_list_of_each_options_pair_and_plan(sizes, extra):
    """Candidates.sources answers option i with (its pair, its template's plan) from the parts, as the list of one
    tuple per option it replaces did: every index, negative ones, slices, options appended one by one after the
    parts, and IndexError past the end."""
    from tangram_launch.planner.build import OptionSources
    from tangram_launch.planner.slices import Pair

    sources, want = OptionSources(), []
    for k, n in enumerate(sizes):
        pair = Pair((k, k + 1), k % 3, (f"isl{k}",))
        temps = [(None, f"plan{k}.{j}", None, None) for j in range(n)]
        sources.add_part(pair, temps)
        want += [(pair, t[1]) for t in temps]
    for j in range(extra):
        item = (Pair((0, 1), 0, ("manual",)), f"manual{j}")
        sources.append(item)
        want.append(item)
    assert len(sources) == len(want)
    assert [sources[i] for i in range(len(want))] == want
    assert [sources[-i] for i in range(1, len(want) + 1)] == [want[-i] for i in range(1, len(want) + 1)]
    assert sources[1:4] == want[1:4] and list(sources) == want
    with pytest.raises(IndexError):
        sources[len(want)]


_CLASSES = st.one_of(st.sampled_from([(1, 2), (2, 1), None]),
                     st.builds(GridClass, st.sampled_from([(1, 2), (2, 4)]),
                               st.sampled_from([None, (1, 2, 1), (2, 1, 1), (1, 1, 2)])))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_CLASSES, max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), max_size=10))
def test_class_members_of_parts_is_class_members_of_every_options_class(lists, order):
    """Candidates.class_members reads each distinct templates list once (parts share their answer's list): the
    same classes, members and dict order as class_members over every option's class, for plain and GridClass
    classes and lists repeated in any order."""
    from tangram_launch.planner.grid_classes import class_members_of_parts

    temps = [[(None, None, g, None) for g in groups] for groups in lists]
    parts = [temps[k % len(temps)] for k in order] or temps
    every = [t[2] for part in parts for t in part]
    assert list(class_members_of_parts(parts).items()) == list(class_members(every).items())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.lists(st.integers(0, 7), max_size=6),
       st.data())
def test_option_sources_slots_name_each_options_plan(sizes, shared, data):
    """OptionSources.plan_slots and plan_at give back every option's plan; parts sharing a templates list (one
    answer, several pairs) share its slots; an option added one by one has none."""
    from tangram_launch.planner.build import OptionSources
    from tangram_launch.planner.slices import Pair

    lists = [[(None, f"plan{k}.{j}", None, None) for j in range(n)] for k, n in enumerate(sizes)]
    sources = OptionSources()
    for k, s in enumerate(list(range(len(lists))) + shared):
        sources.add_part(Pair((k, k + 1), 0, (f"isl{k}",)), lists[s % len(lists)])
    idx = sorted(data.draw(st.sets(st.integers(0, max(0, len(sources) - 1)), max_size=len(sources)))
                 ) if len(sources) else []
    slots = sources.plan_slots(idx)
    assert slots.shape == (len(idx), 2)
    assert [sources.plan_at(t, p) for t, p in slots.tolist()] == [sources[i][1] for i in idx]
    sources.append((Pair((0, 1), 0, ("manual",)), "manual"))
    assert sources.plan_slots([len(sources) - 1]) is None
