"""MoE in the torch runtime against a single-process reference: real gloo processes, fp32, exact to fp tolerance.

The routed token group (whose tokens share the experts' capacity and the auxiliary losses) is one micro-batch of one
data-parallel replica: ``micro_batch_size`` consecutive rows of the global batch. The reference therefore runs the
whole model over the same row groups one after the other, accumulates their gradients and divides by the number of
groups (what the pipeline schedule and the data-parallel all-reduce do), so it drops the same tokens and adds the
same load-balancing and z-losses as the distributed run. Every case: 2 steps, then the losses and every parameter
(experts gathered by global index from the ranks that hold them) must equal the reference's.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers_plans import make_plan
from runtime_adapters.expert_parallel import expert_layout, local_experts
from runtime_adapters.gpt import build_model, lm_loss
from runtime_adapters.moe import MoEFFN, route
from runtime_adapters.torch_native import TorchAdapter
from tangram_launch.capabilities import TORCH, StageShape
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.plan import Plan
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec
from test_adapter_torch import _free_port, _sgd
from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S

STEPS = 2
SEED = 5


def _moe(**changes) -> dict:
    d = load_model("tiny-moe").to_dict()
    d.update(changes)
    return d


def _with_losses(plan: Plan, aux: float = 0.1, z: float = 0.01) -> Plan:
    """Larger auxiliary-loss coefficients than the defaults, so a wrong aux gradient shows beyond tolerance."""
    d = plan.to_dict()
    d["training"].update(moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    return Plan.from_dict(d)


def _batches(plan: Plan) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    gb, seq = plan.training["global_batch"], plan.training["seq_len"]
    return [torch.randint(0, plan.model["vocab_size"], (gb, seq + 1), generator=g) for _ in range(STEPS)]


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    for name, plan_dict in cases:
        plan = Plan.from_dict(plan_dict)
        ctx = TorchAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                   optimizer_factory=_sgd)
        losses = []
        for i, b in enumerate(_batches(plan)):
            losses.append(ctx.train_step(b))
            if i == 0:
                ctx.moe_stats()  # reset: step 1 also ran the pipeline's shape inference
        stats = ctx.moe_stats()  # of the last step (collective)
        experts = sorted({e for m in ctx.module.moe_layers() for e in m.local_experts})
        torch.save({"losses": losses, "state": ctx.global_state_dict(), "experts": experts, "stats": stats},
                   os.path.join(out_dir, f"{name}-rank{rank}.pt"))
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def _reference(plan: Plan) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """The whole model, one routed group (micro-batch of a replica) at a time; returns losses, parameters, and the
    assignments dropped in the last step."""
    model = build_model(plan.model, seed=SEED)
    model.set_compute_dtype({"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.training["dtype"]))
    model.set_moe_losses(aux_loss_coeff=plan.training["moe_aux_loss_coeff"],
                         z_loss_coeff=plan.training["moe_z_loss_coeff"])
    opt = _sgd(list(model.parameters()))
    rows = plan.stages[0].micro_batch_size
    losses = []
    for b in _batches(plan):
        groups = b.split(rows)
        step_losses = []
        for g in groups:
            loss = lm_loss(model(g[:, :-1]), g[:, 1:])
            loss.backward()
            step_losses.append(loss.item())
        for p in model.parameters():
            p.grad /= len(groups)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
        if len(losses) < STEPS:
            for m in model.moe_layers():
                m.stats.reset()
    dropped = sum(m.stats.dropped for m in model.moe_layers())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, dropped


def _run_and_compare(world: int, cases: dict[str, Plan], tmp_path) -> dict[str, int]:
    mp.start_processes(_worker, args=(world, _free_port(), [(n, p.to_dict()) for n, p in cases.items()],
                                      str(tmp_path)), nprocs=world, start_method="fork", join=True)
    drops = {}
    for name, plan in cases.items():
        ref_losses, ref_state, drops[name] = _reference(plan)
        tol = 2e-5 if plan.training["dtype"] == "fp32" else 2e-3  # autocast: same ops, fp16 rounding
        got: dict[str, torch.Tensor] = {}
        for r in range(world):
            rec = torch.load(tmp_path / f"{name}-rank{r}.pt")
            assert rec["losses"] == pytest.approx(ref_losses, abs=tol), name
            spec = ModelSpec.from_dict(plan.model)  # the last step routed every token top_k times in every MoE layer
            assert rec["stats"]["routed"] == (plan.training["global_batch"] * plan.training["seq_len"] * spec.top_k
                                              * spec.num_moe_layers), name
            assert rec["stats"]["dropped"] == drops[name], name  # the same tokens dropped as in the reference
            for k, v in rec["state"].items():  # replicas (dp, edp) must agree with each other as well
                if k in got:
                    torch.testing.assert_close(v, got[k], atol=tol, rtol=5 * tol, msg=lambda m: f"{name} {k}: {m}")
                got[k] = v
            stage = plan.place(r).stage  # each rank holds its share of the experts (every stage here has MoE)
            assert len(rec["experts"]) == plan.model["num_experts"] // stage.ep, name
        assert set(got) == set(ref_state), f"{name}: {sorted(set(ref_state) ^ set(got))[:4]}"
        for key, ref in ref_state.items():
            torch.testing.assert_close(got[key], ref, atol=tol, rtol=5 * tol, msg=lambda m: f"{name} {key}: {m}")
        init = build_model(plan.model, seed=SEED).state_dict()
        moved = {k: (ref_state[k] - init[k]).abs().max().item() for k in ref_state}
        assert max(moved.values()) > 1e-2, name
        # every routed expert and the router learned something (the comparison is not init == init)
        assert all(v > 0 for k, v in moved.items() if ".mlp.experts." in k or ".mlp.router." in k), name
    return drops


@pytest.mark.distributed
def test_two_ranks_expert_parallel_top1_top2_shared_and_capacity(tmp_path):
    cases = {
        # the tiny-moe preset as it is: top-2 softmax router, dropless, EP=2 over the stage's 2 replicas
        "ep2": _with_losses(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}],
                                      global_batch=8, num_microbatches=2)),
        # full recompute: the all-to-alls run again inside backward, on both ranks alike
        "ep2_recompute": _with_losses(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2,
                                                               "recompute": "full"}],
                                                global_batch=4, num_microbatches=1)),
        # Switch-style top-1 with capacity 1.0: tokens beyond an expert's share are dropped
        "top1_capacity": _with_losses(make_plan(_moe(name="moe-top1", top_k=1, capacity_factor=1.0),
                                                [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}],
                                                global_batch=8, num_microbatches=2)),
        # GShard top-2, every layer MoE except layer 0, a gated shared expert (Qwen2-MoE), capacity 0.75
        "gshard_shared": _with_losses(make_plan(
            _moe(name="moe-gshard", router_type="gshard_top2", moe_layer_frequency=1, dense_layer_indices=[0],
                 num_shared_experts=1, shared_expert_ffn_hidden_size=64, shared_expert_gate=True,
                 capacity_factor=0.75, router_norm_topk=False),
            [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}], global_batch=4, num_microbatches=1)),
        # what the planner picks for tiny-moe on cpu-2: ep 1, experts sharded like any parameter by FSDP2 (ZeRO-3)
        "fsdp_ep1": _with_losses(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "zero_stage": 3}],
                                           global_batch=8, num_microbatches=2)),
        # fp16 autocast with dynamic loss scaling: the auxiliary losses' gradients join at the loss scale
        "fp16_ep2": _with_losses(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}],
                                           global_batch=4, num_microbatches=2, dtype="fp16"), aux=1.0, z=0.1),
        # MoE under pipelining without EP: the auxiliary losses' gradients cross the schedule
        "pp2": _with_losses(make_plan("tiny-moe", [(2, "n0"), (2, "n0")], global_batch=4, num_microbatches=2)),
    }
    drops = _run_and_compare(2, cases, tmp_path)
    assert drops["ep2"] == 0 and drops["top1_capacity"] > 0 and drops["gshard_shared"] > 0, drops


@pytest.mark.distributed
def test_four_ranks_expert_parallel_with_pipeline_and_expert_data_parallel(tmp_path):
    cases = {
        # EP=2 x PP=2: each stage's 2 replicas share its experts; 1F1B interleaves the stages' all-to-alls
        "ep2_pp2": _with_losses(make_plan("tiny-moe", [{"layers": 2, "gpus": "n0", "dp": 2, "ep": 2},
                                                       {"layers": 2, "gpus": "n1", "dp": 2, "ep": 2}],
                                          global_batch=8, num_microbatches=2)),
        # 4 replicas, EP=2: experts averaged over the expert-data-parallel pairs (0, 2) and (1, 3)
        "dp4_ep2_capacity": _with_losses(make_plan(_moe(name="moe-cap", capacity_factor=1.0),
                                                   [{"layers": 4, "gpus": "n0", "dp": 4, "ep": 2}],
                                                   global_batch=8, num_microbatches=1)),
        # EP=4: one expert per rank
        "dp4_ep4": _with_losses(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 4, "ep": 4}],
                                          global_batch=8, num_microbatches=2)),
        # TP=2 of the dense parts (and of a shared expert) x EP=2: each TP coordinate routes and dispatches alike
        "tp2_ep2_shared": _with_losses(make_plan(_moe(name="moe-tp", num_shared_experts=1),
                                                 [{"layers": 4, "gpus": "n0", "tp": 2, "dp": 2, "ep": 2}],
                                                 global_batch=4, num_microbatches=2)),
    }
    drops = _run_and_compare(4, cases, tmp_path)
    assert drops["dp4_ep2_capacity"] > 0


# ------------------------------------------------------------------------------------------------ pure parts
def test_expert_groups_follow_megatron_order():
    from runtime_adapters.megatron_adapter import expert_group

    plan = make_plan("tiny-moe", [{"layers": 2, "gpus": "n0", "dp": 4, "ep": 2},
                                  {"layers": 2, "gpus": "n1", "dp": 4, "ep": 4}], global_batch=8, num_microbatches=2)
    lay = expert_layout(plan)
    assert lay.ep[0] == ((0, 1), (2, 3)) and lay.edp[0] == ((0, 2), (1, 3))
    assert lay.ep[1] == ((4, 5, 6, 7),) and lay.edp[1] == ((4,), (5,), (6,), (7,))
    for r in range(plan.world_size):
        assert any(g == expert_group(plan, r) for g in lay.ep[plan.place(r).stage.index])
    spec = load_model("tiny-moe")
    assert [local_experts(spec, 2, k) for k in (0, 1)] == [range(0, 2), range(2, 4)]
    with pytest.raises(SpecError, match="divide"):
        local_experts(spec, 3, 0)


def test_capacity_keeps_first_choices_before_second_choices():
    spec = ModelSpec.from_dict(_moe(name="cap", capacity_factor=0.5))  # 4 tokens x top-2 / 4 experts -> C = 1
    assert spec.expert_capacity(4) == 1
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0],   # token 0: expert 0, then 1
                           [4.0, 5.0, 0.0, 0.0],   # token 1: expert 1, then 0
                           [5.0, 0.0, 4.0, 0.0],   # token 2: expert 0 (full: token 0 came first), then 2
                           [0.0, 0.0, 0.0, 5.0]])  # token 3: expert 3, then a tie among 0..2
    r = route(logits, spec, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    kept = sorted(zip(r.expert.tolist(), r.token.tolist()))
    assert kept == [(0, 0), (1, 1), (2, 2), (3, 3)] and r.dropped == 4
    assert r.counts.tolist() == [1, 1, 1, 1]
    dropless = route(logits, load_model("tiny-moe"), aux_loss_coeff=0.0, z_loss_coeff=0.0)
    assert dropless.dropped == 0 and dropless.counts.sum() == 8
    # renormalised top-2 weights sum to 1 per token; a uniform router has load-balancing loss 1
    assert torch.allclose(torch.zeros(4).index_add(0, dropless.token, dropless.weight), torch.ones(4))
    flat = route(torch.zeros(8, 4), load_model("tiny-moe"), aux_loss_coeff=0.0, z_loss_coeff=0.0)
    assert flat.load_balancing_loss.item() == pytest.approx(1.0)


def test_moe_model_holds_the_specs_parameters_and_experts_by_global_index():
    from runtime_adapters.gpt import StageModule

    for d in (_moe(), _moe(name="s", num_shared_experts=2, shared_expert_gate=True, router_bias=True,
                           linear_bias=True, moe_layer_frequency=1, dense_layer_indices=[2])):
        spec = ModelSpec.from_dict(d)
        whole = build_model(spec, seed=1)
        assert sum(p.numel() for p in whole.parameters()) == spec.total_params()
        half = StageModule(spec, (0, 4), has_embedding=True, has_head=True, seed=1, experts=range(2, 4))
        full = whole.state_dict()
        for k, v in half.state_dict().items():  # a rank holding experts 2..3 has exactly those weights
            assert torch.equal(v, full[k]), k
        assert {k.split(".")[4] for k in half.state_dict() if ".experts." in k} == {"2", "3"}
        assert len(whole.moe_layers()) == spec.num_moe_layers


def test_spec_and_training_validation_name_the_field():
    for change, field in (({"router_type": "top2"}, "router_type"), ({"router_type": "gshard_top2", "top_k": 1},
                                                                      "top_k"),
                          ({"capacity_factor": 0}, "capacity_factor"), ({"capacity_factor": "big"},
                                                                         "capacity_factor"),
                          ({"router_norm_topk": "yes"}, "router_norm_topk")):
        with pytest.raises(SpecError) as err:
            ModelSpec.from_dict(_moe(**change))
        assert err.value.field == field
    dense = load_model("tiny").to_dict()
    with pytest.raises(SpecError, match="router") as err:
        ModelSpec.from_dict({**dense, "capacity_factor": 1.0})
    assert err.value.field == "capacity_factor"
    assert load_model("tiny").router_type is None and load_model("tiny-moe").router_type == "softmax_topk"
    with pytest.raises(SpecError) as err:
        TrainingSpec(moe_aux_loss_coeff=-1.0)
    assert err.value.field == "moe_aux_loss_coeff"


def test_torch_declares_expert_parallelism_with_all_reduce_only():
    assert TORCH.expert_parallel
    assert TORCH.allows_stage(StageShape(dp=2, ep=2), pipelined=True)
    assert any("ZeRO" in p for p in TORCH.stage_problems(StageShape(dp=2, ep=2, zero_stage=1), pipelined=False))
    plan = make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2, "zero_stage": 3}],
                     global_batch=4, num_microbatches=1)
    with pytest.raises(InfeasibleError) as err:
        TorchAdapter().setup(plan, plan.place(0))
    assert any("ZeRO" in r for r in err.value.reasons) and not dist.is_initialized()
    dense = make_plan("tiny", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}], global_batch=4, num_microbatches=1)
    assert any("needs an MoE model" in p for p in TorchAdapter().plan_problems(dense))
    assert TorchAdapter().plan_problems(make_plan("tiny-moe", [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}],
                                                  global_batch=4, num_microbatches=1)) == []


def test_moe_layer_counts_dropped_tokens():
    spec = ModelSpec.from_dict(_moe(name="c", capacity_factor=0.5))
    layer = MoEFFN(spec, lambda w: torch.nn.Linear(spec.hidden_size, spec.hidden_size))
    layer(torch.randn(2, 8, spec.hidden_size))
    capacity = spec.expert_capacity(16)  # ceil(0.5 * 16 tokens * top-2 / 4 experts) = 4 of 32 assignments each
    assert capacity == 4 and layer.stats.routed == 32 and layer.stats.dropped >= 32 - 4 * capacity


def test_auxiliary_losses_reach_the_router_as_if_added_to_the_loss():
    """The layer attaches coeff * (load balancing) + coeff * (z-loss) to its output; its router gradient must equal
    that of a loss with the two terms added explicitly (and differ from the gradient without them)."""
    import torch.nn.functional as F

    from runtime_adapters.gpt import MLP

    spec = load_model("tiny-moe")
    x = torch.randn(2, 8, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    w = torch.randn(2, 8, spec.hidden_size, generator=torch.Generator().manual_seed(1))

    def router_grad(aux: float, z: float, explicit: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = MoEFFN(spec, lambda width: MLP(spec, width))
        layer.aux_loss_coeff, layer.z_loss_coeff = (0.0, 0.0) if explicit else (aux, z)
        loss = (layer(x) * w).sum()
        if explicit:
            logits = F.linear(x.reshape(-1, spec.hidden_size), layer.router.weight)
            loss = loss + route(logits, spec, aux_loss_coeff=aux, z_loss_coeff=z).aux
        loss.backward()
        return layer.router.weight.grad

    attached, explicit = router_grad(0.5, 0.1, False), router_grad(0.5, 0.1, True)
    torch.testing.assert_close(attached, explicit)
    assert (attached - router_grad(0.0, 0.0, False)).abs().max() > 1e-4


def test_planner_proposes_expert_parallel_plans_the_torch_runtime_runs(cluster_path):
    from test_parallelizers import island, query, shapes_of

    from tangram_launch.islands import build_islands
    from tangram_launch.parallelizers.megatron import MegatronParallelizer
    from tangram_launch.specs.cluster import ClusterSpec

    cpu = build_islands(ClusterSpec.load(cluster_path("cpu-2"))).islands[0]
    queries = {"tiny-moe on cpu-2": query("tiny-moe", cpu, b=2, gb=8, seq=64, dtype="fp32", caps=TORCH),
               "mixtral-8x7b-16l on 8 H100": query("mixtral-8x7b-16l", island("h100-sxm"), b=8, gb=64, seq=4096,
                                                   caps=TORCH)}
    for what, q in queries.items():
        shapes = shapes_of(MegatronParallelizer().query(q))
        assert any(sh.ep > 1 for sh in shapes), what
        assert all(sh.zero_stage == 0 for sh in shapes if sh.ep > 1), what  # what torch runs with EP


def test_megatron_gets_the_router_settings_or_refuses_them():
    from runtime_adapters.megatron_adapter import MegatronAdapter, transformer_config_kwargs

    plan = make_plan(_moe(name="m", capacity_factor=1.25, router_norm_topk=False),
                     [{"layers": 4, "gpus": "n0", "dp": 2, "ep": 2}], global_batch=4, num_microbatches=1,
                     runtime="megatron")
    kw = transformer_config_kwargs(plan, 0)
    assert (kw["moe_expert_capacity_factor"], kw["moe_router_pre_softmax"]) == (1.25, True)
    assert (kw["moe_aux_loss_coeff"], kw["moe_z_loss_coeff"]) == (0.01, 0.001)  # the training config's defaults
    assert "moe_expert_capacity_factor" not in transformer_config_kwargs(
        make_plan("tiny-moe", [(4, "n0")], global_batch=4, num_microbatches=1, runtime="megatron"), 0)
    gshard = make_plan(_moe(name="g", router_type="gshard_top2"), [(4, "n0")], global_batch=4, num_microbatches=1,
                       runtime="megatron")
    assert any("gshard_top2" in p for p in MegatronAdapter().plan_problems(gshard))
