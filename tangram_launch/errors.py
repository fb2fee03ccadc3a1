"""Typed errors: user mistakes and infeasible requests are results the CLI reports, not tracebacks.

The CLI maps ``exit_code`` to the process status (2: bad input, 3: no feasible plan), as the issues require.
"""
from __future__ import annotations

from typing import Any, Iterable

_MISSING = object()


class TangramError(Exception):
    """Base class of every error the CLI reports without a traceback."""

    exit_code = 1


class SpecError(TangramError, ValueError):
    """Bad user input: names the file, the field, the value and what would be valid."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        field: str | None = None,
        value: Any = _MISSING,
        valid: str | None = None,
    ) -> None:
        self.source = source
        self.field = field
        self.value = None if value is _MISSING else value
        self.valid = valid
        parts = []
        if source:
            parts.append(str(source))
        if field:
            parts.append(f"field '{field}'")
        head = ": ".join(parts)
        text = f"{head}: {message}" if head else message
        if value is not _MISSING:
            text += f" (got {value!r})"
        if valid:
            text += f"; valid: {valid}"
        super().__init__(text)


class InfeasibleError(TangramError):
    """No plan can run the request; ``reasons`` say why (memory, GPU counts, capabilities)."""

    exit_code = 3

    def __init__(self, message: str, reasons: Iterable[str] = ()) -> None:
        self.reasons = list(reasons)
        text = message
        if self.reasons:
            text += "\n" + "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(text)
