"""TrainingSpec: the shape of one training iteration (batch, sequence, precision, optimizer)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import ATTENTION_KERNELS, DEFAULT_MEMORY_HEADROOM_FRACTION, STORAGE_DTYPES
from tangram_launch.specs.yamlio import check_keys

# Storage bytes per element: tf32 stores fp32 (only the matmuls round to TF32); fp8 stores bf16 parameters and
# activations (Transformer Engine casts GEMM inputs to FP8 inside each layer and keeps bf16 master copies outside).
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp8": 2}
FULL_PRECISION_DTYPES = ("fp32", "tf32")  # fp32 storage: the optimizer needs no separate master copy
# Optimizer state bytes per parameter with mixed precision (fp32 master copy + moments), Rajbhandari et al. 2020
# (ZeRO, sec. 3.1: "K = 12" for Adam: 4 master + 4 momentum + 4 variance). SGD with momentum: master + momentum.
OPTIMIZER_STATE_BYTES = {"adam": 12, "adamw": 12, "sgd": 8}


@dataclass(frozen=True)
class TrainingSpec:
    global_batch: int = 8  # sequences per iteration
    seq_len: int = 2048
    dtype: str = "bf16"  # compute and parameter dtype
    optimizer: str = "adam"
    grad_dtype: str = "fp32"  # gradient accumulation/reduction precision (Megatron's default: fp32 main grads)
    # MoE only: auxiliary losses added per MoE layer and routed token group (Switch Transformer's load-balancing loss,
    # Fedus et al. 2022 eq. 4, coefficient 0.01 there; ST-MoE's router z-loss, Zoph et al. 2022 eq. 5, 0.001 there)
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.001
    memory_headroom_fraction: float = DEFAULT_MEMORY_HEADROOM_FRACTION  # of each GPU's memory a plan leaves free
    # the fused-attention kernel the job runs (costmodel/attention_kernels.py): auto = what the project's runtimes run
    # (FlashAttention-2 on Ampere, cuDNN on Hopper); fa2 / cudnn when the job's stack runs that one everywhere
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError("must be a positive integer", field=name, value=v, valid="an integer >= 1")
        from tangram_launch.specs.limits import check_training_sizes

        check_training_sizes(self.global_batch, self.seq_len)
        if self.dtype not in DTYPE_BYTES:
            raise SpecError("unknown dtype", field="dtype", value=self.dtype, valid=", ".join(DTYPE_BYTES))
        if self.grad_dtype not in STORAGE_DTYPES:
            raise SpecError("unknown gradient dtype", field="grad_dtype", value=self.grad_dtype,
                            valid=", ".join(STORAGE_DTYPES))
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SpecError("must be a number >= 0", field=name, value=v, valid="a number >= 0 (0: no such loss)")
        h = self.memory_headroom_fraction
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h < 1.0:
            raise SpecError("must be a fraction of GPU memory in [0, 1)", field="memory_headroom_fraction", value=h,
                            valid="e.g. 0.05 (5 %: 4 GiB of an 80 GB GPU)")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise SpecError("unknown attention kernel", field="attention_kernel", value=self.attention_kernel,
                            valid=", ".join(ATTENTION_KERNELS))
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise SpecError("unknown optimizer", field="optimizer", value=self.optimizer,
                            valid=", ".join(OPTIMIZER_STATE_BYTES))

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_dtype]

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes per parameter of optimizer state (incl. the fp32 master copy when training in 16 bits)."""
        k = OPTIMIZER_STATE_BYTES[self.optimizer]
        return k if self.dtype not in FULL_PRECISION_DTYPES else k - 4  # fp32 storage: no separate master copy

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self, *, moe: bool = True) -> dict:
        """``moe=False`` leaves out the MoE loss coefficients: a dense model's plan reads as it did before them."""
        out = asdict(self)
        if not moe:
            del out["moe_aux_loss_coeff"], out["moe_z_loss_coeff"]
        if out["attention_kernel"] == "auto":
            del out["attention_kernel"]  # the default: a plan reads as it did before the choice existed
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str | None = None) -> "TrainingSpec":
        check_keys(d, ("global_batch", "seq_len", "dtype", "optimizer", "grad_dtype", "memory_headroom_fraction",
                       "moe_aux_loss_coeff", "moe_z_loss_coeff", "attention_kernel"), where="training",
                   source=source)
        return cls(**dict(d))
