"""Eager PyTorch's unfused attention: the bytes the cost model charges per score element are those the aten
operators of a minGPT/nanoGPT-style attention read and write, counted by a dispatch mode on real tensors, forward
and backward (costmodel/eager_attention.py)."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.eager_attention import eager_score_bytes, eager_score_saved_bytes
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION, layer_activation_bytes
from tangram_launch.specs.model import load_model
from test_costmodel import gpu

pytestmark = pytest.mark.unit

B, H, S, D = 2, 3, 16, 8  # B x H > 1: the (1, 1, S, S) causal mask is not score-sized
SCORE_NUMEL = B * H * S * S
VIEWS = {"view", "_unsafe_view", "transpose", "t", "expand", "detach", "alias", "as_strided", "unsqueeze", "squeeze",
         "permute", "reshape", "slice", "select"}


class ScoreTraffic(TorchDispatchMode):
    """Bytes per score element that the dispatched operators read and write on score-sized tensors (views move
    nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in VIEWS:
            tensors = tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]
            self.bytes += sum(t.element_size() for t in tensors
                              if isinstance(t, torch.Tensor) and t.numel() == SCORE_NUMEL)
        return out


def _attention(q, k, v, *, dropout: bool, cuda_autocast: bool):
    """minGPT/nanoGPT's attention. CUDA's autocast runs softmax in fp32 (torch.amp's fp32 list) and casts P back
    for P V; CPU autocast does not, so the casts CUDA's autocast inserts are written out. Dropout is the fused
    kernel CUDA runs (native_dropout: a 1-byte mask), not the CPU composite."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    mask = torch.tril(torch.ones(S, S)).view(1, 1, S, S)
    att = att.masked_fill(mask == 0, float("-inf"))
    if cuda_autocast:
        att = att.float()
    att = torch.softmax(att, dim=-1)
    if dropout:
        att, _keep = torch.native_dropout(att, 0.1, True)
    if cuda_autocast:
        att = att.to(q.dtype)
    return att @ v


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("dropout", [True, False])
def test_charged_bytes_are_what_the_operators_move(dtype, autocast, dropout):
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
    with ScoreTraffic() as fwd:
        y = _attention(q, k, v, dropout=dropout, cuda_autocast=autocast)
    with ScoreTraffic() as bwd:
        y.backward(torch.randn_like(y))
    p = torch.finfo(dtype).bits // 8
    assert eager_score_bytes(p, autocast=autocast, dropout=dropout) == (fwd.bytes, bwd.bytes)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("dropout", [True, False])
def test_kept_bytes_are_what_autograd_saves(dtype, autocast, dropout):
    """The score-sized tensors autograd keeps for the backward, counted through saved-tensor hooks (a tensor saved
    twice counts once)."""
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
    kept: dict[int, int] = {}

    def pack(t):
        if t.numel() == SCORE_NUMEL:
            kept[t.untyped_storage().data_ptr()] = t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _attention(q, k, v, dropout=dropout, cuda_autocast=autocast)
    p = torch.finfo(dtype).bits // 8
    assert eager_score_saved_bytes(p, autocast=autocast, dropout=dropout) == sum(kept.values())


def test_only_eager_layers_pay_it():
    """On a V100 (no flash kernel), a GPT layer's attention costs the fused kernel's 6p + 1 bytes per score forward,
    twice that backward, where Megatron's kernels run; eager PyTorch's layers pay the operator-by-operator traffic,
    more under 16-bit autocast than without; FLOPs and everything else are the same."""
    model = load_model("gpt3-1.3b")
    dev = DeviceModel.from_gpu(gpu("v100-32gb"), "fp16", fused_elementwise=True)
    eager = DeviceModel.from_gpu(gpu("v100-32gb"), "fp16", fused_elementwise=False)
    kw = dict(seq_len=2048, mbs=2, tp=1, cp=1, ep=1, use_measured=False, host_floor=False)
    fused = layer_compute(model, 0, dev=dev, **kw)
    scores = 2 * model.num_heads * 2048 * 2048
    per_byte = scores / dev.memory_bandwidth
    assert not dev.flash_attention and fused.attention_backward_extra_s == 0.0
    fused_traffic_s = fused.attention_core_s - fused.attention_core_flops / dev.gemm_flops
    assert fused_traffic_s == pytest.approx(13 * per_byte)
    for autocast in (True, False):
        lc = layer_compute(model, 0, dev=eager, autocast=autocast, **kw)
        fwd_b, bwd_b = eager_score_bytes(2, autocast=autocast, dropout=bool(model.dropout))
        assert lc.attention_core_s - lc.attention_core_flops / eager.gemm_flops == pytest.approx(fwd_b * per_byte)
        extra = lc.backward_s - 2 * lc.forward_s  # the backward's own score traffic beyond 2 x the forward's
        assert extra == pytest.approx((bwd_b - 2 * fwd_b) * per_byte)
        assert lc.forward_flops == fused.forward_flops
    on, off = (layer_compute(model, 0, dev=eager, autocast=a, **kw) for a in (True, False))
    assert on.forward_s + on.backward_s > off.forward_s + off.backward_s > fused.forward_s + fused.backward_s
    # --attention-kernel eager (transformers' eager attention) with fused element-wise kernels: the same attention
    hf = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16", attention_kernel="eager")
    assert hf.eager_attention and hf.fused_elementwise and not hf.flash_attention
    assert not DeviceModel.from_gpu(gpu("a100-80gb"), "bf16").eager_attention


@pytest.mark.parametrize("autocast", [True, False])
def test_eager_layers_keep_what_autograd_keeps(autocast):
    """A layer's kept activations differ from Megatron's fused kernel's by the score part alone, by
    eager_score_saved_bytes per score element (fp32 softmax output under 16-bit autocast)."""
    model = load_model("gpt3-1.3b")
    kw = dict(seq_len=2048, mbs=2, tp=2, recompute="none", flash=False, dtype_bytes=2, autocast=autocast)
    eager = layer_activation_bytes(model, 0, eager_attention=True, **kw)
    fused = layer_activation_bytes(model, 0, eager_attention=False, **kw)
    scores_per_gpu = 2 * model.num_heads * 2048 * 2048 / 2
    megatron = 2 * 2 + 1  # 2p + 1 with dropout (gpt3 trains with it)
    assert model.dropout
    assert eager - fused == pytest.approx(scores_per_gpu * (eager_score_saved_bytes(2, autocast=autocast, dropout=True)
                                                            - megatron))
    assert (eager > fused) == autocast


def test_sdpa_runtimes_run_the_memory_efficient_kernel_before_ampere():
    """The torch and DeepSpeed runtimes call torch's SDPA (runtime_adapters/gpt.py), which runs its memory-efficient
    kernel on a V100: no s x s scores kept, the time of the unfused attention at its dtype; Megatron's unfused path
    keeps its fused softmax and the scores; an Ampere GPU runs FlashAttention either way."""
    from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
    from tangram_launch.costmodel.eager_attention import mem_efficient_score_bytes

    assert TORCH.sdpa_attention and DEEPSPEED.sdpa_attention and not MEGATRON.sdpa_attention
    v100 = DeviceModel.from_gpu(gpu("v100-16gb"), "fp16", sdpa=True)
    assert v100.mem_efficient_attention and not v100.flash_attention and not v100.eager_attention
    assert not DeviceModel.from_gpu(gpu("v100-16gb"), "fp16").mem_efficient_attention
    assert DeviceModel.from_gpu(gpu("a100-80gb"), "bf16", sdpa=True).flash_attention
    assert not DeviceModel.from_gpu(gpu("a100-80gb"), "bf16", sdpa=True).mem_efficient_attention
    eager = DeviceModel.from_gpu(gpu("v100-16gb"), "fp16", sdpa=True, attention_kernel="eager")
    assert eager.eager_attention and not eager.mem_efficient_attention

    model = load_model("opt-350m")
    kw = dict(seq_len=2048, mbs=1, tp=1, cp=1, ep=1, use_measured=False, host_floor=False)
    lc = layer_compute(model, 0, dev=v100, **kw)
    scores = model.num_heads * 2048 * 2048
    fwd_b, bwd_b = mem_efficient_score_bytes(2, dropout=bool(model.dropout))
    assert (fwd_b, bwd_b) == eager_score_bytes(2, autocast=False, dropout=bool(model.dropout))
    assert lc.attention_core_s - lc.attention_core_flops / v100.gemm_flops == pytest.approx(
        fwd_b * scores / v100.memory_bandwidth)


def test_sdpa_stages_on_a_v100_keep_no_scores():
    """A torch-runtime stage on V100s keeps what a fused kernel keeps; the same stage under Megatron keeps the s x s
    scores besides (2p + 1 bytes per element with dropout: OPT trains with it)."""
    from tangram_launch.capabilities import MEGATRON, TORCH
    from tangram_launch.costmodel.breakdown import ParallelConfig
    from test_costmodel import coster, island

    model = load_model("opt-350m")
    cfg = ParallelConfig(tp=1, pp=1, dp=8, zero_stage=0, recompute="none")
    acts = {}
    for caps in (TORCH, MEGATRON):
        plan = coster(model, island("v100-16gb"), b=8, gb=8, seq=2048, dtype="fp16", caps=caps).plan(cfg)
        acts[caps.name] = plan.stages[0].breakdown["activations_bytes"]
    scores_per_layer = model.num_heads * 2048 * 2048 * (2 * 2 + 1)
    lse_per_layer = 4 * model.num_heads * 2048
    assert acts["megatron"] - acts["torch"] == pytest.approx(
        model.num_layers * (scores_per_layer - lse_per_layer) * (1 + FRAGMENTATION_FRACTION), rel=1e-9)


@pytest.mark.parametrize("runtime,says", [("torch", "SDPA's memory-efficient kernel"),
                                          ("deepspeed", "SDPA's memory-efficient kernel"),
                                          ("megatron", "Megatron's fused scale-mask-softmax: s x s scores kept")])
def test_estimate_says_how_attention_is_priced(capsys, runtime, says):
    """`tangram-launch estimate` prints which attention it priced: on V100s SDPA's memory-efficient kernel for the
    runtimes that call SDPA, Megatron's unfused path for Megatron; the JSON carries the same line."""
    import json
    import os

    from tangram_launch.cli import main

    cluster = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "c3-full-het-iii.yaml")
    argv = ["estimate", "--cluster", cluster, "--model", "opt-350m", "--island", "v100-16gb", "--dp", "4", "--mbs",
            "1", "--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16", "--runtime", runtime]
    assert main(argv) in (0, 3)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("attention: ")]
    assert len(lines) == 1 and says in lines[0]
    assert main(argv + ["--format", "json"]) in (0, 3)
    assert says in json.loads(capsys.readouterr().out)["attention"]
