"""The built-in parallelizers: Pareto fronts (checked by brute force), infeasible answers, runtime capabilities,
the registry (with a real entry-point plugin), the uniform baseline and the `estimate` command."""
import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH, RuntimeCapabilities
from tangram_launch.cli import main
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.compute import RECOMPUTE_MODES
from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.errors import SpecError
from tangram_launch.islands import Island, build_islands
from tangram_launch.parallelizers.base import Parallelizer, SliceQuery, capacity_bytes
from tangram_launch.parallelizers import megatron as megatron_mod
from tangram_launch.parallelizers.megatron import MegatronParallelizer, fit_depth, query_key
from tangram_launch.parallelizers.registry import get_parallelizer, registered_names
from tangram_launch.parallelizers.uniform import UniformParallelizer
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, LinkSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

ANY = RuntimeCapabilities(name="any")


def island(gpu_type, nodes=1, per_node=8, net_gbps=25.0):
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}},
                                  "nodes": [{"name": "x", "gpu": gpu_type, "count": 1}]}).nodes[0].gpus[0]
    names = tuple(f"n{i}" for i in range(nodes))
    return Island(name=gpu_type, nodes=names, gpus=tuple(GpuRef(n, k) for n in names for k in range(per_node)),
                  gpus_per_node=per_node, gpu=spec, inter_node_link=LinkSpec(net_gbps, 2.0) if nodes > 1 else None)


def query(model, isl, *, layers=None, b=4, gb=32, seq=2048, dtype="bf16", caps=ANY, **kw):
    model = load_model(model) if isinstance(model, str) else model
    tr = TrainingSpec(global_batch=gb, seq_len=seq, dtype=dtype)
    return SliceQuery(model=model, training=tr, layers=layers or (0, model.num_layers), island=isl,
                      microbatch_sequences=b, capabilities=caps, **kw)


def objectives(plan, m, cap):
    """(bottleneck, sum of stage times, DP sync + optimizer, fit depth, stages, GPUs): the front's criteria."""
    times = [s.time_s for s in plan.stages]
    tail = max(s.dp_sync_s + s.optimizer_s for s in plan.stages)
    return max(times), sum(times), tail, plan.max_stages_after(m, cap), len(plan.stages), plan.num_gpus


def dominates(a, b):
    return (a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and a[3] >= b[3] and a[4] <= b[4]
            and a[5] <= b[5])


# ------------------------------------------------------------------------------------------------ Pareto front
def test_every_feasible_config_is_weakly_dominated_by_a_front_plan():
    """Brute force: cost every configuration the parallelizer enumerates through the explained path; every feasible
    one is weakly dominated by an answer plan in the closed form's terms (the answer holds the closed form's front:
    megatron.exact_front keeps more, test_parallelizer_front.py checks its own rule by brute force)."""
    q = query("gpt3-13b", island("a100-80gb", per_node=4), layers=(4, 14), b=4, gb=32)
    par = MegatronParallelizer()
    res = par.query(q)
    m, cap = q.num_microbatches, capacity_bytes(q.island)
    front = [objectives(p, m, cap) for p in res.plans]
    assert len(front) >= 3
    coster = SliceCoster(q)
    feasible = 0
    count = 0
    for grid in par.grids(q, coster):
        if coster.check(grid):
            continue
        for zero, r, off in par.savers(q, grid):
            count += 1
            cfg = ParallelConfig(tp=grid.tp, pp=grid.pp, dp=grid.dp, cp=grid.cp, ep=grid.ep, zero_stage=zero,
                                 recompute=RECOMPUTE_MODES[r], offload=off)
            plan = coster.plan(cfg)
            obj = objectives(plan, m, cap)
            if obj[3] < 0:
                continue
            feasible += 1
            assert any(dominates(f, obj) for f in front), (cfg, obj)
    assert count == res.configs_evaluated and feasible > len(front)


