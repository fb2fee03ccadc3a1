"""End-to-end calibration of the cost model against published training throughput.

Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using Megatron-LM" (SC'21),
Table 1: GPT models (vocab 51200, s = 2048) on A100-80GB nodes of Selene (8 GPUs, NVLink/NVSwitch, 8 x 200 Gb/s
HDR per node), fp16, full activation recomputation; achieved "hardware" TFLOP/s per GPU counted with their eq. (3),
96 B s l h^2 (1 + s/(6h) + V/(16 l h)). 2021 Megatron-LM had no FlashAttention, so the unfused attention path is
costed (flash_attention=False). Micro-batch size 1 is assumed (the table does not list it).

Grattafiori et al. 2024, "The Llama 3 herd of models", Table 4: Llama 3 405B on 8,192 H100s, TP 8, PP 16, DP 64,
s = 8192, 16M tokens per batch: 430 TFLOP/s per GPU, 43 % BF16 MFU (38-43 % across their configurations).

One layer's forward + backward time measured on an H200 (this project's device check, recorded below), priced at
the isolated large-GEMM share GEMM_EFFICIENCY (0.70; the profiler measured 0.69 on that GPU in the same check).

Table 1 is split in two: the GEMM efficiency is fitted on the even rows and the odd rows test it, within 7 % (a
20 % error in the efficiency puts 4-5 held-out rows 7-19 % off, checked below). The shipped A100 figure
(GEMM_EFFICIENCY_BY_GPU, issue 13) is that even-row fit, rounded. The shipped model predicts 0.94-1.06x the
published throughput on every row of Table 1.
"""
import math

import pytest

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.pipeline import iteration_time_s
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, LinkSpec
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec

ANY = RuntimeCapabilities(name="any")

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def island(gpu_type, nodes, net_gbps, *, gemm_efficiency: float | None = None):
    """``nodes`` x 8 GPUs; ``gemm_efficiency`` replaces the shipped GEMM_EFFICIENCY (as a measured GEMM figure)."""
    from tangram_launch.costmodel.efficiency import peak_tflops_for

    gpu = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}},
                                 "nodes": [{"name": "x", "gpu": gpu_type, "count": 1}]}).nodes[0].gpus[0]
    if gemm_efficiency is not None:
        measured = {"gemm_tflops": {d: peak_tflops_for(gpu, d) * gemm_efficiency for d in ("fp16", "bf16")}}
        gpu = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}}, "nodes": [
            {"name": "x", "gpus": [{"type": gpu_type, "measured": measured}]}]}).nodes[0].gpus[0]
    names = tuple(f"n{i}" for i in range(nodes))
    return Island(name=gpu_type, nodes=names, gpus=tuple(GpuRef(n, k) for n in names for k in range(8)),
                  gpus_per_node=8, gpu=gpu, inter_node_link=LinkSpec(net_gbps, 2.0) if nodes > 1 else None)


