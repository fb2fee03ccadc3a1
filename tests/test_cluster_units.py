"""Bandwidth keys carry their unit (GB/s or Gb/s), and GPU names resolve only to what the user wrote."""
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec

GIGA = 1e9


def cluster(link: dict, **node) -> dict:
    return {"network": {"default": {"latency_us": 5, **link}},
            "nodes": [{"name": "a", "gpu": "a100-80gb", "count": 2, **node},
                      {"name": "b", "gpu": "a100-80gb", "count": 2}]}


def test_bandwidth_GBps_is_gigabytes_per_second():
    c = ClusterSpec.from_dict(cluster({"bandwidth_GBps": 50}))
    assert c.default_link.bandwidth_GBps == 50


def test_bandwidth_Gbps_is_gigabits_per_second():
    ndr = ClusterSpec.from_dict(cluster({"bandwidth_Gbps": 400}))  # NDR InfiniBand: 400 Gb/s = 50 GB/s
    assert ndr.default_link.bandwidth_GBps == 50


def test_node_bandwidths_take_either_unit():
    c = ClusterSpec.from_dict(cluster({"bandwidth_GBps": 1}, intra_node_bandwidth_Gbps=800,
                                      memory_bandwidth_GBps=1000))
    gpu = c.node("a").gpus[0]
    assert (gpu.intra_node_bandwidth_GBps, gpu.memory_bandwidth_GBps) == (100, 1000)


def test_old_key_is_read_as_gigabytes_with_a_warning_saying_so(caplog):
    with caplog.at_level(logging.WARNING):
        c = ClusterSpec.from_dict(cluster({"bandwidth_gbps": 25}, intra_node_bandwidth_gbps=300), source="c.yaml")
    assert c.default_link.bandwidth_GBps == 25 and c.node("a").gpus[0].intra_node_bandwidth_GBps == 300
    text = caplog.text
    assert "c.yaml: bandwidth_gbps is read as GB/s (gigabytes); write bandwidth_GBps, or bandwidth_Gbps for " \
           "gigabits" in text
    assert "intra_node_bandwidth_gbps is read as GB/s" in text


def test_old_key_warns_once_per_file(caplog):
    data = cluster({"bandwidth_gbps": 25})
    data["network"]["fabrics"] = [{"nodes": ["a", "b"], "bandwidth_gbps": 50}]
    with caplog.at_level(logging.WARNING):
        ClusterSpec.from_dict(data, source="c.yaml")
    assert caplog.text.count("bandwidth_gbps is read as GB/s") == 1


@pytest.mark.parametrize("keys", [("bandwidth_GBps", "bandwidth_Gbps"), ("bandwidth_GBps", "bandwidth_gbps"),
                                  ("bandwidth_Gbps", "bandwidth_gbps")])
def test_two_keys_for_one_bandwidth_are_refused(keys):
    with pytest.raises(SpecError) as e:
        ClusterSpec.from_dict(cluster({k: 10 for k in keys}), source="c.yaml")
    text = str(e.value)
    assert "c.yaml" in text and "network.default" in text and "two keys" in text
    assert "bandwidth_GBps (gigabytes/s) or bandwidth_Gbps (gigabits/s)" in text


def test_bad_gigabit_value_names_its_key():
    with pytest.raises(SpecError, match=r"network\.default\.bandwidth_Gbps"):
        ClusterSpec.from_dict(cluster({"bandwidth_Gbps": "fast"}))


def test_written_cluster_uses_the_gigabyte_keys():
    d = ClusterSpec.from_dict(cluster({"bandwidth_Gbps": 200})).to_dict()
    assert d["network"]["default"] == {"bandwidth_GBps": 25.0, "latency_us": 5.0}
    assert {"memory_bandwidth_GBps", "intra_node_bandwidth_GBps"} <= set(d["nodes"][0]["gpus"][0])
    assert "gbps" not in repr(d)


