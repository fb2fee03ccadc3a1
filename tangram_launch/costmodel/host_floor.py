"""The host's floor under a layer's time: a GPU runs a layer no faster than the host dispatches its operators.

Eager PyTorch issues every operator from the host: Python, the dispatcher, autograd's bookkeeping and, for most,
a kernel launch. The GPU runs ahead only while its queue holds work; where a layer's kernels take less time than
the host takes to issue them, the layer runs at the host's pace. At large shapes the floor is far below the
compute (a Llama-3-8B layer at 8k tokens: about 20 ms forward on an A100, against under 1 ms of host work); at
small shapes per GPU (a small model at high TP, a micro-batch of one, many small experts) it decides the time,
and with it whether more TP or a smaller micro-batch pays.

    floor (forward, backward) = operators dispatched (layer_host_ops) x host seconds per operator

Operators: those the torch runtime's layer dispatches (runtime_adapters/gpt.py and runtime_adapters/moe.py,
mirrored by profiler/layer.py), counted at the aten level with a dispatch-mode counter; views count, as each is a
dispatcher call. A pre-norm Llama-style layer (RMSNorm, rotary angles built per call, grouped-query K/V repeated,
SwiGLU, no biases) dispatches 114 forward and 144 backward; each feature adds or removes a fixed number
(HOST_OPS_DELTA), and an MoE layer loops over its local experts (one FFN each). tests/test_host_floor.py recounts
the profiler's layer over generated models and checks every count here. Runtimes that fuse kernels (Transformer
Engine, torch.compile) or run experts as one grouped GEMM dispatch fewer; the floor is the eager runtime's.

Host seconds per operator: the profile's ``host_op_us`` where it measured one (profiler/host_ops.py), else HOST_OP_S
on a GPU and nothing on an unprofiled CPU device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tangram_launch.costmodel.composed_activation import COMPOSED

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.specs.model import ModelSpec

# The torch runtime's Llama-style layer at one token on this project's CI machine (2 shared cores, CPU tensors):
# 5.9 us per dispatched operator forward, 5.2 backward. On a GPU the kernel launch (1-3 us on CUDA 12 drivers) adds
# to the half of them that launch one, on a server's faster core: about 6 us.
HOST_OP_S = 6e-6

LLAMA_HOST_OPS = (114, 144)  # (forward, backward) of the pre-norm Llama-style layer (module docstring)
# (forward, backward) operators a feature changes from the Llama-style layer
HOST_OPS_DELTA = {
    "no_rotary": (-50, -18),  # positions learned at the embedding: no per-call angles, no rotation of q and k
    "layernorm": (-12, -30),  # one fused native_layer_norm against RMSNorm's pow, mean, add, rsqrt, mul, mul
    "no_gqa": (-8, -6),  # as many K/V heads as query heads (on this TP shard): no repeat_interleave
    "gelu": (-5, -12),  # GeLU FFN: one up projection and no gate product
}
BIAS_BACKWARD_OPS_PER_LINEAR = 3  # a bias gradient: the sum over rows and its views
# routed FFN beyond the dense FFN it replaces, and per FFN (expert or shared), by (SwiGLU, bias)
MOE_ROUTING_OPS = (39, 28)  # router, softmax, top-k, auxiliary losses, sort, gather, the weighted scatter back
MOE_GATED_ROUTING_OPS = (-5, -12)  # a SwiGLU model's routing (the dense SwiGLU FFN it replaces has more ops)
MOE_FFN_FORWARD_OPS = (6, 3)  # per FFN: + 3 with SwiGLU
MOE_FFN_BACKWARD_OPS = (18, 10, 6, 3)  # per FFN: + 10 with SwiGLU, + 6 with biases, + 3 with both
MOE_TOPK_OPS = (2, 0)  # top-k above 1: the top-k slice
MOE_NORM_TOPK_OPS = (2, 8)  # renormalised top-k weights (top-k above 1)
MOE_CAPACITY_OPS = (17, 2)  # a capacity: one-hot, cumulative sum, the kept mask
MOE_SHARED_SLICE_BACKWARD_OPS = 2  # an expert's backward through its slice of the rows, which shared ones skip
MOE_SHARED_GATE_OPS = (5, 13)  # a sigmoid gate on the shared experts' output
MOE_ROUTER_BIAS_OPS = (0, 3)


def layer_host_ops(model: "ModelSpec", layer: int, *, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(forward, backward) operators the torch runtime's layer ``layer`` dispatches on one GPU of a ``tp`` x ``ep``
    grid (module docstring). TP changes only whether K/V heads are repeated on the shard; EP, how many experts the
    GPU loops over."""
    heads = max(1, model.num_heads // tp)
    kv_heads = max(1, model.num_kv_heads // tp)
    gated = model.ffn_type in ("swiglu", "geglu")
    fwd, bwd = LLAMA_HOST_OPS
    for feature, on in (("no_rotary", model.position_embedding != "rotary"),
                        ("layernorm", model.norm_type != "rmsnorm"), ("no_gqa", kv_heads == heads),
                        ("gelu", not gated)):
        if on:
            fwd, bwd = fwd + HOST_OPS_DELTA[feature][0], bwd + HOST_OPS_DELTA[feature][1]
    bias = bool(model.linear_bias)
    moe = model.is_moe_layer(layer)
    if bias:  # q, k, v and the output projection; a dense FFN's own (a routed FFN counts them per FFN, below)
        bwd += BIAS_BACKWARD_OPS_PER_LINEAR * (4 + (0 if moe else model.ffn_matrices))
    # FFNs the layer runs on this GPU: its local experts and the shared experts as one, else the dense FFN
    ffns = (model.num_experts / ep + (1 if model.num_shared_experts else 0)) if moe else 1
    composed = COMPOSED.get(model.activation_impl)  # a composed activation's operators beyond one F.gelu
    act_fwd, act_bwd = composed.ops if composed is not None else (0, 0)
    fwd, bwd = fwd + ffns * act_fwd, bwd + ffns * act_bwd
    if not moe:
        return fwd, bwd
    ffn_fwd = MOE_FFN_FORWARD_OPS[0] + MOE_FFN_FORWARD_OPS[1] * gated
    a, b, c, d = MOE_FFN_BACKWARD_OPS
    ffn_bwd = a + b * gated + c * bias + d * (gated and bias)
    fwd += MOE_ROUTING_OPS[0] + MOE_GATED_ROUTING_OPS[0] * gated + ffns * ffn_fwd
    bwd += MOE_ROUTING_OPS[1] + MOE_GATED_ROUTING_OPS[1] * gated + ffns * ffn_bwd
    if model.num_shared_experts:  # on all tokens: no slice of the permuted rows to take the gradient of
        bwd -= MOE_SHARED_SLICE_BACKWARD_OPS
    extras = ((model.top_k > 1, MOE_TOPK_OPS), (model.top_k > 1 and bool(model.router_norm_topk), MOE_NORM_TOPK_OPS),
              (model.capacity_factor is not None, MOE_CAPACITY_OPS), (bool(model.shared_expert_gate),
                                                                      MOE_SHARED_GATE_OPS),
              (bool(model.router_bias), MOE_ROUTER_BIAS_OPS))
    for on, (f, b_) in extras:
        if on:
            fwd, bwd = fwd + f, bwd + b_
    return round(fwd), round(bwd)


def layer_host_floor_s(model: "ModelSpec", layer: int, host_op_s: float, *, tp: int = 1,
                       ep: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds the host takes to dispatch layer ``layer`` (0 where ``host_op_s`` is 0)."""
    if host_op_s <= 0:
        return 0.0, 0.0
    fwd, bwd = layer_host_ops(model, layer, tp=tp, ep=ep)
    return fwd * host_op_s, bwd * host_op_s
