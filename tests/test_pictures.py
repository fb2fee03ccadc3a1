"""The pictures at scale: islands of identical nodes drawn as ranges, timelines of the schedule a plan runs, link
labels on their arcs."""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.interleaved_schedule import simulate_interleaved_1f1b, simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import pipeline_latency_s
from tangram_launch.draw import Curve, Rect, Text, islands_items, schedule_blocks, timeline_items
from tangram_launch.islands import build_islands
from tangram_launch.plan import Plan
from tangram_launch.specs.cluster import ClusterSpec

from conftest import CLUSTERS

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "plans")
MAX_PX = 1600
GPU_SQUARE = 18.0


@functools.cache  # the pictures' items are only read: two tests draw the 4,096-GPU cluster
def _picture(name: str):
    cluster = ClusterSpec.load(os.path.join(CLUSTERS, f"{name}.yaml"))
    iset = build_islands(cluster)
    return cluster, iset, islands_items(cluster, iset)


def _node_boxes(items) -> list[Rect]:
    return [it for it in items if isinstance(it, Rect) and it.fill == "white" and it.rx == 5]


def _gpu_squares(items) -> list[Rect]:
    return [it for it in items if isinstance(it, Rect) and it.w == GPU_SQUARE and it.h == GPU_SQUARE]


def test_the_4096_gpu_islands_picture_is_bounded_with_one_box_per_group_of_nodes():
    cluster, iset, (items, width, height) = _picture("llama3-405b-4096gpu")
    assert width <= MAX_PX and height <= MAX_PX, (width, height)
    assert len(iset.islands) == 8 and len(cluster.nodes) == 512
    boxes = _node_boxes(items)
    assert len(boxes) == 8  # one per pod of 64 alike nodes, not 512
    assert len(_gpu_squares(items)) == 8 * 8  # one node's GPUs per box
    texts = [it.text for it in items if isinstance(it, Text)]
    assert "h100-[0-63]" in texts and "64 nodes alike, 900 GB/s intra-node" in texts
    # the 28 island pairs share one link: said once, no arcs
    assert not [it for it in items if isinstance(it, Curve)]
    assert "every pair of islands: 12.5 GB/s, 10 us (their slowest node pair)" in texts
    assert texts[0] == "llama3-405b-4096gpu: 4096 GPUs in 8 islands"
    assert "and 16 pairs more (tangram-launch islands lists them all)" in texts


def test_every_node_box_stays_inside_the_picture():
    for name in ("llama3-405b-4096gpu", "c3-4-islands-20gpu", "opt350m-512gpu"):
        _, _, (items, width, height) = _picture(name)
        for box in _node_boxes(items) + _gpu_squares(items):
            assert 0 <= box.x and box.x + box.w <= width and 0 <= box.y and box.y + box.h <= height, (name, box)


def test_a_single_node_keeps_its_own_name_and_gpus():
    _, _, (items, _, _) = _picture("c3-full-het-iii")
    texts = [it.text for it in items if isinstance(it, Text)]
    assert "a100-0 (600 GB/s intra-node)" in texts
    assert len(_node_boxes(items)) == 3 and len(_gpu_squares(items)) == 16


def test_a_cpu_cluster_is_drawn_as_cpu_processes():
    _, _, (items, _, _) = _picture("cpu-2")
    texts = [it.text for it in items if isinstance(it, Text)]
    assert texts[0] == "cpu-2: 2 CPU processes in 1 island"
    assert not any("GPU" in t for t in texts)


