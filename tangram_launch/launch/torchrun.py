"""``tangram-launch``: torchrun, plus launching by a Tangram plan.

Without a Tangram option this *is* torchrun: torch's own parser (same names, aliases, defaults and ``PET_*``
environment fallbacks), ``torch.distributed.run.run`` (``--standalone``, rendezvous, ``-m``, ``--no-python``,
``--run-path``, ``--max-restarts``, ``--log-dir``, ``--redirects``, ``--tee``), the same worker environment and the
same exit status (1 when a worker fails), and the same failure table, followed by one line naming the first
failure's host, rank and exit code::

    tangram-launch --standalone --nproc-per-node 2 train.py --lr 3e-4
    tangram-launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 train.py

With ``--plan FILE`` (JSON or YAML with a ``rank_layout``), each agent is one plan node (``--node-name``, default:
matched by host name) and its workers start through :mod:`tangram_launch.launch.boot`, which takes the plan's rank for
the worker's (node, local rank), checks that all agents brought the same plan, and runs the script as python
would; workers read their place with :func:`tangram_launch.worker.current_plan`::

    tangram-launch --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
        --plan plan.json --node-name a100-0 train.py

A plan that does not fit the world (node count, this node's GPU count, unknown node) is refused before any worker
starts (SpecError, exit 2), as is every mistake :mod:`tangram_launch.launch.preflight` checks (a missing script,
plan or cluster file, a sequence longer than the model's positions, a runtime whose packages are not installed):
read without torch where :func:`tangram_launch.launch.options.parse_early` can, so they answer in well under a
second.  A hand-written plan (stages by island, no rank layout) is costed first, as ``tangram-launch plan --plan
FILE`` does, with ``--cluster`` (or ``--profile``) and ``--model``, and the launch goes by the full plan.

Planning at launch time: with ``--cluster FILE`` or ``--profile`` (measure this node first; the ClusterSpec is
cached by hardware fingerprint and reused while the hardware is unchanged), ``--model``, ``--global-batch``,
``--seq-len``, ``--dtype``, ``--runtime`` and ``--parallelizer``, every agent plans (deterministically; the file
is canonical JSON), logs the plan table, writes the plan into ``<log dir>/tangram/`` (else the cache's ``plans/``)
and launches by it as with ``--plan`` (:mod:`tangram_launch.launch.planning`)::

    tangram-launch --standalone --nproc-per-node 2 --profile --model tiny --global-batch 8 --seq-len 64 \\
        examples/train_gpt.py --steps 2

Resuming: ``--resume DIR`` describes the newest complete checkpoint in DIR (none: exit 2 naming DIR), re-plans for
the cluster as it is now (``--cluster``, ``--plan``, else ``--profile``) with the checkpoint's model and global
batch unless given again, logs what changed between the two plans, and starts the workers with
``TANGRAM_RESUME_DIR`` set (the examples load from it)::

    tangram-launch --standalone --nproc-per-node 3 --cluster cluster.yaml --resume ckpt/ examples/train_gpt.py \\
        --steps 100 --save-dir ckpt/ --save-every 10

Elastic: with ``--nnodes MIN:MAX`` and ``--cluster FILE`` (every node the job may have), each rendezvous round is
planned for the nodes present and resumes from the newest checkpoint; a node that returns joins at the next
checkpoint (:mod:`tangram_launch.launch.elastic`)::

    tangram-launch --nnodes 1:2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint head:29500 --max-restarts 3 \
        --cluster cluster.yaml --node-name a100-0 --checkpoint-dir ckpt --model llama3-8b ... \
        train.py --save-dir ckpt --save-every 100

Tangram options come before the script, like torchrun's; everything after the script belongs to the script.
Ctrl-C (SIGINT) stops the workers and prints one line (exit 130); a planned launch's workers stop without a
traceback (:mod:`tangram_launch.launch.signals`).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tangram_launch import worker as W
from tangram_launch.errors import SpecError, TangramError
from tangram_launch.launch import preflight
from tangram_launch.launch.options import add_tangram_options, literal_nproc, parse_early
from tangram_launch.launch.preflight import check_world, resolve_node_name  # noqa: F401  (their home before)
from tangram_launch.specs.yamlio import dump_bytes_file

logger = logging.getLogger(__name__)

# Options that ask for planning at launch time (they need a plan provider, or are ignored next to --plan).
PLANNING_OPTIONS = ("cluster", "profile", "reprofile", "profile_quick", "model", "global_batch", "seq_len", "dtype", "runtime",
                    "parallelizer", "gpu_counts", "attention_kernel")
EXIT_WORKER_FAILED = 1  # what torchrun exits with when a worker fails (an uncaught ChildFailedError)


def build_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser, unchanged, plus a "tangram" group.  Built per call: PET_* defaults read the env."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tangram-launch"
    parser.description = "Tangram launcher: torchrun, plus launching by a plan for heterogeneous GPU clusters."
    add_tangram_options(parser.add_argument_group(
        "tangram", "Planning and planned launch (before the training script, like torchrun's options; without "
                   "them, tangram-launch is torchrun)."))
    return parser


def unknown_option_error(unknown: Sequence[str], parser: argparse.ArgumentParser) -> SpecError:
    """The first argument the launcher's parser does not know, with the closest option it does (difflib)."""
    import difflib

    token = next((u for u in unknown if u.startswith("-")), unknown[0])
    name = token.split("=", 1)[0]
    known = sorted(s for s in parser._option_string_actions if s.startswith("--"))  # argparse's own table
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    valid = (f"did you mean {' or '.join(close)}? " if close else "") + "(tangram-launch --help lists the options)"
    return SpecError("unknown option, before the training script", field=name, value=token, valid=valid)


