"""FP8 training keeps the inputs of its FP8 GEMMs in FP8 where the runtime is Transformer Engine (Megatron's FP8 path):
its Linear saves the FP8 cast of its input for the weight gradient, its LayerNormLinear the FP8 normalised output
beside the 16-bit norm input. torchao's Float8Linear (torchtitan) saves its 16-bit inputs instead
(memory.layer_activation_bytes, SliceCoster's fp8_gemm_inputs)."""
from __future__ import annotations

import pytest
from test_costmodel_runtime_variants import _island
from test_published_runs import bench, data  # noqa: F401  (fixtures: the benchmark module and its data file)

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION, layer_activation_bytes
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec

S, B = 2048, 2


def _gpt3() -> ModelSpec:
    return ModelSpec(name="gpt3-175b", num_layers=2, hidden_size=12288, num_heads=96, num_kv_heads=96,
                     ffn_hidden_size=4 * 12288, vocab_size=51200, max_seq_len=2048, tied_embeddings=True)


@pytest.mark.unit
@pytest.mark.parametrize("tp", [1, 8])
def test_fp8_gemm_inputs_take_seven_of_korthikantis_34(tp):
    """Korthikanti et al. 2022's 34 s b h under selective recompute: the QKV input (2), the output projection's
    input (2), the first FFN GEMM's input (2) and the GeLU output, the down GEMM's input (8), halve: 27 s b h."""
    m, h = _gpt3(), 12288
    bf16 = layer_activation_bytes(m, 0, seq_len=S, mbs=B, tp=tp, recompute="selective")
    fp8 = layer_activation_bytes(m, 0, seq_len=S, mbs=B, tp=tp, recompute="selective", fp8_gemm_inputs=True)
    assert bf16 == pytest.approx(34 * S * B * h / tp)
    assert fp8 == pytest.approx(27 * S * B * h / tp)


@pytest.mark.unit
def test_without_sequence_parallelism_the_replicated_gemm_inputs_are_fp8_too():
    """Without SP each TP rank keeps the two norms' inputs (4), the QKV and first FFN inputs (2 x 1 in FP8) and the
    two dropout masks (2) whole: s b h (8 + 19 / t), where bf16 keeps s b h (10 + 24 / t)."""
    m, h, tp = _gpt3(), 12288, 4
    fp8 = layer_activation_bytes(m, 0, seq_len=S, mbs=B, tp=tp, recompute="selective", sequence_parallel=False,
                                 fp8_gemm_inputs=True)
    assert fp8 == pytest.approx(S * B * h * (8 + 19 / tp))


@pytest.mark.unit
def test_a_flash_kernel_without_recompute_keeps_its_own_16_bit_output():
    """Llama 3 8B, flash attention: without recompute the kernel keeps its 16-bit output for its backward beside
    the projection's FP8 copy (one q-wide byte more), with selective recompute only the FP8 copy is kept."""
    m = load_model("llama3-8b")
    h, q, f = m.hidden_size, m.q_dim, m.ffn_hidden_size
    for recompute, saved_per_token in (("none", 2 * h + f - q), ("selective", 2 * h + f + q)):
        bf16 = layer_activation_bytes(m, 0, seq_len=S, mbs=B, recompute=recompute, flash=True)
        fp8 = layer_activation_bytes(m, 0, seq_len=S, mbs=B, recompute=recompute, flash=True, fp8_gemm_inputs=True)
        assert bf16 - fp8 == pytest.approx(S * B * saved_per_token)
    full = [layer_activation_bytes(m, 0, seq_len=S, mbs=B, recompute="full", flash=True, fp8_gemm_inputs=x)
            for x in (False, True)]
    assert full[0] == full[1]  # only the layer input, 16-bit, is kept


def _activations(dtype: str, fp8_gemm_inputs: bool) -> float:
    m = load_model("llama3-8b")
    tr = TrainingSpec(global_batch=64, seq_len=S, dtype=dtype)
    q = SliceQuery(model=m, training=tr, layers=(0, m.num_layers), island=_island("h100-sxm"),
                   microbatch_sequences=B * 8, capabilities=RuntimeCapabilities(name="any"), pipelined=False)
    coster = SliceCoster(q, fp8_gemm_inputs=fp8_gemm_inputs)
    plan = coster.plan(ParallelConfig(tp=1, pp=1, dp=8, recompute="selective"), parallelizer="test")
    return plan.stages[0].breakdown["activations_bytes"]


@pytest.mark.unit
def test_the_coster_keeps_fp8_gemm_inputs_only_when_training_in_fp8():
    m = load_model("llama3-8b")
    h, q, f = m.hidden_size, m.q_dim, m.ffn_hidden_size
    assert _activations("bf16", True) == _activations("bf16", False)
    saved = _activations("fp8", False) - _activations("fp8", True)
    want = m.num_layers * S * B * (2 * h + f + q) * (1 + FRAGMENTATION_FRACTION)
    assert saved == pytest.approx(want)


@pytest.mark.unit
def test_torchao_fp8_rows_keep_16_bit_gemm_inputs_and_transformer_engine_rows_fp8(data):
    fp8_rows = [r for r in data["runs"] if r["parallel"].get("dtype") == "fp8"]
    torchao = [r for r in fp8_rows if "torchtitan" in r.get("framework", "")]
    assert torchao and len(torchao) < len(fp8_rows)
    for r in fp8_rows:
        declared = (r.get("runtime") or {}).get("fp8_gemm_inputs", True)
        assert declared is (r not in torchao), r["id"]
