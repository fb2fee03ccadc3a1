"""The launcher's side of adapting: watch a segment, re-plan on a straggler, switch plans at a step boundary.

A run is a sequence of *segments*, one per plan. While a segment trains, a thread reads the workers' timing files
(every 0.5 s; no collective) and feeds :class:`.decide.Controller`. On a decision it logs what it would do; with
``--adapt``, when the decision is to switch, it writes a switch request for a step a little ahead of every rank
(:mod:`.handshake`). The workers save a checkpoint at that step into ``--checkpoint-dir`` and exit; the launcher
then starts them under the new plan (``--nproc-per-node`` set to the GPUs it uses, ``CUDA_VISIBLE_DEVICES`` to
which), and they resume from that checkpoint through the layout-agnostic path: same samples, same RNG streams.

The price of a switch is what this run measured: at first twice the segment's start-up (launch to the end of the
first step, less that step: once to stop and reshard, once to start) plus twice the checkpoint saves the workers
timed (a save, and loading the same bytes under the new layout); after a switch, its measured downtime.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import math
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.launch.adapt import handshake
from tangram_launch.launch.adapt.decide import Candidate, Controller, Decision, Policy, Replan
from tangram_launch.launch.adapt.detect import DetectConfig, GpuKey, rank_places
from tangram_launch.launch.adapt.history import History, adaptation_line

logger = logging.getLogger(__name__)

POLL_S = 0.5
REQUEST_AHEAD_S = 1.0  # a request names a step at least this far ahead of the fastest rank (and 2 steps)


def check_adapt_options(opts: Any, *, single_node: bool) -> None:
    """``--adapt`` needs a cluster file to re-plan from, a checkpoint directory to switch through, one node."""
    if not opts.adapt:
        return
    if not opts.cluster:
        raise SpecError("--adapt re-plans from a cluster file: give --cluster FILE (`tangram-launch profile -o "
                        "FILE` writes one)", field="--adapt", valid="--adapt --cluster FILE")
    if not (opts.checkpoint_dir or opts.resume):
        raise SpecError("--adapt switches plans through a checkpoint: give --checkpoint-dir DIR", field="--adapt",
                        valid="--adapt --checkpoint-dir DIR")
    if not single_node:
        raise SpecError("--adapt re-plans one node's workers (each agent reads its own timing files)",
                        field="--nnodes", valid="1 (or --standalone)")


@dataclass(frozen=True)
class AdaptiveLaunch:
    """What the adaptive loop needs from the launcher, passed in (the launcher imports this module, not back)."""

    options: Any  # LaunchOptions
    planned: Any  # PlannedLaunch of the first segment
    staging: str  # where plan files go
    resume: Any  # CheckpointInfo of --resume, or None
    prepare: Callable[[argparse.Namespace, str], Any]  # (torchrun args, plan file) -> PlannedLaunch
    launch: Callable[[argparse.Namespace, Any, "str | None", str], int]  # (args, planned, resume dir, run dir) -> rc
    default_run_dir: Callable[[str], str]  # plan hash -> run directory


# --- the re-plan -----------------------------------------------------------------------------------------------------

def launcher_replan(*, cluster_path: str, opts: Any, resume: Any, out_dir: str, plan: Mapping[str, Any],
                    plan_hash: str) -> Replan:
    """The planner on the cluster file with each GPU's figures divided by its measured slowdown."""
    counter = [0]

    def replan(factors: Mapping[GpuKey, float]) -> Candidate:
        from tangram_launch.launch.calibration import RATIO_RANGE, calibrate
        from tangram_launch.launch.planning import make_launch_plan, plan_changes, planning_request, write_plan
        from tangram_launch.specs.cluster import ClusterSpec

        stage_of = {gpu: stage for gpu, stage in rank_places(plan).values()}
        # a slowdown beyond what calibrate takes from a report is planned at its edge: such a GPU is left out anyway
        lo, hi = RATIO_RANGE
        rows = [{"node": n, "local_gpu": g, "ratio": min(max(f, lo * 1.001), hi / 1.001)}
                for (n, g), f in sorted(factors.items())]
        report = {"plan_hash": plan_hash, "stages": [{"stage": stage_of.get((r["node"], r["local_gpu"]), 0),
                                                      "ranks": [r]} for r in rows]}
        counter[0] += 1
        cluster, _ = calibrate(ClusterSpec.load(cluster_path), report, untimed_as_twins=False)
        calibrated = os.path.join(out_dir, f"cluster-adapt-{plan_hash[:8]}-{counter[0]}.yaml")
        os.makedirs(out_dir, exist_ok=True)
        cluster.dump(calibrated)
        request = planning_request(opts, resume=resume, cluster=cluster, progress=False)
        new = make_launch_plan(cluster, request)
        path = write_plan(new, out_dir)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        new_dict = new.to_dict()
        same = not [line for line in plan_changes(plan, new_dict) if not line.startswith("cluster ")]
        return Candidate(plan=new_dict, plan_hash=digest, predicted_iteration_s=new.predicted.iteration_time_s,
                         same_as_current=same, plan_path=path, cluster_path=calibrated)

    return replan


