"""Pre-flight: a launch's mistakes refused before any worker starts, each with exit status 2 and its fix.

:func:`tangram_launch.launch.torchrun.run` calls :func:`check_launch` as soon as the command line is read: before
torch is imported where :func:`tangram_launch.launch.options.parse_early` can read it (an answer in well under a
second), else right after torch's parser; always before planning, profiling or any worker.  It checks, in order:

* ``--plan``: the file is readable and a plan; a plan with a rank layout has a node for this agent and the
  launch's world (``--nnodes``, ``--nproc-per-node``) and a sequence length within the model's positions; a
  hand-written plan (stages by island, no rank layout) needs ``--model``, as it is costed before the launch;
* ``--cluster`` is a readable file, ``--model`` loads and ``--seq-len`` fits it, ``--resume`` is a directory;
* the runtime's packages (``--runtime``, or the plan's) are installed: ``importlib.util.find_spec``, nothing is
  imported; else the extra to install;
* the target exists: the script file, the ``-m`` module, the ``--no-python`` command.

One thing is only warned about, as torchrun runs it: CPU workers whose thread pools hold more threads than the node
has cores (:func:`cpu_thread_warning`).

Nothing here imports torch or the planner.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from tangram_launch import worker as W
from tangram_launch.errors import SpecError

# runtime -> the packages its adapter imports: (module, the extra of setup.py that installs it)
RUNTIME_PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "deepspeed": (("deepspeed", "deepspeed"),),
    "megatron": (("megatron.core", "megatron"),),
}


@dataclass(frozen=True)
class CheckedPlan:
    """A ``--plan`` file as pre-flight read it; ``layout`` is None for a hand-written plan (costed at launch)."""

    source: str
    plan: Mapping[str, Any]
    layout: W.RankLayout | None
    node: str | None

    @property
    def hand_written(self) -> bool:
        return self.layout is None


# --- the plan file -----------------------------------------------------------------------------------------------

def is_hand_written(plan: Mapping[str, Any]) -> bool:
    """Stages named by island, without GPUs or a rank layout: what ``tangram-launch plan --plan FILE`` costs."""
    stages = plan.get("stages")
    return ("rank_layout" not in plan and isinstance(stages, list) and bool(stages)
            and all(isinstance(s, Mapping) and "island" in s and "gpus" not in s for s in stages))


def host_names() -> set[str]:
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


def nnodes_range(nnodes: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` (read as ``torch.distributed.run.parse_min_max_nnodes`` does)."""
    parts = str(nnodes).split(":")
    try:
        if len(parts) in (1, 2):
            return int(parts[0]), int(parts[-1])
    except ValueError:
        pass
    raise SpecError("not a node count", field="--nnodes", value=nnodes, valid="N or MIN:MAX")


def check_world(layout: W.RankLayout, node: str, *, nnodes: str, nproc_per_node: int,
                source: str | None = None) -> None:
    """Refuse a plan that does not fit what the agents will start (before any worker does)."""
    min_nodes, max_nodes = nnodes_range(nnodes)
    plan_nodes = len(layout.nodes)
    if not (min_nodes == max_nodes == plan_nodes):
        raise SpecError(f"the plan has {plan_nodes} node(s) ({', '.join(layout.nodes)}); a fixed plan is not "
                        "elastic (for --nnodes MIN:MAX, give --cluster FILE instead of --plan: the launcher plans "
                        "each rendezvous round for the nodes present)", source=source, field="--nnodes",
                        value=nnodes, valid=str(plan_nodes))
    gpus = layout.local_slots(node)
    if nproc_per_node != len(gpus):
        raise SpecError(f"plan node {node!r} has {len(gpus)} GPU(s) (local GPUs "
                        f"{', '.join(str(s.local_gpu) for s in gpus)})", source=source, field="--nproc-per-node",
                        value=nproc_per_node, valid=str(len(gpus)))
    if plan_nodes > 1 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
        raise SpecError("a planned multi-node launch needs torch's shared agent store (the plan's rank 0 may sit on "
                        "any node)", field="TORCH_DISABLE_SHARE_RDZV_TCP_STORE", value="1", valid="unset or 0")


def validate_full_plan(plan: Mapping, layout: W.RankLayout, source: str) -> None:
    """A file with ``stages`` claims to be a Plan: it must load as one, so workers' ``current_plan().plan`` works."""
    if "stages" not in plan:
        return
    from tangram_launch.plan import Plan

    full = Plan.from_dict(plan, source=source)
    derived = [(r.rank, r.node, r.local_gpu) for r in full.rank_layout]
    if derived != [(s.rank, s.node, s.local_gpu) for s in layout.slots]:
        raise SpecError("rank_layout rows differ from the Plan's", source=source, field="rank_layout")


