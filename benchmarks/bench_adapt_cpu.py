"""Tokens trained in a fixed wall-clock window while one device is throttled mid-run: static plan, --adapt, oracle.

    sudo python benchmarks/bench_adapt_cpu.py [--window-s 240] [--throttle-at-s 70] [--quota 0.33]
        [--adapt-window 20] [--adapt-horizon 200] [--adapt-threshold 0.15]
        [--model examples/models/bench-cpu.yaml] [--global-batch 12] [--seq-len 32] [--save-every 20]
        [--only static|adapt|oracle ...] [--keep DIR] [--json FILE]

Three CPU processes are three devices of one node (``CPU3``: the figures measured on this machine kind); the run
starts on a three-stage pipeline that puts work on all of them (the planner's plan for three alike devices).
``--throttle-at-s`` seconds after each
launch starts, device 1 is throttled to ``--quota`` of a core, as ``benchmarks/bench_hetero_cpu.py`` throttles: a
cgroup-v1 ``cpu`` group with a CFS quota, every worker process on that device moved into it as it appears (a
restarted worker too). Without a writable cgroup-v1 controller it falls back to stopping and continuing the process
(SIGSTOP/SIGCONT, the same duty cycle in the same period) and says so. The period is 10 ms: a worker whose step
computes for less than a longer period's quota (22 ms a step against 33 ms of every 100 ms) would run at full speed
in most steps and be slowed only in some, which is not a slower device. A worker's device is its
``CUDA_VISIBLE_DEVICES`` entry for its ``LOCAL_RANK`` (the launcher narrows it when a plan leaves devices out).

Three launches of ``examples/train_gpt.py`` (synthetic tokens, the same seed and samples), each for ``--window-s``
seconds of wall clock from the launch (start-up included), then stopped:

* static: the pipeline plan throughout (the launcher only logs what it would do);
* adapt: the same with ``--adapt``: it detects the slow device, re-plans and switches through a checkpoint;
* oracle: the planner's plan for a cluster file that knows the throttle from the start (device 1's figures / quota).

Prints the tokens each trained in the window, the median step time after the throttle (adapt: after its switch),
the adaptation history and whether the adapt run's losses equal the static run's step for step (same samples).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_hetero_cpu as base  # noqa: E402  (cgroup helpers, process tree, environment)

REPO = base.REPO
SLOW_DEVICE = 1
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+([0-9.naninf+-]+)\s")
# Three CPU processes of one host with the figures measured on this machine kind (examples/clusters/profiled-cpu-2.yaml:
# GEMM rate, memory and gloo all-reduce bandwidth): the planner's plan for it is a three-stage pipeline
CPU3 = """name: cpu-3
nodes:
  - name: local
    host: localhost
    gpus:
""" + "".join("""      - {type: cpu, tflops: {fp32: 0.1, bf16: 0.24}, memory_gib: 8, memory_bandwidth_GBps: 9,
         intra_node_bandwidth_GBps: 0.75}
""" for _ in range(3))


# ---------------------------------------------------------------- the throttle
def device_of(pid: int) -> int | None:
    """The device a worker process runs on: CUDA_VISIBLE_DEVICES[LOCAL_RANK], else LOCAL_RANK; None: not a worker."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        if b"LOCAL_RANK" not in env or b"TANGRAM_RUN_DIR" not in env:
            return None
        local = int(env[b"LOCAL_RANK"])
        visible = env.get(b"CUDA_VISIBLE_DEVICES", b"").decode()
        return int(visible.split(",")[local]) if visible else local
    except (OSError, ValueError, IndexError):
        return None


