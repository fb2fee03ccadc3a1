"""The GEMM-shape sweep: measured by the profiler, written into the cluster profile, refused when damaged, and
interpolated by the cost model (between measured neighbours, monotone where they are, the catalog curve where
nothing is measured)."""
from __future__ import annotations

import math
import time

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bad_inputs import run_cli
from profiler import bench
from profiler.assemble import DeviceRecord, NodeRecord, ProfileRecord, assemble_cluster
from profiler.inventory import read_node_inventory
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.gemm_curve import SMALL_SHAPES, MeasuredGemmCurve, sweep_shapes
from tangram_launch.errors import SpecError
from tangram_launch.islands import build_islands
from tangram_launch.planner import PlannerOptions, make_plan
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec
from test_profiler_inventory import fake

BOUNDED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
dims = st.integers(min_value=1, max_value=8192)
shapes = st.tuples(dims, dims, dims)


def flat_catalog(m: float, n: float, k: float) -> float:
    return 100e12  # FLOP/s: a catalog curve that ignores shape (the properties must not lean on it)


def flops(shape) -> float:
    return 2.0 * shape[0] * shape[1] * shape[2]


# --------------------------------------------------------------------------------------------- interpolation

@BOUNDED
@given(points=st.dictionaries(shapes, st.floats(min_value=0.01, max_value=2000), min_size=2, max_size=12),
       query=shapes)
def test_inside_the_measured_range_the_rate_stays_between_its_measured_neighbours(points, query):
    curve = MeasuredGemmCurve.from_rows([[*s, t] for s, t in points.items()])
    got = curve.flops_per_s(*query, flat_catalog) / 1e12
    if query in points:
        assert got == pytest.approx(points[query])  # a measured shape is its own figure
        return
    q = flops(query)
    below = [s for s in points if flops(s) <= q]
    above = [s for s in points if flops(s) >= q]
    if not below or not above:
        return  # outside the range: the next test
    lo_f, hi_f = max(flops(s) for s in below), min(flops(s) for s in above)
    near = [t for s, t in points.items() if flops(s) in (lo_f, hi_f)]
    assert min(near) * (1 - 1e-9) <= got <= max(near) * (1 + 1e-9)


@BOUNDED
@given(sizes=st.lists(st.integers(min_value=8, max_value=4096), min_size=2, max_size=10, unique=True),
       gains=st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=10, max_size=10),
       q1=shapes, q2=shapes)
def test_where_the_measured_rate_rises_with_size_the_curve_does_too(sizes, gains, q1, q2):
    sizes = sorted(sizes)
    rates = [1.0 + sum(gains[: i + 1]) for i in range(len(sizes))]  # non-decreasing in FLOPs
    curve = MeasuredGemmCurve.from_rows([[s, s, s, r] for s, r in zip(sizes, rates)])
    lo, hi = flops((sizes[0],) * 3), flops((sizes[-1],) * 3)
    inside = [q for q in (q1, q2) if lo <= flops(q) <= hi]
    if len(inside) < 2:
        return
    a, b = sorted(inside, key=flops)
    assert curve.flops_per_s(*a, flat_catalog) <= curve.flops_per_s(*b, flat_catalog) * (1 + 1e-9)


@BOUNDED
@given(points=st.dictionaries(shapes, st.floats(min_value=0.01, max_value=2000), min_size=1, max_size=6),
       query=shapes)
def test_outside_the_measured_range_the_catalog_curve_is_scaled_to_the_nearest_end(points, query):
    dev = DeviceModel.from_gpu(_gpu("a100-80gb"), "bf16")
    catalog = dev.roofline_flops_per_s
    curve = MeasuredGemmCurve.from_rows([[*s, t] for s, t in points.items()])
    q = flops(query)
    lo, hi = min(map(flops, points)), max(map(flops, points))
    if lo <= q <= hi or query in points:
        return
    end = [s for s in points if flops(s) == (lo if q < lo else hi)]
    ratio = sum(points[s] * 1e12 / catalog(*s) for s in end) / len(end)
    assert curve.flops_per_s(*query, catalog) == pytest.approx(catalog(*query) * ratio)


