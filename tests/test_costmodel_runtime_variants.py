"""What a runtime really did, as cost-model options (issue 13, memory): TP without sequence parallelism (Korthikanti et
al. 2022, Table 2), torchtitan's op-level selective activation checkpointing, and 16-bit .grad tensors kept beside
the fp32 gradient buffer (DeepSpeed's BF16_Optimizer under pipeline parallelism). The defaults are what the planner
assumes, so its plans do not move."""
from __future__ import annotations

import pytest

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.memory import (
    korthikanti_activation_bytes,
    layer_activation_bytes,
    op_sac_bytes_per_token,
)
from tangram_launch.errors import SpecError
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.cluster import ClusterSpec, GpuRef
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec


def _island(gpu_type: str = "a100-80gb", n: int = 8) -> Island:
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}},
                                  "nodes": [{"name": "n0", "gpu": gpu_type, "count": n}]})
    return Island(name=gpu_type, nodes=("n0",), gpus=tuple(GpuRef("n0", k) for k in range(n)), gpus_per_node=n,
                  gpu=spec.nodes[0].gpus[0], inter_node_link=None)


def _coster(model: ModelSpec, *, b: int = 8, gb: int = 64, seq: int = 2048, **kw) -> SliceCoster:
    tr = TrainingSpec(global_batch=gb, seq_len=seq, dtype="bf16")
    q = SliceQuery(model=model, training=tr, layers=(0, model.num_layers), island=_island(),
                   microbatch_sequences=b, capabilities=RuntimeCapabilities(name="any"), pipelined=True)
    return SliceCoster(q, **kw)


def _gpt(h: int = 4096, a: int = 32, layers: int = 4) -> ModelSpec:
    return ModelSpec(name="gpt-test", num_layers=layers, hidden_size=h, num_heads=a, num_kv_heads=a,
                     ffn_hidden_size=4 * h, vocab_size=51200, max_seq_len=2048, tied_embeddings=True)


# ------------------------------------------------------------------------------------------------ no SP
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_tp_without_sequence_parallelism_reproduces_korthikanti_table_2(tp, recompute):
    """Table 2, row "tensor parallel" (no SP): s b h (10 + 24/t + 5 a s/(h t)); full recompute keeps 2 s b h
    whole on every rank."""
    m = ModelSpec(name="gpt3-175b", num_layers=2, hidden_size=12288, num_heads=96, num_kv_heads=96,
                  ffn_hidden_size=4 * 12288, vocab_size=51200, max_seq_len=2048, tied_embeddings=True)
    got = layer_activation_bytes(m, 0, seq_len=2048, mbs=2, tp=tp, recompute=recompute, flash=False,
                                 sequence_parallel=False)
    want = korthikanti_activation_bytes(2048, 2, 12288, 96, tp, recompute=recompute, sequence_parallel=False)
    assert got == pytest.approx(want)
    with_sp = layer_activation_bytes(m, 0, seq_len=2048, mbs=2, tp=tp, recompute=recompute, flash=False)
    assert got > with_sp


def test_without_tp_sequence_parallelism_changes_nothing():
    m = load_model("llama3-8b")
    for r in ("none", "selective", "full"):
        assert (layer_activation_bytes(m, 0, seq_len=4096, mbs=1, recompute=r, flash=True, sequence_parallel=False)
                == layer_activation_bytes(m, 0, seq_len=4096, mbs=1, recompute=r, flash=True))


# ------------------------------------------------------------------------------------------------ op-level SAC
def test_op_sac_keeps_every_other_mm_output_of_a_llama_block():
    """torchtitan's policy over wq, wk, wv, wo, w1, w3, w2: saves wq, wv, w1, w2 (1st, 3rd, 5th, 7th), the
    attention output and its fp32 log-sum-exp, and the block input."""
    m = load_model("llama3-8b")
    h, q, kv, f, heads = 4096, 4096, 1024, 14336, 32
    sharded, whole = op_sac_bytes_per_token(m, 0)
    assert sharded == 2 * (q + kv + f) + 2 * q + 4 * heads + 2 * h  # column-parallel outputs, attention, input
    assert whole == 2 * h  # w2's output is saved before the row-parallel reduction: h wide on every TP rank
    sac = layer_activation_bytes(m, 0, seq_len=8192, mbs=2, recompute="selective", flash=True,
                                 selective_policy="op-sac")
    assert sac == pytest.approx(2 * 8192 * (sharded + whole))
    megatron = layer_activation_bytes(m, 0, seq_len=8192, mbs=2, recompute="selective", flash=True)
    full = layer_activation_bytes(m, 0, seq_len=8192, mbs=2, recompute="full", flash=True)
    assert full < sac < 0.6 * megatron  # op-level SAC recomputes the norms and SwiGLU that Megatron keeps


