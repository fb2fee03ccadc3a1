"""allocation.LinkModel's ``like``: a model of another micro-batch size's activations that shares the first one's
network and node-pair terms gives every floor bit for bit as a model built on its own, whichever asked first."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.planner.allocation import LinkModel
from tangram_launch.specs.cluster import ClusterSpec


def _cluster(n: int, fabrics: list, gpus: list[int]) -> ClusterSpec:
    names = [f"n{i}" for i in range(n)]
    net = {"default": {"bandwidth_GBps": 6.25, "latency_us": 20},
           "fabrics": [{"name": f"f{k}", "nodes": [names[i] for i in sorted(nodes)], "bandwidth_GBps": bw,
                        "latency_us": lat} for k, (nodes, bw, lat) in enumerate(fabrics)]}
    return ClusterSpec.from_dict({"name": "gen", "network": net, "nodes": [
        {"name": x, "gpu": "a100-80gb", "count": gpus[i % len(gpus)]} for i, x in enumerate(names)]})


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 7).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.sets(st.integers(0, n - 1), min_size=2), st.sampled_from([12.5, 25.0, 50.0]),
                       st.sampled_from([1.0, 5.0])), max_size=3),
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3),
    st.lists(st.tuples(st.sets(st.integers(0, n - 1), min_size=1), st.sets(st.integers(0, n - 1), min_size=1)),
             min_size=1, max_size=4),
    st.lists(st.sampled_from([0.0, 1.0e3, 1.0e6, 5.0e8, 3.3e9]), min_size=2, max_size=4))))
def test_a_model_sharing_another_sizes_terms_gives_the_floors_of_a_fresh_one(case):
    n, fabrics, gpus, sets, act_bytes = case
    cluster = _cluster(n, fabrics, gpus)
    pairs = [(frozenset(f"n{i}" for i in a), frozenset(f"n{i}" for i in b)) for a, b in sets]
    first = LinkModel(cluster, [], act_bytes[0])
    for a, b in pairs[:1]:  # the first model has seen some pairs, not all, when the others share its terms
        first.nodes_s(a, b)
    for act in act_bytes[1:]:
        shared, fresh = LinkModel(cluster, [], act, like=first), LinkModel(cluster, [], act)
        for a, b in pairs:
            assert shared.nodes_s(a, b) == fresh.nodes_s(a, b)
            assert shared.nodes_s(b, a) == fresh.nodes_s(b, a)
    for a, b in pairs:
        assert first.nodes_s(a, b) == LinkModel(cluster, [], act_bytes[0]).nodes_s(a, b)
