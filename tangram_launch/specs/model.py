"""Model specification: the shape of a decoder-only transformer, its parameter counts and FLOPs.

A ``ModelSpec`` comes from a preset name (``tangram_launch/models/<name>.yaml``), a YAML file with the same keys as
``ModelSpec.to_dict()``, or a Hugging Face ``config.json``; ``load_model`` takes any of the three::

    load_model("llama3-8b")                  # preset (case and '_'/'-' are ignored: "Llama3_8B" works)
    load_model("my-model.yaml")              # our keys; unknown keys are refused
    load_model("ckpt/config.json")           # HF config (or the folder that holds it)

Counting conventions (the cost model relies on them):

* Parameters are exact for the architectures described (weights, biases, norms, router); the planner places them.
* FLOPs count matrix multiplications only, 2 FLOPs per multiply-accumulate. Norms, softmax, activations, bias adds
  and rotary embeddings are left out (< 1 % for the models here). With ``causal=False`` a layer costs, per token,
  ``24h^2 + 4sh`` for a GPT-style layer, which reproduces Narayanan et al. 2021, "Efficient large-scale language model
  training on GPU clusters using Megatron-LM" (SC'21), eq. (3) without recompute:
  ``72 * B * s * l * h^2 * (1 + s/(6h) + V/(12hl))`` training FLOPs per batch (3x forward).
* Attention is counted **causal by default**: a token attends on average to s/2 keys, so the two s-dependent matmuls
  (Q K^T and P V) count half of the non-causal ``4sh`` (what FlashAttention's causal kernel actually executes).
  Pass ``causal=False`` for the count Megatron-LM and the Narayanan formula use.
* For short sequences, training FLOPs per token ~ 6 x (active parameters touched by matmuls), the rule of Kaplan et
  al. 2020, "Scaling laws for neural language models", sec. 2.1 (C ~ 6N).
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping


from tangram_launch.errors import SpecError
from tangram_launch.specs.yamlio import check_keys, closest, load_yaml_file

logger = logging.getLogger(__name__)

FFN_TYPES = {"gelu": 2, "relu": 2, "swiglu": 3, "geglu": 3}   # name -> weight matrices per FFN
NORM_TYPES = ("layernorm", "rmsnorm")
POSITION_TYPES = ("learned", "rotary", "alibi", "none")      # only "learned" has parameters
# How the model's code computes its FFN activation: "kernel", one operator (F.gelu, nn.GELU, F.silu, relu, and every
# fused runtime); or the tanh-approximate GELU / sigmoid GELU written as separate tensor ops, each of which keeps its
# own operands for the backward (costmodel/memory.py composed_activation_saved_bytes): "gelu_new" (Hugging Face's
# NewGELUActivation, GPT-2 / GPT-Neo / GPT-J / CodeGen / Phi's activation_function, and minGPT's NewGELU),
# "gelu_fast" (FastGELUActivation), "quick_gelu" (x * sigmoid(1.702 x)).
ACTIVATION_IMPLS = ("kernel", "gelu_new", "gelu_fast", "quick_gelu")
# softmax_topk: softmax over all experts, the k largest kept (Mixtral, Qwen-MoE; Switch with k = 1).
# gshard_top2: GShard's top-2 gate (Lepikhin et al. 2021, Algorithm 1): weights renormalised over the two, the
#              load-balancing loss counts each token's first choice only.
ROUTER_TYPES = ("softmax_topk", "gshard_top2")
_MOE_ROUTING_FIELDS = ("router_type", "router_norm_topk", "capacity_factor")  # None on a dense model
_OMITTED_AT = {"activation_impl": "kernel"}  # left out of to_dict at this value: earlier plans' bytes stay as they were


def _bad(message: str, field_name: str, value: Any, valid: str) -> SpecError:
    return SpecError(message, field=field_name, value=value, valid=valid)


def _check_int(value: Any, name: str, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("expected an integer", name, value, f"an integer >= {minimum}")
    if value < minimum:
        raise _bad("must be positive" if minimum == 1 else f"must be >= {minimum}", name, value,
                   f"an integer >= {minimum}")


def _check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise _bad("expected true or false", name, value, "true | false")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (dense or MoE), validated on construction.

    Optional sizes (``head_dim``, ``expert_ffn_hidden_size``, ``norm_bias``, ``num_position_embeddings``) are
    resolved in ``__post_init__`` so that two specs describing the same model compare equal.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int            # dense layers' FFN width (HF intermediate_size / ffn_dim / n_inner)
    vocab_size: int
    head_dim: int | None = None     # default hidden_size // num_heads (Qwen3 sets 128 with hidden 2048, 32 heads)
    ffn_type: str = "gelu"          # "gelu"/"relu": 2 matrices; "swiglu"/"geglu": 3 matrices (gate, up, down)
    activation_impl: str = "kernel"  # ACTIVATION_IMPLS: one operator, or a GELU composed of separate tensor ops
    num_experts: int = 0            # 0 = dense
    top_k: int = 0
    expert_ffn_hidden_size: int | None = None   # default ffn_hidden_size (Mixtral); Qwen3-MoE: 768
    moe_layer_frequency: int = 1    # layer i (0-based) is MoE when (i+1) % k == 0 (GShard: 2; HF decoder_sparse_step)
    dense_layer_indices: tuple[int, ...] = ()   # layers forced dense in an MoE model (HF Qwen mlp_only_layers)
    num_shared_experts: int = 0     # always-active experts beside the routed ones (Qwen2-MoE style)
    shared_expert_ffn_hidden_size: int | None = None  # default expert_ffn_hidden_size
    shared_expert_gate: bool = False  # a sigmoid gate (hidden -> 1) scaling the shared experts' output (Qwen2-MoE)
    router_bias: bool = False
    router_type: str | None = None  # MoE: ROUTER_TYPES, default softmax_topk; None for a dense model
    router_norm_topk: bool | None = None  # MoE: renormalise the top-k weights to sum 1 (HF norm_topk_prob); default
                                          # true (Mixtral, Qwen3-MoE), false for Qwen2-MoE; ignored when top_k is 1
    capacity_factor: float | None = None  # MoE: tokens an expert takes per routed token group = ceil(cf * tokens *
                                          # top_k / num_experts), the rest dropped; None = dropless
    tied_embeddings: bool = False
    max_seq_len: int = 2048
    position_embedding: str = "learned"           # "learned" | "rotary" | "alibi" | "none"
    num_position_embeddings: int | None = None    # learned table rows; default max_seq_len (OPT: 2048 + 2 offset)
    norm_type: str = "layernorm"                  # "layernorm" | "rmsnorm"
    norm_bias: bool | None = None                 # default True for layernorm, False for rmsnorm
    final_norm: bool = True                       # OPT-350M (post-LN) has none
    qk_norm: bool = False                         # per-head norms on Q and K (Qwen3)
    linear_bias: bool = True                      # biases on every attention and FFN linear layer (GPT, OPT)
    qkv_bias: bool = False                        # bias on Q, K, V only (Qwen2); implied by linear_bias
    embedding_dim: int | None = None              # token-embedding width when projected to hidden (OPT-350M: 512)
    # dropout in training (its masks are activation memory); default by architecture: GPT-2/3 and OPT (learned
    # positions) train with dropout 0.1, while rotary/ALiBi models (Llama, Mistral, Qwen, Mixtral, MPT, BLOOM-176B)
    # train without it
    dropout: bool | None = None
    citation: str = ""                            # where the figures come from

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise _bad("expected a non-empty name", "name", self.name, "a string")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                     "max_seq_len", "moe_layer_frequency"):
            _check_int(getattr(self, name), name)
        for name in ("num_experts", "top_k", "num_shared_experts"):
            _check_int(getattr(self, name), name, minimum=0)
        from tangram_launch.specs.limits import check_model_sizes

        check_model_sizes(self)  # physically absurd sizes (10^9 layers) would exhaust memory or time later
        for name in ("router_bias", "tied_embeddings", "final_norm", "qk_norm", "linear_bias", "qkv_bias",
                     "shared_expert_gate"):
            _check_bool(getattr(self, name), name)
        if not isinstance(self.citation, str):
            raise _bad("expected a string", "citation", self.citation, "a string")

        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise _bad(f"num_heads must divide hidden_size {self.hidden_size} (or give head_dim)", "num_heads",
                           self.num_heads, f"a divisor of {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        else:
            _check_int(self.head_dim, "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise _bad(f"num_kv_heads must divide num_heads {self.num_heads} (grouped-query attention)",
                       "num_kv_heads", self.num_kv_heads, f"a divisor of {self.num_heads}")

        if not isinstance(self.ffn_type, str) or self.ffn_type not in FFN_TYPES:
            hint = closest(str(self.ffn_type), FFN_TYPES)
            raise _bad("unknown FFN type" + (f" (did you mean '{hint}'?)" if hint else ""), "ffn_type",
                       self.ffn_type, " | ".join(FFN_TYPES))
        if not isinstance(self.activation_impl, str) or self.activation_impl not in ACTIVATION_IMPLS:
            raise _bad("unknown activation implementation", "activation_impl", self.activation_impl,
                       " | ".join(ACTIVATION_IMPLS))
        if not isinstance(self.norm_type, str) or self.norm_type not in NORM_TYPES:
            raise _bad("unknown norm type", "norm_type", self.norm_type, " | ".join(NORM_TYPES))
        if not isinstance(self.position_embedding, str) or self.position_embedding not in POSITION_TYPES:
            raise _bad("unknown position embedding", "position_embedding", self.position_embedding,
                       " | ".join(POSITION_TYPES))

        if self.norm_bias is None:
            object.__setattr__(self, "norm_bias", self.norm_type == "layernorm")
        _check_bool(self.norm_bias, "norm_bias")

        if self.position_embedding == "learned":
            if self.num_position_embeddings is None:
                object.__setattr__(self, "num_position_embeddings", self.max_seq_len)
            _check_int(self.num_position_embeddings, "num_position_embeddings")
            if self.num_position_embeddings < self.max_seq_len:
                raise _bad(f"a learned position table must cover max_seq_len {self.max_seq_len}",
                           "num_position_embeddings", self.num_position_embeddings, f">= {self.max_seq_len}")
        else:
            if self.num_position_embeddings not in (None, 0):
                raise _bad(f"only learned positions have a table (position_embedding is "
                           f"'{self.position_embedding}')", "num_position_embeddings",
                           self.num_position_embeddings, "0 or omitted")
            object.__setattr__(self, "num_position_embeddings", 0)

        if self.dropout is None:
            object.__setattr__(self, "dropout", self.position_embedding == "learned")
        _check_bool(self.dropout, "dropout")

        if self.embedding_dim is None:
            object.__setattr__(self, "embedding_dim", self.hidden_size)
        _check_int(self.embedding_dim, "embedding_dim")

        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.num_experts == 0:
            if self.top_k:
                raise _bad("top_k needs experts", "top_k", self.top_k, "0 for a dense model, or set num_experts")
            for name in ("expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
                if getattr(self, name) is not None:
                    raise _bad("only MoE models have experts", name, getattr(self, name),
                               "omit it, or set num_experts")
            if self.num_shared_experts:
                raise _bad("only MoE models have experts", "num_shared_experts", self.num_shared_experts,
                           "0, or set num_experts")
            if self.shared_expert_gate:
                raise _bad("only MoE models have shared experts", "shared_expert_gate", True, "false")
            if self.dense_layer_indices:
                raise _bad("only MoE models have dense-layer overrides", "dense_layer_indices",
                           list(self.dense_layer_indices), "[] for a dense model")
            # a dense copy of an MoE spec (dataclasses.replace(num_experts=0, ...)) carries the resolved router
            # defaults: those mean nothing here and become None; anything else is a setting that would be ignored
            for name, default in (("router_type", "softmax_topk"), ("router_norm_topk", True),
                                  ("capacity_factor", None)):
                value = getattr(self, name)
                if value is not None and value != default:
                    raise _bad("only MoE models have a router", name, value, "omit it, or set num_experts")
                object.__setattr__(self, name, None)
            return
        if self.top_k == 0:
            raise _bad("an MoE model needs top_k (experts per token)", "top_k", self.top_k,
                       f"an integer in 1..{self.num_experts}")
        if self.top_k > self.num_experts:
            raise _bad(f"top_k exceeds num_experts {self.num_experts}", "top_k", self.top_k,
                       f"an integer in 1..{self.num_experts}")
        self._validate_router()
        if self.expert_ffn_hidden_size is None:
            object.__setattr__(self, "expert_ffn_hidden_size", self.ffn_hidden_size)
        _check_int(self.expert_ffn_hidden_size, "expert_ffn_hidden_size")
        if self.shared_expert_ffn_hidden_size is None:
            if self.num_shared_experts:
                object.__setattr__(self, "shared_expert_ffn_hidden_size", self.expert_ffn_hidden_size)
        else:
            _check_int(self.shared_expert_ffn_hidden_size, "shared_expert_ffn_hidden_size")
            if not self.num_shared_experts:
                raise _bad("a shared-expert size needs num_shared_experts >= 1", "shared_expert_ffn_hidden_size",
                           self.shared_expert_ffn_hidden_size, "omit it, or set num_shared_experts")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise _bad("a shared-expert gate needs num_shared_experts >= 1", "shared_expert_gate", True,
                       "false, or set num_shared_experts")
        if self.moe_layer_frequency > self.num_layers:
            raise _bad(f"no layer would be MoE with {self.num_layers} layers", "moe_layer_frequency",
                       self.moe_layer_frequency, f"an integer in 1..{self.num_layers}")
        indices = tuple(self.dense_layer_indices)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise _bad("layer index out of range", "dense_layer_indices", i, f"0..{self.num_layers - 1}")
        object.__setattr__(self, "dense_layer_indices", tuple(sorted(set(indices))))
        if self.num_moe_layers == 0:
            raise _bad("every MoE layer is overridden to dense", "dense_layer_indices",
                       list(self.dense_layer_indices), "leave at least one MoE layer, or set num_experts: 0")

    def _validate_router(self) -> None:
        if self.router_type is None:
            object.__setattr__(self, "router_type", "softmax_topk")
        if self.router_type not in ROUTER_TYPES:
            hint = closest(str(self.router_type), ROUTER_TYPES)
            raise _bad("unknown router type" + (f" (did you mean '{hint}'?)" if hint else ""), "router_type",
                       self.router_type, " | ".join(ROUTER_TYPES))
        if self.router_type == "gshard_top2" and self.top_k != 2:
            raise _bad("GShard's gate routes every token to two experts", "top_k", self.top_k,
                       "2 with router_type gshard_top2, or router_type softmax_topk")
        if self.router_norm_topk is None:
            object.__setattr__(self, "router_norm_topk", True)
        _check_bool(self.router_norm_topk, "router_norm_topk")
        cf = self.capacity_factor
        if cf is not None:
            if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf <= 0:
                raise _bad("expected a positive number", "capacity_factor", cf,
                           "a number > 0 (1.0: an even share per expert), or null for dropless routing")
            object.__setattr__(self, "capacity_factor", float(cf))

    def expert_capacity(self, tokens: int) -> int | None:
        """Tokens one expert takes from a routed group of ``tokens`` tokens: ceil(capacity_factor * tokens * top_k
        / num_experts); None when dropless. The group is one forward call of a layer on one rank (one micro-batch of
        one data-parallel replica), so a layout with the same micro-batches drops the same tokens."""
        if not self.is_moe or self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    # ------------------------------------------------------------------ shape helpers
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the K and V projection outputs (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    @property
    def ffn_matrices(self) -> int:
        return FFN_TYPES[self.ffn_type]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def _check_layer(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise _bad("layer index out of range", "layer", i, f"0..{self.num_layers - 1}")

    def is_moe_layer(self, i: int) -> bool:
        self._check_layer(i)
        return (self.is_moe and (i + 1) % self.moe_layer_frequency == 0
                and i not in self.dense_layer_indices)

    def layer_kind(self, i: int) -> str:
        """"dense" or "moe": layers of one kind have equal parameters and FLOPs, so slices of them interchange."""
        return "moe" if self.is_moe_layer(i) else "dense"

    # ------------------------------------------------------------------ parameters
    def _norm_params(self, width: int) -> int:
        return width * (2 if self.norm_bias else 1)

    def _ffn_params(self, width: int) -> int:
        """One FFN (or one expert) of inner width ``width``: 2 or 3 weight matrices h x width, plus biases."""
        params = self.ffn_matrices * self.hidden_size * width
        if self.linear_bias:
            params += (self.ffn_matrices - 1) * width + self.hidden_size
        return params

    def _attention_params(self) -> int:
        h = self.hidden_size
        params = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h     # Wq, Wk, Wv, Wo
        if self.linear_bias or self.qkv_bias:
            params += self.q_dim + 2 * self.kv_dim
        if self.linear_bias:
            params += h
        if self.qk_norm:
            params += 2 * self._norm_params(self.head_dim)
        return params

    def _router_params(self) -> int:
        return self.hidden_size * self.num_experts + (self.num_experts if self.router_bias else 0)

    def _shared_expert_params(self) -> int:
        if not self.num_shared_experts:
            return 0
        gate = self.hidden_size if self.shared_expert_gate else 0
        return gate + self.num_shared_experts * self._ffn_params(self.shared_expert_ffn_hidden_size)

    def _layer_common_params(self) -> int:
        """Attention plus the two pre-/post-norms of a layer."""
        return self._attention_params() + 2 * self._norm_params(self.hidden_size)

    def layer_params(self, i: int) -> int:
        """All parameters of transformer layer ``i`` (every expert counted)."""
        self._check_layer(i)
        if not self.is_moe_layer(i):
            return self._layer_common_params() + self._ffn_params(self.ffn_hidden_size)
        return (self._layer_common_params() + self._router_params() + self._shared_expert_params()
                + self.num_experts * self._ffn_params(self.expert_ffn_hidden_size))

    def layer_active_params(self, i: int) -> int:
        """Parameters one token touches in layer ``i``: top-k routed experts, shared experts and the router."""
        self._check_layer(i)
        if not self.is_moe_layer(i):
            return self.layer_params(i)
        return (self._layer_common_params() + self._router_params() + self._shared_expert_params()
                + self.top_k * self._ffn_params(self.expert_ffn_hidden_size))

    def embedding_params(self) -> int:
        """Token embedding (vocab x embedding_dim), learned positions, OPT's project_in (embedding_dim -> hidden)."""
        params = self.vocab_size * self.embedding_dim + self.num_position_embeddings * self.hidden_size
        if self.embedding_dim != self.hidden_size:
            params += self.embedding_dim * self.hidden_size
        return params

    def output_embedding_params(self) -> int:
        """The output projection's weight (vocab x embedding_dim), whether or not it is tied.

        Tied weights are counted once in ``embedding_params``, but a pipeline's last stage still holds a copy.
        """
        return self.vocab_size * self.embedding_dim

    def head_params(self) -> int:
        """Final norm, OPT's project_out (hidden -> embedding_dim), and the output projection unless tied."""
        params = self._norm_params(self.hidden_size) if self.final_norm else 0
        if self.embedding_dim != self.hidden_size:
            params += self.hidden_size * self.embedding_dim
        if not self.tied_embeddings:
            params += self.output_embedding_params()
        return params

    def total_params(self) -> int:
        return (self.embedding_params() + self.head_params()
                + sum(self.layer_params(i) for i in range(self.num_layers)))

    def active_params(self) -> int:
        """Parameters used per token (MoE: only the top-k experts); equals total_params for a dense model."""
        return (self.embedding_params() + self.head_params()
                + sum(self.layer_active_params(i) for i in range(self.num_layers)))

    def active_matmul_params(self) -> int:
        """Active parameters that multiply activations: N of Kaplan et al. 2020's C ~ 6N.

        Leaves out lookups only (learned positions; the input embedding unless tied to the output projection).
        """
        lookups = self.num_position_embeddings * self.hidden_size
        if not self.tied_embeddings:
            lookups += self.vocab_size * self.embedding_dim
        return self.active_params() - lookups

    # ------------------------------------------------------------------ FLOPs
    def layer_flops_breakdown(self, i: int, seq_len: int, *, causal: bool = True) -> dict[str, float]:
        """Forward FLOPs per token of layer ``i`` by matmul group (2 FLOPs per multiply-accumulate).

        qkv:       2 h (q_dim + 2 kv_dim)              (GQA shrinks K and V)
        attention: 2 * 2 q_dim s_eff                   (Q K^T and P V; s_eff = s/2 causal, s non-causal)
        out:       2 q_dim h
        ffn:       2 m h f per FFN (m = 2 or 3 matrices), x top_k experts (+ shared experts) in an MoE layer
        router:    2 h E (+ 2 h for a shared-expert gate)   (MoE layers)
        """
        self._check_layer(i)
        _check_int(seq_len, "seq_len")
        h = self.hidden_size
        keys = seq_len / 2 if causal else float(seq_len)
        out = {
            "qkv": 2.0 * h * (self.q_dim + 2 * self.kv_dim),
            "attention": 2.0 * 2.0 * self.q_dim * keys,
            "out": 2.0 * self.q_dim * h,
            "router": 0.0,
        }
        if self.is_moe_layer(i):
            ffn = self.top_k * self.expert_ffn_hidden_size
            ffn += self.num_shared_experts * (self.shared_expert_ffn_hidden_size or 0)
            out["router"] = 2.0 * h * (self.num_experts + (1 if self.shared_expert_gate else 0))
        else:
            ffn = self.ffn_hidden_size
        out["ffn"] = 2.0 * self.ffn_matrices * h * ffn
        return out

    def layer_forward_flops_per_token(self, i: int, seq_len: int, *, causal: bool = True) -> float:
        """Forward FLOPs per token of layer ``i`` at sequence length ``seq_len`` (see the module docstring)."""
        return sum(self.layer_flops_breakdown(i, seq_len, causal=causal).values())

    def embedding_forward_flops_per_token(self) -> float:
        """A lookup costs no FLOPs; OPT's project_in (embedding_dim -> hidden) does."""
        if self.embedding_dim == self.hidden_size:
            return 0.0
        return 2.0 * self.embedding_dim * self.hidden_size

    def head_forward_flops_per_token(self) -> float:
        """Logits (2 V embedding_dim), plus OPT's project_out (hidden -> embedding_dim)."""
        flops = 2.0 * self.vocab_size * self.embedding_dim
        if self.embedding_dim != self.hidden_size:
            flops += 2.0 * self.hidden_size * self.embedding_dim
        return flops

    def forward_flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Whole-model forward FLOPs per token; training (no recompute) is 3x this."""
        return (self.embedding_forward_flops_per_token() + self.head_forward_flops_per_token()
                + sum(self.layer_forward_flops_per_token(i, seq_len, causal=causal) for i in range(self.num_layers)))

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """Plain types only (YAML/JSON safe); ``from_dict(to_dict())`` gives an equal spec."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _MOE_ROUTING_FIELDS:
                continue  # a dense model's JSON (and so its plans' bytes) stays as before MoE routing existed
            if f.name in _OMITTED_AT and value == _OMITTED_AT[f.name]:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str | None = None) -> "ModelSpec":
        """Build from a mapping with ``to_dict``'s keys; unknown keys and bad values are SpecErrors naming source."""
        if not isinstance(d, Mapping):
            raise SpecError("expected a mapping", source=source, value=type(d).__name__, valid="a YAML mapping")
        check_keys(d, field_names(), where="", source=source)
        kwargs = dict(d)
        missing = [k for k in _REQUIRED if k not in kwargs]
        if missing:
            raise SpecError("missing required field", source=source, field=missing[0],
                            valid=f"required fields: {', '.join(_REQUIRED)}")
        if "dense_layer_indices" in kwargs:
            value = kwargs["dense_layer_indices"]
            if not isinstance(value, (list, tuple)):
                raise SpecError("expected a list of layer indices", source=source, field="dense_layer_indices",
                                value=value, valid="a list of integers")
            kwargs["dense_layer_indices"] = tuple(value)
        if "name" in kwargs and not isinstance(kwargs["name"], str):
            kwargs["name"] = str(kwargs["name"])
        return _construct(kwargs, source=source)


