"""Hugging Face transformers causal LMs as a model source: the plan's stages cut from a ``config.json``.

    source = HFSource.from_pretrained("path/to/model")         # config.json [+ *.safetensors as starting weights]
    source = HFSource(config)                                   # a transformers config: random init
    ctx = TorchAdapter().setup(plan, place, model_source=source)

Supported families (``FAMILIES``): Llama, Mistral, Qwen2, Qwen3 (rotary, RMSNorm, gated FFN), GPT-2 and OPT
(learned positions, LayerNorm). Each stage holds transformers' own modules (the decoder layers are the library's
classes, run with the library's mask functions and rotary module), regrouped as ``embedding.*``, ``layers.<global
i>.*`` and ``head.*`` (the contract of ``runtime_adapters.model_source``); ``hf_name``/``global_name`` translate
between these names and the checkpoint names of ``AutoModelForCausalLM`` (``model.layers.3.mlp.up_proj.weight``).

How a stage is built: the whole model is instantiated on the ``meta`` device (no memory), the stage's parts are
taken from it, materialised, and each part initialised by the model class's own ``_init_weights`` under its own seed,
so every layout of the plan starts from the same weights (not those of ``from_config``'s single RNG stream).
With ``weights`` (a local directory of ``*.safetensors``) the stage then reads exactly its own tensors.

Attention runs with the implementation in the config (``attn_implementation``; default "eager", which matches
an unsplit model bit for bit on CPU). Dropout follows the config and, when non-zero, makes runs differ by layout.
Tensor parallelism: Megatron-style column/row splits on the HF module names for the Llama family (whose attention
reads the head count from the projection's output); GPT-2 (one fused Conv1D for q/k/v) and OPT (views with the
full head count) are refused for tp > 1 with the reason. Recompute: full (each layer re-runs in
backward) or selective (only the attention core: softmax/score matmuls/SDPA are recomputed, everything else saved,
via torch's selective activation checkpointing).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime_adapters.gpt import as_model_spec
from runtime_adapters.model_source import part_seed, seeded
from tangram_launch.checkpoint import model_differences
from tangram_launch.checkpoint.keys import EMBEDDING, HEAD, LAYERS
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Stage
from tangram_launch.specs.constants import RECOMPUTE_MODES
from tangram_launch.specs.model import ModelSpec, from_hf_config


@dataclass(frozen=True)
class HFLayout:
    """Where a family keeps its parts inside ``AutoModelForCausalLM`` (dotted paths), and how its stage runs."""

    embedding: Mapping[str, str]  # our part name -> HF module path (absent modules are skipped)
    layers: str  # the ModuleList of decoder layers
    head: Mapping[str, str]
    rotary: str | None = None
    kind: str = "rotary"  # rotary | gpt2 | opt: how embedding and layers are called
    tp_plan: Mapping[str, str] = field(default_factory=dict)  # path inside a layer -> colwise | rowwise
    no_tp_because: str = ""  # why a family without tp_plan has none


_LLAMA_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
             "mlp.down_proj": "rowwise"}
_LLAMA = HFLayout(embedding={"embed_tokens": "model.embed_tokens"}, layers="model.layers",
                  head={"norm": "model.norm", "lm_head": "lm_head"}, rotary="model.rotary_emb", tp_plan=_LLAMA_TP)
FAMILIES: dict[str, HFLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "gpt2": HFLayout(embedding={"wte": "transformer.wte", "wpe": "transformer.wpe", "drop": "transformer.drop"},
                     layers="transformer.h", head={"ln_f": "transformer.ln_f", "lm_head": "lm_head"}, kind="gpt2",
                     no_tp_because="its q/k/v projection is one fused Conv1D, which DTensor's linear styles cannot "
                                   "split by heads"),
    "opt": HFLayout(embedding={"embed_tokens": "model.decoder.embed_tokens",
                               "embed_positions": "model.decoder.embed_positions",
                               "project_in": "model.decoder.project_in"},
                    layers="model.decoder.layers",
                    head={"final_layer_norm": "model.decoder.final_layer_norm",
                          "project_out": "model.decoder.project_out", "lm_head": "lm_head"}, kind="opt",
                    no_tp_because="its attention reshapes q/k/v with the model's full head count, so a shard of "
                                  "the heads does not fit"),
}
# attention-core ops recomputed under selective recompute (eager: score/value matmuls, softmax; sdpa kernels)
_ATTENTION_CORE_OPS = ("aten.bmm", "aten._softmax", "aten._scaled_dot_product", "aten.masked_fill", "aten.where")


def family_of(config: Any) -> HFLayout:
    """The layout of a transformers config's model_type; others are refused with the supported list."""
    model_type = str(getattr(config, "model_type", "") or "")
    if model_type not in FAMILIES:
        raise SpecError("this Hugging Face architecture is not supported by the torch runtime's HF source",
                        field="config.model_type", value=model_type or None,
                        valid=", ".join(sorted(FAMILIES)) + " (or write a LayeredSource: README, 'Train your own "
                                                            "model')")
    return FAMILIES[model_type]


