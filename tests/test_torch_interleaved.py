"""Interleaved 1F1B in the torch runtime: real gloo ranks, exact against the single-process reference.

2 ranks, each holding 2 model chunks laid out as the plan says (chunk-major: virtual stage j*S + k on rank k), the
same harness as tests/test_adapter_torch.py (losses and every parameter after 2 steps); then a checkpoint written
under v=2 resumes under v=1 (plain 1F1B) and back, and the three steps equal three steps of the whole model.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_plans import make_plan
from test_adapter_torch import SEED, _batches, _free_port, _run_and_compare, _sgd
from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S
from runtime_adapters.gpt import build_model, lm_loss
from runtime_adapters.interleaved import ChunkedStage, chunk_key_map, chunk_stages
from runtime_adapters.torch_native import TorchAdapter
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.plan import Plan, interleaved_chunks


def interleave(plan: Plan, v: int) -> Plan:
    """The same stages under interleaved 1F1B with ``v`` chunks per stage (the plan's own chunk layout)."""
    chunks = interleaved_chunks([s.num_layers for s in plan.stages], v)
    stages = tuple(replace(s, chunks=c) for s, c in zip(plan.stages, chunks))
    return replace(plan, stages=stages, schedule="interleaved-1F1B", virtual_stages=v)


def test_chunks_hold_the_plans_layers_and_merge_under_global_names():
    plan = interleave(make_plan("tiny", [(2, "n0"), (2, "n0")], global_batch=4, num_microbatches=2), 2)
    assert [c.layers for c in chunk_stages(plan, plan.stages[0])] == [(0, 1), (2, 3)]
    last = chunk_stages(plan, plan.stages[1])
    assert [(c.layers, c.has_embedding, c.has_head) for c in last] == [((1, 2), False, False), ((3, 4), False, True)]
    from runtime_adapters.gpt import StageModule, as_model_spec

    spec = as_model_spec(plan.model)
    parts = [StageModule(spec, c.layers, has_embedding=c.has_embedding, has_head=c.has_head, seed=SEED)
             for c in chunk_stages(plan, plan.stages[0])]
    merged = ChunkedStage(parts)
    names = [n for n, _ in merged.named_parameters()]
    assert len(names) == sum(len(list(p.parameters())) for p in parts) and len(set(names)) == len(names)
    assert {n.split(".")[0] for n in names} == {"embedding", "layers"}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"0", "2"}
    rename = chunk_key_map(plan, plan.stages[0])
    assert rename("layers.2.attn.q.weight") == "layers.2.attn.q.weight"
    with pytest.raises(SpecError, match="holds no part"):
        rename("layers.1.attn.q.weight")  # layer 1 is rank 1's


def test_refuses_chunks_without_layers_before_any_process_group():
    plan = interleave(make_plan("tiny", [(3, "n0"), (1, "n0")], global_batch=4, num_microbatches=2), 2)
    with pytest.raises(InfeasibleError) as err:
        TorchAdapter().setup(plan, plan.place(0))
    assert any("cannot fill 2 virtual stages" in r for r in err.value.reasons), err.value.reasons
    assert not dist.is_initialized()


def test_interleaving_with_expert_parallelism_is_refused_as_a_capability():
    from tangram_launch.capabilities import TORCH

    moe = interleave(make_plan("tiny-moe", [{"layers": 2, "gpus": "n0", "dp": 2, "ep": 2},
                                            {"layers": 2, "gpus": "n1", "dp": 2, "ep": 2}],
                               global_batch=8, num_microbatches=2), 2)
    assert any("without expert parallelism" in p for p in TORCH.plan_problems(moe))  # the planner reads this
    assert any("without expert parallelism" in p for p in TorchAdapter().plan_problems(moe))


@pytest.mark.distributed
def test_two_ranks_interleaved_equal_the_reference(tmp_path):
    cases = {
        "v2_m4": interleave(make_plan("tiny", [(2, "n0"), (2, "n1")], global_batch=8, num_microbatches=4), 2),
        "v2_m2_recompute": interleave(make_plan("tiny", [{"layers": 2, "gpus": "n0", "recompute": "full"},
                                                         {"layers": 2, "gpus": "n1", "recompute": "selective"}],
                                                global_batch=4, num_microbatches=2), 2),
    }
    _run_and_compare(2, cases, tmp_path)


def _resume_worker(rank: int, world: int, port: int, plans: list[dict], out_dir: str) -> None:
    from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    ckpt = os.path.join(out_dir, "ckpt")
    batches = _batches(Plan.from_dict(plans[0]), steps=len(plans))
    losses = []
    for step, d in enumerate(plans):  # one step per layout: save, then resume under the next layout
        plan = Plan.from_dict(d)
        ctx = TorchAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                   optimizer_factory=_sgd)
        state = ctx.checkpoint_state()
        if step:
            load_checkpoint(ckpt, plan=plan, state=state, rng="none")
        losses.append(ctx.train_step(batches[step]))
        save_checkpoint(ckpt, plan=plan, state=state, position=TrainingPosition(step + 1, 0), keep_last=None)
        final = ctx.global_state_dict()
    torch.save({"losses": losses, "state": final}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def resume_through_layouts(plans: list[Plan], tmp_path) -> None:
    """Step i runs under plans[i] after resuming from step i-1's checkpoint (written under plans[i-1]); the
    losses and final parameters must equal len(plans) steps of the whole model."""
    world = plans[0].world_size
    mp.start_processes(_resume_worker, args=(world, _free_port(), [p.to_dict() for p in plans], str(tmp_path)),
                       nprocs=world, start_method="fork", join=True)
    plain = plans[0]
    model = build_model(plain.model, seed=SEED)
    opt = _sgd(list(model.parameters()))
    ref_losses = []
    for b in _batches(plain, steps=len(plans)):
        loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    got = {}
    for r in range(world):
        rec = torch.load(tmp_path / f"rank{r}.pt")
        assert rec["losses"] == pytest.approx(ref_losses, abs=2e-5)
        got.update(rec["state"])
    ref = dict(model.named_parameters())
    assert set(got) == set(ref)
    for k, v in ref.items():  # momentum buffers travelled too: step 3 would differ without them
        torch.testing.assert_close(got[k], v.detach(), atol=2e-5, rtol=1e-4, msg=lambda m: f"{k}: {m}")


@pytest.mark.distributed
def test_checkpoint_from_interleaved_resumes_under_plain_1f1b_and_back(tmp_path):
    plain = make_plan("tiny", [(2, "n0"), (2, "n1")], global_batch=4, num_microbatches=2)
    resume_through_layouts([interleave(plain, 2), plain, interleave(plain, 2)], tmp_path)
