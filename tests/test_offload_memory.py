"""The model states a torch-runtime stage holds at their peak are what the cost model prices: real gloo processes,
the torch adapter, bf16 on CPU (costmodel/memory.py, model_state_bytes; costmodel/breakdown.py, SliceCoster).

FSDP2 (ZeRO 1-2) under the pipeline schedule, which runs a whole-model stage as a one-stage pipeline: every
micro-batch's backward runs without gradient sync and keeps its parameters gathered, and one reduce-scatter follows
the last (torch.distributed.pipelining's PipelineStage). Just before it the rank holds every parameter gathered in 16
bits, every gradient unsharded in fp32 (FSDP2 accumulates in its reduce dtype), its fp32 parameter shard and its
share of Adam's moments: ZeRO-1's states, as the cost model prices any stage that holds them. A whole-model ZeRO-3
stage runs as plain gradient accumulation, each backward resharding and reduce-scattering: when the optimizer step
starts the rank holds its fp32 parameter shard, its fp32 gradient shard and its share of the moments, nothing
gathered (the one unit gathered at a time during a pass is the cost model's working memory, priced apart).

Optimizer offload (runtime_adapters/offload.py) moves only the optimizer: Adam's moments and the fp32 copy of the
parameters they update live on the host, the module's fp32 parameters and gradients stay on the accelerator. On CPU
the accelerator and the host are one memory, so the test counts bytes by role. A stage without data parallelism is
not wrapped, whatever its ZeRO stage: it runs, and is priced, as ZeRO-0.
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
from runtime_adapters.offload import _local
from runtime_adapters.torch_native import default_optimizer_factory
from tangram_launch.capabilities import TORCH
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.plan import Plan
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

KW = dict(global_batch=4, num_microbatches=2, seq_len=32, dtype="bf16")


def _local_bytes(t: torch.Tensor | None) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard), 0 for None."""
    return 0 if t is None else _local(t).nbytes


def _gathered_bytes(module) -> tuple[int, int]:
    """(the 16-bit parameters FSDP2 holds gathered, the unsharded gradients it accumulated) of ``module``'s units.
    FSDP2's per-parameter state is private API: the test reads it only to count bytes (torch is pinned)."""
    from torch.distributed.fsdp import FSDPModule

    params = [fp for m in module.modules() if isinstance(m, FSDPModule)
              for fp in (m._get_fsdp_state()._fsdp_param_group.fsdp_params
                         if m._get_fsdp_state()._fsdp_param_group is not None else ())]
    gathered = sum(fp._unsharded_param.nbytes for fp in params if fp._unsharded_param.untyped_storage().nbytes())
    grads = sum(_local_bytes(fp.unsharded_accumulated_grad) + _local_bytes(fp._unsharded_param.grad) for fp in params)
    return gathered, grads


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, plan, ctx in rank_contexts(rank, world, port, cases, optimizer_factory=default_optimizer_factory):
        opt, module = ctx.optimizer, ctx.module  # AdamW: two moments per parameter
        seen = {"gathered": 0, "gradients": 0}
        # this test's own instances are wrapped to look at the peak: the runtime is not changed
        whole_zero3 = plan.num_stages == 1 and plan.stages[0].zero_stage == 3
        if isinstance(module, FSDPModule) and not whole_zero3:  # just before the step's one reduce-scatter
            sync = module.set_requires_gradient_sync

            def look(requires: bool, *args, **kwargs):
                if requires:
                    seen["gathered"], seen["gradients"] = _gathered_bytes(module)
                return sync(requires, *args, **kwargs)

            module.set_requires_gradient_sync = look
        else:  # no FSDP2, or ZeRO-3 resharding after each backward: what the optimizer step finds
            step = opt.step

            def look_step(*args, **kwargs):
                seen["gradients"] = sum(_local_bytes(p.grad) for p in module.parameters())
                if isinstance(module, FSDPModule):  # nothing left gathered, no unsharded gradient kept
                    seen["gathered"], unsharded = _gathered_bytes(module)
                    seen["gradients"] += unsharded
                return step(*args, **kwargs)

            opt.step = look_step
        for b in _batches(plan, steps=2):
            ctx.train_step(b)
        moments = sum(_local_bytes(t) for s in opt.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        offload = ctx.place.stage.offload
        seen.update(shards=sum(_local_bytes(p) for p in module.parameters()), moments=0 if offload else moments,
                    host=sum(_local_bytes(p) for p in opt.host_params) + moments if offload else 0,
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
def test_a_stage_holds_at_its_peak_the_model_states_the_cost_model_prices(tmp_path):
    one = {"layers": 4, "gpus": "n0", "dp": 2}
    cases = {f"zero{z}{'_offload' * off}": make_plan("tiny", [{**one, "zero_stage": z, "offload": off}], **KW)
             for z in (1, 2, 3) for off in (False, True)}
    cases["zero3_dp1_two_stages_offload"] = make_plan(
        "tiny", [{"layers": 2, "gpus": "n0", "zero_stage": 3, "offload": True},
                 {"layers": 2, "gpus": "n1", "zero_stage": 3, "offload": True}], **KW)
    mp.start_processes(_worker, args=(2, _free_port(), [(n, p.to_dict()) for n, p in cases.items()], str(tmp_path)),
                       nprocs=2, start_method="fork", join=True)
    for name, plan in cases.items():
        for rank in range(2):
            seen = json.loads((tmp_path / f"{name}-{rank}.json").read_text())
            bd = _priced(plan, seen["stage"])
            held = seen["gathered"] + seen["gradients"] + seen["shards"] + seen["moments"]
            priced = bd["parameters_bytes"] + bd["gradients_bytes"] + bd["optimizer_bytes"]
            assert held > 0 and priced == pytest.approx(held, rel=1e-6), (name, rank, seen, bd)
            if plan.stages[seen["stage"]].offload:
                # Adam's two moments and the fp32 copy they update: 8 + 4 bytes per parameter this rank updates
                assert bd["optimizer_bytes"] == 0.0 and seen["host"] == pytest.approx(3 * seen["shards"], rel=1e-6)
                assert bd["host_offload_bytes"] == pytest.approx(seen["host"], rel=1e-6), (name, rank, seen, bd)


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
