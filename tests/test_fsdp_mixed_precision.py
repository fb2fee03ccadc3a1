"""A 16-bit plan's FSDP2 stages keep what ZeRO promises: real gloo processes, the torch adapter, bf16 on CPU.

Autocast over FSDP2's gathered fp32 parameters saves a 16-bit copy of every weight for the backward, and FSDP2's
resharding after forward does not free it: a ZeRO-3 stage then holds every layer's whole 16-bit weights at the end
of the forward, per micro-batch. With FSDP2's MixedPrecisionPolicy (the adapter's) the gathered 16-bit parameters
are freed after each layer's forward and gathered again for its backward. The test counts, at the first backward
step, the bytes still held by the full-shape layer weights that autograd saved, and checks that training still
follows the fp32 reference (autocast) within bf16 rounding.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_plans import make_plan
from test_adapter_torch import SEED, _batches, _free_port, _sgd
from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S
from runtime_adapters.gpt import build_model, lm_loss
from runtime_adapters.torch_native import TorchAdapter
from tangram_launch.plan import Plan

LAYERS = 4


def _held_at_first_backward(ctx, batch: torch.Tensor, weight_shapes: set[tuple[int, ...]]) -> tuple[float, int]:
    """(loss, bytes of 16-bit full-shape layer weights saved for backward and still allocated when the backward
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


def _worker(rank: int, world: int, port: int, plan_dict: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    plan = Plan.from_dict(plan_dict)
    ctx = TorchAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                               optimizer_factory=_sgd)
    layer = build_model(plan.model, seed=SEED).layers["0"]
    shapes = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2}
    losses, held = [], []
    for b in _batches(plan):
        loss, h = _held_at_first_backward(ctx, b, shapes)
        losses.append(loss)
        held.append(h)
    if rank == 0:
        torch.save({"losses": losses, "held": held,
                    "layer_bytes_16bit": 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)},
                   os.path.join(out_dir, "rec.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _reference_losses(plan: Plan) -> list[float]:
    model = build_model(plan.model, seed=SEED)
    model.set_compute_dtype(torch.bfloat16)
    opt = _sgd(list(model.parameters()))
    out = []
    for b in _batches(plan):
        loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.distributed
def test_a_bf16_zero3_stage_frees_each_layers_gathered_weights_after_its_forward(tmp_path):
    plan = make_plan("tiny", [{"layers": LAYERS, "gpus": "n0", "dp": 2, "zero_stage": 3}], global_batch=4,
                     num_microbatches=2, seq_len=40, dtype="bf16")  # 40: no activation has a weight's shape
    mp.start_processes(_worker, args=(2, _free_port(), plan.to_dict(), str(tmp_path)), nprocs=2,
                       start_method="fork", join=True)
    rec = torch.load(tmp_path / "rec.pt")
    # at most the layer whose backward starts and one prefetched; autocast over fp32 shards held all LAYERS
    assert max(rec["held"]) <= 2 * rec["layer_bytes_16bit"], rec
    # bf16 parameters in the forward instead of autocast's per-op casts: the same training within bf16 rounding
    assert rec["losses"] == pytest.approx(_reference_losses(plan), abs=2e-2)
