"""Optimizer offload (``stage.offload``): optimizer state and the update on the host, as ZeRO-Offload does.

The accelerator keeps the parameters and gradients the forward and backward need; the host keeps an fp32 master
copy of each parameter (this rank's shard under FSDP2/TP) and the optimizer state for it (Adam: 2 x 4 bytes per
parameter). Each step copies the gradients to the host, runs the optimizer there and copies the updated parameters
back: gradient bytes + parameter bytes per parameter over PCIe per step, what the cost model charges
(``tangram_launch.costmodel``: ``model_state_bytes`` with offload for the host memory, the copies and CPU Adam in
the optimizer time). The master copy is re-read from the accelerator in ``load_state_dict`` (a checkpoint load
restores the module's parameters first, then the optimizer) and in ``sync_from_params``, for any other in-place
change of the module's parameters; otherwise the next step would overwrite such a change with the old master.

Sharded parameters (DTensor: FSDP2 or tensor parallel) get host copies that are DTensors over the same mesh and
placements with a host local tensor, as FSDP2's ``CPUOffloadPolicy`` keeps them, so the optimizer state stays a
sharded tensor and checkpoints reshard it like any other.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``ref``'s kind: a DTensor with ref's mesh and placements, or itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(ref, DTensor):
        return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                  stride=ref.stride())
    return local


class HostOffloadOptimizer:
    """An optimizer (``factory`` over host copies of ``params``) whose state and update live on the host.

    Offers what the adapter and the checkpoints use of ``torch.optim.Optimizer``: ``step``, ``zero_grad``,
    ``param_groups`` (the host copies' groups: LR schedules act on them), ``state``, ``state_dict`` and
    ``load_state_dict``; ``host_params`` maps each host copy to its accelerator parameter (checkpoint names)."""

    def __init__(self, params: Iterable[nn.Parameter], factory: Callable[[list[nn.Parameter]], Any],
                 host: torch.device | None = None) -> None:
        self.params = list(params)
        self.host = host or torch.device("cpu")
        pin = torch.cuda.is_available() and any(_local(p).is_cuda for p in self.params)
        copies = []
        for p in self.params:
            local = _local(p).detach().to(self.host, dtype=torch.float32, copy=True)
            copies.append(nn.Parameter(_like(local.pin_memory() if pin else local, p)))
        self.host_params: dict[nn.Parameter, nn.Parameter] = dict(zip(copies, self.params))
        self.inner = factory(copies)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.sync_from_params()

    @torch.no_grad()
    def sync_from_params(self) -> None:
        """Re-read the master copies from the accelerator's parameters (after loading or editing them)."""
        for hp, p in self.host_params.items():
            _local(hp).copy_(_local(p))

    @torch.no_grad()
    def step(self) -> None:
        """Gradients down to the host, the update there, parameters back up."""
        for hp, p in self.host_params.items():
            if p.grad is None:
                hp.grad = None
                continue
            g = _local(p.grad).to(self.host, dtype=torch.float32, non_blocking=True)
            hp.grad = _like(g, hp)
        if any(_local(p).is_cuda for p in self.params):
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        self.inner.step()
        for hp, p in self.host_params.items():
            _local(p).copy_(_local(hp), non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)
