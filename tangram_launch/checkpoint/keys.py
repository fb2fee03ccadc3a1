"""Global names for one rank's training state: the key convention that makes checkpoints layout-agnostic.

A checkpoint never says "stage 1" or "rank 3". Every tensor is named by the part of the model it belongs to::

    embedding.<param>             the input embedding (first stage)
    layers.<global i>.<param>     transformer layer i, counted over the whole model
    head.<param>                  final norm and output projection (last stage)

and optimizer state is keyed by the same parameter names (``layers.5.mlp.fc_in.weight`` -> ``{"step",
"exp_avg", "exp_avg_sq"}``), never by a parameter's position in ``optimizer.state_dict()``, which changes with the
stage's layer range. A stage module may number its layers locally (``layers.0`` = the stage's first layer, as a
``ModuleList`` does) or globally (``runtime_adapters.gpt.StageModule``); :class:`LayerKeyMap` translates either way
and refuses names outside the stage. Pure torch; no process groups.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, TypeVar

import torch

from tangram_launch.checkpoint.state_fields import ABSENT, check_hparam
from tangram_launch.errors import SpecError
from tangram_launch.plan import Stage

logger = logging.getLogger(__name__)

V = TypeVar("V")

EMBEDDING = "embedding."
LAYERS = "layers."
HEAD = "head."
_GLOBAL_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
NUMBERINGS = ("local", "global")


def layer_of(global_key: str) -> int | None:
    """The global layer index of a ``layers.<i>.<param>`` key; None for embedding/head keys."""
    m = _GLOBAL_LAYER.match(global_key)
    return int(m.group(1)) if m else None


def part_of(global_key: str) -> str:
    """``embedding`` | ``layers`` | ``head``; SpecError for a name outside the convention."""
    if global_key.startswith(EMBEDDING) and len(global_key) > len(EMBEDDING):
        return "embedding"
    if global_key.startswith(HEAD) and len(global_key) > len(HEAD):
        return "head"
    if _GLOBAL_LAYER.match(global_key):
        return "layers"
    raise SpecError("not a global state name", field="state key", value=global_key,
                    valid="embedding.<param>, layers.<global layer>.<param>, head.<param>")


def format_layers(layers: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (for messages about missing layers)."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(layers)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


@dataclass(frozen=True)
class LayerKeyMap:
    """Local <-> global state names for one pipeline stage.

    ``layer_prefix`` is where the stage module keeps its layers (``layers.`` for a ModuleList/ModuleDict attribute
    called ``layers``; Megatron-core: ``decoder.layers.``); ``local_numbering`` says whether the index after it
    counts from the stage's first layer ("local") or over the whole model ("global"). ``parts`` maps the local
    prefixes of the non-layer parts to global ones, which must start with ``embedding.`` or ``head.`` (Megatron-core:
    ``{"embedding.": "embedding.", "decoder.final_layernorm.": "head.final_layernorm.",
    "output_layer.": "head.output_layer."}``). The longest matching local prefix wins.
    """

    layers: tuple[int, int]  # [start, stop) over the whole model
    has_embedding: bool
    has_head: bool
    local_numbering: str = "local"
    layer_prefix: str = LAYERS
    parts: Mapping[str, str] = field(default_factory=lambda: {EMBEDDING: EMBEDDING, HEAD: HEAD})

    def __post_init__(self) -> None:
        start, stop = self.layers
        if not 0 <= start <= stop:
            raise SpecError("layer range must be [start, stop) with 0 <= start <= stop", field="layers",
                            value=list(self.layers))
        if self.local_numbering not in NUMBERINGS:
            raise SpecError("unknown layer numbering", field="local_numbering", value=self.local_numbering,
                            valid=", ".join(NUMBERINGS))
        if not self.layer_prefix.endswith("."):
            raise SpecError("a prefix ends with '.'", field="layer_prefix", value=self.layer_prefix)
        for local, glob in self.parts.items():
            if not (local.endswith(".") and glob.endswith(".")):
                raise SpecError("part prefixes end with '.'", field="parts", value={local: glob})
            if not glob.startswith((EMBEDDING, HEAD)):
                raise SpecError("a part's global prefix starts with 'embedding.' or 'head.'", field="parts",
                                value={local: glob})
        object.__setattr__(self, "parts", dict(self.parts))
        # longest local prefix first, so "decoder.final_layernorm." wins over a shorter "decoder." entry
        object.__setattr__(self, "_ordered_parts", sorted(self.parts.items(), key=lambda kv: -len(kv[0])))

    @classmethod
    def for_stage(cls, stage: Stage, **kwargs: Any) -> "LayerKeyMap":
        """The map of a plan stage (layer range, embedding, head); ``kwargs`` set numbering and prefixes."""
        return cls(layers=tuple(stage.layers), has_embedding=stage.has_embedding, has_head=stage.has_head, **kwargs)

    @property
    def global_layers(self) -> range:
        return range(*self.layers)

    def owns(self, global_key: str) -> bool:
        """Whether a global name belongs to this stage (its layers, plus embedding/head where it holds them)."""
        part = part_of(global_key)
        if part == "embedding":
            return self.has_embedding
        if part == "head":
            return self.has_head
        return layer_of(global_key) in self.global_layers

    def to_global(self, local_key: str) -> str:
        for local, glob in self._ordered_parts:  # type: ignore[attr-defined]
            if local_key.startswith(local) and not (
                    local_key.startswith(self.layer_prefix) and len(self.layer_prefix) > len(local)):
                name = glob + local_key[len(local):]
                if not self.owns(name):
                    raise SpecError(f"stage holding layers {list(self.layers)} has no {part_of(name)} part but "
                                    "its state names one", field="state key", value=local_key)
                return name
        if local_key.startswith(self.layer_prefix):
            index, _, rest = local_key[len(self.layer_prefix):].partition(".")
            if index.isdigit() and rest:
                i = int(index) + (self.layers[0] if self.local_numbering == "local" else 0)
                if i not in self.global_layers:
                    raise SpecError(f"layer {i} is outside this stage's layers [{self.layers[0]}, {self.layers[1]})"
                                    f" ({self.local_numbering} numbering)", field="state key", value=local_key)
                return f"{LAYERS}{i}.{rest}"
        raise SpecError("state name matches neither the layer prefix nor a part prefix", field="state key",
                        value=local_key,
                        valid=f"{self.layer_prefix}<i>.*, " + ", ".join(f"{p}*" for p in self.parts))

    def to_local(self, global_key: str) -> str:
        if not self.owns(global_key):
            raise SpecError(f"not held by the stage with layers [{self.layers[0]}, {self.layers[1]})",
                            field="state key", value=global_key)
        i = layer_of(global_key)
        if i is not None:
            rest = global_key.split(".", 2)[2]
            j = i - self.layers[0] if self.local_numbering == "local" else i
            return f"{self.layer_prefix}{j}.{rest}"
        for local, glob in sorted(self.parts.items(), key=lambda kv: -len(kv[1])):
            if global_key.startswith(glob):
                return local + global_key[len(glob):]
        raise SpecError("no local prefix maps to this global name", field="state key", value=global_key,
                        valid=", ".join(f"{g}*" for g in self.parts.values()))

    def rename_to_global(self, state: Mapping[str, V]) -> dict[str, V]:
        """A stage's local state dict under global names (two local names for one global name are refused)."""
        out: dict[str, V] = {}
        for key, value in state.items():
            name = self.to_global(key)
            if name in out:
                raise SpecError("two local state names map to one global name", field="state key",
                                value=[key, name])
            out[name] = value
        return out

    def rename_to_local(self, state: Mapping[str, V]) -> dict[str, V]:
        return {self.to_local(k): v for k, v in state.items()}


