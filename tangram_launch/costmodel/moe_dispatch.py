"""What an MoE layer's token dispatch moves, by dispatcher: rows over the EP group and rows through memory; and
what the routed experts' grouped GEMMs compute beyond the balanced share: the busiest EP rank's load and whole tiles
per expert. The router's softmax and top-k are charged as memory traffic.

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
from math import comb, sqrt
from statistics import NormalDist

MOE_DISPATCHERS = ("alltoall", "deepep")
# A grouped GEMM (torch._grouped_mm's CUTLASS kernels, Transformer Engine's per-expert cuBLAS GEMMs) computes each
# expert's rows in whole thread-block tiles: 128 rows on Hopper (two 64-row warpgroup MMAs per tile) and the common
# 128-row tiles of Ampere's kernels. A partial tile costs a whole one.
GROUPED_GEMM_TILE_ROWS = 128
# Row passes of a scatter-add per added row: read the source row, read and write the destination row.
SCATTER_ADD_PASSES = 3.0


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
    # Bytes per element of the unfused combine's weighted rows: the routing probabilities are fp32 and the product
    # takes their dtype (this project's torch runtime, `y * r.weight` into an fp32 buffer; torchtitan's MoE,
    # `routed_output.to(torch.float32) * top_scores`; Megatron-core's unpermute under --moe-router-dtype fp32, which
    # its own comment says promotes permuted_tokens). Megatron-core with 16-bit router probabilities: 2.
    combine_bytes: int = 4
    # The MoE block's input is whole on every TP rank (DTensor TP: torchtitan's apply_moe_ep_tp wraps the block in
    # PrepareModuleInputOutput(input Shard(1) -> Replicate(), output Partial() -> Shard(1)) and runs the router's gate
    # as NoParallel). The block then costs the SP all-gather before it and the reduce-scatter after it like a dense
    # MLP, the router scores all M tokens on every TP rank, and the dispatch starts from those M tokens: with
    # etp = tp (ExpertTensorParallel) each TP rank sends all its M tokens' copies over its EP group and no expert-TP
    # all-gather follows (the expert weights are column/row-sharded over TP instead); with etp 1
    # (ReordererSequenceParallel) each TP rank dispatches 1/tp of the routed pairs over an EP group that includes
    # TP. False: Megatron-core's all-to-all dispatcher, which permutes the rank's sequence-parallel shard and
    # all-gathers the received copies over the experts' TP group (gather_from_sequence_parallel_region).
    replicated_tp_input: bool = False

    def etp(self, tp: int) -> int:
        return tp if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def dispatch_factor(self, tp: int) -> int:
        """Tokens whose routed copies one GPU permutes and sends over its EP group, per token of its sequence-parallel
        shard (M / tp): 1 (Megatron-core), or under a replicated input etp (all M tokens with etp = tp, the TP
        rank's 1/tp of the routed pairs with etp 1)."""
        return self.etp(tp) if self.replicated_tp_input else 1

    def router_factor(self, tp: int) -> int:
        """Tokens one GPU's router scores per token of its SP shard: 1, or tp under a replicated input (all M)."""
        return tp if self.replicated_tp_input else 1

    def gathers_over_etp(self, tp: int) -> bool:
        """Whether the received copies are all-gathered over the experts' TP group (Megatron-core with etp > 1); a
        replicated input has every TP rank dispatch its own tokens instead."""
        return self.etp(tp) > 1 and not self.replicated_tp_input


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


def permutation_traffic_h(*, top_k: int, ep: int, local_experts: float, dispatcher: str, fused: bool,
                          etp: int = 1, combine_ratio: float = 1.0, weighted: bool = True) -> float:
    """Memory traffic of one token's permutation and un-permutation in one MoE layer's forward, in h-wide rows of
    the activation dtype (read + written), as the dispatchers run them.

    Unfused (Megatron-core moe_utils.permute / unpermute, torchtitan's MoE.forward, and this project's torch
    runtime, runtime_adapters/moe.py): the permute's index_select / gather reads and writes the k copies (2k). The
    combine multiplies them by their routing probabilities (``weighted``), writing rows of ``combine_ratio`` x the
    activation's bytes (MoERuntime.combine_bytes: fp32 probabilities promote them) (k (1 + c)), zero-fills an output
    of that dtype (c) and scatter-adds the k rows into it: each added row is read (c k) and read-modified-written
    into its token's output row (2 c k), the k adds to one token lying far apart in the expert-sorted buffer, whose
    M x h output a training micro-batch makes larger than L2 (SCATTER_ADD_PASSES); a promoted output is cast back
    (c + 1). At c = 1: 7k + 1; fp32 rows under 16-bit activations (c = 2): 11k + 5.
    Fused (Transformer Engine's moe_permute / moe_unpermute, Megatron's --moe-permute-fusion): one read of the token
    and k written copies, k reads and one written sum in registers: 2k + 2. The all-to-all dispatcher with more than
    one local expert behind an EP > 1 exchange regroups the received chunks by local expert and back
    (sort_chunks_by_idxs, a read and a write each way: 4k), on the buffer the experts' TP all-gather returned, etp
    ranks' copies (``etp``); DeepEP's received rows are permuted into expert order directly."""
    k = top_k
    if fused:
        out = 2.0 * k + 2.0
    else:
        c = combine_ratio if weighted else 1.0
        multiply = k * (1.0 + c) if weighted else 0.0
        cast_back = c + 1.0 if c != 1.0 else 0.0
        out = 2.0 * k + multiply + c + SCATTER_ADD_PASSES * c * k + cast_back
    if dispatcher == "alltoall" and ep > 1 and local_experts > 1:
        out += 4.0 * k * etp
    return out


def router_traffic_bytes(*, num_experts: int, top_k: int, dtype_bytes: int) -> float:
    """Memory traffic per token of the router beyond its gate GEMM: the softmax reads the E logits and writes E fp32
    scores, top-k reads them and writes k fp32 probabilities and k int64 indices (Megatron-core's
    topk_routing_with_score_function, ``torch.softmax(logits, dim=-1, dtype=torch.float32)``; torchtitan's
    TokenChoiceTopKRouter alike), and the per-expert token count reads the k indices."""
    return num_experts * (dtype_bytes + 4 + 4) + top_k * (4 + 8 + 8)


def grouped_gemm_rows(tokens_per_expert: float, tile_rows: int = GROUPED_GEMM_TILE_ROWS) -> float:
    """Rows one expert's GEMM computes in a grouped GEMM: its tokens rounded up to whole tiles of ``tile_rows``.
    Dropless routing gives every expert a different count, so the last tile is on average half empty; an expert
    with fewer tokens than half a tile still costs a whole one. Large experts lose a fraction tile / (2 M_e) (24 K
    tokens: 0.3 %); many small experts at small micro-batches lose much more (256 tokens: a quarter)."""
    if tokens_per_expert <= 0:
        return 0.0
    return max(float(tile_rows), tokens_per_expert + tile_rows / 2.0)


def busiest_rank_load_factor(*, tokens: float, top_k: int, num_experts: int, ep: int) -> float:
    """Expected load of the busiest of ``ep`` ranks over the mean, when ``tokens`` tokens each pick ``top_k``
    distinct experts of ``num_experts``, every expert equally likely (E / ep on each rank). The layer waits for
    that rank: the combine's all-to-all cannot finish before its grouped GEMMs do. This is the least imbalance
    dropless routing has -- a trained router's preferences add to it and are not priced.

    A token puts X copies on a given rank, X hypergeometric (mean k / ep, variance k (1/ep)(1 - 1/ep)(E - k)/(E - 1));
    a rank's load is the sum over the tokens, nearly normal, and the expected largest of ep such loads lies
    z(ep) standard deviations above the mean (Blom's approximation of the expected maximum of n normal draws,
    z = Phi^-1((n - 0.375) / (n + 0.25)))."""
    if ep <= 1 or tokens <= 0 or num_experts <= top_k:
        return 1.0
    mean = tokens * top_k / ep
    var = tokens * top_k * (1.0 / ep) * (1.0 - 1.0 / ep) * (num_experts - top_k) / (num_experts - 1)
    z = NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25))
    return 1.0 + z * sqrt(var) / mean


def expert_gemm_rows(*, group_tokens: float, top_k: int, num_experts: int, ep: int) -> float:
    """Rows each local expert's GEMMs compute on the busiest EP rank, when the EP group's ``group_tokens`` tokens
    are routed: the balanced share M_e = group_tokens k / E, scaled by busiest_rank_load_factor, in whole tiles
    (grouped_gemm_rows)."""
    m_e = group_tokens * top_k / num_experts
    return grouped_gemm_rows(m_e * busiest_rank_load_factor(tokens=group_tokens, top_k=top_k,
                                                            num_experts=num_experts, ep=ep))
