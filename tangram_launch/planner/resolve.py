"""The parallelizer and the runtime capabilities a planning request names, as objects (the search and
hand-written plans both start here)."""
from __future__ import annotations

from tangram_launch.capabilities import RuntimeCapabilities, capabilities_for
from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import Parallelizer


def resolve_parallelizer(parallelizer: str | Parallelizer, gpu_counts: str = "tiling") -> Parallelizer:
    """The parallelizer by name or as given; ``gpu_counts`` other than the default is passed to a named one's
    factory (a parallelizer without that option is refused, as is a given instance set otherwise)."""
    if isinstance(parallelizer, str):
        from tangram_launch.parallelizers.registry import get_parallelizer  # floor 3, loaded on demand

        if gpu_counts == "tiling":
            return get_parallelizer(parallelizer)
        try:
            return get_parallelizer(parallelizer, gpu_counts=gpu_counts)
        except TypeError as exc:
            raise SpecError(f"parallelizer {parallelizer!r} has no GPU-count option ({exc})", field="gpu_counts",
                            value=gpu_counts, valid="tiling") from exc
    if not hasattr(parallelizer, "query"):
        raise SpecError("not a parallelizer (needs .name and .query(SliceQuery))", field="parallelizer",
                        value=type(parallelizer).__name__)
    if getattr(parallelizer, "gpu_counts", "tiling") != gpu_counts:
        raise SpecError(f"the parallelizer given offers gpu_counts={getattr(parallelizer, 'gpu_counts', 'tiling')!r}",
                        field="gpu_counts", value=gpu_counts)
    return parallelizer


def resolve_capabilities(runtime: str | RuntimeCapabilities) -> RuntimeCapabilities:
    return runtime if isinstance(runtime, RuntimeCapabilities) else capabilities_for(runtime)
