"""Inventory: NVML paths against recorded answers (fake pynvml replaying an H100 NVLink node and an L4 PCIe node;
no GPU here), the no-NVML fallback, NICs from a sysfs tree, and matching torch devices by UUID."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from profiler.inventory import (
    GpuInfo,
    inventory_identity,
    match_torch_devices,
    normalize_uuid,
    parse_ib_rate_gbps,
    read_nics,
    read_node_inventory,
    read_nvml,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"


def _fake_module():
    spec = importlib.util.spec_from_file_location("fake_pynvml", FIXTURES / "fake_pynvml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fake = _fake_module()


def test_h100_nvlink_node():
    nvml = fake.FakeNvml.from_file("h100-sxm-8.json")
    r = read_nvml(nvml)
    assert r.status == "ok" and r.driver_version == "550.54.15"
    assert len(r.gpus) == 8
    for g in r.gpus:
        assert g.name == "NVIDIA H100 80GB HBM3"
        assert g.catalog_type == "h100-sxm"  # normalised to the catalog
        assert g.uuid.startswith("GPU-")
        assert g.nvlink_active_links == 18  # NVLink4 x18 into the NVSwitches
        assert {link.remote_kind for link in g.nvlinks} == {"switch"}
        assert all(link.remote_gpu_index is None for link in g.nvlinks)
        assert g.memory_total_bytes == 81559 * 2**20
        assert g.pcie_gen == 5 and g.pcie_width == 16  # the maximum, also where the link idles at Gen1
        assert g.pcie_bandwidth_gbps() == 128.0
        assert g.compute_capability == (9, 0)
    assert r.gpus[1].pcie_gen_current == 1
    # 28 pairs; PCIe topology NODE within a socket, SYS across; P2P over NVLink everywhere
    assert len(r.pairs) == 28
    assert {(p.a, p.b): p.topology for p in r.pairs}[(0, 3)] == "node"
    assert {(p.a, p.b): p.topology for p in r.pairs}[(3, 4)] == "system"
    assert all(p.p2p_nvlink == "ok" and p.p2p_read == "ok" for p in r.pairs)
    assert nvml.initialised == 0  # nvmlShutdown after reading


def test_l4_pcie_node():
    r = read_nvml(fake.FakeNvml.from_file("l4-pcie-4.json"))
    assert [g.catalog_type for g in r.gpus] == ["l4"] * 4
    assert all(g.nvlink_active_links == 0 and g.nvlinks == () for g in r.gpus)  # NVML: NotSupported
    assert all(g.pcie_gen == 4 and g.pcie_gen_current == 1 for g in r.gpus)
    assert r.gpus[0].pcie_bandwidth_gbps() == 64.0  # the catalog's PCIe Gen4 x16 figure
    pairs = {(p.a, p.b): p for p in r.pairs}
    assert pairs[(0, 1)].topology == "single" and pairs[(0, 1)].p2p_read == "ok"  # behind one PCIe switch
    assert pairs[(1, 2)].topology == "system" and pairs[(1, 2)].p2p_read == "chipset_not_supported"
    assert pairs[(0, 1)].p2p_nvlink == "not_supported"


def test_recorded_h200_from_a_real_machine():
    """Recorded with record_nvml.py on a one-GPU H200 VM (driver 580): NVML there reports no NVLink and P2P
    with itself as not supported."""
    r = read_nvml(fake.FakeNvml.from_file("h200-1.json"))
    [g] = r.gpus
    assert g.name == "NVIDIA H200" and g.catalog_type == "h200"
    assert g.uuid == "GPU-683f67a3-1e45-aa1a-c4b2-fafcf5c157c3"
    assert g.memory_total_bytes == 143771 * 2**20
    assert g.pcie_gen == 5 and g.nvlink_active_links == 0 and r.pairs == ()
    # torch prints this GPU's UUID without the prefix ("683f67a3-..."): it still matches
    assert match_torch_devices(["683f67a3-1e45-aa1a-c4b2-fafcf5c157c3"], r.gpus) == [g]


def test_direct_nvlinks_resolve_peer_gpus():
    """DGX-1 style: links go straight to other GPUs (no NVSwitch); peers are found by PCI bus id."""
    data = json.loads((FIXTURES / "l4-pcie-4.json").read_text())
    data = copy.deepcopy(data)
    for i, dev in enumerate(data["devices"]):
        dev["name"] = "Tesla V100-SXM2-16GB"
        peers = [j for j in range(4) if j != i]
        # two links to the next GPU, one to each other (remote type missing: an older driver)
        dev["nvlink"] = [{"state": 1, "remote_bus_id": data["devices"][p]["pci_bus_id"].replace("00000000:", "0000:"),
                          "remote_type": {"error": "NotSupported"}} for p in peers + [peers[0]]]
        dev["nvlink"].append({"state": 0, "remote_bus_id": None, "remote_type": None})
    r = read_nvml(fake.FakeNvml(data))
    assert [g.catalog_type for g in r.gpus] == ["v100-16gb"] * 4
    g0 = r.gpus[0]
    assert g0.nvlink_active_links == 4 and len(g0.nvlinks) == 5
    assert [link.remote_gpu_index for link in g0.nvlinks if link.active] == [1, 2, 3, 1]
    assert {(p.a, p.b): p.nvlink_links for p in r.pairs}[(0, 1)] == 2


def test_unknown_gpu_name_has_no_catalog_type():
    data = json.loads((FIXTURES / "l4-pcie-4.json").read_text())
    data["devices"][0]["name"] = "NVIDIA Future GPU 9000"
    r = read_nvml(fake.FakeNvml(data))
    assert r.gpus[0].catalog_type is None and r.gpus[1].catalog_type == "l4"


def test_without_nvml_library_the_inventory_has_no_gpus(tmp_path):
    nvml = fake.FakeNvml(None)
    inv = read_node_inventory(nvml, infiniband_root=str(tmp_path / "none"), host="cpu-box")
    assert inv.gpus == () and inv.pairs == ()
    assert not inv.nvml_available
    assert inv.nvml_status == "unavailable: NVML Shared Library Not Found"
    assert inv.host == "cpu-box" and inv.cpu_count >= 1 and inv.memory_total_bytes > 2**28


def test_real_pynvml_without_driver_is_information_not_failure():
    pytest.importorskip("pynvml")
    r = read_nvml()  # this machine: no NVIDIA driver
    if r.status == "ok":
        pytest.skip("this machine has an NVIDIA driver")
    assert r.status.startswith("unavailable:") and r.gpus == ()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_nics_from_sysfs(tmp_path):
    root = tmp_path / "infiniband"
    _write(root / "mlx5_0" / "ports" / "1" / "link_layer", "InfiniBand")
    _write(root / "mlx5_0" / "ports" / "1" / "rate", "200 Gb/sec (4X HDR)")
    _write(root / "mlx5_0" / "ports" / "1" / "state", "4: ACTIVE")
    _write(root / "mlx5_1" / "ports" / "1" / "link_layer", "Ethernet")
    _write(root / "mlx5_1" / "ports" / "1" / "rate", "100 Gb/sec (2X HDR)")
    _write(root / "mlx5_1" / "ports" / "1" / "state", "1: DOWN")
    nics = read_nics(str(root))
    assert [(n.device, n.port, n.link_layer, n.rate_gbps, n.state) for n in nics] == [
        ("mlx5_0", 1, "InfiniBand", 25.0, "ACTIVE"),
        ("mlx5_1", 1, "Ethernet", 12.5, "DOWN"),
    ]
    assert read_nics(str(tmp_path / "missing")) == ()
    assert parse_ib_rate_gbps("400 Gb/sec (4X NDR)") == 50.0
    assert parse_ib_rate_gbps("garbage") is None


def test_torch_devices_match_nvml_by_uuid_not_index():
    gpus = read_nvml(fake.FakeNvml.from_file("h100-sxm-8.json")).gpus
    # CUDA_VISIBLE_DEVICES=7,6,...: torch device i is NVML GPU 7-i; torch prints UUIDs without the "GPU-" prefix
    torch_uuids = [gpus[7 - i].uuid[4:].upper() for i in range(8)] + ["GPU-ffffffff", None]
    matched = match_torch_devices(torch_uuids, gpus)
    assert [g.index if g else None for g in matched] == [7, 6, 5, 4, 3, 2, 1, 0, None, None]
    assert normalize_uuid("GPU-AbC") == normalize_uuid("abc") == "abc"


def test_inventory_identity_ignores_free_memory_and_link_state():
    a = read_node_inventory(fake.FakeNvml.from_file("l4-pcie-4.json"), infiniband_root="/nonexistent", host="h")
    data = json.loads((FIXTURES / "l4-pcie-4.json").read_text())
    for d in data["devices"]:
        d["memory"]["free"] -= 2**30
        d["pcie"]["curr_gen"] = 4
    b = read_node_inventory(fake.FakeNvml(data), infiniband_root="/nonexistent", host="h")
    assert inventory_identity(a) == inventory_identity(b)
    data["devices"][2]["uuid"] = "GPU-replaced"
    c = read_node_inventory(fake.FakeNvml(data), infiniband_root="/nonexistent", host="h")
    assert inventory_identity(a) != inventory_identity(c)
    d = a.to_dict()
    assert d["gpus"][0]["nvlinks"] == {"active": 0, "remote_kinds": {}, "gpu_peers": {}}
    json.dumps(d)  # plain data (goes into the YAML's profile section)


def test_gpu_info_pcie_bandwidth_unknown_generation():
    g = GpuInfo(index=0, name="x", catalog_type=None, uuid="GPU-1", bus_id=None, memory_total_bytes=1,
                memory_free_bytes=1, pcie_gen=None, pcie_width=16, pcie_gen_current=None, pcie_width_current=None,
                compute_capability=None)
    assert g.pcie_bandwidth_gbps() is None
