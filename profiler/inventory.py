"""Hardware inventory of one node: GPUs through NVML, host CPU and memory, NICs through sysfs.

The NVML module is a parameter (``nvml=``) so tests replay recorded answers through a fake module instead of
patching the real ``pynvml``; ``None`` imports ``pynvml`` (package ``nvidia-ml-py``). Without NVML (no driver, no
GPU: ``NVMLError_LibraryNotFound``, or any NVML error at init) the inventory has no GPUs and says why in
``nvml_status``: that is a normal outcome on CPU machines, not a failure.

Torch devices are matched to NVML devices by UUID (:func:`match_torch_devices`), never by index: NVML enumerates
every GPU of the host in PCI order while CUDA honours ``CUDA_VISIBLE_DEVICES`` and its own ordering.
"""
from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import asdict, dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)

INFINIBAND_ROOT = "/sys/class/infiniband"

# PCIe payload bandwidth per lane and direction by generation, GB/s (rounded as the catalog does: Gen4 x16 = 32+32).
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 1.0, 4: 2.0, 5: 4.0, 6: 8.0, 7: 16.0}


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU as NVML reports it."""

    link: int
    active: bool
    remote_bus_id: str | None
    remote_kind: str  # "gpu" | "switch" | "ibmnpu" | "unknown"
    remote_gpu_index: int | None = None  # NVML index of the peer when the remote end is a GPU of this node


@dataclass(frozen=True)
class GpuInfo:
    """One GPU's identity and static figures (NVML index order)."""

    index: int
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    catalog_type: str | None  # canonical catalog name ("h100-sxm"), None when the catalog does not know it
    uuid: str
    bus_id: str | None
    memory_total_bytes: int
    memory_free_bytes: int
    pcie_gen: int | None  # maximum link generation (idle GPUs train the link down; see pcie_gen_current)
    pcie_width: int | None
    pcie_gen_current: int | None
    pcie_width_current: int | None
    compute_capability: tuple[int, int] | None
    nvlinks: tuple[NvLink, ...] = ()

    @property
    def nvlink_active_links(self) -> int:
        return sum(1 for link in self.nvlinks if link.active)

    @property
    def memory_total_gib(self) -> float:
        return self.memory_total_bytes / 2**30

    def pcie_bandwidth_gbps(self) -> float | None:
        """Bidirectional PCIe bandwidth of the link (the catalog's convention for intra-node figures)."""
        if self.pcie_gen is None or self.pcie_width is None or self.pcie_gen not in _PCIE_LANE_GBPS:
            return None
        return 2 * _PCIE_LANE_GBPS[self.pcie_gen] * self.pcie_width


@dataclass(frozen=True)
class GpuPair:
    """Topology between two GPUs of a node (a < b, NVML indices)."""

    a: int
    b: int
    topology: str  # common PCIe ancestor: internal | single | multiple | hostbridge | node | system | unknown
    p2p_read: str  # NVML P2P status for reads over PCIe: ok | chipset_not_supported | ... | unknown
    p2p_nvlink: str  # NVML P2P status over NVLink
    nvlink_links: int  # direct NVLinks between the two (0 behind an NVSwitch: see GpuInfo.nvlinks)


@dataclass(frozen=True)
class Nic:
    """One port of an RDMA device from /sys/class/infiniband (InfiniBand, or Ethernet for RoCE)."""

    device: str
    port: int
    link_layer: str  # "InfiniBand" | "Ethernet"
    rate_gbps: float | None  # GB/s (bytes): sysfs prints Gb/s, e.g. "200 Gb/sec (4X HDR)" -> 25.0
    rate_text: str
    state: str  # "ACTIVE", "DOWN", ...