@pytest.mark.parametrize("name", ["c3-full-het-iii", "c3-4-islands-20gpu", "c2-modern-het"])
def test_link_labels_sit_on_their_arcs_apexes_in_rows_of_their_own(name):
    _, _, (items, _, _) = _picture(name)
    curves = [it for it in items if isinstance(it, Curve)]
    labels = [it for it in items if isinstance(it, Text) and re.fullmatch(r"[\d.]+ GB/s, [\d.]+ us", it.text)]
    assert len(labels) == len(curves) > 0
    for c, lb in zip(curves, labels):
        apex_x, apex_y = (c.x1 + c.x2) / 2, (c.y1 + c.cy) / 2  # a quadratic's midpoint is halfway to its pull
        assert lb.x == pytest.approx(apex_x)
        assert 0 < apex_y - lb.y <= 8, (c, lb)  # the label's baseline just above the apex it names
    # an arc that spans another rises above that arc's label: the two labels are in different rows
    for a, la in zip(curves, labels):
        for b, lb in zip(curves, labels):
            if a is not b and a.x1 < b.x1 and b.x2 < a.x2:
                assert la.y < lb.y - 12, (a, b)


def _fixture(name: str) -> Plan:
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        return Plan.from_dict(json.load(f))


def _bars_end(items) -> float:
    """Where the drawn bars end, in seconds, read back from the blocks' tooltips and the DP sync bars."""
    ends = [float(m.group(1)) for it in items if isinstance(it, Rect)
            for m in [re.search(r"-([0-9.]+) s$", it.title)] if m]
    tail = [float(re.search(r"optimizer ([0-9.]+) s", it.title).group(1)) for it in items
            if isinstance(it, Rect) and it.title.startswith("DP sync")]
    return max(ends) + (tail[0] if tail else 0.0)


PLAIN = sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json") and _fixture(f[:-5]).virtual_stages == 1)
INTERLEAVED = sorted(f[:-5] for f in os.listdir(FIXTURES)
                     if f.endswith(".json") and _fixture(f[:-5]).virtual_stages > 1)


@pytest.mark.parametrize("name", PLAIN)
def test_a_1f1b_timeline_ends_at_its_titles_figure(name):
    plan = _fixture(name)
    items, _, _ = timeline_items(plan)
    assert _bars_end(items) == pytest.approx(plan.predicted.iteration_time_s, abs=1e-3)
    title = next(it.text for it in items if isinstance(it, Text) and " iteration " in it.text)
    assert f"predicted 1F1B iteration {plan.predicted.iteration_time_s:.3f} s" in title


def _last_bar_px(items) -> float:
    """Where the rightmost block or DP sync bar ends, in pixels."""
    return max(it.x + it.w for it in items if isinstance(it, Rect)
               and re.match(r"(stage \d+ (forward|backward)|DP sync)", it.title))


def _assert_bars_end_at_the_title(plan: Plan) -> None:
    """The drawn schedule ends at the plan's predicted iteration: to the bit in seconds (its blocks + the tail), to
    float rounding in pixels, and the title and note say so."""
    items, width, _ = timeline_items(plan)
    tail = plan.predicted.breakdown["tail_s"]
    pred = plan.predicted.iteration_time_s
    assert max(b.end_s for b in schedule_blocks(plan)) + tail == pred
    right = 30.0  # timeline_items' right margin: the plot spans the predicted iteration
    assert _last_bar_px(items) == pytest.approx(width - right, abs=1e-6)
    texts = [it.text for it in items if isinstance(it, Text)]
    title = next(t for t in texts if " iteration " in t)
    assert f"iteration {pred:.3f} s" in title
    note = next(t for t in texts if t.startswith("bars: "))
    assert f"ends at {pred:.3f} s" in note and "is not this simulation" not in note


@pytest.mark.parametrize("name", INTERLEAVED)
def test_an_interleaved_timeline_draws_every_chunk_and_ends_at_its_titles_figure(name):
    plan = _fixture(name)
    S, m, v = plan.num_stages, plan.num_microbatches, plan.virtual_stages
    items, _, _ = timeline_items(plan)
    blocks = [it for it in items if isinstance(it, Rect) and re.match(r"stage \d+ (forward|backward) chunk", it.title)]
    assert len(blocks) == 2 * S * m * v
    assert {int(re.search(r"chunk (\d+)", b.title).group(1)) for b in blocks} == set(range(v))
    note = next(it.text for it in items if isinstance(it, Text) and it.text.startswith("bars: "))
    assert note.startswith(f"bars: the simulated interleaved 1F1B schedule the prediction comes from, {v} chunks "
                           "per stage")
    _assert_bars_end_at_the_title(plan)


