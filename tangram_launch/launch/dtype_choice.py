"""Which dtype a launch trains in when the user gives none, and which peak its MFU is against.

On GPUs the catalog default (bf16) stands. On CPU processes the profile is the only authority: whether bf16
matmul has hardware support (AVX-512 BF16, AMX) decides whether it runs several times faster than fp32 or tens of
times slower, so the default is the dtype the profile measured fastest among those allowed, and the launcher
prints why. An explicit ``--dtype`` (or a resumed checkpoint's dtype) always wins.

Pure functions over a ClusterSpec's figures; the launcher logs the returned reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.specs.cluster import ClusterSpec

# Dtypes a CPU launch may pick by itself: the profiler times these GEMMs (fp16 has no CPU training path here).
CPU_CANDIDATE_DTYPES = ("fp32", "bf16")
MEASURED_TYPES = ("cpu", "custom")  # GPUSpec types whose ``tflops`` are the profiler's measurements, not a catalog's


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to train in and one line saying why."""

    dtype: str
    reason: str


def _tflops(x: float) -> str:
    return f"{x:.3g} TFLOP/s"


def choose_dtype(explicit: str | None, default: str, measured_tflops: Mapping[str, float | None] | None,
                 allowed: Sequence[str] = CPU_CANDIDATE_DTYPES) -> DtypeChoice:
    """``explicit`` if given; else, with ``measured_tflops`` (dtype -> the slowest device's measured GEMM rate;
    None where no figure is measured, e.g. GPUs with catalog peaks), the fastest measured dtype in ``allowed``
    (ties: the earlier in ``allowed``); else ``default``."""
    if explicit:
        return DtypeChoice(explicit, f"dtype {explicit}: as given")
    rates = {d: float(measured_tflops[d]) for d in allowed
             if measured_tflops and measured_tflops.get(d) and float(measured_tflops[d]) > 0}
    if not rates:
        return DtypeChoice(default, f"dtype {default}: the default; pass --dtype to choose")
    best = max(rates, key=lambda d: (rates[d], -list(allowed).index(d)))
    others = ", ".join(f"{d} {rates[d]:.3g}" for d in rates if d != best)
    return DtypeChoice(best, f"dtype {best}: fastest measured on this cluster ({best} {_tflops(rates[best])}"
                             f"{', ' + others if others else ''}); pass --dtype to choose")


def launch_dtype_choice(cluster: "ClusterSpec | None", *, default: str, given: str | None,
                        resumed_plan: Mapping | None = None) -> DtypeChoice:
    """The dtype of a plan: ``--dtype`` (``given``), else the resumed checkpoint's, else the fastest measured on a
    CPU cluster (none before the cluster is known), else ``default``."""
    if given:
        return DtypeChoice(given, f"dtype {given}: given with --dtype")
    resumed = ((resumed_plan or {}).get("training") or {}).get("dtype")
    if resumed:
        return DtypeChoice(str(resumed), f"dtype {resumed}: the checkpoint's; pass --dtype to change it")
    return choose_dtype(None, default, measured_cpu_tflops(cluster) if cluster is not None else None)


def _measured_gemm(gpu, dtype: str) -> float | None:
    """The profiler's GEMM rate of ``gpu`` in ``dtype`` where its figures are the measured ones (CPU processes,
    GPUs the catalog does not know); None for catalog figures, including the ``cpu`` placeholder's."""
    if gpu.type not in MEASURED_TYPES:
        return None
    value = ((gpu.measured or {}).get("gemm_tflops") or {}).get(dtype)
    return float(value) if value else None


def measured_cpu_tflops(cluster: "ClusterSpec") -> dict[str, float | None] | None:
    """Per dtype, the slowest device's measured GEMM rate when every device of ``cluster`` is a profiled CPU
    process (the slowest stage bounds a pipeline); None for a cluster with GPUs or with the catalog's placeholder
    ``cpu`` figures, whose default dtype stays the default."""
    gpus = [g for _, g in cluster.iter_gpus()]
    if not gpus or any(g.type != "cpu" for g in gpus):
        return None
    out: dict[str, float | None] = {}
    for d in CPU_CANDIDATE_DTYPES:
        values = [_measured_gemm(g, d) for g in gpus]
        out[d] = min(v for v in values if v is not None) if all(values) else None
    return out if any(out.values()) else None


def mfu_peak_label(cluster: "ClusterSpec", dtype: str) -> str:
    """What the plan's MFU is a fraction of, in words: a catalog peak, or (CPU processes, unknown GPUs) the
    profiler's measured GEMM rate in the training dtype, which is no hardware peak."""
    gpus = [g for _, g in cluster.iter_gpus()]
    what = "CPU processes" if all(g.type == "cpu" for g in gpus) else "GPUs"
    measured = [_measured_gemm(g, dtype) is not None for g in gpus]
    if all(measured):
        return f"the measured {dtype} GEMM rate of the {what} used, not a hardware peak"
    if any(measured):
        return f"the {dtype} peak of the GPUs used (the measured GEMM rate where the catalog has none)"
    if what == "CPU processes":
        return f"the catalog's placeholder {dtype} figure for CPU processes, not a measurement"
    return f"the catalog {dtype} peak of the GPUs used"