def test_fast_path_agrees_with_the_explained_plan():
    q = query("mixtral-8x7b-16l", island("h100-sxm"), layers=(0, 6), b=8, gb=64, seq=4096)
    coster = SliceCoster(q)
    m, cap = q.num_microbatches, capacity_bytes(q.island)
    for cfg in (ParallelConfig(tp=2, pp=2, dp=2, ep=2, zero_stage=1, recompute="selective"),
                ParallelConfig(tp=1, pp=1, dp=8, ep=8, zero_stage=3, recompute="full", offload=True),
                ParallelConfig(tp=4, pp=2, dp=1, zero_stage=0, recompute="none")):
        plan = coster.plan(cfg)
        sums = coster.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)
        numbers = [coster.fast_stage(st, cfg.zero_stage, RECOMPUTE_MODES.index(cfg.recompute), cfg.offload)
                   for st in sums]
        for st, (f, b, static, act, sync, opt) in zip(plan.stages, numbers):
            assert (st.forward_s, st.backward_s, st.static_bytes, st.activation_bytes, st.dp_sync_s,
                    st.optimizer_s) == (f, b, static, act, sync, opt)
        depth, _ = fit_depth(numbers, m, cap)
        assert depth == plan.max_stages_after(m, cap)


def test_every_plan_fits_and_covers_the_slice():
    q = query("gpt3-13b", island("v100-32gb"), layers=(0, 40), b=8, gb=128, dtype="fp16")
    res = MegatronParallelizer().query(q)
    assert res.plans and res.infeasible is None and res.configs_evaluated > 300
    for p in res.plans:
        assert p.fits(0, q.num_microbatches, capacity_bytes(q.island))
        assert p.stages[0].layers[0] == 0 and p.stages[-1].layers[1] == 40
        assert all(a.layers[1] == b.layers[0] for a, b in zip(p.stages, p.stages[1:]))
        assert p.num_gpus <= 8 and p.parallelizer == "megatron"
        assert len({s.shape for s in p.stages}) == 1  # a slice's stages share one grid and memory savers
        assert all(s.micro_batch_size * s.shape.dp == 8 for s in p.stages)


def test_query_key_identifies_interchangeable_slices():
    isl = island("a100-80gb", per_node=4)
    a = query("gpt3-13b", isl, layers=(5, 15))
    b = query("gpt3-13b", isl, layers=(20, 30))
    head = query("gpt3-13b", isl, layers=(30, 40))
    assert query_key(a) == query_key(b) != query_key(head)
    ra, rb = MegatronParallelizer().query(a), MegatronParallelizer().query(b)
    assert ra.query_key == rb.query_key
    assert [p.bottleneck_s for p in ra.plans] == pytest.approx([p.bottleneck_s for p in rb.plans])


# ------------------------------------------------------------------------------------------------ infeasible
def test_llama3_405b_on_one_t4_is_infeasible_with_the_minimum_memory():
    q = query("llama3-405b", island("t4", per_node=1), b=1, gb=8, seq=2048, dtype="fp16")
    res = MegatronParallelizer().query(q)
    assert res.plans == () and res.infeasible is not None
    inf = res.infeasible
    assert inf.min_memory_bytes > 16 * GIB
    assert "needs at least" in inf.message() and "GiB" in inf.message() and "t4" in inf.message()
    assert {"parameters_bytes", "activations_bytes", "config"} <= set(inf.breakdown)
    # the smallest configuration is the most frugal one: everything offloaded, full recompute
    assert "offload=yes" in inf.breakdown["config"] and "recompute=full" in inf.breakdown["config"]


def test_dtype_the_gpu_lacks_is_an_infeasible_answer():
    res = MegatronParallelizer().query(query("gpt3-1.3b", island("v100-32gb"), dtype="bf16"))
    assert not res.plans and "bf16" in res.infeasible.message()


def test_batch_not_divisible_is_infeasible():
    res = MegatronParallelizer().query(query("gpt3-1.3b", island("a100-80gb"), b=3, gb=32))
    assert not res.plans and "multiple" in res.infeasible.message()


# ------------------------------------------------------------------------------------------------ capabilities
def shapes_of(res):
    return [s.shape for p in res.plans for s in p.stages]


