"""What an FSDP2 unit costs beyond its compute and its transfers, measured on a node's ranks.

The torch runtime shards ZeRO 1-3 stages with FSDP2 (``fully_shard`` per layer and on the stage's root module). Each
unit pays, per pass, work the cost model's transfer terms do not see: its pre- and post-forward and -backward hooks,
the copy into and out of the all-gather buffer, the collective calls, and, in the optimizer, one step per DTensor
parameter (a dozen tensor-subclass dispatches per tensor where a plain tensor pays a dozen kernels). On 2 gloo CPU
ranks the tiny GPT's dp-2 ZeRO-3 stage ran its forward 3x, its backward 2x and its optimizer step 6x what the plain
stage's did (torch profiler: ~1.1 ms per all-gather call, ~2 ms per reduce-scatter, ~150 us per DTensor AdamW step).

Measured here with units whose parameters are tiny (their bytes cost nothing on any link), against the same module
unwrapped: forward and backward per unit, and AdamW's step per sharded parameter tensor. The plain and the sharded
modules run in alternating blocks and each figure is the median of the blocks' paired differences, so a change of
the host's speed during the probe (shared cores) moves both sides of a pair alike. The cost model charges the unit
overhead beyond the collectives' own fixed cost, which it charges apart (costmodel/breakdown.py).
"""
from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from profiler.bench import (DTYPES, Measured, Timing, barrier_kwargs, device_sync, time_blocks_split,
                            time_repeated)

UNITS = 8  # FSDP2 units of the probe: 7 children and the root
LINEARS = 6  # per unit: a transformer layer's dozen parameter tensors (the host work grows with them: ~20 us a
# tensor forward and ~80 backward on 2 gloo ranks, where a unit of 2 tensors reads ~1.3 and ~2.6 ms)
WIDTH = 32  # each Linear is WIDTH x WIDTH with a bias: two parameter tensors, ~1k elements
BLOCKS, CALLS = 7, 4  # alternating timed blocks of back-to-back (forward, backward) calls, the same on every member
OPT_REPS = 5


def _unit() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LINEARS)))


class _Probe(nn.Module):
    """UNITS units of LINEARS small Linears in sequence: ``children_`` each its own FSDP2 unit, ``root`` in the root
    unit (as the runtime wraps a stage: every layer, then the module holding the embedding and the head)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.children_ = nn.ModuleList(_unit() for _ in range(UNITS - 1))
        self.root = _unit()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children_:
            x = torch.tanh(layer(x))
        return self.root(x)


def _optimizer_step_s(params: list, group: Any, device: torch.device) -> Timing:
    """Seconds of one AdamW step over ``params`` (zero gradients), OPT_REPS times, the members started together."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)  # as the torch runtime builds it

    def barrier() -> None:
        dist.barrier(group=group, **barrier_kwargs(device))
    barrier()
    return time_repeated(opt.step, warmup=1, reps=OPT_REPS, sync=device_sync(device), between=barrier)


def _sharded(device: torch.device, mesh: Any, dtype: str) -> nn.Module:
    """The probe wrapped as the torch runtime wraps a stage whose units gather in ``dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32) if dtype != "fp32" \
        else MixedPrecisionPolicy()
    module = _Probe(device)
    for layer in module.children_:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    return module


def fsdp_unit_overhead(group: Any, group_size: int, device: torch.device,
                       dtypes: tuple[str, ...] = ("fp32",)) -> tuple[dict, dict, Measured]:
    """({dtype: forward us per unit}, {dtype: backward us per unit}, AdamW us per sharded parameter tensor) over
    ``group``'s ``group_size`` ranks. Unit figures: the median over BLOCKS alternating blocks of the FSDP2-wrapped
    probe's time less the plain one's, over UNITS (0 or more), per dtype the units gather in
    (``MixedPrecisionPolicy(param_dtype=...)`` for a 16-bit one, as the torch runtime wraps a 16-bit plan's stages;
    fp32: none); the step: AdamW(foreach=False) over the sharded probe's DTensor parameters (fp32 shards whatever
    the dtype), per tensor."""
    from torch.distributed.device_mesh import DeviceMesh

    x = torch.randn(4, WIDTH, device=device, generator=torch.Generator(device=device).manual_seed(1))
    mesh = DeviceMesh.from_group(group, device.type)
    modules = {"plain": _Probe(device), **{d: _sharded(device, mesh, d) for d in dtypes}}
    sync = device_sync(device)
    for module in modules.values():  # warm up: FSDP2's lazy init, the allocator
        for _ in range(2):
            module(x).square().mean().backward()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in modules}  # (forward, forward + backward)
    for _ in range(BLOCKS):
        for name, module in modules.items():
            dist.barrier(group=group, **barrier_kwargs(device))  # every member starts each block together
            fb, f = time_blocks_split(lambda m=module: m(x).square().mean(), lambda loss: loss.backward(),
                                      lambda: None, blocks=1, calls=CALLS, sync=sync)
            times[name].append((f.median_s, fb.median_s))
    fwd: dict[str, Measured] = {}
    bwd: dict[str, Measured] = {}
    for d in dtypes:
        pairs = list(zip(times[d], times["plain"]))
        f_diff = [s[0] - p[0] for s, p in pairs]
        b_diff = [(s[1] - s[0]) - (p[1] - p[0]) for s, p in pairs]
        detail = (("units", UNITS), ("unit_tensors", 2 * LINEARS), ("unit_params", LINEARS * (WIDTH * WIDTH + WIDTH)),
                  ("group_size", group_size), ("param_dtype", d), ("blocks", BLOCKS), ("calls", CALLS),
                  ("plain_forward_s", statistics.median(p[0] for p in times["plain"])),
                  ("plain_forward_backward_s", statistics.median(p[1] for p in times["plain"])))
        fwd[d] = Measured(max(0.0, statistics.median(f_diff)) / UNITS * 1e6, "us",
                          Timing(tuple(s[0] for s, _ in pairs)), detail + (("op", "FSDP2 unit forward less plain"),))
        bwd[d] = Measured(max(0.0, statistics.median(b_diff)) / UNITS * 1e6, "us",
                          Timing(tuple(s[1] for s, _ in pairs)), detail + (("op", "FSDP2 unit backward less plain"),))
    params = list(modules[dtypes[-1]].parameters())
    step = _optimizer_step_s(params, group, device)
    return fwd, bwd, Measured(step.median_s / len(params) * 1e6, "us", step,
                              (("tensors", len(params)), ("group_size", group_size),
                               ("op", "AdamW(foreach=False).step over FSDP2-sharded parameters, per tensor")))
