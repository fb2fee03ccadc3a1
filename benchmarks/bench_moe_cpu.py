"""Tokens/s of the MoE tiny model with expert parallelism on 2 CPU ranks, measured against the cost model.

    python benchmarks/bench_moe_cpu.py [--ep 2] [--steps 20] [--global-batch 8] [--seq-len 64] [--micro-batch 1]
        [--model tiny-moe] [--cluster FILE] [--keep DIR] [--json FILE] [--runs N] [--quiet-load L] [--shares N]

1. Profile, for real (unless ``--cluster``): ``tangram-launch profile --standalone --nproc-per-node 2 --quick
   --model M --seq-len S --micro-batch B --layer-dtype fp32``: GEMM rate, memory bandwidth, gloo all-reduce and p2p
   bandwidth, one layer of each kind (dense, MoE: routed, on one process) forward and forward+backward at the
   planned shape, a tiny all-to-all right after that layer's forward on both processes (``collective_wait_us``,
   what each collective of a step costs) and AdamW's cost per parameter tensor (``optimizer_tensor_us``); the
   all-to-all volume is the cost model's own term.
2. Cost one stage of all layers on the two processes, dp 2, ep ``--ep``, ZeRO 0, ``--micro-batch`` sequences per
   replica and micro-batch, through the planner's manual-plan path (the same cost model as every plan). The two
   processes share one host, so their figures differ only by what the host's other work took from each (seen: 1.7x
   in fp32 GEMM rate at load 2-4); they are put in one island with a loose compute tolerance (100 %) rather than be
   split by that noise.
3. Train the plan: ``tangram-launch --standalone --nproc-per-node 2 --plan PLAN examples/train_gpt.py --data
   synthetic`` (torch adapter, EP by all_to_all_single over gloo), median iteration after the first step.
4. Print predicted and measured tokens/s, measured / predicted, the measured routing imbalance (busiest expert's
   load over the mean; the cost model assumes balanced routing), the prediction's breakdown and the load average
   before and after (a shared host: the figures are only comparable at low load).

``--runs N`` repeats 1-4 N times (a fresh profile each time) and prints the ratios' range; ``--quiet-load L``
waits (up to ``--quiet-wait-s``) before each run until the host's 1-minute load average is below L: the host is
shared, and a profile taken during another job's burst costs a training run that did not meet it.

``--shares N`` (default 262144, the most cgroup v1 allows; 0: off): as root on a cgroup-v1 host, the benchmark and
every process it starts (profile and training) run in a ``cpu`` cgroup with that cpu.shares against the 1024 of
any other task, so the host's other work takes less from the two processes' compute (as bench_hetero_cpu.py
does). It cannot stop that work from running while they wait at a collective: the waits still grow with the
load. Seen at load 4.5-6 on 2 cores: measured/predicted 1.00, 1.29, 0.92 (EP=2), 0.82 (EP=1), 0.83 (tiny),
against 0.35-1.23 without the group in the same hour.

Exits 1 when a step fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench_hetero_cpu import CGROUP_ROOT, _env, _write, load_avg  # noqa: E402  (benchmarks/ is the script's folder)


def enter_shares_group(shares: int) -> tuple[str | None, str]:
    """Move this process (and so every process it starts) into a new cgroup-v1 ``cpu`` group with ``shares``
    cpu.shares; (its path, "") or (None, why not)."""
    if not shares:
        return None, "--shares 0"
    if not os.path.isfile(os.path.join(CGROUP_ROOT, "cpu.shares")):
        return None, f"no cgroup-v1 cpu controller at {CGROUP_ROOT}"
    path = os.path.join(CGROUP_ROOT, f"tangram-bench-moe-{os.getpid()}")
    try:
        os.mkdir(path)
        _write(os.path.join(path, "cpu.shares"), shares)
        _write(os.path.join(path, "cgroup.procs"), os.getpid())
    except OSError as exc:
        leave_shares_group(path)
        return None, f"cannot use a cpu cgroup under {CGROUP_ROOT} ({exc}); run as root on a cgroup-v1 host"
    return path, ""


def leave_shares_group(path: str | None) -> None:
    """Back to the root group, then remove ``path`` (empty once the children have exited)."""
    if not path:
        return
    try:
        _write(os.path.join(CGROUP_ROOT, "cgroup.procs"), os.getpid())
        os.rmdir(path)
    except OSError as exc:
        print(f"could not remove {path}: {exc}", file=sys.stderr)


def profile(args, out: str) -> None:
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--standalone", "--nproc-per-node", "2", "--quick",
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--layer-dtype", "fp32", "-o", out]
    subprocess.run(cmd, check=True, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=600)


def cost(args, cluster_path: str):
    from tangram_launch.islands import IslandTolerances, build_islands
    from tangram_launch.planner import PlannerOptions
    from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.load(cluster_path)
    model = load_model(args.model)
    training = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32", optimizer="adamw",
                            grad_dtype="fp32")
    iset = build_islands(cluster, IslandTolerances(compute=1.0), dtype="fp32")
    if len(iset.islands) != 1:
        raise SystemExit(f"the two processes did not form one island: {[i.name for i in iset.islands]}")
    b = 2 * args.micro_batch  # sequences per micro-batch over both replicas
    opts = PlannerOptions(microbatch_sequences=(b,), max_workers=1, progress=False)
    manual = parse_manual_plan({"stages": [{"layers": [0, model.num_layers], "island": iset.islands[0].name,
                                            "tp": 1, "dp": 2, "ep": args.ep, "zero_stage": 0}],
                                "microbatch_sequences": b},
                               num_layers=model.num_layers, island_names=[iset.islands[0].name], source="bench")
    return cost_manual_plan(manual, cluster, model, training, runtime="torch", islands=iset, options=opts)


def cluster_measured(cluster_path: str) -> dict:
    """The island's view of the per-call and per-tensor figures: the largest over the two processes."""
    from tangram_launch.specs.cluster import ClusterSpec

    gpus = [g for n in ClusterSpec.load(cluster_path).nodes for g in n.gpus]
    keys = ("collective_wait_us", "collective_latency_us", "optimizer_tensor_us")
    return {k: max(g.measured[k] for g in gpus) for k in keys if all(k in (g.measured or {}) for g in gpus)}