@dataclass(frozen=True)
class NodeInventory:
    host: str
    cpu_count: int
    memory_total_bytes: int
    gpus: tuple[GpuInfo, ...]
    pairs: tuple[GpuPair, ...]
    nics: tuple[Nic, ...]
    nvml_status: str  # "ok" or "unavailable: <reason>"
    driver_version: str | None = None

    @property
    def nvml_available(self) -> bool:
        return self.nvml_status == "ok"

    def gpu_by_uuid(self, uuid: str | None) -> GpuInfo | None:
        key = normalize_uuid(uuid)
        if not key:
            return None
        for g in self.gpus:
            if normalize_uuid(g.uuid) == key:
                return g
        return None

    def pair(self, a: int, b: int) -> GpuPair | None:
        lo, hi = min(a, b), max(a, b)
        for p in self.pairs:
            if (p.a, p.b) == (lo, hi):
                return p
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory_total_gib"] = round(self.memory_total_bytes / 2**30, 2)
        for g, gd in zip(self.gpus, d["gpus"]):
            gd["nvlink_active_links"] = g.nvlink_active_links
            gd["compute_capability"] = list(g.compute_capability) if g.compute_capability else None
            # NVLinks are summarised (count and remote kinds); the per-link list is long on NVSwitch systems.
            gd["nvlinks"] = _summarise_links(g.nvlinks)
        return d


def _summarise_links(links: Sequence[NvLink]) -> dict:
    kinds: dict[str, int] = {}
    peers: dict[str, int] = {}
    for link in links:
        if not link.active:
            continue
        kinds[link.remote_kind] = kinds.get(link.remote_kind, 0) + 1
        if link.remote_gpu_index is not None:
            peers[str(link.remote_gpu_index)] = peers.get(str(link.remote_gpu_index), 0) + 1
    return {"active": sum(kinds.values()), "remote_kinds": kinds, "gpu_peers": peers}


def normalize_uuid(uuid: Any) -> str:
    """Compare form of a GPU UUID: NVML says "GPU-5b3b...", torch may print the bare hex form."""
    if uuid is None:
        return ""
    text = str(uuid).strip().lower()
    if text.startswith("gpu-"):
        text = text[4:]
    return text


def match_torch_devices(torch_uuids: Sequence[str | None], gpus: Sequence[GpuInfo]) -> list[GpuInfo | None]:
    """For each torch device (by its UUID) the NVML GPU with the same UUID, or None."""
    by_uuid = {normalize_uuid(g.uuid): g for g in gpus}
    return [by_uuid.get(normalize_uuid(u)) if u else None for u in torch_uuids]


# --------------------------------------------------------------------------------------------- NVML reading

@dataclass(frozen=True)
class NvmlReading:
    status: str
    gpus: tuple[GpuInfo, ...] = ()
    pairs: tuple[GpuPair, ...] = ()
    driver_version: str | None = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _index_constant(value: Any) -> int:
    # nvidia-ml-py 12.x defines NVML_P2P_CAPS_INDEX_READ as a one-element tuple (a stray comma): accept both.
    return int(value[0]) if isinstance(value, tuple) else int(value)


def _optional(nvml, fn, *args):
    """Call an NVML query that a GPU or driver may not support; None when it says so."""
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _topology_names(nvml) -> dict[int, str]:
    names = {}
    for const, name in (("NVML_TOPOLOGY_INTERNAL", "internal"), ("NVML_TOPOLOGY_SINGLE", "single"),
                        ("NVML_TOPOLOGY_MULTIPLE", "multiple"), ("NVML_TOPOLOGY_HOSTBRIDGE", "hostbridge"),
                        ("NVML_TOPOLOGY_NODE", "node"), ("NVML_TOPOLOGY_SYSTEM", "system")):
        if hasattr(nvml, const):
            names[int(getattr(nvml, const))] = name
    return names


def _p2p_names(nvml) -> dict[int, str]:
    names = {}
    for attr in dir(nvml):
        if attr.startswith("NVML_P2P_STATUS_") and not attr.endswith("SUPPORED"):  # skip NVML's misspelt alias
            names[int(getattr(nvml, attr))] = attr[len("NVML_P2P_STATUS_"):].lower()
    return names


def _remote_kind(nvml, code: int | None) -> str:
    kinds = {getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", 0): "gpu",
             getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", 1): "ibmnpu",
             getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2): "switch"}
    return kinds.get(code, "unknown") if code is not None else "unknown"


