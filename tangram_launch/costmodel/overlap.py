"""How much ZeRO-3 / FSDP communication a pass of one micro-batch leaves exposed after overlapping it with compute.

FSDP2 (as torchtitan wraps a model) and DeepSpeed ZeRO-3 gather parameters unit by unit: the embedding, one unit per
layer, the output layer (with the final norm). A unit's gather is issued when the unit before it starts computing
(prefetch depth one), and a unit's gradients are reduce-scattered when its backward ends. Gathers and
reduce-scatters share the node's network interface, so one link carries them in turn.

Forward, units in order: the embedding's gather has nothing before it to hide under; layer 1's gather hides under
the embedding's forward; layer i's under layer i - 1's; the output layer's under layer n's (and stays gathered for
its backward, the first)::

    exposed_fwd = e + max(0, g - c_emb) + (n - 1) max(0, g - c) + max(0, h - c)

Backward, layers in reverse: layer n's gather hides under the output layer's backward; while layer i computes, the
link carries the reduce-scatter of the unit after it (the output layer's for layer n), then layer i - 1's gather
(the next layer waits for it); while layer 1 computes, only layer 2's reduce-scatter, whose excess (the backlog)
delays layer 1's; that one hides under the embedding's backward, and the embedding's reduce-scatter comes last::

    exposed_bwd = max(0, g - c_head) + max(0, g + h_r - b) + (n - 2) max(0, g + r - b)
                  + max(0, max(0, r - b) + r - b_emb) + e_r

(e, e_r: the embedding's gather and reduce-scatter; h, h_r: the output layer's; g, r: a layer's; c, b: a layer's
forward and backward compute; with n = 1 the output layer's reduce-scatter is the backlog under layer 1.) The sum is what an event simulation of these units
on one link gives (tests/test_dp_exposure.py), and each term is a part that cannot overlap: the first gather, the
last reduce-scatter, a layer's communication beyond the compute it runs beside.

What hides is not free: while a collective runs, its kernels hold a share of the SMs (``COLLECTIVE_SM_SHARE``), so
the compute beside it runs slower by that share. A hidden transfer of h seconds under compute C (h <= C) stretches
it to C + share x h (``contention_s``); where the transfer is longer than the compute, the charge is at most
share x C too high. This holds for every GPU and stack that overlaps its collectives with compute (FSDP, ZeRO-2/3).

ZeRO-0/1 gradient sync, where the runtime overlaps it (``DP_OVERLAP_KINDS``): PyTorch DDP and Megatron-core's
``overlap_grad_reduce`` start each gradient bucket's all-reduce (ZeRO-0) or reduce-scatter (distributed optimizer) as
the bucket fills during the backward of the step's last micro-batch (the earlier micro-batches only accumulate: DDP's
``no_sync``, Megatron's sync on the last one). Buckets fill layer by layer in reverse, so what stays exposed is the
backward form above with nothing gathered. Megatron-core's ``overlap_param_gather`` issues the distributed optimizer's
parameter all-gathers bucket by bucket ahead of the next step's first forward: the forward form. This project's
runtimes do neither (the torch runtime reduces after the schedule, the Megatron adapter sets
``overlap_grad_reduce=False``), so the planner's default is ``none``.
"""
from __future__ import annotations

from tangram_launch.costmodel.efficiency import COLLECTIVE_SM_SHARE

# none: the sync runs whole after the last backward; grads: gradient buckets hide under the last backward;
# grads-params: and the distributed optimizer's parameter all-gathers under the next step's first forward
DP_OVERLAP_KINDS = ("none", "grads", "grads-params")


def forward_exposed_s(*, root_gather_s: float, layer_gather_s: float, layer_compute_s: float,
                      lead_compute_s: float, num_layers: int, head_gather_s: float = 0.0) -> float:
    """Exposed gathers of one forward pass (module docstring); ``lead_compute_s``: the embedding's forward."""
    if num_layers < 1:
        return 0.0
    g, c = layer_gather_s, layer_compute_s
    return (root_gather_s + max(0.0, g - lead_compute_s) + (num_layers - 1) * max(0.0, g - c)
            + max(0.0, head_gather_s - c))


def backward_exposed_s(*, layer_gather_s: float, layer_rs_s: float, root_rs_s: float, layer_compute_s: float,
                       head_compute_s: float, tail_compute_s: float, num_layers: int,
                       head_rs_s: float = 0.0) -> float:
    """Exposed gathers and reduce-scatters of one backward pass (module docstring); ``head_compute_s``: the output
    layer's backward (before the layers'), ``tail_compute_s``: the embedding's (after them)."""
    n, g, r, b = num_layers, layer_gather_s, layer_rs_s, layer_compute_s
    if n < 1:
        return 0.0
    if g <= 0.0:  # reduce-scatters only (ZeRO-2): nothing waits for them, they queue on the link
        queued = max(head_rs_s + n * r, b + n * r, n * b + r)  # from the backward's first layer
        return max(0.0, queued - n * b - tail_compute_s) + root_rs_s
    out = max(0.0, g - head_compute_s) + root_rs_s
    backlog = max(0.0, head_rs_s - b)  # the reduce-scatter beside layer 1's backward, beyond it
    if n >= 2:
        out += max(0.0, g + head_rs_s - b) + (n - 2) * max(0.0, g + r - b)
        backlog = max(0.0, r - b)
    return out + max(0.0, backlog + r - tail_compute_s)


def contention_s(transfers_s: float, exposed_s: float, sm_share: float = COLLECTIVE_SM_SHARE) -> float:
    """Compute time lost to collectives hidden beside it (module docstring): ``sm_share`` x the part of
    ``transfers_s`` that is not exposed."""
    return sm_share * max(0.0, transfers_s - exposed_s)