def read_plan_file(source: str, data: bytes | None = None, *, node_name: str | None, nnodes: str,
                   nproc_per_node: int | None, hosts: set[str] | None = None) -> CheckedPlan:
    """Read a ``--plan`` file and check it against the launch (``nproc_per_node=None``: not known yet)."""
    if data is None:
        from tangram_launch.specs.limits import read_bytes  # a FIFO, /dev/zero, a huge file: refused, not read

        data = read_bytes(source, what="plan file")
    plan = W.read_plan_dict(source, data)
    if is_hand_written(plan):
        return CheckedPlan(source=source, plan=plan, layout=None, node=None)
    layout = W.RankLayout.from_plan_dict(plan, source=source)
    validate_full_plan(plan, layout, source)
    node = resolve_node_name(layout, plan, node_name, host_names=host_names() if hosts is None else hosts,
                             source=source)
    if nproc_per_node is not None:
        check_world(layout, node, nnodes=nnodes, nproc_per_node=nproc_per_node, source=source)
    _check_plan_seq_len(plan, source)
    return CheckedPlan(source=source, plan=plan, layout=layout, node=node)


# --- model, runtime, target --------------------------------------------------------------------------------------

def check_seq_len(model: Any, seq_len: int, *, field: str, source: str | None = None, fix: str = "") -> None:
    """A sequence longer than a learned position table cannot run (rotary and no positions have no table)."""
    positions = model.num_position_embeddings
    if model.position_embedding == "learned" and positions is not None and seq_len > positions:
        raise SpecError(f"model {model.name} has {positions} learned positions, fewer than the sequence length",
                        source=source, field=field, value=seq_len, valid=f"at most {positions}{fix}")


def _check_plan_seq_len(plan: Mapping[str, Any], source: str) -> None:
    model = plan.get("model")
    seq_len = (plan.get("training") or {}).get("seq_len") if isinstance(plan.get("training"), Mapping) else None
    if not isinstance(model, Mapping) or isinstance(seq_len, bool) or not isinstance(seq_len, int):
        return
    from tangram_launch.specs.model import ModelSpec

    try:
        spec = ModelSpec.from_dict(model, source=source)
    except SpecError:  # a layout-only plan's partial model: the script decides what it needs
        return
    check_seq_len(spec, seq_len, field="training.seq_len", source=source,
                  fix=f": plan again with --seq-len {spec.num_position_embeddings} or less")