def test_deepspeed_capabilities_no_zero2_with_pipeline():
    q = query("gpt3-13b", island("a100-80gb"), layers=(0, 20), b=8, gb=64, caps=DEEPSPEED, pipelined=True)
    res = MegatronParallelizer().query(q)
    assert res.plans
    for sh in shapes_of(res):
        assert sh.zero_stage <= 1 and sh.recompute in ("none", "full") and sh.cp == 1 and not sh.offload
    # without a global pipeline ZeRO-3 is allowed and chosen somewhere on the front of this memory-heavy slice
    q1 = query("gpt3-13b", island("a100-80gb"), b=8, gb=64, caps=DEEPSPEED, pipelined=False, max_stages=1)
    assert any(sh.zero_stage >= 2 for sh in shapes_of(MegatronParallelizer().query(q1)))


def test_megatron_capabilities_and_one_front_per_grid():
    q = query("gpt3-13b", island("a100-80gb"), layers=(0, 20), b=8, gb=64, caps=MEGATRON)
    res = MegatronParallelizer().query(q)
    for sh in shapes_of(res):
        assert sh.zero_stage <= 1 and not sh.offload
    # uniform_grid: the planner needs a plan for every (tp, dp, cp) grid that can work, not only the fastest
    grids = {(p.stages[0].shape.tp, p.stages[0].shape.dp, p.stages[0].shape.cp) for p in res.plans}
    unconstrained = MegatronParallelizer().query(query("gpt3-13b", island("a100-80gb"), layers=(0, 20), b=8,
                                                       gb=64, caps=RuntimeCapabilities(name="free", max_zero_stage=1,
                                                                                       offload=False)))
    free_grids = {(p.stages[0].shape.tp, p.stages[0].shape.dp, p.stages[0].shape.cp) for p in unconstrained.plans}
    # (and so does a free runtime's: a plan stands only for plans of its own grid, megatron.exact_front)
    assert free_grids == grids and len(grids) >= 10


def test_torch_capabilities_and_max_stages():
    q = query("gpt3-13b", island("a100-80gb"), layers=(0, 20), b=8, gb=64, caps=TORCH, max_stages=1)
    res = MegatronParallelizer().query(q)
    assert res.plans
    for p in res.plans:
        assert len(p.stages) == 1
        sh = p.stages[0].shape
        assert sh.cp == 1 and sh.ep == 1  # torch has no context parallelism; a dense model has no experts
    assert any(p.stages[0].shape.offload for p in res.plans) == TORCH.offload  # offload proposed where it runs


def test_moe_plans_use_expert_parallelism():
    q = query("mixtral-8x7b-16l", island("h100-sxm"), layers=(0, 16), b=8, gb=64, seq=4096)
    res = MegatronParallelizer().query(q)
    assert res.plans
    eps = {sh.ep for sh in shapes_of(res)}
    assert max(eps) > 1
    for sh in shapes_of(res):
        assert (sh.dp * sh.cp) % sh.ep == 0 and 8 % sh.ep == 0


def test_cpu_cluster_tiny_model(cluster_path):
    iset = build_islands(ClusterSpec.load(cluster_path("cpu-2")))
    q = query("tiny", iset.islands[0], b=2, gb=8, seq=64, dtype="fp32")
    res = MegatronParallelizer().query(q)
    assert res.plans and all(p.num_gpus <= 2 for p in res.plans)
    assert all(s.breakdown["overhead_bytes"] == 0 for p in res.plans for s in p.stages)  # no CUDA context on CPU
    assert not any(s.shape.offload for p in res.plans for s in p.stages)  # host memory is the device's own


# ------------------------------------------------------------------------------------------------ uniform
def test_uniform_is_whole_island_without_memory_savers():
    q = query("gpt3-6.7b", island("a100-80gb"), b=8, gb=64)
    res = UniformParallelizer().query(q)
    assert res.plans and res.configs_evaluated >= 4
    for p in res.plans:
        assert p.num_gpus == 8 and p.parallelizer == "uniform"
        for s in p.stages:
            assert (s.shape.zero_stage, s.shape.recompute, s.shape.offload, s.shape.cp) == (0, "none", False, 1)


