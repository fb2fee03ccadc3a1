"""The published runs' memory is costed with the runtime their source ran: torchtitan's trainer of 2024 computed its
loss with eager F.cross_entropy on fp32 logits whether or not it compiled the model (its train.py compiled the
transformer blocks and left the loss uncompiled), so every row of those sources declares the eager loss, and the
benchmark hands that to the memory model."""
import copy

import pytest
from test_published_runs import bench, data  # noqa: F401  (fixtures: the benchmark module and its data file)

from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION

TORCHTITAN_2024_SOURCES = ("torchtitan-perf", "torchtitan-h100")


@pytest.mark.unit
def test_every_torchtitan_2024_row_declares_the_eager_loss(data):
    rows = [r for r in data["runs"] if r["source"]["ref"] in TORCHTITAN_2024_SOURCES]
    assert len(rows) >= 10
    compiled = [r for r in rows if "torch.compile" in r.get("framework", "")]
    assert compiled, "the compiled rows are the ones this rule is about"
    missing = [r["id"] for r in rows if (r.get("runtime") or {}).get("cross_entropy") != "eager"]
    assert not missing, f"rows of torchtitan's 2024 trainer without runtime.cross_entropy: eager: {missing}"


@pytest.mark.unit
def test_the_eager_loss_adds_two_bytes_per_logit_to_a_compiled_torchtitan_row(data, bench):
    """Context parallelism 2 at 65,536 tokens: each GPU holds the loss of 32,768 tokens over Llama 3's 128,256-word
    vocabulary; eager F.cross_entropy holds 12 bytes per logit where the fused loss holds 10 (bf16 + 8)."""
    row = next(r for r in data["runs"] if r["id"] == "tt-h100-llama3-8b-cp2-fp8")
    fused = copy.deepcopy(row)
    fused.pop("runtime")
    model = bench.resolve_model(row["model"], data)
    eager_gib = bench.predict(row, model)["peak_gib"]
    fused_gib = bench.predict(fused, model)["peak_gib"]
    tokens = row["parallel"]["seq_len"] // row["parallel"]["cp"]
    expected = 2 * tokens * model.vocab_size * (1 + FRAGMENTATION_FRACTION) / GIB
    assert eager_gib - fused_gib == pytest.approx(expected, rel=1e-9)
