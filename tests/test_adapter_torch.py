"""The torch adapter against a single-process reference: real gloo processes, fp32, exact to fp tolerance.

Each multi-rank run starts its processes once and trains several plans of the same world size one after the other
(the adapter keeps no global state), so the whole file stays fast. Every case: 2 steps, then the losses and every
updated parameter (gathered by global name across stages and shards) must equal the whole model trained in this
process on the same batches from the same seeded init.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S
from helpers_plans import make_plan
from runtime_adapters.gpt import build_model, lm_loss
from runtime_adapters.groups import group_layout
from runtime_adapters.torch_native import TorchAdapter
from tangram_launch.errors import InfeasibleError
from tangram_launch.plan import Plan

STEPS = 2


def _sgd(params):
    """SGD with momentum, not Adam: Adam's m/sqrt(v) turns fp-level noise in a near-zero gradient into an O(lr)
    update, so parameters would differ by rounding alone; a linear update keeps the comparison at fp tolerance."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)

SEED = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(plan: Plan, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    gb, seq = plan.training["global_batch"], plan.training["seq_len"]
    return [torch.randint(0, plan.model["vocab_size"], (gb, seq + 1), generator=g) for _ in range(steps)]


def rank_contexts(rank: int, world: int, port: int, cases: list[tuple[str, dict]], optimizer_factory=None):
    """This rank's gloo process group, then each case's (name, plan, torch-adapter context: SGD unless
    ``optimizer_factory`` says otherwise, the shared seed)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    for name, plan_dict in cases:
        plan = Plan.from_dict(plan_dict)
        yield name, plan, TorchAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                               optimizer_factory=optimizer_factory or _sgd)


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    for name, plan, ctx in rank_contexts(rank, world, port, cases):
        losses = [ctx.train_step(b) for b in _batches(plan)]
        state = ctx.global_state_dict()
        if ctx.place.coords["dp"] == 0 and ctx.place.coords["tp"] == 0:
            torch.save({"losses": losses, "state": state, "rank": rank},
                       os.path.join(out_dir, f"{name}-stage{ctx.place.stage.index}.pt"))
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def _reference(plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(plan.model, seed=SEED)
    model.set_compute_dtype({"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.training["dtype"]))
    opt = _sgd(list(model.parameters()))
    losses = []
    for b in _batches(plan):
        loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _run_and_compare(world: int, cases: dict[str, Plan], tmp_path) -> None:
    mp.start_processes(_worker, args=(world, _free_port(), [(n, p.to_dict()) for n, p in cases.items()],
                                      str(tmp_path)), nprocs=world, start_method="fork", join=True)
    for name, plan in cases.items():
        ref_losses, ref_state = _reference(plan)
        tol = 2e-5 if plan.training["dtype"] == "fp32" else 2e-3  # autocast: same ops, bf16/fp16 rounding
        got: dict[str, torch.Tensor] = {}
        for s in range(plan.num_stages):
            rec = torch.load(tmp_path / f"{name}-stage{s}.pt")
            assert rec["losses"] == pytest.approx(ref_losses, abs=tol), name
            assert not set(got) & set(rec["state"]), f"{name}: a parameter is on two stages"
            got.update(rec["state"])
        assert set(got) == set(ref_state), name
        for key, ref in ref_state.items():
            torch.testing.assert_close(got[key], ref, atol=tol, rtol=5 * tol, msg=lambda m: f"{name} {key}: {m}")
        # the steps moved the weights far beyond the tolerance (the comparison is not init == init)
        init = build_model(plan.model, seed=SEED).state_dict()
        assert max((ref_state[k] - init[k]).abs().max().item() for k in ref_state) > 1e-2


@pytest.mark.distributed
def test_two_ranks_uneven_stages_noncontiguous_and_tp(tmp_path):
    cases = {
        # 3 + 1 layers, stage 0 on node n1 and stage 1 on n0 (rank 0 is not on the first node), recompute
        "uneven": make_plan("tiny", [{"layers": 3, "gpus": "n1", "recompute": "full"},
                                     {"layers": 1, "gpus": "n0", "recompute": "selective"}],
                            global_batch=4, num_microbatches=2),
        # 1 + 3 under GPipe
        "gpipe": make_plan("tiny", [(1, "n0"), (3, "n0")], global_batch=6, num_microbatches=3, schedule="GPipe"),
        # one stage, tensor parallel 2 (DTensor column/row split)
        "tp2": make_plan("tiny", [(4, "n0", 2, 1)], global_batch=4, num_microbatches=2),
        # mixed precision: bf16 autocast; fp16 autocast with dynamic loss scaling
        "bf16": make_plan("tiny", [(3, "n0"), (1, "n0")], global_batch=4, num_microbatches=2, dtype="bf16"),
        "fp16": make_plan("tiny", [(2, "n0"), (2, "n0")], global_batch=4, num_microbatches=2, dtype="fp16"),
        # the micro-batches share autocast's casts of the DTensor weights (torch_native.casts_once_per_step)
        "tp2_bf16": make_plan("tiny", [(4, "n0", 2, 1)], global_batch=4, num_microbatches=2, dtype="bf16"),
    }
    assert cases["uneven"].rank_layout[0].node == "n1"
    _run_and_compare(2, cases, tmp_path)


@pytest.mark.distributed
def test_four_ranks_stages_times_dp_and_tp(tmp_path):
    cases = {
        "pp2_dp2_ddp": make_plan("tiny", [(2, "n0", 1, 2), (2, "n1", 1, 2)], global_batch=8, num_microbatches=2),
        "pp2_dp2_fsdp": make_plan("tiny", [{"layers": 3, "gpus": "n0", "dp": 2, "zero_stage": 3},
                                           {"layers": 1, "gpus": "n1", "dp": 2, "zero_stage": 1}],
                                  global_batch=8, num_microbatches=2),
        "pp2_tp2": make_plan("tiny", [{"layers": 1, "gpus": "n0", "tp": 2, "recompute": "selective"},
                                      {"layers": 3, "gpus": "n1", "tp": 2}], global_batch=4, num_microbatches=2),
        "tp2_dp2_fsdp": make_plan("tiny", [{"layers": 4, "gpus": "n0", "tp": 2, "dp": 2, "zero_stage": 3}],
                                  global_batch=4, num_microbatches=1),
    }
    _run_and_compare(4, cases, tmp_path)


def test_group_layout_follows_rank_layout():
    plan = make_plan("tiny", [(2, "n0", 2, 2), (2, "n1", 2, 2)], global_batch=8, num_microbatches=2)
    lay = group_layout(plan)
    assert lay.tp[0] == ((0, 1), (2, 3)) and lay.dp[1] == ((4, 6), (5, 7))
    assert lay.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lay.stage_mesh[1] == ((4, 5), (6, 7))
    for r in range(plan.world_size):  # the plan's own view of each rank agrees with the groups built
        place = plan.place(r)
        assert place.pp_group in lay.pp and place.dp_group in lay.dp[place.stage.index]


@pytest.mark.parametrize("stages, missing", [
    # stages with different tp/dp run (tests/test_torch_stage_grids.py), but not with a tp that splits no head
    ([(2, "n0", 2, 1), (2, "n1", 3, 1)], "does not divide num_heads"),
    ([(4, "n0", 3, 1)], "does not divide num_heads"),
])
def test_refused_before_any_process_group(stages, missing):
    plan = make_plan("tiny", stages, global_batch=4, num_microbatches=2)
    adapter = TorchAdapter()
    with pytest.raises(InfeasibleError) as err:
        adapter.setup(plan, plan.place(0))  # no MASTER_ADDR etc.: it must fail before touching the network
    assert any(missing in r for r in err.value.reasons), err.value.reasons
    assert not dist.is_initialized()


def test_accepts_what_it_can_run():
    plan = make_plan("tiny", [{"layers": 3, "gpus": "n0", "dp": 2, "zero_stage": 3},
                              {"layers": 1, "gpus": "n1", "dp": 2, "recompute": "full"}],
                     global_batch=8, num_microbatches=2)
    assert TorchAdapter().plan_problems(plan) == []


def test_stage_parts_compose_to_the_whole_model():
    """Any split builds the same weights: stages chained equal the whole model (GQA, swiglu, rmsnorm, rotary,
    qk-norm and a projected embedding exercised on the way)."""
    from runtime_adapters.gpt import StageModule, as_model_spec
    from tangram_launch.specs.model import load_model

    d = load_model("tiny").to_dict()
    d.update(name="tiny-llama", num_kv_heads=2, ffn_type="swiglu", norm_type="rmsnorm", norm_bias=None,
             position_embedding="rotary", num_position_embeddings=None, qk_norm=True, linear_bias=False,
             embedding_dim=32)
    spec = as_model_spec(d)
    whole = build_model(spec, seed=7)
    parts = [StageModule(spec, (0, 1), has_embedding=True, has_head=False, seed=7),
             StageModule(spec, (1, 3), has_embedding=False, has_head=False, seed=7),
             StageModule(spec, (3, 4), has_embedding=False, has_head=True, seed=7)]
    tokens = torch.randint(0, spec.vocab_size, (2, 16))
    x = tokens
    for p in parts:
        x = p(x)
    assert x.shape == (2, 16, spec.vocab_size)
    torch.testing.assert_close(x, whole(tokens))
    names = {k for p in parts for k in p.state_dict()}
    assert names == set(whole.state_dict()) and "layers.3.mlp.gate.weight" in names
    assert "layers.1.mlp.gate" in parts[1].tensor_parallel_plan()


def test_unsupported_model_is_a_spec_error():
    from runtime_adapters.gpt import as_model_spec
    from tangram_launch.errors import SpecError
    from tangram_launch.specs.model import load_model

    # MoE layers only for runtimes that ask for them (torch does: tests/test_moe_torch.py)
    with pytest.raises(SpecError, match="MoE"):
        as_model_spec(load_model("tiny-moe"))
    assert as_model_spec(load_model("tiny-moe"), moe=True).is_moe
    alibi = {**load_model("tiny").to_dict(), "position_embedding": "alibi", "num_position_embeddings": None}
    plan = make_plan(alibi, [(4, "n0")], global_batch=2, num_microbatches=1)
    assert any("ALiBi" in p for p in TorchAdapter().plan_problems(plan))