_TIMES = st.floats(0.0, 3.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_bars_end_at_the_title_for_any_stage_timings(data):
    """Any stage times and links on an interleaved example plan's shape, predicted as build_plan predicts (its
    choice's simulation + the tail): the picture ends at the title's figure."""
    plan = _fixture(INTERLEAVED[0])
    S, m, v = plan.num_stages, plan.num_microbatches, plan.virtual_stages
    fwd = data.draw(st.lists(st.floats(0.01, 3.0), min_size=S, max_size=S))
    bwd = data.draw(st.lists(_TIMES, min_size=S, max_size=S))
    p2p = data.draw(st.lists(st.floats(0.0, 0.5), min_size=S - 1, max_size=S - 1))
    tail = data.draw(st.floats(0.0, 1.0))
    pred = simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v) + tail
    stages = tuple(replace(p, forward_s=f, backward_s=b) for p, f, b in zip(plan.predicted.stages, fwd, bwd))
    predicted = replace(plan.predicted, iteration_time_s=pred, stages=stages,
                        breakdown={**plan.predicted.breakdown, "tail_s": tail})
    _assert_bars_end_at_the_title(replace(plan, predicted=predicted, planner={**plan.planner, "p2p_s": p2p}))


def test_a_plan_predicted_otherwise_gets_the_gap_to_its_bars():
    """A hand-written or older plan whose prediction is not the simulation of its schedule: the note says by how
    much the bars differ."""
    plan = _fixture(INTERLEAVED[0])
    drawn = max(b.end_s for b in schedule_blocks(plan)) + plan.predicted.breakdown["tail_s"]
    older = replace(plan, predicted=replace(plan.predicted, iteration_time_s=drawn * 0.9))
    note = next(it.text for it in timeline_items(older)[0] if isinstance(it, Text) and it.text.startswith("bars: "))
    assert note.endswith(f"ends at {drawn:.3f} s · the plan's prediction {drawn * 0.9:.3f} s is not this simulation "
                         f"({(drawn - drawn * 0.9) / (drawn * 0.9) * 100:+.1f} %)")


@pytest.mark.parametrize("S, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 9, 3), (2, 16, 8), (4, 4, 2)])
def test_the_interleaved_simulation_of_equal_stages_is_the_closed_form(S, m, v):
    f, b = 0.3, 0.7
    end = max(x.end_s for x in simulate_interleaved_1f1b([f] * S, [b] * S, [0.0] * (S - 1), m, v))
    assert end == pytest.approx(pipeline_latency_s(m, f + b, S * (f + b), 0.0, v), rel=1e-12)


def test_the_interleaved_simulation_keeps_each_rank_busy_with_one_chunk_at_a_time_in_order():
    f, b, p2p, m, v = [0.2, 0.5, 0.3], [0.4, 1.0, 0.6], [0.05, 0.02], 6, 2
    blocks = simulate_interleaved_1f1b(f, b, p2p, m, v)
    assert len(blocks) == 2 * 3 * m * v
    at = {(x.kind, x.stage, x.chunk, x.micro): x for x in blocks}
    for k in range(3):
        mine = sorted((x for x in blocks if x.stage == k), key=lambda x: x.start_s)
        assert all(a.end_s <= c.start_s + 1e-12 for a, c in zip(mine, mine[1:]))
    for i in range(m):
        for c in range(v):
            for k in range(1, 3):
                assert at[("F", k, c, i)].start_s >= at[("F", k - 1, c, i)].end_s + p2p[k - 1] - 1e-12
                assert at[("B", k - 1, c, i)].start_s >= at[("B", k, c, i)].end_s + p2p[k - 1] - 1e-12
            if c:
                assert at[("F", 0, c, i)].start_s >= at[("F", 2, c - 1, i)].end_s - 1e-12
        assert at[("B", 2, v - 1, i)].start_s >= at[("F", 2, v - 1, i)].end_s - 1e-12
