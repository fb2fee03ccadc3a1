"""Measured layer costs against a real run: a plan priced from ``profile --model`` layer times, and the same plan
priced by the analytic model, each set beside what the run's ``run-report.json`` measured, per stage.

    sudo python benchmarks/bench_measured_cpu.py [--runs 3] [--quota 0.33] [--no-calibrate] [--cores 0,0,1]
        [--no-fast-quota] [--period-us 0] [--no-filler] [--filler-grace-us 2000] [--ticker-us 1000] [--model tiny]
        [--seq-len 64] [--global-batch 256] [--micro-batches 8,16,32,64] [--min-micro-batch 8] [--layer-budget-s 60]
        [--layer-timing back-to-back] [--steps 20] [--cluster FILE] [--keep DIR] [--json FILE]
    taskset -c 1 python benchmarks/bench_measured_cpu.py --probe-wait [--probe-micro-batch 8] [--probe-sleep-ms 30]
    sudo python benchmarks/bench_measured_cpu.py --probe-throttle [--probe-sleep-ms 30] [--probe-short-sleep-ms 0.5]
        [--quota 0.33] [--period-us N]
    sudo python benchmarks/bench_measured_cpu.py --probe-pair

Three CPU processes are the devices. Every process runs in a cgroup-v1 ``cpu`` group with raised cpu.shares (the
host's other work yields to it; ``bench_hetero_cpu.make_groups``), and each device in a ``cpuset`` of its own core
(``--cores``: by default the two fast devices share one core, half a core each while both compute, as the data-
parallel replicas of one stage do; the throttled device has the other core). A fast device that shares its core is
capped at its share by a CFS quota of its own, with a ticker (below), so that it computes at the same speed whether
its neighbour computes or waits, as a GPU does (``make_devices``; ``--no-fast-quota`` leaves it uncapped). Local
rank 2 is throttled: its child ``cpu`` group has a CFS quota, calibrated so that the device measures ``--quota`` of
a fast device's speed (``calibrate_quota``: a stage-like micro-batch back to back in its groups against a fast
device's; the nominal share, ``--quota`` times a fast device's core share, 0.165 of a core for ⅓, computes well below
⅓ of a fast device with the ticker below; ``--no-calibrate`` keeps it).

How a CFS quota behaves on such a host: the kernel enforces it at its tick (4 ms here), so whatever the period the
device runs in bursts of whole ticks (4 ms on, 20 ms off at 0.165 of a core, period 24 ms), and a quota under 1 ms
is refused. The mean speed over many periods is exact, but a device that waits leaves its quota unspent and then
computes at full speed until it is spent: a throttled stage that waits part of each step reads faster than its
profile (benchmarks/README.md). So a busy loop at SCHED_IDLE (the filler; ``--no-filler`` leaves it out) runs in
the throttled device's groups: it spends the quota only while the worker waits. That alone is not enough: the
throttled time then falls inside the worker's wait, it wakes with a fresh quota, and the kernel notices the quota
is spent only at its next tick, so a call shorter than a tick still ran at full speed after each wait
(``--probe-throttle``). A ticker (``--ticker-us``, default 1 ms; 0 leaves it out) wakes in the same groups, and
each of its wake-ups makes the kernel check the quota: the worker computes at its quota's speed after a wait as
back to back, as a slower device would. (``--filler-grace-us`` lets the filler wait that long into each wait before
it spends the quota, so that a short wait, the p2p handshake between two micro-batches, is not charged at the
quota's rate; the slowest stage measured the same with and without it, so the default is 0.)

1. Profile, for real: ``tangram-launch profile --standalone --nproc-per-node 3 --model M --seq-len S
   --micro-batch 8,16,32,64 --layer-dtype fp32 --layer-timing back-to-back``, each worker moved into its device's
   groups as soon as it appears. Back-to-back: blocks of calls of at least 0.1 s of process time (tens of quota
   periods), an all-to-all after each block, so every device is timed computing without pause and the two fast
   devices share their core while they are timed. Back-to-back also times a stage-like sequence (the embedding, the
   model's layers, the head and loss) in blocks at each micro-batch size beside the sum of its parts timed alone:
   the planner multiplies a stage priced from measured layers by that ratio (costmodel/measured_layers.py).
2. Plan with the torch runtime (any micro-batch size: the cost model interpolates between the measured ones); where
   the planner leaves a device out, the best plan (by the same cost model) that gives every device a stage. The same
   stages, GPUs and grids are priced again by the analytic model alone (the manual-plan path on the cluster with its
   layer times removed), so the two predictions differ only in how layers are priced.
3. Train the plan: ``tangram-launch --standalone --nproc-per-node N --plan P --run-dir D examples/train_gpt.py``,
   each worker moved into its device's groups as soon as it appears (by LOCAL_RANK: local rank i runs the plan's
   i-th local GPU). The launcher writes ``D/run-report.json``: per stage, the median over steps of forward and of
   backward per micro-batch; the last stage's loss and the first stage's embedding backward included, as the plan
   prices them.
4. Print per run and stage: predicted (measured-priced), predicted (analytic), measured, each prediction's error,
   and the measured-priced forward and backward each beside the run's; each worker's CPU per micro-batch, its main
   thread's and its other threads' (/proc, from the first step every rank has written to the last look), and the
   share of a core the throttled device's ticker and filler took; then, for each pricing, how many runs had every
   stage within 10 %, the median and the worst stage error.

``--probe-wait`` (no benchmark, no root): the training's stage module and one profiled layer, CPU time per
micro-batch, back to back and sleeping before each micro-batch as a stage that waits for a slower neighbour does
(a layer call after a sleep costs more CPU than the back-to-back profile measures: benchmarks/README.md).
``--probe-throttle`` (root, no benchmark): the profiler's wake-up measurement (profiler/wake.py: a stage-like
micro-batch back to back and after a sleep, wall time) in the throttled device's groups and in a fast device's,
at 8 and 16 rows: whether the throttled device computes at its speed after a wait as it does back to back.
``--probe-pair`` (root, no benchmark): a stage-like micro-batch in the fast devices' groups, one alone, both back to
back, both with random waits before each call, with the fast devices uncapped and capped (``make_devices``).
``--runs N`` repeats 1-3 (a new profile each time); one run takes about 2 minutes.

Exit status: 0 when it ran (the figures say how well each prediction did), 1 when a step failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_hetero_cpu as base  # noqa: E402  (the cgroup and load helpers; puts the repository on the path)
from tangram_launch.errors import InfeasibleError  # noqa: E402
from tangram_launch.islands import build_islands  # noqa: E402
from tangram_launch.launch.run_report import iteration_parts  # noqa: E402
from tangram_launch.planner import PlannerOptions, make_plan  # noqa: E402
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec  # noqa: E402
from tangram_launch.specs.model import load_model  # noqa: E402
from tangram_launch.specs.training import TrainingSpec  # noqa: E402
from profiler.worker import LAYER_BUDGET_S  # noqa: E402

REPO = base.REPO
THROTTLED = 2  # local rank (and cluster local GPU index) of the throttled device
LAYER_KEYS = ("layer_forward_s", "layer_forward_backward_s", "layer_activation_bytes", "stage_sequence_s",
              "stage_sequence_parts_s")


CPUSET_ROOT = "/sys/fs/cgroup/cpuset"


@dataclasses.dataclass(frozen=True)
class Devices:
    """The benchmark's cgroup-v1 groups: ``bench`` (``cpu``: every process, cpu.shares above the host's other work),
    a ``cpu`` child for the throttled device and one for each capped fast device (their CFS quotas), and a ``cpuset``
    group per device (its core)."""

    bench: str
    group_of: dict  # local device index -> its cpu group (absent: stays in bench)
    cpuset_of: dict  # local device index -> its cpuset group (absent: not pinned)
    core_of: dict  # local device index -> the CPU it runs on
    cpuset_root: str | None = None
    # in the throttled device's groups: the filler (spends its quota while its worker waits), the ticker
    helpers: tuple[subprocess.Popen, ...] = ()

    def remove(self) -> list[str]:
        for proc in self.helpers:
            proc.kill()
            proc.wait()
        cpusets = [*self.cpuset_of.values(), *([self.cpuset_root] if self.cpuset_root else [])]
        return base.remove_groups([*self.group_of.values(), self.bench, *cpusets])  # children first

    @property
    def capped(self) -> list[int]:
        """The fast devices capped by a CFS quota of their own (make_devices)."""
        return [d for d in self.group_of if d != THROTTLED]

    def groups_of(self, device: int) -> list[str]:
        """The device's ``cpu`` group (its own, else the benchmark's: a process started outside it, as a probe's, must
        not compete with the host's other work on equal terms) and its cpuset."""
        return [g for g in (self.group_of.get(device, self.bench), self.cpuset_of.get(device)) if g is not None]


