"""Optimizer offload keeps what the cost model prices where it prices it: real gloo processes, the torch adapter,
bf16 on CPU (runtime_adapters/offload.py; costmodel/memory.py, model_state_bytes).

The torch runtime offloads the optimizer only: its state (Adam's moments) and the fp32 parameter copy it updates
live on the host, while the module's fp32 parameters and gradients stay on the accelerator under their ZeRO
sharding (FSDP2). On CPU the accelerator and the host are one memory, so the test counts bytes by role: the module's
parameters (their local shards), their gradients when the optimizer step reads them, and the offloaded optimizer's
tensors. A stage without data parallelism is not wrapped, whatever its ZeRO stage: the cost model prices it as ZeRO-0.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_adapter_torch import _batches, _free_port, rank_contexts
from test_costmodel_runtime_variants import _island

from helpers_plans import make_plan
from runtime_adapters.torch_native import default_optimizer_factory
from tangram_launch.capabilities import TORCH
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.plan import Plan
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

KW = dict(global_batch=4, num_microbatches=2, seq_len=32, dtype="bf16")


def _local_bytes(t: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    return (t.to_local() if isinstance(t, DTensor) else t).nbytes


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    for name, plan, ctx in rank_contexts(rank, world, port, cases, optimizer_factory=default_optimizer_factory):
        opt = ctx.optimizer  # AdamW: two moments per parameter
        seen = {}
        step = opt.step

        def counted_step(*args, **kwargs):  # the gradients as the offloaded optimizer finds them
            seen["gradients"] = sum(_local_bytes(p.grad) for p in ctx.module.parameters())
            return step(*args, **kwargs)

        opt.step = counted_step  # this test's own instance: the runtime is not changed
        for b in _batches(plan, steps=2):
            ctx.train_step(b)
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        seen.update(parameters=sum(_local_bytes(p) for p in ctx.module.parameters()),
                    host=sum(_local_bytes(p) for p in opt.host_params) + sum(_local_bytes(t) for t in state),
                    stage=ctx.place.stage.index)
        with open(os.path.join(out_dir, f"{name}-{rank}.json"), "w") as f:
            json.dump(seen, f)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def _priced(plan: Plan, stage: int) -> dict:
    """The cost model's model-state bytes of one of ``plan``'s stages, per GPU."""
    s = plan.stages[stage]
    tr = TrainingSpec(global_batch=KW["global_batch"], seq_len=KW["seq_len"], dtype=KW["dtype"])
    q = SliceQuery(model=ModelSpec.from_dict(plan.model), training=tr, layers=tuple(s.layers),
                   island=_island("h100-sxm"), microbatch_sequences=s.micro_batch_size * s.dp,
                   capabilities=TORCH, pipelined=plan.num_stages > 1)
    coster = SliceCoster(q)
    cfg = ParallelConfig(tp=1, pp=1, dp=s.dp, zero_stage=s.zero_stage, recompute=s.recompute, offload=s.offload)
    _numbers, bd = coster.stage_numbers(coster.stage_sums(1, 1, s.dp, 1, 1)[0], cfg)
    return bd


@pytest.mark.distributed
def test_offloaded_stages_keep_parameters_and_gradients_and_send_the_optimizer_to_the_host(tmp_path):
    one = {"layers": 4, "gpus": "n0", "dp": 2, "offload": True}
    cases = {**{f"zero{z}_dp2": make_plan("tiny", [{**one, "zero_stage": z}], **KW) for z in (1, 2, 3)},
             "zero3_dp1_two_stages": make_plan("tiny", [{"layers": 2, "gpus": "n0", "zero_stage": 3, "offload": True},
                                                        {"layers": 2, "gpus": "n1", "zero_stage": 3, "offload": True}],
                                               **KW)}
    mp.start_processes(_worker, args=(2, _free_port(), [(n, p.to_dict()) for n, p in cases.items()], str(tmp_path)),
                       nprocs=2, start_method="fork", join=True)
    for name, plan in cases.items():
        for rank in range(2):
            seen = json.loads((tmp_path / f"{name}-{rank}.json").read_text())
            bd = _priced(plan, seen["stage"])
            assert bd["optimizer_bytes"] == 0.0, (name, bd)
            # Adam's two moments and the fp32 copy they update on the host: 8 + 4 bytes per parameter this rank updates
            assert seen["host"] == pytest.approx(3 * seen["parameters"], rel=1e-6), (name, seen)
            assert bd["host_offload_bytes"] == pytest.approx(seen["host"], rel=0.02), (name, rank, seen, bd)
            # fp32 parameters and gradients on the device: ZeRO-3's shards exactly (and a stage without data
            # parallelism's whole ones); ZeRO 1-2 are priced whole, above FSDP2's shards and the 16-bit parameters
            # it keeps gathered from the forward to the backward (2 bytes each: the test does not count them)
            exact = "zero3" in name
            for key, role in (("parameters_bytes", "parameters"), ("gradients_bytes", "gradients")):
                if exact:
                    assert bd[key] == pytest.approx(seen[role], rel=0.02), (name, rank, role, seen, bd)
                else:
                    assert bd[key] >= seen[role] + (bd["parameters_bytes"] / 4 * 2 if role == "parameters" else 0), (
                        name, rank, role, seen, bd)


@pytest.mark.unit
@pytest.mark.parametrize("offload", [False, True])
def test_a_stage_without_data_parallelism_is_priced_as_the_runtime_runs_it_zero_0(offload):
    """_apply_data_parallel wraps nothing at dp 1 and casts_once_per_step keeps autocast's copies for the step."""
    bds = [_priced(make_plan("tiny", [{"layers": 2, "gpus": "n0", "zero_stage": z, "offload": offload},
                                      {"layers": 2, "gpus": "n1", "zero_stage": z, "offload": offload}], **KW), 0)
           for z in range(4)]
    keys = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "host_offload_bytes",
            "autocast_held_copies_bytes", "offload_pcie_bytes")
    assert bds[0]["autocast_held_copies_bytes"] > 0
    for bd in bds[1:]:
        assert {k: bd[k] for k in keys} == {k: bds[0][k] for k in keys}
