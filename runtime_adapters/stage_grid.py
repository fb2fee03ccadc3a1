"""Who sends which rows to whom when pipeline stages have their own (tp, dp) grids (pure data, no process group).

A micro-batch is ``B = micro_batch_size_k * dp_k`` sequences, the same for every stage k (the Plan checks it). Stage
k splits it over its dp_k replicas: replica d holds rows ``[d * b_k, (d + 1) * b_k)`` with ``b_k = B / dp_k``. At the
boundary k -> k+1 the two splits differ, so each sender replica sends each receiver replica exactly the rows both
hold (the overlap of the two ranges; none when they do not overlap). Inside a replica every TP rank computes the
same activations (the TP blocks end in an all-reduce), so one TP rank (tp = 0) sends and every TP rank of the
receiving replica gets the rows. Gradients flow back the same way: the receiving replica's tp-0 rank sends each
sending replica's TP ranks the gradient of the rows they sent.

Micro-batch m is rows ``[m * B, (m + 1) * B)`` of the global batch, so stage k replica d reads rows
``m * B + [d * b_k, (d + 1) * b_k)`` of the tokens (first stage) and targets (last stage).
"""
from __future__ import annotations

from dataclasses import dataclass

from tangram_launch.plan import Plan


@dataclass(frozen=True)
class Transfer:
    """One message per micro-batch: rows ``[lo, hi)`` of the micro-batch (global row numbers inside it) go from
    ``src`` to ``dst`` (global ranks). ``src_offset``/``dst_offset``: where those rows start in the sender's and
    receiver's own slices."""

    src: int
    dst: int
    lo: int
    hi: int
    src_offset: int
    dst_offset: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def replica_rows(plan: Plan, stage: int, dp: int) -> tuple[int, int]:
    """Rows [lo, hi) of a micro-batch that replica ``dp`` of ``stage`` holds."""
    s = plan.stages[stage]
    return dp * s.micro_batch_size, (dp + 1) * s.micro_batch_size


def forward_transfers(plan: Plan, boundary: int) -> tuple[Transfer, ...]:
    """Activations from stage ``boundary`` to stage ``boundary + 1``: tp-0 rank of each sending replica to every TP
    rank of each receiving replica whose rows overlap; ordered by (receiver, rows), so a receiver concatenates in
    order."""
    return tuple(_transfers(plan, boundary, forward=True))


def backward_transfers(plan: Plan, boundary: int) -> tuple[Transfer, ...]:
    """Gradients from stage ``boundary + 1`` back to stage ``boundary`` (the same rows, the other way): tp-0 rank of
    each receiving replica to every TP rank of each sending replica; ordered by (destination, rows)."""
    return tuple(_transfers(plan, boundary, forward=False))


def _transfers(plan: Plan, k: int, *, forward: bool):
    topo = plan.topology
    lo_stage, hi_stage = (k, k + 1) if forward else (k + 1, k)  # sender, receiver of this direction
    src_shape, dst_shape = plan.stages[lo_stage], plan.stages[hi_stage]
    out = []
    for e in range(dst_shape.dp):
        d_lo, d_hi = replica_rows(plan, hi_stage, e)
        for d in range(src_shape.dp):
            s_lo, s_hi = replica_rows(plan, lo_stage, d)
            lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
            if lo >= hi:
                continue
            src = topo.rank_of(lo_stage, dp=d, cp=0, tp=0)
            for t in range(dst_shape.tp):
                dst = topo.rank_of(hi_stage, dp=e, cp=0, tp=t)
                out.append(Transfer(src=src, dst=dst, lo=lo, hi=hi, src_offset=lo - s_lo, dst_offset=lo - d_lo))
    out.sort(key=lambda x: (x.dst, x.lo))
    return out


def check_routes(plan: Plan) -> None:
    """Internal invariant: every TP rank of every receiving replica gets each of its rows exactly once."""
    for k in range(plan.num_stages - 1):
        for fwd in (True, False):
            recv_stage = k + 1 if fwd else k
            got: dict[int, list[tuple[int, int]]] = {}
            for x in (forward_transfers if fwd else backward_transfers)(plan, k):
                got.setdefault(x.dst, []).append((x.lo, x.hi))
            for r in plan.topology.stage_ranks(recv_stage):
                lo, hi = replica_rows(plan, recv_stage, plan.topology.coords(r).dp)
                spans = sorted(got.get(r, []))
                assert spans and spans[0][0] == lo and spans[-1][1] == hi, (k, fwd, r, spans)
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (k, fwd, r, spans)