@settings(max_examples=60, deadline=None)
@given(bytes_per_s=st.floats(min_value=1e6, max_value=1e13, allow_nan=False),
       key=st.sampled_from(["bandwidth_GBps", "bandwidth_Gbps", "bandwidth_gbps"]))
def test_bandwidth_round_trips_in_bytes_per_second(bytes_per_s, key):
    """Written in any unit, read, written and read again: the same bytes per second."""
    value = bytes_per_s / GIGA * (8 if key == "bandwidth_Gbps" else 1)
    first = ClusterSpec.from_dict(cluster({key: value}))
    assert first.default_link.bandwidth_GBps * GIGA == pytest.approx(bytes_per_s, rel=1e-12)
    again = ClusterSpec.from_dict(first.to_dict())
    assert again.default_link.bandwidth_GBps * GIGA == first.default_link.bandwidth_GBps * GIGA


# --- GPU names ----------------------------------------------------------------------------------------------------

def gpu_error(name: str, *, listed: bool = False) -> str:
    node = {"name": "n0", "gpus": [{"type": name}]} if listed else {"name": "n0", "gpu": name, "count": 2}
    with pytest.raises(SpecError) as e:
        ClusterSpec.from_dict({"nodes": [node]}, source="c.yaml")
    return str(e.value)


def test_unknown_gpu_names_the_key_the_user_wrote():
    assert "field 'nodes[0] (n0).gpu'" in gpu_error("quantum-9000")
    assert "field 'nodes[0] (n0).gpus[0].type'" in gpu_error("quantum-9000", listed=True)


def test_unknown_gpu_hints_at_explicit_figures():
    text = gpu_error("quantum-9000")
    assert "'gpu: custom'" in text
    for figure in ("tflops", "memory_gib", "memory_bandwidth_GBps", "intra_node_bandwidth_GBps"):
        assert figure in text


def test_a_near_name_is_a_suggestion_not_a_match():
    text = gpu_error("h800")
    assert "not in the catalog: did you mean 'h200'? (the closest spelling, a suggestion, not a match" in text


def test_a_bare_memory_size_is_ambiguous_not_matched():
    text = gpu_error("a100-80g")
    assert "'a100-80g' is ambiguous" in text and "a100-80gb or a100-pcie-80gb" in text
    assert "a suggestion, not a match" in text


@pytest.mark.parametrize("name, canonical", [("a100-80gb", "a100-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                             ("A100 80GiB PCIe", "a100-pcie-80gb"), ("h100", "h100-sxm")])
def test_catalog_spellings_still_resolve(name, canonical):
    c = ClusterSpec.from_dict({"nodes": [{"name": "n0", "gpu": name, "count": 1}]})
    assert c.nodes[0].gpus[0].type == canonical


def test_custom_gpu_with_figures_in_either_unit():
    c = ClusterSpec.from_dict({"nodes": [{"name": "n0", "gpu": "custom", "count": 1, "tflops": {"bf16": 700},
                                          "memory_gib": 80, "memory_bandwidth_GBps": 3000,
                                          "intra_node_bandwidth_Gbps": 3200}]})
    g = c.nodes[0].gpus[0]
    assert (g.type, g.memory_bandwidth_GBps, g.intra_node_bandwidth_GBps) == ("custom", 3000, 400)


@pytest.mark.parametrize("key, value", [("bandwidth_gbps", 25), ("bandwidth_Gbps", 200)])
def test_the_cluster_hash_does_not_depend_on_how_the_unit_is_spelled(key, value):
    """Plans record their cluster's hash: one made before the keys spelled their unit still matches."""
    new = ClusterSpec.from_dict(cluster({"bandwidth_GBps": 25}, intra_node_bandwidth_GBps=300))
    other = ClusterSpec.from_dict(cluster({key: value}, intra_node_bandwidth_gbps=300))
    assert new.content_hash() == other.content_hash()
    assert new.content_hash() != ClusterSpec.from_dict(cluster({"bandwidth_GBps": 26})).content_hash()
