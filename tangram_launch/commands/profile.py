"""Measure a live cluster and write its ClusterSpec (run the same command on every node, like torchrun).

    tangram-launch profile --standalone --nproc-per-node 8 -o cluster.yaml --quick
    tangram-launch profile --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
        -o cluster.yaml [--model llama3-8b --seq-len 4096]

One profiling worker per GPU (or per CPU process where there is no GPU) measures GEMM TFLOP/s per dtype, memory
bandwidth, all-reduce bus bandwidth and point-to-point bandwidth inside each node, and bandwidth and latency between
every pair of nodes (each node talks to one peer at a time). Global rank 0 writes the ClusterSpec; that node prints
a summary table. The file appears only when every worker finished: a failed profile names the node and the rank
that stopped, and leaves no file behind. ``tangram-launch islands --cluster cluster.yaml`` and ``plan`` read it.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
import uuid

from tangram_launch.errors import SpecError, TangramError

log = logging.getLogger(__name__)

# torchrun options that choose what to run: the profile command sets them itself.
_NOT_FORWARDED = {"help", "module", "no_python", "run_path", "training_script", "training_script_args"}


class ProfileError(TangramError):
    """The profile did not complete (a worker died, a node was unreachable); exit status 1."""

    exit_code = 1


def _torchrun_actions() -> list[argparse.Action]:
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.dest not in _NOT_FORWARDED and a.option_strings]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tr = parser.add_argument_group("torchrun options", "as for torchrun (same names, defaults and PET_* variables)")
    for action in _torchrun_actions():
        # torch's own Action objects, so names, aliases, env-variable defaults and checks stay exactly torchrun's
        tr._add_action(action)
    g = parser.add_argument_group("profile")
    g.add_argument("-o", "--output", default="cluster.yaml", help="ClusterSpec YAML to write (default cluster.yaml)")
    g.add_argument("--quick", action="store_true", help="small sizes and few repetitions (under a minute)")
    g.add_argument("--name", help="cluster name written into the file")
    g.add_argument("--model", metavar="NAME|FILE",
                   help="also time one transformer layer of this model (forward and backward) on every device")
    g.add_argument("--seq-len", type=int, help="sequence length for --model (default: the model's, capped)")
    g.add_argument("--micro-batch", type=int, default=1, help="micro-batch size for --model (default 1)")
    g.add_argument("--layer-dtype", choices=("bf16", "fp16", "fp32"), help="dtype for --model (default bf16)")
    g.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a silent peer fails the profile after this long (default 300)")


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The torchrun options the user gave, back as a command line (values that differ from the defaults)."""
    argv: list[str] = []
    for action in _torchrun_actions():
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


def _check(args: argparse.Namespace) -> None:
    if args.seq_len is not None and args.seq_len < 1:
        raise SpecError("must be a positive integer", field="--seq-len", value=args.seq_len)
    if args.micro_batch < 1:
        raise SpecError("must be a positive integer", field="--micro-batch", value=args.micro_batch)
    if args.timeout_s <= 0:
        raise SpecError("must be positive", field="--timeout-s", value=args.timeout_s)
    if args.model:
        from tangram_launch.specs.model import load_model

        load_model(args.model)  # a bad name fails here, before any worker starts
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise SpecError("output folder does not exist", field="--output", value=args.output)


def run(args: argparse.Namespace) -> int:
    _check(args)
    output = os.path.abspath(args.output)
    run_id = uuid.uuid4().hex[:12]
    staged = f"{output}.partial-{run_id}"  # renamed to output only when every worker finished
    run_dir = tempfile.mkdtemp(prefix="tangram-profile-")
    worker = ["-m", "profiler.worker", "--output", staged, "--run-dir", run_dir, "--timeout-s", str(args.timeout_s)]
    if args.quick:
        worker.append("--quick")
    if args.name:
        worker += ["--name", args.name]
    if args.model:
        worker += ["--model", args.model, "--micro-batch", str(args.micro_batch)]
        if args.seq_len:
            worker += ["--seq-len", str(args.seq_len)]
        if args.layer_dtype:
            worker += ["--layer-dtype", args.layer_dtype]
    argv = torchrun_argv(args) + worker
    log.info("profiling: tangram-launch %s", " ".join(argv))
    try:
        rc, launch_error = _launch(argv, args)
        if rc != 0 or launch_error:
            raise ProfileError(failure_message(run_dir, rc, launch_error))
        if os.path.exists(staged):
            os.replace(staged, output)
            _report(output)
        else:
            writer = _writer(run_dir)
            where = f"node {writer['node']} (host {writer['host']})" if writer else "the node of global rank 0"
            print(f"profile done on this node; global rank 0 on {where} wrote the ClusterSpec to its {args.output}")
        return 0
    finally:
        _remove_partials(staged)  # after a failure or an interrupt: no partial output
        shutil.rmtree(run_dir, ignore_errors=True)


def _launch(argv: list[str], args: argparse.Namespace) -> tuple[int, str | None]:
    """Start the workers through the launcher (torchrun machinery); rendezvous failures become a message."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from tangram_launch.launch import torchrun as launch

    try:
        return int(launch.run(argv) or 0), None
    except RendezvousError as exc:
        detail = f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"
        where = getattr(args, "rdzv_endpoint", "") or "the rendezvous endpoint"
        return 1, (f"rendezvous of {getattr(args, 'nnodes', '?')} node(s) at {where} did not complete on host "
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


def _report(output: str) -> None:
    from profiler.assemble import format_summary
    from tangram_launch.specs.cluster import ClusterSpec

    spec = ClusterSpec.load(output)
    print(format_summary(spec))
    print(f"\nwrote {output}")