# --- the watcher -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pending:
    decision: Decision
    at_step: int  # absolute step the workers save at and stop after
    entry: dict


class SwitchCosts:
    """What a switch costs, as this run measured it."""

    def __init__(self) -> None:
        self.startup_s: list[float] = []
        self.downtime_s: list[float] = []

    def estimate(self, run_dir: str) -> float:
        """The last switch's downtime; before any, a save and a load of the same bytes (the periodic saves the
        workers timed) and two start-ups: stopping the old workers and resharding cost about what starting did."""
        if self.downtime_s:
            return self.downtime_s[-1]
        saves = [s["save_s"] for s in handshake.read_saves(run_dir)]
        return 2 * (statistics.median(saves) if saves else 0.0) + 2 * (self.startup_s[-1] if self.startup_s else 0.0)


class Watcher(threading.Thread):
    """Polls one segment's timing files; decides; with ``acting``, requests the switch."""

    def __init__(self, *, run_dir: str, controller: Controller, acting: bool, costs: SwitchCosts, history: History,
                 segment: dict, poll_s: float = POLL_S) -> None:
        super().__init__(name="tangram-adapt", daemon=True)
        self.run_dir, self.controller, self.acting, self.costs = run_dir, controller, acting, costs
        self.history, self.segment, self.poll_s = history, segment, poll_s
        self.pending: Pending | None = None
        self.first_line_unix_s: float | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001  # adapting is never worth a failed run: say why, keep training
                logger.warning("adapt: %s: %s (the run continues under its plan)", type(exc).__name__, exc)

    def stop(self) -> None:
        self._stop_event.set()

    def poll(self) -> None:
        from tangram_launch.launch.run_report import read_timings

        timings = read_timings(self.run_dir)
        if not timings:
            return
        if self.first_line_unix_s is None:
            self._first_step(timings)
        latest = max(t["step"] for t in timings)
        if self.pending is not None:
            return
        had_baseline = self.controller.baseline_step_s is not None
        total = handshake.read_steps_total(self.run_dir)
        start = self.segment["start_step"]
        decision = self.controller.observe(
            timings, switch_cost_s=self.costs.estimate(self.run_dir),
            remaining_steps=None if total is None else total - start - latest)
        if not had_baseline and self.controller.baseline_step_s is not None:
            self.segment["step_s_median"] = self.controller.baseline_step_s
            self._measured_gain(self.controller.baseline_step_s)
        if decision is None:
            return
        entry = {**decision.to_dict(), "step": start + decision.step, "acted": self.acting, "switched": False,
                 "decided_unix_s": time.time(), "at_step": None, "downtime_s": None, "measured_step_s": None,
                 "measured_gain_s_per_step": None}
        self.history.adaptations.append(entry)
        self.history.save()
        if not (decision.switch and self.acting):
            logger.info("%s", adaptation_line(entry))
            return
        step_s = max(decision.current_step_s, 1e-3)
        at = latest + max(2, math.ceil(REQUEST_AHEAD_S / step_s))
        if total is not None and start + at >= total:  # a restart that would train nothing: whatever the horizon
            entry["switch"] = False
            entry["reason"] += f"; but the run ends at step {total}, before a step under the new plan (at {start + at})"
            self.history.save()
            logger.info("%s", adaptation_line(entry))
            return
        handshake.write_request(self.run_dir, start + at, plan_hash=decision.new_plan_hash)
        seen = max(t["step"] for t in read_timings(self.run_dir))
        if not handshake.request_in_time(seen, at):  # a rank may have passed it: withdraw, decide again later
            handshake.clear_request(self.run_dir)
            logger.warning("adapt: the workers passed step %d before the switch request was written; not switching",
                           start + at)
            entry["reason"] += "; the request came too late"
            return
        entry["at_step"] = start + at
        entry["new_stages"] = stage_layout(decision.new_plan or {})
        self.history.save()
        logger.info("adapt: step %d: %s; switching to plan %s at step %d (%s)", entry["step"], decision.cause,
                    decision.new_plan_hash[:8], start + at, decision.reason)
        self.pending = Pending(decision=decision, at_step=start + at, entry=entry)

    def _first_step(self, timings: list[dict]) -> None:
        firsts = [t for t in timings if t["step"] == 1 and t.get("step_s") is not None]
        if not firsts:
            return
        self.first_line_unix_s = time.time()
        first_step_s = max(t["step_s"] for t in firsts)
        self.segment["first_step_unix_s"] = self.first_line_unix_s
        self.costs.startup_s.append(max(0.0, self.first_line_unix_s - self.segment["started_unix_s"] - first_step_s))
        previous = [a for a in self.history.adaptations if a.get("switched") and a.get("downtime_s") is None]
        if previous:  # the end of the stop: the first step under the new plan, less that step's work
            ended = self.segment.get("stopped_unix_s") or self.segment["started_unix_s"]
            previous[-1]["downtime_s"] = max(0.0, self.first_line_unix_s - ended - first_step_s)
            self.costs.downtime_s.append(previous[-1]["downtime_s"])
            self.history.save()

    def _measured_gain(self, step_s: float) -> None:
        previous = [a for a in self.history.adaptations if a.get("switched") and a.get("measured_step_s") is None]
        if previous:
            entry = previous[-1]
            entry["measured_step_s"] = step_s
            entry["measured_gain_s_per_step"] = entry["current_step_s"] - step_s
            self.history.save()
            logger.info("%s", adaptation_line(entry))