@dataclass(frozen=True)
class TangramOptions:
    """The tangram group of the command line, apart from torchrun's options."""

    cluster: str | None = None
    profile: bool = False
    reprofile: bool = False
    profile_quick: bool = False
    model: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    dtype: str | None = None
    attention_kernel: str | None = None
    runtime: str | None = None
    plan: str | None = None
    parallelizer: str | None = None
    gpu_counts: str | None = None
    node_name: str | None = None
    resume: str | None = None
    checkpoint_dir: str | None = None
    run_dir: str | None = None
    report_every: int | None = None
    adapt: bool = False
    adapt_horizon: int | None = None
    adapt_threshold: float | None = None
    adapt_window: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TangramOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def given(self) -> list[str]:
        """Names of the options the user set."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]

    def planning_given(self) -> list[str]:
        return [name for name in PLANNING_OPTIONS if getattr(self, name) not in (None, False)]

    def run_checkpoint_dir(self) -> str | None:
        """The run's checkpoint directory: ``--checkpoint-dir``, else the one ``--resume`` names or whose single
        checkpoint it names (``DIR/step_<N>``: DIR), else None."""
        from tangram_launch.checkpoint.store import home_directory

        return self.checkpoint_dir or (home_directory(self.resume) if self.resume else None)


@dataclass(frozen=True)
class LaunchOptions:
    """The command line, converted once at the boundary (as torch.distributed.run turns its arguments into a
    ``LaunchConfig``): torchrun's options, kept as torch's own namespace because torch's ``run`` takes exactly that,
    and Tangram's, typed. Nothing after this re-parses argv."""

    torchrun: argparse.Namespace
    tangram: TangramOptions

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "LaunchOptions":
        parser = build_parser()
        args, unknown = parser.parse_known_args(list(argv))
        if unknown:  # what parse_args would refuse, as one line with the nearest option instead of the usage
            raise unknown_option_error(unknown, parser)
        return cls(torchrun=args, tangram=TangramOptions.from_args(args))

    @property
    def nproc_per_node(self) -> int:
        """Workers on this node (torchrun's ``--nproc-per-node``: a number, or gpu/cpu/auto resolved here)."""
        from torch.distributed.run import determine_local_world_size

        return determine_local_world_size(self.torchrun.nproc_per_node)

    @property
    def fixed_nodes(self) -> bool:
        """``--nnodes N`` (or MIN = MAX): not an elastic launch."""
        from torch.distributed.run import parse_min_max_nnodes

        low, high = parse_min_max_nnodes(self.torchrun.nnodes)
        return bool(getattr(self.torchrun, "standalone", False)) or low == high

    @property
    def single_node(self) -> bool:
        from torch.distributed.run import parse_min_max_nnodes

        return bool(getattr(self.torchrun, "standalone", False)) or parse_min_max_nnodes(
            self.torchrun.nnodes) == (1, 1)

    def torchrun_argv(self) -> list[str]:
        """torchrun's options back as a command line (to start other workers, e.g. the profiler's, with them)."""
        from tangram_launch.launch.profiling import torchrun_argv

        return torchrun_argv(self.torchrun)


