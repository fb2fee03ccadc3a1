"""The profiler's like groups (worker._like_groups), on a real gloo process group of 4 ranks as 2 "nodes": one of a
single rank, one of two fast ranks and a slow one between them. Every rank creates every group in the same order
(new_group is collective over the world), the fast pair gets its own group, and the small collectives run over it
while the other ranks wait (no rank blocks on a group it is not in)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from profiler import bench
from profiler.worker import RankEnv, _like_groups, _small_collectives
from test_adapter_torch import _free_port

# global rank -> GEMM TFLOP/s: node 0 (rank 0); node 1 (ranks 1-3): fast, slow (a third), fast
SPEEDS = {0: 1.0, 1: 1.0, 2: 0.33, 3: 1.05}
NODES = {0: [0], 1: [1, 2, 3]}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    node = next(n for n, ranks in NODES.items() if rank in ranks)
    env = RankEnv(rank=rank, world_size=world, local_rank=NODES[node].index(rank),
                  local_world_size=len(NODES[node]), node_rank=node)
    cfg = bench.BenchConfig.for_device("cpu", quick=True)
    run = SimpleNamespace(env=env, cfg=cfg, device=torch.device("cpu"),
                          progress=SimpleNamespace(phase=lambda *_: None))
    layout = SimpleNamespace(node_ranks=sorted(NODES), ranks_of=NODES)
    gemm = {d: bench.Measured(SPEEDS[rank] * (2.0 if d == "bf16" else 1.0), "TFLOP/s", bench.Timing((1.0,)))
            for d in cfg.gemm_dtypes}
    like = _like_groups(run, layout, gemm)
    got = {"members": None}
    if like is not None:
        members, group = like
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)  # over the like group only
        latency, wait, fsdp = _small_collectives(run, group, len(members), None, ("fp32",), "test", False)
        got = {"members": list(members), "sum": t.item(), "latency_us": latency.value, "wait": wait,
               "fsdp": fsdp is not None}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_like_groups_form_per_node_class_and_run_their_collectives(tmp_path):
    world = len(SPEEDS)
    mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, start_method="fork",
                       join=True)
    got = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}
    # node 0 holds one rank, and node 1's slow rank is a class of one: no group, the node's figures stand
    assert got[0]["members"] is None and got[2]["members"] is None
    # node 1's fast ranks, within the islands' 15 % (first fit in rank order), past the slow one between them
    assert got[1]["members"] == got[3]["members"] == [1, 3]
    assert got[1]["sum"] == got[3]["sum"] == 4.0  # the all-reduce ran over the pair alone
    for r in (1, 3):
        assert got[r]["latency_us"] > 0 and got[r]["wait"] is None  # no layer to run before it here
        assert got[r]["fsdp"]  # FSDP2's probe ran over the pair
