"""Pictures of a plan and of a cluster's islands, as SVG written by hand (no dependency), or PNG with matplotlib.

    draw_timeline(plan, "plan.svg")                 # the schedule the plan runs (1F1B or interleaved): a row per stage
    draw_islands(cluster, island_set, "c3.svg")     # nodes grouped into islands, with their links

Both build a list of primitives (rectangles, lines, text) once and hand it to a writer: ``.svg`` needs nothing,
``.png`` needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence
from xml.sax.saxutils import escape

from tangram_launch.costmodel.interleaved_schedule import simulate_interleaved_1f1b
from tangram_launch.costmodel.blocks import Block
from tangram_launch.costmodel.pipeline import simulate_1f1b
from tangram_launch.errors import SpecError
from tangram_launch.specs.yamlio import dump_text_file
from tangram_launch.text import devices, on_cpu, plural

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import IslandSet
    from tangram_launch.plan import Plan
    from tangram_launch.specs.cluster import ClusterSpec

# colour-blind-safe palette (Okabe & Ito 2008), one colour per island
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str = "none"
    opacity: float = 1.0
    rx: float = 0.0
    title: str = ""


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = "#333"
    width: float = 1.0
    dash: str = ""


@dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    size: float = 12.0
    anchor: str = "start"  # start | middle | end
    fill: str = "#222"
    bold: bool = False


@dataclass(frozen=True)
class Curve:
    """A quadratic curve from (x1, y1) to (x2, y2) pulled towards (cx, cy)."""

    x1: float
    y1: float
    cx: float
    cy: float
    x2: float
    y2: float
    stroke: str = "#555"
    width: float = 1.5
    dash: str = ""


def _shade(hex_colour: str, factor: float) -> str:
    """Lighter (factor > 0, towards white) or darker (factor < 0, towards black) version of a colour."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    if factor >= 0:
        r, g, b = (int(c + (255 - c) * factor) for c in (r, g, b))
    else:
        r, g, b = (int(c * (1 + factor)) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


# --- writers -------------------------------------------------------------------------------------------------------

def _write_svg(items: Sequence, width: float, height: float, path: str) -> None:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}">',
           f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="white"/>']
    for it in items:
        if isinstance(it, Rect):
            attrs = (f'x="{it.x:.2f}" y="{it.y:.2f}" width="{max(it.w, 0):.2f}" height="{it.h:.2f}" '
                     f'fill="{it.fill}"')
            if it.stroke != "none":
                attrs += f' stroke="{it.stroke}" stroke-width="1"'
            if it.opacity < 1:
                attrs += f' fill-opacity="{it.opacity:.2f}"'
            if it.rx:
                attrs += f' rx="{it.rx:.1f}"'
            if it.title:
                out.append(f"<rect {attrs}><title>{escape(it.title)}</title></rect>")
            else:
                out.append(f"<rect {attrs}/>")
        elif isinstance(it, Line):
            dash = f' stroke-dasharray="{it.dash}"' if it.dash else ""
            out.append(f'<line x1="{it.x1:.2f}" y1="{it.y1:.2f}" x2="{it.x2:.2f}" y2="{it.y2:.2f}" '
                       f'stroke="{it.stroke}" stroke-width="{it.width}"{dash}/>')
        elif isinstance(it, Curve):
            dash = f' stroke-dasharray="{it.dash}"' if it.dash else ""
            out.append(f'<path d="M {it.x1:.1f} {it.y1:.1f} Q {it.cx:.1f} {it.cy:.1f} {it.x2:.1f} {it.y2:.1f}" '
                       f'fill="none" stroke="{it.stroke}" stroke-width="{it.width}"{dash}/>')
        elif isinstance(it, Text):
            weight = ' font-weight="bold"' if it.bold else ""
            out.append(f'<text x="{it.x:.1f}" y="{it.y:.1f}" font-size="{it.size:.1f}" text-anchor="{it.anchor}" '
                       f'fill="{it.fill}"{weight}>{escape(it.text)}</text>')
    out.append("</svg>")
    dump_text_file("\n".join(out) + "\n", path)


