"""Configurations per second of the ``megatron`` parallelizer: the inner loop of planning (issue 3).

One query = a 40-layer slice of GPT-3 13B (the paper's §6.4 model, whole model: embedding and head included) on an
8-GPU island, b = 8 sequences per micro-batch, 16 micro-batches, fp16 (V100) / bf16 (A100):

    /work/venv/bin/python benchmarks/bench_parallelizer.py              # V100-32GB node of c3-full-het-ii
    /work/venv/bin/python benchmarks/bench_parallelizer.py --island a100 --reps 20

Each repetition builds a fresh parallelizer and cost model (no cache carried over) and answers the query; the
figure is configurations costed / time, with CPU time (``time.process_time``, one core, robust to other processes
on a shared machine) and wall time, median over repetitions. The V100 island is one node of 8 (c3-full-het-ii); the
A100 island is two 4-GPU nodes (c2-style, HDR InfiniBand) so that multi-node groups are costed too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tangram_launch.capabilities import RuntimeCapabilities  # noqa: E402
from tangram_launch.islands import build_islands  # noqa: E402
from tangram_launch.parallelizers.base import SliceQuery  # noqa: E402
from tangram_launch.parallelizers.megatron import MegatronParallelizer  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec  # noqa: E402
from tangram_launch.specs.model import load_model  # noqa: E402
from tangram_launch.specs.training import TrainingSpec  # noqa: E402


def _island(which: str):
    if which == "v100":
        cluster = ClusterSpec.load(os.path.join(ROOT, "examples", "clusters", "c3-full-het-ii.yaml"))
        return build_islands(cluster, dtype="fp16").by_name("v100-32gb"), "fp16"
    cluster = ClusterSpec.from_dict({
        "name": "a100-2x4",
        "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
        "nodes": [{"name": f"a100-{i}", "gpu": "a100-80gb", "count": 4} for i in range(2)],
    })
    return build_islands(cluster).islands[0], "bf16"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--island", choices=("v100", "a100"), default="v100")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--runtime", default="any", help="capabilities: any | torch | deepspeed | megatron")
    args = parser.parse_args(argv)

    island, dtype = _island(args.island)
    model = load_model("gpt3-13b")
    if args.runtime == "any":
        caps = RuntimeCapabilities(name="any")
    else:
        from tangram_launch.capabilities import capabilities_for

        caps = capabilities_for(args.runtime)
    q = SliceQuery(model=model, training=TrainingSpec(global_batch=128, seq_len=2048, dtype=dtype), layers=(0, 40),
                   island=island, microbatch_sequences=8, capabilities=caps)
    MegatronParallelizer().query(q)  # warm-up: imports, catalog, lru caches of pure helpers
    cpu, wall = [], []
    configs = front = 0
    for _ in range(args.reps):
        par = MegatronParallelizer()
        w0, c0 = time.perf_counter(), time.process_time()
        res = par.query(q)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        configs, front = res.configs_evaluated, len(res.plans)
    c_med, w_med = statistics.median(cpu), statistics.median(wall)
    print(f"megatron parallelizer: gpt3-13b layers 0:40 on {island.name} ({island.num_nodes} x "
          f"{island.gpus_per_node} GPUs), b=8, m=16, {dtype}, runtime '{caps.name}'")
    print(f"  configurations per query : {configs} (Pareto front kept: {front} plans)")
    print(f"  query time (median of {args.reps}): {c_med * 1e3:.1f} ms CPU, {w_med * 1e3:.1f} ms wall")
    print(f"  configurations per second: {configs / c_med:,.0f} (CPU time), {configs / w_med:,.0f} (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
