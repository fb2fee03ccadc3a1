"""Planning at launch time: ``tangram-launch --cluster FILE | --profile --model NAME ... script.py``.

The launcher's plan provider (see :func:`tangram_launch.launch.run`).  It runs on every agent and must give every
agent the same plan bytes (the workers' boot compares sha256 across agents), so:

* planning is deterministic for the same cluster, model and options (the planner is), and the file is canonical
  JSON (sorted keys, fixed indentation) without the planner's wall-clock figures (``planning_time_s``, query and
  compose times, pool size), which are logged instead.  Every agent plans for itself; no agent waits for another,
  and agents that were given different cluster files fail the boot-time hash check, naming both.
* ``--profile`` measures this node first through ``tangram-launch profile`` (the same torchrun options) and caches
  the ClusterSpec under ``$TANGRAM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tangram-launch`` or
  ``~/.cache/tangram-launch``), keyed by the hardware fingerprint of the live node (host, CPUs, memory, GPU names and
  UUIDs, NICs, worker count), read without any benchmark.  A later launch on the same hardware reuses it; a changed
  fingerprint profiles again.  With ``--model`` (and a searched plan) the profile also times the model's layers at
  the shapes the planner prices, which the cost model then prices the stages from; a cached profile without them
  is profiled again (:func:`profile_cluster`).  A multi-node ``--profile`` is refused: the profiler writes the
  ClusterSpec on global rank 0's node only, so the other agents could not plan; profile once and launch with
  ``--cluster``.
* a plan that leaves GPUs out (the planner dropped an island that only adds a bottleneck) is refused with the
  reason and the ``--nproc-per-node`` that launches the GPUs it uses: the launcher starts one worker per GPU
  (torchrun's contract), so it never starts workers the plan has no rank for.

Resuming (``--resume DIR``): the newest complete checkpoint in DIR is described (missing: exit 2 naming DIR); the
run is re-planned for the cluster as it is now (``--cluster``, else ``--profile`` implied) with the checkpoint's
model, global batch, sequence length, dtype and runtime unless given again, and what changed between the
checkpoint's plan and the new one is logged before any worker starts.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.yamlio import dump_bytes_file

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.checkpoint.store import CheckpointInfo
    from tangram_launch.launch.profile_cache import LayerShapes
    from tangram_launch.launch.torchrun import LaunchOptions, TangramOptions
    from tangram_launch.plan import Plan
    from tangram_launch.planner.options import PlannerOptions
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "TANGRAM_CACHE_DIR"
# Planner statistics that differ from run to run (wall-clock times, pool size): logged, never in the plan's bytes.
VOLATILE_PLANNER_KEYS = ("planning_time_s", "query_time_s", "compose_time_s", "workers")
IDENTITY_VERSION = 1


# --- canonical plan bytes ------------------------------------------------------------------------------------------

def canonical_plan_bytes(plan: "Plan") -> bytes:
    """The plan as canonical JSON: sorted keys, one-space indent, no volatile planner figures."""
    d = plan.to_dict()
    d["planner"] = {k: v for k, v in d.get("planner", {}).items() if k not in VOLATILE_PLANNER_KEYS}
    return (json.dumps(d, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def write_plan(plan: "Plan", directory: str) -> str:
    """Write the canonical plan as ``plan-<sha256[:16]>.json`` in ``directory`` (atomic); returns its path."""
    data = canonical_plan_bytes(plan)
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.path.abspath(directory), f"plan-{digest[:16]}.json")
    dump_bytes_file(data, path)
    return path


# --- the profile cache -----------------------------------------------------------------------------------------------

def cache_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    if env.get(ENV_CACHE_DIR):
        return os.path.abspath(env[ENV_CACHE_DIR])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tangram-launch")


def live_identity(nproc_per_node: int, *, inventory: Any = None, host: str | None = None) -> list:
    """This node's hardware identity, without a benchmark: NVML/sysfs inventory and the worker devices.

    Same shape as ``profiler.assemble.hardware_identity`` (one entry per node: name, inventory identity, devices),
    so on CPU nodes its fingerprint equals the one the profiler writes.  GPU devices are NVML's (name, UUID), the
    first ``nproc_per_node`` of them in ``CUDA_VISIBLE_DEVICES`` order when that is set.
    """
    from profiler.inventory import inventory_identity, read_node_inventory

    inv = inventory if inventory is not None else read_node_inventory()
    name = host or socket.gethostname()
    if inv.gpus:
        gpus = list(inv.gpus)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            picked = []
            for item in (v.strip() for v in visible.split(",") if v.strip()):
                match = [g for g in gpus if (item.isdigit() and g.index == int(item)) or g.uuid.startswith(item)]
                picked += match[:1]
            gpus = picked
        devices = [["cuda", g.name, g.uuid] for g in gpus[:nproc_per_node]]
        if len(devices) < nproc_per_node:
            devices += [["cuda", "?", ""]] * (nproc_per_node - len(devices))
    else:
        from profiler.assemble import cpu_threads_identity

        devices = [["cpu", "cpu", cpu_threads_identity(os.environ, nproc_per_node)]] * nproc_per_node
    return [{"name": name, "inventory": inventory_identity(inv), "devices": devices}]


def live_fingerprint(nproc_per_node: int, **kw: Any) -> str:
    from profiler.assemble import fingerprint

    return fingerprint(live_identity(nproc_per_node, **kw))


def _profile_path(directory: str, fingerprint: str) -> str:
    return os.path.join(directory, "profiles", fingerprint.split(":", 1)[-1] + ".yaml")


def cached_profile(directory: str, fingerprint: str, *, nproc_per_node: int,
                   need_full: bool) -> "ClusterSpec | None":
    """The cached ClusterSpec of this hardware, or None (absent, unreadable, quick when a full one is asked, or
    not this launch's shape)."""
    from tangram_launch.specs.cluster import ClusterSpec

    path = _profile_path(directory, fingerprint)
    if not os.path.exists(path):
        return None
    try:
        spec = ClusterSpec.load(path)
    except SpecError as exc:
        logger.warning("ignoring the cached profile %s: %s", path, exc)
        return None
    from tangram_launch.launch.profile_cache import seal_problem

    problem = seal_problem(path, fingerprint, spec.fingerprint)
    if problem:
        logger.warning("not reusing the cached profile %s: %s; profiling again", path, problem)
        return None
    if need_full and spec.profile.get("quick"):
        logger.info("the cached profile %s is a quick one; profiling again in full", path)
        return None
    if len(spec.nodes) != 1 or spec.nodes[0].num_gpus != nproc_per_node:
        logger.warning("ignoring the cached profile %s: it describes %d node(s) and %d device(s), this launch has 1 "
                       "node and %d", path, len(spec.nodes), spec.num_gpus, nproc_per_node)
        return None
    return spec


def profile_age(finished_at: str, now: "_dt.datetime | None" = None) -> str:
    """How long ago an ISO-8601 time was, in words: "3 h 12 min ago", "2 days 4 h ago", "age unknown"."""
    try:
        then = _dt.datetime.fromisoformat(str(finished_at))
    except ValueError:
        return "age unknown"
    if then.tzinfo is None:
        then = then.replace(tzinfo=_dt.timezone.utc)
    seconds = ((now or _dt.datetime.now(_dt.timezone.utc)) - then).total_seconds()
    if seconds < 0:
        return "measured in the future: check this machine's clock"
    minutes = int(seconds // 60)
    days, hours, mins = minutes // 1440, minutes // 60 % 24, minutes % 60
    if days:
        return f"{days} day{'s' if days != 1 else ''} {hours} h ago"
    if hours:
        return f"{hours} h {mins} min ago"
    return f"{mins} min ago"


# wall seconds one layer timing (a kind at a shape) may take at launch, by device type, and the most all of them
# may take on one device (profiler --layer-budget-s): a CPU timing back to back needs about 0.3 s (a calibration,
# a warm block, blocks of 0.1 s of process time); the cap is the profiler's quick layer budget
LAUNCH_LAYER_JOB_S = {"cpu": 0.35, "cuda": 1.0}
LAUNCH_LAYER_BUDGET_CAP_S = 15.0
# CPU devices: layers timed in blocks of back-to-back calls, as the busiest stage runs, with the stage-like
# sequence the cost model scales stages by (profiler --layer-timing; GPUs ignore it)
LAUNCH_LAYER_TIMING = "back-to-back"


def profile_cluster(options: "LaunchOptions", *, quick: bool = False, directory: str | None = None,
                    nproc_per_node: int | None = None, reprofile: bool = False,
                    layers: "LayerShapes | None" = None) -> tuple["ClusterSpec", str, bool]:
    """(ClusterSpec, its cache path, whether it was reused): the cached profile of this hardware, or a new one.

    The profile runs with the launch's torchrun options (``options.torchrun``). With ``layers``, it also times the
    model's layers at those shapes (``profiler --model``), and a cached profile is reused only if its layer timings
    were asked for every one of them (profile_cache.covers): else the node is profiled again with them, and the new
    profile replaces the cached one. Not merged: the profiler times the cross product of sequence lengths, sizes
    and TP shards within one budget, so the union with the cached shapes would hold shapes neither launch needs,
    and its budget would leave out some this launch needs.
    """
    from tangram_launch.launch.profile_cache import calibrations, covers, keep_aside, recorded_layer_shapes, seal

    args = options.torchrun
    if not options.single_node:
        raise SpecError("--profile measures the nodes at launch on a single node only (the profiler writes the "
                        "ClusterSpec on global rank 0's node); run `tangram-launch profile [the same torchrun "
                        "options] -o cluster.yaml` once, copy cluster.yaml to every node and launch with --cluster "
                        "cluster.yaml", field="--profile", value=f"--nnodes {args.nnodes}", valid="--nnodes 1")
    directory = directory or cache_dir()
    nproc = nproc_per_node or options.nproc_per_node
    identity = live_identity(nproc)
    from profiler.assemble import fingerprint

    fp = fingerprint(identity)
    spec = None if reprofile else cached_profile(directory, fp, nproc_per_node=nproc, need_full=not quick)
    path = _profile_path(directory, fp)
    if spec is not None and layers is not None and not covers(recorded_layer_shapes(spec.profile), layers):
        logger.info("the cached profile %s has no layer timings of %s; profiling this node again with them",
                    path, layers.label())
        spec = None
    if spec is not None:
        measured = spec.profile.get("finished_at", "?")
        calibrated = calibrations(path)
        since = (f", calibrated from {len(calibrated)} run report(s), last at {calibrated[-1].get('at', '?')}"
                 if calibrated else "")
        logger.info("reusing the cached profile %s, measured %s (%s; hardware fingerprint %s unchanged%s). A "
                    "profile taken while the machine was busy stays until removed: to measure again, pass "
                    "--reprofile or delete that file", path, measured, profile_age(measured), fp, since)
        return spec, path, True
    logger.info("no cached profile for hardware fingerprint %s; profiling this node with %d worker(s)%s", fp, nproc,
                " (quick)" if quick else "")
    from tangram_launch.launch.profiling import ProfileRequest
    from tangram_launch.launch.profiling import profile_cluster as run_profile
    from tangram_launch.specs.cluster import ClusterSpec

    if layers is not None and layers.dtype is None and _device_kind(identity) == "cpu":
        layers = replace(layers, dtype=likely_cpu_dtype())
        logger.info("timing %s's layers in %s, the faster here in a small product (the profile's GEMM then chooses "
                    "the dtype the launch trains in)", layers.model, layers.dtype)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staged = f"{path}.new-{os.getpid()}"
    request = ProfileRequest(output=staged, torchrun_argv=tuple(options.torchrun_argv()), quick=quick,
                             nnodes=str(args.nnodes), rdzv_endpoint=getattr(args, "rdzv_endpoint", "") or "",
                             **_layer_fields(layers, identity))
    try:
        run_profile(request)  # single node (checked above): this node writes the file
        spec = ClusterSpec.load(staged)
        kept = keep_aside(path, fp, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        if kept:
            logger.info("kept the cached profile it replaces (edited or calibrated since it was measured) as %s", kept)
        os.replace(staged, path)
        seal(path, fp, spec.fingerprint)
    finally:
        with contextlib.suppress(OSError):
            os.remove(staged)
    if spec.fingerprint and spec.fingerprint != fp:
        logger.info("the profile's own fingerprint is %s (the cache key is this node's %s)", spec.fingerprint, fp)
    logger.info("cached the profile as %s", path)
    return spec, path, False


def _device_kind(identity: list) -> str:
    return "cuda" if any(d[0] == "cuda" for node in identity for d in node["devices"]) else "cpu"


def likely_cpu_dtype(size: int = 256, reps: int = 3) -> str:
    """The dtype a CPU launch will most likely train in (dtype_choice: the fastest measured GEMM), guessed from a
    ``size``-cubed product in each candidate dtype (a few ms; a CPU without bf16 hardware takes tens of ms), so
    that the profile times the layers in that dtype at once: the layers of a dtype without hardware support take
    many times the layer budget's share, and in the wrong dtype they would be timed twice."""
    import torch

    from tangram_launch.launch.dtype_choice import CPU_CANDIDATE_DTYPES

    best: dict[str, float] = {}
    for name in CPU_CANDIDATE_DTYPES:
        a = torch.ones(size, size, dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[name]))
        torch.mm(a, a)  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, a)
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return min(CPU_CANDIDATE_DTYPES, key=lambda d: (best[d], CPU_CANDIDATE_DTYPES.index(d)))


def _layer_fields(shapes: "LayerShapes | None", identity: list) -> dict[str, Any]:
    """ProfileRequest's ``--model`` fields for ``shapes`` on this node (``identity``: live_identity's): a budget of
    LAUNCH_LAYER_JOB_S per timing, at most LAUNCH_LAYER_BUDGET_CAP_S (the shapes beyond it are left out, largest
    first, and priced from the nearest measured one)."""
    if shapes is None:
        return {}
    from profiler.layer import layer_kinds
    from tangram_launch.specs.model import load_model

    kind = _device_kind(identity)
    jobs = shapes.jobs(len(layer_kinds(load_model(shapes.source or shapes.model))))
    return {"model": shapes.source or shapes.model, "seq_len": shapes.seq_lens, "micro_batch": shapes.micro_batches,
            "tp": shapes.tps, "layer_dtype": shapes.dtype, "layer_timing": LAUNCH_LAYER_TIMING,
            "layer_budget_s": round(min(LAUNCH_LAYER_BUDGET_CAP_S, jobs * LAUNCH_LAYER_JOB_S[kind]), 2)}


def launch_layer_shapes(inputs: "PlanningRequest", devices: int, *, source: str,
                        dtype: str | None) -> "LayerShapes":
    """The shapes the planner asks the cost model about for this launch, on one node of ``devices`` devices: the
    launch's sequence length, every rows-per-replica it may price (profile_cache.planner_micro_batches), and the
    TP shards it considers on the node (profiler.layer.tp_shards; tp 1 where the runtime has no tensor
    parallelism); in ``dtype`` (None: the profiler's default, checked once the launch's dtype is chosen).
    ``source``: the ``--model`` argument, which the profiler loads again."""
    from profiler.layer import tp_shards
    from tangram_launch.capabilities import runtime
    from tangram_launch.launch.profile_cache import LayerShapes, planner_micro_batches

    tps = tp_shards(inputs.model, devices) if runtime(inputs.runtime).capabilities.tensor_parallel else [1]
    return LayerShapes(model=inputs.model.name, seq_lens=(inputs.seq_len,),
                       micro_batches=planner_micro_batches(inputs.global_batch, inputs.options.microbatch_sequences,
                                                           devices),
                       tps=tuple(sorted(set(tps))), dtype=dtype, source=source)


def measurement_lines(plan: "Plan") -> list[str]:
    """One line per stage saying how its time was priced: from which measured layer times (the plan's
    ``predicted.stages[k].measured``, costmodel/measured_layers.py), how far from a measured shape, or by the
    analytic model alone."""
    out = []
    for k, stage in enumerate(plan.predicted.stages):
        m = stage.measured
        if not m:
            out.append(f"stage {k}: priced by the analytic model (no measured layer times of this model)")
            continue
        steps = float(m.get("distance", 0.0))
        how = {"measured": "at measured shapes",
               "interpolated": "interpolated between measured shapes",
               "scaled": "scaled by the analytic model from the nearest measured shape"}.get(m.get("how"), m.get("how"))
        far = f", {2 ** steps:.3g}x from the nearest measured size" if steps > 0 else ""
        analytic = m.get("analytic_parts")
        rest = f"; {', '.join(analytic)} by the analytic model" if analytic else ""
        out.append(f"stage {k}: priced from measured layer times ({', '.join(m.get('parts', ()))}) {how}{far}{rest}")
    return out


# --- what to plan ----------------------------------------------------------------------------------------------------

DEFAULT_PARALLELIZER = "megatron"


@dataclass(frozen=True)
class PlanningRequest:
    """Everything a plan is made from, whichever command line asked (``tangram-launch plan`` or launch-time planning):
    built by :func:`planning_request` with one set of defaults, so the same arguments give the same plan bytes."""

    model: "ModelSpec"
    training: "TrainingSpec"  # global batch, sequence length, dtype, optimizer, memory headroom
    runtime: str  # a registered runtime (tangram_launch.capabilities.runtime)
    parallelizer: str
    options: "PlannerOptions"  # schedule, micro-batch sizes, pruning, workers
    cluster: "ClusterSpec | None" = None  # where known when the request is built (launch: after --profile)
    dtype_reason: str = ""  # one line: why this dtype (given, the checkpoint's, fastest measured, the default)

    def __post_init__(self) -> None:
        from tangram_launch.launch.preflight import check_seq_len

        check_seq_len(self.model, self.seq_len, field="--seq-len")  # the workers would refuse it

    @property
    def global_batch(self) -> int:
        return self.training.global_batch

    @property
    def seq_len(self) -> int:
        return self.training.seq_len

    @property
    def dtype(self) -> str:
        return self.training.dtype

    @property
    def optimizer(self) -> str:
        return self.training.optimizer

    @property
    def schedule(self) -> str:
        return self.options.schedule



def default_seq_len(model: "ModelSpec") -> int:
    """Tokens per sequence when none is given (nor a checkpoint's): the model's context, at most TrainingSpec's
    default (2,048): a full long context (Llama-3's 8,192 or 131,072) is rarely what a first plan is for."""
    from tangram_launch.specs.training import TrainingSpec

    return min(model.max_seq_len, TrainingSpec().seq_len)


def planning_request(values: Any, *, resume: "CheckpointInfo | None" = None, cluster: "ClusterSpec | None" = None,
                     progress: bool | None = None) -> PlanningRequest:
    """The request from either command line's values (an argparse namespace or TangramOptions: absent or None
    attributes take the defaults); when resuming, the checkpoint's plan fills what was not given again."""
    from tangram_launch.capabilities import DEFAULT_RUNTIME, runtime
    from tangram_launch.launch.dtype_choice import launch_dtype_choice
    from tangram_launch.planner.options import PlannerOptions
    from tangram_launch.planner.slices import DEFAULT_BALANCE_TOLERANCE, PruningPolicy
    from tangram_launch.specs.model import ModelSpec, load_model
    from tangram_launch.specs.training import TrainingSpec

    def given(name: str) -> Any:
        return getattr(values, name, None)

    old = dict(resume.plan) if resume is not None else {}
    old_training = dict(old.get("training") or {})
    if given("model") is not None:
        model = load_model(given("model"))
    elif old.get("model"):
        model = ModelSpec.from_dict(old["model"], source=f"{resume.path}/plan.json")
    else:
        raise SpecError("planning needs a model", field="--model",
                        valid="a preset name, a model YAML or a Hugging Face config.json")
    default = TrainingSpec()
    # the one place the dtype is decided: given, else the checkpoint's, else on profiled CPUs the fastest measured
    dtype = launch_dtype_choice(cluster, default=default.dtype, given=given("dtype"), resumed_plan=old)
    training = {
        "global_batch": int(given("global_batch") or old_training.get("global_batch") or default.global_batch),
        "seq_len": int(given("seq_len") or old_training.get("seq_len") or default_seq_len(model)),
        "dtype": dtype.dtype,
        "optimizer": str(given("optimizer") or old_training.get("optimizer") or default.optimizer)}
    if given("memory_headroom") is not None:
        training["memory_headroom_fraction"] = given("memory_headroom")
    kernel = given("attention_kernel") or old_training.get("attention_kernel")
    if kernel:
        training["attention_kernel"] = str(kernel)
    name = str(given("runtime") or old.get("runtime") or DEFAULT_RUNTIME)
    runtime(name)  # a registered runtime, built in or third-party: else SpecError naming the registered ones
    no_prune = tuple(given("no_prune") or ())
    tolerance = given("balance_tolerance")
    sizes = given("microbatch_sequences")
    options = PlannerOptions(
        pruning=PruningPolicy(redundant="redundant" not in no_prune, unbalanced="unbalanced" not in no_prune,
                              infeasible="infeasible" not in no_prune,
                              balance_tolerance=DEFAULT_BALANCE_TOLERANCE if tolerance is None else tolerance),
        max_workers=given("workers"), schedule=given("schedule") or "auto", progress=progress,
        microbatch_sequences=tuple(sizes) if sizes else None,
        gpu_counts=str(given("gpu_counts") or (old.get("planner") or {}).get("gpu_counts") or "tiling"))
    return PlanningRequest(
        model=model, training=TrainingSpec(**training), runtime=name,
        parallelizer=str(given("parallelizer") or _registered((old.get("planner") or {}).get("parallelizer"))
                         or DEFAULT_PARALLELIZER),
        options=options, cluster=cluster, dtype_reason=dtype.reason)


def plan_inputs(opts: "TangramOptions", resume: "CheckpointInfo | None" = None) -> PlanningRequest:
    """Launch-time planning's request (planning_request without progress output)."""
    return planning_request(opts, resume=resume, progress=False)


def _explicit_dtype(opts: "TangramOptions", request: Any) -> str | None:
    """The dtype the launch trains in whatever the profile measures (``--dtype``, else a resumed checkpoint's);
    None: the profile's figures decide it (dtype_choice)."""
    resumed = ((dict(request.resume.plan).get("training") or {}).get("dtype") if request.resume is not None else None)
    return getattr(opts, "dtype", None) or resumed or None


def _registered(name: Any) -> str | None:
    """The checkpoint plan's parallelizer when it is one this install has (a hand-written plan names none)."""
    from tangram_launch.parallelizers.registry import registered_names

    return name if isinstance(name, str) and name in registered_names() else None


def make_launch_plan(cluster: "ClusterSpec", request: PlanningRequest) -> "Plan":
    """The request's plan on ``cluster`` (the planner proposes only what the request's runtime executes)."""
    from tangram_launch.planner.plan_search import make_plan

    return make_plan(cluster, request.model, request.training, runtime=request.runtime,
                     parallelizer=request.parallelizer, options=request.options)


def check_plan_fits_launch(plan: "Plan", cluster: "ClusterSpec", *, nproc_per_node: int, node: str | None = None,
                           source: str | None = None, single_node: bool = False) -> None:
    """Refuse a plan that leaves out GPUs this launch would start workers on, saying what to launch instead.

    A single-node launch of a one-node cluster is not refused: the launcher starts only the workers the plan uses
    (:func:`workers_for_plan`)."""
    used = plan.node_gpu_counts()
    if sum(used.values()) == cluster.num_gpus:
        return
    if single_node and len(cluster.nodes) == 1 and used.get(cluster.nodes[0].name, 0) > 0:
        return
    dropped = "; ".join(d.get("reason", d.get("island", "?")) for d in plan.islands_dropped) or "no island dropped"
    per_node = ", ".join(
        f"{n.name}: {used.get(n.name, 0)} of {n.num_gpus} (local GPUs "
        f"{','.join(str(g) for nn, g in sorted((r.node, r.local_gpu) for r in plan.rank_layout) if nn == n.name) or 'none'})"
        for n in cluster.nodes)
    mine = used.get(node, 0) if node is not None else None
    if mine is not None and mine == nproc_per_node and len(used) == len(cluster.nodes):
        return  # the user already launches exactly the GPUs the plan uses
    hint = (f"launch --nproc-per-node {mine} on node {node}" if mine else
            f"leave node {node} out of the launch" if node is not None else "launch only the GPUs the plan uses")
    raise SpecError(f"the plan uses {sum(used.values())} of the cluster's {cluster.num_gpus} GPUs ({per_node}) "
                    f"because the planner left islands out ({dropped}); tangram-launch starts one worker per GPU, "
                    f"so {hint} (with CUDA_VISIBLE_DEVICES selecting the GPUs used), or give a cluster file without "
                    "the left-out GPUs", source=source, field="--nproc-per-node", value=nproc_per_node,
                    valid=str(mine) if mine else None)


def visible_devices(plan: Mapping[str, Any], node: str, before: str | None, nproc_before: int) -> str:
    """CUDA_VISIBLE_DEVICES for the plan's GPUs on ``node``, in the numbering the launch started with: worker i
    (LOCAL_RANK i) then sees the plan's i-th local GPU of the node as its device 0 + i, as boot places it."""
    devices = [d.strip() for d in before.split(",")] if before else [str(i) for i in range(nproc_before)]
    used = sorted(int(r["local_gpu"]) for r in plan.get("rank_layout", ()) if r.get("node") == node)
    return ",".join(devices[g] for g in used if g < len(devices))


def workers_for_plan(plan: Mapping[str, Any], node: str, nproc_per_node: int,
                     visible_before: str | None) -> tuple[int, dict[str, str]] | None:
    """(workers to start, environment) when the plan uses fewer of ``node``'s GPUs than the launch would start
    workers on; None when it uses them all. The planner may leave GPUs out (a GPU that would only slow the pipeline
    down); a single-node launch then starts one worker per GPU the plan uses, on those GPUs."""
    used = sum(1 for r in plan.get("rank_layout", ()) if r.get("node") == node)
    if used == nproc_per_node or used == 0:
        return None
    return used, {"CUDA_VISIBLE_DEVICES": visible_devices(plan, node, visible_before, nproc_per_node)}


def this_node(cluster: "ClusterSpec", requested: str | None) -> str | None:
    if requested is not None:
        return requested
    if len(cluster.nodes) == 1:
        return cluster.nodes[0].name
    hosts = {socket.gethostname(), socket.getfqdn()}
    hosts |= {h.split(".", 1)[0] for h in hosts}
    matches = [n.name for n in cluster.nodes if n.name in hosts or (n.host and n.host in hosts)]
    return matches[0] if len(matches) == 1 else None


# --- the provider ----------------------------------------------------------------------------------------------------

def provide_plan(request: Any) -> str:
    """The launcher's plan provider: cluster (file or profile) -> plan -> canonical file in the request's dir.

    ``request`` is a :class:`tangram_launch.launch.torchrun.PlanRequest` (launch options, resume info, out dir).
    """
    from tangram_launch.specs.cluster import ClusterSpec

    opts = request.options.tangram
    if opts.cluster and (opts.profile or opts.reprofile):
        raise SpecError("give either --cluster FILE or --profile", field="--profile")
    nproc = request.options.nproc_per_node
    inputs = plan_inputs(opts, request.resume)  # a bad model name fails before any profiling
    if opts.cluster:
        cluster = ClusterSpec.load(opts.cluster)
        source = opts.cluster
    else:
        if not opts.profile:
            logger.info("no --cluster given: profiling this node (--profile)")
        cluster, source = _profiled_cluster(request, inputs)
    # again with the cluster, whose measured figures can decide the dtype (a dtype given or resumed wins)
    inputs = planning_request(opts, resume=request.resume, cluster=cluster, progress=False)
    from tangram_launch.launch.dtype_choice import mfu_peak_label

    logger.info("%s", inputs.dtype_reason)
    from tangram_launch.text import device_noun

    logger.info("planning %s on %s (%d %s): global batch %d x %d tokens, %s, runtime %s, parallelizer %s",
                inputs.model.name, cluster.name, cluster.num_gpus,
                device_noun(cpu=all(g.type == "cpu" for _, g in cluster.iter_gpus())), inputs.global_batch,
                inputs.seq_len, inputs.dtype, inputs.runtime, inputs.parallelizer)
    if request.hand_written:  # costed as `tangram-launch plan --plan FILE` does, not searched
        from tangram_launch.launch.hand_written import cost_hand_written

        plan = cost_hand_written(request.hand_written, cluster, inputs)
    else:
        plan = make_launch_plan(cluster, inputs)
    from tangram_launch.planner.report import format_plan_table

    table = format_plan_table(plan, cluster_name=cluster.name, manual=bool(request.hand_written),
                              mfu_peak=mfu_peak_label(cluster, inputs.dtype))
    for line in table.splitlines():
        logger.info("%s", line)
    if not request.hand_written and any(g.measured.get("layer_forward_s") for _, g in cluster.iter_gpus()
                                        if g.measured):
        for line in measurement_lines(plan):
            logger.info("%s", line)
    from tangram_launch.launch.calibration import unmeasured_layout_line

    if unmeasured := unmeasured_layout_line(cluster, plan.to_dict()):  # calibrated from other layouts
        logger.warning("%s", unmeasured)
    check_plan_fits_launch(plan, cluster, nproc_per_node=nproc, node=this_node(cluster, opts.node_name),
                           source=source, single_node=request.options.single_node)
    path = write_plan(plan, request.out_dir)
    logger.info("plan written to %s (sha256 of its bytes is what every agent compares; relaunch with --plan %s to "
                "skip planning)", path, path)
    return path


def _profiled_cluster(request: Any, inputs: PlanningRequest) -> tuple["ClusterSpec", str]:
    """(cluster, its cache path) of ``--profile``: with ``--model`` and a searched plan, the profile also times
    the model's layers at the shapes the planner prices (launch_layer_shapes), so that its stages are priced from
    them. Where the dtype the launch then trains in is not the one the layers were timed in (no ``--dtype``, and
    the profile found another dtype faster), the node is profiled again with the layers in that dtype: the cost
    model's layer times carry no dtype."""
    from tangram_launch.launch.profile_cache import recorded_layer_shapes

    opts, nproc = request.options.tangram, request.options.nproc_per_node
    layers = None
    if opts.model and not request.hand_written:
        layers = launch_layer_shapes(inputs, nproc, source=str(opts.model), dtype=_explicit_dtype(opts, request))
    cluster, source, _ = profile_cluster(request.options, quick=opts.profile_quick, nproc_per_node=nproc,
                                         reprofile=opts.reprofile, layers=layers)
    timed = recorded_layer_shapes(cluster.profile) if layers is not None else None
    dtype = planning_request(opts, resume=request.resume, cluster=cluster, progress=False).dtype
    if timed is not None and timed.dtype != dtype:
        logger.info("the layers were timed in %s and the launch trains in %s: profiling again with the layers in %s",
                    timed.dtype, dtype, dtype)
        cluster, source, _ = profile_cluster(request.options, quick=opts.profile_quick, nproc_per_node=nproc,
                                             reprofile=True, layers=replace(layers, dtype=dtype))
    return cluster, source


# --- resume -----------------------------------------------------------------------------------------------------------

def describe_resume(directory: str) -> "CheckpointInfo":
    """The newest complete checkpoint in ``directory``: checksums verified as the workers will (so both pick the
    same one), and what the workers will unpickle proven to be data (:mod:`tangram_launch.safe_load`)."""
    from tangram_launch.checkpoint.store import describe, read_manifest
    from tangram_launch.checkpoint.safe_load import check_checkpoint

    from tangram_launch.launch.preflight import check_resume_dir

    check_resume_dir(directory)
    info = describe(directory, checksums=True)
    check_checkpoint(info.path, read_manifest(info.path))
    pos = info.position
    logger.info("resuming from %s: step %d, %d samples consumed", info.path, info.step, pos.consumed_samples)
    for s in info.skipped:
        logger.warning("skipped a newer checkpoint: %s", s)
    return info


def _stage_rows(plan: Mapping[str, Any]) -> list[str]:
    rows = []
    for s in plan.get("stages") or ():
        gpus = s.get("gpus") or ()
        nodes = sorted({g["node"] for g in gpus if isinstance(g, Mapping)})
        layers = s.get("layers") or [0, 0]
        rows.append(f"layers {layers[0]}-{layers[1] - 1} on {s.get('island')} ({len(gpus)} GPU(s) on "
                    f"{','.join(nodes)}; tp{s.get('tp', 1)} dp{s.get('dp', 1)} zero{s.get('zero_stage', 0)})")
    return rows


def plan_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Lines saying what differs between two plan dicts: world size, stages, layer ranges, islands, batch."""
    out = []

    def world(p: Mapping) -> int:
        return len(p.get("rank_layout") or ())

    if world(old) != world(new):
        out.append(f"world size {world(old)} -> {world(new)}")
    old_rows, new_rows = _stage_rows(old), _stage_rows(new)
    if len(old_rows) != len(new_rows):
        out.append(f"stages {len(old_rows)} -> {len(new_rows)}")
    for i in range(max(len(old_rows), len(new_rows))):
        a = old_rows[i] if i < len(old_rows) else "-"
        b = new_rows[i] if i < len(new_rows) else "-"
        if a != b:
            out.append(f"stage {i}: {a} -> {b}")
    islands_old, islands_new = list(old.get("islands_used") or ()), list(new.get("islands_used") or ())
    if islands_old != islands_new:
        out.append(f"islands {', '.join(islands_old) or '-'} -> {', '.join(islands_new) or '-'}")
    to, tn = dict(old.get("training") or {}), dict(new.get("training") or {})
    for key in ("global_batch", "seq_len", "dtype"):
        if to.get(key) != tn.get(key):
            out.append(f"{key} {to.get(key)} -> {tn.get(key)}")
    if old.get("num_microbatches") != new.get("num_microbatches"):
        out.append(f"micro-batches {old.get('num_microbatches')} -> {new.get('num_microbatches')}")
    if old.get("runtime") != new.get("runtime"):
        out.append(f"runtime {old.get('runtime')} -> {new.get('runtime')}")
    oc, nc = dict(old.get("cluster") or {}), dict(new.get("cluster") or {})
    if oc.get("hash") != nc.get("hash") and (oc or nc):
        out.append(f"cluster {oc.get('name', '?')} ({oc.get('hash', '?')}) -> {nc.get('name', '?')} "
                   f"({nc.get('hash', '?')})")
    return out


def report_resume(info: "CheckpointInfo", new_plan: Mapping[str, Any], *, source: str | None = None) -> list[str]:
    """Refuse a plan for another model than the checkpoint's; log what changed; returns the change lines."""
    from tangram_launch.checkpoint import model_differences

    old = dict(info.plan)
    diffs = model_differences(dict(old.get("model") or {}), dict(new_plan.get("model") or {}))
    if diffs:
        detail = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} in the plan" for k, a, b in diffs)
        raise SpecError(f"the plan is for another model than the checkpoint {info.path}: {detail}", source=source,
                        field=f"model.{diffs[0][0]}", value=diffs[0][2], valid=repr(diffs[0][1]))
    changes = plan_changes(old, new_plan)
    if changes:
        logger.info("the plan changed since the checkpoint (step %d):", info.step)
        for line in changes:
            logger.info("  %s", line)
    else:
        logger.info("same layout as when the checkpoint (step %d) was written", info.step)
    old_gb = (old.get("training") or {}).get("global_batch")
    new_gb = (new_plan.get("training") or {}).get("global_batch")
    if old_gb is not None and new_gb is not None and old_gb != new_gb:
        logger.info("global batch %s -> %s: the data position continues from sample %d", old_gb, new_gb,
                    info.position.consumed_samples)
    return changes


def default_plan_dir() -> str:
    """Where launch-time plans are kept when there is no --log-dir."""
    return os.path.join(cache_dir(), "plans")


__all__ = ["canonical_plan_bytes", "write_plan", "cache_dir", "live_identity", "live_fingerprint", "cached_profile",
           "profile_cluster", "launch_layer_shapes", "measurement_lines", "PlanningRequest", "planning_request",
           "plan_inputs", "make_launch_plan", "check_plan_fits_launch", "workers_for_plan", "visible_devices",
           "provide_plan", "describe_resume", "plan_changes", "report_resume", "default_plan_dir"]
