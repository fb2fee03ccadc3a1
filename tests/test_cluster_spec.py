"""ClusterSpec: parsing, catalog filling, links, round trips and bad input."""
import glob
import os

import pytest
import yaml

from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec, GpuRef

from conftest import CLUSTERS


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def two_nodes(**net):
    return {
        "network": {"default": {"bandwidth_GBps": 3.125, "latency_us": 30}, **net},
        "nodes": [{"name": "a", "gpu": "a100-80gb", "count": 4}, {"name": "b", "gpu": "v100-32gb", "count": 8}],
    }


def _example_clusters():
    """Every example cluster; the planner-scale ones (hundreds of nodes: a round trip writes and parses ~1 MB of YAML,
    seconds each) in the slow tier."""
    for path in sorted(glob.glob(os.path.join(CLUSTERS, "*.yaml"))):
        name = os.path.basename(path)
        big = name.startswith(("opt350m-", "llama3-405b-"))
        yield pytest.param(path, marks=pytest.mark.slow) if big else path


@pytest.mark.parametrize("path", list(_example_clusters()))
def test_examples_load_and_round_trip(path, tmp_path):
    c = ClusterSpec.load(path)
    assert c.num_gpus > 0
    out = tmp_path / "rt.yaml"
    c.dump(out)
    again = ClusterSpec.load(out)
    assert again.to_dict() == c.to_dict()
    assert again.content_hash() == c.content_hash()


def test_catalog_fills_figures_and_overrides_win(tmp_path):
    d = two_nodes()
    d["nodes"][0]["intra_node_bandwidth_GBps"] = 64  # an A100 PCIe-only box
    c = ClusterSpec.load(write(tmp_path, d))
    a = c.node("a").gpus[0]
    assert a.type == "a100-80gb" and a.memory_gib == 80 and a.tflops["bf16"] == 312
    assert a.intra_node_bandwidth_GBps == 64
    assert c.node("b").gpus[0].tflops["bf16"] is None  # V100 has no bf16
    with pytest.raises(SpecError, match="bf16"):
        c.node("b").gpus[0].peak_tflops("bf16")


def test_nvml_style_names_resolve(tmp_path):
    d = {"nodes": [{"name": "n", "gpus": [{"type": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-1"},
                                          {"type": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-2"}]}]}
    c = ClusterSpec.load(write(tmp_path, d))
    assert [g.type for g in c.node("n").gpus] == ["a100-80gb", "a100-80gb"]
    assert c.node("n").gpus[1].uuid == "GPU-2"


def test_links_pair_beats_fabric_beats_default(tmp_path):
    d = two_nodes()
    d["nodes"].append({"name": "c", "gpu": "t4", "count": 4})
    d["network"]["fabrics"] = [{"name": "ib", "nodes": ["a", "b", "c"], "bandwidth_GBps": 25, "latency_us": 2}]
    d["network"]["pairs"] = [{"nodes": ["a", "c"], "bandwidth_GBps": 12.5, "latency_us": 5}]
    c = ClusterSpec.load(write(tmp_path, d))
    assert c.link("a", "b").bandwidth_GBps == 25
    assert c.link("c", "a").bandwidth_GBps == 12.5
    assert c.bandwidth_GBps(GpuRef("a", 0), GpuRef("a", 1)) == c.node("a").gpus[0].intra_node_bandwidth_GBps
    d["network"]["fabrics"] = []
    c2 = ClusterSpec.load(write(tmp_path, d, "c2.yaml"))
    assert c2.link("a", "b").bandwidth_GBps == 3.125


def test_mixed_node_sizes_and_custom_gpu(tmp_path):
    d = {"network": {"default": {"bandwidth_GBps": 12.5}},
         "nodes": [{"name": "x", "gpu": "h100-sxm", "count": 8},
                   {"name": "y", "gpus": [{"type": "custom", "tflops": {"bf16": 100, "fp32": 10}, "memory_gib": 24,
                                           "memory_bandwidth_GBps": 900, "intra_node_bandwidth_GBps": 32}]}]}
    c = ClusterSpec.load(write(tmp_path, d))
    assert [n.num_gpus for n in c.nodes] == [8, 1]
    assert c.node("y").gpus[0].type == "custom" and c.node("y").gpus[0].peak_tflops("bf16") == 100


@pytest.mark.parametrize("text, field", [
    ("nodes: [a, b", "malformed YAML"),
    ("- just\n- a list\n", "mapping"),
])
def test_malformed_yaml_names_file(tmp_path, text, field):
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as e:
        ClusterSpec.load(p)
    assert p in str(e.value) and field in str(e.value)


def test_missing_file():
    with pytest.raises(SpecError, match="file not found"):
        ClusterSpec.load("/nonexistent/cluster.yaml")


@pytest.mark.parametrize("mutate, expect", [
    (lambda d: d["nodes"][0].update(gpu="a100-80"), "a100-80gb"),  # suggests the closest catalog name
    (lambda d: d["nodes"][0].update(gpu="quantum-9000"), "unknown GPU type"),
    (lambda d: d["nodes"][0].update(count=0), "zero GPUs"),
    (lambda d: d["nodes"][0].update(count=-2), "count"),
    (lambda d: d["nodes"][0].update(memory_gib=-1), "memory_gib"),
    (lambda d: d["nodes"][0].update(colour="red"), "nodes[0].colour"),
    (lambda d: d.update(nodez=[]), "did you mean 'nodes'"),
    (lambda d: d["network"]["default"].update(bandwidth_GBps=0), "bandwidth_GBps"),
    (lambda d: d["network"].update(pairs=[{"nodes": ["a", "zz"], "bandwidth_GBps": 1}]), "unknown node"),
    (lambda d: d["network"].update(pairs=[{"nodes": ["a", "b"], "bandwidth_GBps": 1},
                                          {"nodes": ["b", "a"], "bandwidth_GBps": 2}]), "inconsistent bandwidths"),
    (lambda d: d["nodes"].append({"name": "a", "gpu": "t4"}), "duplicate node name"),
    (lambda d: d.pop("network"), "network.default"),
    (lambda d: d.update(nodes=[]), "at least one node"),
])
def test_bad_input_names_field(tmp_path, mutate, expect):
    d = two_nodes()
    mutate(d)
    p = write(tmp_path, d)
    with pytest.raises(SpecError) as e:
        ClusterSpec.load(p)
    msg = str(e.value)
    assert expect in msg and p in msg