def load_config(path: str | os.PathLike, *, attn_implementation: str = "eager") -> Any:
    """A transformers config from a config.json or the folder that holds it (local files only).

    The file is read through :mod:`tangram_launch.specs.limits` (bounded, control characters refused) and its
    ``model_type`` checked against ``FAMILIES`` before transformers sees it, so a folder's own code (``auto_map``)
    is never imported and transformers never asks whether to run it."""
    from tangram_launch.specs.limits import parse_json, read_text

    path = os.fspath(path)
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise SpecError("no config.json there", field="hf model", value=path,
                        valid="a local Hugging Face model folder or its config.json")
    data = parse_json(read_text(config_file, what="Hugging Face config.json"), source=config_file)
    if not isinstance(data, dict):
        raise SpecError("expected a JSON object at the top level", source=config_file, value=type(data).__name__)
    config = config_from_dict(data, source=config_file)
    if os.path.isdir(path):
        config._name_or_path = path  # as from_pretrained names it (the model's name in its spec)
    config._attn_implementation = attn_implementation
    return config


def config_from_dict(data: Mapping[str, Any], *, source: str | None = None) -> Any:
    """A transformers config from its dict form (``config.to_dict()`` / a config.json's content).

    Only the built-in config class of a supported family is used (``AutoConfig.for_model`` reads transformers' own
    registry, never ``auto_map``): another ``model_type`` is refused with the supported list."""
    from transformers import AutoConfig

    data = dict(data)
    model_type = data.pop("model_type", None)
    check_model_type(model_type, source=source)
    data.pop("auto_map", None)  # a pointer to the folder's own code: never followed, not kept in the config
    return AutoConfig.for_model(model_type, **data)


def check_model_type(model_type: Any, *, source: str | None = None) -> None:
    """``model_type`` names a supported family (before transformers is asked anything about it)."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise SpecError("this Hugging Face model_type is not supported (its folder's own code is never run)",
                        source=source, field="model_type", value=model_type,
                        valid=", ".join(sorted(FAMILIES)))


def _get(root: nn.Module, path: str) -> nn.Module | None:
    m: Any = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def hf_name(global_name: str, layout: HFLayout) -> str:
    """``layers.3.mlp.up_proj.weight`` -> ``model.layers.3.mlp.up_proj.weight`` (the AutoModelForCausalLM name)."""
    for prefix, parts in ((EMBEDDING, layout.embedding), (HEAD, layout.head)):
        if global_name.startswith(prefix):
            part, _, rest = global_name[len(prefix):].partition(".")
            if part in parts and rest:
                return f"{parts[part]}.{rest}"
    if global_name.startswith(LAYERS):
        return f"{layout.layers}.{global_name[len(LAYERS):]}"
    raise SpecError("not a global parameter name of this model", field="state key", value=global_name,
                    valid="embedding.<part>.*, layers.<i>.*, head.<part>.*")


def global_name(name: str, layout: HFLayout) -> str | None:
    """The inverse of ``hf_name``; None for a name outside the model's parts (e.g. a rotary buffer)."""
    if name.startswith(layout.layers + "."):
        return LAYERS + name[len(layout.layers) + 1:]
    for prefix, parts in ((EMBEDDING, layout.embedding), (HEAD, layout.head)):
        for part, path in parts.items():
            if name.startswith(path + "."):
                return f"{prefix}{part}.{name[len(path) + 1:]}"
    return None


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(op)
    if name.startswith(_ATTENTION_CORE_OPS):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


