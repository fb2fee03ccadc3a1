"""What PyTorch's CUDA caching allocator reserves beyond the bytes a plan needs.

A plan fits when the bytes it needs fit (memory.py: live tensors, the activations' fragmentation allowance, the
runtime's own overhead). What a user then reads -- nvidia-smi, ``torch.cuda.max_memory_reserved`` -- is the
allocator's reserve, which is larger: the default allocator splits cached blocks and never merges blocks of
different segments, so freed blocks of one size stand idle while a request of another size takes new memory. GMLake
(Guo et al., ASPLOS '24, arXiv:2401.08156) measured that fragmentation, (reserved - allocated) / reserved, at 15 %
on average and up to 33 % over eight LLM training set-ups on A100-80GB. With ``expandable_segments:True`` a segment
grows in place and requests of changing sizes reuse it; that term is not counted there (the activations' own
allowance, memory.FRAGMENTATION_FRACTION, stays in the needed bytes either way).

Under pressure the allocator frees its idle cached blocks and retries before it reports out-of-memory, so the
reserve never exceeds the device: a plan that needs less than the device is not refused for its reserve.
"""
from __future__ import annotations

from typing import Mapping

from tangram_launch.errors import SpecError

ALLOCATOR_KINDS = ("caching", "expandable")
# GMLake's average fragmentation of the default caching allocator, (reserved - allocated) / reserved; not fitted
# on any published row of benchmarks/data/published_runs.yaml.
CACHING_FRAGMENTATION_FRACTION = 0.15
# Where torch reads the allocator's settings, first match wins (c10/cuda/CUDAAllocatorConfig.h, torch 2.9+).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(conf: str) -> dict[str, str]:
    """``key:value`` pairs of an allocator configuration string, as torch splits them (comma-separated)."""
    out: dict[str, str] = {}
    for item in conf.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def allocator_kind(environ: Mapping[str, str]) -> str:
    """The allocator the workers will run, from the environment they inherit: ``expandable`` where the first of
    ALLOC_CONF_VARIABLES that is set says ``expandable_segments:True`` (torch accepts only that spelling), else the
    default ``caching``."""
    for name in ALLOC_CONF_VARIABLES:
        conf = environ.get(name)
        if conf is not None:
            return "expandable" if allocator_settings(conf).get("expandable_segments") == "True" else "caching"
    return "caching"


def reserved_bytes(needed_bytes: float, *, overhead_bytes: float, device_bytes: float, allocator: str) -> float:
    """Bytes a GPU shows in use (nvidia-smi's view: the allocator's reserve plus the ``overhead_bytes`` it does not
    manage) when a stage needs ``needed_bytes`` (overhead included) on a device of ``device_bytes``. Subtract
    ``overhead_bytes`` for what ``torch.cuda.max_memory_reserved`` reads."""
    if allocator not in ALLOCATOR_KINDS:
        raise SpecError("unknown allocator", field="allocator", value=allocator, valid=", ".join(ALLOCATOR_KINDS))
    inside = max(0.0, needed_bytes - overhead_bytes)  # what the allocator hands out
    if allocator == "expandable":
        return inside + overhead_bytes
    reserve = inside / (1.0 - CACHING_FRAGMENTATION_FRACTION)
    room = max(inside, device_bytes - overhead_bytes)  # idle cached blocks are freed before an out-of-memory
    return min(reserve, room) + overhead_bytes
