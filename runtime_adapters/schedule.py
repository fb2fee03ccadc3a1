"""A 1F1B (or GPipe) executor for pipelines whose stages have their own (tp, dp) grids.

``torch.distributed.pipelining`` passes a micro-batch from one rank to one rank, so it needs one grid for every
stage. Here each rank runs its stage's action list (``stage_actions``: 1F1B warm-up forwards, steady one-forward-one-
backward, cool-down backwards; every rank of a stage runs the same list) and exchanges row slices with the ranks
``runtime_adapters.stage_grid`` names, by batched ``isend``/``irecv`` on the default group:

- after each action one batch goes out: that action's sends and the next action's receives (as torch's own 1F1B
  fuses a forward's send with the next backward's receive: on NCCL a send and the receive its peer posts meanwhile
  must be in flight together);
- a rank waits on a receive only right before the action that needs it, and on its sends only at the end of the step
  (their tensors are kept alive until then), so it never blocks on a send and its waits follow the schedule's data
  dependencies: no deadlock (every receive waits for an action its sender reaches without waiting on this rank).
  Each message carries tag ``2 m`` (activations of micro-batch m) or ``2 m + 1`` (its gradient).

Run on gloo (CPU) in the tests; on NCCL it is untested (no GPU here).

Gradient scale: the last stage back-propagates each replica's micro-batch loss over M (the schedule averages over
micro-batches) and each stage averages over its own replicas (all-reduce / FSDP2). With dp_k replicas on stage k and
dp_{k+1} on k+1, a gradient arriving at stage k is multiplied by dp_k / dp_{k+1}; then stage k's replica-average
equals the average over the last stage's replicas, i.e. the whole batch's mean loss (exact: one step equals the
single-process reference step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from runtime_adapters.stage_grid import Transfer, backward_transfers, forward_transfers, replica_rows
from tangram_launch.plan import Place, Plan

logger = logging.getLogger(__name__)


def stage_actions(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """This stage's actions in order: ("F", m) forward / ("B", m) backward of micro-batch m."""
    m = num_microbatches
    if schedule == "GPipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(num_stages - 1 - stage, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("B", i)]
    out += [("B", i) for i in range(m - warmup, m)]
    return out


@dataclass
class _Slot:
    """What one micro-batch keeps between its forward and backward."""

    inputs: torch.Tensor | None = None  # received activations (requires grad) or None on the first stage
    output: torch.Tensor | None = None  # activations sent on, or the loss on the last stage