def field_names() -> list[str]:
    """The keys a model YAML file may use (those of ``ModelSpec.to_dict``)."""
    return [f.name for f in dataclasses.fields(ModelSpec)]


_REQUIRED = [f.name for f in dataclasses.fields(ModelSpec)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _construct(kwargs: dict, *, source: str | None, renamed: Mapping[str, str] | None = None) -> ModelSpec:
    """ModelSpec(**kwargs), re-raising validation errors with the file name (and the HF key a field came from)."""
    try:
        return ModelSpec(**kwargs)
    except SpecError as exc:
        if source is None and not renamed:
            raise
        text = str(exc)
        if renamed and exc.field in renamed:
            text += f" [from config key '{renamed[exc.field]}']"
        err = SpecError(text, source=source)
        err.field, err.value, err.valid = exc.field, exc.value, exc.valid
        raise err from None


# ---------------------------------------------------------------------- Hugging Face config.json
# model_type families whose FFN is gated (3 matrices) and whose HF config defaults tie_word_embeddings to false.
_GATED_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                "olmo", "olmo2", "olmoe", "phi3", "granite", "granitemoe", "deepseek", "internlm2", "yi"}
_UNTIED_BY_DEFAULT = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo", "olmo2",
                      "olmoe", "phi3", "granite", "granitemoe", "internlm2"}
