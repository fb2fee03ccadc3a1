"""An emulated heterogeneous cluster on one CPU host: the Tangram plan against a uniform layer split, measured.

    sudo python benchmarks/bench_hetero_cpu.py [--quota 0.33] [--steps 10] [--warmup-steps 2] [--rounds 2]
        [--model examples/models/bench-cpu.yaml] [--global-batch 16] [--micro-batch 2] [--seq-len 256]
        [--period-us 100000] [--shares 262144] [--no-pin] [--cluster FILE] [--keep DIR] [--json FILE]

    sudo python benchmarks/bench_hetero_cpu.py --stage-grids [ARGS]    # the per-stage-grid case (issue 18): runs
        benchmarks/bench_stage_grids_cpu.py with ARGS (three devices: two throttled workers and a fast one)

Two CPU processes are the two "devices"; the second one runs in a cgroup-v1 ``cpu`` group whose CFS quota gives it
``--quota`` of a core (period ``--period-us``, 100 ms by default): a device about 1/quota times slower. Device k
(local rank k) is pinned to the k-th CPU this process may use (``--no-pin``: not pinned), and both run in a parent
group with ``--shares`` cpu.shares (a task elsewhere has 1024), so that other work on a shared host slows the
emulated devices less; it cannot stop it (caches, memory bandwidth): the figures say how busy the host was.

1. Profile, for real: ``tangram-launch profile --standalone --nproc-per-node 2 --model M --layer-dtype fp32`` with
   local rank 1 in the cgroup (the profiler's own hook, TANGRAM_PROFILE_TEST_CGROUP and
   TANGRAM_PROFILE_TEST_CGROUP_LOCAL_RANK; the workers are pinned by polling the command's process tree). The
   ClusterSpec it writes carries each device's measured GEMM rate, memory bandwidth, gloo all-reduce/p2p bandwidth
   and per-layer forward (and forward+backward) time at the planned shapes (``--seq-len``, ``--micro-batch``), so
   the two devices become two islands. ``--cluster FILE`` reuses a profile.
2. Plan: ``tangram_launch.planner.make_plan`` (runtime torch, fp32, the micro-batch fixed to the profiled one so
   the cost model reads the measured layer times instead of its roofline). The uniform split (same islands in the
   same pipeline order, layers split evenly) is costed by the planner's manual-plan path
   (``tangram_launch.planner.manual.cost_manual_plan``), so both predictions come from the same cost model.
3. Train both plans with examples/train_gpt.py (torch adapter, Schedule1F1B, gloo, synthetic tokens), the process
   that holds the throttled device in the cgroup in both runs (its pid written to ``cgroup.procs`` before it
   executes, as the profiler hook does for its worker; examples/train_gpt.py has no such hook). ``--rounds N``
   alternates the two runs N times (load drift hits both); each run's figure is the median iteration time after
   ``--warmup-steps`` steps, a plan's figure the median over rounds.
4. Print both measured iteration times, their ratio, the planner's predicted times and predicted/measured - 1, the
   profiled per-layer times, the CPU the host's other work took meanwhile and the load average (the host may be
   shared: figures are only comparable at low load). The cost model takes each layer's profiled forward and
   forward+backward times (on CPUs the backward is 2.1-2.5x the forward, not the 2x of large GPU GEMMs).

Needs root and a writable /sys/fs/cgroup/cpu (cgroup v1). Without it the benchmark says why and exits 0 (skipped);
a failed profile, plan or training run exits 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CGROUP_ROOT = "/sys/fs/cgroup/cpu"
DEFAULT_MODEL = os.path.join(REPO, "examples", "models", "bench-cpu.yaml")
THROTTLED_LOCAL_RANK = 1  # profiler local rank (and plan local_gpu) of the slow device


# ---------------------------------------------------------------- the emulated devices
@dataclasses.dataclass(frozen=True)
class Groups:
    """cgroup-v1 cpu groups: ``bench`` (every worker; cpu.shares above the host's other tasks, so the two
    "devices" keep their speed on a shared host) and its child ``slow`` (the throttled device's CFS quota)."""

    bench: str
    slow: str

    def remove(self) -> list[str]:
        return remove_groups((self.slow, self.bench))  # empty once the workers have exited; child first


def remove_groups(paths) -> list[str]:
    """Remove each cgroup directory in order (children before their parent); what could not be removed, and why."""
    problems = []
    for path in paths:
        try:
            if os.path.isdir(path):
                os.rmdir(path)
        except OSError as exc:
            problems.append(f"could not remove {path}: {exc}")
    return problems


def make_groups(quota: float, period_us: int, shares: int) -> tuple[Groups | None, str]:
    """The benchmark's groups, or (None, why not)."""
    if not os.path.isfile(os.path.join(CGROUP_ROOT, "cpu.cfs_quota_us")):
        return None, f"no cgroup-v1 cpu controller at {CGROUP_ROOT}"
    bench = os.path.join(CGROUP_ROOT, f"tangram-bench-{uuid.uuid4().hex[:8]}")
    groups = Groups(bench, os.path.join(bench, "slow"))
    try:
        os.mkdir(groups.bench)
        if shares:
            _write(os.path.join(groups.bench, "cpu.shares"), shares)
        os.mkdir(groups.slow)
        _write(os.path.join(groups.slow, "cpu.cfs_period_us"), period_us)
        _write(os.path.join(groups.slow, "cpu.cfs_quota_us"), max(1000, int(quota * period_us)))
    except OSError as exc:
        groups.remove()
        return None, f"cannot create cpu cgroups under {CGROUP_ROOT} ({exc}); run as root on a cgroup-v1 host"
    return groups, ""


def _write(path: str, value: int | str) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def cgroup_stat(path: str) -> dict[str, int]:
    with open(os.path.join(path, "cpu.stat")) as f:
        return {k: int(v) for k, v in (line.split() for line in f if line.strip())}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def host_busy_s() -> float:
    """CPU seconds the host has spent busy, all cores (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------- 1. profile
def profile(args, groups: Groups, out: str, cores: tuple[int, int] | None) -> dict[int, int]:
    """Run the profile command; returns {local rank: worker pid} of the workers it pinned."""
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--standalone", "--nproc-per-node", "2",
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--layer-dtype", "fp32", "--timeout-s", "300", "-o", out]
    env = _env(TANGRAM_PROFILE_TEST_CGROUP=groups.slow,
               TANGRAM_PROFILE_TEST_CGROUP_LOCAL_RANK=str(THROTTLED_LOCAL_RANK))
    # the command (launcher agent and workers) starts in the bench group; the hook moves local rank 1 to ``slow``
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_join(groups.bench))
    workers: dict[int, int] = {}
    watch = None if cores is None else (lambda done: _pin_descendants(proc.pid, cores, workers, done))
    wait_watched(proc, watch, args.timeout_s, "profile")
    return workers


def wait_watched(proc: subprocess.Popen, watch, timeout_s: float, what: str) -> None:
    """Wait for ``proc`` while ``watch(done)`` (if given) runs in a thread until ``done`` is set: it places the
    command's workers as they appear. The process is killed on a timeout; a non-zero exit raises with its output."""
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(done,), daemon=True) if watch is not None else None
    if watcher is not None:
        watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if watcher is not None:
        watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")