def train(args, plan_path: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2", "--plan", plan_path,
           os.path.join(REPO, "examples", "train_gpt.py"), "--steps", str(args.steps), "--data", "synthetic",
           "--quiet", "--out", out]
    proc = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> bool:
    """Wait until the 1-minute load average is below ``max_load`` (None: do not wait); False on timeout."""
    if max_load is None:
        return True
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= max_load:
        if time.monotonic() > deadline:
            return False
        time.sleep(5.0)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per replica and micro-batch")
    p.add_argument("--cluster", help="reuse this profile instead of profiling")
    p.add_argument("--keep", help="keep the profile, plan and results in this folder")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--runs", type=int, default=1, help="independent profile + train runs")
    p.add_argument("--quiet-load", type=float, help="before each run, wait for a 1-minute load average below this")
    p.add_argument("--quiet-wait-s", type=float, default=300.0)
    p.add_argument("--shares", type=int, default=262144,
                   help="cpu.shares of a cgroup the benchmark runs in (root, cgroup v1; 0: none)")
    args = p.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")
    if args.shares < 0 or args.shares == 1:
        raise SystemExit(f"--shares must be 0 (off) or 2..262144, got {args.shares}")
    group, why = enter_shares_group(args.shares)
    print(f"in cpu cgroup {group} (cpu.shares {args.shares})" if group else f"no cpu cgroup: {why}")
    try:
        return _main(args)
    finally:
        leave_shares_group(group)


