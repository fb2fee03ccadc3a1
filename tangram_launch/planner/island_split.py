"""One island, two slices: split an island the best plan uses only in part into its used and its idle nodes.

The composer gives each island one slice, and a slice's pipeline stages all have the same width (tp x dp x cp GPUs),
so an island whose GPU count no such plan fills leaves whole nodes idle (e.g. 96 V100s where the micro-batch's 32
sequences cap dp at 32: one stage of 64). Two islands of the same GPUs can hold two slices of different widths, a
layer on the 32 idle GPUs and two on the 64. ``split_idle`` builds that island set from the plan; the search
(plan_search.search) plans on it once more and keeps the faster plan. Each part keeps its island's GPU figures and
inter-node link (a part on one node has none). ``in_pipeline_order`` then lays the parts out again so that the part
the pipeline reaches first holds the island's first nodes: the GPUs a hand-written plan naming the island twice
gets (planner/manual.py places consecutive stages on an island in node order).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from tangram_launch.islands import IslandSet

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.plan import Plan

PART_SUFFIXES = (".a", ".b")  # split_idle: used, idle nodes; in_pipeline_order: first, second in the pipeline


def _parts(iset: IslandSet, nodes_of_part: dict[str, list[tuple[str, ...]]]) -> tuple[IslandSet, dict[str, list[str]]]:
    """``iset`` with each island named in ``nodes_of_part`` replaced by its parts, named name + ".a", ".b"."""
    islands, parts = [], {}
    for isl in iset.islands:
        if isl.name not in nodes_of_part:
            islands.append(isl)
            continue
        # a part reaches the other part over the island's own links, the rest of the cluster as the island does
        egress = min((link for link in (isl.egress_link, isl.inter_node_link) if link is not None),
                     key=lambda link: (link.bandwidth_GBps, -link.latency_us), default=None)
        pair = [replace(isl, name=isl.name + suffix, nodes=nodes, gpus=tuple(g for g in isl.gpus if g.node in nodes),
                        inter_node_link=isl.inter_node_link if len(nodes) > 1 else None, egress_link=egress)
                for suffix, nodes in zip(PART_SUFFIXES, nodes_of_part[isl.name])]
        islands += pair
        parts[isl.name] = [p.name for p in pair]
    return IslandSet(tuple(islands), iset.separations, iset.tolerances), parts


def split_idle(iset: IslandSet, plan: "Plan") -> tuple[IslandSet, dict[str, list[str]]] | None:
    """``iset`` with every island that ``plan`` uses but leaves at least one whole node of idle replaced by two
    islands, its used nodes (name + ".a") and its idle nodes (name + ".b"); and which island became which parts.
    None when no island has an idle node beside used ones."""
    used_nodes: dict[str, set[str]] = {}
    for s in plan.stages:
        used_nodes.setdefault(s.island, set()).update(node for node, _ in s.gpus)
    nodes_of_part = {}
    for isl in iset.islands:
        used = used_nodes.get(isl.name, set())
        idle = tuple(n for n in isl.nodes if n not in used)
        if used and idle:
            nodes_of_part[isl.name] = [tuple(n for n in isl.nodes if n in used), idle]
    return _parts(iset, nodes_of_part) if nodes_of_part else None


def in_pipeline_order(iset: IslandSet, split: IslandSet, parts: dict[str, list[str]],
                      plan: "Plan") -> tuple[IslandSet, dict[str, list[str]]] | None:
    """The islands of ``iset`` (as built) split again into parts of the node counts ``split`` gave them, the part
    that ``plan``'s earlier stage uses on the island's first nodes; None when ``split`` has them so already."""
    first_stage: dict[str, int] = {}
    for st in plan.stages:
        first_stage.setdefault(st.island, st.index)
    nodes_of_part, moved = {}, False
    for isl in iset.islands:
        pair = parts.get(isl.name)
        if pair is None:
            continue
        first = min(pair, key=lambda p: first_stage.get(p, len(plan.stages)))
        n_first = split.by_name(first).num_nodes
        nodes_of_part[isl.name] = [isl.nodes[:n_first], isl.nodes[n_first:]]
        moved |= split.by_name(first).nodes != isl.nodes[:n_first]
    return _parts(iset, nodes_of_part) if moved else None