def fast_core_share(cores: list[int]) -> float:
    """A fast device's share of its core while every device computes: one over the devices pinned to that core
    (the fast devices are the data-parallel replicas of one stage, so they compute at the same time)."""
    fast = [c for dev, c in enumerate(cores) if dev != THROTTLED]
    return 1.0 / max(cores.count(c) for c in fast)


def shortest_period_us(core: float) -> int:
    """The shortest CFS period whose quota of ``core`` of a core is 1 ms, the kernel's least quota."""
    return math.ceil(1000 / core)


def capped_fast_devices(args, cores: list[int]) -> list[int]:
    """The fast devices that get a CFS quota of their core share: those sharing their core, unless
    ``--no-fast-quota``."""
    if not (args.fast_quota and cores):
        return []
    return [d for d, c in enumerate(cores) if d != THROTTLED and cores.count(c) > 1]


def make_devices(args) -> tuple[Devices | None, str]:
    """Device 2 at ``quota`` of a fast device's speed (a CFS quota of ``quota`` x the fast device's core share, then
    calibrated: ``calibrate_quota``), each device pinned to its core by a cpuset (``--cores``); the fast devices
    that share a core each capped at their share of it, each with its own ticker (``--no-fast-quota``: uncapped).

    Why the cap: without it a fast device computes at its whole core whenever its neighbour waits. The profile
    times the two together (half a core each), but in a run the replicas wake out of step behind the slower stage,
    and a stage-like micro-batch with random waits before it ran 37-44 % faster than both back to back; capped,
    +5 % to -20 % (``--probe-pair``, benchmarks/README.md). A GPU's speed does not depend on whether the GPU beside
    it is busy; a capped device's depends on it far less."""
    cores = _cores(args)
    share = fast_core_share(cores) if cores else 1.0
    args.quota_core = args.quota * share
    auto_period = not args.period_us
    if auto_period:
        args.period_us = shortest_period_us(args.quota_core)
    groups, why = base.make_groups(args.quota_core, args.period_us, args.shares)
    if groups is None:
        return None, why
    devices = Devices(groups.bench, {THROTTLED: groups.slow}, {}, dict(enumerate(cores)))
    capped = capped_fast_devices(args, cores)
    try:
        for dev in capped:
            group = os.path.join(groups.bench, f"fast{dev}")
            os.mkdir(group)
            devices.group_of[dev] = group
            base._write(os.path.join(group, "cpu.cfs_period_us"), shortest_period_us(share))
            base._write(os.path.join(group, "cpu.cfs_quota_us"), max(1000, int(share * shortest_period_us(share))))
    except OSError as exc:
        devices.remove()
        return None, f"cannot cap the fast devices under {groups.bench} ({exc})"
    if cores:
        devices = dataclasses.replace(devices, cpuset_root=os.path.join(CPUSET_ROOT, os.path.basename(groups.bench)))
        try:
            _pin(devices)
        except OSError as exc:
            devices.remove()
            return None, f"cannot create the devices' cpusets under {CPUSET_ROOT} ({exc})"
    throttled = devices.groups_of(THROTTLED)
    ticker = (start_ticker(throttled, args.ticker_us),) if args.ticker_us else ()
    ticker += tuple(start_ticker(devices.groups_of(dev), args.ticker_us) for dev in capped if args.ticker_us)
    devices = dataclasses.replace(devices, helpers=ticker)
    args.speed_ratio = None
    if args.calibrate and cores:
        try:
            args.speed_ratio = calibrate_quota(args, devices, auto_period)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            devices.remove()
            return None, f"cannot calibrate the throttled device's quota ({exc})"
    filler = (start_filler(throttled, filler_grace_us(args)),) if args.filler else ()
    return dataclasses.replace(devices, helpers=ticker + filler), ""