def test_uniform_fails_where_memory_savers_are_needed():
    """The paper's point (§6.1): without recompute and ZeRO, GPT-3 13B does not fit on 8 V100-32GB at this
    batch shape, while the exhaustive parallelizer finds plans."""
    q = query("gpt3-13b", island("v100-32gb"), b=8, gb=64, dtype="fp16")
    assert UniformParallelizer().query(q).infeasible is not None
    best = MegatronParallelizer().query(q)
    assert best.plans


# ------------------------------------------------------------------------------------------------ registry
def test_registry_builtins_and_unknown_names():
    assert registered_names()[:2] == ["megatron", "uniform"]
    assert isinstance(get_parallelizer("megatron"), Parallelizer)
    assert get_parallelizer("uniform").name == "uniform"
    with pytest.raises(SpecError) as err:
        get_parallelizer("megatorn")
    assert "megatron, uniform" in str(err.value) and "did you mean 'megatron'" in str(err.value)


def test_registry_loads_an_entry_point_plugin(tmp_path, monkeypatch):
    """A real installed distribution (dist-info with entry_points.txt on sys.path), no mocks."""
    (tmp_path / "toy_parallelizer.py").write_text(
        "from tangram_launch.parallelizers.base import SliceResult\n"
        "class Toy:\n"
        "    name = 'toy'\n"
        "    def __init__(self, **kw):\n"
        "        self.kw = kw\n"
        "    def query(self, q):\n"
        "        return SliceResult(('toy',), ())\n")
    dist = tmp_path / "toy_parallelizer-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-parallelizer\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tangram_launch.parallelizers]\ntoy = toy_parallelizer:Toy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy" in registered_names()
    toy = get_parallelizer("toy", level=2)
    assert toy.name == "toy" and toy.kw == {"level": 2}
    assert toy.query(None).query_key == ("toy",)


