"""What a GPU sustains, as opposed to what its spec sheet promises: the cost model's only tuning knobs.

Every time in the cost model is work divided by one of the rates of a ``DeviceModel``:

* **GEMMs** follow an additive roofline (Williams et al. 2009, "Roofline: an insightful visual performance model",
  CACM 52(4), with compute and memory time summed rather than maxed because real kernels overlap them imperfectly)::

      t(M, N, K) = 2 M N K / F_gemm + p (M K + K N + M N) / B_mem

  so the achieved fraction of peak is a saturating curve in the arithmetic intensity I = M N K / (M K + K N + M N):
  ``eff(I) = e_gemm / (1 + F_gemm / (B_mem I))``. Few tokens per micro-batch (small M) and a high TP degree
  (small N or K = h / t) lower I, hence the efficiency; big GEMMs approach ``e_gemm``.
* **Attention core** (Q K^T and P V): fused on Ampere and newer (bf16-capable GPUs), at the published rate of the
  kernel that runs it (FlashAttention-2 or cuDNN) by sequence length and head dim where ``costmodel.attention_kernels``
  has one, else a fixed fraction of peak; unfused on Volta/Turing, where the s x s score matrix is written and read
  through HBM.
* **Element-wise work** (norms, activations, dropout, residual adds) is memory-bound: bytes / B_mem.

Calibration: how much of the dense peak large GEMMs sustain depends on the GPU generation (clocks under the
power limit, how much of the peak needs Hopper's warpgroup instructions), so it is a per-GPU figure where
published runs pin it and ``GEMM_EFFICIENCY`` elsewhere; every other effect (GEMM shapes, attention, element-wise
work, communication, bubbles) comes from the model, not from the constant. Each figure is fitted on a named subset
of benchmarks/data/published_runs.yaml (``fitted_constants:`` there; ``python
benchmarks/bench_costmodel_published.py --fit`` re-fits them) and judged on the rows it was not fitted on:

* A100 (40 and 80 GB, one GA100 die): 0.77, fitted on the even rows of Narayanan et al. 2021 ("Efficient
  large-scale language model training on GPU clusters using Megatron-LM", SC'21, Table 1: 1.7B, 7.5B, 39.1B,
  145.6B, 529.6B; 135-163 TFLOP/s per A100, hardware FLOPs incl. recompute); the odd rows, Korthikanti et al.
  2022, torchtitan, llm-foundry and FlagPerf A800 rows are held out.
* GH100 (H100 SXM, PCIe and NVL; H200): 0.58, fitted on the three FlagPerf Megatron-core H100 rows (Llama 3 8B /
  70B, 8-64 GPUs); the llm-foundry, torchtitan and Megatron-core MoE H100 rows are held out. An A100 sustains a
  larger share of its (lower) peak than an H100 in end-to-end training: the H100 sustains 2.4x the A100's
  large-GEMM rate, not the 3.2x of the spec sheets (Grattafiori et al. 2024, Llama 3 405B: 38-43 % MFU on H100;
  Narayanan et al. 2021: 43-52 % on A100). The H200 is the same die at the same 700 W with more and faster HBM,
  which the model prices through its memory bandwidth, not through this figure: with a figure of its own, a
  cluster mixing H100s and H200s would see the H200's GEMMs 1.2x as fast as the H100's and balance its stages
  that far off. Its isolated layers run faster than whole jobs, as the H100's do: on one H200 (device check,
  2026-11-29: eager PyTorch layers with SDPA flash attention, bf16) the profiler's large GEMMs sustained 682
  TFLOP/s, 0.69 of the peak, and the layer model priced at the isolated share 0.70 is within +0.3 ... +9.4 % of
  the measured forward+backward time of one GPT-3 13B / Llama 3 8B layer at mbs 1-4, s 2048-8192
  (tests/test_costmodel_calibration.py; +1.6 ... +10.8 % at the measured 682). A whole job adds communication
  kernels sharing the SMs and sustained power draw, which the fitted figure holds.
* B200: the GH100 whole-job figure, 0.58. No published B200 run is in its fit; what carries is the share of peak
  whole jobs sustain. MLPerf Training v4.1 (November 2024, both generations in FP8) measured Blackwell at 2.0x the
  Hopper per-GPU throughput on GPT-3 175B pretraining and 2.2x on Llama 2 70B fine-tuning, against 2.27x for their
  dense peaks (4,500 / 1,979 TFLOP/s): 0.88-0.97 of the H100's share of peak, as power-limited at its peak as the
  H100 (1,000 W). At the isolated 0.70 a cluster mixing B200s and H100s would price the B200's GEMMs 2.75x as fast
  as the H100's, where whole jobs run about 2x.
* Others (V100, T4, L40S, ...): ``GEMM_EFFICIENCY`` = 0.70, the isolated large-GEMM share cuBLAS reaches (the H200's
  measured 0.69 above).

A GPU whose profile has a GEMM-shape sweep of the training dtype (``measured.gemm_sweep_tflops``) has its GEMMs
priced from it (``costmodel.gemm_curve``); with the large-GEMM figure every profile holds beside it (fused attention
scales with that), none of these figures applies. Without one, the catalog curve keeps its per-GPU
large-GEMM figure: a single figure shared by every GPU, fitted on the union of the A100 and H100 fit rows, predicts
the development rows of the published runs markedly worse (0.69 shared: 9.7 % median time error against 5.7 %,
with exposed and contended ZeRO communication and FlashAttention's backward costed). What separates the
generations in those runs is not a GEMM-shape, attention or communication effect the model can see: the GPUs'
sustained large-GEMM rates differ (power-limited clocks, kernels that reach Hopper's peak only with its warpgroup
instructions), which is what the profiler's ``gemm_tflops`` measures.

Measured figures replace the constants: ``GPUSpec.measured`` with ``gemm_sweep_tflops`` (the profiler's GEMM-shape
sweep, which prices every GEMM of its dtype instead of the roofline and e_gemm: ``costmodel.gemm_curve``),
``gemm_tflops`` (the large-GEMM throughput, used as F_gemm instead of peak x e_gemm), ``memory_bandwidth_GBps`` and
``allreduce_busbw_gbps`` (with ``reduce_scatter_busbw_gbps`` / ``all_gather_busbw_gbps`` for those collectives where
measured: a backend need not run them at the all-reduce's bus bandwidth); ``collective_wait_us``,
``optimizer_tensor_us``, ``optimizer_param_ns`` and the FSDP2 figures (``FSDP_KEYS``) add costs that only a
measurement sets (absent: not charged); ``host_op_us`` replaces HOST_OP_S, the host's time per dispatched operator
(costmodel.host_floor); ``layer_forward_s`` / ``layer_forward_backward_s`` replace a layer's (and the
embedding's and head's) computed time at the profiled shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from tangram_launch.costmodel.attention_kernels import KernelCurve, attention_curve
from tangram_launch.costmodel.gemm_curve import MeasuredGemmCurve
from tangram_launch.costmodel.host_floor import HOST_OP_S
from tangram_launch.costmodel.measured_layers import SEQUENCE_KEY, SEQUENCE_PARTS_KEY
from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import GPUSpec, math_mode
from tangram_launch.specs.constants import GIB  # noqa: F401 (re-exported for the cost model's users)

TFLOPS = 1e12
# FSDP2 as the torch runtime wraps ZeRO 1-3 stages, measured over a node's ranks (profiler/fsdp_unit.py): host work
# per unit and pass beyond compute and transfers ({dtype: us}, the dtype the units gather in), and AdamW's step per
# sharded (DTensor) parameter tensor (us)
FSDP_KEYS = ("fsdp_unit_forward_us", "fsdp_unit_backward_us", "optimizer_sharded_tensor_us")
GBPS = 1e9  # _gbps = GB/s = 1e9 bytes per second

# Large bf16/fp16 GEMMs reach 60-80 % of the dense peak (cuBLAS on A100/H100; GPU-FACTS.md); 0.70 matches the
# H200's measured large GEMMs above and applies to every GPU type without a fitted figure of its own.
GEMM_EFFICIENCY = 0.70
# Sustained GEMM efficiency by catalog GPU type where published runs pin it (fit subsets in the module docstring
# and in published_runs.yaml `fitted_constants:`). Fused attention scales with it (the same tensor cores).
# The H100 PCIe and NVL parts (same GH100 die, lower power, no published rows of their own) and the H200 (same die
# and power, faster HBM) take the SXM figure against their own peaks, and so does the B200 (whole jobs at about the
# H100's share of peak: MLPerf Training v4.1, module docstring); the A100 PCIe parts (250-300 W) keep the default,
# ~0.9x the SXM figure.
GEMM_EFFICIENCY_BY_GPU: Mapping[str, float] = MappingProxyType({"a100-80gb": 0.77, "a100-40gb": 0.77,
                                                                 "h100-sxm": 0.58, "h100-pcie": 0.58,
                                                                 "h100-nvl": 0.58, "h200": 0.58, "b200": 0.58})
# FP8 GEMMs have no figure of their own: FP8 tensor cores do twice the bf16 rate on the same datapath, so a GEMM
# reaches the same share of the FP8 peak as the GPU's bf16 GEMMs reach of the bf16 peak (gemm_efficiency_for), and the
# FP8 casts (FP8_INPUT_BYTES) keep FP8 GEMMs under 2x bf16 ones. A figure fitted on one FP8 run (0.78 of the FP8 peak
# on Megatron-Bridge's Llama 3 8B) would be 2.6x the H100's bf16 figure: that run's stack, not its tensor cores.
# Bytes per GEMM input element with FP8: Transformer Engine reads the bf16 tensor and writes its FP8 copy (cast +
# amax), then the GEMM reads the FP8 copy: 2 + 1 + 1.
FP8_INPUT_BYTES = 4.0
# Streaming kernels reach ~85 % of the HBM peak (STREAM-style copy/triad on A100/H100 sustain 1.7/2.9 TB/s of
# 2.0/3.35 TB/s).
MEMORY_EFFICIENCY = 0.85
# FlashAttention-2 forward+backward reaches 50-73 % of the A100 peak (Dao 2023, "FlashAttention-2: faster attention
# with better parallelism and work partitioning", sec. 4.1); the low end covers short sequences and GQA. Used where
# costmodel.attention_kernels has no measured figures for the GPU and kernel (Blackwell, Ada).
FLASH_ATTENTION_EFFICIENCY = 0.50
# NCCL ring all-reduce bus bandwidth inside a node, as a fraction of the per-direction link bandwidth (half the
# bidirectional NVLink/PCIe figure of the catalog): nccl-tests on DGX A100 report ~230-240 GB/s of 300 GB/s
# per direction (~0.8); PCIe Gen3 x16 rings reach ~12 of 16 GB/s. Replaced by measured allreduce_busbw_gbps.
NCCL_INTRA_EFFICIENCY = 0.80
# Share of a GPU's SMs that a collective's kernels hold while they run beside compute (NCCL runs one thread block per
# channel on its own SM; DeepSeek-AI 2024, "DeepSeek-V3 technical report", sec. 3.2.2: 20 of the H800's 132 SMs
# saturate its InfiniBand and NVLink, 0.15): compute that hides a collective runs that much slower meanwhile.
# Not fitted; the same for every GPU (the ratio of channels to SMs is similar from Volta to Hopper).
COLLECTIVE_SM_SHARE = 0.15
# Fraction of a node-to-node link's nominal bandwidth that NCCL achieves (InfiniBand/RoCE ~90 %+ of line rate).
NET_EFFICIENCY = 0.90
# Per-step latency of an intra-node collective (NVLink/PCIe, NCCL LL protocol: a few microseconds per hop).
INTRA_NODE_LATENCY_S = 2e-6
# Host <-> GPU copies (offload): achievable per-direction PCIe bandwidth by generation (x16 theoretical 16/32/64 GB/s;
# pinned-memory copies reach ~75 %).
HOST_LINK_GBPS = {3: 12.0, 4: 24.0, 5: 48.0}
# CPU Adam (ZeRO-Offload, Ren et al. 2021, sec. 4.2; DeepSpeedCPUAdam is 5-7x torch's CPU Adam): the update is
# memory-bound on the host, ~32 bytes of traffic per parameter at ~50-100 GB/s of host memory bandwidth -> 1.5-3e9
# parameters/s per node. Consistent with DeepSpeed PR #7474: a whole Qwen2.5-3B fine-tuning step with CPU Adam over
# all 3B parameters takes 2.4 s on 2 A100-40GB and a 128-core host (>= 1.25e9 parameters/s incl. forward/backward).
CPU_ADAM_PARAMS_PER_S_PER_NODE = 2.0e9


def peak_tflops_for(gpu: GPUSpec, dtype: str) -> float:
    """Dense peak for the training dtype in the GPU's math mode (tf32 runs FP32 where the GPU lacks TF32);
    SpecError names the supported dtypes (V100 has no bf16)."""
    return gpu.peak_tflops(dtype)


def intra_link(gpu: GPUSpec) -> tuple[float, float]:
    """(bus bandwidth bytes/s, per-step latency s) of the GPU's link to its node's peers: measured where profiled
    (``allreduce_busbw_gbps``; ``collective_latency_us``, a tiny all-to-all over n ranks, n - 1 steps: the node's,
    or a group of its like ranks, ``collective_group_size``), else half the catalog's bidirectional NVLink/PCIe
    figure x NCCL_INTRA_EFFICIENCY and INTRA_NODE_LATENCY_S."""
    busbw = _measured(gpu, "allreduce_busbw_gbps")
    intra = busbw * GBPS if busbw is not None else gpu.intra_node_bandwidth_GBps / 2.0 * GBPS * NCCL_INTRA_EFFICIENCY
    latency_us = _measured(gpu, "collective_latency_us")
    if latency_us is None:
        return intra, INTRA_NODE_LATENCY_S
    ranks = _measured(gpu, "collective_group_size") or _measured(gpu, "allreduce_group_size") or 2
    steps = max(1, int(ranks) - 1)
    return intra, latency_us * 1e-6 / steps


def gemm_efficiency_for(gpu_type: str) -> float:
    """Sustained fraction of the dense peak that large GEMMs reach on this GPU type (GEMM_EFFICIENCY_BY_GPU)."""
    return GEMM_EFFICIENCY_BY_GPU.get(gpu_type, GEMM_EFFICIENCY)


def supports_flash_attention(gpu: GPUSpec) -> bool:
    """FlashAttention-2 needs Ampere or newer; among NVIDIA GPUs exactly those have bf16 tensor cores."""
    return bool(gpu.tflops.get("bf16"))


def _measured(gpu: GPUSpec, key: str, dtype: str | None = None) -> float | None:
    value = gpu.measured.get(key) if gpu.measured else None
    if isinstance(value, Mapping):
        value = value.get(dtype) if dtype else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _host_pcie_gen(gpu: GPUSpec) -> int:
    try:  # the catalog knows the host interface; custom GPUs are assumed Gen3 (the slowest in use)
        from tangram_launch.specs.catalog import default_catalog

        gen = default_catalog().lookup(gpu.type).pcie_gen
    except SpecError:
        gen = None
    return gen if gen in HOST_LINK_GBPS else 3


@dataclass(frozen=True)
class DeviceModel:
    """Sustained rates of one GPU type for one training dtype (all in base units: FLOP/s, bytes/s, s)."""

    gpu_type: str
    dtype: str
    dtype_bytes: int
    peak_flops: float  # dense peak of the dtype the GEMMs run in (fp8: the FP8 peak; MFU is against it)
    gemm_flops: float  # F_gemm: large-GEMM throughput (measured, or peak x GEMM_EFFICIENCY)
    memory_bandwidth: float  # B_mem, bytes/s sustained
    # the bf16 peak fused attention runs against, scaled as the GEMMs are (the GPU's sustained/assumed GEMM share)
    attention_peak_flops: float
    flash_attention: bool
    intra_busbw: float  # NCCL all-reduce bus bandwidth inside a node, bytes/s
    host_link_bandwidth: float  # GPU <-> host copies, bytes/s
    is_cpu: bool = False  # the `cpu` placeholder device has no CUDA context
    measured_layer_forward_s: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    measured_layer_forward_backward_s: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    # the stage-like sequence's and its parts' seconds by micro-batch (measured_layers.SEQUENCE_KEY, ..._PARTS_KEY)
    measured_sequence: Mapping[str, Mapping] = field(default_factory=dict, compare=False, hash=False)
    sources: tuple[str, ...] = ()  # which figures were measured (for explanations)
    gemm_input_bytes: float = 0.0  # bytes moved per GEMM input element (0: dtype_bytes; fp8: cast + FP8 read)
    # fixed cost per ring step of an intra-node collective: measured (a tiny all-to-all / (n - 1)) or NVLink's
    intra_latency_s: float = INTRA_NODE_LATENCY_S
    fused_elementwise: bool = True  # norms, RoPE, SwiGLU as fused kernels (Megatron/TE, torch.compile); False: eager
    # unfused attention runs as eager PyTorch's separate kernels (eager_attention.py): eager layers, or eager
    # attention asked for (--attention-kernel eager: transformers' eager_attention_forward); else Megatron's fused
    # scale-mask-softmax
    eager_attention: bool = False
    # torch SDPA's memory-efficient kernel (no FlashAttention on the GPU): keeps no s x s scores, and takes about
    # the time of the unfused attention it replaces (eager_attention.py: mem_efficient_score_bytes)
    mem_efficient_attention: bool = False
    # measured only (0: not charged): an intra-node collective's cost per call when it follows a layer's compute on
    # every rank (the profiler's collective_wait_us: fixed cost + the wait for the slowest member), and AdamW's
    # fixed cost per parameter tensor (optimizer_tensor_us: foreach=False runs a dozen small kernels per tensor)
    collective_wait_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    # measured only (0: the all-reduce's intra_busbw): a reduce-scatter's and an all-gather's own bus bandwidth inside
    # a node, bytes/s (gloo runs them below its all-reduce's)
    reduce_scatter_busbw: float = 0.0
    all_gather_busbw: float = 0.0
    # measured only (0: not charged): AdamW's cost per parameter beyond the per-tensor cost (optimizer_param_ns:
    # foreach=False makes about ten passes over each tensor); the optimizer step pays the larger of it and the
    # memory-bound term
    optimizer_param_s: float = 0.0
    # measured only (0: not charged; FSDP_KEYS): what an FSDP2 unit's forward and backward cost beyond their compute
    # and transfers, and AdamW's fixed cost per sharded parameter tensor, where the runtime shards with FSDP2
    fsdp_unit_forward_s: float = 0.0
    fsdp_unit_backward_s: float = 0.0
    optimizer_sharded_tensor_s: float = 0.0
    # host seconds per operator the runtime dispatches (host_floor.py): measured (host_op_us), else HOST_OP_S on a
    # GPU and 0 on an unprofiled CPU device
    host_op_s: float = 0.0
    # the profiler's GEMM sweep for this math mode (measured.gemm_sweep_tflops): replaces the roofline in gemm_s
    gemm_curve: MeasuredGemmCurve | None = None
    # the attention kernel's measured shape dependence (attention_kernels.py), against attention_peak_flops; None:
    # attention_flops at every shape
    attention_curve: KernelCurve | None = None

    @classmethod
    def from_gpu(cls, gpu: GPUSpec, dtype: str, *, flash_attention: bool | None = None,
                 fused_elementwise: bool = True, attention_kernel: str = "auto",
                 sdpa: bool = False) -> "DeviceModel":
        """``attention_kernel``: the fused-attention kernel family the runtime runs (attention_kernels.py); ``sdpa``:
        the runtime's attention is torch's scaled_dot_product_attention, which runs its memory-efficient kernel where
        the GPU has no FlashAttention one."""
        from tangram_launch.specs.training import DTYPE_BYTES

        peak = peak_tflops_for(gpu, dtype) * TFLOPS
        sources = []
        gemm = _measured(gpu, "gemm_tflops", math_mode(gpu, dtype))
        if gemm is not None:
            sources.append("gemm_tflops")
            gemm_flops = gemm * TFLOPS
        else:
            gemm_flops = peak * gemm_efficiency_for(gpu.type)  # fp8: the same share of the FP8 peak
        # fused attention runs in the storage dtype's tensor mode: bf16 under fp8 (Transformer Engine keeps
        # attention in bf16); the GPU's sustained (or measured) GEMM rate scales it by the same achieved/peak ratio
        attn_peak = peak_tflops_for(gpu, "bf16") * TFLOPS if dtype == "fp8" else peak
        if dtype == "fp8":
            bf16 = _measured(gpu, "gemm_tflops", "bf16")
            attn_scale = (bf16 * TFLOPS / attn_peak if bf16 is not None else gemm_efficiency_for(gpu.type)) \
                / GEMM_EFFICIENCY
        else:
            attn_scale = gemm_flops / (peak * GEMM_EFFICIENCY)
        mem = _measured(gpu, "memory_bandwidth_GBps")
        if mem is not None:
            sources.append("memory_bandwidth_GBps")
            memory_bandwidth = mem * GBPS
        else:
            memory_bandwidth = gpu.memory_bandwidth_GBps * GBPS * MEMORY_EFFICIENCY
        intra, intra_latency_s = intra_link(gpu)
        op_busbw = {k: _measured(gpu, k) for k in ("reduce_scatter_busbw_gbps", "all_gather_busbw_gbps")}
        sources.extend(k for k in ("allreduce_busbw_gbps", "collective_latency_us", *op_busbw)
                       if _measured(gpu, k) is not None)
        wait_us = _measured(gpu, "collective_wait_us")
        if wait_us is not None:
            sources.append("collective_wait_us")
        tensor_us = _measured(gpu, "optimizer_tensor_us")
        if tensor_us is not None:
            sources.append("optimizer_tensor_us")
        param_ns = _measured(gpu, "optimizer_param_ns")
        if param_ns is not None:
            sources.append("optimizer_param_ns")
        host_op_us = _measured(gpu, "host_op_us")
        if host_op_us is not None:
            sources.append("host_op_us")
        # per dtype the units gather in: a 16-bit plan's, else fp32 (the torch runtime, the one that wraps FSDP2
        # units, runs no fp8)
        gathered = dtype if dtype in ("bf16", "fp16") else "fp32"
        fsdp_us = [_measured(gpu, k, gathered) for k in FSDP_KEYS[:2]] + [_measured(gpu, FSDP_KEYS[2])]
        sources.extend(k for k, v in zip(FSDP_KEYS, fsdp_us) if v is not None)
        sweep = (gpu.measured.get("gemm_sweep_tflops") or {}).get(math_mode(gpu, dtype)) if gpu.measured else None
        if sweep:
            sources.append("gemm_sweep_tflops")
        if flash_attention is None:  # the GPU's fused kernel, unless the job runs eager attention
            flash = supports_flash_attention(gpu) and attention_kernel != "eager"
        else:
            flash = bool(flash_attention)
        layer_times = gpu.measured.get("layer_forward_s", {}) if gpu.measured else {}
        layer_fb_times = gpu.measured.get("layer_forward_backward_s", {}) if gpu.measured else {}
        return cls(
            gpu_type=gpu.type,
            dtype=dtype,
            dtype_bytes=DTYPE_BYTES[dtype],
            peak_flops=peak,
            gemm_flops=gemm_flops,
            memory_bandwidth=memory_bandwidth,
            attention_peak_flops=attn_peak * attn_scale,
            flash_attention=flash,
            intra_busbw=intra,
            host_link_bandwidth=HOST_LINK_GBPS[_host_pcie_gen(gpu)] * GBPS,
            is_cpu=gpu.type == "cpu",
            measured_layer_forward_s=dict(layer_times) if isinstance(layer_times, Mapping) else {},
            measured_layer_forward_backward_s=dict(layer_fb_times) if isinstance(layer_fb_times, Mapping) else {},
            measured_sequence={k: gpu.measured[k] for k in (SEQUENCE_KEY, SEQUENCE_PARTS_KEY)
                               if gpu.measured and isinstance(gpu.measured.get(k), Mapping)},
            sources=tuple(sources),
            gemm_input_bytes=FP8_INPUT_BYTES if dtype == "fp8" else 0.0,
            intra_latency_s=intra_latency_s,
            fused_elementwise=bool(fused_elementwise),
            eager_attention=not fused_elementwise or attention_kernel == "eager",
            mem_efficient_attention=(sdpa and flash_attention is None and attention_kernel != "eager" and not flash
                                     and gpu.type != "cpu"),
            collective_wait_s=(wait_us or 0.0) * 1e-6,
            reduce_scatter_busbw=(op_busbw["reduce_scatter_busbw_gbps"] or 0.0) * GBPS,
            all_gather_busbw=(op_busbw["all_gather_busbw_gbps"] or 0.0) * GBPS,
            optimizer_tensor_s=(tensor_us or 0.0) * 1e-6,
            optimizer_param_s=(param_ns or 0.0) * 1e-9,
            host_op_s=(host_op_us * 1e-6 if host_op_us is not None else 0.0 if gpu.type == "cpu" else HOST_OP_S),
            fsdp_unit_forward_s=(fsdp_us[0] or 0.0) * 1e-6,
            fsdp_unit_backward_s=(fsdp_us[1] or 0.0) * 1e-6,
            optimizer_sharded_tensor_s=(fsdp_us[2] or 0.0) * 1e-6,
            gemm_curve=MeasuredGemmCurve.from_rows(sweep) if sweep else None,
            attention_curve=attention_curve(gpu.type, attention_kernel) if flash else None,
        )

    # ------------------------------------------------------------------ kernels
    def gemm_s(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Time of ``count`` GEMMs of shape (M x K) @ (K x N): from the measured sweep where there is one (see
        gemm_curve), else the catalog curve, the additive roofline."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        if self.gemm_curve is not None:
            return count * 2.0 * m * n * k / self.gemm_curve.flops_per_s(m, n, k, self.roofline_flops_per_s)
        return count * self._roofline_s(m, n, k)

    def _roofline_s(self, m: float, n: float, k: float) -> float:
        inputs = self.gemm_input_bytes or self.dtype_bytes
        traffic = inputs * (m * k + k * n) + self.dtype_bytes * m * n
        return 2.0 * m * n * k / self.gemm_flops + traffic / self.memory_bandwidth

    def roofline_flops_per_s(self, m: float, n: float, k: float) -> float:
        """The catalog curve: achieved FLOP/s of one GEMM by the additive roofline (no measured sweep)."""
        return 2.0 * m * n * k / self._roofline_s(m, n, k)

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """Achieved fraction of the dense peak for one GEMM (for explanations and tests)."""
        t = self.gemm_s(m, n, k)
        return 0.0 if t == 0 else 2.0 * m * n * k / t / self.peak_flops

    def memory_s(self, nbytes: float) -> float:
        return nbytes / self.memory_bandwidth

    @property
    def attention_flops(self) -> float:
        """Fused attention's FLOP/s where no kernel curve applies: FLASH_ATTENTION_EFFICIENCY of the scaled peak."""
        return self.attention_peak_flops * FLASH_ATTENTION_EFFICIENCY

    def attention_flops_per_s(self, seq_len: float, head_dim: float) -> float:
        """Fused attention's FLOP/s (forward + backward convention of attention_kernels) at this shape."""
        if self.attention_curve is None:
            return self.attention_flops
        return self.attention_peak_flops * self.attention_curve.fraction(seq_len, head_dim)


def ridge_intensity(dev: DeviceModel) -> float:
    """Arithmetic intensity (FLOP/byte) at which a GEMM's memory time equals its compute time."""
    return dev.gemm_flops / dev.memory_bandwidth


def saturating_efficiency(intensity_flop_per_byte: float, dev: DeviceModel) -> float:
    """eff(I) = (F_gemm / peak) / (1 + ridge / I): the saturating curve the additive roofline implies."""
    if intensity_flop_per_byte <= 0:
        return 0.0
    return (dev.gemm_flops / dev.peak_flops) / (1.0 + ridge_intensity(dev) / intensity_flop_per_byte)