class HFStage(nn.Module):
    """One pipeline stage of a transformers causal LM (contract: ``runtime_adapters.model_source``)."""

    def __init__(self, config: Any, layout: HFLayout, embedding: nn.ModuleDict | None, layers: nn.ModuleDict,
                 head: nn.ModuleDict | None, rotary: nn.Module | None) -> None:
        super().__init__()
        self.config, self.layout = config, layout
        self.embedding, self.layers, self.head = embedding, layers, head
        self.rotary = rotary  # buffers only (no parameters): every stage computes its own cos/sin
        self.recompute = "none"
        self.compute_dtype: torch.dtype | None = None

    # --- hooks the torch runtime calls ---------------------------------------------------------------------------
    def set_recompute(self, mode: str) -> None:
        """none | selective (attention core only) | full (whole layer, re-run in backward)."""
        if mode not in RECOMPUTE_MODES:
            raise SpecError("unknown recompute mode", field="recompute", value=mode, valid=", ".join(RECOMPUTE_MODES))
        self.recompute = mode

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        self.compute_dtype = dtype

    def tensor_parallel_plan(self) -> dict[str, str]:
        if not self.layout.tp_plan:
            raise SpecError(f"no tensor parallelism for this family: {self.layout.no_tp_because}",
                            field="config.model_type", value=self.config.model_type,
                            valid=", ".join(k for k, v in FAMILIES.items() if v.tp_plan))
        return {f"layers.{k}.{path}": kind for k in self.layers for path, kind in self.layout.tp_plan.items()}

    # --- forward ---------------------------------------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        e = self.embedding
        if self.layout.kind == "gpt2":
            return e["drop"](e["wte"](tokens) + e["wpe"](position_ids))
        x = e["embed_tokens"](tokens)  # (B, T, E)
        if self.layout.kind == "opt":
            pos = e["embed_positions"](None, 0, position_ids=position_ids.expand(tokens.shape[0], -1))
            if "project_in" in e:
                x = e["project_in"](x)
            return x + pos
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.head.values():  # norm [, project_out], lm_head: in the layout's order
            x = part(x)
        return x

    def _layer_kind(self, index: int) -> str:
        kinds = getattr(self.config, "layer_types", None)
        if kinds:
            return kinds[index]
        if self.config.model_type == "mistral" and getattr(self.config, "sliding_window", None) is not None:
            return "sliding_attention"
        return "full_attention"

    def _masks(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kinds = {self._layer_kind(int(k)) for k in self.layers}
        out = {}
        for kind in kinds:
            fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            out[kind] = fn(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                           position_ids=None if self.layout.kind == "opt" else position_ids)
        return out

    def _run_layer(self, layer: nn.Module, h: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        call = functools.partial(layer, **kwargs)
        if self.recompute == "none" or not torch.is_grad_enabled():
            out = call(h)
        elif self.recompute == "full":
            out = checkpoint(call, h, use_reentrant=False)
        else:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            out = checkpoint(call, h, use_reentrant=False,
                             context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy))
        return out[0] if isinstance(out, tuple) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.compute_dtype or torch.float32,
                            enabled=self.compute_dtype is not None):
            t = x.shape[1]
            position_ids = torch.arange(t, device=x.device).unsqueeze(0)  # (1, T): whole sequences, no padding
            h = self._embed(x, position_ids) if self.embedding is not None else x  # (B, T, H)
            if len(self.layers):
                masks = self._masks(h, position_ids)
                common: dict[str, Any] = {"position_ids": position_ids, "use_cache": False}
                if self.rotary is not None:
                    common["position_embeddings"] = self.rotary(h, position_ids)  # (cos, sin), each (1, T, hd)
                for key, layer in self.layers.items():
                    h = self._run_layer(layer, h, {"attention_mask": masks[self._layer_kind(int(key))], **common})
            if self.head is not None:
                h = self._head(h)  # (B, T, V)
        return h


