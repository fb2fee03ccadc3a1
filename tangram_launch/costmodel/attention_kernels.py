"""Fused attention's sustained rate by kernel family, GPU and shape, from published kernel benchmarks.

Which kernel runs the attention core matters as much as the GPU: FlashAttention-2 does not use Hopper's warpgroup
MMA or TMA, so on an H100 it reaches about a third of the dense peak (Shah et al. 2024, "FlashAttention-3", sec. 1:
"only 35% utilization"), while cuDNN's fused attention reaches about half; on an A100 FlashAttention-2 reaches about
0.6 (Dao 2023, sec. 4.1). A single figure scaled by the GPU's GEMM rate would price an H100 running FlashAttention-2
about a quarter too fast and one running cuDNN too slow. Who runs which:

* ``fa2``: FlashAttention-2 (the flash-attn package; PyTorch SDPA's flash backend, which torch 2.5.1-2.8 put before
  cuDNN on every GPU; HF transformers, llm-foundry, torchtitan up to mid-2025 on Hopper).
* ``cudnn``: cuDNN's fused attention (Transformer Engine's FusedAttention, which TE 2.x prefers on sm90 and newer,
  hence Megatron-core and NeMo on Hopper; PyTorch SDPA from 2.9 on sm90/sm100 with a recent cuDNN).
* ``auto``: what this project's runtimes run: Transformer Engine (the Megatron adapter) and PyTorch SDPA of the pinned
  torch (the torch and DeepSpeed adapters; torch 2.9+ puts cuDNN first on sm90 once its cuDNN is recent enough, which
  the wheels' is from 2.11) both take FlashAttention-2 on Ampere and cuDNN on Hopper.

Figures are TFLOP/s of forward + backward in the papers' convention (causal attention counted as half the FLOPs of
the full s x s product, the backward as 2.5 x the forward: 5 matmuls against 2), head dim 64 and 128, at sequence
lengths 2k-16k with batch x sequence = 16k tokens, bf16/fp16. They are isolated kernels on an idle GPU, so the
DeviceModel scales them as it scales the GEMMs (the GPU's sustained large-GEMM share against GEMM_EFFICIENCY).
Shapes between the measured points interpolate linearly in log2(sequence) and in head dim; outside them the nearest
point holds. GPUs and kernels without figures here (Blackwell, Ada, a cuDNN kernel on Ampere) keep the cost model's
single figure, efficiency.FLASH_ATTENTION_EFFICIENCY.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import ATTENTION_KERNELS

SEQ_POINTS = (2048, 4096, 8192, 16384)  # the papers' sequence lengths (batch x sequence = 16k tokens)


def _fwd_bwd_tflops(forward: tuple[float, ...], backward: tuple[float, ...]) -> tuple[float, ...]:
    """Forward + backward TFLOP/s from the two passes' figures: 3.5 units of work over 1/fwd + 2.5/bwd of time."""
    return tuple(3.5 / (1.0 / f + 2.5 / b) for f, b in zip(forward, backward))


@dataclass(frozen=True)
class KernelCurve:
    """One kernel's measured forward+backward TFLOP/s on one GPU, by head dim, at SEQ_POINTS."""

    peak_tflops: float  # the dense bf16 peak of the GPU the figures were measured on
    tflops_by_head_dim: Mapping[int, tuple[float, ...]]
    source: str

    def fraction(self, seq_len: float, head_dim: float) -> float:
        """Achieved share of the dense peak at this sequence length and head dim (interpolated, clamped)."""
        dims = sorted(self.tflops_by_head_dim)
        d = min(max(float(head_dim), dims[0]), dims[-1])
        hi = next((x for x in dims if x >= d), dims[-1])
        lo = max((x for x in dims if x <= d), default=dims[0])
        w = 0.0 if hi == lo else (d - lo) / (hi - lo)
        rate = (1.0 - w) * self._at(lo, seq_len) + w * self._at(hi, seq_len)
        return rate / self.peak_tflops

    def _at(self, head_dim: int, seq_len: float) -> float:
        values = self.tflops_by_head_dim[head_dim]
        x = min(max(math.log2(max(seq_len, 1.0)), math.log2(SEQ_POINTS[0])), math.log2(SEQ_POINTS[-1]))
        i = min(int(x - math.log2(SEQ_POINTS[0])), len(SEQ_POINTS) - 2)
        f = x - math.log2(SEQ_POINTS[i])
        return (1.0 - f) * values[i] + f * values[i + 1]


