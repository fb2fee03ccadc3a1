"""What a throttled CPU "device" pays per collective, measured with the torch profiler.

    python benchmarks/bench_throttled_collectives.py [--quota 0.33] [--periods-us 100000 10000 3000] [--iters 30]
        [--work-ms 10] [--numel 65536] [--json FILE]

Two gloo ranks stand for bench_stage_grids_cpu.py's two slow devices: both pinned to one CPU, each in its own
cgroup-v1 ``cpu`` group with ``--quota`` of a core per CFS period. Each iteration runs about ``--work-ms`` of
unthrottled compute (a GEMM loop), then one ``all_reduce`` of ``--numel`` fp32 values. ``torch.profiler`` records
every all_reduce on every rank; the run is repeated for each ``--periods-us`` and once unthrottled (the same two
ranks, one core, no quota: 0.5 of it each). The figures per run: the mean and slowest iteration after 3, and the
mean all_reduce time as the profiler saw it on each rank; a uniformly slower device would take 0.5 / quota times
the unthrottled iteration.

Why: with a 100 ms CFS period a throttled rank runs 33 ms and then sleeps up to 67 ms; a collective waits until
both ranks' slots meet, which a GPU that is merely 3x slower never does. The cost model prices the collective by
bandwidth and latency only, so the per-stage-grid plans with a collective per layer (TP) mispredicted most.
Needs root and a writable cgroup-v1 ``cpu`` controller; without it the benchmark says why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_hetero_cpu as base  # noqa: E402  (cgroup helpers)


def worker(rank: int, port: int, iters: int, work_ms: float, numel: int, out: str) -> None:
    """One rank: calibrate the GEMM loop to ``work_ms`` of CPU time, then iterate compute + all_reduce under the
    profiler; write the per-iteration wall times and the profiler's all_reduce figures to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    a = torch.randn(128, 128)
    t0 = time.process_time()
    for _ in range(20):
        a = torch.tanh(a @ a)
    per_gemm_s = (time.process_time() - t0) / 20
    reps = max(1, round(work_ms / 1e3 / per_gemm_s))
    buf = torch.ones(numel)
    dist.barrier()
    iters_s = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            t = time.perf_counter()
            for _ in range(reps):
                a = torch.tanh(a @ a)
            dist.all_reduce(buf)
            iters_s.append(time.perf_counter() - t)
    events = [e for e in prof.key_averages() if "all_reduce" in e.key or "allreduce" in e.key]
    top = max(events, key=lambda e: e.cpu_time_total, default=None)
    result = {"rank": rank, "iteration_s": iters_s, "work_cpu_s": reps * per_gemm_s,
              "profiler_event": top.key if top else None, "profiler_count": top.count if top else 0,
              "all_reduce_mean_s": (top.cpu_time_total / top.count / 1e6) if top and top.count else None}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, period_us: int | None, core: int | None, workdir: str) -> dict:
    """Both ranks in groups with the quota at ``period_us`` (None: unthrottled), pinned to ``core``."""
    made = []
    try:
        for _ in range(2):
            quota = args.quota if period_us else 1.0
            g, why = base.make_groups(quota, period_us or 100_000, 0)
            if g is None:
                raise RuntimeError(why)
            if not period_us:
                base._write(os.path.join(g.slow, "cpu.cfs_quota_us"), -1)
            made.append(g)
        port = _free_port()
        outs = [os.path.join(workdir, f"rank{r}-{period_us}.json") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port),
                                   "--iters", str(args.iters), "--work-ms", str(args.work_ms),
                                   "--numel", str(args.numel), "--out", outs[r]],
                                  env=base._env(), preexec_fn=base._join(made[r].slow, core))
                 for r in range(2)]
        for p in procs:
            if p.wait(timeout=args.timeout_s) != 0:
                raise RuntimeError(f"a worker exited with {p.returncode}")
        ranks = []
        for o in outs:
            with open(o, encoding="utf-8") as f:
                ranks.append(json.load(f))
    finally:
        for g in made:
            g.remove()
    warm = 3
    # the mean, not the median: a 100 ms period runs most iterations at full speed and stalls a few for 67 ms
    it = statistics.mean(x for r in ranks for x in r["iteration_s"][warm:])
    worst = max(x for r in ranks for x in r["iteration_s"][warm:])
    return {"period_us": period_us, "iteration_s": it, "worst_iteration_s": worst, "work_cpu_s": statistics.mean(r["work_cpu_s"] for r in ranks),
            "all_reduce_s": [r["all_reduce_mean_s"] for r in ranks], "event": ranks[0]["profiler_event"],
            "count": ranks[0]["profiler_count"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quota", type=float, default=0.33)
    p.add_argument("--periods-us", type=int, nargs="+", default=[100_000, 10_000, 3_000])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--work-ms", type=float, default=10.0, help="unthrottled CPU time of compute per iteration")
    p.add_argument("--numel", type=int, default=65536, help="fp32 values per all_reduce")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--json")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.port, args.iters, args.work_ms, args.numel, args.out)
        return 0
    g, why = base.make_groups(args.quota, 100_000, 0)
    if g is None:
        print(f"bench_throttled_collectives: skipped: {why}", file=sys.stderr)
        return 0
    g.remove()
    avail = sorted(os.sched_getaffinity(0))
    core = avail[1] if len(avail) >= 2 else None
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="tangram-bench-coll-") as workdir:
        for period in [None] + list(args.periods_us):
            rows.append(run(args, period, core, workdir))
    base_row = rows[0]
    print(f"two ranks on one CPU, quota {args.quota} of a core each, {args.work_ms} ms of compute + one all_reduce "
          f"of {args.numel} fp32 per iteration; load average {base.load_avg()}")
    print(f"{'CFS period':>12}  {'iteration':>10}  {'vs unthrottled':>14}  {'slowest':>9}  "
          f"{'all_reduce (profiler, rank 0 / 1)':>36}")
    for r in rows:
        label = "none" if r["period_us"] is None else f"{r['period_us'] / 1e3:g} ms"
        ar = " / ".join(f"{x * 1e3:7.2f} ms" if x is not None else "-" for x in r["all_reduce_s"])
        print(f"{label:>12}  {r['iteration_s'] * 1e3:8.1f} ms  {r['iteration_s'] / base_row['iteration_s']:13.2f}x"
              f"  {r['worst_iteration_s'] * 1e3:6.1f} ms  {ar:>36}")
    print(f"(profiler event: {rows[0]['event']}, {rows[0]['count']} calls per rank; unthrottled, the two ranks share "
          f"the CPU at 0.5 each; at {args.quota} each a uniformly slower device takes {0.5 / args.quota:.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
