"""Planned-launch test worker: records its remapped place, then checks it with a real gloo all_reduce.

Usage: plan_worker.py OUT_DIR   -> OUT_DIR/rank<RANK>.json (RANK as remapped by tangram_launch.launch.boot)
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tangram_launch.worker import current_plan, in_tangram_launch


def main() -> None:
    out_dir = sys.argv[1]
    me = current_plan()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env://, with the remapped RANK
    t = torch.tensor([2.0 ** rank])
    dist.all_reduce(t)  # sum of 2**r over all ranks: 2**world - 1 only if every rank is distinct and present
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, [rank, me.node, me.local_gpu])
    record = {
        "env": {k: v for k, v in os.environ.items() if k.startswith("TANGRAM_") or k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")},
        "in_tangram_launch": in_tangram_launch(),
        "dist_rank": dist.get_rank(),
        "all_reduce": t.item(),
        "places": places,
        "stage": me.stage, "layers": list(me.layers), "island": me.island,
        "place_stage": me.place.stage.index, "place_layers": list(me.place.layers),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