class MidRunThrottle(threading.Thread):
    """Once ``due()`` is true, keeps every worker of ``root`` on ``device`` at ``quota`` of a core."""

    def __init__(self, *, device: int, quota: float, due, period_us: int = 10_000, shares: int = 262144) -> None:
        super().__init__(name="throttle", daemon=True)
        self.root = 0  # the launcher's pid, set before start()
        self.device, self.quota, self.due, self.period_s = device, quota, due, period_us / 1e6
        self.done = threading.Event()
        self.throttled: dict[int, float] = {}  # pid -> when it was throttled
        # the launch runs in a group with cpu.shares above the host's other tasks (as bench_hetero_cpu.py does), so
        # a busy shared host slows the emulated devices less; the slow device's quota is a child of it
        self.groups, why = base.make_groups(quota, period_us, shares)
        self.how = "cgroup-v1 cpu quota" if self.groups else f"SIGSTOP/SIGCONT duty cycle ({why})"

    def preexec(self):
        """For Popen: the launch starts inside the benchmark's group (None without cgroups)."""
        return base._join(self.groups.bench) if self.groups is not None else None

    def run(self) -> None:
        try:
            while not self.done.is_set():
                if self.due():
                    for pid in base._descendants(self.root):
                        if pid not in self.throttled and device_of(pid) == self.device:
                            self._throttle(pid)
                if self.groups is None and self.throttled:
                    self._duty_cycle()
                else:
                    self.done.wait(0.1)
        finally:
            for pid in self.throttled:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)

    def _throttle(self, pid: int) -> None:
        try:
            if self.groups is not None:
                with open(os.path.join(self.groups.slow, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            self.throttled[pid] = time.time()
        except OSError:
            pass

    def _duty_cycle(self) -> None:
        """One period: running for quota of it, stopped for the rest."""
        live = [p for p in self.throttled if os.path.exists(f"/proc/{p}")]
        time.sleep(self.period_s * self.quota)
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(self.period_s * (1 - self.quota))
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)

    def close(self) -> list[str]:
        self.done.set()
        self.join()
        return self.groups.remove() if self.groups is not None else []


# ---------------------------------------------------------------- one launch
@dataclasses.dataclass
class Launch:
    name: str
    argv: list[str]
    run_dir: str
    steps: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)  # step -> (t_s, loss)
    output: list[str] = dataclasses.field(default_factory=list)
    returncode: int | None = None
    throttle_how: str = ""
    throttled_at_s: float | None = None


def launcher_argv(args, workdir: str, name: str, *, plan_args: list[str], nproc: int, steps: int,
                  extra: list[str], script_extra: tuple[str, ...] = ()) -> Launch:
    run_dir = os.path.join(workdir, f"run-{name}")
    ckpt = os.path.join(workdir, f"ckpt-{name}")
    argv = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", str(nproc), *plan_args,
            "--model", args.model, "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
            "--dtype", "fp32", "--runtime", "torch", "--run-dir", run_dir, "--checkpoint-dir", ckpt, *extra,
            os.path.join(REPO, "examples", "train_gpt.py"), "--steps", str(steps), "--data", "synthetic",
            "--timeout-s", "300", "--save-dir", ckpt, "--save-every", str(args.save_every), "--keep-last", "2",
            *script_extra]
    return Launch(name=name, argv=argv, run_dir=run_dir)


