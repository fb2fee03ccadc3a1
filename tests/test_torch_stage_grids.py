"""Stages with their own (tp, dp) grids in the torch runtime (issue 18): the row routing as data, the 1F1B action
order, and real gloo runs exact against the single-process reference (the harness of tests/test_adapter_torch.py:
losses and every parameter after 2 steps)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from helpers_plans import make_plan
from test_adapter_torch import _run_and_compare
from runtime_adapters.schedule import stage_actions
from runtime_adapters.stage_grid import backward_transfers, check_routes, forward_transfers
from runtime_adapters.torch_native import TorchAdapter


def test_rows_are_resplit_between_two_replicas_and_one():
    plan = make_plan("tiny", [(2, "n0", 1, 2), (2, "n1", 1, 1)], global_batch=8, num_microbatches=2)
    # micro-batch of 4 rows: stage 0 replicas hold [0, 2) and [2, 4); stage 1 (rank 2) holds all 4
    fwd = [(x.src, x.dst, x.lo, x.hi, x.src_offset, x.dst_offset) for x in forward_transfers(plan, 0)]
    assert fwd == [(0, 2, 0, 2, 0, 0), (1, 2, 2, 4, 0, 2)]
    bwd = [(x.src, x.dst, x.lo, x.hi, x.src_offset, x.dst_offset) for x in backward_transfers(plan, 0)]
    assert bwd == [(2, 0, 0, 2, 0, 0), (2, 1, 2, 4, 2, 0)]


def test_one_tp_rank_sends_and_every_tp_rank_receives():
    plan = make_plan("tiny", [(2, "n0", 2, 1), (2, "n1", 1, 2)], global_batch=4, num_microbatches=2)
    # stage 0: one replica on ranks 0, 1 (tp); stage 1: replicas on ranks 2 and 3
    assert [(x.src, x.dst, x.lo, x.hi) for x in forward_transfers(plan, 0)] == [(0, 2, 0, 1), (0, 3, 1, 2)]
    assert [(x.src, x.dst, x.lo, x.hi, x.src_offset) for x in backward_transfers(plan, 0)] == [
        (2, 0, 0, 1, 0), (3, 0, 1, 2, 0), (2, 1, 0, 1, 0), (3, 1, 1, 2, 0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 4, 6])), min_size=2, max_size=4),
       st.sampled_from([1, 2]))
def test_every_receiver_gets_each_of_its_rows_once(grids, microbatches):
    gb = 12 * microbatches * 2  # divisible by every dp drawn
    stages = [{"layers": 1, "gpus": [(f"s{i}", g) for g in range(tp * dp)], "tp": tp, "dp": dp}
              for i, (tp, dp) in enumerate(grids)]
    model = {**make_plan("tiny", [(4, "n0")], global_batch=1, num_microbatches=1).model, "num_layers": len(grids)}
    plan = make_plan(model, stages, global_batch=gb, num_microbatches=microbatches)
    check_routes(plan)  # asserts coverage, order and no overlap for both directions
    for k in range(len(grids) - 1):  # a sender sends only rows it holds
        for x in forward_transfers(plan, k):
            assert plan.topology.coords(x.src).tp == 0
            assert 0 <= x.src_offset and x.src_offset + x.rows <= plan.stages[k].micro_batch_size


def _runs_to_the_end(plan, actions=stage_actions) -> bool:
    """Simulate every rank of the executor: an action runs once every message it receives has been sent (sends
    never block: posted after the action that produced them). True when all ranks finish their actions."""
    topo = plan.topology
    S, M = plan.num_stages, plan.num_microbatches
    todo = {r: list(actions(plan.schedule, topo.stage_of(r), S, M)) for r in range(plan.world_size)}
    sent: set[tuple[int, int, str, int]] = set()  # (src, dst, kind, micro-batch)
    needs = {}
    for r in range(plan.world_size):
        k = topo.stage_of(r)
        needs[r, "F"] = [x.src for x in forward_transfers(plan, k - 1) if x.dst == r] if k else []
        needs[r, "B"] = [x.src for x in backward_transfers(plan, k) if x.dst == r] if k < S - 1 else []
    gives = {}
    for r in range(plan.world_size):
        k = topo.stage_of(r)
        gives[r, "F"] = [x.dst for x in forward_transfers(plan, k) if x.src == r] if k < S - 1 else []
        gives[r, "B"] = [x.dst for x in backward_transfers(plan, k - 1) if x.src == r] if k else []
    progress = True
    while progress:
        progress = False
        for r, acts in todo.items():
            while acts and all((src, r, acts[0][0], acts[0][1]) in sent for src in needs[r, acts[0][0]]):
                kind, m = acts.pop(0)
                sent.update((r, dst, kind, m) for dst in gives[r, kind])
                progress = True
    return not any(todo.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 3])), min_size=2, max_size=4),
       st.integers(1, 6), st.sampled_from(["1F1B", "GPipe"]))
def test_no_rank_waits_forever(grids, microbatches, schedule):
    stages = [{"layers": 1, "gpus": [(f"s{i}", g) for g in range(tp * dp)], "tp": tp, "dp": dp}
              for i, (tp, dp) in enumerate(grids)]
    model = {**make_plan("tiny", [(4, "n0")], global_batch=1, num_microbatches=1).model, "num_layers": len(grids)}
    plan = make_plan(model, stages, global_batch=6 * microbatches, num_microbatches=microbatches, schedule=schedule)
    assert _runs_to_the_end(plan)


def test_the_simulation_detects_a_deadlock():
    """The check above can fail: a first stage that waits for a gradient before sending any activation never
    finishes (its peer needs the activation first)."""
    plan = make_plan("tiny", [(2, "n0", 1, 2), (2, "n1")], global_batch=4, num_microbatches=2, schedule="GPipe")
    assert _runs_to_the_end(plan)

    def backward_first_on_stage_0(schedule, stage, stages, m):
        acts = stage_actions(schedule, stage, stages, m)
        return sorted(acts) if stage == 0 else acts  # ("B", i) sorts before ("F", i)
    assert not _runs_to_the_end(plan, backward_first_on_stage_0)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 2), (4, 6), (1, 3)])
def test_1f1b_actions_run_every_forward_before_its_backward(stages, microbatches):
    for k in range(stages):
        acts = stage_actions("1F1B", k, stages, microbatches)
        assert sorted(acts) == sorted([("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)])
        assert all(acts.index(("F", m)) < acts.index(("B", m)) for m in range(microbatches))
        # at most stages - k micro-batches in flight (1F1B's memory bound)
        live = peak = 0
        for kind, _ in acts:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(stages - k, microbatches)


def test_accepts_per_stage_grids_and_refuses_what_the_executor_does_not_run():
    adapter = TorchAdapter()
    ok = make_plan("tiny", [(2, "n0", 2, 1), (2, "n1", 1, 2)], global_batch=4, num_microbatches=2)
    assert adapter.plan_problems(ok) == []
    moe = make_plan("tiny-moe", [(2, "n0", 1, 2), (2, "n1", 1, 1)], global_batch=4, num_microbatches=2)
    assert any("dense models only" in p for p in adapter.plan_problems(moe))
    from test_torch_interleaved import interleave

    inter = interleave(make_plan("tiny", [(2, "n0", 1, 2), (2, "n1")], global_batch=8, num_microbatches=2), 2)
    assert any("interleaved 1F1B with one (tp, dp, cp) grid" in p for p in adapter.plan_problems(inter))


@pytest.mark.distributed
def test_three_ranks_two_replicas_then_one_and_offload(tmp_path):
    cases = {
        # the first case: stage 0 dp=2 + stage 1 dp=1
        "dp2_dp1": make_plan("tiny", [(3, "n0", 1, 2), (1, "n1", 1, 1)], global_batch=8, num_microbatches=2),
        # the other way round, and ZeRO-3 (FSDP2) on the replicated stage only, recompute differing per stage
        "dp1_dp2_zero": make_plan("tiny", [{"layers": 1, "gpus": "n0", "recompute": "full"},
                                           {"layers": 3, "gpus": "n1", "dp": 2, "zero_stage": 3,
                                            "recompute": "selective"}], global_batch=8, num_microbatches=4),
        "dp2_zero1_dp1_gpipe": make_plan("tiny", [{"layers": 2, "gpus": "n0", "dp": 2, "zero_stage": 1},
                                                  {"layers": 2, "gpus": "n1"}],
                                         global_batch=4, num_microbatches=2, schedule="GPipe"),
        # optimizer offload: ZeRO-3 shards' state on the host on one stage, a whole stage's on the other
        "offload_dp2_zero3_dp1": make_plan("tiny", [{"layers": 2, "gpus": "n0", "dp": 2, "zero_stage": 3,
                                                     "offload": True},
                                                    {"layers": 2, "gpus": "n1", "offload": True}],
                                           global_batch=4, num_microbatches=2),
        # offload under one grid (torch.distributed.pipelining), on the middle stage only
        "offload_one_grid": make_plan("tiny", [(1, "n0"), {"layers": 2, "gpus": "n1", "offload": True}, (1, "n2")],
                                      global_batch=3, num_microbatches=3),
    }
    _run_and_compare(3, cases, tmp_path)


@pytest.mark.distributed
def test_four_ranks_tp_then_dp_and_three_stage_mix(tmp_path):
    cases = {
        # the second case: stage 0 tp=2 + stage 1 dp=2
        "tp2_dp2": make_plan("tiny", [(2, "n0", 2, 1), (2, "n1", 1, 2)], global_batch=8, num_microbatches=2),
        "dp2_tp2": make_plan("tiny", [{"layers": 1, "gpus": "n0", "dp": 2, "recompute": "full"},
                                      {"layers": 3, "gpus": "n1", "tp": 2}], global_batch=4, num_microbatches=2),
        # three stages: dp=2, then one rank, then one rank
        "dp2_1_1": make_plan("tiny", [(1, "n0", 1, 2), (2, "n1", 1, 1), (1, "n2", 1, 1)],
                             global_batch=8, num_microbatches=4),
        "bf16_dp1_dp2_tp1": make_plan("tiny", [(2, "n0"), (1, "n1", 1, 2), (1, "n2")], global_batch=4,
                                      num_microbatches=2, dtype="bf16"),
        # offload of tensor-parallel shards
        "offload_tp2_dp2": make_plan("tiny", [{"layers": 2, "gpus": "n0", "tp": 2, "offload": True},
                                              (2, "n1", 1, 2)], global_batch=4, num_microbatches=2),
    }
    _run_and_compare(4, cases, tmp_path)


@pytest.mark.distributed
def test_checkpoints_move_between_per_stage_grids_and_one_grid(tmp_path):
    from test_torch_interleaved import resume_through_layouts

    plans = [make_plan("tiny", [(3, "n0", 1, 2), (1, "n1")], global_batch=6, num_microbatches=3),
             make_plan("tiny", [(1, "n0"), (2, "n1"), (1, "n2")], global_batch=6, num_microbatches=3),  # one grid
             make_plan("tiny", [(1, "n0"), {"layers": 3, "gpus": "n1", "dp": 2, "zero_stage": 3, "offload": True}],
                       global_batch=6, num_microbatches=3)]
    assert [p.topology.uniform_grid for p in plans] == [False, True, False]
    resume_through_layouts(plans, tmp_path)
