"""Gathered measurements -> one ClusterSpec (YAML mapping), its hardware fingerprint and a summary table.

Pure functions over the records the workers gather (no process group here), so the assembly is tested without
launching anything. Conventions of the written file:

* nodes are named by host, or ``host-<k>`` when several agents share a host (k in node-rank order);
* a GPU the catalog knows keeps its catalog type and figures, with the measurements in ``measured``
  (islands and the cost model prefer ``measured.gemm_tflops`` over the spec-sheet peak);
* the GEMM sweep is ``measured.gemm_sweep_tflops``: per dtype, rows [m, n, k, TFLOP/s] (the large GEMM among them);
* a GPU the catalog does not know is ``custom`` with measured figures;
* a CPU device (one gloo process) is type ``cpu`` with the *measured* figures in ``tflops``,
  ``memory_bandwidth_GBps`` and ``intra_node_bandwidth_GBps`` (the catalog's placeholders are kept in
  ``measured.catalog``), so islands and the planner see what the host really does;
* intra-node bandwidth written from a measurement is 2 x all-reduce bus bandwidth: the catalog's figures are
  bidirectional per GPU (NVLink 900 GB/s on H100) while nccl-tests' busbw counts one direction;
* the network lists every measured node pair; ``default`` is the slowest of them (conservative for pairs a later
  edit adds);
* ``fingerprint`` hashes the hardware identity (hosts, device names, UUIDs, counts, NICs), not the measurements,
  so a later launch can reuse a profile while the hardware is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from profiler.bench import Measured, Timing, round_sig
from profiler.inventory import NodeInventory, inventory_identity
from tangram_launch.costmodel.efficiency import FSDP_KEYS
from tangram_launch.costmodel.measured_layers import SEQUENCE_KEY, SEQUENCE_PARTS_KEY
from tangram_launch.specs.constants import STORAGE_DTYPES  # the dtypes the GEMM benchmark times
from tangram_launch.specs.yamlio import to_plain

FINGERPRINT_VERSION = 5  # raised when profiles gain figures the cost model reads: cached ones are measured again


@dataclass(frozen=True)
class LikeGroup:
    """The small-collective figures of NodeRecord measured again over a group of a node's ranks alike in speed
    (worker.like_classes), where the node holds ranks of different speeds. Over the whole node every collective
    waits for its slowest member, and a data-parallel group of the fast ones, which the islands keep apart from the
    slow one, would be charged that wait."""

    ranks: tuple[int, ...]  # global ranks
    collective_latency: Measured | None = None
    collective_wait: Measured | None = None
    fsdp_unit: tuple[dict, dict, Measured] | None = None

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks),
                "collective_latency": self.collective_latency.to_dict() if self.collective_latency else None,
                "collective_wait": self.collective_wait.to_dict() if self.collective_wait else None,
                "fsdp_unit": _fsdp_profile(self.fsdp_unit)}


@dataclass(frozen=True)
class DeviceRecord:
    """One rank's device and what it measured on it."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    device: str  # "cpu" | "cuda:<i>"
    torch_uuid: str | None = None
    torch_name: str | None = None
    total_memory_bytes: int | None = None
    gemm: Mapping[str, Measured] = field(default_factory=dict)  # dtype -> TFLOP/s
    memory_bandwidth: Measured | None = None  # GB/s
    layer: Mapping[str, Mapping[str, Measured]] = field(default_factory=dict)  # kind -> forward/forward_backward
    optimizer_tensor: Measured | None = None  # AdamW step's fixed cost per parameter tensor, us
    optimizer_param: Measured | None = None  # AdamW step's cost per parameter beyond the per-tensor cost, ns
    gemm_sweep: Mapping[str, Sequence[Measured]] = field(default_factory=dict)  # dtype -> TFLOP/s per (m, n, k)
    wake_up: Measured | None = None  # a stage-like micro-batch after a wait, beyond back to back, us (profiler.wake)
    # (micro-batch, stage-like sequence s, the sum of its parts timed alone s), back to back (worker._profile_sequence)
    stage_sequence: Sequence[tuple[int, float, float]] = ()
    like_group: LikeGroup | None = None  # the node's collective figures over this device's like ranks (if measured)
    host_op: Measured | None = None  # host time per dispatched operator, us (profiler.host_ops)

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class NodeRecord:
    node_rank: int
    host: str
    inventory: NodeInventory
    ranks: tuple[int, ...]  # global ranks in local-rank order
    allreduce: Measured | None = None  # bus bandwidth over the node's ranks, GB/s
    reduce_scatter: Measured | None = None  # ... of a reduce-scatter, and of an all-gather (nccl-tests busbw)
    all_gather: Measured | None = None
    collective_latency: Measured | None = None  # one tiny all-to-all over the node's ranks, us
    collective_wait: Measured | None = None  # ... right after a layer forward on every rank (mean), us
    # FSDP2 over the node's ranks (profiler.fsdp_unit): ({dtype: forward us per unit}, {dtype: backward us per unit},
    # AdamW us per sharded parameter tensor)
    fsdp_unit: tuple[dict, dict, Measured] | None = None
    p2p: tuple[tuple[int, int, Measured], ...] = ()  # (local a, local b, GB/s one direction at a time)