def _read_nvlinks(nvml, handle) -> list[tuple[int, bool, str | None, int | None]]:
    """(link, active, remote bus id, remote type code) for each link NVML knows; [] on GPUs without NVLink."""
    out = []
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for link in range(max_links):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError:
            # NotSupported: a PCIe GPU; InvalidArgument: past this GPU's last link. Either way no more links.
            break
        active = int(state) == int(getattr(nvml, "NVML_FEATURE_ENABLED", 1))
        remote = None
        rtype = None
        if active:
            pci = _optional(nvml, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            remote = _text(pci.busId) if pci is not None else None
            if hasattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType"):
                rtype = _optional(nvml, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        out.append((link, active, remote, None if rtype is None else int(rtype)))
    return out


def read_nvml(nvml: Any = None) -> NvmlReading:
    """GPUs and their pairwise topology through NVML; never raises for a missing library or driver."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError as exc:
            return NvmlReading(status=f"unavailable: pynvml not installed ({exc})")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return NvmlReading(status=f"unavailable: {exc}")
    try:
        return _read_initialised(nvml)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:  # pragma: no cover - shutdown after a successful init does not fail in practice
            pass


def _read_initialised(nvml) -> NvmlReading:
    from tangram_launch.specs.catalog import default_catalog, normalize_gpu_name

    catalog = default_catalog()
    driver = _optional(nvml, nvml.nvmlSystemGetDriverVersion)
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    raw: list[dict] = []
    for i, h in enumerate(handles):
        name = _text(nvml.nvmlDeviceGetName(h))
        pci = _optional(nvml, nvml.nvmlDeviceGetPciInfo, h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        cc = _optional(nvml, nvml.nvmlDeviceGetCudaComputeCapability, h)
        canonical = normalize_gpu_name(name)
        raw.append({
            "index": i,
            "name": name,
            "catalog_type": canonical if canonical in catalog else None,
            "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
            "bus_id": _text(pci.busId) if pci is not None else None,
            "memory_total_bytes": int(mem.total),
            "memory_free_bytes": int(mem.free),
            "pcie_gen": _optional(nvml, nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "pcie_width": _optional(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
            "pcie_gen_current": _optional(nvml, nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width_current": _optional(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, h),
            "compute_capability": tuple(int(x) for x in cc) if cc is not None else None,
            "links": _read_nvlinks(nvml, h),
        })
    bus_to_index = {_bus_key(r["bus_id"]): r["index"] for r in raw if r["bus_id"]}
    gpus = []
    for r in raw:
        links = []
        for link, active, remote, rtype in r.pop("links"):
            peer = bus_to_index.get(_bus_key(remote)) if remote else None
            kind = _remote_kind(nvml, rtype)
            if kind == "unknown" and peer is not None:
                kind = "gpu"  # older drivers lack the remote-type query; a GPU's bus id identifies the peer
            links.append(NvLink(link, active, remote, kind, peer if kind == "gpu" else None))
        gpus.append(GpuInfo(nvlinks=tuple(links), **r))
    topo_names = _topology_names(nvml)
    p2p_names = _p2p_names(nvml)
    read_idx = _index_constant(getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0))
    nvlink_idx = _index_constant(getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
    pairs = []
    for a in range(count):
        for b in range(a + 1, count):
            level = _optional(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
            p_read = _optional(nvml, nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b], read_idx)
            p_nvl = _optional(nvml, nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b], nvlink_idx)
            direct = sum(1 for link in gpus[a].nvlinks if link.active and link.remote_gpu_index == b)
            pairs.append(GpuPair(
                a, b,
                topology=topo_names.get(int(level), "unknown") if level is not None else "unknown",
                p2p_read=p2p_names.get(int(p_read), "unknown") if p_read is not None else "unknown",
                p2p_nvlink=p2p_names.get(int(p_nvl), "unknown") if p_nvl is not None else "unknown",
                nvlink_links=direct,
            ))
    return NvmlReading(status="ok", gpus=tuple(gpus), pairs=tuple(pairs),
                       driver_version=_text(driver) if driver is not None else None)


def _bus_key(bus_id: str | None) -> str:
    """PCI bus ids come as "00000000:18:00.0" or "0000:18:00.0": compare domain-less, lower case."""
    if not bus_id:
        return ""
    parts = bus_id.lower().split(":")
    return ":".join(parts[-2:])


# --------------------------------------------------------------------------------------------- host and NICs

_RATE_RE = re.compile(r"([0-9.]+)\s*Gb/s", re.IGNORECASE)


def parse_ib_rate_gbps(text: str) -> float | None:
    """sysfs rate "200 Gb/sec (4X HDR)" -> 25.0 GB/s (bytes, as every _gbps figure here)."""
    m = _RATE_RE.search(text.replace("Gb/sec", "Gb/s"))
    return float(m.group(1)) / 8 if m else None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def read_nics(root: str = INFINIBAND_ROOT) -> tuple[Nic, ...]:
    """RDMA ports from sysfs (``<root>/<device>/ports/<n>/{link_layer,rate,state}``); () when there are none."""
    if not os.path.isdir(root):
        return ()
    nics = []
    for device in sorted(os.listdir(root)):
        ports_dir = os.path.join(root, device, "ports")
        if not os.path.isdir(ports_dir):
            continue
        for port in sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0):
            base = os.path.join(ports_dir, port)
            rate_text = _read_text(os.path.join(base, "rate")) or ""
            state = _read_text(os.path.join(base, "state")) or "unknown"
            # "4: ACTIVE" -> "ACTIVE"
            state = state.split(":", 1)[1].strip() if ":" in state else state
            nics.append(Nic(
                device=device,
                port=int(port) if port.isdigit() else 0,
                link_layer=_read_text(os.path.join(base, "link_layer")) or "unknown",
                rate_gbps=parse_ib_rate_gbps(rate_text),
                rate_text=rate_text,
                state=state,
            ))
    return tuple(nics)


def read_memory_total_bytes(meminfo: str = "/proc/meminfo") -> int:
    text = _read_text(meminfo) or ""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    if m:
        return int(m.group(1)) * 1024
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):  # pragma: no cover - every Linux has one of the two
        return 0


def usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def read_node_inventory(nvml: Any = None, *, infiniband_root: str = INFINIBAND_ROOT,
                        host: str | None = None) -> NodeInventory:
    """The whole node: NVML GPUs (or none, with the reason), host CPUs and memory, RDMA NICs."""
    reading = read_nvml(nvml)
    return NodeInventory(
        host=host or socket.gethostname(),
        cpu_count=usable_cpu_count(),
        memory_total_bytes=read_memory_total_bytes(),
        gpus=reading.gpus,
        pairs=reading.pairs,
        nics=read_nics(infiniband_root),
        nvml_status=reading.status,
        driver_version=reading.driver_version,
    )


def inventory_identity(inv: NodeInventory) -> dict:
    """The parts of a node's inventory that identify its hardware (no free memory, no link states)."""
    return {
        "host": inv.host,
        "cpu_count": inv.cpu_count,
        "memory_total_gib": round(inv.memory_total_bytes / 2**30),
        "gpus": [[g.name, g.uuid, g.memory_total_bytes] for g in inv.gpus],
        "nics": [[n.device, n.port, n.link_layer, n.rate_text] for n in inv.nics],
    }


def describe(inv: NodeInventory) -> str:
    """One log line: host, CPUs, memory, GPUs by type, NICs."""
    gpus: dict[str, int] = {}
    for g in inv.gpus:
        gpus[g.catalog_type or g.name] = gpus.get(g.catalog_type or g.name, 0) + 1
    gpu_text = ", ".join(f"{n}x {t}" for t, n in gpus.items()) or "no GPUs"
    nic_text = ", ".join(f"{n.device}/{n.port} {n.link_layer} {n.rate_text or '?'} {n.state}" for n in inv.nics)
    return (f"{inv.host}: {inv.cpu_count} CPUs, {inv.memory_total_bytes / 2**30:.1f} GiB, {gpu_text}"
            + (f"; NICs: {nic_text}" if nic_text else "; no RDMA NICs"))

