"""ClusterSpec: the GPUs of a cluster, their figures and the links between nodes, as data.

A cluster file names GPUs by catalog type (figures filled from the catalog) or gives figures explicitly; the
profiler writes the same format with measured figures beside the catalog ones. Every bandwidth carries its unit in
its key: ``*_GBps`` is gigabytes per second (1e9 bytes/s), ``*_Gbps`` gigabits per second (read as GB/s / 8, so NDR
InfiniBand is ``bandwidth_Gbps: 400`` or ``bandwidth_GBps: 50``); latencies are in microseconds. The old
``*_gbps`` keys, which meant GB/s though everyone reads them as gigabits, are still read as GB/s, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.catalog import _positive
from tangram_launch.specs.constants import DTYPE_NEEDS, DTYPES
from tangram_launch.specs.gemm_sweep import parse_gemm_sweep
from tangram_launch.specs.yamlio import (
    check_keys,
    dump_yaml_file,
    load_yaml_file,
    positive_int,
    positive_number,
    require,
    to_plain,
)


_GPU_KEYS = ("type", "tflops", "memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps", "uuid", "measured")
_NODE_KEYS = ("name", "host", "host_memory_gib", "gpu", "count", "gpus", "tflops", "memory_gib",
              "memory_bandwidth_GBps", "intra_node_bandwidth_GBps", "measured")
_TOP_KEYS = ("name", "description", "network", "nodes", "fingerprint", "profile")
_NET_KEYS = ("default", "fabrics", "pairs")
_LINK_KEYS = ("bandwidth_GBps", "latency_us")
# Keys "<stem>_GBps" (gigabytes/s), "<stem>_Gbps" (gigabits/s) or the old "<stem>_gbps" (gigabytes/s, warned).
_BANDWIDTH_STEMS = ("bandwidth", "memory_bandwidth", "intra_node_bandwidth")
BITS_PER_BYTE = 8

logger = logging.getLogger(__name__)


def math_mode(gpu: "GPUSpec", dtype: str) -> str:
    """The mode a GPU runs a training dtype's matmuls in: the one rule every peak and dtype check reads.

    ``tf32`` is fp32 storage with TF32 tensor-core matmuls where the GPU has them and strict FP32 elsewhere (V100,
    T4), as people who train "in fp32" run it: ``allow_tf32`` is a per-process switch, so each rank sets its own.
    It never makes a GPU unusable. ``fp32`` stays strict FP32 (torch's default); every other dtype runs as itself.
    """
    if dtype == "tf32" and not gpu.tflops.get("tf32"):
        return "fp32"
    return dtype


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's figures (catalog values unless overridden or measured)."""

    type: str
    tflops: Mapping[str, float | None]  # dense peak per dtype; None = unsupported
    memory_gib: float
    memory_bandwidth_GBps: float
    intra_node_bandwidth_GBps: float  # per-GPU, to peers in its node (NVLink or PCIe)
    uuid: str | None = None
    measured: Mapping[str, Any] = field(default_factory=dict)

    @property
    def physical_memory_gib(self) -> float:
        """The device's memory: ``memory_gib`` unless a run report's calibration lowered that figure for planning
        (``measured.memory_calibration``, launch/calibration.py), which keeps the physical one."""
        return float((self.measured.get("memory_calibration") or {}).get("memory_gib", self.memory_gib))

    def peak_tflops(self, dtype: str) -> float:
        """Dense matmul peak for a training dtype, in the math mode this GPU runs it in (:func:`math_mode`)."""
        value = self.tflops.get(math_mode(self, dtype))
        if value is None:
            supported = [d for d in DTYPES if self.tflops.get(d)]
            need = f" (it needs {DTYPE_NEEDS[dtype]})" if dtype in DTYPE_NEEDS else ""
            raise SpecError(f"GPU type '{self.type}' does not support {dtype}{need}", field="dtype", value=dtype,
                            valid=", ".join(supported))
        return float(value)

    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "type": self.type,
            "tflops": dict(self.tflops),
            "memory_gib": self.memory_gib,
            "memory_bandwidth_GBps": self.memory_bandwidth_GBps,
            "intra_node_bandwidth_GBps": self.intra_node_bandwidth_GBps,
        }
        if self.uuid:
            d["uuid"] = self.uuid
        if self.measured:
            d["measured"] = to_plain(self.measured)
        return d


