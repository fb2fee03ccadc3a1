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
starts (SpecError, exit 2).

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

Tangram options come before the script, like torchrun's; everything after the script belongs to the script.
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
from tangram_launch.specs.constants import DTYPES, RUNTIMES

logger = logging.getLogger(__name__)

# Options that ask for planning at launch time (they need a plan provider, or are ignored next to --plan).
PLANNING_OPTIONS = ("cluster", "profile", "reprofile", "profile_quick", "model", "global_batch", "seq_len", "dtype", "runtime",
                    "parallelizer")
EXIT_WORKER_FAILED = 1  # what torchrun exits with when a worker fails (an uncaught ChildFailedError)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser, unchanged, plus a "tangram" group.  Built per call: PET_* defaults read the env."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tangram-launch"
    parser.description = "Tangram launcher: torchrun, plus launching by a plan for heterogeneous GPU clusters."
    g = parser.add_argument_group("tangram", "Planning and planned launch (before the training script, like "
                                             "torchrun's options; without them, tangram-launch is torchrun).")
    g.add_argument("--cluster", metavar="FILE", default=None, help="Cluster spec YAML (plan at launch time).")
    g.add_argument("--profile", action="store_true",
                   help="Profile this node before planning (cached by hardware fingerprint, reused while unchanged).")
    g.add_argument("--reprofile", action="store_true",
                   help="Profile this node again even if a cached profile matches (implies --profile).")
    g.add_argument("--profile-quick", "--profile_quick", action="store_true",
                   help="With --profile: small sizes and few repetitions (a quick profile).")
    g.add_argument("--model", metavar="NAME|FILE", default=None, help="Model preset, YAML or HF config.json.")
    g.add_argument("--global-batch", "--global_batch", metavar="N", type=_positive_int, default=None,
                   help="Global batch size in sequences.")
    g.add_argument("--seq-len", "--seq_len", metavar="N", type=_positive_int, default=None,
                   help="Sequence length in tokens.")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="Training dtype.")
    g.add_argument("--runtime", metavar="NAME", default=None,
                   help=f"Runtime the plan must run on ({', '.join(RUNTIMES)} or a registered third-party one).")
    g.add_argument("--plan", metavar="FILE", default=None, help="Launch by this plan (JSON or YAML).")
    g.add_argument("--parallelizer", metavar="NAME", default=None, help="Per-island parallelizer to plan with.")
    g.add_argument("--node-name", "--node_name", metavar="NAME", default=None,
                   help="Which plan node this agent is (default: matched by host name).")
    g.add_argument("--resume", metavar="DIR", default=None, help="Resume from this checkpoint directory.")
    g.add_argument("--checkpoint-dir", "--checkpoint_dir", metavar="DIR", default=None,
                   help="The run's checkpoint directory (default: the --resume one): locked against other runs, and "
                        "a restart round (--max-restarts) resumes from its newest complete checkpoint.")
    g.add_argument("--run-dir", "--run_dir", metavar="DIR", default=None,
                   help="Where a planned launch writes its run report (run-report.json: predicted vs measured per "
                        "stage) and the workers' timings (default: tangram-runs/<time>-<plan hash>).")
    g.add_argument("--report-every", "--report_every", metavar="N", type=_positive_int, default=None,
                   help="Also print the predicted-vs-measured table every N steps (default: at the end only).")
    return parser


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
    runtime: str | None = None
    plan: str | None = None
    parallelizer: str | None = None
    node_name: str | None = None
    resume: str | None = None
    checkpoint_dir: str | None = None
    run_dir: str | None = None
    report_every: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TangramOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def given(self) -> list[str]:
        """Names of the options the user set."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]

    def planning_given(self) -> list[str]:
        return [name for name in PLANNING_OPTIONS if getattr(self, name) not in (None, False)]


@dataclass(frozen=True)
class LaunchOptions:
    """The command line, converted once at the boundary (as torch.distributed.run turns its arguments into a
    ``LaunchConfig``): torchrun's options, kept as torch's own namespace because torch's ``run`` takes exactly that,
    and Tangram's, typed. Nothing after this re-parses argv."""

    torchrun: argparse.Namespace
    tangram: TangramOptions

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "LaunchOptions":
        args = build_parser().parse_args(list(argv))
        return cls(torchrun=args, tangram=TangramOptions.from_args(args))

    @property
    def nproc_per_node(self) -> int:
        """Workers on this node (torchrun's ``--nproc-per-node``: a number, or gpu/cpu/auto resolved here)."""
        from torch.distributed.run import determine_local_world_size

        return determine_local_world_size(self.torchrun.nproc_per_node)

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
    checkpoint being resumed (``tangram_launch.checkpoint.store.CheckpointInfo``) and the directory to write the
    plan file into."""

    options: LaunchOptions
    out_dir: str
    resume: Any = None

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


def _host_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    return names | {n.split(".", 1)[0] for n in names if n}


def _node_hosts(plan: Mapping, layout: W.RankLayout) -> dict[str, set[str]]:
    """Host names each plan node answers to: its own name, ``host`` in its layout rows or its cluster entry."""
    hosts: dict[str, set[str]] = {n: {n} for n in layout.nodes}
    for row in plan.get("rank_layout") or ():
        if isinstance(row, Mapping) and row.get("host") and row.get("node") in hosts:
            hosts[row["node"]].add(str(row["host"]))
    cluster = plan.get("cluster")
    for entry in (cluster.get("nodes") or ()) if isinstance(cluster, Mapping) else ():
        if isinstance(entry, Mapping) and entry.get("name") in hosts and entry.get("host"):
            hosts[entry["name"]].add(str(entry["host"]))
    return hosts


def resolve_node_name(layout: W.RankLayout, plan: Mapping, requested: str | None, *,
                      host_names: set[str], source: str | None = None) -> str:
    """``--node-name`` if given (must be a plan node), else the one plan node whose name or host is this host."""
    if requested is not None:
        if requested not in layout.nodes:
            from tangram_launch.specs.yamlio import closest

            hint = closest(requested, layout.nodes)
            valid = (f"did you mean '{hint}'? " if hint else "") + "plan nodes: " + ", ".join(layout.nodes)
            raise SpecError("no such node in the plan", source=source, field="--node-name", value=requested,
                            valid=valid)
        return requested
    if len(layout.nodes) == 1:
        return layout.nodes[0]
    matches = [n for n, hosts in _node_hosts(plan, layout).items() if hosts & host_names]
    if len(matches) == 1:
        return matches[0]
    why = "matches several plan nodes" if matches else "matches no plan node"
    raise SpecError(f"this host ({', '.join(sorted(host_names))}) {why}; say which node this agent is",
                    source=source, field="--node-name", valid="plan nodes: " + ", ".join(layout.nodes))


def check_world(layout: W.RankLayout, node: str, *, nnodes: str, nproc_per_node: int,
                source: str | None = None) -> None:
    """Refuse a plan that does not fit what the agents will start (before any worker does)."""
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(nnodes)
    plan_nodes = len(layout.nodes)
    if not (min_nodes == max_nodes == plan_nodes):
        raise SpecError(f"the plan has {plan_nodes} node(s) ({', '.join(layout.nodes)}); a planned launch is not "
                        "elastic", source=source, field="--nnodes", value=nnodes, valid=str(plan_nodes))
    gpus = layout.local_slots(node)
    if nproc_per_node != len(gpus):
        raise SpecError(f"plan node {node!r} has {len(gpus)} GPU(s) (local GPUs "
                        f"{', '.join(str(s.local_gpu) for s in gpus)})", source=source, field="--nproc-per-node",
                        value=nproc_per_node, valid=str(len(gpus)))
    if plan_nodes > 1 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
        raise SpecError("a planned multi-node launch needs torch's shared agent store (the plan's rank 0 may sit on "
                        "any node)", field="TORCH_DISABLE_SHARE_RDZV_TCP_STORE", value="1", valid="unset or 0")


def _validate_full_plan(plan: Mapping, layout: W.RankLayout, source: str) -> None:
    """A file with ``stages`` claims to be a Plan: it must load as one, so workers' ``current_plan().plan`` works."""
    if "stages" not in plan:
        return
    from tangram_launch.plan import Plan

    full = Plan.from_dict(plan, source=source)
    derived = [(r.rank, r.node, r.local_gpu) for r in full.rank_layout]
    if derived != [(s.rank, s.node, s.local_gpu) for s in layout.slots]:
        raise SpecError("rank_layout rows differ from the Plan's", source=source, field="rank_layout")