def check_picture_path(path: str | os.PathLike, field: str = "output") -> str:
    """The picture's absolute path, or a SpecError naming ``field`` (the option that gave it): an unknown extension,
    or .png without matplotlib. Commands call it before their work, so a bad name fails at once."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".svg", ".png"):
        raise SpecError("unknown picture format", field=field, value=path, valid=".svg or .png")
    if ext == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SpecError("drawing PNG needs matplotlib (pip install matplotlib)", field=field, value=path,
                            valid="a .svg file name, or install matplotlib") from None
    return os.path.abspath(path)


def _write_png(items: Sequence, width: float, height: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, PathPatch
    from matplotlib.path import Path

    dpi = 100
    fig = plt.figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    anchors = {"start": "left", "middle": "center", "end": "right"}
    for it in items:
        if isinstance(it, Rect):
            ax.add_patch(FancyBboxPatch((it.x, it.y), max(it.w, 0), it.h, boxstyle=f"round,pad=0,rounding_size={it.rx}",
                                        facecolor=it.fill, edgecolor=None if it.stroke == "none" else it.stroke,
                                        linewidth=0 if it.stroke == "none" else 1, alpha=it.opacity))
        elif isinstance(it, Line):
            ax.plot([it.x1, it.x2], [it.y1, it.y2], color=it.stroke, linewidth=it.width * 0.75,
                    linestyle="--" if it.dash else "-")
        elif isinstance(it, Curve):
            p = Path([(it.x1, it.y1), (it.cx, it.cy), (it.x2, it.y2)], [Path.MOVETO, Path.CURVE3, Path.CURVE3])
            ax.add_patch(PathPatch(p, fill=False, edgecolor=it.stroke, linewidth=it.width * 0.75,
                                   linestyle="--" if it.dash else "-"))
        elif isinstance(it, Text):
            ax.text(it.x, it.y, it.text, fontsize=it.size * 0.75, ha=anchors[it.anchor], va="baseline",
                    color=it.fill, fontweight="bold" if it.bold else "normal")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _write(items: Sequence, width: float, height: float, path: str | os.PathLike, field: str) -> str:
    """Write the picture; returns its absolute path (what the commands report)."""
    where = check_picture_path(path, field)
    if where.lower().endswith(".svg"):
        _write_svg(items, width, height, where)
    else:
        _write_png(items, width, height, where)
    return where


# --- the 1F1B timeline ------------------------------------------------------------------------------------------------

def _nice_step(span: float, target: int = 8) -> float:
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for f in (1, 2, 2.5, 5, 10):
        if raw <= f * mag:
            return f * mag
    return 10 * mag


def schedule_note(plan: "Plan", drawn_end_s: float) -> str:
    """What the bars show: the schedule the plan runs, simulated. A plan's prediction is this very simulation
    (costmodel.pipeline for 1F1B, costmodel.interleaved_schedule chunk by chunk for interleaved 1F1B), so the bars
    end at the title's figure; a plan predicted otherwise (hand-written, or by an older planner) gets the gap."""
    pred = plan.predicted.iteration_time_s
    if plan.virtual_stages > 1:
        note = (f"bars: the simulated interleaved 1F1B schedule the prediction comes from, {plan.virtual_stages} "
                f"chunks per stage, ends at {drawn_end_s:.3f} s")
    else:
        note = f"bars: the simulated 1F1B schedule the prediction comes from, ends at {drawn_end_s:.3f} s"
    if pred > 0 and abs(drawn_end_s - pred) > 1e-9 * pred:
        gap = (drawn_end_s - pred) / pred * 100
        note += f" · the plan's prediction {pred:.3f} s is not this simulation ({gap:+.1f} %)"
    return note


def schedule_blocks(plan: "Plan") -> list[Block]:
    """The blocks of the schedule the plan runs: plain 1F1B, or interleaved 1F1B chunk by chunk."""
    fwd = [p.forward_s for p in plan.predicted.stages]
    bwd = [p.backward_s for p in plan.predicted.stages]
    p2p = list(plan.planner.get("p2p_s") or [0.0] * (len(fwd) - 1))
    if len(p2p) != len(fwd) - 1:
        p2p = [0.0] * (len(fwd) - 1)
    if plan.virtual_stages > 1:
        return simulate_interleaved_1f1b(fwd, bwd, p2p, plan.num_microbatches, plan.virtual_stages)
    return simulate_1f1b(fwd, bwd, p2p, plan.num_microbatches)