def _gpu(gpu_type: str, measured: dict | None = None):
    entry = {"type": gpu_type, **({"measured": measured} if measured else {})}
    return ClusterSpec.from_dict({"nodes": [{"name": "n", "gpus": [entry]}]}).nodes[0].gpus[0]


def test_without_a_sweep_the_catalog_curve_prices_every_gemm():
    plain = DeviceModel.from_gpu(_gpu("h100-sxm"), "bf16")
    swept_bf16 = DeviceModel.from_gpu(_gpu("h100-sxm", {"gemm_sweep_tflops": {"bf16": [[4096, 4096, 4096, 300.0]]}}),
                                      "fp16")
    assert plain.gemm_curve is None and swept_bf16.gemm_curve is None  # a dtype without a sweep keeps the catalog
    for m, n, k in ((1, 1, 1), (4096, 512, 4096), (8192, 8192, 8192)):
        roofline = 2.0 * m * n * k / plain.gemm_flops + 2 * (m * k + k * n + m * n) / plain.memory_bandwidth
        assert plain.gemm_s(m, n, k) == pytest.approx(roofline)
        assert swept_bf16.gemm_s(m, n, k) == pytest.approx(roofline)
    swept = DeviceModel.from_gpu(_gpu("h100-sxm", {"gemm_sweep_tflops": {"bf16": [[4096, 4096, 4096, 300.0]]}}),
                                 "bf16")
    assert "gemm_sweep_tflops" in swept.sources
    assert swept.gemm_s(4096, 4096, 4096) == pytest.approx(2 * 4096**3 / 300e12)


@BOUNDED
@given(query=shapes)
def test_profiled_gpus_of_two_generations_price_gemms_alike_when_they_measured_alike(query):
    """The per-generation large-GEMM figure prices nothing on a profiled GPU: an A100 and an H100 that measured the
    same sweep, large GEMM and memory bandwidth price every GEMM the same, inside and outside the swept range."""
    measured = {"gemm_sweep_tflops": {"bf16": [[512, 512, 512, 80.0], [4096, 4096, 4096, 240.0]]},
                "gemm_tflops": {"bf16": 250.0}, "memory_bandwidth_GBps": 1700.0}
    a100, h100 = (DeviceModel.from_gpu(_gpu(t, measured), "bf16") for t in ("a100-80gb", "h100-sxm"))
    assert a100.gemm_s(*query) == pytest.approx(h100.gemm_s(*query))


def test_tf32_reads_the_sweep_of_the_mode_the_gpu_runs():
    sweep = {"tf32": [[2048, 2048, 2048, 90.0]], "fp32": [[2048, 2048, 2048, 15.0]]}
    a100 = DeviceModel.from_gpu(_gpu("a100-80gb", {"gemm_sweep_tflops": sweep}), "tf32")
    v100 = DeviceModel.from_gpu(_gpu("v100-32gb", {"gemm_sweep_tflops": sweep}), "tf32")
    assert a100.gemm_s(2048, 2048, 2048) == pytest.approx(2 * 2048**3 / 90e12)
    assert v100.gemm_s(2048, 2048, 2048) == pytest.approx(2 * 2048**3 / 15e12)  # no TF32: strict FP32


def test_an_island_prices_the_shapes_all_its_gpus_swept_at_the_slowest_rate():
    fast = {"gemm_sweep_tflops": {"bf16": [[1024, 1024, 1024, 200.0], [2048, 2048, 2048, 250.0]],
                                  "fp16": [[1024, 1024, 1024, 190.0]]}}
    slow = {"gemm_sweep_tflops": {"bf16": [[1024, 1024, 1024, 150.0], [4096, 4096, 4096, 260.0]]}}
    spec = ClusterSpec.from_dict({"nodes": [{"name": "n0", "gpus": [{"type": "a100-80gb", "measured": fast},
                                                                    {"type": "a100-80gb", "measured": slow}]}]})
    (island,) = build_islands(spec).islands
    assert island.gpu.measured["gemm_sweep_tflops"] == {"bf16": [[1024, 1024, 1024, 150.0]]}