def table_1_prediction(row, gemm_efficiency: float | None = None) -> tuple[float, bool]:
    """(predicted / published TFLOP/s per GPU, whether the configuration fits the 80 GB GPUs it ran on)."""
    params, a, h, layers, tp, pp, n, batch, published = row
    model = ModelSpec(name=f"gpt-{params}b", num_layers=layers, hidden_size=h, num_heads=a, num_kv_heads=a,
                      ffn_hidden_size=4 * h, vocab_size=51200, max_seq_len=2048, tied_embeddings=True)
    dp = n // (tp * pp)
    tr = TrainingSpec(global_batch=batch, seq_len=2048, dtype="fp16")
    q = SliceQuery(model=model, training=tr, layers=(0, layers),
                   island=island("a100-80gb", n // 8, 200.0, gemm_efficiency=gemm_efficiency),
                   microbatch_sequences=dp, capabilities=ANY)
    coster = SliceCoster(q, flash_attention=False)
    plan = coster.plan(ParallelConfig(tp=tp, pp=pp, dp=dp, recompute="full"))
    est = iteration_time_s(plan.stages, q.num_microbatches)
    s, v = 2048, 51200
    hardware_flops = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    predicted = hardware_flops / est["iteration_s"] / n / 1e12
    return predicted / published, plan.fits(0, q.num_microbatches, 80 * 1024**3)


FIT_ROWS, HELD_OUT_ROWS = NARAYANAN_TABLE_1[0::2], NARAYANAN_TABLE_1[1::2]
HELD_OUT_TOLERANCE = 0.07


def fit_gemm_efficiency(rows) -> float:
    """The efficiency minimising the squared log error of predicted against published throughput (golden section)."""
    def loss(e):
        return sum(math.log(table_1_prediction(r, e)[0]) ** 2 for r in rows)

    lo, hi, g = 0.3, 1.0, (math.sqrt(5) - 1) / 2
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    loss_c, loss_d = loss(c), loss(d)
    for _ in range(30):  # each step keeps one inner point and its loss: one new evaluation per step
        if loss_c < loss_d:
            hi, d, loss_d = d, c, loss_c
            c = hi - g * (hi - lo)
            loss_c = loss(c)
        else:
            lo, c, loss_c = c, d, loss_d
            d = lo + g * (hi - lo)
            loss_d = loss(d)
    return (lo + hi) / 2


@pytest.fixture(scope="module")
def fitted_efficiency():
    return fit_gemm_efficiency(FIT_ROWS)


def held_out_errors(gemm_efficiency: float) -> list[float]:
    return [table_1_prediction(r, gemm_efficiency)[0] - 1 for r in HELD_OUT_ROWS]


def test_efficiency_fitted_on_half_of_table_1_predicts_the_other_half(fitted_efficiency):
    from tangram_launch.costmodel.efficiency import gemm_efficiency_for

    assert 0.5 < fitted_efficiency < 0.95  # a plausible fraction of the A100's dense peak
    assert gemm_efficiency_for("a100-80gb") == pytest.approx(fitted_efficiency, abs=0.01)  # what ships is this fit
    errors = held_out_errors(fitted_efficiency)
    assert max(abs(e) for e in errors) <= HELD_OUT_TOLERANCE, [f"{e:+.1%}" for e in errors]


@pytest.mark.parametrize("factor", [0.8, 1.2])
def test_held_out_check_fails_with_the_efficiency_20_percent_off(fitted_efficiency, factor):
    errors = held_out_errors(fitted_efficiency * factor)
    assert sum(abs(e) > HELD_OUT_TOLERANCE for e in errors) >= 4, [f"{e:+.1%}" for e in errors]


# The shipped model predicts 0.94-1.06x the published throughput on every row of Table 1 (issue 13: the A100 GEMM
# efficiency fitted on the even rows; before it, one constant for every GPU gave 0.89-0.99x).
SHIPPED_BAND = (0.93, 1.07)


@pytest.mark.parametrize("row", NARAYANAN_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_shipped_model_against_table_1(row):
    ratio, fits = table_1_prediction(row)
    assert SHIPPED_BAND[0] <= ratio <= SHIPPED_BAND[1], f"{ratio:.3f}"
    assert fits  # and the configuration fits the 80 GB GPUs it ran on


def test_shipped_band_fails_with_the_shipped_efficiency_20_percent_off():
    from tangram_launch.costmodel.efficiency import gemm_efficiency_for

    for factor in (0.8, 1.2):
        ratios = [table_1_prediction(r, gemm_efficiency_for("a100-80gb") * factor)[0] for r in NARAYANAN_TABLE_1]
        outside = [r for r in ratios if not SHIPPED_BAND[0] <= r <= SHIPPED_BAND[1]]
        assert len(outside) >= 5, (factor, [f"{r:.3f}" for r in ratios])


def test_llama3_405b_h100_mfu():
    """Llama 3 runs interleaved 1F1B (bubble (p-1)/(v m)); our 1F1B has the larger (p-1)/m bubble, so compare the
    steady state: m x bottleneck + DP sync, which must give an MFU within 38-55 % (published: 38-43 % end to end,
    with their smaller bubble on top); the full 1F1B estimate must be lower but above 30 %."""
    model = load_model("llama3-405b")
    tr = TrainingSpec(global_batch=2048, seq_len=8192, dtype="bf16")
    q = SliceQuery(model=model, training=tr, layers=(0, 126), island=island("h100-sxm", 1024, 400.0),
                   microbatch_sequences=64, capabilities=ANY)
    coster = SliceCoster(q)
    plan = coster.plan(ParallelConfig(tp=8, pp=16, dp=64, zero_stage=1))
    m = q.num_microbatches
    est = iteration_time_s(plan.stages, m)
    model_flops = 3 * model.forward_flops_per_token(8192) * tr.tokens_per_iteration
    peak = 8192 * coster.dev.peak_flops
    steady = m * est["bottleneck_s"] + est["sync_s"]
    assert 0.38 <= model_flops / (steady * peak) <= 0.55
    assert 0.30 <= model_flops / (est["iteration_s"] * peak) < model_flops / (steady * peak)


# One transformer layer, forward + backward, bf16, eager PyTorch with F.scaled_dot_product_attention (flash), on one
# NVIDIA H200 (device check run 2026-11-29; torch 2.11, CUDA 13): (model, mbs, seq) -> measured milliseconds.
# An isolated layer on an idle GPU runs its GEMMs at the isolated share GEMM_EFFICIENCY (the same run's profile
# measured 682 TFLOP/s, 0.69 of the peak: benchmarks/README.md, H200), above the whole-job figure the catalog holds
# for GH100 parts (costmodel/efficiency.py), so the layer is priced at that share, as a measured GEMM figure.
H200_LAYER_FWD_BWD_MS = {
    ("gpt3-13b", 1, 2048): 6.314, ("gpt3-13b", 4, 2048): 24.52, ("gpt3-13b", 1, 8192): 27.74,
    ("llama3-8b", 1, 2048): 4.801, ("llama3-8b", 4, 2048): 18.68, ("llama3-8b", 1, 8192): 21.22,
}


@pytest.mark.parametrize("key", sorted(H200_LAYER_FWD_BWD_MS), ids=lambda k: f"{k[0]}-b{k[1]}-s{k[2]}")
def test_layer_time_matches_h200_measurement(key):
    from tangram_launch.costmodel.compute import layer_compute
    from tangram_launch.costmodel.efficiency import DeviceModel

    name, mbs, seq = key
    from tangram_launch.costmodel.efficiency import GEMM_EFFICIENCY

    spec = island("h200", 1, 25.0, gemm_efficiency=GEMM_EFFICIENCY).gpu
    lc = layer_compute(load_model(name), 0, seq_len=seq, mbs=mbs, tp=1, cp=1, ep=1,
                       dev=DeviceModel.from_gpu(spec, "bf16"))
    predicted_ms = (lc.forward_s + lc.backward_s) * 1e3
    assert predicted_ms == pytest.approx(H200_LAYER_FWD_BWD_MS[key], rel=0.10)