def timeline_items(plan: "Plan", *, width: float = 1400.0) -> tuple[list, float, float]:
    S = plan.num_stages
    m = plan.num_microbatches
    v = plan.virtual_stages
    fwd = [p.forward_s for p in plan.predicted.stages]
    p2p = list(plan.planner.get("p2p_s") or [0.0] * (S - 1))
    if len(p2p) != S - 1:
        p2p = [0.0] * (S - 1)
    blocks = schedule_blocks(plan)
    tail = float(plan.predicted.breakdown.get("tail_s", 0.0))
    pipe_end = max(b.end_s for b in blocks)
    total = max(pipe_end + tail, plan.predicted.iteration_time_s)
    islands = list(dict.fromkeys(s.island for s in plan.stages))
    colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(islands)}

    left, right, top, row_h, gap = 230.0, 30.0, 94.0, 30.0, 12.0
    plot_w = width - left - right
    scale = plot_w / total
    height = top + S * (row_h + gap) + 120.0
    items: list = []
    tr = plan.training
    pr = plan.predicted
    schedule = "interleaved 1F1B" if plan.virtual_stages > 1 else "1F1B"
    cpu = on_cpu(s.island for s in plan.stages)
    items.append(Text(left, 24, f"{plan.model.get('name')}: predicted {schedule} iteration {pr.iteration_time_s:.3f} s "
                                f"({plural(m, 'micro-batch', 'micro-batches')}, {plural(S, 'stage')}, "
                                f"{devices(plan.world_size, cpu=cpu)}, {tr.get('dtype')})", 15, bold=True))
    # one space between words: SVG collapses runs of spaces, so separators carry the spacing
    items.append(Text(left, 44, f"tokens/s {pr.tokens_per_s:,.0f} · MFU {pr.mfu * 100:.1f} % · "
                                f"gaps are the pipeline bubble and p2p · DP sync + optimizer at the end", 12,
                      fill="#555"))
    items.append(Text(left, 60, schedule_note(plan, pipe_end + tail), 12, fill="#555"))
    # time axis
    step = _nice_step(total)
    axis_y = top - 10
    t = 0.0
    while t <= total + 1e-12:
        x = left + t * scale
        items.append(Line(x, axis_y, x, top + S * (row_h + gap) - gap, stroke="#e3e3e3", width=1))
        items.append(Text(x, axis_y - 4, f"{t:g} s" if step >= 0.01 else f"{t * 1e3:g} ms", 10, "middle", "#666"))
        t += step
    for k, s in enumerate(plan.stages):
        y = top + k * (row_h + gap)
        c = colour[s.island]
        items.append(Rect(left, y, plot_w, row_h, "#f4f4f4"))  # idle (bubble) background
        items.append(Text(left - 10, y + 13, f"stage {k}: {s.island}", 12, "end", c, bold=True))
        items.append(Text(left - 10, y + 26, f"layers {s.layers[0]}-{s.layers[1] - 1}, "
                                             f"{devices(s.num_gpus, cpu=cpu)} (tp{s.tp} dp{s.dp})", 10, "end", "#555"))
    show_numbers = min(fwd) / v * scale > 14
    for bl in blocks:
        y = top + bl.stage * (row_h + gap)
        c = colour[plan.stages[bl.stage].island]
        chunk = getattr(bl, "chunk", 0)
        # chunks of one stage from dark to light, forwards lighter than backwards
        fill = _shade(c, (0.45 if bl.kind == "F" else 0.0) + 0.3 * chunk / max(1, v - 1) * (1 if v > 1 else 0))
        x = left + bl.start_s * scale
        w = (bl.end_s - bl.start_s) * scale
        items.append(Rect(x, y, w, row_h, fill, stroke="white" if w > 3 else "none",
                          title=f"stage {bl.stage} {'forward' if bl.kind == 'F' else 'backward'} "
                                + (f"chunk {chunk} " if v > 1 else "")
                                + f"micro-batch {bl.micro}: {bl.start_s:.4f}-{bl.end_s:.4f} s"))
        if show_numbers:
            items.append(Text(x + w / 2, y + row_h / 2 + 4, str(bl.micro), 9, "middle",
                              "#222" if bl.kind == "F" else "white"))
    # p2p transfers: a dark band in the gap under the sending stage, for each forward and backward transfer
    for k in range(S - 1):
        if p2p[k] <= 0:
            continue
        y = top + k * (row_h + gap) + row_h + 2
        for bl in blocks:
            if bl.kind == "F" and bl.stage == k:
                items.append(Rect(left + bl.end_s * scale, y, max(p2p[k] * scale, 1.0), gap - 4, "#444",
                                  title=f"p2p stage {k}->{k + 1}: {p2p[k] * 1e3:.2f} ms"))
            elif bl.kind == "B" and bl.stage == k + 1:
                items.append(Rect(left + bl.end_s * scale, y, max(p2p[k] * scale, 1.0), gap - 4, "#999",
                                  title=f"p2p stage {k + 1}->{k}: {p2p[k] * 1e3:.2f} ms"))
    if tail > 0:
        for k in range(S):
            y = top + k * (row_h + gap)
            items.append(Rect(left + pipe_end * scale, y, tail * scale, row_h, "#bbbbbb",
                              title=f"DP sync + optimizer {tail:.4f} s"))
    # legend
    ly = top + S * (row_h + gap) + 24
    x = left
    for name in islands:
        items.append(Rect(x, ly - 11, 14, 14, _shade(colour[name], 0.45)))
        items.append(Rect(x + 14, ly - 11, 14, 14, colour[name]))
        items.append(Text(x + 34, ly, f"{name} (forward | backward)", 12))
        x += 40 + 7.2 * len(name) + 150
    ly += 24
    x = left
    for fill, label in (("#f4f4f4", "idle (pipeline bubble)"), ("#444", "p2p activations ->"),
                        ("#999", "p2p gradients <-"), ("#bbbbbb", "DP sync + optimizer step")):
        items.append(Rect(x, ly - 11, 28, 14, fill, stroke="#999"))
        items.append(Text(x + 34, ly, label, 12))
        x += 34 + 7.0 * len(label) + 30
    ly += 24
    bd = pr.breakdown
    if plan.virtual_stages > 1:
        line = (f"simulated pipeline {pipe_end:.3f} s + DP sync/optimizer {tail:.3f} s = {pipe_end + tail:.3f} s "
                f"· the closed form m x period + (fill - period) / v, v = {plan.virtual_stages}: "
                f"{bd.get('formula_s', pr.iteration_time_s):.3f} s")
    else:
        line = (f"simulated pipeline {pipe_end:.3f} s + DP sync/optimizer {tail:.3f} s = {pr.iteration_time_s:.3f} s "
                f"· the composer's closed-form bound: {bd.get('formula_s', pr.iteration_time_s):.3f} s")
    items.append(Text(left, ly, line, 11, fill="#555"))
    return items, width, height