# a child timing a stage-like micro-batch: argv model, seq, rows, one argument of its own, then the groups it enters
_STAGE_CHILD = r'''
import os, random, statistics, sys, time, torch
torch.set_num_threads(1)
for group in sys.argv[5:]:
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
from profiler.layer import LayerShape
from profiler.wake import stage_sequence
from tangram_launch.specs.model import load_model
fn = stage_sequence(load_model(sys.argv[1]), LayerShape(int(sys.argv[3]), int(sys.argv[2]), "fp32"),
                    torch.device("cpu"))
fn()
'''
_SPEED_CHILD = _STAGE_CHILD + r'''
deadline, blocks = time.perf_counter() + float(sys.argv[4]), []
while time.perf_counter() < deadline or len(blocks) < 3:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.25:  # tens of quota periods
        fn()
        n += 1
    blocks.append((time.perf_counter() - t0) / n)
print(statistics.median(blocks))
'''
CALIBRATE_ROWS = 16
CALIBRATE_S = 3.0


def seconds_per_call(args, groups: list[str]) -> float:
    """Wall seconds per call of a stage-like micro-batch (profiler.wake.stage_sequence: the embedding, a layer, the
    head and loss, forward then backward) at ``CALIBRATE_ROWS`` rows, back to back, in ``groups``."""
    out = subprocess.run([sys.executable, "-c", _SPEED_CHILD, args.model, str(args.seq_len), str(CALIBRATE_ROWS),
                          str(CALIBRATE_S), *groups], env=base._env(), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    if out.returncode:
        raise RuntimeError(f"timing a stage-like micro-batch: {out.stderr.strip()[-600:]}")
    return float(out.stdout.split()[-1])


@dataclasses.dataclass(frozen=True)
class Quota:
    """A CFS bandwidth limit: ``core`` of a core per ``period_us``."""

    core: float
    period_us: int


def set_quota(devices: Devices, quota: Quota) -> None:
    group = devices.group_of[THROTTLED]
    base._write(os.path.join(group, "cpu.cfs_period_us"), quota.period_us)
    base._write(os.path.join(group, "cpu.cfs_quota_us"), max(1000, int(quota.core * quota.period_us)))


def calibrated_quota(start: Quota, target: float, speed_ratio: Callable[[Quota], float], *, auto_period: bool,
                     rounds: int = 5, tolerance: float = 0.04, least: int = 2) -> tuple[Quota, float]:
    """The quota at which ``speed_ratio`` (the throttled device's speed over a fast one's, measured under a quota)
    is within ``tolerance`` of ``target``, and the ratio measured there: from ``start``, at most ``rounds`` more
    measurements, each at target / k, k the median of ratio / quota over every reading so far (a device's speed is
    about proportional to its quota), capped at a whole core; with ``auto_period`` the period follows (the shortest
    whose quota is 1 ms, the kernel's least). At least ``least`` measurements: one 3-second reading of a device under
    a CFS quota varied from 0.238 to 0.512 of a fast device at 0.165 of a core (five calibrations on one day), so one
    reading near the target is not trusted alone, and a median keeps one wild reading from steering the rest."""
    quota, ratio = start, speed_ratio(start)
    slopes = [ratio / quota.core]
    for _ in range(rounds):
        if len(slopes) >= least and abs(ratio / target - 1) <= tolerance:
            break
        slope = statistics.median(slopes)
        core = min(1.0, target / slope) if slope > 0 else 1.0
        quota = Quota(core, shortest_period_us(core) if auto_period else quota.period_us)
        ratio = speed_ratio(quota)
        slopes.append(ratio / core)
    return quota, ratio


def calibrate_quota(args, devices: Devices, auto_period: bool) -> float:
    """Set the throttled device's quota so that it computes at ``args.quota`` of a fast device's speed, measured
    (``calibrated_quota``); returns the speed ratio measured at the quota set.

    A fast device's time is a stage-like micro-batch's alone in its groups (over its core share where it is not
    capped: ``--no-fast-quota``); the throttled device's is measured in its groups, ticker running.

    Why: the quota alone does not set the speed. The ticker's wake-ups are spent from the quota, and each burst of
    a short period starts on caches that other work used meanwhile, so a device computes well below its quota's
    nominal share of a core (benchmarks/README.md)."""
    cores = [devices.core_of[d] for d in range(3)]
    fast_s = seconds_per_call(args, devices.groups_of(0))  # a capped device computes at its share alone too
    if 0 not in devices.capped:
        fast_s /= fast_core_share(cores)

    def speed_ratio(quota: Quota) -> float:
        set_quota(devices, quota)
        return fast_s / seconds_per_call(args, devices.groups_of(THROTTLED))

    quota, ratio = calibrated_quota(Quota(args.quota_core, args.period_us), args.quota, speed_ratio,
                                    auto_period=auto_period)
    args.quota_core, args.period_us = quota.core, quota.period_us
    return ratio


def _pin(devices: Devices) -> None:
    """A cpuset per device under ``devices.cpuset_root``: its core, the host's memory nodes."""
    root = devices.cpuset_root
    with open(os.path.join(CPUSET_ROOT, "cpuset.mems")) as f:
        mems = f.read().strip()
    os.mkdir(root)
    base._write(os.path.join(root, "cpuset.cpus"), ",".join(map(str, sorted(set(devices.core_of.values())))))
    base._write(os.path.join(root, "cpuset.mems"), mems)
    for dev, core in devices.core_of.items():
        path = os.path.join(root, f"device{dev}")
        os.mkdir(path)
        devices.cpuset_of[dev] = path
        base._write(os.path.join(path, "cpuset.cpus"), str(core))
        base._write(os.path.join(path, "cpuset.mems"), mems)


_FILLER = r'''
import os, sys, time
grace_s, gap_s, parent = float(sys.argv[1]), float(sys.argv[2]), os.getppid()
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
last, n = time.monotonic(), 0
while True:
    now = time.monotonic()
    if now - last > gap_s:  # it did not run meanwhile: its worker computed, or the group was throttled
        time.sleep(grace_s)  # a wait shorter than this spends nothing
        now = time.monotonic()
        n += 1
        if n % 1000 == 0 and os.getppid() != parent:  # ends with the benchmark, even a killed one
            break
    last = now
'''
FILLER_GAP_S = 2e-4  # longer than the ticker's turn on the core: a jump this long means the filler was not running


def filler_grace_us(args) -> int:
    """How long the worker may wait before the filler spends its quota: ``--filler-grace-us``, at most half of
    what the period leaves after the quota, so that in a long wait each period's quota is still spent."""
    quota_us = max(1000, args.quota_core * args.period_us)
    return int(min(args.filler_grace_us, max(0.0, (args.period_us - quota_us) / 2)))


def start_filler(groups: list[str], grace_us: int) -> subprocess.Popen:
    """A busy loop at SCHED_IDLE in the throttled device's groups: it takes the device's CPU only while the worker
    waits, so the CFS quota is spent on a fixed clock, as if the device were always busy; but only once the worker
    has waited ``grace_us``.

    Why: a quota caps a duty cycle, enforced at the kernel's tick, not a speed. A worker that waits (for its
    pipeline neighbour) leaves its quota unspent, and its next calls run at full speed until the quota is spent:
    a stage that is not the pipeline's busiest reads faster than the profile measured it. With the filler the
    worker gets the quota's share of the core whenever it computes, busy or not, as a slower device would.
    Why a grace (``--filler-grace-us``): a filler that spends the quota from the first microsecond of every wait
    charges each short wait (a p2p handshake between two micro-batches) at the quota's rate, several times its
    length, where a slower device loses just the wait. With a grace the host's other work runs on the core in the
    short waits instead; the pipeline's slowest stage measured the same either way (benchmarks/README.md)."""
    def enter() -> None:
        for group in groups:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", _FILLER, str(grace_us / 1e6), str(FILLER_GAP_S)],
                            preexec_fn=enter, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_TICKER = r'''
import os, sys, time
parent, interval_s = os.getppid(), float(sys.argv[1])
while os.getppid() == parent:  # ends with the benchmark, even a killed one
    time.sleep(interval_s)
'''


def start_ticker(groups: list[str], interval_us: int) -> subprocess.Popen:
    """A process in the throttled device's groups that wakes every ``interval_us`` and sleeps again at once.

    Why: the kernel checks a group's CFS quota when it updates the group's clock: at its tick (4 ms here) or when
    a task of the group is queued or dequeued. A worker that has waited wakes with its group's quota refilled (the
    throttled time fell inside its wait), and a call shorter than a tick then ran at full speed: a stage-like
    micro-batch took about as long after a 20 ms sleep as unthrottled, several times faster than back to back
    (``--probe-throttle``, benchmarks/README.md). The ticker's wake-ups check the quota every ``interval_us``, so
    the worker computes at its quota's speed after a wait as back to back, as a slower device does."""
    def enter() -> None:
        for group in groups:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    return subprocess.Popen([sys.executable, "-c", _TICKER, str(interval_us / 1e6)], preexec_fn=enter,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cores(args) -> list[int]:
    """The CPU of each device (``--cores``: indices into the CPUs this process may use), [] for none."""
    if not args.cores:
        return []
    avail = sorted(os.sched_getaffinity(0))
    picks = [int(x) for x in args.cores.split(",")]
    if len(picks) != 3 or any(not 0 <= i < len(avail) for i in picks):
        raise SystemExit(f"--cores: three indices into this process's {len(avail)} CPUs, got {args.cores!r}")
    return [avail[i] for i in picks]


def _thread_cpu_s(pid: int) -> dict:
    """{thread id: (name, CPU seconds: user + system)} of every thread of ``pid`` (/proc; {} once it is gone)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime, stime (fields 14, 15)
    return out


@dataclasses.dataclass
class ThreadCpu:
    """Per worker, its threads' CPU seconds when the training's timings first hold a step on every rank and at
    the last look before it exits, with the steps each rank had written then: the CPU per micro-batch of the main
    thread and of the others (gloo's, the autograd engine's) over the steps between."""

    timings_dir: str | None = None
    first: dict = dataclasses.field(default_factory=dict)  # pid -> (steps written, {tid: (name, s)})
    last: dict = dataclasses.field(default_factory=dict)

    def _steps(self, pid: int) -> int | None:
        rank = _env_int(pid, b"RANK")
        try:
            with open(os.path.join(self.timings_dir, f"rank{rank}.jsonl")) as f:
                return sum(1 for _ in f)
        except (OSError, TypeError):
            return None

    def look(self, placed: dict) -> None:
        if self.timings_dir is None:
            return
        for pid in placed:
            steps, cpu = self._steps(pid), _thread_cpu_s(pid)
            if not cpu or steps is None or steps < 1:
                continue
            self.first.setdefault(pid, (steps, cpu))
            self.last[pid] = (steps, cpu)

    def per_microbatch_ms(self, pid: int, microbatches: int) -> tuple[float, float] | None:
        """(main thread, other threads) CPU ms per micro-batch between the first and the last look."""
        if pid not in self.first or pid not in self.last:
            return None
        (s0, a), (s1, b) = self.first[pid], self.last[pid]
        if s1 <= s0:
            return None
        delta = {tid: b[tid][1] - a.get(tid, (None, 0.0))[1] for tid in b}
        main = delta.pop(pid, 0.0)
        n = (s1 - s0) * microbatches
        return main / n * 1e3, sum(delta.values()) / n * 1e3


def _place_workers(root: int, device_of, devices: Devices, done: threading.Event, placed: dict,
                   cpu: ThreadCpu | None = None) -> None:
    """Move each worker of ``root``'s process tree into its device's groups as soon as it appears (every 20 ms: a
    worker spends seconds importing torch and meeting its peers before its first measured call)."""
    while not done.is_set():
        if cpu is not None:
            cpu.look(placed)
        for pid in base._descendants(root):
            if pid in placed or _env_int(pid, b"LOCAL_RANK") is None:
                continue
            try:
                device = device_of(pid)  # once: a worker that exits meanwhile has no environment to read again
                for group in devices.groups_of(device):
                    with open(os.path.join(group, "cgroup.procs"), "w") as f:
                        f.write(str(pid))
                placed[pid] = device
            except (OSError, TypeError):  # gone (no LOCAL_RANK to read any more)
                continue
        done.wait(0.02)


def _env_int(pid: int, name: bytes) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[name]) if name in env else None
    except (OSError, ValueError):
        return None


def run_placed(cmd: list[str], cwd: str, devices: Devices | None, device_of, timeout_s: float, what: str,
               cpu: ThreadCpu | None = None) -> dict:
    """Run ``cmd`` in the bench group, its workers each moved into its device's group; {pid: device} placed.
    ``cpu``: where to sample the workers' thread CPU times."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=base._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=base._join(devices.bench) if devices else None)
    placed: dict[int, int] = {}
    watch = None if devices is None else (lambda done: _place_workers(proc.pid, device_of, devices, done, placed,
                                                                      cpu))
    base.wait_watched(proc, watch, timeout_s, what)
    if devices is not None and THROTTLED not in placed.values():
        raise RuntimeError(f"{what}: the throttled device's worker was never found to move into its cgroup")
    return placed


def profile(args, devices: Devices | None, out: str) -> None:
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--standalone", "--nproc-per-node", "3",
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", args.micro_batches,
           "--layer-budget-s", str(args.layer_budget_s), "--layer-dtype", "fp32", "--layer-timing", args.layer_timing,
           "--timeout-s", "300", "-o", out]
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


def all_devices_plan(cluster, model, training, iset, opts, b_values, min_mbs: int = 1):
    """The best plan by the measured-priced cost model among those that give each device (island) a stage of its
    own: every split of the layers into one contiguous stage per island, in every island order, at every
    micro-batch size whose rows per replica are at least ``min_mbs`` (the manual-plan path prices each like the
    planner)."""
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
                if min(s.micro_batch_size for s in plan.stages) < min_mbs:
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
        measured = all_devices_plan(cluster, model, training, iset, opts, b_values, args.min_micro_batch)
        note = (f"the planner's plan leaves out {dropped or 'a device'}; the best plan with a stage on every device "
                f"and at least {args.min_micro_batch} rows per replica and micro-batch (measured-priced) instead")
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
    # one node: local rank i runs the plan's i-th local GPU (the plan's rank is set later, by the worker's boot)
    gpus = sorted(e.local_gpu for e in plan.rank_layout)
    cpu = ThreadCpu(os.path.join(run_dir, "timings"))
    helpers0 = {h.pid: sum(c for _n, c in _thread_cpu_s(h.pid).values()) for h in (devices.helpers if devices else ())}
    t0 = time.perf_counter()
    placed = run_placed(cmd, workdir, devices, lambda pid: gpus[_env_int(pid, b"LOCAL_RANK")], args.timeout_s,
                        "training run", cpu)
    with open(os.path.join(run_dir, "run-report.json"), encoding="utf-8") as f:
        report = json.load(f)
    wall = time.perf_counter() - t0
    # the ticker's and the filler's CPU, of a core, over the training run: what they took of the throttled quota
    report["helpers_core_share"] = [round((sum(c for _n, c in _thread_cpu_s(pid).values()) - c0) / wall, 4)
                                    for pid, c0 in helpers0.items()]
    report["thread_cpu_ms"] = {str(dev): cpu.per_microbatch_ms(pid, plan.num_microbatches)
                               for pid, dev in sorted(placed.items(), key=lambda kv: kv[1])}
    return report


def rows(measured_plan, analytic_plan, report) -> list[dict]:
    out = []
    for s, pm, pa, r in zip(measured_plan.stages, measured_plan.predicted.stages, analytic_plan.predicted.stages,
                            report["stages"]):
        got = r["measured"]["forward_s"] + r["measured"]["backward_s"]
        mark = pm.measured or {}
        out.append({"stage": s.index, "island": s.island, "layers": list(s.layers), "tp": s.tp, "dp": s.dp,
                    "micro_batch": s.micro_batch_size, "priced": f"{mark.get('how', '-')} d={mark.get('distance', '-')}",
                    "predicted_measured_s": pm.time_s, "predicted_analytic_s": pa.time_s, "measured_s": got,
                    "error_measured": pm.time_s / got - 1, "error_analytic": pa.time_s / got - 1,
                    # where the error sits: the measured-priced forward and backward, each against the run's
                    "forward_predicted_s": pm.forward_s, "forward_measured_s": r["measured"]["forward_s"],
                    "backward_predicted_s": pm.backward_s, "backward_measured_s": r["measured"]["backward_s"]})
    return out


def format_table(table: list[dict], report, measured_plan, analytic_plan) -> str:
    head = ("stage", "island", "layers", "tp x dp, b", "priced", "pred. measured ms", "pred. analytic ms",
            "measured ms", "err measured", "err analytic", "fwd pred./meas. ms", "bwd pred./meas. ms")
    lines = [head]
    for r in table:
        a, b = r["layers"]
        lines.append((str(r["stage"]), r["island"], f"{a}-{b - 1}", f"{r['tp']}x{r['dp']}, {r['micro_batch']}",
                      r["priced"], f"{r['predicted_measured_s'] * 1e3:.3f}", f"{r['predicted_analytic_s'] * 1e3:.3f}",
                      f"{r['measured_s'] * 1e3:.3f}", f"{r['error_measured']:+.1%}", f"{r['error_analytic']:+.1%}",
                      f"{r['forward_predicted_s'] * 1e3:.2f}/{r['forward_measured_s'] * 1e3:.2f}",
                      f"{r['backward_predicted_s'] * 1e3:.2f}/{r['backward_measured_s'] * 1e3:.2f}"))
    it = report["iteration"]["measured_median_s"]
    lines.append(("iteration", "", "", "", "", f"{measured_plan.predicted.iteration_time_s * 1e3:.2f}",
                  f"{analytic_plan.predicted.iteration_time_s * 1e3:.2f}", f"{it * 1e3:.2f}",
                  f"{measured_plan.predicted.iteration_time_s / it - 1:+.1%}",
                  f"{analytic_plan.predicted.iteration_time_s / it - 1:+.1%}", "", ""))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def parts_line(run: dict) -> str:
    """The measured-priced iteration in the run report's parts (pipeline, sync, optimizer; ms per step), predicted
    and measured on the rank whose backward ended last: where the iteration's error sits."""
    parts = iteration_parts(run["iteration"])
    cells = [f"{name} {pred * 1e3:.2f}/{meas * 1e3:.2f}" for name, (pred, meas) in parts.items()
             if pred is not None and meas is not None]
    return "iteration parts, predicted/measured ms: " + (", ".join(cells) or "not marked")


def thread_cpu_line(run: dict) -> str:
    """Each device's worker: CPU ms per micro-batch of its main thread and of its other threads (gloo's p2p and
    collective work among them) over the training's steps."""
    parts = [f"device {dev}: {ms[0]:.2f} + {ms[1]:.2f}" for dev, ms in (run.get("thread_cpu_ms") or {}).items()
             if ms is not None]
    helpers = run.get("helpers_core_share")
    return ("CPU ms per micro-batch, main thread + other threads: " + ("; ".join(parts) or "not sampled")
            + (f"; the helpers (the tickers, throttled device's first, then the filler) took {helpers} of a core"
               if helpers else ""))


def summarize(runs: list[dict], limit: float = 0.10) -> list[str]:
    """Per run and over all runs: stages within ``limit`` and the worst stage's error, for each pricing."""
    lines = []
    for col, name in (("error_measured", "measured-priced"), ("error_analytic", "analytic")):
        errs = [[abs(r[col]) for r in run["stages"]] for run in runs]
        every = sum(all(e <= limit for e in run) for run in errs)
        flat = sorted(e for run in errs for e in run)
        per_run = "; ".join(f"run {i + 1}: {sum(e <= limit for e in run)}/{len(run)} within {limit:.0%}, worst "
                            f"{max(run):.1%}" for i, run in enumerate(errs))
        lines.append(f"{name}: {every} of {len(runs)} runs with every stage within {limit:.0%}; median |error| per "
                     f"stage {statistics.median(flat):.1%}, worst {flat[-1]:.1%} ({per_run})")
    return lines


def one_run(args, devices: Devices | None, workdir: str) -> dict:
    """Profile (unless ``--cluster``), plan, train once; the per-stage rows and what the run was like."""
    os.makedirs(workdir, exist_ok=True)
    cluster_path = args.cluster or os.path.join(workdir, "cluster.yaml")
    load0, started = base.load_avg(), time.perf_counter()
    if not args.cluster:
        profile(args, devices, cluster_path)
    profile_s = time.perf_counter() - started
    measured_plan, analytic_plan, note = plans(args, cluster_path)
    measured_plan.dump(os.path.join(workdir, "plan-measured.json"))
    analytic_plan.dump(os.path.join(workdir, "plan-analytic.json"))
    started = time.perf_counter()
    report = train(args, measured_plan, devices, workdir)
    return {"stages": rows(measured_plan, analytic_plan, report), "iteration": report["iteration"],
            "steps_measured": report["steps_measured"], "num_microbatches": measured_plan.num_microbatches,
            "thread_cpu_ms": report.get("thread_cpu_ms"), "helpers_core_share": report.get("helpers_core_share"),
            "note": note, "profile_s": profile_s, "train_s": time.perf_counter() - started,
            "load_avg": [load0, base.load_avg()], "workdir": workdir,
            "table": format_table(rows(measured_plan, analytic_plan, report), report, measured_plan, analytic_plan)}


def probe_wait(args) -> list[str]:
    """Forward and backward CPU milliseconds per micro-batch (this thread's CPU time, one thread) of the training's
    own stage module (layers 1-3 and the head, with the loss, at ``--probe-micro-batch`` rows), run as a pipeline's
    last stage runs it (each micro-batch a fresh input, its forward then its backward), once back to back and once
    sleeping ``--probe-sleep-ms`` before each micro-batch, as a stage does while it waits for a slower neighbour;
    and one dense layer of the profiler's stand-ins beside the training's, back to back.

    Why: in the runs above, the fast pair's forward took about twice the CPU time the profile priced, its backward
    what the profile priced. What differs is the wait: the profile times its layers without pause."""
    import torch
    import torch.nn.functional as F

    from profiler.layer import build_layer
    from runtime_adapters.gpt import StageModule

    torch.set_num_threads(1)
    spec, b, t = load_model(args.model), args.probe_micro_batch, args.seq_len
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (b, t), generator=gen)  # (B, T)

    def stage_ms(module, sleep_s: float, n: int = 60) -> tuple[float, float]:
        fwd, bwd = [], []
        for _ in range(n):
            x = torch.randn(b, t, spec.hidden_size, generator=gen, requires_grad=True)  # (B, T, H), as received
            if sleep_s:
                time.sleep(sleep_s)
            t0 = time.thread_time()
            loss = F.cross_entropy(module(x).flatten(0, 1), tokens.flatten())
            t1 = time.thread_time()
            loss.backward()
            fwd.append(t1 - t0)
            bwd.append(time.thread_time() - t1)
        return statistics.median(fwd[5:]) * 1e3, statistics.median(bwd[5:]) * 1e3

    def layer_ms(layer, sleep_s: float, n: int = 60) -> tuple[float, float]:
        x = torch.randn(b, t, spec.hidden_size, generator=gen, requires_grad=True)  # (B, T, H)
        grad = torch.randn(b, t, spec.hidden_size, generator=gen)
        fwd, fb = [], []
        for _ in range(n):
            if sleep_s:
                time.sleep(sleep_s)
            t0 = time.thread_time()
            layer(x)
            t1 = time.thread_time()
            if sleep_s:  # each call after a sleep
                time.sleep(sleep_s)
                t1 = time.thread_time()
            layer(x).backward(grad)
            fwd.append(t1 - t0)
            fb.append(time.thread_time() - t1)
        f = statistics.median(fwd[5:]) * 1e3
        return f, statistics.median(fb[5:]) * 1e3 - f

    stage = StageModule(spec, (1, spec.num_layers), has_embedding=False, has_head=True)
    lines = [f"{args.model}, {b} x {t} rows, one thread; CPU ms per micro-batch, forward / backward:"]
    for what, sleep_s in (("back to back", 0.0), (f"sleeping {args.probe_sleep_ms:g} ms before each micro-batch",
                                                   args.probe_sleep_ms / 1e3), ("back to back again", 0.0)):
        f, bwd = stage_ms(stage, sleep_s)
        lines.append(f"  training's stage module (layers 1-{spec.num_layers - 1} + head + loss), {what}: "
                     f"{f:.3f} / {bwd:.3f}")
    stand_in = build_layer(spec, "dense", torch.device("cpu"), "fp32")
    for what, layer, sleep_s in (("profiler's stand-in, back to back", stand_in, 0.0),
                                 (f"profiler's stand-in, sleeping {args.probe_sleep_ms:g} ms before each call",
                                  stand_in, args.probe_sleep_ms / 1e3),
                                 ("training's, back to back", stage.layers["1"], 0.0)):
        f, bwd = layer_ms(layer, sleep_s)
        lines.append(f"  one dense layer, the {what}: {f:.3f} / {bwd:.3f} (backward: forward+backward - forward)")
    return lines


