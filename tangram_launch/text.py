"""Wording shared by the commands' output."""
from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``plural(1, "sequence")`` -> "1 sequence", ``plural(4, "micro-batch", "micro-batches")`` -> "4 micro-batches"."""
    if count == 1:
        return f"{count} {noun}"
    return f"{count} {many or (noun + 'es' if noun.endswith(('ch', 'sh', 's', 'x')) else noun + 's')}"