def draw_timeline(plan: "Plan", path: str | os.PathLike, *, width: float = 1400.0, field: str = "output") -> str:
    """Draw the schedule the plan runs, 1F1B or interleaved (.svg, or .png with matplotlib); returns the path written.
    ``field`` names the option that gave ``path`` in errors."""
    items, w, h = timeline_items(plan, width=width)
    return _write(items, w, h, path, field)


# --- islands ----------------------------------------------------------------------------------------------------------

SLOW_LINK_GBPS = 10.0  # links between islands below this are drawn red and dashed
SLOW_LINK_COLOUR = "#c0392b"
LEGEND_Y = 52.0  # baseline of the islands picture's legend row
LABEL_H = 16.0  # height of a link label's box


def _label_width(label: str) -> float:
    return 6.4 * len(label) + 12  # 11 px sans-serif


def _curve_points(xa: float, xb: float, lift: float, n: int = 96) -> list[tuple[float, float]]:
    """Points of the arc from (xa, 0) to (xb, 0) pulled up towards ((xa + xb) / 2, -2 lift); its apex is at -lift."""
    cx, cy = (xa + xb) / 2, -2 * lift
    return [((1 - t) ** 2 * xa + 2 * (1 - t) * t * cx + t * t * xb, 2 * (1 - t) * t * cy)
            for t in (k / n for k in range(n + 1))]


