"""The per-rank profiling worker: one per GPU (or CPU process) of every node, started by torchrun machinery.

``tangram-launch profile [torchrun args] -o cluster.yaml`` starts it; by hand it is

    torchrun --standalone --nproc-per-node 2 -m profiler.worker --output cluster.yaml --quick

Phases (each rank logs and records its phase, so a failure names where it stopped):
  inventory -> GEMM -> memory copy -> optimizer step per tensor and per parameter -> [model layers, embedding,
  head + loss] -> intra-node all-reduce ->
  tiny all-to-all [-> the same after a model layer's forward] -> intra-node p2p (round-robin) -> inter-node p2p
  (round-robin over nodes) -> gather; global rank 0 assembles and writes the ClusterSpec atomically.
On CPU nodes a model layer is timed with a tiny all-to-all over the node's processes after each call, as training
runs it (bench.time_interleaved).
Each local benchmark takes about ``--budget-s`` (bench.BenchConfig.budget_s), so every phase logs within seconds
on any device; counts of collectives that follow a budget are agreed over the node (their minimum).

Test hooks (environment, for the profiler's own tests): ``TANGRAM_PROFILE_TEST_EXIT_RANK=<global rank>`` makes that
rank exit with status 1 when the benchmarks start (a killed worker); ``TANGRAM_PROFILE_TEST_CGROUP=<cgroup dir>``
with ``TANGRAM_PROFILE_TEST_CGROUP_LOCAL_RANK=<local rank>`` moves that rank into a cgroup (v1 ``cpu``) before it
measures anything, to emulate a slower device.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import logging
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from profiler import LAYER_TIMINGS, bench
from profiler.assemble import (DeviceRecord, LikeGroup, LinkRecord, NodeRecord, ProfileRecord, assemble_cluster,
                               cpu_threads_identity, name_nodes)
from profiler.host_ops import host_op_us
from profiler.inventory import describe, read_node_inventory

log = logging.getLogger("profiler.worker")

EXIT_RANK_ENV = "TANGRAM_PROFILE_TEST_EXIT_RANK"
CGROUP_ENV = "TANGRAM_PROFILE_TEST_CGROUP"
CGROUP_RANK_ENV = "TANGRAM_PROFILE_TEST_CGROUP_LOCAL_RANK"


@dataclass(frozen=True)
class RankEnv:
    """This worker's place, from the variables torchrun's agent sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @classmethod
    def from_env(cls, env: dict | None = None) -> "RankEnv":
        env = os.environ if env is None else env
        missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in env]
        if missing:
            raise RuntimeError(f"profiler.worker runs under torchrun / tangram-launch profile; {missing} not set")
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                   node_rank=int(env.get("GROUP_RANK", 0)))


