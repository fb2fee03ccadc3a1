"""Adapters by name: built-ins imported lazily, third-party ones through the entry point group
``tangram_launch.runtime_adapters`` (value: ``module:Class``)."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from tangram_launch.errors import SpecError
from tangram_launch.specs.yamlio import closest

BUILTIN_ADAPTERS = {
    "torch": "runtime_adapters.torch_native:TorchAdapter",
    "deepspeed": "runtime_adapters.deepspeed_adapter:DeepSpeedAdapter",
    "megatron": "runtime_adapters.megatron_adapter:MegatronAdapter",
}
ENTRY_POINT_GROUP = "tangram_launch.runtime_adapters"


def available_adapters() -> dict[str, str]:
    found = dict(BUILTIN_ADAPTERS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def get_adapter(name: str):
    """An adapter instance by name; unknown names list the registered ones."""
    known = available_adapters()
    if name not in known:
        hint = closest(name, known)
        raise SpecError("unknown runtime adapter (did you forget to register it under the entry point group "
                        f"'{ENTRY_POINT_GROUP}'?)", field="runtime", value=name,
                        valid=(f"did you mean '{hint}'? " if hint else "") + ", ".join(sorted(known)))
    module_name, _, attr = known[name].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return cls()