def _pin_descendants(root: int, cores: tuple[int, int], workers: dict[int, int], done: threading.Event) -> None:
    """Pin the profile's workers like the training workers: local rank k on ``cores[k]``.

    torchrun starts the workers and has no per-rank CPU binding, so this polls the command's process tree (every
    20 ms until both workers are found: a worker spends seconds importing torch and meeting its peers before it
    measures anything; then every second) and sets the affinity of every thread of a process whose environment has
    LOCAL_RANK (threads they start later inherit it). Best effort: a process that is gone is skipped.
    """
    pinned: set[int] = set()
    while not done.is_set():
        for pid in _descendants(root):
            rank = _local_rank(pid)
            if rank is None or rank >= len(cores):
                continue
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if int(tid) not in pinned:
                        os.sched_setaffinity(int(tid), {cores[rank]})
                        pinned.add(int(tid))
                workers[rank] = pid
            except OSError:
                continue
        done.wait(1.0 if len(workers) == len(cores) else 0.02)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4, after the (comm)
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _local_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"LOCAL_RANK"]) if b"LOCAL_RANK" in env else None
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- 2. plan
def plans(args, cluster_path: str):
    """(cluster, model, training, islands, tangram plan, uniform plan, throttled GPU ref)."""
    from tangram_launch.islands import build_islands
    from tangram_launch.planner import PlannerOptions, make_plan
    from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.load(cluster_path)
    model = load_model(args.model)
    training = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32", optimizer="adamw",
                            grad_dtype="fp32")
    iset = build_islands(cluster, dtype="fp32")
    # the profiled micro-batch only: at another one the cost model has no measured layer time and falls back to
    # its roofline from the measured GEMM rate
    opts = PlannerOptions(microbatch_sequences=(args.micro_batch,), max_workers=1, progress=False)
    tangram = make_plan(cluster, model, training, runtime="torch", islands=iset, options=opts)
    node = cluster.nodes[0].name
    slow_ref = (node, THROTTLED_LOCAL_RANK)
    island_of = {(g.node, g.local_index): i.name for i in iset.islands for g in i.gpus}
    if tangram.num_stages == 2:
        order = [s.island for s in tangram.stages]
    else:  # a one-stage plan: compare with fast -> slow (one island for both when the quota is mild)
        order = [island_of[(node, 1 - THROTTLED_LOCAL_RANK)], island_of[slow_ref]]
    half = model.num_layers // 2
    manual = parse_manual_plan({"stages": [{"layers": [0, half], "island": order[0]},
                                           {"layers": [half, model.num_layers], "island": order[1]}],
                                "microbatch_sequences": args.micro_batch},
                               num_layers=model.num_layers, island_names=[i.name for i in iset.islands],
                               source="uniform split")
    uniform = cost_manual_plan(manual, cluster, model, training, runtime="torch", islands=iset, options=opts)
    return cluster, model, training, iset, tangram, uniform, slow_ref