_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "olmo2", "olmoe"}
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
_LEARNED_POSITION_TYPES = {"gpt2", "opt", "gpt_bigcode", "bert", "gpt_neo", "biogpt"}
# transformers' config defaults of activation_function where it is not plain "gelu" (GPT2Config, GPTNeoConfig,
# GPTBigCodeConfig, OPTConfig): a config.json that leaves the key out runs these
_HF_ACTIVATION_DEFAULTS = {"gpt2": "gelu_new", "gpt_neo": "gelu_new", "gpt_bigcode": "gelu_pytorch_tanh", "opt": "relu"}
# Keys of configs whose parameters this spec cannot express; refusing beats a silently wrong count.
_UNSUPPORTED_HF_KEYS = {"kv_lora_rank": "multi-head latent attention (DeepSeek-V2/V3)",
                        "q_lora_rank": "multi-head latent attention (DeepSeek-V2/V3)",
                        "first_k_dense_replace": "leading dense layers (DeepSeek)",
                        "n_routed_experts": "DeepSeek-style routed/shared experts"}
# The model_types whose config.json this translation knows (the families above); any other is refused at planning:
# its parameters may differ in ways the keys do not show, and its folder may carry code (auto_map) never to be run.
HF_MODEL_TYPES = frozenset(_GATED_TYPES | _UNTIED_BY_DEFAULT | _QK_NORM_TYPES | _QKV_BIAS_TYPES
                           | _LEARNED_POSITION_TYPES)