@dataclass(frozen=True)
class PlanRequest:
    """What a plan provider plans from: the launch's options (Tangram's, and torchrun's for --profile), the
    checkpoint being resumed (``tangram_launch.checkpoint.store.CheckpointInfo``), the directory to write the
    plan file into, and a hand-written plan to cost instead of searching (``--plan`` without a rank layout)."""

    options: LaunchOptions
    out_dir: str
    resume: Any = None
    hand_written: str | None = None

    @property
    def opts(self) -> TangramOptions:
        return self.options.tangram

    @property
    def args(self) -> argparse.Namespace:
        """torchrun's options (as providers written against the earlier PlanRequest read them)."""
        return self.options.torchrun


# A plan provider turns the planning options into a plan file (the planned launch's seam): it runs on every agent,
# so it must be deterministic (same cluster, model and options -> same bytes), or agents will refuse to start.
PlanProvider = Callable[[PlanRequest], "str | os.PathLike"]


def plan_at_launch(request: PlanRequest) -> "str | os.PathLike":
    """The default provider: :func:`tangram_launch.launch.planning.provide_plan` (imported only when planning)."""
    from tangram_launch.launch.planning import provide_plan

    return provide_plan(request)


@dataclass(frozen=True)
class PlannedLaunch:
    """What an agent launches by: the checked plan copy its workers read, and which plan node it is."""

    source: str  # the user's plan file
    plan_path: str  # absolute path of the copy workers read
    plan_hash: str  # sha256 of its bytes
    node: str
    layout: W.RankLayout
    plan_dict: Mapping[str, Any]
    agent_id: str  # host:pid:nonce, tells agents apart in the cross-agent check's messages

    def slot_of_local_rank(self, local_rank: int) -> W.RankSlot:
        return self.layout.slot_for(self.node, local_rank)


def prepare_planned_launch(args: argparse.Namespace, plan_file: str | os.PathLike, *, node_name: str | None,
                           staging_dir: str) -> PlannedLaunch:
    """Read and check the plan, pick this agent's node, check the world, and write the copy workers read."""
    source = os.fspath(plan_file)
    from tangram_launch.specs.limits import read_bytes  # a FIFO, /dev/zero, a huge file: refused, not read
    from torch.distributed.run import determine_local_world_size

    data = read_bytes(source, what="plan file")
    checked = preflight.read_plan_file(source, data, node_name=node_name, nnodes=args.nnodes,
                                       nproc_per_node=determine_local_world_size(args.nproc_per_node))
    if checked.hand_written:  # costed by the plan provider before it gets here
        W.RankLayout.from_plan_dict(checked.plan, source=source)  # "missing or empty rank layout"
    digest = W.sha256_bytes(data)
    ext = ".json" if source.endswith(".json") else ".yaml"
    copy_path = os.path.join(os.path.abspath(staging_dir), f"plan-{digest[:16]}{ext}")
    dump_bytes_file(data, copy_path)  # the same bytes: workers re-hash them; agents sharing a log dir write alike
    agent_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    layout = checked.layout
    from tangram_launch.launch.boot import worker_env_overrides

    for line in worker_env_overrides(os.environ, W.plan_runtime(checked.plan)):
        logger.warning(line)
    logger.info("planned launch: plan %s (sha256 %s), this agent is plan node %r with %d worker(s)", source,
                digest[:12], checked.node, layout.gpu_count(checked.node))
    return PlannedLaunch(source=source, plan_path=copy_path, plan_hash=digest, node=checked.node, layout=layout,
                         plan_dict=checked.plan, agent_id=agent_id)


