"""The published runs' memory is costed with the loss their source ran (memory.CROSS_ENTROPY_KINDS): torchtitan's
trainer of 2024 computed it with eager F.cross_entropy on fp32 logits whether or not it compiled the model (its
train.py compiled the transformer blocks and left the loss uncompiled), from 2025 compiled the loss with the model;
llm-foundry's MPT with flash-attn's CUDA cross-entropy; NeMo AutoModel's benchmark with F.cross_entropy on the bf16 logits. Every row of those sources
declares its loss, and the benchmark hands it to the memory model."""
import copy

import pytest
from test_published_runs import bench, data  # noqa: F401  (fixtures: the benchmark module and its data file)

from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.costmodel.memory import CROSS_ENTROPY_KINDS, FRAGMENTATION_FRACTION, head_activation_bytes
from tangram_launch.specs.model import load_model

TORCHTITAN_2024_SOURCES = ("torchtitan-perf", "torchtitan-h100")
# the loss each source's trainer ran (the data file's header says where each was read)
LOSS_OF_SOURCE = {"torchtitan-perf": "eager", "torchtitan-h100": "eager", "llm-foundry": "flash-xentropy",
                  "nemo-automodel": "eager-16bit", "torchtitan-h200": "compiled", "torchtitan-deepep": "compiled"}


@pytest.mark.unit
def test_every_row_of_a_source_declares_the_loss_its_trainer_ran(data):
    rows = [r for r in data["runs"] if r["source"]["ref"] in LOSS_OF_SOURCE]
    assert len(rows) >= 25
    compiled = [r for r in rows if r["source"]["ref"] in TORCHTITAN_2024_SOURCES
                and "torch.compile" in r.get("framework", "")]
    assert compiled, "torchtitan's compiled rows ran the eager loss too"
    wrong = [r["id"] for r in rows
             if (r.get("runtime") or {}).get("cross_entropy") != LOSS_OF_SOURCE[r["source"]["ref"]]]
    assert not wrong, f"rows whose runtime.cross_entropy is not their trainer's loss: {wrong}"


@pytest.mark.unit
@pytest.mark.parametrize("kind, bytes_per_logit", [("fused", 2 + 4), ("eager", 12 + 2), ("eager-16bit", 3 * 2),
                                                   ("flash-xentropy", 2 * 2), ("compiled", 2 * 2)])
def test_each_loss_holds_its_own_bytes_per_logit(kind, bytes_per_logit):
    """At the loss's peak, per logit of bf16 logits: Megatron's loss the logits and one fp32 tensor (the upcast,
    turned into the softmax and then the gradient in place); eager F.cross_entropy on upcast logits three fp32
    tensors and the freed bf16 logits' block the allocator cannot reuse for them; on the bf16 logits three bf16
    ones; flash-attn's kernel, and the eager loss compiled, the saved logits and the gradient written beside them."""
    assert kind in CROSS_ENTROPY_KINDS
    m = load_model("llama3-8b")
    tokens, h, v = 4 * 2048, m.hidden_size, m.vocab_size
    for tp in (1, 4):
        got = head_activation_bytes(m, seq_len=2048, mbs=4, tp=tp, cross_entropy=kind)
        # over vocab-parallel logits the compiled loss runs as DTensor's loss-parallel handlers: the eager loss's bytes
        per_logit = 12 + 2 if kind == "compiled" and tp > 1 else bytes_per_logit
        assert got == pytest.approx(tokens * (4 * h + per_logit * v) / tp)


@pytest.mark.unit
def test_the_eager_loss_adds_eight_bytes_per_logit_to_a_compiled_torchtitan_row(data, bench):
    """Context parallelism 2 at 65,536 tokens: each GPU holds the loss of 32,768 tokens over Llama 3's 128,256-word
    vocabulary; eager F.cross_entropy reserves 14 bytes per logit where Megatron's loss holds 6 (bf16 + 4)."""
    row = next(r for r in data["runs"] if r["id"] == "tt-h100-llama3-8b-cp2-fp8")
    fused = copy.deepcopy(row)
    del fused["runtime"]["cross_entropy"]
    model = bench.resolve_model(row["model"], data)
    eager_gib = bench.predict(row, model)["peak_gib"]
    fused_gib = bench.predict(fused, model)["peak_gib"]
    tokens = row["parallel"]["seq_len"] // row["parallel"]["cp"]
    expected = 8 * tokens * model.vocab_size * (1 + FRAGMENTATION_FRACTION) / GIB
    assert eager_gib - fused_gib == pytest.approx(expected, rel=1e-9)