_HF_MARKERS = ("model_type", "architectures", "num_hidden_layers", "n_layer", "n_embd", "num_attention_heads",
               "transformers_version")


def is_hf_config(d: Mapping) -> bool:
    """A mapping written by Hugging Face (not one of our model YAMLs, which always carry num_layers)."""
    if any(k in d for k in ("model_type", "architectures", "transformers_version")):
        return True
    return "num_layers" not in d and any(k in d for k in _HF_MARKERS)


def from_hf_config(cfg: Mapping, *, name: str | None = None, source: str | None = None) -> ModelSpec:
    """Translate a Hugging Face ``config.json`` mapping (Llama, Mistral/Mixtral, Qwen2/3(-MoE), GPT-2, OPT, ...)."""
    renamed: dict[str, str] = {}

    def pick(our: str, *keys: str, default: Any = dataclasses.MISSING) -> Any:
        for key in keys:
            if cfg.get(key) is not None:
                renamed[our] = key
                return cfg[key]
        if default is dataclasses.MISSING:
            raise SpecError("missing required field in Hugging Face config", source=source, field=keys[0],
                            valid=f"one of {', '.join(keys)}")
        return default

    for key, what in _UNSUPPORTED_HF_KEYS.items():
        if cfg.get(key):
            raise SpecError(f"{what} is not supported by ModelSpec", source=source, field=key, value=cfg[key],
                            valid="a Llama/Mixtral/Qwen/GPT-2/OPT-style config, or write a model YAML")
    if "model_type" in cfg and (not isinstance(cfg["model_type"], str) or cfg["model_type"] not in HF_MODEL_TYPES):
        raise SpecError("unknown Hugging Face model_type (a folder's own code, auto_map, is never run)",
                        source=source, field="model_type", value=cfg["model_type"],
                        valid=", ".join(sorted(HF_MODEL_TYPES)) + "; or write a model YAML")
    model_type = str(cfg.get("model_type", "")).lower()
    # transformers' own defaults when the key is absent: silu for the gated (Llama-style) families, gelu otherwise
    act = str(pick("ffn_type", "hidden_act", "activation_function", "hidden_activation",
                   default="silu" if model_type in _GATED_TYPES else _HF_ACTIVATION_DEFAULTS.get(model_type, "gelu")
                   )).lower()

    hidden = pick("hidden_size", "hidden_size", "n_embd", "d_model")
    heads = pick("num_heads", "num_attention_heads", "n_head", "num_heads")
    kw: dict[str, Any] = {
        "name": name or str(cfg.get("_name_or_path") or model_type or "hf-model").rstrip("/").split("/")[-1],
        "num_layers": pick("num_layers", "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": pick("num_kv_heads", "num_key_value_heads", default=heads),
        "vocab_size": pick("vocab_size", "vocab_size"),
        "max_seq_len": pick("max_seq_len", "max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                            default=2048),
        "citation": f"Hugging Face config.json{f' ({source})' if source else ''}",
    }
    ffn = pick("ffn_hidden_size", "intermediate_size", "ffn_dim", "n_inner", default=None)
    if ffn is None:                                  # GPT-2: n_inner null means 4 x n_embd
        ffn = 4 * hidden if isinstance(hidden, int) else hidden
    kw["ffn_hidden_size"] = ffn
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        renamed["head_dim"] = "head_dim"
        kw["head_dim"] = head_dim

    gated = model_type in _GATED_TYPES or act in ("silu", "swish", "swiglu")
    kw["activation_impl"] = act if act in ACTIVATION_IMPLS else "kernel"  # transformers' ACT2FN name
    if gated:
        kw["ffn_type"] = "geglu" if act.startswith("gelu") else "swiglu"
    else:
        kw["ffn_type"] = "relu" if act == "relu" else "gelu"

    tie_default = model_type not in _UNTIED_BY_DEFAULT
    kw["tied_embeddings"] = bool(pick("tied_embeddings", "tie_word_embeddings", default=tie_default))

    # Norms: RMSNorm configs carry rms_norm_eps; LayerNorm ones layer_norm_eps / layer_norm_epsilon.
    if "rms_norm_eps" in cfg or (gated and "layer_norm_eps" not in cfg and "layer_norm_epsilon" not in cfg):
        kw["norm_type"] = "rmsnorm"
    else:
        kw["norm_type"] = "layernorm"
    kw["qk_norm"] = model_type in _QK_NORM_TYPES

    if model_type in _LEARNED_POSITION_TYPES or (not gated and "rope_theta" not in cfg
                                                 and "rotary_dim" not in cfg and "rope_scaling" not in cfg
                                                 and "rotary_pct" not in cfg):
        kw["position_embedding"] = "learned"
        if model_type == "opt":                      # OPTLearnedPositionalEmbedding keeps 2 extra rows
            kw["num_position_embeddings"] = kw["max_seq_len"] + 2
    else:
        kw["position_embedding"] = "rotary"

    if gated:
        attn_bias = bool(cfg.get("attention_bias", False))
        kw["linear_bias"] = attn_bias and bool(cfg.get("mlp_bias", False))
        kw["qkv_bias"] = attn_bias or model_type in _QKV_BIAS_TYPES or bool(cfg.get("qkv_bias", False))
        if attn_bias and not kw["linear_bias"]:
            logger.warning("%s: attention_bias without mlp_bias is counted as Q/K/V biases only (output "
                           "projection bias of %d parameters per layer left out)", source or "config", hidden)
    else:
        kw["linear_bias"] = bool(cfg.get("enable_bias", True))

    if model_type == "opt":
        proj = cfg.get("word_embed_proj_dim")
        if proj is not None:
            renamed["embedding_dim"] = "word_embed_proj_dim"
            kw["embedding_dim"] = proj
        pre_ln = cfg.get("do_layer_norm_before", True)
        if not isinstance(pre_ln, bool):
            raise SpecError("expected true or false", source=source, field="do_layer_norm_before", value=pre_ln,
                            valid="true | false")
        kw["final_norm"] = bool(pre_ln) and not cfg.get("_remove_final_layer_norm", False)

    experts = pick("num_experts", "num_local_experts", "num_experts", "moe_num_experts", default=0) or 0
    if experts:
        kw["num_experts"] = experts
        kw["top_k"] = pick("top_k", "num_experts_per_tok", "moe_top_k", "num_experts_per_token", default=0)
        moe_ffn = pick("expert_ffn_hidden_size", "moe_intermediate_size", default=None)
        if moe_ffn is not None:
            kw["expert_ffn_hidden_size"] = moe_ffn
        kw["moe_layer_frequency"] = pick("moe_layer_frequency", "decoder_sparse_step", default=1)
        if cfg.get("norm_topk_prob") is not None:  # Qwen2/3-MoE; Mixtral always renormalises (no key)
            renamed["router_norm_topk"] = "norm_topk_prob"
            kw["router_norm_topk"] = bool(cfg["norm_topk_prob"])
        if cfg.get("mlp_only_layers"):
            renamed["dense_layer_indices"] = "mlp_only_layers"
            dense = cfg["mlp_only_layers"]
            if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
                raise SpecError("expected a list of layer indices", source=source, field="mlp_only_layers",
                                value=dense, valid="e.g. [0, 1]")
            kw["dense_layer_indices"] = tuple(dense)
        shared = cfg.get("shared_expert_intermediate_size")
        if shared:
            renamed["shared_expert_ffn_hidden_size"] = "shared_expert_intermediate_size"
            kw["num_shared_experts"] = 1
            kw["shared_expert_ffn_hidden_size"] = shared
            kw["shared_expert_gate"] = model_type == "qwen2_moe"
    return _construct(kw, source=source, renamed=renamed)


# ---------------------------------------------------------------------- presets and loading
def _normalize(name: str) -> str:
    """Preset lookup key: case, '-', '_' and spaces ignored (dots kept: gpt3-1.3b is not gpt3-13b)."""
    return re.sub(r"[-_\s]+", "", str(name).strip().lower())


def _preset_dir():
    return importlib.resources.files("tangram_launch") / "models"


def preset_names() -> list[str]:
    """Names of the packaged presets (``tangram_launch/models/<name>.yaml``), sorted."""
    return sorted(p.name[: -len(".yaml")] for p in _preset_dir().iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> ModelSpec:
    """A packaged preset; an unknown name is a SpecError listing the presets and the closest one."""
    names = preset_names()
    by_key = {_normalize(n): n for n in names}
    canonical = by_key.get(_normalize(name))
    if canonical is None:
        hint = closest(str(name).strip().lower(), names)
        valid = (f"did you mean '{hint}'? " if hint else "") + "a model YAML or config.json path, or a preset: " \
            + ", ".join(names)
        raise SpecError("unknown model preset (and no such file)", field="model", value=name, valid=valid)
    resource = _preset_dir() / f"{canonical}.yaml"
    with importlib.resources.as_file(resource) as path:
        data = load_yaml_file(path)
    return ModelSpec.from_dict(data, source=f"preset {canonical}")


def _read_mapping(path: str) -> dict:
    """YAML or JSON, decided by content (a JSON document starts with '{')."""
    from tangram_launch.specs.limits import parse_json, parse_yaml, read_text  # bounded input cost

    text = read_text(path)
    if text.lstrip().startswith("{"):
        # JSON, or YAML in flow style ({a: 1}); if neither parses, the JSON parser's message is the useful one.
        try:
            data = parse_json(text, source=path)
        except SpecError as exc:
            try:
                data = parse_yaml(text, source=path)
            except SpecError:
                raise exc from None
        if not isinstance(data, dict):
            raise SpecError("expected a mapping at the top level", source=path, value=type(data).__name__)
        return data
    return load_yaml_file(path)


def load_model_file(path: str | os.PathLike) -> ModelSpec:
    """A model YAML (our keys) or a Hugging Face config.json (or a folder holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise SpecError("folder has no config.json", source=path, field="model", value=path,
                            valid="a preset name, a model YAML file, or a Hugging Face config.json (or its folder)")
        path = config
    data = _read_mapping(path)
    if is_hf_config(data):
        stem = os.path.splitext(os.path.basename(path))[0]
        name = None if stem == "config" else stem
        if name is None and not data.get("_name_or_path"):
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or None
        return from_hf_config(data, name=name, source=path)
    return ModelSpec.from_dict(data, source=path)


def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    """A preset name, a model YAML file, or a Hugging Face config.json (an existing path wins over a preset)."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    text = os.fspath(name_or_path)
    if os.path.exists(text):
        return load_model_file(text)
    looks_like_path = os.sep in text or "/" in text or text.lower().endswith((".yaml", ".yml", ".json"))
    if looks_like_path and _normalize(os.path.basename(text)) not in {_normalize(n) for n in preset_names()}:
        raise SpecError("file not found", source=text, field="model", value=text,
                        valid=f"an existing model YAML / config.json, or a preset: {', '.join(preset_names())}")
    return load_preset(text)