_THROTTLE_CHILD = r'''
import os, sys, torch
torch.set_num_threads(1)
for group in sys.argv[5:]:
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
from profiler.layer import LayerShape
from profiler.wake import stage_sequence, time_wake_up
from tangram_launch.specs.model import load_model
model, seq = load_model(sys.argv[1]), int(sys.argv[2])
for rows in (8, 16):
    fn = stage_sequence(model, LayerShape(rows, seq, "fp32"), torch.device("cpu"))
    got = [dict(time_wake_up(fn, torch.device("cpu"), budget_s=3.0, sleep_s=float(s)).detail) for s in sys.argv[3:5]]
    print(f"{rows} rows: back to back {got[0]['back_to_back_s'] * 1e3:.2f} ms, after a "
          f"{got[0]['sleep_s'] * 1e3:g} ms sleep {got[0]['after_sleep_s'] * 1e3:.2f} ms; back to back "
          f"{got[1]['back_to_back_s'] * 1e3:.2f} ms, after a {got[1]['sleep_s'] * 1e3:g} ms sleep "
          f"{got[1]['after_sleep_s'] * 1e3:.2f} ms", flush=True)
'''


def probe_throttle(args) -> list[str]:
    """The profiler's wake-up measurement in the throttled device's groups and in a fast one's (see --probe-throttle),
    after a long and after a short sleep.

    Why: a CFS quota is a duty cycle enforced at the kernel's tick, not a speed; a device that waits may compute
    its next call at full speed (benchmarks/README.md), and one whose idle quota a filler spends may pay a short
    wait several times over. A slower device computes a call in the same time after any wait as back to back."""
    devices, why = make_devices(args)
    if devices is None:
        raise SystemExit(f"--probe-throttle: {why}")
    lines = [describe(args, devices)]
    try:
        for device in (THROTTLED, 0):
            out = subprocess.run([sys.executable, "-c", _THROTTLE_CHILD, args.model, str(args.seq_len),
                                  str(args.probe_sleep_ms / 1e3), str(args.probe_short_sleep_ms / 1e3),
                                  *devices.groups_of(device)], env=base._env(),
                                 cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
            if out.returncode:
                raise RuntimeError(f"--probe-throttle on device {device}: {out.stderr.strip()[-800:]}")
            lines += [f"device {device} ({'throttled' if device == THROTTLED else 'fast, alone on its core'}), "
                      f"wall time per micro-batch:"] + [f"  {line}" for line in out.stdout.splitlines()]
    finally:
        lines += devices.remove()
    return lines


_PAIR_CHILD = _STAGE_CHILD + r'''
waits, deadline, times = sys.argv[4] == "waits", time.perf_counter() + 6.0, []
random.seed(os.getpid())
while time.perf_counter() < deadline:
    if waits:  # a stage behind a slower one: out of step with its neighbour
        time.sleep(random.uniform(0.005, 0.03))
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
print(statistics.median(times))
'''


def probe_pair(args) -> list[str]:
    """The fast devices' speed alone and beside each other, back to back and with random waits (5-30 ms) before
    each call, uncapped (as ``--no-fast-quota`` leaves them) and capped (``make_devices``): wall ms per stage-like
    micro-batch.

    Why: the profile times the two fast devices busy at once; in a run they wait behind the throttled stage and
    wake out of step. A device whose speed depends on whether its neighbour is busy is priced at the wrong speed."""
    lines = []
    for capped in (False, True):
        trial = argparse.Namespace(**{**vars(args), "fast_quota": capped, "calibrate": False})
        devices, why = make_devices(trial)
        if devices is None:
            raise SystemExit(f"--probe-pair: {why}")
        try:
            lines.append(f"fast devices {'capped' if capped else 'uncapped'}, wall ms per micro-batch:")
            for rows in (8, 16):
                got = []
                for pair, mode in ((False, "back-to-back"), (True, "back-to-back"), (True, "waits")):
                    procs = [subprocess.Popen([sys.executable, "-c", _PAIR_CHILD, args.model, str(args.seq_len),
                                               str(rows), mode, *devices.groups_of(d)], env=base._env(), cwd=REPO,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                             for d in ((0, 1) if pair else (0,))]
                    outs = [proc.communicate(timeout=args.timeout_s) for proc in procs]
                    if any(proc.returncode for proc in procs):
                        raise RuntimeError(f"--probe-pair: {outs[0][1].strip()[-800:]}")
                    got.append("/".join(f"{float(out.split()[-1]) * 1e3:.2f}" for out, _err in outs))
                lines.append(f"  {rows} rows: alone back to back {got[0]}; both back to back {got[1]}; both with "
                             f"random waits {got[2]}")
        finally:
            lines += devices.remove()
    return lines


def describe(args, devices: Devices | None) -> str:
    if devices is None:
        return "the three devices unthrottled, not pinned"
    cores = [devices.core_of.get(d) for d in range(3)]
    share = fast_core_share(cores) if devices.core_of else 1.0
    capped = devices.capped
    tickers = ("a ticker in its groups and one in each capped fast device's check" if capped else
               "a ticker in its groups checks")
    measured = ("" if args.speed_ratio is None else
                f", {args.speed_ratio:.3f} measured ({CALIBRATE_ROWS} rows of a stage-like micro-batch back to back "
                f"against a fast device alone in its groups{'' if capped else ' over its share'})")
    return (f"device {THROTTLED} at {args.quota:.0%} of a fast device's speed (CFS quota {args.quota_core:.3f} of "
            f"a core, period {args.period_us} us{measured}); fast devices {share:g} core each"
            + (f", capped there by a CFS quota (period {shortest_period_us(share)} us)" if capped else "")
            + (f"; devices on CPUs {cores}" if devices.core_of else "; not pinned")
            + (f"; a SCHED_IDLE filler spends the throttled device's quota once its worker has waited "
               f"{filler_grace_us(args)} us" if args.filler else "")
            + (f"; {tickers} the quota every {args.ticker_us} us" if args.ticker_us else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quota", type=float, default=0.33, help="the throttled device's speed, of a fast device's")
    p.add_argument("--cores", default="0,0,1",
                   help="each device's CPU, as indices into the CPUs this process may use (cpusets; '' : not "
                        "pinned). The default puts the two fast devices (one stage's data-parallel replicas, busy "
                        "at the same time) on one core, half a core each, and the throttled device alone on the other")
    p.add_argument("--period-us", type=int, default=0,
                   help="CFS period of the throttled device's cgroup (0: the shortest whose quota is 1 ms, the "
                        "kernel's least). With the ticker, a short period keeps the device's speed after a wait "
                        "what it is back to back; without it, the kernel enforces the quota at its tick (4 ms here) "
                        "and the device runs in bursts of whole ticks, whatever the period")
    p.add_argument("--shares", type=int, default=262144, help="cpu.shares of the benchmark's group")
    p.add_argument("--ticker-us", type=int, default=1000,
                   help="a process in the throttled device's groups wakes this often, so the kernel checks the "
                        "quota then and not only at its tick (0: none; a worker then computes a call shorter than a "
                        "tick at full speed after each wait)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="keep the quota at --quota times a fast device's core share instead of setting it so that "
                        "the throttled device measures --quota of a fast device's speed")
    p.add_argument("--filler-grace-us", type=int, default=0,
                   help="the filler spends the throttled device's quota only once its worker has waited this long "
                        "(at most half of what the period leaves after the quota), as a slower device loses just a "
                        "short wait, not its quota's worth of compute; but meanwhile the host's other work runs on "
                        "the device's core and cools its caches (0: from the first microsecond)")
    p.add_argument("--no-fast-quota", dest="fast_quota", action="store_false",
                   help="leave the fast devices that share a core uncapped: each then computes at its whole core "
                        "whenever its neighbour waits, where the profile timed both busy at once")
    p.add_argument("--no-filler", dest="filler", action="store_false",
                   help="no busy loop at SCHED_IDLE in the throttled device's groups (its worker then runs at full "
                        "speed after each wait, until its quota is spent)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--micro-batches", default="8,16,32,64", help="the micro-batch sizes the profile measures")
    p.add_argument("--min-micro-batch", type=int, default=8,
                   help="where the planner leaves a device out: the plan on every device has at least this many "
                        "rows per replica and micro-batch (a tiny layer call on fewer is mostly per-operator overhead)")
    p.add_argument("--layer-budget-s", type=float, default=LAYER_BUDGET_S,
                   help="the profile's layer budget per device (default: the product's)")
    p.add_argument("--layer-timing", default="back-to-back", choices=("back-to-back", "interleaved"),
                   help="how the profile times the layers (profile --layer-timing): back to back, each device busy "
                        "throughout, as the throttled device is in training when its stage is the pipeline's busiest")
    p.add_argument("--steps", type=int, default=20, help="training steps (the first is left out of the report)")
    p.add_argument("--runs", type=int, default=1, help="profile, plan and train this many times")
    p.add_argument("--cluster", help="reuse this profile instead of profiling")
    p.add_argument("--keep", help="keep the profile, plans and run directories here")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--probe-wait", action="store_true",
                   help="instead of the benchmark: the training's stage module timed back to back and sleeping "
                        "before each micro-batch, in this process (run it pinned to one core: taskset -c 1)")
    p.add_argument("--probe-throttle", action="store_true",
                   help="instead of the benchmark (root): a stage-like micro-batch back to back and after a sleep, "
                        "in the throttled device's groups and in a fast device's")
    p.add_argument("--probe-pair", action="store_true",
                   help="no benchmark: the fast devices' speed alone, together and with random waits, capped and "
                        "not (root)")
    p.add_argument("--probe-micro-batch", type=int, default=8)
    p.add_argument("--probe-sleep-ms", type=float, default=30.0)
    p.add_argument("--probe-short-sleep-ms", type=float, default=0.5,
                   help="--probe-throttle: the short wait, as a p2p handshake between two micro-batches")
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.probe_wait:
        print("\n".join(probe_wait(args)))
        return 0
    if args.probe_throttle:
        print("\n".join(probe_throttle(args)))
        return 0
    if args.probe_pair:
        print("\n".join(probe_pair(args)))
        return 0

    devices, why = make_devices(args)
    if devices is None:
        print(f"no throttled device ({why}): the three devices run unthrottled")
    top = args.keep or tempfile.mkdtemp(prefix="tangram-bench-measured-")
    runs = []
    print(f"{args.model}, seq {args.seq_len}, global batch {args.global_batch}, {args.steps} steps; "
          f"{describe(args, devices)}", flush=True)
    try:
        for i in range(args.runs):
            run = one_run(args, devices, os.path.join(top, f"run{i + 1}"))
            runs.append(run)
            print(f"\nrun {i + 1}: {run['num_microbatches']} micro-batches, {run['steps_measured']} steps measured; "
                  f"profile {run['profile_s']:.0f} s, training {run['train_s']:.0f} s; load average "
                  f"{run['load_avg'][0]} -> {run['load_avg'][1]}\nplan: {run['note']}\nper micro-batch, forward + "
                  f"backward (run-report.json medians):\n{run.pop('table')}\n{parts_line(run)}\n"
                  f"{thread_cpu_line(run)}", flush=True)
    except Exception as exc:  # a failed step: say which, exit 1
        print(f"bench_measured_cpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if devices is not None:
            for problem in devices.remove():
                print(problem, file=sys.stderr)
    print("\n" + "\n".join(summarize(runs)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "quota": args.quota if devices else None, "period_us": args.period_us,
                       "quota_core": getattr(args, "quota_core", None),
                       "speed_ratio": getattr(args, "speed_ratio", None), "cores": args.cores}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