def route_through_boot(args: argparse.Namespace, planned: PlannedLaunch,
                       resume_dir: str | None = None) -> argparse.Namespace:
    """torchrun args that start ``python -u -m tangram_launch.launch.boot <boot opts> -- <the user's target>`` instead.

    torch still builds the command (PYTHON_EXEC, ``-u``, ``--run-path``), so nothing of torchrun's worker start is
    re-implemented; only the target changes.
    """
    boot_opts = ["--plan-file", planned.plan_path, "--plan-hash", planned.plan_hash, "--node", planned.node,
                 "--agent-id", planned.agent_id]
    if resume_dir:
        boot_opts += ["--resume", os.path.abspath(resume_dir)]
    return route_to_boot(args, boot_opts)


def route_to_boot(args: argparse.Namespace, boot_opts: Sequence[str]) -> argparse.Namespace:
    """torchrun args whose target is boot with ``boot_opts``, then ``--`` and the user's target (see above)."""
    routed = copy.copy(args)
    if args.no_python and args.module:
        raise SpecError("use either --no-python or -m/--module", field="--no-python")
    if args.run_path:  # in-process worker: torch's run_script_path runs boot.py, which runs the script
        from tangram_launch.launch import boot

        routed.training_script = os.path.abspath(boot.__file__)
        routed.training_script_args = [*boot_opts, "--", args.training_script, *args.training_script_args]
        return routed
    if args.no_python:
        target = ["--exec", args.training_script]
    elif args.module:
        target = ["-m", args.training_script]
    else:
        target = [args.training_script]
    routed.no_python = False
    routed.module = True
    routed.training_script = "tangram_launch.launch.boot"
    routed.training_script_args = [*boot_opts, "--", *target, *args.training_script_args]
    return routed


def failure_summary(exc: Exception, planned: PlannedLaunch | None = None) -> str:
    """One line naming the first failure: host, rank, exit code (and plan node, stage, island when planned)."""
    rank, failure = exc.get_first_failure()  # type: ignore[attr-defined]  # ChildFailedError
    host = socket.getfqdn()
    if failure.exitcode < 0 and failure.signal_name() != "<N/A>":
        how = f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    else:
        how = f"exited with code {failure.exitcode}"
    if planned is None:
        return f"first failure: host {host}, rank {rank} (local rank {failure.local_rank}) {how}"
    slot = planned.slot_of_local_rank(failure.local_rank)
    info = W.stage_info(planned.plan_dict, slot)
    where = [f"plan node {planned.node}", f"local GPU {slot.local_gpu}"]
    if info["stage"] is not None:
        where.append(f"stage {info['stage']}")
    if info["island"] is not None:
        where.append(f"island {info['island']}")
    return (f"first failure: host {host}, rank {slot.rank} (torchrun rank {rank}, local rank {failure.local_rank}; "
            f"{', '.join(where)}) {how}")