def prepare_planned_launch(args: argparse.Namespace, plan_file: str | os.PathLike, *, node_name: str | None,
                           staging_dir: str) -> PlannedLaunch:
    """Read and check the plan, pick this agent's node, check the world, and write the copy workers read."""
    source = os.fspath(plan_file)
    from tangram_launch.specs.limits import read_bytes  # a FIFO, /dev/zero, a huge file: refused, not read

    data = read_bytes(source, what="plan file")
    plan = W.read_plan_dict(source, data)
    layout = W.RankLayout.from_plan_dict(plan, source=source)
    _validate_full_plan(plan, layout, source)
    node = resolve_node_name(layout, plan, node_name, host_names=_host_names(), source=source)
    from torch.distributed.run import determine_local_world_size

    check_world(layout, node, nnodes=args.nnodes, nproc_per_node=determine_local_world_size(args.nproc_per_node),
                source=source)
    digest = W.sha256_bytes(data)
    ext = ".json" if source.endswith(".json") else ".yaml"
    copy_path = os.path.join(os.path.abspath(staging_dir), f"plan-{digest[:16]}{ext}")
    tmp = f"{copy_path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:  # the same bytes: workers re-hash them; agents sharing a log dir write the same file
        f.write(data)
    os.replace(tmp, copy_path)
    agent_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    logger.info("planned launch: plan %s (sha256 %s), this agent is plan node %r with %d worker(s)", source,
                digest[:12], node, layout.gpu_count(node))
    return PlannedLaunch(source=source, plan_path=copy_path, plan_hash=digest, node=node, layout=layout,
                         plan_dict=plan, agent_id=agent_id)