def _inside(pt: tuple[float, float], box: tuple[float, float, float, float], margin: float = 2.0) -> bool:
    x, y = pt
    x0, y0, x1, y1 = box
    return x0 - margin <= x <= x1 + margin and y0 - margin <= y <= y1 + margin


def _below(pt: tuple[float, float], box: tuple[float, float, float, float], margin: float = 4.0) -> bool:
    """Whether the point is under the box's top edge (plus a margin) within its width."""
    x, y = pt
    return box[0] - margin <= x <= box[2] + margin and y > box[1] - margin


def _spans(outer: tuple[float, float], inner: tuple[float, float]) -> bool:
    return min(outer) <= min(inner) and max(inner) <= max(outer)


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place_arcs(arcs: Sequence[tuple[float, float, float]]) -> tuple[list[float], list[tuple]]:
    """Lift of each arc (xa, xb, label width) and its label box (x0, y0, x1, y1), in coordinates where the island
    boxes' top edge is y = 0 and up is negative: narrow arcs first, each raised in 6 px steps until its label (just
    above its apex) is crossed by no arc placed so far, overlaps no label, its own curve crosses no label, and it
    passes above the label of every arc it spans, so that nested arcs never cross and each label stands in its own
    row, on its arc's apex."""
    order = sorted(range(len(arcs)), key=lambda k: abs(arcs[k][1] - arcs[k][0]))
    lifts: list[float] = [0.0] * len(arcs)
    boxes: list[tuple] = [()] * len(arcs)
    placed: list[int] = []
    for k in order:
        xa, xb, w = arcs[k]
        lift = 26.0
        while True:
            mid = (xa + xb) / 2
            box = (mid - w / 2, -lift - 2 - LABEL_H, mid + w / 2, -lift - 2)
            curve = _curve_points(xa, xb, lift)
            clear = all(not _overlap(box, boxes[o]) for o in placed)
            clear = clear and not any(_inside(pt, box) for o in placed for pt in _curve_points(*arcs[o][:2],
                                                                                                 lifts[o]))
            clear = clear and not any(_inside(pt, boxes[o]) for o in placed for pt in curve)
            clear = clear and not any(_below(pt, boxes[o]) for o in placed if _spans((xa, xb), arcs[o][:2])
                                      for pt in curve)
            if clear or lift > 2000:
                break
            lift += 6.0
        lifts[k], boxes[k] = lift, box
        placed.append(k)
    return lifts, boxes


@dataclass(frozen=True)
class NodeGroup:
    """Consecutive nodes of an island that draw alike (GPU count, type, intra-node bandwidth, the GPUs the island
    holds): one box, named by their range ("h100-[0-63]")."""

    names: tuple[str, ...]
    num_gpus: int
    mine: frozenset[int]


def node_groups(cluster: "ClusterSpec", nodes: Sequence[str], gpus) -> list[NodeGroup]:
    """``nodes`` (in order) in runs that draw alike; ``gpus``: the island's GpuRefs."""
    groups: list[NodeGroup] = []
    last_key = None
    for n in nodes:
        node = cluster.node(n)
        mine = frozenset(g.local_index for g in gpus if g.node == n)
        key = (node.num_gpus, mine, node.gpus[0].type, node.gpus[0].intra_node_bandwidth_GBps)
        if groups and key == last_key:
            groups[-1] = NodeGroup(groups[-1].names + (n,), node.num_gpus, mine)
        else:
            groups.append(NodeGroup((n,), node.num_gpus, mine))
        last_key = key
    return groups


MAX_ARC_ISLANDS = 4  # past this many islands, the links most island pairs share are one line, not an arc each
GRID_COLUMNS = 4  # islands per row when no arc is left to draw


def _island_arcs(cluster: "ClusterSpec", isls) -> list[tuple[int, int, str, bool]]:
    """(a, b, label, slow) per island pair: the slowest link between their nodes."""
    arcs = []
    for a in range(len(isls)):
        for b in range(a + 1, len(isls)):
            bw, lat = None, 0.0
            for x in isls[a].nodes:
                for y2 in isls[b].nodes:
                    if x == y2:
                        continue
                    lk = cluster.link(x, y2)
                    if bw is None or lk.bandwidth_GBps < bw:
                        bw, lat = lk.bandwidth_GBps, lk.latency_us
            label = f"{bw:g} GB/s, {lat:g} us" if bw is not None else "same node"
            arcs.append((a, b, label, bw is not None and bw < SLOW_LINK_GBPS))
    return arcs


