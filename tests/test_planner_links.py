"""allocation.LinkModel: the links between two node sets, from one pair per class of alike pairs, are the links of
every pair (ClusterSpec.link: pair override, else the fastest shared fabric, else the default)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.planner.allocation import LinkModel
from tangram_launch.specs.cluster import ClusterSpec


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.integers(2, 9).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.sets(st.integers(0, n - 1), min_size=2), st.sampled_from([12.5, 25.0, 50.0]),
                       st.sampled_from([1.0, 5.0])), max_size=3),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.sampled_from([1.0, 100.0])), max_size=2),
    st.sets(st.integers(0, n - 1), min_size=1), st.sets(st.integers(0, n - 1), min_size=1),
    st.sampled_from([1.0e6, 5.0e8]))))
def test_representative_pairs_give_the_links_of_every_pair(case):
    n, fabrics, pairs, a, b, act_bytes = case
    names = [f"n{i}" for i in range(n)]
    net = {"default": {"bandwidth_GBps": 6.25, "latency_us": 20},
           "fabrics": [{"name": f"f{k}", "nodes": [names[i] for i in sorted(nodes)], "bandwidth_GBps": bw,
                        "latency_us": lat} for k, (nodes, bw, lat) in enumerate(fabrics)],
           "pairs": [{"nodes": [names[i], names[j]], "bandwidth_GBps": bw, "latency_us": 3}
                     for i, j, bw in {(min(i, j), max(i, j), bw) for i, j, bw in pairs if i != j}]}
    # pairs with the same two nodes twice would be a spec error: keep the first of each
    seen, kept = set(), []
    for p in net["pairs"]:
        key = frozenset(p["nodes"])
        if key not in seen:
            seen.add(key)
            kept.append(p)
    net["pairs"] = kept
    cluster = ClusterSpec.from_dict({"name": "gen", "network": net,
                                     "nodes": [{"name": x, "gpu": "a100-80gb", "count": 2} for x in names]})
    links = LinkModel(cluster, [], act_bytes)
    nodes_a, nodes_b = [names[i] for i in a], [names[i] for i in b]
    every = {links.net.link(x, y) for x in nodes_a for y in nodes_b if x != y}
    assert links.pair_links(frozenset(nodes_a), frozenset(nodes_b)) == every