# --- optimizer state by parameter name -------------------------------------------------------------------------

@dataclass(frozen=True)
class NamedOptimizerState:
    """torch.optim state keyed by global parameter name, so it reshards with the parameters.

    ``tensors``: name -> {state name -> tensor} (Adam/AdamW: step, exp_avg, exp_avg_sq[, max_exp_avg_sq]; SGD:
    momentum_buffer); ``scalars``: non-tensor state values (JSON-able: None, bool, int, float); ``hparams``: the
    hyperparameters of the group each parameter was in (lr, betas, eps, weight_decay, ...), JSON-able.
    """

    tensors: Mapping[str, Mapping[str, torch.Tensor]]
    scalars: Mapping[str, Mapping[str, Any]]
    hparams: Mapping[str, Mapping[str, Any]]


def _jsonable(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return repr(value)  # "inf"/"nan" survive as strings; float("inf") reads them back
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, where) for v in value]
    raise SpecError("optimizer value is not a number, bool, string, None or a list of them", field=where,
                    value=type(value).__name__)


def _param_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict()`` numbers them: group by group, then within the group."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            param_names: Mapping[torch.Tensor, str]) -> NamedOptimizerState:
    """The optimizer's state under global parameter names (values are the optimizer's own tensors, not copies)."""
    sd = optimizer.state_dict()
    params = _param_order(optimizer)
    ids = {id(p): n for p, n in param_names.items()}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    hparams: dict[str, dict[str, Any]] = {}
    index = 0
    for gi, group in enumerate(sd["param_groups"]):
        hp = {k: _jsonable(v, f"param_groups[{gi}].{k}") for k, v in group.items()
              if k not in ("params", "param_names")}
        for idx in group["params"]:
            param = params[index]
            index += 1
            name = ids.get(id(param))
            if name is None:
                raise SpecError("an optimizer parameter has no name in the stage's state", field="optimizer",
                                value=f"param_groups[{gi}] parameter of shape {tuple(param.shape)}")
            hparams[name] = hp
            for key, value in sd["state"].get(idx, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors.setdefault(name, {})[key] = value
                else:
                    scalars.setdefault(name, {})[key] = _jsonable(value, f"optimizer state {name}.{key}")
    return NamedOptimizerState(tensors=tensors, scalars=scalars, hparams=hparams)


def _restore_type(saved: Any, current: Any) -> Any:
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, torch.Tensor) and not isinstance(saved, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, float) and isinstance(saved, str):
        return float(saved)
    return saved


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, param_names: Mapping[torch.Tensor, str],
                                 state: NamedOptimizerState, *, restore_hparams: bool = True,
                                 source: str = "optimizer state") -> None:
    """Load state keyed by global names into an optimizer built over a (possibly different) set of parameters.

    Parameters with no saved state start fresh (as they would before their first step). Through
    ``Optimizer.load_state_dict``, so the optimizer's own dtype/device rules apply. Group hyperparameters are taken
    from the first parameter of each group that has them; a group whose parameters were saved with different
    hyperparameters is logged. Every saved hyperparameter is checked against the group's own (``source``: the
    file named in errors).
    """
    ids = {id(p): n for p, n in param_names.items()}
    current = optimizer.state_dict()
    params = _param_order(optimizer)
    new_state: dict[int, dict[str, Any]] = {}
    new_groups = []
    index = 0
    for gi, group in enumerate(current["param_groups"]):
        names = []
        for idx in group["params"]:
            name = ids.get(id(params[index]))
            index += 1
            if name is None:
                raise SpecError("an optimizer parameter has no name in the stage's state", field="optimizer",
                                value=f"param_groups[{gi}]")
            names.append(name)
            entry: dict[str, Any] = {}
            entry.update({k: _restore_type(v, None) for k, v in state.scalars.get(name, {}).items()})
            entry.update(state.tensors.get(name, {}))
            if entry:
                new_state[idx] = entry
        new_group = dict(group)
        if restore_hparams:
            saved = [state.hparams[n] for n in names if n in state.hparams]
            if saved:
                if any(s != saved[0] for s in saved[1:]):
                    logger.warning("optimizer group %d: its parameters were saved with different hyperparameters; "
                                   "using those of %s", gi, next(n for n in names if n in state.hparams))
                first = next(n for n in names if n in state.hparams)
                for k, v in saved[0].items():
                    checked = check_hparam(k, v, group.get(k, ABSENT), source=source, field=f"{first}.hparams.{k}")
                    new_group[k] = _restore_type(checked, group.get(k))
        new_groups.append(new_group)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
