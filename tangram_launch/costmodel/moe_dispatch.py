"""How many copies of a token an MoE dispatcher moves, by dispatcher.

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

from math import comb

MOE_DISPATCHERS = ("alltoall", "deepep")


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