def run_launch(launch: Launch, *, window_s: float, throttle_at_s: float | None, quota: float,
               env: dict[str, str], throttle_due=None) -> Launch:
    """Run for ``window_s`` seconds (then SIGTERM; the launcher stops its workers), throttling device 1 from
    ``throttle_at_s`` (or when ``throttle_due()`` says)."""
    t0 = time.time()
    due = throttle_due or (lambda: throttle_at_s is not None and time.time() - t0 >= throttle_at_s)
    throttle = MidRunThrottle(device=SLOW_DEVICE, quota=quota, due=due)
    proc = subprocess.Popen(launch.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=throttle.preexec())
    throttle.root = proc.pid
    launch.throttle_how = throttle.how
    throttle.start()

    def read() -> None:
        for line in proc.stdout:
            launch.output.append(line)
            m = STEP_LINE.match(line.strip())
            if m:
                launch.steps[int(m.group(1))] = (time.time() - t0, float(m.group(2)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=window_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        for problem in throttle.close():
            print(f"bench_adapt_cpu: {problem}", file=sys.stderr)
    reader.join(timeout=10)
    launch.returncode = proc.returncode
    if throttle.throttled:
        launch.throttled_at_s = min(throttle.throttled.values()) - t0
    return launch


def history(launch: Launch) -> dict:
    for path in (os.path.join(launch.run_dir, "run-report.json"), os.path.join(launch.run_dir, "adapt",
                                                                                 "history.json")):
        with contextlib.suppress(OSError, ValueError):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("adaptations") is not None:
                return data
    return {"segments": [], "adaptations": []}


def step_times_after(launch: Launch, t_s: float) -> list[float]:
    """Wall time between consecutive steps printed after ``t_s`` (a restart's gap left out: consecutive only)."""
    items = sorted(launch.steps.items())
    return [b[1][0] - a[1][0] for a, b in zip(items, items[1:]) if b[0] == a[0] + 1 and a[1][0] >= t_s]


# ---------------------------------------------------------------- main
def oracle_cluster(workdir: str, quota: float) -> str:
    """cpu-3 with device 1's figures divided by 1 / quota: the throttle known from the start."""
    from tangram_launch.launch.calibration import calibrate
    from tangram_launch.specs.cluster import ClusterSpec

    base_path = os.path.join(workdir, "cpu-3.yaml")
    report = {"plan_hash": "oracle", "stages": [{"stage": 1, "ranks": [
        {"node": "local", "local_gpu": SLOW_DEVICE, "ratio": 1.0 / quota}]}]}
    cluster, _ = calibrate(ClusterSpec.load(base_path), report)
    path = os.path.join(workdir, "cpu-3-oracle.yaml")
    cluster.dump(path)
    return path


def oracle_plan(args, cluster_path: str, workdir: str) -> tuple[str, list[int]]:
    """The planner's plan on the oracle cluster: its file and the local devices it uses."""
    from tangram_launch.launch.planning import make_launch_plan, planning_request, write_plan
    from tangram_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.load(cluster_path)
    values = argparse.Namespace(model=args.model, global_batch=args.global_batch, seq_len=args.seq_len,
                                dtype="fp32", runtime="torch")
    plan = make_launch_plan(cluster, planning_request(values, cluster=cluster, progress=False))
    return write_plan(plan, workdir), sorted(r.local_gpu for r in plan.rank_layout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--window-s", type=float, default=240.0, help="wall-clock seconds each launch trains")
    p.add_argument("--throttle-at-s", type=float, default=70.0, help="seconds after the launch the throttle starts")
    p.add_argument("--quota", type=float, default=0.33, help="the slow device's share of one core (0.33)")
    p.add_argument("--adapt-window", type=int, default=20, help="--adapt-window of the adapt launch (steps)")
    p.add_argument("--adapt-horizon", type=int, default=200, help="--adapt-horizon of the adapt launch (steps)")
    p.add_argument("--adapt-threshold", type=float, default=0.15, help="--adapt-threshold of the adapt launch")
    p.add_argument("--model", default=os.path.join(REPO, "examples", "models", "bench-cpu.yaml"))
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=32, help="(global batch 12 x 32: the planner's plan is a pipeline "
                                                           "over the three devices, 6 micro-batches)")
    p.add_argument("--save-every", type=int, default=20, help="periodic checkpoints (their save times price a "
                                                               "switch; the switch saves its own)")
    p.add_argument("--only", choices=("static", "adapt", "oracle"), action="append",
                   help="run only these launches (repeatable; a single row on a shared machine)")
    p.add_argument("--keep", metavar="DIR", help="keep run directories, plans and checkpoints here")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if not 0.01 <= args.quota <= 1.0:
        p.error("--quota must be in [0.01, 1]")
    workdir = args.keep or tempfile.mkdtemp(prefix="tangram-bench-adapt-")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "cpu-3.yaml"), "w") as f:
        f.write(CPU3)
    sys.path.insert(0, REPO)
    env = base._env()
    pipeline = ["--cluster", os.path.join(workdir, "cpu-3.yaml")]
    steps = 100_000  # the window ends the run
    oracle_path, oracle_devices = oracle_plan(args, oracle_cluster(workdir, args.quota), workdir)
    launches = {
        "static": launcher_argv(args, workdir, "static", plan_args=pipeline, nproc=3, steps=steps, extra=[]),
        "adapt": launcher_argv(args, workdir, "adapt", plan_args=pipeline, nproc=3, steps=steps,
                               extra=["--adapt", "--adapt-window", str(args.adapt_window), "--adapt-horizon",
                                      str(args.adapt_horizon), "--adapt-threshold", str(args.adapt_threshold)]),
        "oracle": launcher_argv(args, workdir, "oracle", plan_args=["--plan", oracle_path],
                                nproc=len(oracle_devices), steps=steps, extra=[]),
    }
    results = {}
    try:
        for name in args.only or ("static", "adapt", "oracle"):
            run_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(map(str, oracle_devices))) if name == "oracle" else env
            results[name] = run_launch(launches[name], window_s=args.window_s, throttle_at_s=args.throttle_at_s,
                                       quota=args.quota, env=run_env)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    tokens_per_step = args.global_batch * args.seq_len
    figures: dict = {"window_s": args.window_s, "throttle_at_s": args.throttle_at_s, "quota": args.quota,
                     "load_avg": base.load_avg(), "runs": {}}
    print(f"{args.window_s:.0f} s window per launch, device {SLOW_DEVICE} throttled to {args.quota:.0%} of a core "
          f"from {args.throttle_at_s:.0f} s; {tokens_per_step} tokens per step")
    for name, launch in results.items():
        hist = history(launch) if name == "adapt" else {"adaptations": []}
        switched = [a for a in hist["adaptations"] if a.get("switched")]
        after = args.throttle_at_s
        if switched and hist.get("segments") and len(hist["segments"]) > 1:
            after = (hist["segments"][1].get("first_step_unix_s") or 0) - (hist["segments"][0]["started_unix_s"])
        times = step_times_after(launch, after)
        done = max(launch.steps) if launch.steps else 0
        row = {"steps": done, "tokens": done * tokens_per_step, "throttle": launch.throttle_how,
               "throttled_at_s": launch.throttled_at_s, "median_step_s_after": statistics.median(times) if times
               else None, "adaptations": hist["adaptations"], "returncode": launch.returncode}
        figures["runs"][name] = row
        med = row["median_step_s_after"]
        print(f"  {name:7s} {done:5d} steps  {row['tokens']:8d} tokens  median step after the throttle"
              f"{' (after the switch)' if switched else ''} {med * 1e3 if med else float('nan'):7.0f} ms   "
              f"throttle: {launch.throttle_how}")
        for a in hist["adaptations"]:
            print(f"      step {a['step']}: {a['cause']}: {'switched' if a.get('switched') else 'kept'} "
                  f"({a['reason']}); downtime {a.get('downtime_s')}")
    if "adapt" in results and "static" in results:
        a, s = results["adapt"].steps, results["static"].steps
        common = sorted(set(a) & set(s))
        same = all(abs(a[k][1] - s[k][1]) <= 1e-5 * max(1.0, abs(s[k][1])) + 1e-4 for k in common)
        contiguous = sorted(a) == list(range(1, len(a) + 1))
        figures["losses_equal_on_common_steps"] = same
        figures["adapt_steps_contiguous"] = contiguous
        print(f"adapt vs static losses on {len(common)} common steps: {'equal' if same else 'DIFFERENT'} "
              f"(printed to 4 decimals); adapt steps 1..{len(a)} {'without' if contiguous else 'WITH'} gaps")
    if "adapt" in results and "oracle" in results:
        a_med, o_med = figures["runs"]["adapt"]["median_step_s_after"], figures["runs"]["oracle"]["median_step_s_after"]
        if a_med and o_med:
            figures["adapt_over_oracle_step"] = a_med / o_med
            print(f"step time after the switch / oracle's after the throttle: {a_med / o_med:.2f}")
    print(f"load average: {figures['load_avg']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