def test_op_sac_recomputes_every_second_mm_and_the_elementwise_work():
    m = load_model("llama3-8b")
    dev = DeviceModel.from_gpu(_island("h100-sxm").gpu, "bf16")
    lc = layer_compute(m, 0, seq_len=8192, mbs=2, tp=1, cp=1, ep=1, dev=dev)
    tokens = 2 * 8192
    h, kv, f = 4096, 1024, 14336
    wk, wo, w3 = dev.gemm_s(tokens, kv, h), dev.gemm_s(tokens, h, 4096), dev.gemm_s(tokens, f, h)
    assert lc.recompute_s("selective", "op-sac") == pytest.approx(lc.elementwise_s + wk + wo + w3)
    assert lc.recompute_flops("selective", "op-sac") == pytest.approx(2 * tokens * (kv * h + h * 4096 + f * h))
    assert lc.recompute_s("selective") == lc.attention_core_s  # the default stays Megatron's
    assert lc.recompute_s("selective") < lc.recompute_s("selective", "op-sac") < lc.recompute_s("full")


# ------------------------------------------------------------------------------------------------ SliceCoster
def _peak(c: SliceCoster, cfg: ParallelConfig):
    plan = c.plan(cfg)
    return plan.stages[0]


def test_defaults_leave_every_stage_as_before():
    m = _gpt()
    cfg = ParallelConfig(tp=2, pp=2, dp=2, recompute="selective", zero_stage=1)
    a = _peak(_coster(m), cfg)
    b = _peak(_coster(m, sequence_parallel=True, selective_policy="megatron", keeps_param_dtype_grads=False), cfg)
    assert a == b


