"""What an FSDP2 unit costs beyond its compute and its transfers, measured on a node's ranks.

The torch runtime shards ZeRO 1-3 stages with FSDP2 (``fully_shard`` per layer and on the stage's root module). Each
unit pays, per pass, work the cost model's transfer terms do not see: its pre- and post-forward and -backward hooks,
the copy into and out of the all-gather buffer, the collective calls, and, in the optimizer, one step per DTensor
parameter (a dozen tensor-subclass dispatches per tensor where a plain tensor pays a dozen kernels). On 2 gloo CPU
ranks the tiny GPT's dp-2 ZeRO-3 stage ran its forward 3x, its backward 2x and its optimizer step 6x what the plain
stage's did (torch profiler: ~1.1 ms per all-gather call, ~2 ms per reduce-scatter, ~150 us per DTensor AdamW step).

Measured here with units whose parameters are tiny (their bytes cost nothing on any link), against the same module
unwrapped: forward and backward per unit, and AdamW's step per sharded parameter tensor. The cost model charges the
unit overhead beyond the collectives' own fixed cost, which it charges apart (costmodel/breakdown.py).
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from profiler.bench import Measured, Timing, device_sync, time_blocks_split

UNITS = 8  # FSDP2 units of the probe: 7 children and the root, one Linear each
WIDTH = 32  # each Linear is WIDTH x WIDTH with a bias: two parameter tensors, ~1k elements
BLOCKS, CALLS = 5, 4  # timed blocks of back-to-back (forward, backward) calls, the same count on every member
OPT_REPS = 5


def _stack(linears: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(linears)))


class _Probe(nn.Module):
    """UNITS small Linears in sequence: ``children`` each its own FSDP2 unit, ``root`` in the root unit (as the
    runtime wraps a stage: every layer, then the module holding the embedding and the head)."""

    def __init__(self, device: torch.device, linears: int = 1) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.children_ = nn.ModuleList(_stack(linears) for _ in range(UNITS - 1))
        self.root = _stack(linears)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children_:
            x = torch.tanh(layer(x))
        return self.root(x)


def _fwd_bwd_timing(module: nn.Module, x: torch.Tensor, group: Any, device: torch.device) -> tuple[Timing, Timing]:
    """(forward + backward, forward) seconds per call, BLOCKS blocks of CALLS calls, the members started together."""
    def forward() -> torch.Tensor:
        return module(x).square().mean()

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    between = (lambda: dist.barrier(group=group))
    for _ in range(2):  # warm up: FSDP2's lazy init, allocator
        backward(forward())
    between()
    return time_blocks_split(forward, backward, between, blocks=BLOCKS, calls=CALLS, sync=device_sync(device))


def _optimizer_step_s(params: list, group: Any, device: torch.device) -> Timing:
    """Seconds of one AdamW step over ``params`` (zero gradients), OPT_REPS times, the members started together."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)  # as the torch runtime builds it
    sync = device_sync(device)
    opt.step()
    samples = []
    for _ in range(OPT_REPS):
        dist.barrier(group=group)
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))


def fsdp_unit_overhead(group: Any, group_size: int, device: torch.device, linears: int = 1) -> tuple[Measured, Measured, Measured]:
    """(forward us per unit, backward us per unit, AdamW us per sharded parameter tensor) over ``group``'s
    ``group_size`` ranks. Unit figures: the FSDP2-wrapped probe's time less the plain one's, over UNITS (0 or
    more); the step: AdamW(foreach=False) over the sharded probe's DTensor parameters, per tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, WIDTH, device=device, generator=torch.Generator(device=device).manual_seed(1))
    plain = _Probe(device, linears)
    plain_fb, plain_f = _fwd_bwd_timing(plain, x, group, device)
    sharded = _Probe(device, linears)
    mesh = DeviceMesh.from_group(group, device.type)
    for layer in sharded.children_:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    fsdp_fb, fsdp_f = _fwd_bwd_timing(sharded, x, group, device)
    params = list(sharded.parameters())
    step = _optimizer_step_s(params, group, device)
    fwd_us = max(0.0, fsdp_f.median_s - plain_f.median_s) / UNITS * 1e6
    bwd_us = max(0.0, (fsdp_fb.median_s - fsdp_f.median_s) - (plain_fb.median_s - plain_f.median_s)) / UNITS * 1e6
    detail = (("units", UNITS), ("unit_params", WIDTH * WIDTH + WIDTH), ("group_size", group_size),
              ("plain_forward_s", plain_f.median_s), ("plain_forward_backward_s", plain_fb.median_s))
    return (Measured(fwd_us, "us", fsdp_f, detail + (("op", "FSDP2 unit forward less plain, per unit"),)),
            Measured(bwd_us, "us", fsdp_fb, detail + (("op", "FSDP2 unit backward less plain, per unit"),)),
            Measured(step.median_s / len(params) * 1e6, "us", step,
                     (("tensors", len(params)), ("group_size", group_size),
                      ("op", "AdamW(foreach=False).step over FSDP2-sharded parameters, per tensor"))))