def stage_layout(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per stage of a plan: its layer range [first, end) and the GPUs ("node:local") that run it, for the report."""
    return [{"layers": list(st.get("layers") or ()),
             "gpus": [f"{g.get('node')}:{g.get('local_gpu')}" for g in st.get("gpus") or () if isinstance(g, Mapping)]}
            for st in plan.get("stages") or ()]


# --- the loop --------------------------------------------------------------------------------------------------------

def _checkpoint_at(directory: str, step: int) -> bool:
    from tangram_launch.checkpoint.store import find_latest

    try:
        return find_latest(directory, checksums=False).step == step
    except SpecError:
        return False


def _archive_segment(run_dir: str, index: int) -> None:
    """Move a finished segment's timings and report aside: the next segment counts its steps from 1 again."""
    dest = os.path.join(run_dir, "segments", str(index))
    os.makedirs(dest, exist_ok=True)
    for name in ("timings", "run-report.json"):
        src = os.path.join(run_dir, name)
        if os.path.exists(src):
            shutil.move(src, os.path.join(dest, name))


def run_adaptive(ctx: AdaptiveLaunch) -> int:
    """Run segments until one ends without a switch; returns the last segment's exit status."""
    from tangram_launch.launch.lifetime import exported

    opts = ctx.options.tangram
    policy = Policy(detect=DetectConfig(threshold=opts.adapt_threshold or DetectConfig.threshold,
                                        window_steps=opts.adapt_window or DetectConfig.window_steps),
                    horizon_steps=opts.adapt_horizon)
    planned, args = ctx.planned, ctx.options.torchrun
    run_dir = os.path.abspath(opts.run_dir or ctx.default_run_dir(planned.plan_hash))
    os.makedirs(run_dir, exist_ok=True)
    handshake.clear_request(run_dir)
    ckpt_dir = opts.run_checkpoint_dir()
    ckpt_dir = os.path.abspath(ckpt_dir) if ckpt_dir else None
    history, costs = History(run_dir), SwitchCosts()
    cluster_path, resume_dir = opts.cluster, opts.resume
    start_step = ctx.resume.step if ctx.resume is not None else 0
    nproc0 = ctx.options.nproc_per_node
    visible0 = os.environ.get("CUDA_VISIBLE_DEVICES")
    env: dict[str, str] = {}
    stopped_unix_s = None
    while True:
        nproc = nproc0 if args is ctx.options.torchrun else int(args.nproc_per_node)  # the first: maybe "auto"
        segment = {"index": len(history.segments), "plan_hash": planned.plan_hash, "plan_path": planned.plan_path,
                   "nproc": nproc, "start_step": start_step, "started_unix_s": time.time(),
                   "stopped_unix_s": stopped_unix_s, "first_step_unix_s": None, "ended_unix_s": None,
                   "step_s_median": None}
        history.segments.append(segment)
        replan = launcher_replan(cluster_path=cluster_path, opts=opts, resume=ctx.resume, out_dir=ctx.staging,
                                 plan=planned.plan_dict, plan_hash=planned.plan_hash)
        controller = Controller(plan=planned.plan_dict, plan_hash=planned.plan_hash, replan=replan, policy=policy)
        watcher = Watcher(run_dir=run_dir, controller=controller, acting=opts.adapt, costs=costs, history=history,
                          segment=segment)
        watcher.start()
        try:
            with exported(env):
                rc = ctx.launch(args, planned, resume_dir, run_dir)
        finally:
            watcher.stop()
            watcher.join()
        segment["ended_unix_s"] = time.time()
        pending = watcher.pending
        handshake.clear_request(run_dir)
        if rc != 0 or pending is None or ckpt_dir is None or not _checkpoint_at(ckpt_dir, pending.at_step):
            if pending is not None and rc == 0:
                logger.warning("adapt: the workers finished before the switch at step %d; no switch", pending.at_step)
            if history.adaptations or len(history.segments) > 1:
                history.save()
                history.merge_into_report()
            return rc
        candidate = pending.decision.candidate
        assert candidate is not None and candidate.plan_path is not None
        saves = [s for s in handshake.read_saves(run_dir) if s.get("step") == pending.at_step]
        stopped_unix_s = saves[-1]["end_unix_s"] - saves[-1]["save_s"] if saves else segment["ended_unix_s"]
        pending.entry["switched"] = True
        _archive_segment(run_dir, segment["index"])
        node = planned.node
        nproc = sum(1 for r in candidate.plan.get("rank_layout", ()) if r.get("node") == node)
        args = copy.copy(args)
        args.nproc_per_node = str(nproc)
        from tangram_launch.launch.planning import plan_changes, visible_devices

        env = {"CUDA_VISIBLE_DEVICES": visible_devices(candidate.plan, node, visible0, nproc0)}

        for line in plan_changes(planned.plan_dict, candidate.plan):
            logger.info("adapt:   %s", line)
        planned = ctx.prepare(args, candidate.plan_path)
        cluster_path = candidate.cluster_path or cluster_path
        resume_dir, start_step = ckpt_dir, pending.at_step
        logger.info("adapt: restarting %d worker(s) under plan %s from the checkpoint of step %d", nproc,
                    planned.plan_hash[:8], start_step)


__all__ = ["AdaptiveLaunch", "check_adapt_options", "launcher_replan", "run_adaptive", "SwitchCosts", "Watcher"]