@dataclass(frozen=True)
class LinkRecord:
    """Measured link between two nodes (node ranks)."""

    node_a: int
    node_b: int
    latency_rtt: Timing  # leaders' round trip of a tiny message
    bandwidth: tuple[Measured, ...]  # one per concurrent rank pair (local rank i <-> i); the link is their sum
    round_index: int = 0


@dataclass(frozen=True)
class ProfileRecord:
    devices: tuple[DeviceRecord, ...]
    nodes: tuple[NodeRecord, ...]
    links: tuple[LinkRecord, ...]
    backend: str
    quick: bool
    bench: Mapping[str, Any]
    started_at: str
    finished_at: str
    wall_s: float
    torch_version: str = ""
    model: Mapping[str, Any] | None = None
    schedule: tuple[tuple[tuple[int, int], ...], ...] = ()  # inter-node rounds of node-rank pairs


def name_nodes(hosts: Sequence[str]) -> list[str]:
    """Node names in node-rank order: the host, or host-<k> when several nodes share a host."""
    counts: dict[str, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    seen: dict[str, int] = {}
    names: list[str] = []
    for h in hosts:
        if counts[h] == 1:
            name = h
        else:
            name = f"{h}-{seen.get(h, 0)}"
            seen[h] = seen.get(h, 0) + 1
        while name in names:  # a host literally called "a-0" beside two agents on "a"
            name += "x"
        names.append(name)
    return names


def hardware_identity(record: ProfileRecord) -> list:
    """What the fingerprint covers: per node its host, inventory identity and devices (kind, name, UUID)."""
    names = name_nodes([n.host for n in sorted(record.nodes, key=lambda n: n.node_rank)])
    out = []
    for name, node in zip(names, sorted(record.nodes, key=lambda n: n.node_rank)):
        devs = sorted((d for d in record.devices if d.node_rank == node.node_rank), key=lambda d: d.local_rank)
        out.append({
            "name": name,
            "inventory": inventory_identity(node.inventory),
            "devices": [[d.device.split(":")[0], d.torch_name or "cpu", d.torch_uuid or ""] for d in devs],
        })
    return out


def cpu_threads_identity(environ: Mapping[str, str], local_world_size: int) -> str:
    """A CPU device's part of the fingerprint: the threads it computes on, as ``OMP_NUM_THREADS`` reaches its
    worker (torchrun sets 1 where it is unset and several workers start; one worker alone keeps torch's default).
    The launcher reads it before any worker starts, a worker from its own environment: both read the same. A CPU
    process on 2 threads is another device than on 1, so a profile measured on one is not reused for the other."""
    if "OMP_NUM_THREADS" in environ:
        value = environ["OMP_NUM_THREADS"]
    else:
        value = "1" if local_world_size > 1 else "default"
    return f"OMP_NUM_THREADS={value}"


def fingerprint(identity: Any) -> str:
    blob = json.dumps({"v": FINGERPRINT_VERSION, "hardware": identity}, sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]


def _catalog_figures(gpu_type) -> dict:
    return {"tflops": dict(gpu_type.tflops), "memory_gib": gpu_type.memory_gib,
            "memory_bandwidth_GBps": gpu_type.memory_bandwidth_GBps,
            "intra_node_bandwidth_GBps": gpu_type.intra_node_bandwidth_GBps}


def _p2p_row(node: NodeRecord, local: int) -> list[float | None]:
    row: list[float | None] = [None] * len(node.ranks)
    for a, b, m in node.p2p:
        if a == local:
            row[b] = round_sig(m.value)
        elif b == local:
            row[a] = round_sig(m.value)
    return row


def gemm_sweep_table(dev: DeviceRecord) -> dict[str, list[list]]:
    """``measured.gemm_sweep_tflops``: per swept dtype, rows [m, n, k, TFLOP/s] of the sweep and of the large GEMM
    (a point of the same curve), each shape once, fewest FLOPs first."""
    table = {}
    for dtype, points in dev.gemm_sweep.items():
        rows = {tuple(dict(p.detail)["shape_mnk"]): p.value for p in points}
        large = dev.gemm.get(dtype)
        if large is not None:
            m, k, n = dict(large.detail)["shape_mkn"]
            rows.setdefault((m, n, k), large.value)
        if rows:
            ordered = sorted(rows.items(), key=lambda row: (math.prod(row[0]), row[0]))
            table[dtype] = [[*shape, round_sig(v)] for shape, v in ordered]
    return table


def sequence_times(rows: Sequence[tuple[int, float, float]]) -> tuple[dict, dict]:
    """({micro-batch: the stage-like sequence back to back, s}, {micro-batch: the sum of its parts timed alone by the
    layer profile at the same shape, s}), keyed by the micro-batch as text; rows without both figures left out.
    Their ratio is what a stage's layers cost more run one after another, as a stage runs them, than each in a loop
    of its own (costmodel/measured_layers.py). Written as times, so an island keeps its slowest device's."""
    ok = [(int(m), w, p) for m, w, p in sorted(rows)
          if isinstance(w, (int, float)) and isinstance(p, (int, float)) and w > 0 and p > 0]
    return {str(m): round_sig(w) for m, w, _ in ok}, {str(m): round_sig(p) for m, _, p in ok}


def _fsdp_profile(fsdp: tuple | None) -> dict | None:
    if fsdp is None:
        return None
    fwd, bwd, opt = fsdp
    return {FSDP_KEYS[0]: {d: m.to_dict() for d, m in fwd.items()},
            FSDP_KEYS[1]: {d: m.to_dict() for d, m in bwd.items()}, FSDP_KEYS[2]: opt.to_dict()}


def _gpu_entry(dev: DeviceRecord, node: NodeRecord, catalog, model_name: str | None = None) -> dict:
    from tangram_launch.specs.catalog import normalize_gpu_name

    inv = node.inventory
    measured: dict[str, Any] = {"device": dev.device}
    gemm = {d: round_sig(m.value) for d, m in dev.gemm.items()}
    if gemm:
        measured["gemm_tflops"] = gemm
    sweep = gemm_sweep_table(dev)
    if sweep:
        measured["gemm_sweep_tflops"] = sweep
    if dev.memory_bandwidth is not None:
        measured["memory_bandwidth_GBps"] = round_sig(dev.memory_bandwidth.value)
    if node.allreduce is not None:
        measured["allreduce_busbw_gbps"] = round_sig(node.allreduce.value)
        measured["allreduce_group_size"] = len(node.ranks)
    for key, m in (("reduce_scatter_busbw_gbps", node.reduce_scatter), ("all_gather_busbw_gbps", node.all_gather)):
        if m is not None:
            measured[key] = round_sig(m.value)
    group = dev.like_group or node  # a like group's figures where it measured them, else the node's
    if group.collective_latency is not None:
        measured["collective_latency_us"] = round_sig(group.collective_latency.value)
        measured["collective_group_size"] = len(group.ranks)  # the ranks it was measured over: n - 1 ring steps
    if group.collective_wait is not None:
        measured["collective_wait_us"] = round_sig(group.collective_wait.value)
    if group.fsdp_unit is not None:
        fwd, bwd, opt = group.fsdp_unit
        for key, per_dtype in zip(FSDP_KEYS, (fwd, bwd)):
            measured[key] = {d: round_sig(m.value) for d, m in per_dtype.items()}
        measured[FSDP_KEYS[2]] = round_sig(opt.value)
    if dev.optimizer_tensor is not None:
        measured["optimizer_tensor_us"] = round_sig(dev.optimizer_tensor.value)
    if dev.optimizer_param is not None:
        measured["optimizer_param_ns"] = round_sig(dev.optimizer_param.value)
    if dev.host_op is not None:
        measured["host_op_us"] = round_sig(dev.host_op.value)
    if dev.wake_up is not None:
        measured["wake_up_us"] = round_sig(dev.wake_up.value)
        waited_s = dict(dev.wake_up.detail).get("waited_s")
        if isinstance(waited_s, (int, float)) and waited_s > 0:  # the wait the cost was measured after
            measured["wake_up_wait_us"] = round_sig(waited_s * 1e6)
    whole, parts = sequence_times(dev.stage_sequence)
    if whole:
        measured[SEQUENCE_KEY], measured[SEQUENCE_PARTS_KEY] = whole, parts
    if node.p2p:
        measured["p2p_gbps"] = _p2p_row(node, dev.local_rank)
    if dev.layer and model_name:
        # Keyed as the cost model looks them up (model, layer kind and shape; a TP shard on one device).
        from tangram_launch.costmodel.compute import measured_layer_key

        def key(m: Measured) -> str:
            d = dict(m.detail)
            return measured_layer_key(model_name, d["layer_kind"], int(d["seq_len"]), int(d["micro_batch"]),
                                      int(d.get("tp", 1)))

        measured["layer_forward_s"] = {key(v["forward"]): round_sig(v["forward"].timing.median_s)
                                       for v in dev.layer.values()}
        measured["layer_forward_backward_s"] = {key(v["forward_backward"]):
                                                round_sig(v["forward_backward"].timing.median_s)
                                                for v in dev.layer.values()}
        activation = {key(v["forward"]): dict(v["forward"].detail).get("activation_bytes") for v in dev.layer.values()}
        if any(activation.values()):
            measured["layer_activation_bytes"] = {k: int(b) for k, b in activation.items() if b}
    intra_measured = 2 * node.allreduce.value if node.allreduce is not None else None

    if dev.is_cpu:
        base = catalog.lookup("cpu")
        measured["catalog"] = _catalog_figures(base)
        tflops = {d: gemm.get(d) for d in STORAGE_DTYPES}
        if not any(tflops.values()):
            tflops = dict(base.tflops)
        elif tflops.get("fp32"):
            tflops["tf32"] = tflops["fp32"]  # TF32 is a tensor-core mode: on the host a tf32 job runs fp32 GEMMs
        entry: dict[str, Any] = {
            "type": "cpu",
            "tflops": tflops,
            # one CPU device is one process: it gets its share of the host's memory
            "memory_gib": round_sig(inv.memory_total_bytes / 2**30 / max(1, len(node.ranks))),
            "memory_bandwidth_GBps": measured.get("memory_bandwidth_GBps", base.memory_bandwidth_GBps),
            "intra_node_bandwidth_GBps": (round_sig(intra_measured) if intra_measured
                                          else base.intra_node_bandwidth_GBps),
        }
        measured["intra_node_bandwidth_source"] = ("2 x measured all-reduce busbw" if intra_measured
                                                   else "catalog (one device on the node)")
        entry["measured"] = measured
        return entry

    nvml_gpu = inv.gpu_by_uuid(dev.torch_uuid)
    name = nvml_gpu.name if nvml_gpu is not None else (dev.torch_name or "unknown GPU")
    measured["name"] = name
    if nvml_gpu is not None:
        measured["nvml"] = {
            "index": nvml_gpu.index, "bus_id": nvml_gpu.bus_id, "memory_total_gib": round(nvml_gpu.memory_total_gib, 2),
            "pcie_gen": nvml_gpu.pcie_gen, "pcie_width": nvml_gpu.pcie_width,
            "nvlink_active_links": nvml_gpu.nvlink_active_links,
        }
    uuid = nvml_gpu.uuid if nvml_gpu is not None else dev.torch_uuid
    canonical = normalize_gpu_name(name)
    if canonical in catalog:
        entry = {"type": canonical}
    else:
        memory_bytes = nvml_gpu.memory_total_bytes if nvml_gpu is not None else (dev.total_memory_bytes or 0)
        if intra_measured:
            intra, source = intra_measured, "2 x measured all-reduce busbw"
        elif nvml_gpu is not None and nvml_gpu.pcie_bandwidth_gbps():
            intra, source = nvml_gpu.pcie_bandwidth_gbps(), f"PCIe Gen{nvml_gpu.pcie_gen} x{nvml_gpu.pcie_width} (NVML)"
        else:
            intra, source = 32.0, "assumed PCIe Gen3 x16 (no measurement, no NVML)"
        measured["intra_node_bandwidth_source"] = source
        entry = {
            "type": "custom",
            "tflops": {d: gemm.get(d) for d in STORAGE_DTYPES},
            "memory_gib": round_sig(memory_bytes / 2**30) if memory_bytes else 1.0,
            "memory_bandwidth_GBps": measured.get("memory_bandwidth_GBps", 1.0),
            "intra_node_bandwidth_GBps": round_sig(intra),
        }
    if uuid:
        entry["uuid"] = str(uuid)
    entry["measured"] = measured
    return entry


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def assemble_cluster(record: ProfileRecord, *, name: str | None = None, catalog=None) -> dict:
    """The ClusterSpec mapping (validate with ``ClusterSpec.from_dict``) for a gathered profile."""
    if catalog is None:
        from tangram_launch.specs.catalog import default_catalog

        catalog = default_catalog()
    nodes = sorted(record.nodes, key=lambda n: n.node_rank)
    names = name_nodes([n.host for n in nodes])
    name_of = {n.node_rank: nm for n, nm in zip(nodes, names)}
    by_node: dict[int, list[DeviceRecord]] = {}
    for d in record.devices:
        by_node.setdefault(d.node_rank, []).append(d)

    node_entries = []
    node_profiles: dict[str, Any] = {}
    for node, nm in zip(nodes, names):
        devs = sorted(by_node.get(node.node_rank, []), key=lambda d: d.local_rank)
        entry = {"name": nm, "host": node.host}
        if node.inventory.memory_total_bytes > 0:  # MemTotal: what an offloaded optimizer's state must fit in
            # rounded down to 0.01 GiB: never more than the node has
            entry["host_memory_gib"] = math.floor(node.inventory.memory_total_bytes / 2**30 * 100) / 100
        entry["gpus"] = [_gpu_entry(d, node, catalog, (record.model or {}).get("name")) for d in devs]
        node_entries.append(entry)
        node_profiles[nm] = {
            "node_rank": node.node_rank,
            "ranks": list(node.ranks),
            "inventory": node.inventory.to_dict(),
            "allreduce": node.allreduce.to_dict() if node.allreduce else None,
            "reduce_scatter": node.reduce_scatter.to_dict() if node.reduce_scatter else None,
            "all_gather": node.all_gather.to_dict() if node.all_gather else None,
            "collective_latency": node.collective_latency.to_dict() if node.collective_latency else None,
            "collective_wait": node.collective_wait.to_dict() if node.collective_wait else None,
            "fsdp_unit": _fsdp_profile(node.fsdp_unit),
            "p2p_gbps": [_p2p_row(node, i) for i in range(len(node.ranks))] if node.p2p else None,
            "p2p": [{"local_ranks": [a, b], **m.to_dict()} for a, b, m in node.p2p],
        }

    spec: dict[str, Any] = {
        "name": name or (f"profiled-{names[0]}" if len(names) == 1 else f"profiled-{len(names)}-nodes"),
        "description": (f"measured by tangram-launch profile at {record.started_at} ({_count(len(names), 'node')}, "
                        f"{_count(len(record.devices), 'device')}, {record.backend}"
                        f"{', quick' if record.quick else ''})"),
    }
    inter: dict[str, Any] = {}
    if len(names) > 1:
        order = [name_of[n.node_rank] for n in nodes]
        bw = [[None] * len(order) for _ in order]
        lat = [[None] * len(order) for _ in order]
        pairs = []
        details = []
        for link in record.links:
            a, b = name_of[link.node_a], name_of[link.node_b]
            gbps = round_sig(sum(m.value for m in link.bandwidth))
            lat_us = round_sig(link.latency_rtt.median_s / 2 * 1e6)
            ia, ib = order.index(a), order.index(b)
            bw[ia][ib] = bw[ib][ia] = gbps
            lat[ia][ib] = lat[ib][ia] = lat_us
            pairs.append({"nodes": [a, b], "bandwidth_GBps": gbps, "latency_us": lat_us})
            details.append({"nodes": [a, b], "round": link.round_index, "rank_pairs": len(link.bandwidth),
                            "bandwidth": [m.to_dict() for m in link.bandwidth],
                            "latency_rtt": link.latency_rtt.to_dict()})
        missing = [(x, y) for i, x in enumerate(order) for j, y in enumerate(order) if i < j and bw[i][j] is None]
        if missing:
            raise ValueError(f"inter-node links not measured for {missing}")
        spec["network"] = {
            "default": {"bandwidth_GBps": min(p["bandwidth_GBps"] for p in pairs),
                        "latency_us": max(p["latency_us"] for p in pairs)},
            "pairs": pairs,
        }
        inter = {"nodes": order, "bandwidth_GBps": bw, "latency_us": lat, "pairs": details,
                 "method": "point-to-point ping-pong between same-local-rank pairs of two nodes (bandwidth summed "
                           "over the pairs), latency between node leaders; rounds of a round-robin tournament",
                 "schedule": [[[name_of[a], name_of[b]] for a, b in rnd] for rnd in record.schedule]}
    spec["nodes"] = node_entries
    spec["fingerprint"] = fingerprint(hardware_identity(record))
    profile: dict[str, Any] = {
        "tool": "tangram-launch profile",
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "wall_s": round(record.wall_s, 2),
        "quick": record.quick,
        "backend": record.backend,
        "torch_version": record.torch_version,
        "world_size": len(record.devices),
        "bench": dict(record.bench),
        "nodes": node_profiles,
        "devices": [
            {"node": name_of[d.node_rank], "local_index": d.local_rank, "rank": d.rank, "device": d.device,
             "gemm": {k: m.to_dict() for k, m in d.gemm.items()},
             **({"gemm_sweep": {k: [m.to_dict() for m in v] for k, v in d.gemm_sweep.items()}} if d.gemm_sweep
                else {}),
             "memory_bandwidth": d.memory_bandwidth.to_dict() if d.memory_bandwidth else None,
             **({"optimizer_tensor": d.optimizer_tensor.to_dict()} if d.optimizer_tensor else {}),
             **({"optimizer_param": d.optimizer_param.to_dict()} if d.optimizer_param else {}),
             **({"host_op": d.host_op.to_dict()} if d.host_op else {}),
             **({"wake_up": d.wake_up.to_dict()} if d.wake_up else {}),
             **({"stage_sequence": [{"micro_batch": m, "sequence_s": round_sig(w), "parts_s": round_sig(p)}
                                    for m, w, p in d.stage_sequence]} if d.stage_sequence else {}),
             **({"like_group": d.like_group.to_dict()} if d.like_group else {}),
             **({"layer": {k: {p: m.to_dict() for p, m in v.items()} for k, v in d.layer.items()}} if d.layer else {})}
            for d in sorted(record.devices, key=lambda d: d.rank)
        ],
    }
    if inter:
        profile["inter_node"] = inter
    if record.model:
        profile["model"] = dict(record.model)
    spec["profile"] = profile
    return to_plain(spec)


# --------------------------------------------------------------------------------------------- summary

def _range(values: Sequence[float]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return f"{lo:.3g}" if abs(hi - lo) <= 0.005 * hi else f"{lo:.3g}-{hi:.3g}"


def format_summary(spec) -> str:
    """Terminal table of a profiled ClusterSpec: per node its devices and measured figures, then the
    node-to-node bandwidth (latency) matrix."""
    profile = spec.profile or {}
    head = (f"profile of {_count(len(spec.nodes), 'node')}, {_count(spec.num_gpus, 'device')}: backend "
            f"{profile.get('backend', '?')}, {profile.get('wall_s', '?')} s"
            f"{' (quick)' if profile.get('quick') else ''}; fingerprint {spec.fingerprint or '-'}")
    rows = [("node", "host", "devices", "bf16 TFLOP/s", "fp32 TFLOP/s", "mem GiB", "mem GB/s", "allreduce GB/s",
             "p2p GB/s", "layer f+b ms")]
    for node in spec.nodes:
        types: dict[str, int] = {}
        for g in node.gpus:
            types[g.type] = types.get(g.type, 0) + 1
        devices = ", ".join(f"{n}x {t}" for t, n in types.items())
        ms = [g.measured or {} for g in node.gpus]
        gemm = [m.get("gemm_tflops") or {} for m in ms]
        p2p = [v for m in ms for v in (m.get("p2p_gbps") or []) if v is not None]
        layer = [v * 1e3 for m in ms for v in (m.get("layer_forward_backward_s") or {}).values()]
        rows.append((
            node.name, node.host or "-", devices,
            _range([x.get("bf16") for x in gemm]), _range([x.get("fp32") for x in gemm]),
            _range([g.memory_gib for g in node.gpus]),
            _range([m.get("memory_bandwidth_GBps") for m in ms]),
            _range([m.get("allreduce_busbw_gbps") for m in ms]),
            _range(p2p), _range(layer),
        ))
    lines = [head, ""] + _table(rows)
    inter = profile.get("inter_node")
    if inter:
        order = inter["nodes"]
        lines += ["", "node-to-node bandwidth GB/s (latency us):"]
        mrows = [("",) + tuple(order)]
        for i, a in enumerate(order):
            cells = []
            for j, _ in enumerate(order):
                bw, lat = inter["bandwidth_GBps"][i][j], inter["latency_us"][i][j]
                cells.append("-" if bw is None else f"{bw:.3g} ({lat:.3g})")
            mrows.append((a,) + tuple(cells))
        lines += _table(mrows)
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