@dataclass(frozen=True)
class NodeHostMemory:
    """A node's host RAM and the GPUs that share it: what an offloaded optimizer's state must fit in."""

    node: str
    host_memory_gib: float
    num_gpus: int  # every GPU of the node, whatever island it is in: they all may offload

    @property
    def gib_per_gpu(self) -> float:
        return self.host_memory_gib / self.num_gpus


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: tuple[GPUSpec, ...]
    host: str | None = None
    host_memory_gib: float | None = None  # host RAM (MemTotal); None: unknown, so offload is not checked against it

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def host_memory(self) -> NodeHostMemory | None:
        """The node's host RAM shared by its GPUs, or None where the cluster file does not give it."""
        if self.host_memory_gib is None:
            return None
        return NodeHostMemory(self.name, self.host_memory_gib, self.num_gpus)


@dataclass(frozen=True)
class LinkSpec:
    """A node-to-node link: bandwidth per direction in GB/s and one-way latency in microseconds."""

    bandwidth_GBps: float
    latency_us: float = 0.0

    def to_dict(self) -> dict:
        return {"bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us}


@dataclass(frozen=True)
class Fabric:
    name: str
    nodes: frozenset[str]
    link: LinkSpec


@dataclass(frozen=True)
class GpuRef:
    """A GPU's place in the cluster: node name and local index."""

    node: str
    local_index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.local_index}"


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]
    default_link: LinkSpec
    fabrics: tuple[Fabric, ...] = ()
    pair_links: Mapping[frozenset, LinkSpec] = field(default_factory=dict)
    name: str = "cluster"
    description: str = ""
    fingerprint: str | None = None
    profile: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError("a cluster needs at least one node", field="nodes")
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise SpecError("duplicate node name", field="nodes.name", value=sorted(dup)[0],
                            valid="unique node names")

    # --- lookups -------------------------------------------------------------------------------------------
    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise SpecError("unknown node", field="node", value=name, valid=", ".join(x.name for x in self.nodes))

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def gpu(self, ref: GpuRef) -> GPUSpec:
        return self.node(ref.node).gpus[ref.local_index]

    def iter_gpus(self) -> Iterator[tuple[GpuRef, GPUSpec]]:
        for n in self.nodes:
            for i, g in enumerate(n.gpus):
                yield GpuRef(n.name, i), g

    def link(self, a: str, b: str) -> LinkSpec:
        """Node-to-node link: a pair override, else the fastest fabric holding both, else the default."""
        if a == b:
            raise ValueError("link() is for two different nodes; intra-node bandwidth is per GPU")
        pair = self.pair_links.get(frozenset((a, b)))
        if pair is not None:
            return pair
        shared = [f.link for f in self.fabrics if a in f.nodes and b in f.nodes]
        if shared:
            return max(shared, key=lambda l: (l.bandwidth_GBps, -l.latency_us))
        return self.default_link

    def bandwidth_GBps(self, a: GpuRef, b: GpuRef) -> float:
        """Bandwidth between two GPUs: the slower intra-node link inside a node, the network across nodes."""
        if a.node == b.node:
            return min(self.gpu(a).intra_node_bandwidth_GBps, self.gpu(b).intra_node_bandwidth_GBps)
        return self.link(a.node, b.node).bandwidth_GBps

    # --- serialisation -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d: dict[str, Any] = {"name": self.name}
        if self.description:
            d["description"] = self.description
        net: dict[str, Any] = {"default": self.default_link.to_dict()}
        if self.fabrics:
            net["fabrics"] = [
                {"name": f.name, "nodes": sorted(f.nodes, key=self.node_names.index), **f.link.to_dict()}
                for f in self.fabrics
            ]
        if self.pair_links:
            net["pairs"] = [
                {"nodes": sorted(k, key=self.node_names.index), **v.to_dict()} for k, v in self.pair_links.items()
            ]
        d["network"] = net
        d["nodes"] = []
        for n in self.nodes:
            nd: dict[str, Any] = {"name": n.name}
            if n.host:
                nd["host"] = n.host
            if n.host_memory_gib is not None:
                nd["host_memory_gib"] = n.host_memory_gib
            nd["gpus"] = [g.to_dict() for g in n.gpus]
            d["nodes"].append(nd)
        if self.fingerprint:
            d["fingerprint"] = self.fingerprint
        if self.profile:
            d["profile"] = to_plain(self.profile)
        return d

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str | None = None, catalog=None) -> "ClusterSpec":
        return _parse_cluster(data, source=source, catalog=catalog)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSpec":
        path = os.fspath(path)
        return _parse_cluster(load_yaml_file(path), source=path)

    def dump(self, path: str | os.PathLike) -> None:
        dump_yaml_file(self.to_dict(), path)

    def content_hash(self) -> str:
        """Hash of the figures the planner reads (not of names' order in the file). It is taken over the bandwidth
        keys as first named (``*_gbps``, the same GB/s), so plans made before the keys spelled their unit still
        match their cluster."""
        blob = json.dumps(_first_key_names(self.to_dict()), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]




