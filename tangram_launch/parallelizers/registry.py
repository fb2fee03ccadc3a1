"""Parallelizers by name: the built-ins (imported lazily) and third-party ones from an entry point.

A third-party package registers a factory (a class or a function returning an object with ``name`` and
``query(SliceQuery) -> SliceResult``) in its packaging metadata::

    [project.entry-points."tangram_launch.parallelizers"]
    alpa = "my_package.alpa_parallelizer:AlpaParallelizer"

and ``tangram-launch plan --parallelizer alpa`` finds it. Built-in names win over entry points of the same name.
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import Parallelizer
from tangram_launch.specs.yamlio import closest

if TYPE_CHECKING:  # pragma: no cover
    from importlib import metadata

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tangram_launch.parallelizers"
DEFAULT = "megatron"
BUILTIN = {
    "megatron": "tangram_launch.parallelizers.megatron:MegatronParallelizer",
    "uniform": "tangram_launch.parallelizers.uniform:UniformParallelizer",
}


def _entry_points() -> dict[str, "metadata.EntryPoint"]:
    # imported here: a built-in name needs no packaging metadata (importlib.metadata and the email package it loads
    # are a noticeable share of a small planning run's CPU)
    from importlib import metadata

    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_names() -> list[str]:
    """Built-in names first, then entry-point names (sorted)."""
    extra = sorted(n for n in _entry_points() if n not in BUILTIN)
    return list(BUILTIN) + extra


def _load(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get_parallelizer(name: str, **options) -> Parallelizer:
    """A new parallelizer instance by name; unknown names raise SpecError listing the registered ones."""
    if name in BUILTIN:
        factory = _load(BUILTIN[name])
    else:
        eps = _entry_points()
        if name not in eps:
            names = registered_names()
            hint = closest(str(name), names)
            raise SpecError("unknown parallelizer" + (f" (did you mean '{hint}'?)" if hint else ""),
                            field="parallelizer", value=name,
                            valid=", ".join(names) + f" (third-party ones register under the entry point group "
                                                     f"'{ENTRY_POINT_GROUP}'; did you forget to install one?)")
        try:
            factory = eps[name].load()
        except Exception as exc:  # a broken plugin is a user-environment problem, reported by name
            raise SpecError(f"cannot load parallelizer plugin ({type(exc).__name__}: {exc})", field="parallelizer",
                            value=name, valid=f"entry point {eps[name].value}") from exc
    instance = factory(**options)
    if not isinstance(instance, Parallelizer):
        raise SpecError("plugin does not implement the parallelizer interface (needs `name` and `query`)",
                        field="parallelizer", value=name)
    return instance
