"""Two gloo ranks on this host: what each collective costs as training meets it, beside the profile's own figures.

    OMP_NUM_THREADS=1 python benchmarks/bench_collective_after_compute.py [--reps 400] [--json FILE]

1. Bus bandwidth (nccl-tests convention, profiler.bench.busbw_factor) of an all-reduce, a reduce-scatter and an
   all-gather on 1, 8 and 32 MiB buffers, each call after a barrier, median of 12: the profile times the 32 MiB
   point of each (profiler.bench.collective_busbw_gbps), and gloo runs the other two well below the all-reduce.
2. A tiny all-to-all right after T ms of GEMMs on both ranks (no barrier between, as a training step meets its
   collectives), for T from 0.5 to 16 ms: the mean over calls, the median over blocks of 10 calls of the block's
   mean (the statistic of the profile's collective_wait_us, measured after one layer forward) and the median call:
   whether the wait depends on the compute before the collective, which the profile measures after one short
   layer forward only.

Prints one table per part; exit 0. Figures vary with the host's load: compare rows of one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profiler import bench  # noqa: E402

SIZES_MIB = (1, 8, 32)
COMPUTE_MS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
BLOCK = bench.WAIT_BLOCK


def _bandwidth(world: int) -> dict:
    """The profile's own measurement (profiler.bench.collective_busbw_gbps) at each buffer size."""
    cpu, cfg = torch.device("cpu"), bench.BenchConfig.for_device("cpu", quick=False)
    return {f"{op} {mib} MiB": round(bench.collective_busbw_gbps(
                op, None, world, cpu, dataclasses.replace(cfg, allreduce_bytes=mib * 2**20, comm_reps=12)).value, 3)
            for mib in SIZES_MIB for op in bench.BANDWIDTH_OPS}


def _waits(world: int, reps: int) -> dict:
    """The profile's wait measurement (profiler.bench._tiny_all_to_all_after) after T ms of GEMMs."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ b
        n += 1
    per_ms = n / 200.0
    out = {}
    for ms in COMPUTE_MS:
        k = max(1, round(per_ms * ms))
        samples = bench._tiny_all_to_all_after(lambda: [a @ b for _ in range(k)], None, world, torch.device("cpu"),
                                               reps, warmup=1, warm_compute=True)
        blocks = [statistics.fmean(samples[i:i + BLOCK]) for i in range(0, len(samples) - BLOCK + 1, BLOCK)]
        out[ms] = {"mean_ms": statistics.fmean(samples) * 1e3, "block_median_ms": statistics.median(blocks) * 1e3,
                   "median_ms": statistics.median(samples) * 1e3}
    return out


def _worker(rank: int, world: int, port: int, reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"bandwidth": _bandwidth(world), "waits": _waits(world, reps)}
        queue.put((rank, result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=400, help="all-to-alls per compute length (default 400)")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args.reps, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    print(f"bus bandwidth, GB/s (2 gloo ranks, median of 12 calls after a barrier; load {os.getloadavg()[0]:.2f})")
    for key, value in results[0]["bandwidth"].items():
        print(f"  {key:<24} {value:8.3f}")
    print("tiny all-to-all after T ms of GEMMs on both ranks, ms (rank 0 / rank 1): mean, median of block means, "
          "median call")
    for ms in COMPUTE_MS:
        cells = [results[r]["waits"][ms] for r in (0, 1)]
        print(f"  T {ms:5.1f}  " + "   ".join(
            f"{c['mean_ms']:.3f} / {c['block_median_ms']:.3f} / {c['median_ms']:.3f}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({str(r): v for r, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