class HFSource:
    """A transformers causal LM as a model source (see the module docstring).

    ``config``: a transformers ``PretrainedConfig`` of a supported family; ``weights``: optional local folder of
    ``*.safetensors`` (a ``save_pretrained`` output) whose tensors replace the random init.
    """

    def __init__(self, config: Any, *, weights: str | os.PathLike | None = None) -> None:
        self.layout = family_of(config)
        self.config = copy.deepcopy(config)
        if getattr(self.config, "_attn_implementation", None) is None:
            self.config._attn_implementation = "eager"
        self.weights = os.fspath(weights) if weights is not None else None
        if self.weights is not None and not _safetensors_files(self.weights):
            raise SpecError("no *.safetensors files in the weights folder", field="weights", value=self.weights,
                            valid="a folder written by save_pretrained (safetensors)")

    def set_attention(self, implementation: str) -> None:
        """transformers' attention implementation ("eager", "sdpa", ...) of the modules built from now on."""
        self.config._attn_implementation = implementation

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, attn_implementation: str = "eager") -> "HFSource":
        """A local HF folder: its config.json, and its safetensors as starting weights when it has any."""
        config = load_config(path, attn_implementation=attn_implementation)
        folder = os.fspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        return cls(config, weights=folder if _safetensors_files(folder) else None)

    def model_spec(self) -> ModelSpec:
        """The planner's view of this model (the same translation ``tangram-launch plan --model DIR`` uses)."""
        return from_hf_config(self.config.to_dict())

    def plan_problems(self, plan: Plan) -> list[str]:
        problems = [f"model: {k} is {b!r} in the plan but {a!r} in the Hugging Face config"
                    for k, a, b in model_differences(self.model_spec().to_dict(), plan.model)]
        try:
            spec = as_model_spec(plan.model)
        except SpecError as exc:
            return problems + [f"model: {exc}"]
        for s in plan.stages:
            if s.tp > 1:
                if not self.layout.tp_plan:
                    problems.append(f"stage {s.index}: tp={s.tp}, but {self.config.model_type} has no tensor-"
                                    f"parallel plan: {self.layout.no_tp_because}")
                for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                                ("ffn_hidden_size", spec.ffn_hidden_size)):
                    if n % s.tp:
                        problems.append(f"stage {s.index}: tp={s.tp} does not divide {what}={n}")
            if s.ep > 1:
                problems.append(f"stage {s.index}: ep={s.ep} (the HF source builds dense models)")
        if spec.tied_embeddings and plan.num_stages > 1:
            problems.append("tied embeddings need the embedding and the head in one stage (set "
                            "tie_word_embeddings=false to split them)")
        return problems

    def build_stage(self, spec: ModelSpec, stage: Stage, seed: int) -> HFStage:
        from transformers import AutoModelForCausalLM

        n = self.config.num_hidden_layers  # GPT-2's n_layer answers to this name too
        start, stop = stage.layers
        if not 0 <= start < stop <= n:
            raise SpecError("layer range must be [start, stop) inside the model", field="layers",
                            value=list(stage.layers), valid=f"0 <= start < stop <= {n}")
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(self.config, trust_remote_code=False)  # meta: no memory
        layout = self.layout

        def parts(paths: Mapping[str, str]) -> nn.ModuleDict:
            return nn.ModuleDict({k: m for k, p in paths.items() if (m := _get(whole, p)) is not None})

        embedding = parts(layout.embedding) if stage.has_embedding else None
        all_layers = _get(whole, layout.layers)
        layers = nn.ModuleDict({str(i): all_layers[i] for i in range(start, stop)})
        head = parts(layout.head) if stage.has_head else None
        rotary = _get(whole, layout.rotary) if layout.rotary else None
        module = HFStage(whole.config, layout, embedding, layers, head, rotary)
        module.to_empty(device="cpu")
        init = whole._init_weights
        tied = bool(getattr(whole.config, "tie_word_embeddings", False))
        if tied and embedding is not None and head is not None:
            head["lm_head"].weight = embedding[next(iter(embedding))].weight  # one tensor, as in the HF model
        for part_index, part in ([(n + 1, head)] if head is not None else []) + \
                [(i + 1, layers[str(i)]) for i in range(start, stop)] + \
                ([(0, embedding)] if embedding is not None else []):  # embedding last: it wins a tied weight
            for p in part.parameters():
                if hasattr(p, "_is_hf_initialized"):
                    del p._is_hf_initialized
            with seeded(part_seed(seed, part_index)):
                part.apply(init)  # children first, then the parent (GPT-2's scaled residual init lands last)
        if rotary is not None:  # buffers only; on meta they were never computed
            real = dict(type(rotary)(config=whole.config).named_buffers())
            with torch.no_grad():
                for name, buf in rotary.named_buffers():
                    buf.copy_(real[name])
        if self.weights is not None:
            load_stage_weights(module, self.weights)
        return module.train()  # training mode throughout (dropout as the config says), whatever the meta model had


