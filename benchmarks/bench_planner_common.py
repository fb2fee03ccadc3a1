"""Shared pieces of the planner benchmarks (bench_planner*.py): example paths, synthetic clusters, timing."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTERS = os.path.join(REPO, "examples", "clusters")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# GPU types for synthetic clusters of up to 8 islands: each pair differs in compute (> 15 %) or memory (> 10 %)
SWEEP_TYPES = ("b200", "h200", "h100-sxm", "h100-nvl", "a100-80gb", "a100-40gb", "l40s", "v100-32gb")


def cluster_path(name: str) -> str:
    return os.path.join(CLUSTERS, f"{name}.yaml")


def synthetic_cluster(num_islands: int, num_gpus: int):
    """``num_islands`` islands of one GPU type each, ``num_gpus`` in all (8 per node, fewer for tiny islands),
    every node on one 50 GB/s network."""
    from tangram_launch.specs.cluster import ClusterSpec

    per = max(1, num_gpus // num_islands)
    nodes = []
    for k in range(num_islands):
        t = SWEEP_TYPES[k]
        for n in range(max(1, per // 8)):
            nodes.append({"name": f"{t}-{n}", "gpu": t, "count": min(8, per)})
    return ClusterSpec.from_dict({"name": f"sweep-{num_islands}x{num_gpus}",
                                  "network": {"default": {"bandwidth_GBps": 50, "latency_us": 2}}, "nodes": nodes})


def synthetic_parallelizer(model, dtype: str = "fp16"):
    """A synthetic parallelizer whose per-layer time follows each GPU type's peak (so islands differ as real ones
    do) and whose memory follows the model's layer size: it isolates the planner's own cost from a cost model's."""
    from tangram_launch.planner.synthetic import SyntheticParallelizer
    from tangram_launch.specs.catalog import default_catalog

    cat = default_catalog()
    flops = 6.0 * model.layer_forward_flops_per_token(0, 4096) / 3.0 * 4096  # fwd+bwd FLOPs of one layer, 1 seq
    times = {t: flops / (cat.lookup(t).peak_tflops(dtype) * 1e12 * 0.5) for t in SWEEP_TYPES}
    return SyntheticParallelizer(layer_time_s=times, layer_static_bytes=model.layer_params(0) * 18.0,
                                 layer_activation_bytes=4096 * model.hidden_size * 34.0,
                                 embedding_static_bytes=model.embedding_params() * 18.0, shard_static_over_dp=True,
                                 max_stages_per_slice=4)


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_child(args: list[str], timeout_s: float) -> dict:
    """Run ``python <this script> <args>`` and parse the JSON line it prints last (a fresh process per point, so
    each point's peak memory is its own)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout_s:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": time.perf_counter() - t0}
    return json.loads(lines[-1])


def describe_plan(plan) -> str:
    """Compact 'layers@island(tp x dp)' per stage."""
    parts = []
    for s in plan.stages:
        parts.append(f"{s.layers[0]}-{s.layers[1] - 1}@{s.island}(tp{s.tp}xdp{s.dp}"
                     + (f",{s.recompute[:3]}" if s.recompute != "none" else "") + ")")
    return " ".join(parts)
