"""Interleaved 1F1B in the torch runtime: each pipeline rank holds ``virtual_stages`` model chunks.

The plan lays the chunks out chunk-major (``tangram_launch.plan.interleaved_chunks``): virtual stage ``j * S + k`` is
chunk ``j`` of pipeline rank ``k``, the embedding on virtual stage 0 and the head on the last. That is the order
Megatron-core's virtual pipeline uses and the "loop" stage-to-rank mapping of
``torch.distributed.pipelining.ScheduleInterleaved1F1B`` (stage ``i`` on group rank ``i mod S``), so one list of
``PipelineStage`` objects per rank, one per chunk, runs the plan as costed.

A rank's chunks are also one ``ChunkedStage`` module whose parameter names are the chunks' own global names
(``embedding.*``, ``layers.<i>.*``, ``head.*``): the optimizer, tensor parallel plan, gradient all-reduce and
layout-agnostic checkpoints see one stage module, whatever the number of chunks.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Stage


def chunk_stages(plan: Plan, stage: Stage) -> list[Stage]:
    """The plan stage's chunks as stages of their own (one per virtual stage, in schedule order)."""
    last = plan.num_stages - 1
    v = len(stage.chunks)
    return [replace(stage, layers=chunk, chunks=(), has_embedding=stage.index == 0 and j == 0,
                    has_head=stage.index == last and j == v - 1)
            for j, chunk in enumerate(stage.chunks)]


def chunk_problems(plan: Plan) -> list[str]:
    """What the chunks need (pure): every virtual stage holds at least one layer."""
    if plan.schedule != "interleaved-1F1B":
        return []
    out = [f"stage {s.index}: {s.num_layers} layers cannot fill {plan.virtual_stages} virtual stages "
           f"(each chunk needs a layer)" for s in plan.stages if s.num_layers < plan.virtual_stages]
    return out  # expert parallelism: a declared capability (TORCH.interleaved_expert_parallel)


class ChunkedStage(nn.Module):
    """A rank's model chunks seen as one stage module under the chunks' own (global) names.

    Each chunk's children are registered here by name; ``ModuleDict`` children (the layers, keyed by global index)
    merge, so ``layers.5`` is the same module here and in its chunk. The chunks themselves are kept in a plain
    list (not registered), so no parameter appears twice. ``forward`` runs the chunks in order: the whole stage's
    layers in model order only when the chunks are consecutive (one rank holding the whole model)."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunk_modules = list(chunks)
        for c, chunk in enumerate(chunks):
            for name, param in chunk.named_parameters(recurse=False):
                self._add(name, param, c)
            for name, child in chunk.named_children():
                if isinstance(child, nn.ModuleDict) and isinstance(getattr(self, name, None), nn.ModuleDict):
                    merged = getattr(self, name)
                    for key, sub in child.items():
                        if key in merged:
                            raise SpecError("two chunks hold one module", field="chunks", value=f"{name}.{key}")
                        merged[key] = sub
                elif isinstance(child, nn.ModuleDict):
                    self.add_module(name, nn.ModuleDict(dict(child.items())))
                else:
                    self._add(name, child, c)

    def _add(self, name: str, value: Any, chunk: int) -> None:
        if name in self._modules or name in self._parameters:
            raise SpecError("two chunks hold a part of one name", field=f"chunks[{chunk}]", value=name)
        if isinstance(value, nn.Parameter):
            self.register_parameter(name, value)
        else:
            self.add_module(name, value)

    def _each(self, method: str, *args: Any) -> None:
        for chunk in self.chunk_modules:
            fn: Callable | None = getattr(chunk, method, None)
            if fn is None:
                raise SpecError(f"every chunk needs {method}()", field="model chunk", value=type(chunk).__name__)
            fn(*args)

    def set_recompute(self, mode: str) -> None:
        self._each("set_recompute", mode)

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        self._each("set_compute_dtype", dtype)

    def set_moe_losses(self, **coeffs: float) -> None:
        for chunk in self.chunk_modules:
            if hasattr(chunk, "set_moe_losses"):
                chunk.set_moe_losses(**coeffs)

    def moe_layers(self) -> list:
        return [m for chunk in self.chunk_modules for m in getattr(chunk, "moe_layers", list)()]

    def tensor_parallel_plan(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for chunk in self.chunk_modules:
            out.update(chunk.tensor_parallel_plan())
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for chunk in self.chunk_modules:
            x = chunk(x)
        return x


def chunk_key_map(plan: Plan, stage: Stage) -> Callable[[str], str]:
    """Local -> global state names of a ChunkedStage (already global; checked against the stage's chunks), for
    ``tangram_launch.checkpoint.StageState.from_module``."""
    from tangram_launch.checkpoint.keys import LayerKeyMap

    maps = [LayerKeyMap.for_stage(c, local_numbering="global") for c in chunk_stages(plan, stage)]

    def to_global(key: str) -> str:
        for m in maps:
            try:
                return m.to_global(key)
            except SpecError:
                continue
        raise SpecError(f"stage {stage.index} holds no part named so (its chunks hold layers "
                        f"{[list(c) for c in stage.chunks]})", field="state key", value=key)
    return to_global


def build_interleaved_schedule(plan: Plan, stage: Stage, chunks: list[nn.Module], pp_group: Any,
                               device: torch.device, loss_fn: Callable) -> Any:
    """One PipelineStage per chunk (virtual stage j*S + k) under ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    num_stages = plan.num_stages * plan.virtual_stages
    stages = [PipelineStage(chunk, j * plan.num_stages + stage.index, num_stages, device, group=pp_group)
              for j, chunk in enumerate(chunks)]
    return ScheduleInterleaved1F1B(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)
