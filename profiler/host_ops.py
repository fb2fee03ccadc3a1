"""The host's time per operator the torch runtime dispatches (``host_op_us``; the cost model's host floor,
tangram_launch/costmodel/host_floor.py).

A small Llama-style layer (the profiler's layer, whose operators are the runtime's) runs forward and backward at one
token, timed within the profile's budget and divided by the aten operators that call dispatches (counted once with a
dispatch-mode counter). At one token the kernels are too small to matter, so the time is the host's: Python, the
dispatcher, autograd, and on a GPU the kernel launches. A larger shape pays it too wherever its kernels finish
faster than the host issues them."""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from profiler.bench import BenchConfig, Measured, calibration_clock, device_sync, time_budgeted
from profiler.layer import build_layer

# the reference layer's widths: small enough that one token's kernels take next to nothing on any device
REFERENCE_WIDTHS = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def reference_layer_model():
    """The Llama-style model whose layer is timed (llama3-8b's structure at REFERENCE_WIDTHS)."""
    from tangram_launch.specs.model import load_model

    return dataclasses.replace(load_model("llama3-8b"), **REFERENCE_WIDTHS)


def counted_ops(step) -> int:
    """Aten operators one call of ``step`` dispatches."""
    with _OpCounter() as counter:
        step()
    return counter.ops


def host_op_us(device: torch.device, cfg: BenchConfig) -> Measured:
    """Microseconds of host time per dispatched operator (module docstring), within half the benchmark budget."""
    model = reference_layer_model()
    layer = build_layer(model, "dense", device, "fp32")
    x = torch.randn(1, 1, model.hidden_size, device=device, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    step()  # the first call allocates and selects kernels
    ops = counted_ops(step)
    timing = time_budgeted(step, cfg.budget_s / 2, min_rep_s=cfg.min_rep_s, max_reps=cfg.reps,
                           sync=device_sync(device), clock=calibration_clock(device))
    return Measured(timing.median_s / ops * 1e6, "us", timing,
                    (("ops", ops), ("op", "a Llama-style layer's forward and backward at one token")))
