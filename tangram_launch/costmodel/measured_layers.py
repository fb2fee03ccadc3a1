"""A layer's time priced from the profiler's measured points at a shape it may not have measured.

``tangram-launch profile --model`` times each layer kind (and the embedding, and the head with the loss) at a few
shapes: micro-batch sizes, sequence lengths and TP shards (the sharded layer on one device). The cost model asks
about other shapes too. Between measured points it interpolates; beyond them it scales the nearest measured point
by the analytic model's ratio between the two shapes, so the analytic model supplies only how time grows, never
the time itself (at small shapes a layer's time is mostly per-operator overhead the analytic model does not see:
the tiny model runs about 8x its analytic time on a CPU).

    measured (micro-batch m, sequence s, tp t) -> forward_s, forward_backward_s
    tp      the measured TP shard nearest in log2 (an exact one if measured); a different one is scaled
    s       a measured s; between two measured ones, linear in s; beyond them, the nearest one scaled
    m       a measured m; between two measured ones, linear in m (a per-call cost plus a per-row cost is linear
            in m); below them, the nearest one scaled; above them, the largest one scaled, but never below the
            line through the two largest measured (likewise for s)

A stage runs its layers one after another, each on the caches the others left; the profile times each part alone
in a loop of its own, so a stage's parts add up to less than it costs, by a ratio that differs by shape. On CPU devices
the profiler also times a stage-like sequence (the embedding, layers, the head with the loss) back to back at each
micro-batch size it measured, and the sum of its parts' times there (``SEQUENCE_KEY``, ``SEQUENCE_PARTS_KEY``:
seconds by micro-batch); ``sequence_ratio``, their ratio, is what a stage priced from measured parts is multiplied
by (below 1 on the parts, ``parts_correction``; above 1 on the plan's stage, ``sequence_factor``).

``distance`` says how far the shape priced is from the nearest measured one: the largest log2 step over micro-batch,
sequence length and TP (0: measured there; 1: twice or half the nearest measured size on some axis).
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping

# how a price was found, from best to worst; a stage reports its worst part
HOW = ("measured", "interpolated", "scaled")
_KEY = re.compile(r"^(?P<model>.+)\|(?P<kind>[^|]+)\|seq=(?P<seq>\d+)\|mbs=(?P<mbs>\d+)\|tp=(?P<tp>\d+)$")

AnalyticS = Callable[[int, int, int], float]  # (seq_len, mbs, tp) -> analytic forward seconds
# GPUSpec.measured, {micro-batch: s}: a stage-like sequence back to back, and the sum of its parts timed alone
SEQUENCE_KEY, SEQUENCE_PARTS_KEY = "stage_sequence_s", "stage_sequence_parts_s"
SEQUENCE_FACTOR_RANGE = (0.5, 2.0)  # outside it the figure is taken for a broken measurement and not used


def sequence_ratio(measured: Mapping | None, mbs: int) -> float:
    """The stage-like sequence's time over its parts' at ``mbs`` (the module docstring): each measured micro-batch
    size's ratio, linear between two of them, the nearest one's beyond; 1 where the device has no measured layer
    times (the analytic model keeps its own constants) or no sequence times. A ratio outside
    ``SEQUENCE_FACTOR_RANGE`` is taken for a broken measurement and left out.

    A stage priced from measured parts costs its parts times this ratio, split in two so that the search's floors
    hold: below 1 it corrects the parts themselves (``parts_correction``: the layer profile times each part in a
    window of its own, and a slow spell of the host during those windows put the parts' sum a quarter to a half
    above the sequence in some profiles of the throttled bench; the profiler times the sequence in rounds over the
    whole of its window, which spreads such a spell over every size), above 1 it scales the plan's stage
    times (``sequence_factor``), never the parts the floors are made of."""
    measured = measured or {}
    whole, parts = measured.get(SEQUENCE_KEY), measured.get(SEQUENCE_PARTS_KEY)
    if not measured.get("layer_forward_s") or not isinstance(whole, Mapping) or not isinstance(parts, Mapping):
        return 1.0
    lo, hi = SEQUENCE_FACTOR_RANGE
    at = {}
    for key, w in whole.items():
        p = parts.get(key)
        if str(key).isdigit() and _positive(w) and _positive(p) and lo <= w / p <= hi:
            at[int(key)] = w / p
    if not at:
        return 1.0
    value, _how = _along(sorted(at), mbs, lambda m: (at[m], "measured"), lambda m: 1.0)
    return value


def sequence_factor(measured: Mapping | None, mbs: int) -> float:
    """What a stage of ``mbs`` rows per replica, priced from this device's measured layer times, is multiplied by:
    ``sequence_ratio``, at least 1 (the search's floors price stages from their parts alone, which stays a lower
    bound only while the factor is at least 1; a ratio below 1 corrects the parts instead: ``parts_correction``)."""
    return max(1.0, sequence_ratio(measured, mbs))


def parts_correction(measured: Mapping | None, mbs: int) -> float:
    """What each measured part of a stage of ``mbs`` rows per replica is multiplied by: ``sequence_ratio``, at most
    1 (see there)."""
    return min(1.0, sequence_ratio(measured, mbs))


def measured_layer_key(model_name: str, kind: str, seq_len: int, mbs: int, tp: int) -> str:
    """Key of a measured time in ``GPUSpec.measured['layer_forward_s']`` (and ``layer_forward_backward_s``,
    written by the profiler's model-layer profile): e.g. ``"llama3-8b|dense|seq=4096|mbs=1|tp=2"``."""
    return f"{model_name}|{kind}|seq={seq_len}|mbs={mbs}|tp={tp}"


@dataclass(frozen=True)
class Point:
    """One measured shape of one layer kind."""

    seq_len: int
    mbs: int
    tp: int
    forward_s: float
    forward_backward_s: float | None  # None where the profile has only the forward


@dataclass(frozen=True)
class Priced:
    forward_s: float
    backward_s: float | None  # None: no measured forward+backward to take it from
    how: str  # one of HOW
    distance: float  # largest log2 step to the nearest measured shape


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def measured_points(forward_s: Mapping, forward_backward_s: Mapping, model_name: str, kind: str) -> list[Point]:
    """The measured shapes of ``kind`` of ``model_name`` (keys of other models or kinds, and bad values, ignored)."""
    points = []
    for key, fwd in (forward_s or {}).items():
        match = _KEY.match(str(key))
        if not match or match["model"] != model_name or match["kind"] != kind or not _positive(fwd):
            continue
        both = (forward_backward_s or {}).get(key)
        points.append(Point(int(match["seq"]), int(match["mbs"]), int(match["tp"]), float(fwd),
                            float(both) if _positive(both) and both > fwd else None))
    return points


def _log_step(a: int, b: int) -> float:
    return abs(math.log2(a / b))


def distance(points: list[Point], *, seq_len: int, mbs: int, tp: int) -> float:
    """Largest log2 step over (micro-batch, sequence, TP) to the nearest measured point (inf without points)."""
    return min((max(_log_step(seq_len, p.seq_len), _log_step(mbs, p.mbs), _log_step(tp, p.tp)) for p in points),
               default=math.inf)


def _nearest(values: list[int], x: int) -> int:
    return min(values, key=lambda v: (_log_step(x, v), v))


def _along(xs: list[int], x: int, value: Callable[[int], tuple[float, str]],
           scaled: Callable[[int], float], *, trend: bool = False) -> tuple[float, str]:
    """Value at ``x`` from measured ``xs`` (sorted): exact, linear between the two around it, or the nearest one
    times ``scaled(nearest)`` (the analytic ratio target / nearest). With ``trend``, beyond the largest of two or
    more measured points, at least the line through the two largest (the module docstring: growth the device
    measured is not undone by an analytic ratio that expects more efficiency at larger shapes)."""
    if x in xs:
        return value(x)
    i = bisect.bisect_left(xs, x)
    if 0 < i < len(xs):
        lo, hi = xs[i - 1], xs[i]
        (v_lo, how_lo), (v_hi, how_hi) = value(lo), value(hi)
        w = (x - lo) / (hi - lo)
        return v_lo + w * (v_hi - v_lo), _worst(how_lo, how_hi, "interpolated")
    near = _nearest(xs, x)
    v, how = value(near)
    out = v * scaled(near)
    if trend and i == len(xs) >= 2:
        lo, hi = xs[-2], xs[-1]
        v_lo, how_lo = value(lo)
        out = max(out, v + (x - hi) * (v - v_lo) / (hi - lo))
        how = _worst(how, how_lo)
    return out, _worst(how, "scaled")


def _worst(*hows: str) -> str:
    return max(hows, key=HOW.index)


def _price_one(points: list[Point], get: Callable[[Point], float | None], *, seq_len: int, mbs: int, tp: int,
               analytic_s: AnalyticS) -> tuple[float, str] | None:
    usable = [p for p in points if get(p) is not None]
    if not usable:
        return None
    t = _nearest(sorted({p.tp for p in usable}), tp)
    at_tp = {(p.seq_len, p.mbs): get(p) for p in usable if p.tp == t}

    def ratio(num: tuple[int, int, int], den: tuple[int, int, int]) -> float:
        a, b = analytic_s(*num), analytic_s(*den)
        return a / b if a > 0 and b > 0 else 1.0

    def at_seq(s: int) -> tuple[float, str]:
        ms = sorted(m for ss, m in at_tp if ss == s)
        return _along(ms, mbs, lambda m: (at_tp[(s, m)], "measured"), lambda m: ratio((s, mbs, t), (s, m, t)),
                      trend=True)

    seqs = sorted({s for s, _ in at_tp})
    value, how = _along(seqs, seq_len, at_seq, lambda s: ratio((seq_len, mbs, t), (s, mbs, t)), trend=True)
    if t != tp:
        value, how = value * ratio((seq_len, mbs, tp), (seq_len, mbs, t)), "scaled"
    return value, how


def price(points: list[Point], *, seq_len: int, mbs: int, tp: int, analytic_s: AnalyticS) -> Priced | None:
    """The forward (and, where measured, backward) seconds of one layer kind at (seq_len, mbs, tp) from its
    measured ``points`` (see the module docstring); None without points."""
    fwd = _price_one(points, lambda p: p.forward_s, seq_len=seq_len, mbs=mbs, tp=tp, analytic_s=analytic_s)
    if fwd is None:
        return None
    both = _price_one(points, lambda p: p.forward_backward_s, seq_len=seq_len, mbs=mbs, tp=tp, analytic_s=analytic_s)
    backward = both[0] - fwd[0] if both is not None and both[0] > fwd[0] else None
    return Priced(fwd[0], backward, fwd[1], distance(points, seq_len=seq_len, mbs=mbs, tp=tp))


def stage_measurement(parts: Mapping[str, Priced | None]) -> dict | None:
    """What a plan says about a stage priced from measurement (None where no part was): the parts measured and
    not, the worst way a part was priced and the farthest distance."""
    priced = {k: p for k, p in parts.items() if p is not None}
    if not priced:
        return None
    out = {"parts": sorted(priced), "how": _worst(*(p.how for p in priced.values())),
           "distance": round(max(p.distance for p in priced.values()), 3)}
    analytic = sorted(k for k, p in parts.items() if p is None)
    if analytic:
        out["analytic_parts"] = analytic
    return out