def _safetensors_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def stage_hf_names(module: HFStage) -> dict[str, str]:
    """The stage's parameter names -> AutoModelForCausalLM names (tied weights appear once, under the embedding)."""
    out = {}
    for name, _ in module.named_parameters():
        if name.startswith(("embedding.", "layers.", "head.")):
            out[name] = hf_name(name, module.layout)
    return out


@contextlib.contextmanager
def _safetensors_refusal(path: str) -> Iterator[None]:
    """A truncated or malformed safetensors file is bad input (SpecError naming it), not a traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(f"not a readable safetensors file ({type(exc).__name__}: {str(exc)[:200]})", source=path,
                        field="weights", valid="a file written by save_pretrained / safetensors") from None


def load_stage_weights(module: HFStage, folder: str) -> None:
    """Copy the stage's tensors from a folder of safetensors (reads only the tensors this stage holds)."""
    from safetensors import safe_open

    wanted = {hf: local for local, hf in stage_hf_names(module).items()}
    params = dict(module.named_parameters())
    found: set[str] = set()
    for path in _safetensors_files(folder):
        with _safetensors_refusal(path), safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    value = f.get_tensor(key)
                    target = params[wanted[key]]
                    if tuple(value.shape) != tuple(target.shape):
                        raise SpecError("tensor shape differs from the config's", source=path, field=key,
                                        value=list(value.shape), valid=str(list(target.shape)))
                    with torch.no_grad():
                        target.copy_(value)
                    found.add(key)
    missing = set(wanted) - found
    if module.head is not None and "lm_head" in module.head and getattr(module.config, "tie_word_embeddings", False):
        missing.discard(hf_name("head.lm_head.weight", module.layout))  # tied: stored once, under the embedding
    if missing:
        raise SpecError(f"{len(missing)} tensors of this stage are not in the weights folder", source=folder,
                        field="weights", value=sorted(missing)[:5])


def to_hf_state_dict(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A whole model's state under global names -> AutoModelForCausalLM names (what save_pretrained writes)."""
    layout = family_of(config)
    out = {hf_name(k, layout): v for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        out.pop(hf_name("head.lm_head.weight", layout), None)
    return out


def save_hf(out_dir: str | os.PathLike, config: Any, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Write ``config.json`` + ``model.safetensors`` that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    ``state``: the whole model under global names (``embedding.*``, ``layers.<i>.*``, ``head.*``). Returns the
    files written."""
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    tensors = to_hf_state_dict(state, config)
    n = config.num_hidden_layers
    have = {int(k.split(".")[1]) for k in state if k.startswith(LAYERS)}
    if have != set(range(n)):
        raise SpecError("the state does not hold every layer of the model", field="layers",
                        value=sorted(set(range(n)) - have)[:10], valid=f"0..{n - 1}")
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    return [os.path.join(out_dir, "config.json"), weights]
