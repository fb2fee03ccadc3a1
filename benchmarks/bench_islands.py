"""Island construction time for 64 ... 2,048 nodes (8 GPUs each).

    python benchmarks/bench_islands.py [--sizes 64,128,256,512,1024,2048] [--repeat 3]

Three cluster shapes:
  fabrics  pods of 32 nodes, each pod on its own InfiniBand fabric (50 GB/s), all nodes on a 100 GbE spine
           (12.5 GB/s), 25 GbE default; pods alternate H100 and A100 nodes. The usual, fabric-described case;
           islands grow with nodes, and "why apart" with islands squared.
  8-pods   the same with 8 pods of nodes/8 nodes: 8 islands whatever the size (growth in nodes alone).
  pairs    as fabrics, plus four measured-looking overrides per pod (50 GB/s +- 4 %) and one degraded link
           (20 GB/s) in every fourth pod, so 8 nodes per pod are no longer interchangeable.
Prints the best of --repeat runs of ``build_islands`` (the ClusterSpec is built outside the timing) as wall
time and as this process's CPU time (steadier on a shared machine), the number of islands, and CPU time per node.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tangram_launch.islands import build_islands  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec  # noqa: E402

POD_NODES = 32


def make_cluster(num_nodes: int, *, overrides: bool, pod_nodes: int = POD_NODES, seed: int = 0) -> ClusterSpec:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(num_nodes)]
    pods = [names[k:k + pod_nodes] for k in range(0, num_nodes, pod_nodes)]
    nodes = [{"name": n, "gpu": ("h100-sxm" if p % 2 == 0 else "a100-80gb"), "count": 8}
             for p, pod in enumerate(pods) for n in pod]
    fabrics = [{"name": f"ib{p}", "nodes": pod, "bandwidth_GBps": 50, "latency_us": 2} for p, pod in enumerate(pods)]
    fabrics.append({"name": "spine", "nodes": names, "bandwidth_GBps": 12.5, "latency_us": 8})
    pairs = []
    if overrides:
        for p, pod in enumerate(pods):
            chosen = rng.sample(pod, 8)
            for a, b in zip(chosen[0::2], chosen[1::2]):
                pairs.append({"nodes": [a, b], "bandwidth_GBps": round(50 * rng.uniform(0.96, 1.04), 2),
                              "latency_us": 2})
            if p % 4 == 0:
                pairs[-1]["bandwidth_GBps"] = 20
    return ClusterSpec.from_dict({"name": f"bench-{num_nodes}", "nodes": nodes, "network": {
        "default": {"bandwidth_GBps": 3.125, "latency_us": 30}, "fabrics": fabrics, "pairs": pairs}})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128,256,512,1024,2048")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'nodes':>6}  {'GPUs':>6}  {'case':<8}  {'islands':>7}  {'wall s':>7}  {'CPU s':>7}  {'CPU us/node':>11}")
    for n in sizes:
        for case in ("fabrics", "8-pods", "pairs"):
            cluster = make_cluster(n, overrides=(case == "pairs"), pod_nodes=n // 8 if case == "8-pods" else POD_NODES)
            wall_s = cpu_s = float("inf")
            for _ in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                iset = build_islands(cluster)
                wall_s = min(wall_s, time.perf_counter() - t0)
                cpu_s = min(cpu_s, time.process_time() - c0)
            print(f"{n:>6}  {cluster.num_gpus:>6}  {case:<8}  {len(iset.islands):>7}  {wall_s:>7.3f}  {cpu_s:>7.3f}  "
                  f"{cpu_s / n * 1e6:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