# ------------------------------------------------------------------------------------------------ estimate CLI
def test_estimate_prints_the_breakdown(cluster_path, capsys):
    rc = main(["estimate", "--cluster", cluster_path("c3-full-het-ii"), "--model", "gpt3-13b", "--island",
               "v100-32gb", "--tp", "4", "--pp", "2", "--dp", "1", "--zero", "0", "--recompute", "full",
               "--global-batch", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for needle in ("stage 0", "stage 1", "compute forward", "TP comm", "optimizer states", "activations",
                   "peak", "capacity", "iteration estimate", "MFU", "fp16"):
        assert needle in out


def test_estimate_reports_a_configuration_that_does_not_fit(cluster_path, capsys):
    rc = main(["estimate", "--cluster", cluster_path("c3-full-het-ii"), "--model", "gpt3-13b", "--island",
               "v100-32gb", "--dp", "8", "--format", "json"])
    out = capsys.readouterr().out
    assert rc == 3 and '"fits": false' in out


def test_estimate_rejects_bad_input(cluster_path, capsys):
    rc = main(["estimate", "--cluster", cluster_path("c3-full-het-ii"), "--model", "gpt3-13b", "--island",
               "v100-32gb", "--tp", "3"])
    assert rc == 2 and "tp=3" in capsys.readouterr().err
    rc = main(["estimate", "--cluster", cluster_path("c3-full-het-ii"), "--model", "gpt3-13b"])
    assert rc == 2 and "a100-80gb" in capsys.readouterr().err  # several islands: lists them


# ------------------------------------------------------------------------------------------------ speed
def test_forty_layer_query_is_fast():
    """The inner loop of planning: a 40-layer slice on an 8-GPU island (benchmarks/bench_parallelizer.py measures
    it properly; this only guards against an order-of-magnitude regression on a shared machine). The best of three
    fresh queries: one may pay a collector's full pass over what the tests before it left."""
    rates = []
    for _ in range(3):
        q = query("gpt3-13b", island("v100-32gb"), b=8, gb=128, dtype="fp16")
        start = time.process_time()
        res = MegatronParallelizer().query(q)
        rates.append(res.configs_evaluated / max(time.process_time() - start, 1e-9))
    assert max(rates) > 3000, rates


def test_shape_validation_cache_still_rejects_bad_fields():
    """StageShape skips re-validating fields it has seen; a bool or float equal to a cached int must still fail."""
    from tangram_launch.specs.shape import StageShape
    StageShape(tp=1, dp=2, zero_stage=1)  # cached as valid
    for bad in ({"tp": True}, {"dp": 2.0}, {"zero_stage": True}, {"recompute": ["none"]}):
        with pytest.raises(SpecError):
            StageShape(**{"tp": 1, "dp": 2, "zero_stage": 1, **bad})


def test_pareto_front_matches_brute_force():
    """pareto_front keeps exactly the points no other point dominates (ties keep the first in sort order)."""
    import random

    from tangram_launch.parallelizers.megatron import pareto_front
    rng = random.Random(7)
    for _ in range(30):
        pts = [(rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, 3), rng.randint(1, 3),
                rng.randint(1, 3), i) for i in range(rng.randint(1, 40))]
        order = sorted(pts, key=lambda p: (p[0], p[1], p[2], -p[3], p[4], p[5]))
        want = [p for i, p in enumerate(order)
                if not any(q[0] <= p[0] and q[1] <= p[1] and q[2] <= p[2] and q[3] >= p[3] and q[4] <= p[4]
                           and q[5] <= p[5] for q in order[:i])]
        assert pareto_front(pts) == want


def test_slice_plan_fits_is_memory_bytes_at_every_stage():
    """SlicePlan.fits (inlined) agrees with StageCost.memory_bytes at every pipeline position."""
    isl = island("a100-40gb")
    q = query(load_model("gpt3-1.3b"), isl, b=4, gb=32)
    res = MegatronParallelizer().query(q)
    m = q.num_microbatches
    assert res.plans
    for plan in res.plans[:20]:
        n = len(plan.stages)
        for after in (0, 1, 3, m):
            peak = max(st.memory_bytes(after + n - 1 - j, m) for j, st in enumerate(plan.stages))
            for cap in (peak, peak * (1 - 1e-9)):
                assert plan.fits(after, m, cap) == (peak <= cap)


@settings(max_examples=60, deadline=None)
@given(hst.lists(hst.tuples(hst.integers(0, 2), hst.integers(1, 3), hst.floats(0.1, 2.0), hst.floats(0.0, 1.0),
                            hst.integers(0, 3), hst.data()), min_size=1, max_size=40))
def test_the_answer_holds_each_grids_own_front_and_the_class_front(raw):
    """Under any runtime the answer holds the class's Pareto front and each grid's own front (a one-grid pipeline
    can win interleaved with plans another grid beats under 1F1B): a point stands only for points of its own ports
    (megatron.exact_front), a rule that implies the closed form's dominance."""
    grids = [ParallelConfig(tp=tp, pp=1, dp=dp) for tp, dp in ((1, 4), (2, 2), (4, 1))]
    pts, times = [], {}
    for g, pp, tail, _, depth, data in raw:
        grid = dataclasses.replace(grids[g], pp=pp)
        stages = tuple(data.draw(hst.tuples(hst.floats(0.0, 1.0), hst.floats(0.0, 1.0))) for _ in range(pp))
        pt = (max(f + b for f, b in stages), sum(f + b for f, b in stages), tail, depth, pp, pp * 4, grid, len(pts))
        times[pt[-1]] = stages
        pts.append(pt)
    got = {id(p) for p in megatron_mod._front({(): pts}, lambda p: times[p[-1]])}
    assert {id(p) for p in megatron_mod.pareto_front(pts)} <= got
    for g in {p[6] for p in pts}:
        assert {id(p) for p in megatron_mod.pareto_front([p for p in pts if p[6] == g])} <= got
