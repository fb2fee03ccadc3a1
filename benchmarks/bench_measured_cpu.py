"""Measured layer costs against a real run: a plan priced from ``profile --model`` layer times, and the same plan
priced by the analytic model, each set beside what the run's ``run-report.json`` measured, per stage.

    sudo python benchmarks/bench_measured_cpu.py [--quota 0.33] [--fast-quota 0] [--period-us 3000] [--model tiny]
        [--seq-len 64] [--global-batch 64] [--micro-batches 2,4,8,16,32] [--layer-budget-s 20] [--steps 30]
        [--cluster FILE] [--keep DIR] [--json FILE]
    sudo python benchmarks/bench_measured_cpu.py --quota 1 ...      # three devices alike (none throttled)

Three CPU processes are the devices, in the groups of ``benchmarks/bench_hetero_cpu.py``: a parent group with raised
cpu.shares holds every process (the host's other work yields to it), and local rank 2 runs in its child ``slow``
whose CFS quota gives it ``--quota`` of a fast device's core share (``--fast-quota``: each fast device's own quota,
0 for none). A CFS quota caps a duty cycle, not a speed: a call shorter than the quota left in its period runs at
full speed, so the period is short (3 ms) and the micro-batches large enough that a layer call lasts milliseconds.
Without a writable cgroup-v1 controller the benchmark says so and runs the three devices unthrottled.

1. Profile, for real: ``tangram-launch profile --standalone --nproc-per-node 3 --model M --seq-len S
   --micro-batch 2,4,8,16,32 --layer-dtype fp32``, each worker moved into its device's group as soon as it appears.
   Every device gets its layer kinds', embedding's and head's forward and forward+backward times at each size.
2. Plan with the torch runtime (any micro-batch size: the cost model interpolates between the measured ones); where
   the planner leaves a device out, the best plan (by the same cost model) that gives every device a stage. The same
   stages, GPUs and grids are priced again by the analytic model alone (the manual-plan path on the cluster with its
   layer times removed), so the two predictions differ only in how layers are priced.
3. Train the plan: ``tangram-launch --standalone --nproc-per-node N --plan P --run-dir D examples/train_gpt.py``
   in the bench group, each worker moved into its device's group as soon as it appears (seconds before its first
   step). The launcher writes ``D/run-report.json``: per stage, the measured median forward and backward per
   micro-batch.
4. Print per stage: predicted (measured-priced), predicted (analytic), measured, and each prediction's error.

Exit status: 0 when it ran (the figures say how well each prediction did), 1 when a step failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_hetero_cpu as base  # noqa: E402  (the cgroup and load helpers; puts the repository on the path)
from tangram_launch.errors import InfeasibleError  # noqa: E402
from tangram_launch.islands import build_islands  # noqa: E402
from tangram_launch.planner import PlannerOptions, make_plan  # noqa: E402
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec  # noqa: E402
from tangram_launch.specs.model import load_model  # noqa: E402
from tangram_launch.specs.training import TrainingSpec  # noqa: E402

REPO = base.REPO
THROTTLED = 2  # local rank (and cluster local GPU index) of the throttled device
LAYER_KEYS = ("layer_forward_s", "layer_forward_backward_s", "layer_activation_bytes")


@dataclasses.dataclass(frozen=True)
class Devices:
    """The benchmark's cgroup-v1 ``cpu`` groups: ``bench`` (every process; cpu.shares above the host's other work)
    and one child per device with its CFS quota (none for an unlimited device)."""

    bench: str
    group_of: dict  # local device index -> its cgroup (absent: stays in bench)

    def remove(self) -> list[str]:
        return base.remove_groups([*self.group_of.values(), self.bench])  # children first


def make_devices(args) -> tuple[Devices | None, str]:
    """Device 2 at ``quota`` of a fast device's speed; devices 0 and 1 at ``fast_quota`` of a core each (0: as much
    as they get), every quota over a period short against one layer's time."""
    slow_quota = args.quota * (args.fast_quota or 1.0)
    groups, why = base.make_groups(slow_quota, args.period_us, args.shares)
    if groups is None:
        return None, why
    devices = Devices(groups.bench, {THROTTLED: groups.slow})
    try:
        for dev in (0, 1):
            if args.fast_quota:
                path = os.path.join(groups.bench, f"device{dev}")
                os.mkdir(path)
                devices.group_of[dev] = path
                base._write(os.path.join(path, "cpu.cfs_period_us"), args.period_us)
                base._write(os.path.join(path, "cpu.cfs_quota_us"), int(args.fast_quota * args.period_us))
    except OSError as exc:
        devices.remove()
        return None, f"cannot create the fast devices' cgroups ({exc})"
    return devices, ""


