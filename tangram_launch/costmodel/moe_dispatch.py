"""What an MoE layer's token dispatch moves, by dispatcher: rows over the EP group and rows through memory.

``alltoall``  Megatron-core's MoEAlltoAllTokenDispatcher and this project's torch runtime (runtime_adapters/moe.py):
              the tokens are permuted into one row per (token, chosen expert) before the all-to-all, so a token
              travels top_k times, to each of its experts' ranks, also twice to a rank that holds two of them.
``deepep``    DeepEP's dispatch (deepseek-ai/DeepEP, Buffer.get_dispatch_layout -> is_token_in_rank[token, rank],
              num_tokens_per_rank; Megatron-core's flex dispatcher and torchtitan's DeepEP path call it): a token goes
              once to each rank that holds at least one of its experts, which expands it to its local experts; the
              combine sums a token's local expert outputs on that rank and sends one row back.

Under balanced routing (every expert equally likely, a token's k experts distinct) the expected number of EP
ranks a token reaches is ep (1 - C(E - E/ep, k) / C(E, k)): one minus the chance that none of its k experts lies on
a given rank, summed over the ranks. Qwen3-235B (E 128, k 8) over EP 8: 5.34 rows per token instead of 8.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb

MOE_DISPATCHERS = ("alltoall", "deepep")


@dataclass(frozen=True)
class MoERuntime:
    """How the runtime runs the routed experts (SliceCoster's keywords of these names, less the ``moe_`` prefix):
    their tensor-parallel degree (None: the stage's tp), the dispatcher, whether permutation is fused, and whether
    the routing probabilities weight the experts' outputs in the combine (``probs_on_output``: Megatron-core's
    unpermute, `permuted_tokens * permuted_probs`, and the allgather dispatcher of 2024, `unpermuted_local_hidden *
    scores`; this project's torch runtime, `y * r.weight`: autograd keeps the k output rows for the probabilities'
    gradient) or inside the experts' activation (False: Megatron-core's TEGroupedMLP with weighted_bias_swiglu_impl,
    which keeps only its input, already counted)."""

    expert_tensor_parallel: int | None = None
    dispatcher: str = "alltoall"
    permute_fusion: bool = False
    probs_on_output: bool = True

    def etp(self, tp: int) -> int:
        return tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel


DEFAULT_MOE_RUNTIME = MoERuntime()


def expected_ranks_reached(num_experts: int, top_k: int, ep: int) -> float:
    """Expected number of the ``ep`` ranks (E / ep experts each) that hold at least one of a token's ``top_k``
    distinct experts, every expert equally likely."""
    if ep <= 1:
        return 1.0
    per_rank = num_experts // ep
    miss = comb(num_experts - per_rank, top_k) / comb(num_experts, top_k)
    return ep * (1.0 - miss)


def copies_per_token(dispatcher: str, *, num_experts: int, top_k: int, ep: int) -> float:
    """Rows a dispatcher moves per token over the EP group (module docstring)."""
    if dispatcher == "alltoall":
        return float(top_k)
    if dispatcher == "deepep":
        return expected_ranks_reached(num_experts, top_k, ep)
    raise ValueError(f"moe dispatcher {dispatcher!r} (known: {', '.join(MOE_DISPATCHERS)})")


def permutation_traffic_h(*, top_k: int, ep: int, local_experts: float, dispatcher: str, fused: bool) -> float:
    """Memory traffic of one token's permutation and un-permutation in one MoE layer's forward, in h-wide rows of
    the activation dtype (read + written), as the dispatchers run them.

    Unfused (Megatron-core moe_utils.permute / unpermute, and this project's torch runtime, runtime_adapters/moe.py):
    the permute's index_select reads and writes the k copies (2k); the combine multiplies them by their routing
    probabilities (2k), zero-fills the output (1) and scatter-adds the k weighted rows into it (k + 1): 5k + 2.
    Fused (Transformer Engine's moe_permute / moe_unpermute, Megatron's --moe-permute-fusion): one read of the token
    and k written copies, k reads and one written sum: 2k + 2. The all-to-all dispatcher with more than one local
    expert behind an EP > 1 exchange regroups the received chunks by local expert and back (sort_chunks_by_idxs,
    a read and a write each way: 4k); DeepEP's received rows are permuted into expert order directly."""
    k = top_k
    out = 2.0 * k + 2.0 if fused else 5.0 * k + 2.0
    if dispatcher == "alltoall" and ep > 1 and local_experts > 1:
        out += 4.0 * k
    return out