# ---------------------------------------------------------------- 3. train
def _join(cgroup: str, core: int | None = None):
    def fn() -> None:  # runs in the child between fork and exec: the process starts inside its group, pinned
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        if core is not None:
            os.sched_setaffinity(0, {core})
    return fn


def train(args, plan, slow_ref: tuple[str, int], groups: Groups, workdir: str, name: str,
          cores: tuple[int, int] | None) -> dict:
    """Both ranks of ``plan`` as examples/train_gpt.py workers; the rank on the throttled device in the cgroup."""
    def preexec(entry):
        slow = (entry.node, entry.local_gpu) == slow_ref
        return _join(groups.slow if slow else groups.bench, cores[entry.local_gpu] if cores else None)

    return run_plan_workers(args, plan, workdir, name, preexec)


def run_plan_workers(args, plan, workdir: str, name: str, preexec_for) -> dict:
    """Every rank of ``plan`` as an examples/train_gpt.py worker started with ``preexec_for(rank entry)`` (its
    cgroup and core); the result file with the median iteration after ``args.warmup_steps`` and the host's other
    load while it ran (cores)."""
    path = os.path.join(workdir, f"plan-{name}.json")
    plan.dump(path)
    out = os.path.join(workdir, f"result-{name}.json")
    if os.path.exists(out):
        os.remove(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    busy0, ours0, t0 = host_busy_s(), children_cpu_s(), time.perf_counter()
    for entry in plan.rank_layout:
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(entry.rank),
                   WORLD_SIZE=str(plan.world_size), LOCAL_RANK=str(entry.local_gpu),
                   LOCAL_WORLD_SIZE=str(plan.world_size))
        cmd = [sys.executable, os.path.join(REPO, "examples", "train_gpt.py"), "--plan", path, "--steps",
               str(args.steps), "--data", "synthetic", "--quiet", "--out", out, "--timeout-s", "300"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, preexec_fn=preexec_for(entry)))
    logs = []
    try:
        logs = [p.communicate(timeout=args.timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name} run failed:\n" + "\n".join(x[-3000:] for x in logs))
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    times = res["iteration_s"][args.warmup_steps:]
    res["median_after_warmup_s"] = statistics.median(times)
    # the rest of the host's work while this run lasted, in cores: what the emulated devices had to share with
    res["other_load_cores"] = max(0.0, (host_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall
    return res


def describe(plan) -> str:
    return " + ".join(f"{s.layers[1] - s.layers[0]}"
                      + ("e" if s.has_embedding else "") + ("h" if s.has_head else "")
                      + f"@{s.island}" for s in plan.stages)


def layer_times(cluster, model, args) -> dict[str, dict[str, float]]:
    from tangram_launch.costmodel.compute import measured_layer_key

    key = measured_layer_key(model.name, model.layer_kind(0), args.seq_len, args.micro_batch, 1)
    out = {}
    for node in cluster.nodes:
        for i, g in enumerate(node.gpus):
            m = g.measured or {}
            out[f"{node.name}:{i}"] = {"forward_s": (m.get("layer_forward_s") or {}).get(key),
                                       "forward_backward_s": (m.get("layer_forward_backward_s") or {}).get(key),
                                       "gemm_fp32_tflops": (m.get("gemm_tflops") or {}).get("fp32")}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--stage-grids" in argv:  # the per-stage-grid case: its own emulation (three devices), its own flags
        import bench_stage_grids_cpu  # imports this module for the cgroup, pinning and load helpers

        return bench_stage_grids_cpu.main([a for a in argv if a != "--stage-grids"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quota", type=float, default=0.33, help="CPU share of the slow device, of one core (0.33)")
    p.add_argument("--period-us", type=int, default=100_000, help="CFS period of the slow device's cgroup")
    p.add_argument("--shares", type=int, default=262144,
                   help="cpu.shares of the benchmark's group (the most cgroup v1 allows; a task elsewhere has "
                        "1024; 0: leave the default)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin device k (local rank k) to the k-th CPU of this process's affinity")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model preset or YAML (examples/models/bench-cpu.yaml)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch, profiled and planned")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the median")
    p.add_argument("--rounds", type=int, default=2, help="alternate the two runs this many times")
    p.add_argument("--cluster", help="reuse this profiled ClusterSpec (made with the same --quota) instead of "
                                     "profiling")
    p.add_argument("--keep", metavar="DIR", help="keep the cluster, plans and run results here")
    p.add_argument("--timeout-s", type=float, default=900, help="per profile / training run")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    from tangram_launch.errors import TangramError

    if not 0.01 <= args.quota <= 1.0:
        p.error("--quota must be in [0.01, 1] (a share of one core)")
    if not 1000 <= args.period_us <= 1_000_000:
        p.error("--period-us must be in [1000, 1000000] (the kernel's limits)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps <= args.warmup_steps:
        p.error("--steps must exceed --warmup-steps")
    if args.global_batch % args.micro_batch:
        p.error("--micro-batch must divide --global-batch")

    groups, why = make_groups(args.quota, args.period_us, args.shares)
    if groups is None:
        print(f"bench_hetero_cpu: skipped: {why}", file=sys.stderr)
        return 0
    avail = sorted(os.sched_getaffinity(0))
    cores = (avail[0], avail[1]) if args.pin and len(avail) >= 2 else None
    workdir = args.keep or tempfile.mkdtemp(prefix="tangram-bench-hetero-")
    os.makedirs(workdir, exist_ok=True)
    figures: dict = {"quota": args.quota, "period_us": args.period_us, "shares": args.shares,
                     "cores": list(cores) if cores else None,
                     "load_avg": {"start": load_avg()}}
    try:
        cluster_path = args.cluster
        if cluster_path is None:
            cluster_path = os.path.join(workdir, "cluster.yaml")
            t0, busy0, ours0 = time.perf_counter(), host_busy_s(), children_cpu_s()
            figures["profile_pinned_pids"] = profile(args, groups, cluster_path, cores)
            figures["profile_s"] = round(time.perf_counter() - t0, 1)
            figures["profile_other_load_cores"] = round(
                max(0.0, host_busy_s() - busy0 - (children_cpu_s() - ours0)) / figures["profile_s"], 2)
            figures["load_avg"]["after_profile"] = load_avg()
        t0 = time.perf_counter()
        cluster, model, training, iset, tangram, uniform, slow_ref = plans(args, cluster_path)
        figures["plan_s"] = round(time.perf_counter() - t0, 3)
        runs: dict[str, list[dict]] = {"tangram": [], "uniform": []}
        throttled_before = cgroup_stat(groups.slow)["nr_throttled"]
        for r in range(args.rounds):
            for name, plan in (("tangram", tangram), ("uniform", uniform)):
                runs[name].append(train(args, plan, slow_ref, groups, workdir, name, cores))
                figures["load_avg"][f"after_{name}_{r}"] = load_avg()
        figures["throttled_periods_in_training"] = cgroup_stat(groups.slow)["nr_throttled"] - throttled_before
    except (TangramError, RuntimeError, subprocess.TimeoutExpired, OSError) as exc:  # SpecError, InfeasibleError
        print(f"bench_hetero_cpu: {exc}", file=sys.stderr)
        return 1
    finally:
        for problem in groups.remove():
            print(f"bench_hetero_cpu: {problem}", file=sys.stderr)
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)

    figures.update(model=model.name, cluster=cluster_path if args.cluster or args.keep else None,
                   global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len,
                   num_microbatches=tangram.num_microbatches, throttled_device=f"{slow_ref[0]}:{slow_ref[1]}",
                   islands={i.name: [str(g) for g in i.gpus] for i in iset.islands},
                   layer_times=layer_times(cluster, model, args))
    for name, plan in (("tangram", tangram), ("uniform", uniform)):
        rs = runs[name]
        measured = statistics.median(x["median_after_warmup_s"] for x in rs)
        pred = plan.predicted.iteration_time_s
        figures[name] = {
            "split": describe(plan), "stages": [list(s.layers) for s in plan.stages],
            "measured_s": measured, "measured_per_round_s": [x["median_after_warmup_s"] for x in rs],
            "iteration_s": [x["iteration_s"] for x in rs], "predicted_s": pred,
            "predicted_stage_s": [s.time_s for s in plan.predicted.stages],
            "predicted_breakdown": dict(plan.predicted.breakdown),
            "error": pred / measured - 1.0,
            "loss": [rs[-1]["losses"][0], rs[-1]["losses"][-1]],
            "other_load_cores": [round(x["other_load_cores"], 2) for x in rs],
        }
    figures["speedup"] = figures["uniform"]["measured_s"] / figures["tangram"]["measured_s"]
    figures["predicted_speedup"] = figures["uniform"]["predicted_s"] / figures["tangram"]["predicted_s"]

    lt = figures["layer_times"]
    profiled = (f"profiled in {figures['profile_s']:.0f} s (other work on the host "
                f"{figures['profile_other_load_cores']:.2f} cores)" if "profile_s" in figures
                else f"profile {args.cluster}")
    print(f"model {model.name} ({model.num_layers} layers, hidden {model.hidden_size}), fp32, global batch "
          f"{args.global_batch} x {args.seq_len}, {tangram.num_microbatches} micro-batches of {args.micro_batch}; "
          f"device {figures['throttled_device']} at {args.quota:.0%} of a core (CFS period {args.period_us} us); "
          f"{profiled}")
    for ref, t in lt.items():
        fb = t["forward_backward_s"]
        print(f"  profiled {ref}: layer forward {t['forward_s'] * 1e3:.1f} ms, forward+backward "
              f"{fb * 1e3 if fb else float('nan'):.1f} ms, GEMM {t['gemm_fp32_tflops']} TFLOP/s fp32")
    for name in ("tangram", "uniform"):
        f = figures[name]
        print(f"{name:8s} {f['split']:24s} measured {f['measured_s'] * 1e3:8.1f} ms/iter   predicted "
              f"{f['predicted_s'] * 1e3:8.1f} ms   predicted/measured {f['error']:+.1%}   (rounds "
              + ", ".join(f"{x * 1e3:.0f}" for x in f["measured_per_round_s"]) + " ms; other work on the host "
              + ", ".join(f"{x:.2f}" for x in f["other_load_cores"]) + " cores)")
    print(f"speed-up tangram over uniform: measured {figures['speedup']:.2f}x, predicted "
          f"{figures['predicted_speedup']:.2f}x")
    print("loss (last round): " + ", ".join(f"{n} {figures[n]['loss'][0]:.3f} -> {figures[n]['loss'][1]:.3f}"
                                           for n in ("tangram", "uniform")))
    print(f"load average (1, 5, 15 min): {figures['load_avg']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
