"""Profiling a live cluster as a function call: start one profiler worker per device through the launcher and wait
for the ClusterSpec. ``tangram-launch profile`` (``commands/profile.py``) and ``--profile`` at launch
(``launch/planning.py``) both call :func:`profile_cluster` with a :class:`ProfileRequest`; nothing re-parses a
command line.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from tangram_launch.errors import TangramError

log = logging.getLogger(__name__)

# torchrun options that choose what to run: the profile command sets them itself.
_NOT_FORWARDED = {"help", "module", "no_python", "run_path", "training_script", "training_script_args"}


class ProfileError(TangramError):
    """The profile did not complete (a worker died, a node was unreachable); exit status 1."""

    exit_code = 1


def torchrun_actions() -> list[argparse.Action]:
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.dest not in _NOT_FORWARDED and a.option_strings]


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun options the user gave, back as a command line (values that differ from the defaults)."""
    argv: list[str] = []
    for action in torchrun_actions():
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if action.nargs == 0:  # store_true-like (e.g. --standalone)
            if value:
                argv.append(flag)
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        argv += [flag, str(value)]
    return argv



@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """What to measure and where to write it; ``torchrun_argv`` starts the workers as the user's torchrun options
    would (``--standalone``, ``--nnodes``, ``--rdzv-endpoint`` ...)."""

    output: str
    torchrun_argv: tuple[str, ...] = ()
    quick: bool = False
    name: str | None = None
    model: str | None = None
    seq_len: tuple[int, ...] = ()  # --model's shapes (empty: the profiler's defaults)
    micro_batch: tuple[int, ...] = ()
    tp: tuple[int, ...] = ()
    layer_budget_s: float | None = None  # wall seconds for every --model shape on a device
    layer_dtype: str | None = None
    layer_timing: str | None = None  # CPU devices: "interleaved" (the profiler's default) or "back-to-back"
    timeout_s: float = 300.0
    budget_s: float | None = None  # wall seconds per local benchmark (None: the profiler's default for the device)
    nnodes: str = "1"  # for the rendezvous failure message
    rdzv_endpoint: str = ""


@dataclass(frozen=True)
class ProfileOutcome:
    """``written``: this node wrote ``output``; else ``writer`` names the node of global rank 0 that did."""

    output: str
    written: bool
    writer: dict[str, Any] | None = None


def profile_cluster(request: ProfileRequest) -> ProfileOutcome:
    """Run the profiler workers; the file appears only when every worker finished (else ProfileError naming the
    node and rank that stopped, and no file)."""
    output = os.path.abspath(request.output)
    run_id = uuid.uuid4().hex[:12]
    staged = f"{output}.partial-{run_id}"  # renamed to output only when every worker finished
    run_dir = tempfile.mkdtemp(prefix="tangram-profile-")
    worker = ["-m", "profiler.worker", "--output", staged, "--run-dir", run_dir, "--timeout-s",
              str(request.timeout_s)]
    if request.quick:
        worker.append("--quick")
    if request.budget_s:
        worker += ["--budget-s", str(request.budget_s)]
    if request.name:
        worker += ["--name", request.name]
    if request.model:
        worker += ["--model", request.model]
        for flag, values in (("--micro-batch", request.micro_batch), ("--seq-len", request.seq_len),
                             ("--tp", request.tp)):
            if values:
                worker += [flag, ",".join(map(str, values))]
        if request.layer_budget_s:
            worker += ["--layer-budget-s", str(request.layer_budget_s)]
        if request.layer_dtype:
            worker += ["--layer-dtype", request.layer_dtype]
        if request.layer_timing:
            worker += ["--layer-timing", request.layer_timing]
    argv = list(request.torchrun_argv) + worker
    log.info("profiling: tangram-launch %s", " ".join(argv))
    try:
        rc, launch_error = _launch(argv, request)
        if rc != 0 or launch_error:
            raise ProfileError(failure_message(run_dir, rc, launch_error))
        if os.path.exists(staged):
            os.replace(staged, output)
            return ProfileOutcome(output=output, written=True)
        return ProfileOutcome(output=output, written=False, writer=_writer(run_dir))
    finally:
        _remove_partials(staged)  # after a failure or an interrupt: no partial output
        shutil.rmtree(run_dir, ignore_errors=True)


def _launch(argv: list[str], request: ProfileRequest) -> tuple[int, str | None]:
    """Start the workers with torchrun's own machinery (no plan: profiling comes before planning); a failed worker
    returns 1 after torchrun's failure table, a rendezvous failure becomes a message."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    try:
        record(torch_run)(get_args_parser().parse_args(argv))
        return 0, None
    except ChildFailedError as exc:
        sys.stderr.write(f"{exc}\n")  # torchrun's failure table; failure_message() says which node and phase
        return 1, None
    except RendezvousError as exc:
        detail = f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"
        where = request.rdzv_endpoint or "the rendezvous endpoint"
        return 1, (f"rendezvous of {request.nnodes} node(s) at {where} did not complete on host "
                   f"{socket.gethostname()} ({detail}): a node is unreachable or was not started; run the same "
                   f"`tangram-launch profile` on every node with the same --nnodes and --rdzv-endpoint")


def _remove_partials(staged: str) -> None:
    """This run's staged file and the temporary files of an interrupted atomic write of it (``.tmp.<pid>``)."""
    for path in [staged, *glob.glob(glob.escape(staged) + ".tmp.*")]:
        try:
            os.remove(path)
        except OSError:
            pass


def _statuses(run_dir: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "rank-*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda s: s.get("local_rank", 0))


def _writer(run_dir: str) -> dict | None:
    for s in _statuses(run_dir):
        if s.get("state") == "done" and s.get("writer"):
            return s["writer"]
    return None


def failure_message(run_dir: str, rc: int, launch_error: str | None) -> str:
    """Which node failed and how: from the workers' status files (phase, error) and the launcher's outcome."""
    statuses = _statuses(run_dir)
    if not statuses:
        return launch_error or (f"profiling failed before any worker started on this node (exit code {rc}); "
                                f"no ClusterSpec written")
    first = statuses[0]
    node = first.get("node") or first.get("host")
    head = (f"profiling failed on node '{node}' (host {first.get('host')}, node rank {first.get('node_rank')}); "
            f"no ClusterSpec written:")
    lines = [head]
    # Workers that stopped without reporting an error were killed or crashed: the root cause comes first.
    stopped = [s for s in statuses if s.get("state") == "running"]
    failed = [s for s in statuses if s.get("state") == "failed"]
    for s in stopped:
        lines.append(f"  local rank {s['local_rank']} (global rank {s['rank']}) stopped during '{s['phase']}' "
                     f"without reporting an error (killed or crashed)")
    for s in failed:
        lines.append(f"  local rank {s['local_rank']} (global rank {s['rank']}) failed during '{s['phase']}': "
                     f"{s.get('error')}")
    if not stopped and not failed:
        lines.append(f"  every local worker finished, but the launcher reported a failure (exit code {rc}): "
                     f"a worker on another node failed")
    if launch_error:
        lines.append(f"  {launch_error}")
    return "\n".join(lines)