def _launch(args: argparse.Namespace, planned: PlannedLaunch | None) -> int:
    """torch's run(args) under torch's @record (the first failure's error file becomes the launcher's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import run as torch_run

    from tangram_launch.launch.lifetime import worker_environment
    from tangram_launch.launch.signals import quiet_agent_shutdown, stopped_line
    from tangram_launch.launch.worker_exit import failure_lines_held, workers_told

    told = worker_environment() if planned is not None else contextlib.nullcontext()  # plain torchrun: its env
    told_status = planned is not None or workers_told()  # an elastic launch exports it around this call
    held = failure_lines_held() if told_status else contextlib.nullcontext(None)
    lines = None
    try:
        with told, quiet_agent_shutdown(), held as lines:  # planned workers die with this process
            record(torch_run)(args)
    except SignalException as exc:  # SIGTERM/SIGINT/SIGHUP/SIGQUIT to the agent: its workers were stopped
        if lines is not None:
            lines.release()
        sys.stderr.write(stopped_line(exc.sigval, args, planned) + "\n")
        sys.stderr.flush()
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return _child_failed(exc, planned, lines)
    if lines is not None:
        lines.release()  # a run that ended well (torch stops nothing then: nothing held)
    return 0


def _child_failed(exc: Any, planned: PlannedLaunch | None, held: Any) -> int:
    """What a failed launch prints and exits with. Workers that all refused their input (``held`` is not None when
    they were told how to say so, :mod:`.worker_exit`): their line once and the launcher's, exit 2; torch's failure
    table is for crashes. Otherwise torchrun's table and the first failure, exit 1 (2 when one refused its input)."""
    from tangram_launch.launch.worker_exit import input_error_report, launcher_status, worker_lines

    bad_input = input_error_report(exc.failures) if held is not None else None
    if bad_input is not None:
        sys.stderr.write("".join(line + "\n" for line in bad_input[1]))
        sys.stderr.flush()
        return bad_input[0]
    if held is not None:
        held.release()  # torch's own lines about the failure, as torchrun prints them
        sys.stderr.write("".join(line + "\n" for line in worker_lines(exc.failures)))  # they left them to us
    sys.stderr.write(f"{exc}\n")  # torchrun's failure table
    sys.stderr.write(f"tangram-launch: {failure_summary(exc, planned)}\n")
    refused = launcher_status(exc.failures) if held is not None else None  # only workers told to use the status
    if refused is not None:
        sys.stderr.write(refused[1] + "\n")
    sys.stderr.flush()
    return refused[0] if refused is not None else EXIT_WORKER_FAILED


def _preflight(argv: Sequence[str], *, can_plan: bool) -> tuple[LaunchOptions, preflight.CheckedPlan | None]:
    """The command line, read once by torch's parser, and pre-flight's checks of it: before torch is imported
    when the early reading is certain to read it as torch will (:func:`options.parse_early`), else just after."""
    early = parse_early(argv)
    checked = None
    if early is not None:
        checked = preflight.check_launch(early, nproc_per_node=lambda: literal_nproc(early.nproc_per_node),
                                         can_plan=can_plan)
    options = LaunchOptions.from_argv(argv)
    if early is None:
        checked = preflight.check_launch(options.torchrun, nproc_per_node=lambda: options.nproc_per_node,
                                         can_plan=can_plan)
    return options, checked


