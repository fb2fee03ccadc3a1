"""A node's host memory bounds optimizer offload (costmodel/host_memory.py): ``host_memory_gib`` in the cluster file,
one rule for the planner's search, hand-written plans and ``tangram-launch estimate --offload``, and unknown host
memory changes nothing."""
from __future__ import annotations

import pytest
import yaml

from tangram_launch.errors import SpecError
from tangram_launch.islands import build_islands
from tangram_launch.specs.cluster import ClusterSpec, NodeHostMemory


def _cluster(count: int, host_memory_gib: float | None) -> ClusterSpec:
    node = {"name": "n0", "gpu": "h100-sxm", "count": count}
    if host_memory_gib is not None:
        node["host_memory_gib"] = host_memory_gib
    return ClusterSpec.from_dict({"name": f"h100x{count}", "nodes": [node]})


# --- the cluster file -------------------------------------------------------------------------------------------
def test_host_memory_round_trips_through_the_cluster_yaml(tmp_path):
    c = _cluster(8, 1536)
    assert c.nodes[0].host_memory_gib == 1536.0
    assert c.nodes[0].host_memory() == NodeHostMemory("n0", 1536.0, 8)
    c.dump(tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["nodes"][0]["host_memory_gib"] == 1536.0
    again = ClusterSpec.load(tmp_path / "c.yaml")
    assert again.to_dict() == c.to_dict() and again.nodes[0].host_memory_gib == 1536.0
    assert again.content_hash() == c.content_hash() != _cluster(8, 768).content_hash()


def test_absent_host_memory_is_unknown_and_leaves_the_file_as_it_was():
    c = _cluster(8, None)
    assert c.nodes[0].host_memory_gib is None and c.nodes[0].host_memory() is None
    assert "host_memory_gib" not in c.to_dict()["nodes"][0]
    assert build_islands(c).islands[0].host_memory is None


@pytest.mark.parametrize("bad", [-64, 0, "lots", True, float("nan")])
def test_a_bad_host_memory_is_refused_naming_the_field_the_value_and_what_is_valid(bad):
    with pytest.raises(SpecError) as err:
        _cluster(8, bad)
    assert err.value.field == "nodes[0] (n0).host_memory_gib"
    assert repr(bad) in str(err.value) and "a number > 0" in str(err.value)


def test_an_island_is_bounded_by_its_node_with_the_least_host_memory_per_gpu():
    c = ClusterSpec.from_dict({"name": "two", "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
                               "nodes": [{"name": "big", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 2048},
                                         {"name": "small", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 512},
                                         {"name": "unknown", "gpu": "h100-sxm", "count": 8}]})
    (isl,) = build_islands(c).islands
    assert isl.host_memory == NodeHostMemory("small", 512.0, 8)
