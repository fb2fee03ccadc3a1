"""A 1F1B (or GPipe) executor for pipelines whose stages have their own (tp, dp) grids.

``torch.distributed.pipelining`` passes a micro-batch from one rank to one rank, so it needs one grid for every
stage. Here each rank runs its stage's action list (``stage_actions``: 1F1B warm-up forwards, steady one-forward-one-
backward, cool-down backwards; every rank of a stage runs the same list) and exchanges row slices with the ranks
``runtime_adapters.stage_grid`` names, by batched ``isend``/``irecv`` on the default group:

- receives are posted as one batch right before the action that needs them and waited on;
- sends are posted as one batch right after the action that produced them and only waited on at the end of the
  step (their tensors are kept alive until then), so a rank never blocks on a send and the order of waits follows the
  schedule's data dependencies: no deadlock (every receive waits for an action its sender reaches without waiting
  on this rank). Each message carries tag ``2 m`` (activations of micro-batch m) or ``2 m + 1`` (its gradient).

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
    def _recv(self, transfers: list[Transfer], tag: int, seq_len: int) -> torch.Tensor:
        import torch.distributed as dist

        bufs = [torch.empty(x.rows, seq_len, self.hidden_size, device=self.device) for x in transfers]
        ops = [dist.P2POp(dist.irecv, b, peer=x.src, tag=tag) for b, x in zip(bufs, transfers)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return torch.cat(bufs) if len(bufs) > 1 else bufs[0]  # transfers are ordered by rows: (b_k, T, H)

    def _send(self, value: torch.Tensor, transfers: list[Transfer], tag: int) -> None:
        import torch.distributed as dist

        if not transfers:
            return
        value = value.detach().float()
        parts = [value[x.src_offset:x.src_offset + x.rows].contiguous() for x in transfers]
        ops = [dist.P2POp(dist.isend, p, peer=x.dst, tag=tag) for p, x in zip(parts, transfers)]
        self._pending.append((dist.batch_isend_irecv(ops), parts))  # parts stay alive until the sends complete

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
        for kind, m in self.actions:
            rows = batch[m * self.micro_rows + lo:m * self.micro_rows + hi].to(self.device)  # (b_k, T + 1)
            if kind == "F":
                slot = slots.setdefault(m, _Slot())
                if self.first:
                    x = rows[:, :-1]
                else:
                    x = self._recv(self.recv_act, 2 * m, seq_len).requires_grad_(True)
                    slot.inputs = x
                out = self.module(x)
                if self.last:
                    loss = self.loss_fn(out, rows[:, 1:])
                    losses.append(loss.detach())
                    slot.output = loss / n_mb
                else:
                    slot.output = out
                    self._send(out, self.send_act, 2 * m)
            else:
                slot = slots.pop(m)
                backwards_done += 1
                self.before_backward(backwards_done == n_mb)
                if self.last:
                    slot.output.backward()
                else:
                    grad = self._recv(self.recv_grad, 2 * m + 1, seq_len)
                    if self.grad_ratio != 1.0:
                        grad.mul_(self.grad_ratio)
                    torch.autograd.backward(slot.output, grad.to(slot.output.dtype))
                if slot.inputs is not None:
                    self._send(slot.inputs.grad, self.send_grad, 2 * m + 1)
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()
        return losses
