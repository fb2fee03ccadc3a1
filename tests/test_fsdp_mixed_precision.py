"""A 16-bit plan's stages hold the 16-bit weights the cost model prices: real gloo processes, the torch adapter, bf16
on CPU.

Autocast over FSDP2's gathered fp32 parameters would save a 16-bit copy of every weight for the backward that
FSDP2's resharding does not free: a ZeRO-3 stage would hold every layer's whole 16-bit weights at the end of the
forward, per micro-batch. With FSDP2's MixedPrecisionPolicy (the adapter's) the gathered 16-bit parameters are freed
after each layer's forward and gathered again for its backward. ZeRO-0 stages keep autocast over fp32 weights: one
16-bit copy of each GEMM weight for the whole step where they do not recompute whole layers (the runtime keeps
autocast's cast cache across the step's micro-batches), and under full recompute the output layer's copy per
micro-batch in flight, as costmodel/breakdown.py charges them. The test counts, at the first backward step, the
bytes still held by the full-shape GEMM weights that autograd saved, and checks that training still follows the
fp32-weight reference (autocast) within bf16 rounding.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_plans import make_plan
from test_adapter_torch import SEED, _batches, _free_port, _reference, rank_contexts
from runtime_adapters.gpt import build_model

LAYERS = 4


def _held_at_first_backward(ctx, batch: torch.Tensor, weight_shapes: set[tuple[int, ...]]) -> tuple[float, int]:
    """(loss, bytes of 16-bit full-shape GEMM weights saved for backward and still allocated when the backward
    starts). Storages freed by FSDP2's resharding report 0 bytes."""
    saved: list[torch.Tensor] = []
    held: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes:
            saved.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if not held:
            held.append(sum({x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in saved}.values()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = ctx.train_step(batch)
    return loss, held[0]


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    for name, plan, ctx in rank_contexts(rank, world, port, cases):
        whole = build_model(plan.model, seed=SEED)
        layer = whole.layers["0"]
        shapes = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2} | {tuple(whole.head.proj.weight.shape)}
        losses, held = [], []
        for b in _batches(plan):
            loss, h = _held_at_first_backward(ctx, b, shapes)
            losses.append(loss)
            held.append(h)
        if rank == 0:
            torch.save({"losses": losses, "held": held,
                        "layer_bytes_16bit": 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2),
                        "head_bytes_16bit": 2 * whole.head.proj.weight.numel()},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_bf16_stages_hold_the_16_bit_weights_the_cost_model_prices(tmp_path):
    """ZeRO 3 (FSDP2, MixedPrecisionPolicy): each layer's gathered 16-bit weights are freed after its forward.
    ZeRO 0 (autocast over fp32 weights): the micro-batches in flight share one 16-bit copy of every GEMM weight
    (autocast's cast cache kept across the step); under full recompute the checkpointed layers keep none and each
    micro-batch in flight its own copy of the output layer's weight. The cost model charges the same
    (RuntimeCapabilities.autocast_fp32_weights; GPipe runs both forwards before the first backward, so two are in
    flight)."""
    kw = dict(global_batch=4, num_microbatches=2, seq_len=40, dtype="bf16")  # 40: no activation has a weight's shape
    zero0 = {"layers": LAYERS, "gpus": "n0", "dp": 2, "zero_stage": 0}
    cases = {"zero3": make_plan("tiny", [{"layers": LAYERS, "gpus": "n0", "dp": 2, "zero_stage": 3}], **kw),
             "zero0": make_plan("tiny", [zero0], schedule="GPipe", **kw),
             "zero0_full": make_plan("tiny", [{**zero0, "recompute": "full"}], schedule="GPipe", **kw),
             # no data parallelism: nothing to shard, the stage runs as ZeRO-0 whatever its ZeRO stage says
             "zero3_dp1": make_plan("tiny", [{"layers": 2, "gpus": "n0", "zero_stage": 3},
                                             {"layers": 2, "gpus": "n1", "zero_stage": 3}], schedule="GPipe", **kw)}
    mp.start_processes(_worker, args=(2, _free_port(), [(n, p.to_dict()) for n, p in cases.items()], str(tmp_path)),
                       nprocs=2, start_method="fork", join=True)
    z3, z0, z0_full, z3_dp1 = (torch.load(tmp_path / f"{n}.pt")
                               for n in ("zero3", "zero0", "zero0_full", "zero3_dp1"))
    # at most the layer whose backward starts and one prefetched (autocast over fp32 shards held all of them)
    assert max(z3["held"]) <= 2 * z3["layer_bytes_16bit"], z3
    # every step: each layer's and the output layer's copy once, whatever the micro-batches in flight
    assert z0["held"] == [LAYERS * z0["layer_bytes_16bit"] + z0["head_bytes_16bit"]] * len(z0["held"]), z0
    # rank 0 runs the first stage of two (layers 0-1): each layer's copy once per step, as ZeRO-0's
    assert z3_dp1["held"] == [2 * z3_dp1["layer_bytes_16bit"]] * len(z3_dp1["held"]), z3_dp1
    # full recompute: the output layer's copy per micro-batch in flight, no layer's (the second step: the first also
    # holds what its first forward built once)
    assert z0_full["held"][-1] == 2 * z0_full["head_bytes_16bit"], z0_full
    # bf16 parameters in the forward instead of autocast's per-op casts: the same training within bf16 rounding;
    # the casts shared by the micro-batches are the ones each would have made
    ref = _reference(cases["zero3"])[0]  # the whole model, fp32 weights under autocast, in this process
    assert z3["losses"] == pytest.approx(ref, abs=2e-2)
    assert z0["losses"] == pytest.approx(ref, abs=2e-3) and z0_full["losses"] == pytest.approx(ref, abs=2e-3)
    assert z3_dp1["losses"] == pytest.approx(ref, abs=2e-3)