def route_through_boot(args: argparse.Namespace, planned: PlannedLaunch,
                       resume_dir: str | None = None) -> argparse.Namespace:
    """torchrun args that start ``python -u -m tangram_launch.launch.boot <boot opts> -- <the user's target>`` instead.

    torch still builds the command (PYTHON_EXEC, ``-u``, ``--run-path``), so nothing of torchrun's worker start is
    re-implemented; only the target changes.
    """
    routed = copy.copy(args)
    boot_opts = ["--plan-file", planned.plan_path, "--plan-hash", planned.plan_hash, "--node", planned.node,
                 "--agent-id", planned.agent_id]
    if resume_dir:
        boot_opts += ["--resume", os.path.abspath(resume_dir)]
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

    told = worker_environment() if planned is not None else contextlib.nullcontext()  # plain torchrun: its env
    try:
        with told:  # planned workers die with this process; their bad-input status becomes exit 2
            record(torch_run)(args)
    except SignalException as exc:  # SIGTERM/SIGINT/SIGHUP/SIGQUIT to the agent: its workers were stopped
        from tangram_launch.launch.signals import stopped_line

        sys.stderr.write(stopped_line(exc.sigval, args, planned) + "\n")
        sys.stderr.flush()
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        from tangram_launch.launch.worker_exit import launcher_status

        sys.stderr.write(f"{exc}\n")  # torchrun's failure table
        sys.stderr.write(f"tangram-launch: {failure_summary(exc, planned)}\n")
        bad_input = launcher_status(exc.failures)  # a worker refused its input: exit 2, as the launcher would
        if bad_input is not None:
            sys.stderr.write(bad_input[1] + "\n")
        sys.stderr.flush()
        return bad_input[0] if bad_input is not None else EXIT_WORKER_FAILED
    return 0


