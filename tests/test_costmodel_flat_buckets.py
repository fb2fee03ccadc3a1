"""The torch runtime's ZeRO-0 gradient all-reduce goes through flat buckets (runtime_adapters/torch_native.
_bucketed_all_reduce: concatenate, reduce, divide, copy back): three read-write passes over every gradient beside
the collective, which the cost model charges at the device's memory bandwidth (RuntimeCapabilities.dp_flat_buckets)
and a runtime that reduces gradients where they live is not charged."""
from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_adapters.torch_native import _bucketed_all_reduce
from tangram_launch.capabilities import capabilities_for
from tangram_launch.costmodel.breakdown import FLAT_BUCKET_PASSES
from tangram_launch.costmodel.slice_plan import ParallelConfig
from tangram_launch.specs.model import load_model
from test_costmodel import coster, island

TORCH = capabilities_for("torch")
IN_PLACE = dataclasses.replace(TORCH, dp_flat_buckets=False)
MODEL = load_model("tiny")
MEASURED = {"device": "cpu", "memory_bandwidth_GBps": 10.0, "allreduce_busbw_gbps": 1.0, "allreduce_group_size": 2,
            "collective_latency_us": 300.0}


def _stage(caps, *, dp: int, zero: int = 0, dtype: str = "fp32", ep: int = 1, model=MODEL):
    c = coster(model, island("cpu", per_node=max(dp, 2), measured=MEASURED), b=dp, gb=4 * dp, seq=64, dtype=dtype,
               caps=caps)
    return c.plan(ParallelConfig(tp=1, dp=dp, ep=ep, zero_stage=zero, recompute="none", pp=1)).stages[0]


@settings(max_examples=20, deadline=None)
@given(dp=st.sampled_from([2, 4]), dtype=st.sampled_from(["fp32", "bf16"]))
def test_zero0_pays_three_passes_over_its_fp32_gradients(dp, dtype):
    """dp > 1, ZeRO 0: the sync costs 6 bytes moved per gradient byte more, at 10 GB/s, over every parameter the GPU
    holds (fp32 gradients under autocast as under fp32); nothing else changes."""
    flat, in_place = _stage(TORCH, dp=dp, dtype=dtype), _stage(IN_PLACE, dp=dp, dtype=dtype)
    params = flat.breakdown["params_per_gpu"]
    assert flat.dp_sync_s - in_place.dp_sync_s == pytest.approx(FLAT_BUCKET_PASSES * 4 * params / 10e9)
    assert (flat.forward_s, flat.backward_s, flat.optimizer_s) == (in_place.forward_s, in_place.backward_s,
                                                                    in_place.optimizer_s)


def test_nothing_to_copy_without_replicas_or_under_fsdp():
    for kwargs in ({"dp": 1}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}):
        assert _stage(TORCH, **kwargs).dp_sync_s == _stage(IN_PLACE, **kwargs).dp_sync_s, kwargs


def test_the_experts_gradients_are_bucketed_too():
    moe = load_model("tiny-moe")
    flat, in_place = _stage(TORCH, dp=2, ep=2, model=moe), _stage(IN_PLACE, dp=2, ep=2, model=moe)
    assert flat.dp_sync_s - in_place.dp_sync_s == pytest.approx(
        FLAT_BUCKET_PASSES * 4 * flat.breakdown["params_per_gpu"] / 10e9)


def test_the_charge_is_what_the_runtime_takes_on_megabyte_gradients():
    """The runtime's own bucketing (no group: the copies alone) of 16 gradients of 1 MiB, timed on this machine,
    against the passes over their bytes at this machine's copy bandwidth (a copy of as many bytes): within 2x either
    way (measured 0.6-0.9 of the charge; a check of the physics on a shared CPU, not a benchmark). Many small
    gradients (tiny's 69) take longer than their bytes, about 5 us a tensor of host work here, which the cost model
    does not charge; and where a CPU's allocator maps the bucket's pages anew on every call (glibc, buckets of tens
    of MiB) the faults double it, which a GPU's caching allocator never pays."""
    torch.set_num_threads(1)
    grads = [torch.randn(1 << 18) for _ in range(16)]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)

    def median_s(fn) -> float:
        for _ in range(3):  # first calls allocate
            fn()
        times = []
        for _ in range(9):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    copy_bandwidth = 2 * nbytes / median_s(lambda: dst.copy_(src))  # read + write, bytes/s
    charged = FLAT_BUCKET_PASSES * nbytes / copy_bandwidth
    taken = median_s(lambda: _bucketed_all_reduce(grads, None, 2))
    assert charged / 2 < taken < 2 * charged, (taken, charged)