# A100 80GB SXM4, FlashAttention-2, causal (Dao 2023, arXiv:2307.08691, Fig. 4 (c) hd64 and (d) hd128).
_A100_FA2 = KernelCurve(312.0, MappingProxyType({64: (140.0, 158.0, 165.0, 171.0), 128: (155.0, 182.0, 189.0, 189.0)}),
                        "Dao 2023, FlashAttention-2, Fig. 4 (A100, causal, forward+backward)")
# H100 80GB SXM5, FlashAttention-2, causal (Dao 2023, Fig. 7: "no TMA, no 4th-gen Tensor Cores").
_H100_FA2 = KernelCurve(989.0, MappingProxyType({64: (232.0, 257.0, 273.0, 284.0), 128: (265.0, 294.0, 308.0, 328.0)}),
                        "Dao 2023, FlashAttention-2, Fig. 7 (H100, causal, forward+backward)")
# H100 80GB SXM5, cuDNN fused attention (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608): causal forward
# (Fig. 5 (b) hd64, (d) hd128) and non-causal backward (Fig. 6 (a), (b); no causal backward is published), combined
# as _fwd_bwd_tflops does. The same rule applied to the paper's FlashAttention-2 bars gives 293/313/322/326 against
# the 265/294/308/328 its Fig. 7 measured causal: it errs fast by up to 11 % at 2k and under 5 % from 8k.
_H100_CUDNN = KernelCurve(989.0, MappingProxyType({
    64: _fwd_bwd_tflops((334.0, 363.0, 379.0, 388.0), (395.0, 417.0, 432.0, 433.0)),
    128: _fwd_bwd_tflops((484.0, 518.0, 529.0, 539.0), (465.0, 499.0, 518.0, 516.0))}),
    "Shah et al. 2024, FlashAttention-3, Figs. 5-6 (H100 cuDNN: causal forward, non-causal backward)")

# GPU types by the die their kernels were measured on: the A100 parts share GA100, the H100 parts and the H200 GH100
# (the H200 differs in memory only; attention is compute-bound at these shapes). Each takes the measured share of its
# own peak.
_FAMILY = MappingProxyType({"a100-40gb": "ga100", "a100-80gb": "ga100", "a100-pcie-40gb": "ga100",
                            "a100-pcie-80gb": "ga100", "h100-sxm": "gh100", "h100-pcie": "gh100",
                            "h100-nvl": "gh100", "h200": "gh100"})
_CURVES: Mapping[tuple[str, str], KernelCurve] = MappingProxyType({
    ("ga100", "fa2"): _A100_FA2, ("gh100", "fa2"): _H100_FA2, ("gh100", "cudnn"): _H100_CUDNN})
_AUTO = MappingProxyType({"ga100": "fa2", "gh100": "cudnn"})


def check_attention_kernel(kernel: str) -> str:
    if kernel not in ATTENTION_KERNELS:
        raise SpecError("unknown attention kernel", field="attention_kernel", value=kernel,
                        valid=", ".join(ATTENTION_KERNELS))
    return kernel


def attention_curve(gpu_type: str, kernel: str = "auto") -> KernelCurve | None:
    """The measured curve of ``kernel`` on this GPU type (``auto``: the kernel this project's runtimes run there);
    None where no figures exist (the cost model's single figure applies)."""
    check_attention_kernel(kernel)
    family = _FAMILY.get(gpu_type)
    if family is None:
        return None
    return _CURVES.get((family, _AUTO[family] if kernel == "auto" else kernel))