def _first_key_names(d: Any) -> Any:
    if isinstance(d, dict):
        return {(k.removesuffix("_GBps") + "_gbps" if k.endswith("_GBps") else k): _first_key_names(v)
                for k, v in d.items()}
    if isinstance(d, list):
        return [_first_key_names(v) for v in d]
    return d


# --- parsing -------------------------------------------------------------------------------------------------

def bandwidth_in_GBps(d: Mapping, *, where: str, source: str | None, legacy: set[str]) -> dict:
    """A copy of ``d`` with every bandwidth under its ``<stem>_GBps`` key.

    ``<stem>_Gbps`` (gigabits) is divided by 8; the old ``<stem>_gbps`` is read as GB/s, as it always was, and
    recorded in ``legacy`` so the caller warns once per file. Two keys for one bandwidth are refused: which one the
    user meant cannot be guessed.
    """
    out = dict(d)
    for stem in _BANDWIDTH_STEMS:
        given = [k for k in (f"{stem}_GBps", f"{stem}_Gbps", f"{stem}_gbps") if k in out]
        if len(given) > 1:
            raise SpecError("one bandwidth given under two keys", source=source,
                            field=f"{where}.{given[1]}" if where else given[1], value=given,
                            valid=f"only one of {stem}_GBps (gigabytes/s) or {stem}_Gbps (gigabits/s)")
        if given and given[0] == f"{stem}_Gbps":
            field = f"{where}.{given[0]}" if where else given[0]
            out[f"{stem}_GBps"] = positive_number(out.pop(given[0]), field=field, source=source) / BITS_PER_BYTE
        elif given and given[0] == f"{stem}_gbps":
            out[f"{stem}_GBps"] = out.pop(given[0])
            legacy.add(given[0])
    return out


def _warn_legacy_units(legacy: set[str], source: str | None) -> None:
    for key in sorted(legacy):
        stem = key.removesuffix("_gbps")
        logger.warning("%s%s is read as GB/s (gigabytes); write %s_GBps, or %s_Gbps for gigabits",
                       f"{source}: " if source else "", key, stem, stem)


def _parse_link(d: Any, *, where: str, source: str | None, legacy: set[str],
                extra: tuple[str, ...] = ()) -> LinkSpec:
    if not isinstance(d, Mapping):
        raise SpecError("expected a mapping with bandwidth_GBps (or bandwidth_Gbps) and latency_us", source=source,
                        field=where, value=d)
    d = bandwidth_in_GBps(d, where=where, source=source, legacy=legacy)
    check_keys(d, _LINK_KEYS + extra, where=where, source=source)
    bw = positive_number(require(d, "bandwidth_GBps", where=where, source=source),
                         field=f"{where}.bandwidth_GBps", source=source)
    lat = positive_number(d.get("latency_us", 0.0), field=f"{where}.latency_us", source=source, allow_zero=True)
    return LinkSpec(bw, lat)


def _parse_tflops(d: Any, *, where: str, source: str | None) -> dict[str, float | None]:
    if not isinstance(d, Mapping):
        raise SpecError("expected a mapping of dtype to TFLOP/s", source=source, field=where, value=d,
                        valid="e.g. {bf16: 312, fp16: 312, fp32: 19.5}")
    check_keys(d, DTYPES, where=where, source=source)
    out: dict[str, float | None] = {}
    for k, v in d.items():
        out[k] = None if v is None else positive_number(v, field=f"{where}.{k}", source=source)
    if not any(out.values()):
        raise SpecError("at least one dtype needs a throughput", source=source, field=where, value=d)
    return out


_CUSTOM_HINT = ("or, for a GPU the catalog lacks, '{key}: custom' with its figures: tflops: {{bf16: <TFLOP/s>, "
                "fp16: ..., fp32: ...}}, memory_gib, memory_bandwidth_GBps, intra_node_bandwidth_GBps")