class Progress:
    """Phase tracking: a log line per phase on the reporting ranks and a status file the parent command reads
    to say which node and rank failed where (``<run_dir>/rank-<local rank>.json``)."""

    def __init__(self, run_dir: str | None, env: RankEnv, host: str, *, verbose: bool):
        self.run_dir = run_dir
        self.env = env
        self.host = host
        self.verbose = verbose
        self.node_name: str | None = None
        self.phase_name = "startup"
        self.started = time.perf_counter()
        self._write(state="running")

    def phase(self, name: str) -> None:
        self.phase_name = name
        if self.verbose:
            log.info("[%5.1fs] %s", time.perf_counter() - self.started, name)
        self._write(state="running")

    def done(self, **extra) -> None:
        self._write(state="done", **extra)

    def failed(self, error: str) -> None:
        self._write(state="failed", error=error)

    def _write(self, **fields) -> None:
        if not self.run_dir:
            return
        data = {"rank": self.env.rank, "local_rank": self.env.local_rank, "node_rank": self.env.node_rank,
                "host": self.host, "node": self.node_name, "phase": self.phase_name, "pid": os.getpid(), **fields}
        path = os.path.join(self.run_dir, f"rank-{self.env.local_rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def _join_test_cgroup(env: RankEnv) -> None:
    group = os.environ.get(CGROUP_ENV)
    if not group or os.environ.get(CGROUP_RANK_ENV) != str(env.local_rank):
        return
    with open(os.path.join(group, "cgroup.procs"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    log.warning("test hook: local rank %d joined cgroup %s", env.local_rank, group)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m profiler.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="ClusterSpec YAML to write (global rank 0, atomically)")
    p.add_argument("--run-dir", help="folder for per-rank status files (the parent command reads them)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds each local benchmark may take (default: 1 on CPU, 10 on GPU; --quick 0.4 / 2)")
    p.add_argument("--name", help="cluster name in the written file")
    p.add_argument("--model", help="time each layer kind, the embedding and the head of this model (preset, YAML or "
                                    "config.json)")
    p.add_argument("--seq-len", type=_int_list, help="sequence length(s) for --model, comma-separated (default: the "
                                                      "model's, capped)")
    p.add_argument("--micro-batch", type=_int_list, default=None,
                   help=f"micro-batch sizes for --model, comma-separated (default {_csv(DEFAULT_MICRO_BATCHES)})")
    p.add_argument("--tp", type=_int_list, default=None,
                   help="TP shards for --model, comma-separated (default: powers of two dividing the node's devices "
                        "and the heads)")
    p.add_argument("--layer-budget-s", type=float, default=None,
                   help=f"wall seconds all --model shapes may take on a device (default {LAYER_BUDGET_S:g}; --quick "
                        f"{LAYER_BUDGET_QUICK_S:g}); shapes that do not fit are left out, the last first")
    p.add_argument("--layer-dtype", default=None, choices=sorted(bench.DTYPES),
                   help="dtype for --model (default bf16)")
    p.add_argument("--layer-timing", choices=LAYER_TIMINGS, default="interleaved",
                   help="CPU devices: each --model call followed by an all-to-all of the node's processes "
                        "(interleaved), or blocks of back-to-back calls, an all-to-all after each (back-to-back)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    return p.parse_args(argv)


DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)  # the planner's micro-batch sizes between and beyond are priced from these
LAYER_BUDGET_S, LAYER_BUDGET_QUICK_S = 60.0, 15.0  # wall seconds for every --model shape on one device
# --layer-timing back-to-back: process seconds of one block of calls, many CFS periods of a throttled CPU device (its
# quota is enforced at the kernel's tick, in bursts of milliseconds) yet a few blocks within one shape's budget
LAYER_BLOCK_CPU_S = 0.1
WAKE_BUDGET_S = 8.0  # wall seconds of the wake-up cost's rounds (profiler.wake) on one device


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _csv(values) -> str:
    return ",".join(map(str, values))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    env = RankEnv.from_env()
    host = socket.gethostname()
    verbose = env.rank == 0
    logging.basicConfig(
        level=logging.INFO if (verbose or env.local_rank == 0) else logging.WARNING,
        format=f"[profile rank {env.rank}/{env.world_size} node {env.node_rank}] %(message)s",
    )
    progress = Progress(args.run_dir, env, host, verbose=verbose)
    try:
        _join_test_cgroup(env)
        writer = _profile(args, env, host, progress)
    except Exception as exc:  # every failure is reported with its phase; the traceback goes to the log
        text = f"{type(exc).__name__}: {exc}".strip()
        progress.failed(text)
        log.error("failed during %s on %s: %s", progress.phase_name, progress.node_name or host, text)
        log.debug("%s", traceback.format_exc())
        return 1
    progress.done(writer=writer)
    return 0


def _pick_device(env: RankEnv) -> tuple[torch.device, str]:
    """One GPU per rank (nccl); CPU processes over gloo where torch sees no GPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if env.local_world_size > count:
            raise RuntimeError(f"{env.local_world_size} workers on this node but {count} visible GPU(s): give "
                               f"--nproc-per-node {count} (or gpu); two workers on one GPU would each measure "
                               f"half a GPU")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank), "nccl"
    return torch.device("cpu"), "gloo"


@dataclass(frozen=True)
class _Run:
    """What every phase needs: this rank, its device and the benchmark sizes (no module-level state)."""

    args: argparse.Namespace
    env: RankEnv
    host: str
    progress: Progress
    device: torch.device
    backend: str
    cfg: bench.BenchConfig

    def barrier(self) -> None:
        dist.barrier(**({"device_ids": [self.device.index]} if self.device.type == "cuda" else {}))


def _profile(args: argparse.Namespace, env: RankEnv, host: str, progress: Progress) -> dict:
    started_at, t_start = _now(), time.perf_counter()
    device, backend = _pick_device(env)
    run = _Run(args, env, host, progress, device, backend, bench.BenchConfig.for_device(device.type, quick=args.quick,
                                                                             budget_s=args.budget_s))
    progress.phase(f"rendezvous ({backend}, {env.world_size} ranks)")
    init_kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **init_kwargs)
    try:
        layout = _inventory(run)
        # new_group is collective over the whole world: every rank creates every node's group, in the same order
        groups = {n: dist.new_group(layout.ranks_of[n]) for n in layout.node_ranks if len(layout.ranks_of[n]) > 1}
        local = _local_benchmarks(run, groups.get(env.node_rank))
        like = _like_groups(run, layout, local.gemm)
        bandwidth, latency, wait, fsdp, p2p, own = _intra_node(run, layout, groups, local.stand_in, tuple(local.gemm),
                                                               like)
        links, schedule = _inter_node(run, layout)
        return _gather_and_write(run, layout, local, (bandwidth, latency, wait, fsdp), p2p, links, schedule,
                                 started_at, t_start, own)
    finally:
        dist.destroy_process_group()


def _inventory(run: _Run) -> "_Layout":
    """Local rank 0 reads the node (NVML, sysfs); every rank says who it is and which device it holds."""
    env, device = run.env, run.device
    run.progress.phase("inventory")
    inventory = read_node_inventory() if env.local_rank == 0 else None
    if inventory is not None:
        if not inventory.nvml_available:
            log.info("NVML not used on %s (%s); profiling %s devices", run.host, inventory.nvml_status, device.type)
        log.info("%s", describe(inventory))
    me = {"rank": env.rank, "local_rank": env.local_rank, "node_rank": env.node_rank, "host": run.host,
          "device": str(device) if device.type == "cuda" else "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        me.update(uuid=str(getattr(props, "uuid", "")) or None, name=props.name, total_memory=props.total_memory)
    else:  # a CPU process is told apart by the threads it computes on (the fingerprint's device instance)
        me.update(uuid=cpu_threads_identity(os.environ, env.local_world_size))
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, (me, inventory))
    layout = _Layout.from_gathered(everyone)
    run.progress.node_name = layout.name_of[env.node_rank]
    if env.rank == 0:
        log.info("%d node(s): %s", len(layout.node_ranks),
                 ", ".join(f"{layout.name_of[n]} ({len(layout.ranks_of[n])} {device.type})" for n in layout.node_ranks))
    return layout


@dataclass(frozen=True)
class _Local:
    gemm: dict  # dtype -> Measured TFLOP/s
    copy: bench.Measured
    layer: dict  # kind -> {"forward", "forward_backward"} -> Measured
    model_info: dict | None
    optimizer: bench.Measured | None = None  # AdamW's fixed cost per parameter tensor, us
    stand_in: Callable[[], Any] | None = None  # one layer's forward at the planned shape (collective_wait_us)
    optimizer_param: bench.Measured | None = None  # AdamW's cost per parameter beyond the per-tensor cost, ns
    gemm_sweep: dict = field(default_factory=dict)  # dtype -> tuple of Measured TFLOP/s, one per (m, n, k)
    wake_up: bench.Measured | None = None  # a stage-like micro-batch after a wait against back to back, us
    stage_sequence: tuple = ()  # (micro-batch, stage-like sequence s, its parts' s), _profile_sequence
    host_op: bench.Measured | None = None  # host time per dispatched operator, us (profiler.host_ops)


def _local_benchmarks(run: _Run, node_group: Any = None) -> _Local:
    """GEMM per dtype, memory copy and (with --model) one layer, on every device at once.

    A barrier before each benchmark: every device of a node measures the same thing at the same time, so shared
    resources (host cores and their matrix units, power, PCIe) are loaded alike for all of them.
    """
    cfg, device = run.cfg, run.device
    agree = _group_min(node_group, device)
    gemm: dict[str, bench.Measured] = {}
    for i, dtype in enumerate(cfg.gemm_dtypes):  # a phase per dtype, each within the budget
        run.progress.phase(f"GEMM {dtype} up to {'x'.join(map(str, cfg.gemm_shape))} within {cfg.budget_s:g} s "
                           f"({i + 1} of {len(cfg.gemm_dtypes)})")
        if i == 0 and os.environ.get(EXIT_RANK_ENV) == str(run.env.rank):
            log.error("test hook: rank %d exits now", run.env.rank)
            logging.shutdown()
            os._exit(1)
        run.barrier()
        if bench.dtype_supported(device, dtype):
            best = max((m.value for m in gemm.values()), default=None)
            gemm[dtype] = bench.gemm_tflops(device, dtype, cfg, best_tflops=best,
                                            agree=agree if device.type == "cpu" and node_group is not None else None)
    if run.env.rank == 0:
        log.info("GEMM TFLOP/s on rank 0: %s", ", ".join(
            f"{d} {m.value:.3g} at {'x'.join(map(str, dict(m.detail)['shape_mkn']))}"
            + (f" ({dict(m.detail)['stopped']})" if "stopped" in dict(m.detail) else "") for d, m in gemm.items()))
    sweep = _gemm_sweep(run, gemm)
    run.progress.phase(f"memory copy {cfg.copy_bytes // bench.MiB} MiB")
    run.barrier()
    copy = bench.copy_bandwidth_gbps(device, cfg)
    if run.env.rank == 0:
        log.info("memory copy on rank 0: %.4g GB/s", copy.value)
    run.progress.phase("optimizer step per parameter tensor")
    run.barrier()
    optimizer = bench.optimizer_tensor_us(device, cfg)
    run.progress.phase("optimizer step per parameter")
    run.barrier()
    optimizer_param = bench.optimizer_param_ns(device, cfg, optimizer.value)
    if run.env.rank == 0:
        log.info("AdamW step on rank 0: %.3g us per parameter tensor + %.3g ns per parameter", optimizer.value,
                 optimizer_param.value)
    run.progress.phase("host time per dispatched operator")
    run.barrier()
    host_op = host_op_us(device, cfg)
    if run.env.rank == 0:
        log.info("host time on rank 0: %.3g us per dispatched operator", host_op.value)
    run.barrier()
    between = None
    if node_group is not None and device.type == "cpu":  # CPU processes share cores: time layers as training runs
        buf, out = torch.ones(run.env.local_world_size), torch.empty(run.env.local_world_size)

        def between() -> None:
            dist.all_to_all_single(out, buf, group=node_group)
    layer, model_info, stand_in = _profile_layer(run.args, device, cfg, run.progress, between, agree,
                                                 run.env.local_world_size)
    run.barrier()
    wake_up = _profile_wake_up(run, between or (lambda: None), agree)
    run.barrier()
    sequence = ()
    if wake_up is not None and between is not None and getattr(run.args, "layer_timing", None) == "back-to-back":
        sequence = _profile_sequence(run, between, agree, layer, int(dict(wake_up.detail)["layers"]))
        run.barrier()
    return _Local(gemm, copy, layer, model_info, optimizer, stand_in, optimizer_param, gemm_sweep=sweep,
                  wake_up=wake_up, stage_sequence=sequence, host_op=host_op)


def _profile_wake_up(run: _Run, between: Callable[[], Any], agree: Callable[[int], int]) -> bench.Measured | None:
    """With --model: the wake-up cost (profiler.wake) of a stage-like micro-batch at the layer profile's smallest
    shape, every device of the node at once (devices sharing a core share it after the wait too)."""
    if not run.args.model:
        return None
    from profiler.layer import LayerShape
    from profiler.wake import stage_layers, stage_sequence, time_wake_up
    from tangram_launch.specs.model import load_model

    model = load_model(run.args.model)
    shape = LayerShape(min(run.args.micro_batch or DEFAULT_MICRO_BATCHES),
                       min(_layer_seq_lens(run.args, model, run.device)), run.args.layer_dtype or "bf16")
    run.progress.phase(f"wake-up cost of {model.name} at {shape.label()} within {WAKE_BUDGET_S:g} s")
    try:
        layers = stage_layers(model, shape, run.device, budget_s=WAKE_BUDGET_S, agree=agree)
        measured = time_wake_up(stage_sequence(model, shape, run.device, layers), run.device,
                                budget_s=WAKE_BUDGET_S, between=between, agree=agree)
        measured = dataclasses.replace(measured, detail=measured.detail + (("layers", layers),))
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    if run.env.rank == 0:
        log.info("wake-up cost on rank 0: %.4g us per micro-batch after a wait", measured.value)
    return measured


def _gemm_sweep(run: _Run, gemm: dict) -> dict:
    """The GEMM sweep (bench.gemm_sweep) of each dtype measured at full size: with --model its layer shapes at the
    planner's TP degrees for one micro-batch at the layer profile's sequence length, the small squares always."""
    from tangram_launch.costmodel.gemm_curve import SMALL_SHAPES, sweep_shapes

    shapes = list(SMALL_SHAPES)
    if run.args.model:
        from tangram_launch.specs.model import load_model

        model = load_model(run.args.model)
        micro_batch = min(run.args.micro_batch or DEFAULT_MICRO_BATCHES)  # the layer profile's smallest shape
        shapes = sweep_shapes(model, tokens=micro_batch * min(_layer_seq_lens(run.args, model, run.device)))
    out = {}
    run.barrier()  # once: which dtypes are swept may differ between ranks (a dtype `stopped` on one of them)
    for dtype, large in gemm.items():
        if "stopped" in dict(large.detail):  # no hardware support: training should not use it
            continue
        run.progress.phase(f"GEMM sweep {dtype}: {len(shapes)} shapes within {run.cfg.budget_s:g} s")
        out[dtype] = tuple(bench.gemm_sweep(run.device, dtype, shapes, run.cfg, tflops_hint=large.value))
    return out


def _group_min(group: Any, device: torch.device) -> Callable[[int], int]:
    """The smallest of a count over ``group``'s members (a count of collectives every member must issue alike)."""
    if group is None:
        return lambda n: n

    def smallest(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())
    return smallest


def _intra_node(run: _Run, layout: "_Layout", groups: dict, stand_in: Callable[[], Any] | None = None,
                dtypes: tuple[str, ...] = ("fp32",), like: tuple | None = None) -> tuple:
    """The bandwidth collectives (``bench.BANDWIDTH_OPS``) and the small collectives (``_small_collectives``) over
    each node's ranks, then the small collectives again over this rank's like group (``like``: (its ranks, their
    process group), where ``_like_groups`` made one), then point-to-point between every pair of a node's ranks
    (round-robin rounds); every node at once, since nodes do not share these links. Returns ({op: bus bandwidth},
    latency, wait, FSDP2 (forward, backward, optimizer) or None, p2p, LikeGroup or None)."""
    env = run.env
    bandwidth: dict[str, bench.Measured] = {}
    latency = wait = fsdp = None
    if env.node_rank in groups:
        size = len(layout.ranks_of[env.node_rank])
        for op in bench.BANDWIDTH_OPS:
            run.progress.phase(f"intra-node {op.replace('_', '-')}")
            bandwidth[op] = bench.collective_busbw_gbps(op, groups[env.node_rank], size, run.device, run.cfg)
        if env.local_rank == 0:
            log.info("busbw on %s: %s", layout.name_of[env.node_rank],
                     ", ".join(f"{op.replace('_', '-')} {m.value:.4g} GB/s" for op, m in bandwidth.items()))
        latency, wait, fsdp = _small_collectives(run, groups[env.node_rank], size, stand_in, dtypes,
                                                 layout.name_of[env.node_rank], env.local_rank == 0)
    own = None
    if like is not None:
        members, group = like
        own = LikeGroup(members, *_small_collectives(run, group, len(members), stand_in, dtypes,
                                                     f"like ranks {list(members)}", env.rank == members[0]))
    run.barrier()

    p2p: list[tuple[int, int, int, bench.Measured]] = []  # (node rank, local a, local b, GB/s)
    node_rounds = {n: bench.round_robin(layout.ranks_of[n]) for n in layout.node_ranks}
    local = layout.ranks_of[env.node_rank]
    for r in range(max((len(v) for v in node_rounds.values()), default=0)):
        rounds = node_rounds[env.node_rank]
        pair = next(((a, b) for a, b in rounds[r] if env.rank in (a, b)), None) if r < len(rounds) else None
        if pair is not None:
            a, b = pair
            peer = b if env.rank == a else a
            run.progress.phase(f"intra-node p2p round {r + 1} with rank {peer}")
            t = bench.ping_pong(peer, initiator=env.rank == a, nbytes=run.cfg.p2p_bytes, reps=run.cfg.comm_reps,
                                warmup=run.cfg.warmup, device=run.device)
            if t is not None:
                p2p.append((env.node_rank, local.index(a), local.index(b), _pingpong_bw(t, run.cfg.p2p_bytes)))
        run.barrier()
    return bandwidth, latency, wait, fsdp, p2p, own


def _small_collectives(run: _Run, group: Any, size: int, stand_in: Callable[[], Any] | None,
                       dtypes: tuple[str, ...], where: str, say: bool) -> tuple:
    """A tiny all-to-all over ``group`` (fixed cost per call) and, with a model layer to run before it, the same
    all-to-all after that layer's forward (the wait training meets), and FSDP2's overhead per unit and per sharded
    optimizer tensor (profiler.fsdp_unit, in each of ``dtypes``: the GEMM benchmark's). Returns (latency, wait or
    None, FSDP2 (forward, backward, optimizer) or None); ``say``: this rank logs them."""
    run.progress.phase(f"collective latency over {where}")
    latency = bench.collective_latency_us(group, size, run.device, run.cfg)
    wait = None
    if stand_in is not None:
        run.progress.phase(f"collective wait after a layer forward over {where}")
        wait = bench.collective_wait_us(group, size, run.device, run.cfg, stand_in, agree=_group_min(group, run.device))
    run.progress.phase(f"FSDP2 unit overhead over {where}")
    fsdp = _fsdp_probe(run, group, size, dtypes)
    if say:
        log.info("over %s: tiny all-to-all %.4g us%s", where, latency.value,
                 f", after a layer forward {wait.value:.4g} us (mean)" if wait is not None else "")
        if fsdp is not None:
            log.info("FSDP2 over %s, per unit: %s; AdamW %.4g us per sharded tensor", where,
                     ", ".join(f"{d} {fsdp[0][d].value:.4g} us forward, {fsdp[1][d].value:.4g} us backward"
                               for d in fsdp[0]), fsdp[2].value)
    return latency, wait, fsdp


def like_classes(speeds: list[float], tolerance: float) -> list[list[int]]:
    """Indices of ``speeds`` (one node's ranks in local order) in classes alike within ``tolerance`` (max / min at
    most 1 + tolerance over a class): first fit in order, as tangram_launch.islands splits a node's GPUs into parts
    of alike GPUs, so the ranks of one class are the ones an island can hold together."""
    classes: list[list[int]] = []
    for i, v in enumerate(speeds):
        for c in classes:
            values = [speeds[j] for j in c] + [v]
            if max(values) <= (1 + tolerance) * min(values):
                c.append(i)
                break
        else:
            classes.append([i])
    return classes


def _like_groups(run: _Run, layout: "_Layout", gemm: dict) -> tuple | None:
    """(this rank's like ranks, their process group) where its node holds ranks of different speeds (GEMM TFLOP/s
    beyond the islands' compute tolerance: like_classes) and two or more alike with it; else None.

    Why: over a whole node, every small collective waits for its slowest member, and the profile's figures would
    charge that wait to a data-parallel group of the fast ones, which the islands keep apart from the slow one (a
    throttled CPU device made the fast pair's sync read 1.6-4.3x its run). Every rank creates every such group, in
    the same order (new_group is collective over the whole world)."""
    from tangram_launch.islands import IslandTolerances

    tolerance = IslandTolerances().compute
    speeds: list = [None] * run.env.world_size
    dist.all_gather_object(speeds, {d: m.value for d, m in gemm.items() if "stopped" not in dict(m.detail)})
    dtype = next((d for d in run.cfg.gemm_dtypes if all(d in s and s[d] > 0 for s in speeds)), None)
    if dtype is None:
        return None
    mine = None
    for n in layout.node_ranks:
        ranks = layout.ranks_of[n]
        classes = like_classes([speeds[r][dtype] for r in ranks], tolerance)
        if len(classes) < 2:
            continue
        for c in (c for c in classes if len(c) > 1):
            members = tuple(ranks[i] for i in c)
            group = dist.new_group(list(members))
            if run.env.rank in members:
                mine = (members, group)
    if mine is not None and run.env.rank == mine[0][0]:
        log.info("ranks %s measure the small collectives again among themselves: their node's other ranks are "
                 "slower or faster by more than %.0f %% (%s GEMM)", list(mine[0]), 100 * tolerance, dtype)
    return mine


def _fsdp_probe(run: _Run, group: Any, size: int, dtypes: tuple[str, ...]) -> tuple | None:
    """profiler.fsdp_unit over the node's ranks, or None where FSDP2 cannot run here: the profile then goes on
    without those figures (the cost model charges nothing for them) and says why. Every member agrees on the
    outcome, so none goes on to the next collective alone."""
    from profiler.fsdp_unit import fsdp_unit_overhead

    try:
        out, error = fsdp_unit_overhead(group, size, run.device, dtypes), ""
    except Exception as exc:  # an API the installed torch lacks, a backend without the collective
        out, error = None, f"{type(exc).__name__}: {exc}"
    ok = _group_min(group, run.device)(int(out is not None))
    if error or not ok:
        log.warning("FSDP2 unit overhead not measured on rank %d (%s); plans will not charge it", run.env.rank,
                    error or "another rank of the node could not measure it")
        return None
    return out


def _inter_node(run: _Run, layout: "_Layout") -> tuple[list, list]:
    """Rounds of node pairs (round-robin: each node talks to one peer at a time). In a pair, the leaders measure
    latency; then local rank i of one node and local rank i of the other measure bandwidth at the same time
    (on multi-NIC nodes each GPU uses its own NIC, so the node-to-node figure is their sum)."""
    env, cfg = run.env, run.cfg
    schedule = bench.round_robin(layout.node_ranks)
    links: list[tuple] = []  # (round, (node a, node b), leaders' latency RTT or None, [bandwidth per rank pair])
    for r, pairs in enumerate(schedule):
        mine = next(((a, b) for a, b in pairs if env.node_rank in (a, b)), None)
        lat = None
        bws: list[bench.Measured] = []
        if mine is not None:
            a, b = mine
            peer_node = b if env.node_rank == a else a
            where = f"inter-node round {r + 1}/{len(schedule)}"
            run.progress.phase(f"{where}: latency with node {layout.name_of[peer_node]}")
            if env.local_rank == 0:
                lat = bench.ping_pong(layout.ranks_of[peer_node][0], initiator=env.node_rank == a, nbytes=4,
                                      reps=cfg.latency_reps, warmup=cfg.warmup, device=run.device)
        run.barrier()
        if mine is not None and env.local_rank < min(len(layout.ranks_of[a]), len(layout.ranks_of[b])):
            run.progress.phase(f"{where}: bandwidth with node {layout.name_of[peer_node]}")
            t = bench.ping_pong(layout.ranks_of[peer_node][env.local_rank], initiator=env.node_rank == a,
                                nbytes=cfg.p2p_bytes, reps=cfg.comm_reps, warmup=cfg.warmup, device=run.device)
            if t is not None:
                bws.append(_pingpong_bw(t, cfg.p2p_bytes))
        run.barrier()
        if mine is not None and (lat is not None or bws):
            links.append((r, mine, lat, bws))  # merged per node pair on rank 0
        if env.rank == 0 and pairs:
            log.info("inter-node round %d/%d done: %s", r + 1, len(schedule),
                     ", ".join(f"{layout.name_of[x]}<->{layout.name_of[y]}" for x, y in pairs))
    return links, schedule


def _gather_and_write(run: _Run, layout: "_Layout", local: _Local, collectives: tuple, p2p, links, schedule,
                      started_at: str, t_start: float, like_group: LikeGroup | None = None) -> dict:
    """Everything to rank 0, which assembles and writes; every rank learns whether that worked."""
    env, args = run.env, run.args
    run.progress.phase("gather")
    me = layout.device_of[env.rank]
    record = DeviceRecord(
        rank=env.rank, local_rank=env.local_rank, node_rank=env.node_rank, host=run.host, device=me["device"],
        torch_uuid=me.get("uuid"), torch_name=me.get("name"), total_memory_bytes=me.get("total_memory"),
        gemm=local.gemm, memory_bandwidth=local.copy, layer=local.layer, optimizer_tensor=local.optimizer,
        optimizer_param=local.optimizer_param, gemm_sweep=local.gemm_sweep, wake_up=local.wake_up,
        stage_sequence=local.stage_sequence, like_group=like_group, host_op=local.host_op,
    )
    # (all-reduce, latency, wait, FSDP2), p2p
    node_part = (collectives if env.local_rank == 0 else (None, None, None, None), p2p)
    gathered: list | None = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object((record, node_part, links), gathered, dst=0)
    outcome: list = [None]
    if env.rank == 0:
        run.progress.phase(f"assemble and write {args.output}")
        try:
            profile = _build_record(gathered, layout, run.backend, run.cfg, args, started_at, t_start,
                                    local.model_info, schedule)
            _write_spec(assemble_cluster(profile, name=args.name), args.output)
            outcome = [{"ok": True}]
        except Exception as exc:  # reported to every rank so all exit non-zero together
            outcome = [{"ok": False, "error": f"{type(exc).__name__}: {exc}"}]
    dist.broadcast_object_list(outcome, src=0)
    if not outcome[0]["ok"]:
        raise RuntimeError(f"global rank 0 could not write the ClusterSpec: {outcome[0]['error']}")
    run.barrier()
    writer_node = layout.node_of_rank[0]
    if env.rank == 0:
        log.info("wrote %s in %.1f s", args.output, time.perf_counter() - t_start)
    return {"node": layout.name_of[writer_node], "host": layout.host_of[writer_node], "output": args.output}


def _pingpong_bw(rtt: bench.Timing, nbytes: int) -> bench.Measured:
    """Ping-pong round trips -> one-direction bandwidth: 2 * bytes per round trip."""
    per_transfer = bench.Timing(tuple(s / 2 for s in rtt.samples_s))
    return bench.Measured(nbytes / per_transfer.median_s / 1e9, "GB/s", per_transfer,
                          (("bytes", nbytes), ("method", "ping-pong, one direction at a time")))


@dataclass(frozen=True)
class _Layout:
    node_ranks: list[int]
    ranks_of: dict[int, list[int]]  # node rank -> global ranks in local-rank order
    host_of: dict[int, str]
    name_of: dict[int, str]
    node_of_rank: dict[int, int]
    inventory_of: dict[int, object]
    device_of: dict[int, dict]

    @classmethod
    def from_gathered(cls, everyone: list) -> "_Layout":
        ranks_of: dict[int, list[tuple[int, int]]] = {}
        host_of: dict[int, str] = {}
        inventory_of: dict[int, object] = {}
        device_of: dict[int, dict] = {}
        for me, inv in everyone:
            ranks_of.setdefault(me["node_rank"], []).append((me["local_rank"], me["rank"]))
            host_of[me["node_rank"]] = me["host"]
            device_of[me["rank"]] = me
            if inv is not None:
                inventory_of[me["node_rank"]] = inv
        node_ranks = sorted(ranks_of)
        names = name_nodes([host_of[n] for n in node_ranks])
        ordered = {n: [r for _, r in sorted(v)] for n, v in ranks_of.items()}
        return cls(node_ranks=node_ranks, ranks_of=ordered, host_of=host_of,
                   name_of=dict(zip(node_ranks, names)),
                   node_of_rank={r: n for n, rs in ordered.items() for r in rs},
                   inventory_of=inventory_of, device_of=device_of)


def _build_record(gathered: list, layout: _Layout, backend: str, cfg: bench.BenchConfig, args, started_at: str,
                  t_start: float, model_info, schedule) -> ProfileRecord:
    devices = []
    bandwidth_of: dict[int, dict[str, bench.Measured]] = {}
    latency_of: dict[int, bench.Measured | None] = {}
    wait_of: dict[int, bench.Measured | None] = {}
    fsdp_of: dict[int, tuple | None] = {}
    p2p_of: dict[int, list] = {n: [] for n in layout.node_ranks}
    link_parts: dict[tuple[int, int], dict] = {}
    for record, ((bandwidth, latency, wait, fsdp), p2p), links in gathered:
        devices.append(record)
        if record.local_rank == 0:
            bandwidth_of[record.node_rank] = bandwidth
            latency_of[record.node_rank] = latency
            wait_of[record.node_rank] = wait
            fsdp_of[record.node_rank] = fsdp
        for node_rank, a, b, m in p2p:
            p2p_of[node_rank].append((a, b, m))
        for r, pair, lat, bws in links:
            part = link_parts.setdefault(pair, {"round": r, "lat": None, "bws": []})
            if lat is not None:
                part["lat"] = lat
            part["bws"].extend(bws)
    # a like group's figures are its first rank's, as a node's are its local rank 0's
    first = {r: d.like_group for d in devices if d.like_group and d.rank == d.like_group.ranks[0]
             for r in d.like_group.ranks}
    devices = [dataclasses.replace(d, like_group=first.get(d.rank)) if d.like_group else d for d in devices]
    nodes = tuple(
        NodeRecord(node_rank=n, host=layout.host_of[n], inventory=layout.inventory_of[n],
                   ranks=tuple(layout.ranks_of[n]), allreduce=bandwidth_of.get(n, {}).get(bench.ALL_REDUCE),
                   reduce_scatter=bandwidth_of.get(n, {}).get(bench.REDUCE_SCATTER),
                   all_gather=bandwidth_of.get(n, {}).get(bench.ALL_GATHER),
                   collective_latency=latency_of.get(n), collective_wait=wait_of.get(n),
                   fsdp_unit=fsdp_of.get(n),
                   p2p=tuple(sorted(p2p_of[n], key=lambda t: (t[0], t[1]))))
        for n in layout.node_ranks
    )
    links = tuple(LinkRecord(node_a=a, node_b=b, latency_rtt=p["lat"], bandwidth=tuple(p["bws"]),
                             round_index=p["round"]) for (a, b), p in sorted(link_parts.items()))
    return ProfileRecord(
        devices=tuple(sorted(devices, key=lambda d: d.rank)), nodes=nodes, links=links, backend=backend,
        quick=args.quick, bench=cfg.to_dict(), started_at=started_at, finished_at=_now(),
        wall_s=time.perf_counter() - t_start, torch_version=str(torch.__version__), model=model_info,
        schedule=tuple(tuple(rnd) for rnd in schedule),
    )


SEQUENCE_BUDGET_SHARE = 1 / 6  # of the layer budget: wall seconds of the stage-like sequence's rounds (60 s -> 10 s)
SEQUENCE_ROUNDS = (3, 16)  # rounds over the micro-batch sizes: at least, at most (one block of each size a round)


def _profile_sequence(run: _Run, between: Callable[[], Any], agree: Callable[[int], int], layer: dict,
                      layers: int) -> tuple[tuple[int, float, float], ...]:
    """CPU devices timing layers back to back: at each micro-batch size the layer profile measured (its smallest
    sequence length), the wake-up's stage-like sequence (the embedding, ``layers`` layers, the head with the loss,
    forward then backward) in blocks of back-to-back calls as the layers were timed (a collective after each block),
    beside the sum of the same parts timed alone: rows (micro-batch, sequence s, parts s).

    Why: a stage runs its layers one after another, each on the caches the others left, so it costs more than its
    parts timed each in a loop of its own, by a ratio that differs by shape (costmodel/measured_layers.py).

    Rounds take one block of every size in turn (after an untimed call: a block of one call at mbs 64 read 12 %
    slow on the caches of the sizes before it), as many rounds as ``SEQUENCE_BUDGET_SHARE`` of the layer budget
    affords, and each size's figure is its blocks' median: a slow spell of the host (another job, the VM's
    neighbours) then costs each size a few blocks, which the median leaves out, instead of every block of the sizes
    timed during it. A plan's CPU stage is priced at about this figure at its micro-batch size (its parts times
    this over the same parts), so this figure's noise is the plan's."""
    from profiler.layer import LayerShape
    from profiler.wake import stage_sequence
    from tangram_launch.specs.model import load_model

    model = load_model(run.args.model)
    seq_len = min(_layer_seq_lens(run.args, model, run.device))
    budget_s = SEQUENCE_BUDGET_SHARE * _layer_budget_s(run.args)
    sizes = []  # (micro-batch, parts s, the sequence's call, calls per block)
    for mbs in sorted(set(run.args.micro_batch or DEFAULT_MICRO_BATCHES)):
        shape = LayerShape(mbs, seq_len, run.args.layer_dtype or "bf16")
        parts_s = sequence_parts_s(layer, model, shape, layers)
        if agree(int(parts_s is not None)) == 0:  # every member times the same sizes (their collectives match)
            continue
        fn = stage_sequence(model, shape, run.device, layers)
        calls = bench.calibrate_inner(fn, min_rep_s=LAYER_BLOCK_CPU_S, clock=time.process_time)
        sizes.append((mbs, parts_s, fn, calls))
    if not sizes:
        return ()
    run.progress.phase(f"stage-like sequence of {model.name} at {len(sizes)} micro-batch size(s), back to back, "
                       f"within {budget_s:.3g} s")
    t0 = time.perf_counter()
    samples: dict[int, list[float]] = {m: [] for m, *_ in sizes}

    def one_round() -> None:
        for mbs, _, fn, calls in sizes:
            fn()  # untimed: the first call after another size's block runs on the caches that one left
            samples[mbs].append(bench.time_blocks(fn, between, blocks=1, calls=calls).median_s)
    one_round()  # which also sizes the rest
    lo, hi = SEQUENCE_ROUNDS
    rounds = agree(max(lo, min(hi, int(budget_s / max(time.perf_counter() - t0, 1e-6)))))
    for _ in range(rounds - 1):
        one_round()
    rows = [(mbs, statistics.median(samples[mbs]), parts_s) for mbs, parts_s, _, _ in sizes]
    if run.env.rank == 0:
        log.info("stage-like sequence over its parts on rank 0 (%d rounds): %s", rounds,
                 ", ".join(f"b={m} {w / p:.3f}" for m, w, p in rows))
    return tuple(rows)


def sequence_parts_s(layer: dict, model, shape, layers: int) -> float | None:
    """Forward+backward seconds of the wake-up's stage-like sequence (the embedding, the model's first ``layers``
    layers, the head with the loss) summed from the layer profile's parts, each timed alone at ``shape``; None
    where one of them was not measured (a budget spent, a shape out of memory)."""
    kinds = ["embedding", *(model.layer_kind(i) for i in range(layers)), "head"]
    try:
        return sum(layer[f"{kind}|{shape.label()}"]["forward_backward"].timing.median_s for kind in kinds)
    except KeyError:
        return None


def _layer_budget_s(args) -> float:
    """Wall seconds for every --model shape on one device: ``--layer-budget-s``, or the default (``--quick``'s)."""
    return args.layer_budget_s or (LAYER_BUDGET_QUICK_S if args.quick else LAYER_BUDGET_S)


def _layer_seq_lens(args, model, device: torch.device) -> list[int]:
    """The sequence lengths layers are profiled at: ``--seq-len``'s, or the model's, capped (512 on CPU or with
    --quick, 4,096 otherwise)."""
    return list(args.seq_len or [min(model.max_seq_len, 512 if args.quick or device.type == "cpu" else 4096)])


def _profile_layer(args, device: torch.device, cfg: bench.BenchConfig, progress: Progress,
                   between: Callable[[], Any] | None = None, agree: Callable[[int], int] = lambda n: n,
                   gpus_per_node: int = 1):
    """Each layer kind, the embedding and the head timed at every planned shape (micro-batch sizes, sequence
    lengths, TP shards; edges at tp 1) within the layer budget; also returns the stand-in forward the
    collective-wait benchmark runs before each all-to-all (the model's MoE layer where it has one: what precedes
    expert-parallel dispatch)."""
    if not args.model:
        return {}, None, None
    from profiler.layer import EDGE_KINDS, build_layer, layer_kinds, planned_shapes, time_layer, tp_shards
    from tangram_launch.specs.model import load_model

    model = load_model(args.model)
    seq_lens = _layer_seq_lens(args, model, device)
    shapes = planned_shapes(model, micro_batches=args.micro_batch or list(DEFAULT_MICRO_BATCHES), seq_lens=seq_lens,
                            tps=args.tp or tp_shards(model, gpus_per_node), dtype=args.layer_dtype or "bf16")
    budget_s = _layer_budget_s(args)
    kinds = layer_kinds(model)
    jobs = [(kind, shape) for shape in shapes for kind in kinds + (list(EDGE_KINDS) if shape.tp == 1 else [])]
    each_s, started = budget_s / len(jobs), time.perf_counter()
    out: dict[str, dict] = {}
    for i, (kind, shape) in enumerate(jobs):
        # every member of the node stops at the same job (their collectives must match): the first to run out
        if agree(int(time.perf_counter() - started + each_s <= budget_s * 1.05)) == 0:
            log.warning("layer budget %.0f s spent: %d of %d shape(s) x kind(s) measured", budget_s, i, len(jobs))
            break
        progress.phase(f"model layer {model.name} ({kind}) {shape.label()} ({i + 1} of {len(jobs)})")
        try:
            out[f"{kind}|{shape.label()}"] = time_layer(
                model, kind, shape, device, warmup=cfg.warmup, reps=cfg.reps, min_rep_s=cfg.min_rep_s,
                between=between, budget_s=each_s, agree=agree,
                block_cpu_s=LAYER_BLOCK_CPU_S if getattr(args, "layer_timing", None) == "back-to-back" else None)
        except torch.OutOfMemoryError:  # a shape this GPU cannot hold: the planner cannot use it either
            log.warning("%s (%s) at %s does not fit on %s: left out", model.name, kind, shape.label(), device)
            torch.cuda.empty_cache()
    first = shapes[0]
    info = {"name": model.name, "micro_batch": first.micro_batch, "seq_len": first.seq_len, "dtype": first.dtype,
            "micro_batches": sorted({s.micro_batch for s in shapes}), "seq_lens": list(seq_lens),
            "tp": sorted({s.tp for s in shapes}), "budget_s": budget_s, "measured": len(out), "planned": len(jobs),
            "layer_kinds": kinds, "edge_kinds": list(EDGE_KINDS),
            "note": "each layer kind's forward and forward+backward (and the activation bytes autograd saves), per "
                    "device, with the torch runtime's operators, at each shape; a TP shard is the layer's share on "
                    "one device without its collectives; MoE layers with their routing on one device; the "
                    "embedding, and the head with the loss, likewise at tp 1"}
    kind = "moe" if "moe" in kinds else kinds[0]
    torch.manual_seed(0)
    layer = build_layer(model, kind, device, first.dtype)
    x = torch.randn(first.micro_batch, first.seq_len, model.hidden_size, device=device, dtype=bench.DTYPES[first.dtype])

    def stand_in() -> None:
        with torch.no_grad():
            layer(x)

    return out, info, stand_in


def _write_spec(spec: dict, path: str) -> None:
    """Validate (the file must load as a ClusterSpec) and write atomically (temporary file, fsync, rename)."""
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.yamlio import dump_yaml_file

    ClusterSpec.from_dict(spec, source="profiled cluster")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    dump_yaml_file(spec, path)


if __name__ == "__main__":
    sys.exit(main())