@dataclass
class GridSchedule:
    """One rank's executor over a per-stage-grid plan; ``step`` runs one iteration's forwards and backwards."""

    plan: Plan
    place: Place
    module: nn.Module
    device: torch.device
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    hidden_size: int
    before_backward: Callable[[bool], None] = lambda last: None  # FSDP2: gradient sync on the last backward only
    _pending: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        plan, place = self.plan, self.place
        k, rank = place.stage.index, place.rank
        self.stage = k
        self.first, self.last = place.is_first_stage, place.is_last_stage
        self.rows = replica_rows(plan, k, place.coords["dp"])
        self.micro_rows = place.stage.micro_batch_size * place.stage.dp  # B: sequences per micro-batch
        fwd_in = forward_transfers(plan, k - 1) if k > 0 else ()
        bwd_in = backward_transfers(plan, k) if not self.last else ()
        fwd_out = forward_transfers(plan, k) if not self.last else ()
        bwd_out = backward_transfers(plan, k - 1) if k > 0 else ()
        self.recv_act = [x for x in fwd_in if x.dst == rank]
        self.recv_grad = [x for x in bwd_in if x.dst == rank]
        self.send_act = [x for x in fwd_out if x.src == rank]
        self.send_grad = [x for x in bwd_out if x.src == rank]
        nxt = plan.stages[k + 1].dp if not self.last else place.stage.dp
        self.grad_ratio = place.stage.dp / nxt
        self.actions = stage_actions(plan.schedule, k, plan.num_stages, plan.num_microbatches)

    # --- communication -------------------------------------------------------------------------------------------
    def _recv_ops(self, action: tuple[str, int] | None, seq_len: int) -> tuple[list, list[torch.Tensor]]:
        """The receives ``action`` needs: (P2P ops, buffers in row order)."""
        import torch.distributed as dist

        if action is None:
            return [], []
        kind, m = action
        transfers, tag = (self.recv_act, 2 * m) if kind == "F" else (self.recv_grad, 2 * m + 1)
        bufs = [torch.empty(x.rows, seq_len, self.hidden_size, device=self.device) for x in transfers]
        return [dist.P2POp(dist.irecv, b, peer=x.src, tag=tag) for b, x in zip(bufs, transfers)], bufs

    def _send_ops(self, value: torch.Tensor | None, transfers: list[Transfer], tag: int
                  ) -> tuple[list, list[torch.Tensor]]:
        import torch.distributed as dist

        if value is None or not transfers:
            return [], []
        value = value.detach().float()
        parts = [value[x.src_offset:x.src_offset + x.rows].contiguous() for x in transfers]
        return [dist.P2POp(dist.isend, p, peer=x.dst, tag=tag) for p, x in zip(parts, transfers)], parts

    def _post(self, sends: tuple[list, list[torch.Tensor]], recvs: tuple[list, list[torch.Tensor]]) -> list:
        """Post one batch: this action's sends and the next action's receives (torch's 1F1B fuses them the same
        way, which NCCL needs: a send and the receive its peer posts in between must be in flight together).
        Returns the works to wait on before the next action; the sends' are waited on at the end of the step."""
        import torch.distributed as dist

        ops = sends[0] + recvs[0]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        n = len(sends[0])
        if len(works) == len(ops):  # one work per op (gloo): wait only on the receives now
            self._pending.append((works[:n], sends[1]))
            return works[n:]
        self._pending.append(([], sends[1]))  # one coalesced work (NCCL): waiting on it orders the stream only
        return works

    # --- the step ------------------------------------------------------------------------------------------------
    def step(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """One iteration on the global batch (G, T + 1) tokens (the same on every rank); returns this replica's
        per-micro-batch losses on the last stage (unscaled by 1/M), [] elsewhere."""
        seq_len = batch.shape[1] - 1
        lo, hi = self.rows
        n_mb = self.plan.num_microbatches
        if batch.shape[0] != self.micro_rows * n_mb:
            from tangram_launch.errors import SpecError

            raise SpecError("a batch has global_batch rows", field="batch.shape[0]", value=batch.shape[0],
                            valid=str(self.micro_rows * n_mb))
        slots: dict[int, _Slot] = {}
        losses: list[torch.Tensor] = []
        backwards_done = 0
        recv_ops, recv_bufs = self._recv_ops(self.actions[0], seq_len)
        waiting = self._post(([], []), (recv_ops, recv_bufs))
        for t, (kind, m) in enumerate(self.actions):
            for w in waiting:
                w.wait()
            received = (torch.cat(recv_bufs) if len(recv_bufs) > 1 else recv_bufs[0]) if recv_bufs else None
            rows = batch[m * self.micro_rows + lo:m * self.micro_rows + hi].to(self.device)  # (b_k, T + 1)
            sends: tuple[list, list[torch.Tensor]] = ([], [])
            if kind == "F":
                slot = slots.setdefault(m, _Slot())
                if self.first:
                    x = rows[:, :-1]
                else:
                    x = received.requires_grad_(True)  # (b_k, T, H), rows in order
                    slot.inputs = x
                out = self.module(x)
                if self.last:
                    loss = self.loss_fn(out, rows[:, 1:])
                    losses.append(loss.detach())
                    slot.output = loss / n_mb
                else:
                    slot.output = out
                    sends = self._send_ops(out, self.send_act, 2 * m)
            else:
                slot = slots.pop(m)
                backwards_done += 1
                self.before_backward(backwards_done == n_mb)
                if self.last:
                    slot.output.backward()
                else:
                    grad = received
                    if self.grad_ratio != 1.0:
                        grad.mul_(self.grad_ratio)
                    torch.autograd.backward(slot.output, grad.to(slot.output.dtype))
                if slot.inputs is not None:
                    sends = self._send_ops(slot.inputs.grad, self.send_grad, 2 * m + 1)
            nxt = self.actions[t + 1] if t + 1 < len(self.actions) else None
            recv_ops, recv_bufs = self._recv_ops(nxt, seq_len)
            waiting = self._post(sends, (recv_ops, recv_bufs))
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()
        return losses