def test_no_sequence_parallelism_costs_activation_memory_only_with_tp():
    m = _gpt()
    for tp, grows in ((1, False), (2, True)):
        cfg = ParallelConfig(tp=tp, pp=2, dp=8 // (2 * tp), recompute="full", zero_stage=1)
        sp, no_sp = _peak(_coster(m), cfg), _peak(_coster(m, sequence_parallel=False), cfg)
        assert (no_sp.activation_bytes > sp.activation_bytes) == grows
        assert no_sp.breakdown["parameters_bytes"] == sp.breakdown["parameters_bytes"]
        assert no_sp.forward_s == sp.forward_s


def test_op_sac_changes_only_the_selective_configurations():
    m = load_model("llama3-8b")
    for r in ("none", "full", "selective"):
        cfg = ParallelConfig(tp=1, pp=1, dp=8, recompute=r, zero_stage=3)
        meg = _peak(_coster(m, seq=8192, b=8, gb=16), cfg)
        sac = _peak(_coster(m, seq=8192, b=8, gb=16, selective_policy="op-sac"), cfg)
        if r != "selective":
            assert sac == meg
        else:
            assert sac.activation_bytes < meg.activation_bytes
            assert sac.backward_s > meg.backward_s  # more is recomputed
            assert sac.breakdown["working_bytes"] > meg.breakdown["working_bytes"]  # one block rebuilt


def test_kept_16_bit_gradients_add_two_bytes_per_parameter():
    m = _gpt()
    cfg = ParallelConfig(tp=2, pp=2, dp=2, recompute="full", zero_stage=1)
    plain, kept = _peak(_coster(m), cfg), _peak(_coster(m, keeps_param_dtype_grads=True), cfg)
    params = plain.breakdown["params_per_gpu"]
    assert kept.breakdown["gradients_bytes"] - plain.breakdown["gradients_bytes"] == pytest.approx(2 * params)
    assert kept.dp_sync_s == plain.dp_sync_s  # what is reduced is the fp32 buffer, as before


def test_an_unknown_selective_policy_is_refused_by_name():
    with pytest.raises(SpecError, match="selective_policy.*megatron, op-sac"):
        _coster(_gpt(), selective_policy="torchtitan")


# ------------------------------------------------------------------------------------------------ loss, ZeRO-3 units
def test_eager_cross_entropy_reserves_fourteen_bytes_per_logit():
    """F.cross_entropy on fp32 logits: the saved log-softmax output and the two fp32 gradients of its backward, plus
    the freed bf16 logits' block they do not fit in; Megatron's vocab-parallel loss: p + 4 bytes
    (memory.head_activation_bytes)."""
    from tangram_launch.costmodel.memory import head_activation_bytes

    m = load_model("llama3-8b")
    tokens, v, h = 2 * 8192, m.vocab_size, m.hidden_size
    fused = head_activation_bytes(m, seq_len=8192, mbs=2)
    eager = head_activation_bytes(m, seq_len=8192, mbs=2, cross_entropy="eager")
    assert fused == pytest.approx(tokens * (4 * h + 6 * v))
    assert eager - fused == pytest.approx(tokens * 8 * v)
    with pytest.raises(SpecError, match="cross_entropy.*fused, eager"):
        _coster(m, cross_entropy="chunked")


def test_zero3_gathers_the_embedding_whole_when_it_is_larger_than_a_layer():
    """FSDP and ZeRO-3 gather a module's parameters whole: Llama 3 8B's 128k x 4096 embedding (525 M parameters)
    is 2.4 of its layers, so a stage that holds it needs the larger working set. Under pipelining FSDP2 keeps the
    stage's parameters gathered (counted as parameters), so there is no working set of gathered units. Beside it
    every stage holds one layer's activation gradients (memory.layer_backward_transient_bytes), which the loss's
    freed blocks hold on the last stage at Llama 3's vocabulary, not at a 1024-word one."""
    from tangram_launch.costmodel.memory import (
        FRAGMENTATION_FRACTION,
        head_activation_bytes,
        layer_backward_transient_bytes,
    )

    m = load_model("llama3-8b")
    c = _coster(m, seq=8192, b=8, gb=16)
    whole = c.plan(ParallelConfig(tp=1, pp=1, dp=4, recompute="none", zero_stage=3)).stages[0]
    frag = 1 + FRAGMENTATION_FRACTION
    emb, head, layer = m.embedding_params(), m.head_params(), m.layer_params(0)
    assert emb > 2 * layer and head > 2 * layer
    grads = layer_backward_transient_bytes(m, 0, seq_len=8192, mbs=2)  # b 8 over dp 4
    assert head_activation_bytes(m, seq_len=8192, mbs=2) > grads
    # the gathered unit's bf16 weights and fp32 gradients, and the next layer's bf16 weights prefetched
    assert whole.breakdown["working_bytes"] == pytest.approx((max(emb, head) * (2 + 4) + layer * 2) * frag)
    first, last = c.plan(ParallelConfig(tp=1, pp=2, dp=4, recompute="none", zero_stage=3)).stages
    assert first.breakdown["working_bytes"] == pytest.approx(grads * frag)
    assert last.breakdown["working_bytes"] == 0.0
    assert first.breakdown["parameters_bytes"] == pytest.approx(first.breakdown["params_per_gpu"] * 2)
    small_model = ModelSpec.from_dict({**m.to_dict(), "vocab_size": 1024})
    tiny_vocab = _coster(small_model, seq=8192, b=8, gb=16)
    small = tiny_vocab.plan(ParallelConfig(tp=1, pp=1, dp=4, recompute="none", zero_stage=3)).stages[0]
    small_grads = grads - head_activation_bytes(small_model, seq_len=8192, mbs=2)
    assert small.breakdown["working_bytes"] == pytest.approx((layer * (2 * 2 + 4) + small_grads) * frag)
    zero1 = c.plan(ParallelConfig(tp=1, pp=1, dp=4, recompute="none", zero_stage=1)).stages[0]
    assert zero1.breakdown["working_bytes"] == 0.0  # only ZeRO-3 gathers parameters
