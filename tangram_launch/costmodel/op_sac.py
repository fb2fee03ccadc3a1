"""The GEMMs of one transformer block under torchtitan's op-level selective activation checkpointing (op-SAC): which
outputs the policy saves and which the backward recomputes. memory.py (what a layer keeps) and compute.py (what its
backward runs again) read the same list.

torchtitan wraps each block in torch.utils.checkpoint with a policy (the models' infra/parallelize.py
``_op_sac_save_list``, torchtitan/distributed/activation_checkpoint.py): the outputs of the ops in the save list --
aten.mm, the scaled-dot-product-attention kernels, a TP reduce-scatter -- are saved, except every second aten.mm of the
block (a per-block count); everything else is recomputed in the backward. For an MoE block two facts decide:

``op-sac`` (eager)
    The routed experts run as ``torch._grouped_mm`` (GroupedExperts), an op outside the save list: their GEMMs are
    recomputed and do not advance the mm count. The router's gate is an aten.mm, counted after the attention's wq, wk,
    wv, wo; shared experts are nn.Linear mms counted after the gate.
``op-sac-compiled`` (torch.compile on)
    torchtitan's apply_compile compiles a dense block whole, checkpoint wrapper included, so the policy holds inside
    the graph as in eager. An MoE block is compiled submodule by submodule inside the eager checkpoint wrapper (the
    FSDP hooks of GroupedExperts would break the block's graph), and a compiled region is opaque to the policy unless
    inductor's ``wrap_inductor_compiled_regions`` is on (off by default; torchtitan does not set it): the regions'
    saved tensors go through the checkpoint's hooks and are rebuilt in the backward. The MoE block so keeps its input
    only, as under full recompute, and its backward runs its whole forward again (the EP all-to-alls included).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tangram_launch.specs.model import ModelSpec

OP_SAC_POLICIES = ("op-sac", "op-sac-compiled")


class BlockMm(NamedTuple):
    """One aten.mm of a block in forward order: its output width (whole, before TP) and input width, whether TP
    shards its output (column-parallel) or it is saved whole before its reduction (row-parallel), and whether op-SAC
    saves it."""

    out_width: int
    in_width: int
    column: bool
    saved: bool


def keeps_input_only(model: "ModelSpec", layer: int, policy: str) -> bool:
    """Whether op-SAC under ``policy`` keeps only the block's input for ``layer`` (module docstring)."""
    return policy == "op-sac-compiled" and model.is_moe_layer(layer)


def block_mms(model: "ModelSpec", layer: int) -> list[BlockMm]:
    """The aten.mm calls of block ``layer`` in forward order with op-SAC's choice: the 1st, 3rd, 5th, ... saved.

    Dense: wq, wk, wv, wo, then w1[, w3], w2. MoE: wq, wk, wv, wo, the router's gate (hidden -> num_experts, whole on
    every rank), the shared experts' w1[, w3], w2; the routed experts' grouped GEMMs are no aten.mm (routed_gemms)."""
    h = model.hidden_size
    attention = [(model.q_dim, h, True), (model.kv_dim, h, True), (model.kv_dim, h, True), (h, model.q_dim, False)]
    if model.is_moe_layer(layer):
        ffn = [(model.num_experts, h, False)]
        if model.num_shared_experts:
            width = model.num_shared_experts * model.shared_expert_ffn_hidden_size
            ffn += [(width, h, True)] * (model.ffn_matrices - 1) + [(h, width, False)]
    else:
        width = model.ffn_hidden_size
        ffn = [(width, h, True)] * (model.ffn_matrices - 1) + [(h, width, False)]
    return [BlockMm(n, k, column, i % 2 == 0) for i, (n, k, column) in enumerate(attention + ffn)]


def routed_gemms(model: "ModelSpec", layer: int) -> list[tuple[int, int]]:
    """(output width, input width) of the routed experts' GEMMs per routed token copy: the up projection (w1 and w3
    of a gated FFN as one GEMM of their joint width, as compute.layer_compute prices it), then w2. op-SAC recomputes
    all of them (torch._grouped_mm is outside its save list)."""
    if not model.is_moe_layer(layer):
        return []
    h, width = model.hidden_size, model.expert_ffn_hidden_size
    return [((model.ffn_matrices - 1) * width, h), (h, width)]