def islands_items(cluster: "ClusterSpec", island_set: "IslandSet") -> tuple[list, float, float]:
    from tangram_launch.islands import node_ranges

    isls = list(island_set.islands)
    cpu = on_cpu(g.type for _, g in cluster.iter_gpus())
    node_w, gpu_s, pad = 190.0, 18.0, 14.0
    col_w = node_w + 2 * pad + 40
    box_w = col_w - 40
    per_row_gpus = 8
    groups = [node_groups(cluster, isl.nodes, isl.gpus) for isl in isls]

    def group_h(g: NodeGroup) -> float:
        rows = math.ceil(g.num_gpus / per_row_gpus)
        return (34 if len(g.names) == 1 else 48) + rows * (gpu_s + 4)

    # Links between islands: arcs above the boxes, labelled with the slowest link between their nodes. Past
    # MAX_ARC_ISLANDS islands, the label most pairs share is said once in a line, and only the other pairs get arcs.
    K = len(isls)
    arcs = _island_arcs(cluster, isls)
    shared_note = ""
    if K > MAX_ARC_ISLANDS and arcs:
        common, count = Counter(label for _, _, label, _ in arcs).most_common(1)[0]
        if count > 1:
            shared_note = (f"{'every' if count == len(arcs) else 'every other'} pair of islands: {common} "
                           f"(their slowest node pair)")
            arcs = [arc for arc in arcs if arc[2] != common]
    columns = K if arcs else min(K, GRID_COLUMNS)

    # Each box has one spot per partner, ordered so that arcs nest (left partners nearest first, then right partners
    # farthest first): a wider arc's feet lie outside a narrower one's. Labels are never crossed by an arc
    # (_place_arcs).
    def foot(a: int, b: int) -> float:
        spots = list(range(a - 1, -1, -1)) + list(range(K - 1, a, -1))
        return 20 + a * col_w + box_w * (spots.index(b) + 0.5) / max(1, K - 1)

    feet = [(foot(a, b), foot(b, a)) for a, b, _, _ in arcs]
    lifts, label_boxes = _place_arcs([(xa, xb, _label_width(label)) for (xa, xb), (_, _, label, _)
                                      in zip(feet, arcs)])
    note_y = LEGEND_Y + (18.0 if arcs else 0.0)
    top = (note_y if shared_note else LEGEND_Y) + 16 + max((-bx[1] for bx in label_boxes), default=0.0)

    heights = [sum(group_h(g) + 10 for g in gs) + 64 for gs in groups]
    rows = [list(range(r, min(r + columns, K))) for r in range(0, K, columns)]
    row_top = [top]
    for row in rows[:-1]:
        row_top.append(row_top[-1] + max(heights[k] for k in row) + 20)
    width = 40 + col_w * columns
    boxes_end = row_top[-1] + max(heights[k] for k in rows[-1])
    shown = island_set.separations[:12]
    hidden = len(island_set.separations) - len(shown)
    height = boxes_end + 70 + 18 * (len(shown) + (1 if hidden else 0))
    items: list = [Text(20, 28, f"{cluster.name}: {devices(cluster.num_gpus, cpu=cpu)} in {plural(K, 'island')}",
                        15, bold=True)]
    if arcs:  # legend for the link styles
        items.append(Line(20, LEGEND_Y - 4, 50, LEGEND_Y - 4, stroke="#555", width=2.0))
        text = "link between two islands: their slowest node pair (bandwidth, latency)"
        items.append(Text(56, LEGEND_Y, text, 11, fill="#333"))
        x = 56 + _label_width(text) + 20
        items.append(Line(x, LEGEND_Y - 4, x + 30, LEGEND_Y - 4, stroke=SLOW_LINK_COLOUR, width=2.0, dash="6,4"))
        text = f"slow link (under {SLOW_LINK_GBPS:g} GB/s)"
        items.append(Text(x + 36, LEGEND_Y, text, 11, fill=SLOW_LINK_COLOUR))
        width = max(width, x + 36 + _label_width(text) + 20)
    if shared_note:
        items.append(Text(20, note_y, shared_note, 11, fill="#333"))
    for r, row in enumerate(rows):
        for col, k in enumerate(row):
            isl = isls[k]
            c = PALETTE[k % len(PALETTE)]
            x0, y0 = 20 + col * col_w, row_top[r]
            items.append(Rect(x0, y0, box_w, heights[k], _shade(c, 0.85), stroke=c, rx=10))
            items.append(Text(x0 + 12, y0 + 22, isl.name, 14, fill=_shade(c, -0.3), bold=True))
            inter = isl.inter_node_link
            sub = (f"{devices(isl.num_gpus, cpu=cpu)}, {isl.gpu.memory_gib:g} GiB each"
                   + (f", nodes linked at {inter.bandwidth_GBps:g} GB/s" if inter else ""))
            items.append(Text(x0 + 12, y0 + 40, sub, 10, fill="#444"))
            y = y0 + 52
            for g in groups[k]:
                node = cluster.node(g.names[0])
                h = group_h(g)
                items.append(Rect(x0 + pad, y, node_w + 12, h, "white", stroke="#888", rx=5))
                intra = f"{node.gpus[0].intra_node_bandwidth_GBps:g} GB/s intra-node"
                if len(g.names) == 1:
                    items.append(Text(x0 + pad + 8, y + 16, f"{g.names[0]} ({intra})", 10, fill="#333"))
                    gy0 = y + 24
                else:
                    items.append(Text(x0 + pad + 8, y + 16, f"{node_ranges(g.names)}", 10, fill="#333", bold=True))
                    items.append(Text(x0 + pad + 8, y + 30, f"{len(g.names)} nodes alike, {intra}", 10,
                                      fill="#333"))
                    gy0 = y + 38
                for i in range(g.num_gpus):
                    gx = x0 + pad + 8 + (i % per_row_gpus) * (gpu_s + 4)
                    gy = gy0 + (i // per_row_gpus) * (gpu_s + 4)
                    each = f" on each of {len(g.names)} nodes" if len(g.names) > 1 else ""
                    items.append(Rect(gx, gy, gpu_s, gpu_s, c if i in g.mine else "#dddddd", rx=3,
                                      title=f"{node_ranges(g.names)}:{i} {node.gpus[i].type}{each}"))
                y += h + 10
    for ((xa, xb), (_, _, _, slow)), lift in zip(zip(feet, arcs), lifts):
        items.append(Curve(xa, top, (xa + xb) / 2, top - 2 * lift, xb, top,
                           stroke=SLOW_LINK_COLOUR if slow else "#555", width=2.0, dash="6,4" if slow else ""))
    for (_, _, label, slow), (x0, y0, x1, y1) in zip(arcs, label_boxes):
        items.append(Rect(x0, top + y0, x1 - x0, y1 - y0, "white"))
        items.append(Text((x0 + x1) / 2, top + y1 - 4, label, 11, "middle", SLOW_LINK_COLOUR if slow else "#333"))
    y = boxes_end + 30
    if island_set.separations:
        items.append(Text(20, y, "why apart:", 12, bold=True))
        for sep in shown:
            y += 18
            items.append(Text(30, y, f"{sep.island_a} / {sep.island_b}: {sep.constraint}: {sep.detail}", 11,
                              fill="#444"))
        if hidden:
            y += 18
            items.append(Text(30, y, f"and {plural(hidden, 'pair')} more (tangram-launch islands lists them all)",
                              11, fill="#444"))
    width = max(width, 40 + 7.0 * max((len(sep.detail) + 40 for sep in shown), default=0))
    return items, width, height


def draw_islands(cluster: "ClusterSpec", island_set: "IslandSet", path: str | os.PathLike, *,
                 field: str = "output") -> str:
    """Draw the cluster's nodes grouped into islands, with the links between islands (.svg, or .png); returns the
    absolute path written. ``field`` names the option that gave ``path`` in errors."""
    items, w, h = islands_items(cluster, island_set)
    return _write(items, w, h, path, field)