# --------------------------------------------------------------------------------------------- the sweep's shapes

def test_the_sweep_covers_each_layer_gemm_at_every_tp_degree_the_planner_tries():
    model = load_model("llama3-8b")
    got = set(sweep_shapes(model, tokens=4096))
    h, q, kv, f, v = 4096, model.q_dim, model.kv_dim, model.ffn_hidden_size, model.vocab_size
    for t in (1, 2, 4, 8):
        assert {(4096, (q + 2 * kv) // t, h), (4096, h, q // t), (4096, 2 * f // t, h), (4096, h, f // t),
                (4096, v // t, h)} <= got
    assert set(SMALL_SHAPES) <= got
    moe = load_model("tiny-moe")
    m_e = round(512 * moe.top_k / moe.num_experts)
    assert (m_e, moe.hidden_size, moe.expert_ffn_hidden_size) in set(sweep_shapes(moe, tokens=512))


def test_the_sweep_covers_the_expert_gemms_at_each_ep_degree():
    """Under EP a rank's experts take the tokens of ep ranks (M k ep / E each, compute.layer_compute), so the sweep
    measures the expert GEMMs at those token counts too: Qwen3-30B-A3B (128 experts, top-8) at 4096 tokens has
    256 tokens per expert at EP 1 and 2048 at EP 8."""
    moe = load_model("qwen3-30b-a3b")
    got = set(sweep_shapes(moe, tokens=4096))
    for ep in (1, 2, 4, 8):
        m_e = 4096 * 8 * ep // 128
        assert (m_e, moe.hidden_size, moe.expert_ffn_hidden_size) in got
        assert (m_e, 2 * moe.expert_ffn_hidden_size, moe.hidden_size) in got


# --------------------------------------------------------------------------------------------- the planner

MODEL = ModelSpec(name="g8", num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096,
                  vocab_size=8000, max_seq_len=512)
TRAIN = TrainingSpec(global_batch=8, seq_len=512, dtype="bf16")


def _cluster(measured: dict | None) -> ClusterSpec:
    gpu = {"type": "a100-80gb", **({"measured": measured} if measured else {})}
    return ClusterSpec.from_dict({"name": "one", "nodes": [{"name": "n0", "gpus": [gpu] * 2}]})


def _per_layer_forward_s(plan) -> list[float]:
    return [p.forward_s / (s.layers[1] - s.layers[0]) for s, p in zip(plan.stages, plan.predicted.stages)]


def test_a_measured_sweep_changes_the_plans_per_layer_compute_time():
    """Sweep points at a third of what the catalog curve expects for this model's own layer GEMMs: every stage's
    per-layer forward time grows (the catalog curve alone would price them as before)."""
    dev = DeviceModel.from_gpu(_gpu("a100-80gb"), "bf16")
    rows = [[m, n, k, round(dev.roofline_flops_per_s(m, n, k) / 3e12, 3)]
            for m, n, k in sweep_shapes(MODEL, tokens=TRAIN.seq_len)]
    opts = PlannerOptions(max_workers=1)
    base = make_plan(_cluster(None), MODEL, TRAIN, options=opts)
    slow = make_plan(_cluster({"gemm_sweep_tflops": {"bf16": rows}}), MODEL, TRAIN, options=opts)
    assert base.predicted.iteration_time_s < slow.predicted.iteration_time_s
    assert min(_per_layer_forward_s(slow)) > max(_per_layer_forward_s(base)) * 1.3


# --------------------------------------------------------------------------------------------- the profiler

@pytest.mark.slow
def test_the_profiler_sweeps_on_cpu_within_its_budget_and_writes_the_table():
    cfg = bench.BenchConfig.for_device("cpu", quick=True, budget_s=1.0)
    cpu = torch.device("cpu")
    large = bench.gemm_tflops(cpu, "fp32", cfg)
    # the last one, 0.55 TFLOP, takes seconds on any CPU: the budget leaves it out
    shapes = sweep_shapes(load_model("tiny"), tokens=128) + [(4096, 8192, 8192)]
    started = time.perf_counter()
    sweep = bench.gemm_sweep(cpu, "fp32", shapes, cfg, tflops_hint=large.value)
    assert time.perf_counter() - started < cfg.budget_s + 2.0  # the budget, and a last repetition's overrun
    assert len(sweep) >= 2 and all(m.value > 0 and m.unit == "TFLOP/s" for m in sweep)
    measured_shapes = [tuple(dict(m.detail)["shape_mnk"]) for m in sweep]
    assert measured_shapes == shapes[: len(sweep)] and shapes[-1] not in measured_shapes  # fewest FLOPs first
    for m in sweep:
        a, b, c = dict(m.detail)["shape_mnk"]
        assert m.value == pytest.approx(2 * a * b * c / m.timing.median_s / 1e12)

    inv = read_node_inventory(fake.FakeNvml(None), infiniband_root="/nonexistent", host="box")
    record = ProfileRecord(
        devices=(DeviceRecord(rank=0, local_rank=0, node_rank=0, host="box", device="cpu", gemm={"fp32": large},
                              memory_bandwidth=bench.Measured(10.0, "GB/s", bench.Timing((1.0,))),
                              gemm_sweep={"fp32": tuple(sweep)}),),
        nodes=(NodeRecord(node_rank=0, host="box", inventory=inv, ranks=(0,)),), links=(), backend="gloo",
        quick=True, bench=cfg.to_dict(), started_at="t0", finished_at="t1", wall_s=1.0)
    spec = ClusterSpec.from_dict(yaml.safe_load(yaml.safe_dump(assemble_cluster(record))))
    gpu = spec.nodes[0].gpus[0]
    table = gpu.measured["gemm_sweep_tflops"]["fp32"]
    m_, k_, n_ = dict(large.detail)["shape_mkn"]  # the large GEMM is a point of the same table
    assert [tuple(r[:3]) for r in table] == sorted({*measured_shapes, (m_, n_, k_)}, key=lambda s: (math.prod(s), s))
    dev = DeviceModel.from_gpu(gpu, "fp32")
    for (a, b, c), m in zip(measured_shapes, sweep):  # the cost model prices each measured shape as measured
        assert dev.gemm_s(a, b, c) == pytest.approx(2 * a * b * c / (m.value * 1e12), rel=1e-3)


# --------------------------------------------------------------------------------------------- bad data

BAD_ROWS = [
    ({"bf16": [[64, 64, 64, 1.0], [64, 64, 128, -2.0]]}, "gemm_sweep_tflops.bf16[1].tflops"),
    ({"bf16": [[64, 64.5, 64, 1.0]]}, "gemm_sweep_tflops.bf16[0].n"),
    ({"bf16": [[64, 64, 1.0]]}, "gemm_sweep_tflops.bf16[0]"),
    ({"bf16": [[64, 64, 64, 1.0], [64, 64, 64, 2.0]]}, "gemm_sweep_tflops.bf16[1]"),
    ({"bf17": [[64, 64, 64, 1.0]]}, "gemm_sweep_tflops.bf17"),
    ({"bf16": []}, "gemm_sweep_tflops.bf16"),
    ([[64, 64, 64, 1.0]], "gemm_sweep_tflops"),
]


@pytest.mark.parametrize("sweep,field", BAD_ROWS, ids=[f for _, f in BAD_ROWS])
def test_bad_sweep_data_is_refused_naming_the_field(sweep, field):
    with pytest.raises(SpecError) as err:
        _cluster({"gemm_sweep_tflops": sweep})
    assert err.value.field.endswith(field)


def test_the_cli_refuses_a_profile_with_bad_sweep_data_with_exit_2(tmp_path):
    doc = {"name": "bad", "nodes": [{"name": "n0", "gpus": [{"type": "a100-80gb", "measured": {
        "gemm_sweep_tflops": {"bf16": [[4096, 4096, 4096, 250.0], [4096, 1024, 4096, "fast"]]}}}]}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, err, _ = run_cli(["islands", "--cluster", str(path)])
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "measured.gemm_sweep_tflops.bf16[1].tflops" in err and "cluster.yaml" in err, err[-2000:]