def run(argv: Sequence[str], *, plan_provider: PlanProvider | None = plan_at_launch) -> int:
    """Launch like torchrun; by a plan when ``--plan`` is given or ``plan_provider`` plans from the options.

    ``plan_provider=None`` turns planning at launch off (``--cluster`` ... is then refused).  Returns 0, or 1 when
    a worker failed (as torchrun exits), or 2 when a worker refused its input (:mod:`.worker_exit`).  User errors
    raise SpecError (exit 2) before any worker starts; argparse errors exit 2 as torchrun's do.
    """
    options = LaunchOptions.from_argv(argv)
    args, opts = options.torchrun, options.tangram
    planning = opts.planning_given()
    if opts.node_name and opts.plan is None and not planning and not opts.resume:
        raise SpecError("needs a plan (--plan FILE or --cluster FILE ...)", field="--node-name")
    resume_info = None
    if opts.resume:
        from tangram_launch.launch.planning import describe_resume

        resume_info = describe_resume(opts.resume)  # missing or empty: SpecError naming the directory
    if opts.plan is not None and planning:
        logger.warning("ignoring %s: the plan %s fixes them",
                       ", ".join("--" + p.replace("_", "-") for p in planning), opts.plan)
    ckpt_dir = opts.checkpoint_dir or opts.resume
    if ckpt_dir:  # one run per checkpoint directory; workers inherit the token and the directory
        from tangram_launch.launch.checkpoint_dir import hold_checkpoint_dir

        hold_checkpoint_dir(ckpt_dir)
    if opts.plan is None and not planning and resume_info is None:
        return _launch(args, None)
    with contextlib.ExitStack() as stack:
        if args.log_dir:  # kept with the job's logs: a record of what ran
            staging = os.path.join(args.log_dir, "tangram")
            os.makedirs(staging, exist_ok=True)
        else:
            staging = tempfile.mkdtemp(prefix="tangram-plan-")
            stack.callback(shutil.rmtree, staging, ignore_errors=True)
        plan_file = opts.plan
        if plan_file is None:
            if plan_provider is None:
                raise SpecError("planning at launch time is not available in this launcher; write a plan with "
                                "`tangram-launch plan ... -o plan.json` and launch with --plan plan.json",
                                field="--" + (planning[0].replace("_", "-") if planning else "resume"))
            out_dir = staging
            if not args.log_dir:
                from tangram_launch.launch.planning import default_plan_dir

                out_dir = default_plan_dir()
            plan_file = plan_provider(PlanRequest(options=options, out_dir=out_dir, resume=resume_info))
        planned = prepare_planned_launch(args, plan_file, node_name=opts.node_name, staging_dir=staging)
        if resume_info is not None:
            from tangram_launch.launch.planning import report_resume

            report_resume(resume_info, planned.plan_dict, source=planned.source)
        with reporting(opts, planned):
            return _launch(route_through_boot(args, planned, opts.resume), planned)


@contextlib.contextmanager
def reporting(opts: TangramOptions, planned: PlannedLaunch):
    """Workers of a planned launch time their stages into the run directory (they inherit ``TANGRAM_RUN_DIR``); at
    the end, and every ``--report-every`` steps, the launcher prints predicted against measured and writes
    ``run-report.json`` there."""
    from runtime_adapters.stage_timing import ENV_RUN_DIR
    from tangram_launch.launch import run_report

    run_dir = os.path.abspath(opts.run_dir or os.path.join(
        "tangram-runs", f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{planned.plan_hash[:8]}"))
    os.makedirs(run_dir, exist_ok=True)
    previous = os.environ.get(ENV_RUN_DIR)
    os.environ[ENV_RUN_DIR] = run_dir
    watcher = None
    if opts.report_every:
        watcher = run_report.ReportEvery(run_dir, planned.plan_dict, planned.plan_hash, opts.report_every,
                                         sys.stdout)
        watcher.start()
    try:
        yield run_dir
    finally:
        if watcher is not None:
            watcher.stop()
        if previous is None:
            os.environ.pop(ENV_RUN_DIR, None)
        else:
            os.environ[ENV_RUN_DIR] = previous
        try:
            run_report.finish(run_dir, planned.plan_dict, planned.plan_hash, out=sys.stdout)
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


if __name__ == "__main__":
    sys.exit(main())
