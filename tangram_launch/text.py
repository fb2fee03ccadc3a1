"""Wording shared by the commands' output."""
from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``plural(1, "sequence")`` -> "1 sequence", ``plural(4, "micro-batch", "micro-batches")`` -> "4 micro-batches"."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {many or (noun + 'es' if noun.endswith(('ch', 'sh', 's', 'x')) else noun + 's')}"


def on_cpu(gpu_types) -> bool:
    """Whether every device is a CPU process (the catalog's ``cpu`` placeholder); island names count too, as they
    are the type's name, or the type's name and a number ('cpu', 'cpu-2')."""
    types = [str(t) for t in gpu_types]
    return bool(types) and all(t == "cpu" or t.startswith("cpu-") for t in types)


def devices(count: int, *, cpu: bool) -> str:
    """``devices(2, cpu=True)`` -> "2 CPU processes", ``devices(1, cpu=False)`` -> "1 GPU"."""
    return plural(count, "CPU process", "CPU processes") if cpu else plural(count, "GPU")


def device_noun(*, cpu: bool) -> str:
    """The plural noun alone, for headings and column titles."""
    return "CPU processes" if cpu else "GPUs"
