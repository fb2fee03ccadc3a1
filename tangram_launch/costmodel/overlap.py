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

Tensor-parallel collectives (``TP_OVERLAP_KINDS``), per (all-gather, reduce-scatter) pair of a layer, priced as two
collectives in each pass. ``backward``: Megatron-LM's linear layers since 2022 and every Megatron-core (their
default): the forward waits for its collectives; in the backward the row-parallel GEMM's output-gradient all-gather
waits too, while the column-parallel GEMM's input-gradient reduce-scatter runs beside its weight-gradient GEMM,
which is as long as its forward GEMM (``beside_s``). ``pipelined``: Transformer Engine's userbuffers under
``--tp-comm-overlap`` and torch's AsyncTP split each collective into tp chunks pipelined with the GEMM beside it
(forward: the column-parallel GEMM that reads the gathered input, the row-parallel one whose output is
reduce-scattered; backward: the row-parallel dgrad beside its gradient's all-gather, the column-parallel dgrad
beside its reduce-scatter). A chunk's transfer runs beside another chunk's GEMM, so what shows is one chunk's
transfer, which has no GEMM beside it, or the transfers beyond the GEMM chunks, whichever is longer
(``tp_exposed_s``). Either way the hidden rest slows the GEMM by the SM share. This project's runtimes overlap none.
"""
from __future__ import annotations

from tangram_launch.costmodel.efficiency import COLLECTIVE_SM_SHARE

# none: the sync runs whole after the last backward; grads: gradient buckets hide under the last backward;
# grads-params: and the distributed optimizer's parameter all-gathers under the next step's first forward
DP_OVERLAP_KINDS = ("none", "grads", "grads-params")
TP_OVERLAP_KINDS = ("none", "backward", "pipelined")


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


def beside_s(collective_s: float, gemm_s: float, sm_share: float = COLLECTIVE_SM_SHARE) -> float:
    """A collective issued as one GEMM starts: what outlasts the GEMM, plus the compute slowed where the rest
    hides."""
    exposed = max(0.0, collective_s - gemm_s)
    return exposed + contention_s(collective_s, exposed, sm_share)


def tp_exposed_s(collective_s: float, gemm_s: float, tp: int, sm_share: float = COLLECTIVE_SM_SHARE) -> float:
    """One sequence-parallel collective of ``collective_s`` pipelined in ``tp`` chunks with the GEMM of ``gemm_s``
    beside it (module docstring): max(one chunk's transfer, the transfers beyond the other chunks' GEMMs), plus
    the compute slowed where the rest hides."""
    if tp <= 1 or collective_s <= 0.0:
        return max(0.0, collective_s)
    exposed = max(collective_s / tp, collective_s - gemm_s * (tp - 1) / tp)
    return exposed + contention_s(collective_s, exposed, sm_share)