def module_findable(name: str, extra_paths: Iterable[str] = ()) -> bool:
    """Whether ``import name`` would find a module, without importing it or its parent packages."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        spec = None
    if spec is None and extra_paths:
        spec = importlib.machinery.PathFinder.find_spec(parts[0], list(extra_paths))
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                        list(spec.submodule_search_locations))
    return spec is not None


def check_runtime_packages(runtime: Any, *, field: str, source: str | None = None) -> None:
    for module, extra in RUNTIME_PACKAGES.get(str(runtime), ()):
        if not module_findable(module):
            raise SpecError(f"runtime {runtime} needs the {module} package, which is not installed in {sys.prefix}; "
                            f"install it with: pip install -e \".[{extra}]\"", source=source, field=field)


def check_resume_dir(directory: str) -> None:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise SpecError(f"{os.path.abspath(directory)} is a file, not a checkpoint directory", field="--resume",
                        value=directory, valid="a directory holding step_<N>/ checkpoints")
    if not os.path.isdir(directory):
        raise SpecError(f"checkpoint directory {os.path.abspath(directory)} does not exist", field="--resume",
                        value=directory, valid="a directory holding step_<N>/ checkpoints")


def check_target(args: argparse.Namespace, cwd: str | None = None) -> None:
    """The script file, the ``-m`` module or the ``--no-python`` command exists."""
    target = args.training_script
    cwd = cwd or os.getcwd()
    if args.no_python and args.module:
        return  # torch refuses the pair with its own message
    if args.no_python:
        found = (os.path.isfile(target) and os.access(target, os.X_OK)) if os.sep in target else shutil.which(target)
        if not found:
            raise SpecError(f"command not found: {target} (--no-python runs the target as a command)",
                            field="training_script", valid="a command on PATH or the path of an executable file")
        return
    if args.module:
        if not module_findable(target, extra_paths=[cwd]):
            raise SpecError(f"no module named {target} (-m runs a module, as python -m does, from {cwd})",
                            field="training_script", valid="an importable module, or a script path without -m")
        return
    if os.path.isfile(os.path.join(cwd, target)):
        return
    hint = _closest_script(target, cwd)
    fix = f"did you mean {hint}?" if hint else "give the path of an existing Python file (or -m MODULE)"
    raise SpecError(f"training script not found: {target} (in {cwd}); {fix}")


def _closest_script(target: str, cwd: str) -> str | None:
    from tangram_launch.specs.yamlio import closest

    folder = os.path.dirname(target)
    where = os.path.join(cwd, folder)
    if not os.path.isdir(where):
        return None
    names = [n for n in os.listdir(where) if n.endswith(".py") or os.path.isdir(os.path.join(where, n))]
    match = closest(os.path.basename(target), names)
    return os.path.join(folder, match) if match else None


# --- CPU workers' threads ----------------------------------------------------------------------------------------

def cpu_thread_warning(omp_num_threads: str | None, *, nproc_per_node: int, cores: int) -> str | None:
    """What to tell a user whose CPU workers' thread pools would hold more threads than the node has cores; None if
    not.

    Each CPU worker computes on ``OMP_NUM_THREADS`` threads (torch's intra-op pool). torchrun sets it to 1 only where
    it is unset and several workers start, so a value from the user's shell stands: at 2 workers x 2 threads on 2
    cores the tiny main job's plan trained 2.8-3.0x slower than at 1 thread, and its profile read the host's time per
    operator 11x high: the plan is priced from threads waiting on each other. Not refused: torchrun runs it too."""
    if omp_num_threads is None:
        return None
    per_worker = max(1, cores // max(1, nproc_per_node))
    fix = f"set OMP_NUM_THREADS={per_worker} ({nproc_per_node} worker(s) x {per_worker} on {cores} core(s))"
    text = omp_num_threads.strip()
    valid = text.isdigit() and int(text) >= 1
    threads = int(text) if valid else cores  # OpenMP ignores a value it cannot read: a thread per core
    if threads <= 1 or threads * nproc_per_node <= cores:  # one thread a worker: time-shared, no pool to spin
        return None
    if not valid:
        return (f"OMP_NUM_THREADS={omp_num_threads!r} is not a positive whole number: OpenMP ignores it and each "
                f"of the {nproc_per_node} CPU worker(s) starts a thread per core; {fix}")
    return (f"OMP_NUM_THREADS={threads} gives each of the {nproc_per_node} CPU worker(s) {threads} threads: "
            f"{threads * nproc_per_node} threads on {cores} core(s), which wait on each other and slow the profile "
            f"and the training several times over; {fix}")


# --- the whole check ---------------------------------------------------------------------------------------------

def check_launch(args: argparse.Namespace, *, nproc_per_node: Callable[[], int | None],
                 can_plan: bool = True) -> CheckedPlan | None:
    """Every pre-flight check of a launch's command line (``args``: torch's namespace or the early reading's).

    ``nproc_per_node`` resolves ``--nproc-per-node`` (None: not without torch); it is called only for a plan.
    ``can_plan``: the launcher plans at launch time (else the planning options are refused, not checked).
    Returns the checked ``--plan`` file, if any.
    """
    checked = None
    runtime, runtime_field, runtime_source = args.runtime, "--runtime", None
    if args.plan is not None:
        checked = read_plan_file(args.plan, node_name=args.node_name, nnodes=args.nnodes,
                                 nproc_per_node=nproc_per_node())
        if not checked.hand_written:
            runtime, runtime_field, runtime_source = checked.plan.get("runtime"), "runtime", checked.source
        elif args.model is None and args.resume is None:
            raise SpecError("a hand-written plan (stages by island, no rank_layout) is costed before the launch, "
                            "for a model on a cluster", source=args.plan, field="--model",
                            valid="add --model NAME and --cluster FILE (or --profile)")
    plans_here = can_plan and (checked is None or checked.hand_written)  # a laid-out plan fixes model, cluster
    if args.cluster is not None and plans_here and not (args.profile or args.reprofile):  # both: planning says
        from tangram_launch.specs.limits import read_bytes

        read_bytes(args.cluster, what="cluster file")
    if args.model is not None and plans_here:
        from tangram_launch.specs.model import load_model

        model = load_model(args.model)
        if args.seq_len is not None:
            check_seq_len(model, args.seq_len, field="--seq-len")
    if args.resume is not None:
        check_resume_dir(args.resume)
    if runtime is not None:
        check_runtime_packages(runtime, field=runtime_field, source=runtime_source)
    check_target(args)
    return checked
