"""Adapters by name, from the one runtime registry (tangram_launch.capabilities.runtime: each runtime's capabilities
with its adapter): built-ins imported lazily, third-party ones through the entry point group
``tangram_launch.runtime_adapters`` (value: ``module:Class``)."""
from __future__ import annotations

from tangram_launch.capabilities import (ADAPTER_ENTRY_POINT_GROUP, BUILTIN_RUNTIMES, adapter_entry_points, runtime,
                                         runtime_names)

BUILTIN_ADAPTERS = {name: rt.adapter_target for name, rt in BUILTIN_RUNTIMES.items()}
ENTRY_POINT_GROUP = ADAPTER_ENTRY_POINT_GROUP


def available_adapters() -> dict[str, str]:
    """Every registered runtime's adapter target (``module:Class``), built-ins first."""
    eps = adapter_entry_points()
    return {n: BUILTIN_ADAPTERS[n] if n in BUILTIN_ADAPTERS else eps[n].value for n in runtime_names()}


def get_adapter(name: str):
    """An adapter instance by name; unknown names list the registered ones."""
    return runtime(name).adapter()