def _main(args) -> int:
    top = args.keep or tempfile.mkdtemp(prefix="bench-moe-")
    runs = []
    for r in range(args.runs):
        quiet = wait_for_quiet(args.quiet_load, args.quiet_wait_s)
        if not quiet:
            print(f"run {r + 1}: the load average stayed >= {args.quiet_load} for {args.quiet_wait_s:.0f} s; "
                  f"running anyway")
        work = top if args.runs == 1 else os.path.join(top, f"run-{r + 1}")
        runs.append(one_run(args, work))
    if args.runs > 1:
        ratios = [f["measured_over_predicted"] for f in runs]
        print(f"{args.runs} runs: measured/predicted " + ", ".join(f"{x:.2f}" for x in ratios)
              + f" (range {min(ratios):.2f}-{max(ratios):.2f}); load average at start "
              + ", ".join(f"{f['load_before'][0]:.1f}" for f in runs))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(runs[0] if args.runs == 1 else runs, f, indent=1)
    return 0


def one_run(args, work: str) -> dict:
    os.makedirs(work, exist_ok=True)
    load_before = load_avg()
    cluster_path = args.cluster or os.path.join(work, "cluster.yaml")
    if not args.cluster:
        profile(args, cluster_path)
    plan = cost(args, cluster_path)
    plan_path = os.path.join(work, f"plan-ep{args.ep}.json")
    plan.dump(plan_path)
    result = train(args, plan_path, os.path.join(work, "train.json"))
    predicted, measured = plan.predicted.tokens_per_s, result["tokens_per_s"]
    s = plan.stages[0]
    figures = {"model": args.model, "ep": args.ep, "dp": s.dp, "micro_batch": s.micro_batch_size,
               "num_microbatches": plan.num_microbatches, "predicted_tokens_per_s": predicted,
               "measured_tokens_per_s": measured, "measured_over_predicted": measured / predicted,
               "predicted_iteration_s": plan.predicted.iteration_time_s,
               "measured_iteration_s": result["median_iteration_s"], "breakdown": dict(plan.predicted.breakdown),
               "losses": [result["losses"][0], result["losses"][-1]], "moe_routing": result.get("moe"),
               "load_before": load_before, "cpu_shares": args.shares,
               "load_after": load_avg(), "work": work}
    print(f"{args.model}: 1 stage, dp {s.dp}, ep {args.ep}, {plan.num_microbatches} micro-batches of "
          f"{s.micro_batch_size} x {args.seq_len} tokens per replica")
    print(f"predicted {predicted:,.0f} tokens/s ({plan.predicted.iteration_time_s * 1e3:.1f} ms/iteration); measured "
          f"{measured:,.0f} tokens/s ({result['median_iteration_s'] * 1e3:.1f} ms, median of steps 2-{args.steps}); "
          f"measured/predicted {measured / predicted:.2f}")
    moe = result.get("moe") or {}
    if moe:  # the cost model assumes balanced routing (factor 1.0) and no drops
        print(f"routing measured: busiest expert {moe['expert_load_max_over_mean']:.2f}x the mean load (the cost "
              f"model assumes 1.00), {moe['dropped_fraction']:.1%} dropped")
    print("prediction breakdown (s): " + ", ".join(f"{k} {v:.4f}" for k, v in plan.predicted.breakdown.items()))
    ps = plan.predicted.stages[0]
    m = cluster_measured(cluster_path)
    print(f"per micro-batch: forward {ps.forward_s * 1e3:.1f} ms, backward {ps.backward_s * 1e3:.1f} ms; measured "
          f"on the host: collective after a layer {m.get('collective_wait_us', float('nan')):.0f} us, after a GEMM "
          f"{m.get('collective_latency_us', float('nan')):.0f} us, AdamW {m.get('optimizer_tensor_us', float('nan')):.0f}"
          f" us per parameter tensor")
    figures["measured_on_host"] = m
    print(f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}; load average {load_before} -> "
          f"{figures['load_after']}; files in {work}")
    return figures


if __name__ == "__main__":
    sys.exit(main())