def _parse_gpu(d: Mapping, *, where: str, source: str | None, catalog) -> GPUSpec:
    key = "type" if "type" in d else "gpu"  # a 'gpus' list entry says type, a node says gpu
    type_name = d.get(key)
    if type_name is None:
        raise SpecError("missing GPU type", source=source, field=f"{where}.{key}",
                        valid="a catalog name (e.g. a100-80gb) or 'custom' with explicit figures")
    type_name = str(type_name)
    if type_name.lower() == "custom":
        for key in ("tflops", "memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps"):
            if key not in d:
                raise SpecError("a custom GPU needs every figure", source=source, field=f"{where}.{key}",
                                valid="tflops, memory_gib, memory_bandwidth_GBps, intra_node_bandwidth_GBps")
        canonical = "custom"
        base_tflops: dict[str, float | None] = {}
        base = None
    else:
        if catalog is None:
            from tangram_launch.specs.catalog import default_catalog

            catalog = default_catalog()
        base = catalog.lookup(type_name, field=f"{where}.{key}", source=source,
                              otherwise=_CUSTOM_HINT.format(key=key))
        canonical = base.name
        base_tflops = dict(base.tflops)
    tflops = dict(base_tflops)
    if "tflops" in d:
        tflops.update(_parse_tflops(d["tflops"], where=f"{where}.tflops", source=source))

    def fig(key: str) -> float:
        if key in d:
            return positive_number(d[key], field=f"{where}.{key}", source=source)
        return float(getattr(base, key))

    measured = d.get("measured") or {}
    if not isinstance(measured, Mapping):
        raise SpecError("expected a mapping", source=source, field=f"{where}.measured", value=measured)
    parse_gemm_sweep(measured, where=where, source=source)
    uuid = d.get("uuid")
    return GPUSpec(
        type=canonical,
        tflops=tflops,
        memory_gib=fig("memory_gib"),
        memory_bandwidth_GBps=fig("memory_bandwidth_GBps"),
        intra_node_bandwidth_GBps=fig("intra_node_bandwidth_GBps"),
        uuid=str(uuid) if uuid is not None else None,
        measured=dict(measured),
    )


def _parse_node(d: Any, idx: int, *, source: str | None, catalog, legacy: set[str]) -> NodeSpec:
    where = f"nodes[{idx}]"
    if not isinstance(d, Mapping):
        raise SpecError("expected a mapping", source=source, field=where, value=d)
    d = bandwidth_in_GBps(d, where=where, source=source, legacy=legacy)
    check_keys(d, _NODE_KEYS, where=where, source=source)
    name = str(require(d, "name", where=where, source=source))
    where = f"nodes[{idx}] ({name})"
    gpus: list[GPUSpec] = []
    if "gpus" in d:
        if "gpu" in d or "count" in d:
            raise SpecError("give either 'gpu' + 'count' or a 'gpus' list, not both", source=source, field=where)
        entries = d["gpus"]
        if not isinstance(entries, list) or not entries:
            raise SpecError("a node needs at least one GPU", source=source, field=f"{where}.gpus", value=entries,
                            valid="a non-empty list of GPU entries")
        for j, g in enumerate(entries):
            if not isinstance(g, Mapping):
                raise SpecError("expected a mapping", source=source, field=f"{where}.gpus[{j}]", value=g)
            g = bandwidth_in_GBps(g, where=f"{where}.gpus[{j}]", source=source, legacy=legacy)
            check_keys(g, _GPU_KEYS, where=f"{where}.gpus[{j}]", source=source)
            merged = {k: v for k, v in d.items() if k in _GPU_KEYS and k not in ("type", "uuid")}
            merged.update(g)
            gpus.append(_parse_gpu(merged, where=f"{where}.gpus[{j}]", source=source, catalog=catalog))
    else:
        if "gpu" not in d:
            raise SpecError("missing GPUs", source=source, field=f"{where}.gpu",
                            valid="'gpu: <catalog name>' with 'count: N', or a 'gpus' list")
        count = d.get("count", 1)
        if isinstance(count, int) and not isinstance(count, bool) and count == 0:
            raise SpecError("a node with zero GPUs", source=source, field=f"{where}.count", value=0,
                            valid="an integer >= 1 (leave the node out instead)")
        count = positive_int(count, field=f"{where}.count", source=source)
        from tangram_launch.specs.limits import MAX_GPUS_PER_NODE

        if count > MAX_GPUS_PER_NODE:
            raise SpecError("more GPUs than a node holds", source=source, field=f"{where}.count", value=count,
                            valid=f"an integer from 1 to {MAX_GPUS_PER_NODE}")
        one = _parse_gpu({k: v for k, v in d.items() if k in _GPU_KEYS or k == "gpu"}, where=where, source=source,
                         catalog=catalog)
        gpus = [one] * count
    host = d.get("host")
    host_memory_gib = None  # left out where it is unknown
    if d.get("host_memory_gib") is not None:
        host_memory_gib = _positive(d["host_memory_gib"], field=f"{where}.host_memory_gib", source=source)
    return NodeSpec(name=name, gpus=tuple(gpus), host=str(host) if host is not None else None,
                    host_memory_gib=host_memory_gib)


