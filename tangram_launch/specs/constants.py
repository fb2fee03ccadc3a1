"""The words every layer shares, defined once: dtypes, recompute modes, ZeRO stages, runtime names, GiB.

On the ground floor so that specs, the cost model, the Plan, the planner, the launcher and the adapters all validate
against the same tuples (a new recompute mode or runtime is added here, and every parser and check follows).
"""
GIB = 1024**3  # bytes per GiB (memory figures are GiB; link figures are GB/s, 10**9 bytes)

DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8")  # training dtypes, in the order tables print them
# tf32: fp32 storage, TF32 tensor-core matmuls (torch.backends.cuda.matmul.allow_tf32). fp8: FP8 GEMMs with bf16
# storage and everything else in bf16, as Transformer Engine runs it. What a GPU needs for each, for refusals:
# A tf32 plan's stages record their math mode (specs.cluster.math_mode): TF32 tensor-core matmuls, or strict FP32
# on GPUs without TF32. The adapters set allow_tf32 per rank from it.
MATH_MODES = ("tf32", "fp32")
STORAGE_DTYPES = ("bf16", "fp16", "fp32")  # what tensors are stored in (gradients, the profiler's GEMM timings)
DTYPE_NEEDS = {"tf32": "TF32 tensor cores (Ampere or newer)",
               "fp8": "FP8 tensor cores (H100, H200, B200, L40S, L4)",
               "bf16": "BF16 tensor cores (Ampere or newer)"}
# attention kernels the cost model prices (costmodel/attention_kernels.py): auto, the runtimes' own fused kernel;
# fa2 / cudnn, a fused kernel named; eager, unfused attention that keeps its s x s scores for the backward
ATTENTION_KERNELS = ("auto", "fa2", "cudnn", "eager")
ATTENTION_KERNEL_HELP = ("attention kernel the job runs, for the cost model (default auto: FlashAttention-2 on "
                         "Ampere, cuDNN on Hopper, as Transformer Engine and PyTorch SDPA pick them; fa2 for a stack "
                         "that runs FlashAttention-2 on Hopper too, e.g. PyTorch 2.5.1-2.8's SDPA; eager for "
                         "unfused attention, which keeps the s x s scores: transformers' eager, train_hf.py --attn eager)")
RECOMPUTE_MODES = ("none", "selective", "full")  # activation recomputation (Korthikanti et al. 2022)
ZERO_STAGES = (0, 1, 2, 3)  # ZeRO optimizer/gradient/parameter sharding (Rajbhandari et al. 2020)
# Memory a plan leaves free on every GPU, as a fraction of its capacity: the cost model's memory figures are
# estimates (benchmarks/bench_costmodel_published.py reports their error), and the allocator needs slack.
DEFAULT_MEMORY_HEADROOM_FRACTION = 0.05
SCHEDULES = ("1F1B", "interleaved-1F1B")  # pipeline schedules (Narayanan et al. 2021, sec. 2.2)
RUNTIMES = ("torch", "deepspeed", "megatron")  # built-in runtimes (capabilities.runtime adds registered ones)
DEFAULT_RUNTIME = "torch"  # where none is given: the command lines, the planner, a Plan without one
