"""The DeepSpeed adapter against a single-process reference (real gloo processes, fp32), plus its config merge,
partition and topology translation.

DeepSpeed would JIT-compile its CPU shm comm op on first use (46-270 s on a cold cache); training does not use it
and the adapter skips the build. The ranks train with an empty TORCH_EXTENSIONS_DIR of their own, and the tests
check that nothing was built there.
"""
from __future__ import annotations

import json
import logging
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers_plans import make_plan
from timeouts import PROCESS_GROUP_TIMEOUT_S, SUBPROCESS_TIMEOUT_S
from runtime_adapters.deepspeed_adapter import DeepSpeedAdapter, build_config, plan_partition
from runtime_adapters.gpt import build_model, lm_loss
from tangram_launch.errors import InfeasibleError
from tangram_launch.plan import Plan

pytest.importorskip("deepspeed")  # an optional runtime: the extra 'deepspeed' installs it (always in CI)

STEPS = 2


def _sgd(params):
    """SGD with momentum, not Adam: Adam's m/sqrt(v) turns fp-level noise in a near-zero gradient into an O(lr)
    update, so parameters would differ by rounding alone; a linear update keeps the comparison at fp tolerance."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)

SEED = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(plan: Plan) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    gb, seq = plan.training["global_batch"], plan.training["seq_len"]
    return [torch.randint(0, plan.model["vocab_size"], (gb, seq + 1), generator=g) for _ in range(STEPS)]


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, dict]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      TORCH_EXTENSIONS_DIR=os.path.join(out_dir, "torch_extensions"))
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    # the caller owns the default group (several setups in one process): close leaves it to the caller
    dist.init_process_group("gloo", timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    for name, plan_dict in cases:
        plan = Plan.from_dict(plan_dict)
        ctx = DeepSpeedAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                       optimizer_factory=_sgd,
                                       user_config={"gradient_clipping": 0.0, "train_batch_size": 999})
        losses = [ctx.train_step(b) for b in _batches(plan)]
        if ctx.place.coords["dp"] == 0:
            torch.save({"losses": losses, "state": ctx.global_state_dict()},
                       os.path.join(out_dir, f"{name}-stage{ctx.place.stage.index}.pt"))
        ctx.close()
    dist.barrier()
    dist.destroy_process_group()


def _reference(plan: Plan):
    model = build_model(plan.model, seed=SEED)
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
    # no JIT build: DeepSpeed's shm comm op (inference only) is skipped on CPU, so a cold cache costs nothing
    assert not (tmp_path / "torch_extensions").exists() or not os.listdir(tmp_path / "torch_extensions")
    for name, plan in cases.items():
        ref_losses, ref_state = _reference(plan)
        got = {}
        for s in range(plan.num_stages):
            rec = torch.load(tmp_path / f"{name}-stage{s}.pt")
            assert rec["losses"] == pytest.approx(ref_losses, abs=2e-5), name
            got.update(rec["state"])
        assert set(got) == set(ref_state), name
        for key, ref in ref_state.items():
            torch.testing.assert_close(got[key], ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.distributed
def test_two_ranks_uneven_noncontiguous(tmp_path):
    # 3 + 1 layers; stage 0 on node n1, stage 1 on n0; full recompute on stage 0 (activation_checkpoint_interval)
    plan = make_plan("tiny", [{"layers": 3, "gpus": "n1", "recompute": "full"}, (1, "n0")],
                     global_batch=4, num_microbatches=2, runtime="deepspeed")
    assert plan.rank_layout[0].node == "n1"
    _run_and_compare(2, {"uneven": plan}, tmp_path)


@pytest.mark.distributed
def test_four_ranks_stages_times_dp_zero1(tmp_path):
    plan = make_plan("tiny", [{"layers": 1, "gpus": "n0", "dp": 2, "zero_stage": 1},
                              {"layers": 3, "gpus": "n1", "dp": 2, "zero_stage": 1}],
                     global_batch=8, num_microbatches=2, runtime="deepspeed")
    _run_and_compare(4, {"pp2_dp2_zero1": plan}, tmp_path)


@pytest.mark.distributed
def test_close_destroys_the_groups_that_setup_created(tmp_path):
    """A worker that exits with its gloo groups alive aborts now and then at exit (exit code -6, and the launcher
    reports the finished run as failed): close destroys the default group when setup created it, and leaves a group
    the caller created to the caller. One gloo rank, in child processes (the default group is per process)."""
    import subprocess
    import sys

    path = tmp_path / "plan.json"
    make_plan("tiny", [(4, "n0")], global_batch=2, num_microbatches=1, runtime="deepspeed").dump(path)
    code = (
        "import json, sys\n"
        "import torch, torch.distributed as dist\n"
        "from runtime_adapters.deepspeed_adapter import DeepSpeedAdapter\n"
        "from tangram_launch.plan import Plan\n"
        "if sys.argv[2] == 'caller':\n"
        "    dist.init_process_group('gloo')\n"
        "plan = Plan.load(sys.argv[1])\n"
        "ctx = DeepSpeedAdapter().setup(plan, timeout_s=60)\n"
        "loss = ctx.train_step(torch.randint(0, plan.model['vocab_size'], (2, plan.training['seq_len'] + 1)))\n"
        "owns = ctx.owns_default_group\n"
        "ctx.close()\n"
        "print(json.dumps({'owns': owns, 'after': dist.is_initialized(), 'loss': loss}))\n"
        "if dist.is_initialized():\n"
        "    dist.destroy_process_group()\n")
    got = {}
    for who in ("setup", "caller"):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                   TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
        res = subprocess.run([sys.executable, "-c", code, str(path), who], env=env, capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S)
        assert res.returncode == 0, res.stderr[-3000:]
        got[who] = json.loads(res.stdout.strip().splitlines()[-1])
    assert {k: (v["owns"], v["after"]) for k, v in got.items()} == {"setup": (True, False), "caller": (False, True)}
    assert all(v["loss"] > 0 for v in got.values())


@pytest.mark.parametrize("stages, missing", [
    ([{"layers": 2, "gpus": "n0", "zero_stage": 3}, {"layers": 2, "gpus": "n1", "zero_stage": 3}],
     "ZeRO stage <= 1 with pipeline parallelism"),
    ([(2, "n0", 1, 1), (2, "n1", 1, 2)], "one (tp, dp, cp) grid"),
    ([{"layers": 4, "gpus": "n0", "recompute": "selective"}], "no 'selective' recompute"),
])
def test_refused_before_any_process_group(stages, missing):
    import torch.distributed as dist

    plan = make_plan("tiny", stages, global_batch=4, num_microbatches=2, runtime="deepspeed")
    with pytest.raises(InfeasibleError) as err:
        DeepSpeedAdapter().setup(plan, plan.place(0))
    assert any(missing in r for r in err.value.reasons), err.value.reasons
    assert not dist.is_initialized()


def test_config_merge_user_wins_unless_it_contradicts_the_plan(tmp_path, caplog):
    plan = make_plan("tiny", [{"layers": 3, "gpus": "n0", "dp": 2, "zero_stage": 1},
                              {"layers": 1, "gpus": "n1", "dp": 2, "zero_stage": 1}],
                     global_batch=8, num_microbatches=4, runtime="deepspeed")
    user = {"gradient_clipping": 1.0, "steps_per_print": 5, "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}, "gradient_accumulation_steps": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    with caplog.at_level(logging.WARNING, logger="runtime_adapters.deepspeed_adapter"):
        cfg = build_config(plan, str(path))
    assert cfg["train_batch_size"] == 8 and cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["gradient_accumulation_steps"] == 4
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert cfg["gradient_clipping"] == 1.0 and cfg["steps_per_print"] == 5
    assert cfg["bf16"] == {"enabled": False} and cfg["fp16"] == {"enabled": False}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "train_micro_batch_size_per_gpu=4" in warned and "zero_optimization.stage=2" in warned
    assert "gradient_accumulation_steps" not in warned  # the user agreed with the plan


def test_partition_and_topology_follow_the_plan():
    pytest.importorskip("deepspeed")
    from runtime_adapters.deepspeed_adapter import plan_topology

    plan = make_plan("tiny", [(3, "n1", 1, 2), (1, "n0", 1, 2)], global_batch=8, num_microbatches=2,
                     runtime="deepspeed")
    assert plan_partition(plan) == [0, 4, 6]  # [emb, l0, l1, l2] | [l3, head]
    topo = plan_topology(plan)
    for r in plan.rank_layout:
        coord = topo.get_coord(r.rank)
        assert (coord.pipe, coord.data, coord.model) == (r.stage, r.dp, r.tp)
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