def _place_workers(root: int, device_of, devices: Devices, done: threading.Event, placed: dict) -> None:
    """Move each worker of ``root``'s process tree into its device's group as soon as it appears (every 20 ms: a
    worker spends seconds importing torch and meeting its peers before its first measured call)."""
    while not done.is_set():
        for pid in base._descendants(root):
            if pid in placed or _env_int(pid, b"LOCAL_RANK") is None:
                continue
            group = devices.group_of.get(device_of(pid))
            try:
                if group is not None:
                    with open(os.path.join(group, "cgroup.procs"), "w") as f:
                        f.write(str(pid))
                placed[pid] = device_of(pid)
            except OSError:
                continue
        done.wait(0.02)


def _env_int(pid: int, name: bytes) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[name]) if name in env else None
    except (OSError, ValueError):
        return None


def run_placed(cmd: list[str], cwd: str, devices: Devices | None, device_of, timeout_s: float, what: str) -> dict:
    """Run ``cmd`` in the bench group, its workers each moved into its device's group; {pid: device} placed."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=base._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=base._join(devices.bench) if devices else None)
    placed: dict[int, int] = {}
    watch = None if devices is None else (lambda done: _place_workers(proc.pid, device_of, devices, done, placed))
    base.wait_watched(proc, watch, timeout_s, what)
    if devices is not None and THROTTLED not in placed.values():
        raise RuntimeError(f"{what}: the throttled device's worker was never found to move into its cgroup")
    return placed


def profile(args, devices: Devices | None, out: str) -> None:
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--standalone", "--nproc-per-node", "3",
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", args.micro_batches,
           "--layer-budget-s", str(args.layer_budget_s), "--layer-dtype", "fp32", "--timeout-s", "300", "-o", out]
    run_placed(cmd, REPO, devices, lambda pid: _env_int(pid, b"LOCAL_RANK"), args.timeout_s, "profile")


def without_layer_times(cluster):
    """The cluster as the analytic model sees it: every measured figure but the layer times."""
    data = cluster.to_dict()
    for node in data["nodes"]:
        for gpu in node["gpus"]:
            for key in LAYER_KEYS:
                (gpu.get("measured") or {}).pop(key, None)
    return ClusterSpec.from_dict(data, source="profile without layer times")


def _manual(layout: list[dict], iset, model, b: int, source: str):
    return parse_manual_plan({"stages": layout, "microbatch_sequences": b}, num_layers=model.num_layers,
                             island_names=[i.name for i in iset.islands], source=source)


def all_devices_plan(cluster, model, training, iset, opts, b_values):
    """The best plan by the measured-priced cost model among those that give each device (island) a stage of its
    own: every split of the layers into one contiguous stage per island, in every island order, at every
    micro-batch size (the manual-plan path prices each like the planner)."""
    names, n, best = [i.name for i in iset.islands], model.num_layers, None
    for order in itertools.permutations(names):
        for cuts in itertools.combinations(range(1, n), len(order) - 1):
            bounds = (0, *cuts, n)
            layout = [{"layers": [bounds[k], bounds[k + 1]], "island": isl} for k, isl in enumerate(order)]
            for b in b_values:
                try:
                    plan = cost_manual_plan(_manual(layout, iset, model, b, "every device"), cluster, model,
                                            training, runtime="torch", islands=iset, options=opts)
                except InfeasibleError:
                    continue
                if best is None or plan.predicted.iteration_time_s < best.predicted.iteration_time_s:
                    best = plan
    return best


def plans(args, cluster_path: str):
    """(measured-priced plan on every device, the same plan priced analytically, a note on how it was chosen)."""
    cluster, model = ClusterSpec.load(cluster_path), load_model(args.model)
    training = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32", optimizer="adamw",
                            grad_dtype="fp32")
    opts, iset = PlannerOptions(max_workers=1, progress=False), build_islands(cluster, dtype="fp32")
    measured = make_plan(cluster, model, training, runtime="torch", islands=iset, options=opts)
    note = "the planner's plan"
    if measured.world_size < 3:
        dropped = "; ".join(d.get("island", "?") for d in measured.islands_dropped)
        b_values = [b for b in range(1, args.global_batch + 1) if args.global_batch % b == 0]
        measured = all_devices_plan(cluster, model, training, iset, opts, b_values)
        note = (f"the planner's plan leaves out {dropped or 'a device'}; the best plan with a stage on every device "
                f"(measured-priced) instead")
    plain = without_layer_times(cluster)
    plain_iset = build_islands(plain, dtype="fp32")
    stages = [{"layers": list(s.layers), "island": s.island, "tp": s.tp, "dp": s.dp, "cp": s.cp,
               "zero_stage": s.zero_stage, "recompute": s.recompute, "micro_batch_size": s.micro_batch_size}
              for s in measured.stages]
    b = measured.stages[0].micro_batch_size * measured.stages[0].dp
    analytic = cost_manual_plan(_manual(stages, plain_iset, model, b, "the measured plan's layout"), plain, model,
                                training, runtime="torch", islands=plain_iset, options=opts)
    same = [(s.layers, s.island, s.gpus) for s in measured.stages] == [(s.layers, s.island, s.gpus)
                                                                       for s in analytic.stages]
    if not same:
        raise RuntimeError("the analytic pricing of the measured plan's layout placed its stages differently")
    return measured, analytic, note


def train(args, plan, devices: Devices | None, workdir: str) -> dict:
    path = os.path.join(workdir, "plan.json")
    plan.dump(path)
    run_dir = os.path.join(workdir, "run")
    cmd = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", str(plan.world_size),
           "--plan", path,
           "--run-dir", run_dir, os.path.join(REPO, "examples", "train_gpt.py"), "--steps", str(args.steps),
           "--data", "synthetic", "--quiet", "--timeout-s", "300"]
    device_of_rank = {e.rank: e.local_gpu for e in plan.rank_layout}
    run_placed(cmd, workdir, devices, lambda pid: device_of_rank.get(_env_int(pid, b"RANK")), args.timeout_s,
               "training run")
    with open(os.path.join(run_dir, "run-report.json"), encoding="utf-8") as f:
        return json.load(f)


def rows(measured_plan, analytic_plan, report) -> list[dict]:
    out = []
    for s, pm, pa, r in zip(measured_plan.stages, measured_plan.predicted.stages, analytic_plan.predicted.stages,
                            report["stages"]):
        got = r["measured"]["forward_s"] + r["measured"]["backward_s"]
        mark = pm.measured or {}
        out.append({"stage": s.index, "island": s.island, "layers": list(s.layers), "tp": s.tp, "dp": s.dp,
                    "micro_batch": s.micro_batch_size, "priced": f"{mark.get('how', '-')} d={mark.get('distance', '-')}",
                    "predicted_measured_s": pm.time_s, "predicted_analytic_s": pa.time_s, "measured_s": got,
                    "error_measured": pm.time_s / got - 1, "error_analytic": pa.time_s / got - 1})
    return out


def format_table(table: list[dict], report, measured_plan, analytic_plan) -> str:
    head = ("stage", "island", "layers", "tp x dp, b", "priced", "pred. measured ms", "pred. analytic ms",
            "measured ms", "err measured", "err analytic")
    lines = [head]
    for r in table:
        a, b = r["layers"]
        lines.append((str(r["stage"]), r["island"], f"{a}-{b - 1}", f"{r['tp']}x{r['dp']}, {r['micro_batch']}",
                      r["priced"], f"{r['predicted_measured_s'] * 1e3:.3f}", f"{r['predicted_analytic_s'] * 1e3:.3f}",
                      f"{r['measured_s'] * 1e3:.3f}", f"{r['error_measured']:+.1%}", f"{r['error_analytic']:+.1%}"))
    it = report["iteration"]["measured_median_s"]
    lines.append(("iteration", "", "", "", "", f"{measured_plan.predicted.iteration_time_s * 1e3:.2f}",
                  f"{analytic_plan.predicted.iteration_time_s * 1e3:.2f}", f"{it * 1e3:.2f}",
                  f"{measured_plan.predicted.iteration_time_s / it - 1:+.1%}",
                  f"{analytic_plan.predicted.iteration_time_s / it - 1:+.1%}"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quota", type=float, default=0.33, help="the throttled device's speed, of a fast device's")
    p.add_argument("--fast-quota", type=float, default=0.0,
                   help="CPU share of each fast device, of one core (0: unlimited, as bench_hetero_cpu.py runs them); "
                        "below 1 the three devices fit the host's two cores and each keeps its speed")
    p.add_argument("--period-us", type=int, default=3000,
                   help="CFS period of the throttled device's cgroup: short against one layer's time, so the quota slows each "
                        "call (a period of 100 ms lets a whole step of the tiny model run at full speed, then wait)")
    p.add_argument("--shares", type=int, default=262144, help="cpu.shares of the benchmark's group")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batches", default="2,4,8,16,32", help="the micro-batch sizes the profile measures")
    p.add_argument("--layer-budget-s", type=float, default=20.0, help="the profile's layer budget per device")
    p.add_argument("--steps", type=int, default=30, help="training steps (the first is left out of the report)")
    p.add_argument("--cluster", help="reuse this profile instead of profiling")
    p.add_argument("--keep", help="keep the profile, plans and run directory here")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)

    devices, why = make_devices(args)
    if devices is None:
        print(f"no throttled device ({why}): the three devices run unthrottled")
    workdir = args.keep or tempfile.mkdtemp(prefix="tangram-bench-measured-")
    os.makedirs(workdir, exist_ok=True)
    try:
        cluster_path = args.cluster or os.path.join(workdir, "cluster.yaml")
        started = time.perf_counter()
        if not args.cluster:
            profile(args, devices, cluster_path)
        profile_s = time.perf_counter() - started
        measured_plan, analytic_plan, note = plans(args, cluster_path)
        measured_plan.dump(os.path.join(workdir, "plan-measured.json"))
        analytic_plan.dump(os.path.join(workdir, "plan-analytic.json"))
        load0 = base.load_avg()
        report = train(args, measured_plan, devices, workdir)
        table = rows(measured_plan, analytic_plan, report)
    except Exception as exc:  # a failed step: say which, exit 1
        print(f"bench_measured_cpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if devices is not None:
            for problem in devices.remove():
                print(problem, file=sys.stderr)
    print(f"{args.model}, seq {args.seq_len}, global batch {args.global_batch}, "
          f"{measured_plan.num_microbatches} micro-batches, {report['steps_measured']} steps measured; device "
          f"local {THROTTLED} " + (f"at {args.quota:.0%} of a fast one's speed (fast: "
                                   f"{f'{args.fast_quota:g} core' if args.fast_quota else 'unlimited'}, CFS period "
                                   f"{args.period_us} us)" if devices else "unthrottled")
          + f"; profile {profile_s:.0f} s; load average {load0} -> {base.load_avg()}")
    print(f"plan: {note}")
    print("per micro-batch, forward + backward (run-report.json medians):")
    print(format_table(table, report, measured_plan, analytic_plan))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"stages": table, "iteration": report["iteration"], "quota": args.quota if devices else None,
                       "workdir": workdir}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