def _warn_cpu_threads(options: LaunchOptions) -> None:
    """One warning where CPU workers' thread pools would hold more threads than the node has cores
    (preflight.cpu_thread_warning); workers on GPUs compute on them, whatever their host threads."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:  # torchrun's own default fits: resolve nothing on the common path
        return
    from profiler.inventory import read_node_inventory, usable_cpu_count

    text = preflight.cpu_thread_warning(value, nproc_per_node=options.nproc_per_node, cores=usable_cpu_count())
    if text is None:
        return
    # A profile measured so is not reused once the threads fit: a CPU device's fingerprint holds its threads
    # (profiler.assemble.cpu_threads_identity).
    if not read_node_inventory().gpus:
        logger.warning(text)


def run(argv: Sequence[str], *, plan_provider: PlanProvider | None = plan_at_launch) -> int:
    """Launch like torchrun; by a plan when ``--plan`` is given or ``plan_provider`` plans from the options.

    ``plan_provider=None`` turns planning at launch off (``--cluster`` ... is then refused).  Returns 0, or 1 when
    a worker failed (as torchrun exits), or 2 when a worker refused its input (:mod:`.worker_exit`).  User errors
    raise SpecError (exit 2) before any worker starts (:mod:`tangram_launch.launch.preflight`); argparse errors exit
    2 as torchrun's do.
    """
    options, checked = _preflight(argv, can_plan=plan_provider is not None)
    _warn_cpu_threads(options)
    args, opts = options.torchrun, options.tangram
    if opts.adapt:
        from tangram_launch.launch.adapt.switch import check_adapt_options

        check_adapt_options(opts, single_node=options.single_node)
    hand_written = checked is not None and checked.hand_written
    planning = opts.planning_given()
    if opts.node_name and opts.plan is None and not planning and not opts.resume:
        raise SpecError("needs a plan (--plan FILE or --cluster FILE ...)", field="--node-name")
    resume_info = None
    if opts.resume:
        from tangram_launch.launch.planning import describe_resume

        resume_info = describe_resume(opts.resume)  # missing or empty: SpecError naming the directory
    if opts.plan is not None and planning and not hand_written:
        logger.warning("ignoring %s: the plan %s fixes them",
                       ", ".join("--" + p.replace("_", "-") for p in planning), opts.plan)
    ckpt_dir = opts.run_checkpoint_dir()
    elastic = opts.plan is None and (bool(planning) or resume_info is not None) and not options.fixed_nodes
    if ckpt_dir:  # one run per checkpoint directory; workers inherit the token and the directory
        from tangram_launch.launch.checkpoint_dir import check_one_history, hold_checkpoint_dir

        if resume_info is not None:
            check_one_history(ckpt_dir, resume_info, field="--checkpoint-dir" if opts.checkpoint_dir else "--resume")
        hold_checkpoint_dir(ckpt_dir, shared_by_agents=elastic)
    if opts.plan is None and not planning and resume_info is None:
        return _launch(args, None)
    with contextlib.ExitStack() as stack:
        if args.log_dir:  # kept with the job's logs: a record of what ran
            staging = os.path.join(args.log_dir, "tangram")
            os.makedirs(staging, exist_ok=True)
        else:
            staging = tempfile.mkdtemp(prefix="tangram-plan-")
            stack.callback(shutil.rmtree, staging, ignore_errors=True)
        plan_file = None if hand_written else opts.plan
        if plan_file is None:
            if plan_provider is None:
                field = "--plan" if hand_written else "--" + (planning[0].replace("_", "-") if planning else "resume")
                raise SpecError("planning at launch time is not available in this launcher; write a plan with "
                                "`tangram-launch plan ... -o plan.json` and launch with --plan plan.json", field=field)
            out_dir = staging
            if not args.log_dir:
                from tangram_launch.launch.planning import default_plan_dir

                out_dir = default_plan_dir()
            if elastic:  # planned at every rendezvous round, for the nodes present
                from tangram_launch.launch.elastic import launch_elastic

                return launch_elastic(options, staging=staging, resume=resume_info, launch=_launch,
                                      route=route_to_boot)
            plan_file = plan_provider(PlanRequest(options=options, out_dir=out_dir, resume=resume_info,
                                                  hand_written=opts.plan if hand_written else None))
            if options.single_node:  # the plan may leave GPUs out: start workers on the ones it uses
                from tangram_launch.launch.lifetime import exported

                options, narrowed = _narrowed_to_plan(options, plan_file)
                args = options.torchrun
                stack.enter_context(exported(narrowed))
        planned = prepare_planned_launch(args, plan_file, node_name=opts.node_name, staging_dir=staging)
        preflight.check_runtime_packages(planned.plan_dict.get("runtime"), field="runtime", source=planned.source)
        if resume_info is not None:
            from tangram_launch.launch.planning import report_resume

            report_resume(resume_info, planned.plan_dict, source=planned.source)
        if opts.cluster or opts.adapt:  # a straggler is re-planned for (--adapt), or what would be done is logged
            from tangram_launch.launch.adapt.switch import AdaptiveLaunch, run_adaptive

            return run_adaptive(AdaptiveLaunch(
                options=options, planned=planned, staging=staging, resume=resume_info,
                prepare=lambda a, f: prepare_planned_launch(a, f, node_name=opts.node_name, staging_dir=staging),
                launch=lambda a, p, resume_dir, run_dir: launch_segment(
                    a, dataclasses.replace(opts, run_dir=run_dir), p, resume_dir),
                default_run_dir=default_run_dir))
        return launch_segment(args, opts, planned, opts.resume)


def _narrowed_to_plan(options: LaunchOptions, plan_file: str) -> tuple[LaunchOptions, dict[str, str]]:
    """The launch options and environment that start one worker per GPU of this node the plan uses (a plan made at
    launch for one node may leave GPUs out); the options unchanged and no environment when it uses them all."""
    from tangram_launch.launch.planning import workers_for_plan

    plan = W.read_plan_dict(plan_file)
    nodes = {r.get("node") for r in plan.get("rank_layout", ())}
    nproc = options.nproc_per_node
    narrowed = workers_for_plan(plan, next(iter(nodes)), nproc, os.environ.get("CUDA_VISIBLE_DEVICES")) \
        if len(nodes) == 1 else None
    if narrowed is None:
        return options, {}
    workers, env = narrowed
    logger.info("the plan uses %d of this node's %d devices: starting %d worker(s) (CUDA_VISIBLE_DEVICES=%s)",
                workers, nproc, workers, env["CUDA_VISIBLE_DEVICES"])
    args = copy.copy(options.torchrun)
    args.nproc_per_node = str(workers)
    return dataclasses.replace(options, torchrun=args), env


def launch_segment(args: argparse.Namespace, opts: TangramOptions, planned: PlannedLaunch,
                   resume_dir: str | None) -> int:
    """The workers of one plan, started through boot, with their timings reported."""
    with reporting(opts, planned):
        return _launch(route_through_boot(args, planned, resume_dir), planned)


def default_run_dir(plan_hash: str) -> str:
    return os.path.join("tangram-runs", f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{plan_hash[:8]}")


@contextlib.contextmanager
def reporting(opts: TangramOptions, planned: PlannedLaunch):
    """Workers of a planned launch time their stages into the run directory (they inherit ``TANGRAM_RUN_DIR``); at
    the end, and every ``--report-every`` steps, the launcher prints predicted against measured and writes
    ``run-report.json`` there."""
    from runtime_adapters.stage_timing import ENV_RUN_DIR
    from tangram_launch.launch import run_report
    from tangram_launch.launch.lifetime import exported

    run_dir = os.path.abspath(opts.run_dir or default_run_dir(planned.plan_hash))
    os.makedirs(run_dir, exist_ok=True)
    watcher = None
    if opts.report_every:
        watcher = run_report.ReportEvery(run_dir, planned.plan_dict, planned.plan_hash, opts.report_every,
                                         sys.stdout)
        watcher.start()
    try:
        with exported({ENV_RUN_DIR: run_dir}):
            yield run_dir
    finally:
        if watcher is not None:
            watcher.stop()
        try:
            run_report.finish(run_dir, planned.plan_dict, planned.plan_hash, out=sys.stdout,
                              cluster_path=opts.cluster)
        except (OSError, KeyError, ValueError, TypeError) as exc:  # the run's outcome stands without its report
            logger.warning("no run report: %s", exc)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tangram_launch.launch [torchrun args] [tangram args] script [script args]``."""
    logging.basicConfig(level=logging.INFO, format="[tangram] %(message)s")
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except TangramError as exc:
        sys.stderr.write(f"tangram-launch: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while planning or profiling, before torch's agent handles signals
        from tangram_launch.launch.signals import INTERRUPTED_LINE

        sys.stderr.write(INTERRUPTED_LINE + "\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