def _parse_cluster(data: Mapping, *, source: str | None, catalog=None) -> ClusterSpec:
    if not isinstance(data, Mapping):
        raise SpecError("expected a mapping", source=source, value=type(data).__name__)
    check_keys(data, _TOP_KEYS, where="", source=source)
    raw_nodes = require(data, "nodes", where="", source=source)
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise SpecError("a cluster needs at least one node", source=source, field="nodes", value=raw_nodes)
    legacy: set[str] = set()
    nodes = tuple(_parse_node(n, i, source=source, catalog=catalog, legacy=legacy) for i, n in enumerate(raw_nodes))
    names = [n.name for n in nodes]
    for n in names:
        if names.count(n) > 1:
            raise SpecError("duplicate node name", source=source, field="nodes.name", value=n,
                            valid="unique node names")
    net = data.get("network") or {}
    if not isinstance(net, Mapping):
        raise SpecError("expected a mapping", source=source, field="network", value=net)
    check_keys(net, _NET_KEYS, where="network", source=source)
    if "default" in net:
        default = _parse_link(net["default"], where="network.default", source=source, legacy=legacy)
    elif len(nodes) > 1:
        raise SpecError("a multi-node cluster needs a default node-to-node link", source=source,
                        field="network.default",
                        valid="{bandwidth_GBps: <gigabytes/s>, latency_us: <us>} (or bandwidth_Gbps: <gigabits/s>)")
    else:
        default = LinkSpec(1.0, 0.0)

    def check_members(members: Any, where: str, *, exactly: int | None = None) -> list[str]:
        if not isinstance(members, list) or len(members) < 2 or (exactly and len(members) != exactly):
            want = f"a list of {exactly} node names" if exactly else "a list of at least 2 node names"
            raise SpecError("bad node list", source=source, field=f"{where}.nodes", value=members, valid=want)
        for m in members:
            if m not in names:
                from tangram_launch.specs.yamlio import closest

                hint = closest(str(m), names)
                raise SpecError("unknown node", source=source, field=f"{where}.nodes", value=m,
                                valid=(f"did you mean '{hint}'? " if hint else "") + ", ".join(names))
        if len(set(members)) != len(members):
            raise SpecError("a node is listed twice", source=source, field=f"{where}.nodes", value=members)
        return [str(m) for m in members]

    for key in ("fabrics", "pairs"):
        if not isinstance(net.get(key) or [], list):
            raise SpecError("expected a list", source=source, field=f"network.{key}", value=net.get(key))
    fabrics = []
    for i, f in enumerate(net.get("fabrics") or []):
        where = f"network.fabrics[{i}]"
        if not isinstance(f, Mapping):
            raise SpecError("expected a mapping", source=source, field=where, value=f)
        members = check_members(require(f, "nodes", where=where, source=source), where)
        link = _parse_link(f, where=where, source=source, legacy=legacy, extra=("name", "nodes"))
        fabrics.append(Fabric(str(f.get("name", f"fabric{i}")), frozenset(members), link))
    pairs: dict[frozenset, LinkSpec] = {}
    for i, p in enumerate(net.get("pairs") or []):
        where = f"network.pairs[{i}]"
        if not isinstance(p, Mapping):
            raise SpecError("expected a mapping", source=source, field=where, value=p)
        members = check_members(require(p, "nodes", where=where, source=source), where, exactly=2)
        link = _parse_link(p, where=where, source=source, legacy=legacy, extra=("nodes",))
        key = frozenset(members)
        if key in pairs and pairs[key] != link:
            raise SpecError("inconsistent bandwidths: the same node pair is given twice with different links",
                            source=source, field=where, value=members, valid="one entry per pair")
        pairs[key] = link
    profile = data.get("profile") or {}
    if not isinstance(profile, Mapping):
        raise SpecError("expected a mapping", source=source, field="profile", value=profile)
    _warn_legacy_units(legacy, source)
    return ClusterSpec(
        nodes=nodes,
        default_link=default,
        fabrics=tuple(fabrics),
        pair_links=pairs,
        name=str(data.get("name") or (os.path.splitext(os.path.basename(source))[0] if source else "cluster")),
        description=str(data.get("description") or ""),
        fingerprint=data.get("fingerprint"),
        profile=dict(profile),
    )
