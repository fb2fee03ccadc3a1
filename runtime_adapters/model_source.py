"""Where the torch runtime gets a pipeline stage's module from: the model-source interface.

A model source builds, for one plan stage, the stage's parts (the embedding if the stage is first, its layers
[start, stop), the final norm and head if it is last) as one ``nn.Module``. The contract every stage module keeps,
so that any layout of the same model trains the same model:

* ``forward(x)``: ``x`` is the token ids (B, T) int64 on the first stage and the hidden states (B, T, H) from the
  previous stage otherwise; it returns the logits (B, T, V) on the last stage and the hidden states (B, T, H)
  otherwise. One tensor in, one out, because the pipeline sends exactly that between stages. Nothing else travels:
  sequences are whole (no padding), so each stage rebuilds what its layers need from T alone: position ids
  ``0..T-1``, the causal attention mask, and rotary cos/sin from its own rotary module.
* Parameter names are ``embedding.*``, ``layers.<global layer index>.*`` (a ``layers`` ``nn.ModuleDict`` keyed by
  the global index as a string) and ``head.*``: checkpoints are then layout-agnostic
  (``tangram_launch.checkpoint.keys``, ``local_numbering="global"``) and FSDP2 wraps one unit per layer.
* Weights: each part initialises from its own seed (``part_seed(seed, part)``: 0 = embedding, i + 1 = layer i,
  num_layers + 1 = head), never from construction order, so every layout starts from the same weights.
* Optional hooks the runtime calls when the plan asks for them: ``tensor_parallel_plan()`` (submodule path ->
  "colwise" | "rowwise", for stage.tp > 1), ``set_recompute(mode)`` (none | selective | full) and
  ``set_compute_dtype(dtype)`` (bf16/fp16 plans). A plan that needs a hook the module lacks is refused by name.

Sources: :class:`BuiltinGPT` (``runtime_adapters.gpt``), ``runtime_adapters.hf_model.HFSource`` (Hugging Face
transformers), and :class:`LayeredSource` for any model a user can cut into embedding / layer i / head factories::

    source = LayeredSource(embedding=lambda: MyEmbed(), layer=lambda i: MyBlock(i), head=lambda: MyHead(),
                           num_layers=8)
    ctx = TorchAdapter().setup(plan, place, model_source=source)
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime_adapters.gpt import StageModule, gpt_plan_problems, part_seed
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Stage
from tangram_launch.specs.model import ModelSpec


@runtime_checkable
class ModelSource(Protocol):
    """Builds the stage modules of one model (the contract is in this module's docstring)."""

    def plan_problems(self, plan: Plan) -> list[str]:
        """Why this source cannot build the plan's stages (pure; no process group); [] when it can."""

    def build_stage(self, spec: ModelSpec, stage: Stage, seed: int) -> nn.Module:
        """The stage's module on the CPU: embedding if ``stage.has_embedding``, layers ``stage.layers``, head if
        ``stage.has_head``; weights seeded per part from ``seed``."""


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a part's construction/initialisation under its own seed without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class BuiltinGPT:
    """The project's own GPT (``runtime_adapters.gpt.StageModule``) as a model source."""

    def plan_problems(self, plan: Plan) -> list[str]:
        return gpt_plan_problems(plan, moe=True)

    def build_stage(self, spec: ModelSpec, stage: Stage, seed: int) -> nn.Module:
        return StageModule(spec, stage.layers, has_embedding=stage.has_embedding, has_head=stage.has_head,
                           seed=seed)


class LayeredStage(nn.Module):
    """A stage of a user's layered model: [embedding] -> layers in order -> [head], with full recompute and
    autocast. Each layer maps hidden (B, T, H) -> hidden (B, T, H)."""

    def __init__(self, embedding: nn.Module | None, layers: dict[int, nn.Module], head: nn.Module | None,
                 tp_plan: Callable[[int], dict[str, str]] | None = None) -> None:
        super().__init__()
        self.embedding = embedding
        self.layers = nn.ModuleDict({str(i): m for i, m in sorted(layers.items())})
        self.head = head
        self.recompute = "none"
        self.compute_dtype: torch.dtype | None = None
        self._tp_plan = tp_plan

    def set_recompute(self, mode: str) -> None:
        """none | full (every layer re-runs in backward); selective needs to know the attention core, which a
        generic layer does not expose: refused."""
        if mode not in ("none", "full"):
            raise SpecError("a LayeredSource stage recomputes whole layers only", field="recompute", value=mode,
                            valid="none, full")
        self.recompute = mode

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        self.compute_dtype = dtype

    def tensor_parallel_plan(self) -> dict[str, str]:
        if self._tp_plan is None:
            raise SpecError("tp > 1 needs LayeredSource(tp_plan=...) (layer index -> {path in the layer: colwise|"
                            "rowwise})", field="tp_plan", value=None)
        return {f"layers.{k}.{path}": kind for k in self.layers for path, kind in self._tp_plan(int(k)).items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.compute_dtype or torch.float32,
                            enabled=self.compute_dtype is not None):
            if self.embedding is not None:
                x = self.embedding(x)  # (B, T) -> (B, T, H)
            for layer in self.layers.values():
                if self.recompute == "full" and torch.is_grad_enabled():
                    x = checkpoint(layer, x, use_reentrant=False)
                else:
                    x = layer(x)
            if self.head is not None:
                x = self.head(x)  # (B, T, H) -> (B, T, V)
        return x


class LayeredSource:
    """A model source from three factories: ``embedding()``, ``layer(i)`` (global index i) and ``head()``.

    Each factory runs under its part's seed (``part_seed``), so a module that initialises itself in its
    constructor (as torch's layers do) gets the same weights under every layout. ``tp_plan(i)``: optional
    tensor-parallel plan of layer i (path inside the layer -> "colwise" | "rowwise").
    """

    def __init__(self, *, embedding: Callable[[], nn.Module], layer: Callable[[int], nn.Module],
                 head: Callable[[], nn.Module], num_layers: int,
                 tp_plan: Callable[[int], dict[str, str]] | None = None) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise SpecError("must be a positive integer", field="num_layers", value=num_layers)
        self.embedding, self.layer, self.head = embedding, layer, head
        self.num_layers, self.tp_plan = num_layers, tp_plan

    def plan_problems(self, plan: Plan) -> list[str]:
        n = int(plan.model.get("num_layers", 0))
        problems = [] if n == self.num_layers else [
            f"model: the plan's model has {n} layers, the LayeredSource {self.num_layers}"]
        problems += [f"stage {s.index}: recompute '{s.recompute}' (a LayeredSource recomputes whole layers: none, "
                     "full)" for s in plan.stages if s.recompute not in ("none", "full")]
        if self.tp_plan is None:
            problems += [f"stage {s.index}: tp={s.tp} needs LayeredSource(tp_plan=...)" for s in plan.stages
                         if s.tp > 1]
        return problems

    def build_stage(self, spec: ModelSpec, stage: Stage, seed: int) -> nn.Module:
        start, stop = stage.layers
        if not 0 <= start < stop <= self.num_layers:
            raise SpecError("layer range must be [start, stop) inside the model", field="layers",
                            value=list(stage.layers), valid=f"0 <= start < stop <= {self.num_layers}")
        embedding = head = None
        if stage.has_embedding:
            with seeded(part_seed(seed, 0)):
                embedding = self.embedding()
        layers = {}
        for i in range(start, stop):
            with seeded(part_seed(seed, i + 1)):
                layers[i] = self.layer(i)
        if stage.has_head:
            with seeded(part_seed(seed, self.num_layers + 1)):
                head = self.head()
        return LayeredStage(embedding, layers, head, tp_plan=self.tp_plan)
