"""Achieved GEMM throughput by shape, interpolated from the profiler's measured sweep.

The profiler times a small sweep of GEMMs per GPU and math mode (``measured.gemm_sweep_tflops``): the model's own
layer shapes at the TP degrees the planner considers (``sweep_shapes``), a few small squares and its large-GEMM
figure. ``MeasuredGemmCurve`` turns those points into a rate for any (m, n, k):

* a measured shape: its own figure;
* inside the measured range: the achieved TFLOP/s interpolated linearly in log(FLOPs) between the two measured
  neighbours (points of equal FLOPs averaged). Why FLOPs, not per-dimension neighbours: on a GPU what a GEMM
  achieves is set mostly by how much work one kernel has (waves of output tiles over the SMs, launch and tail time
  amortised), and the sweep's points are the layer shapes the plan itself asks about, so a query is a neighbouring
  micro-batch or TP degree of a measured shape; one axis keeps every prediction between two measurements, where
  per-dimension neighbours of a three-dimensional query are often missing on one side;
* outside it: the catalog curve (the additive roofline of ``efficiency.DeviceModel``), scaled to agree with the
  nearest measured end, so a smaller GEMM than any measured is slower by what the roofline says about its shape.

The curve replaces the GPU's catalog efficiency (its large-GEMM constant and the roofline) for the dtype measured;
a dtype or GPU without a sweep keeps the catalog curve.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from tangram_launch.specs.model import ModelSpec

TFLOPS = 1e12
TP_DEGREES = (1, 2, 4, 8)  # the TP degrees the planner tries inside a node (divisors of up to 8 GPUs per node)
EP_DEGREES = (1, 2, 4, 8)  # expert-parallel degrees whose per-expert token counts the sweep covers
# Small GEMMs the layer shapes may not reach (a tiny model, MoE experts with few tokens, high TP): where the
# launch and tail cost shows.
SMALL_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024))

Shape = tuple[int, int, int]  # (m, n, k): C(m, n) = A(m, k) @ B(k, n)
RateFn = Callable[[float, float, float], float]  # (m, n, k) -> FLOP/s


@dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    flops_per_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class MeasuredGemmCurve:
    """Measured points of one GPU and math mode, sorted by FLOPs (``from_rows`` builds it)."""

    points: tuple[GemmPoint, ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a measured GEMM curve needs at least one point")
        # derived once: the cost model asks for thousands of GEMMs per plan
        object.__setattr__(self, "_exact", {(p.m, p.n, p.k): p.flops_per_s for p in self.points})
        object.__setattr__(self, "_knots", _knots(self.points))

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[float]]) -> "MeasuredGemmCurve":
        """Rows ``[m, n, k, tflops]`` as ``measured.gemm_sweep_tflops`` holds them (validated by the spec parser)."""
        pts = [GemmPoint(int(m), int(n), int(k), float(t) * TFLOPS) for m, n, k, t in rows]
        return cls(tuple(sorted(pts, key=lambda p: (p.flops, p.m, p.n, p.k))))

    def flops_per_s(self, m: float, n: float, k: float, catalog: RateFn) -> float:
        """Achieved FLOP/s of one (m x k) @ (k x n) product; ``catalog`` is the catalog curve (outside the range)."""
        exact = self._exact.get((m, n, k))
        if exact is not None:
            return exact
        xs, ys, groups = self._knots
        x = math.log(2.0 * m * n * k)
        if xs[0] <= x <= xs[-1]:
            i = bisect.bisect_left(xs, x)
            if xs[i] == x:
                return ys[i]
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
        end = groups[0] if x < xs[0] else groups[-1]
        ratio = sum(p.flops_per_s / catalog(p.m, p.n, p.k) for p in end) / len(end)
        return catalog(m, n, k) * ratio


def _knots(points: Sequence[GemmPoint]) -> tuple[list[float], list[float], list[tuple[GemmPoint, ...]]]:
    """(log FLOPs, mean FLOP/s, the points) per distinct FLOP count of ``points`` (sorted by FLOPs), ascending."""
    xs: list[float] = []
    ys: list[float] = []
    groups: list[tuple[GemmPoint, ...]] = []
    for p in points:
        x = math.log(p.flops)
        if xs and x == xs[-1]:
            groups[-1] += (p,)
            ys[-1] = sum(q.flops_per_s for q in groups[-1]) / len(groups[-1])
        else:
            xs.append(x)
            ys.append(p.flops_per_s)
            groups.append((p,))
    return xs, ys, groups


def sweep_shapes(model: "ModelSpec", *, tokens: int, tp_degrees: Sequence[int] = TP_DEGREES) -> list[Shape]:
    """The GEMMs of ``model``'s layers on one GPU at each TP degree that shards its heads, as the cost
    model's layer compute issues them, plus ``SMALL_SHAPES``: distinct (m, n, k), fewest FLOPs first.

    QKV (m, (q + 2 kv) / t, h), attention out (m, h, q / t), MLP up (m, (mats - 1) f / t, h), MLP down
    (m, h, f / t), the head (m, V / t, e); MoE layers' experts at their balanced share of the tokens instead of
    the MLP: under EP each rank's experts receive the tokens of ep ranks, m top_k ep / experts each (compute.py),
    for each degree of ``EP_DEGREES`` that divides the experts."""
    h, e = model.hidden_size, model.embedding_dim
    mats = model.ffn_matrices
    kinds = {model.is_moe_layer(i) for i in range(model.num_layers)}
    out: set[Shape] = set(SMALL_SHAPES)
    for t in tp_degrees:
        if model.num_heads % t or (model.num_kv_heads % t and t % model.num_kv_heads):  # as the planner's TP
            continue
        cand = [(tokens, (model.q_dim + 2 * model.kv_dim) / t, h), (tokens, h, model.q_dim / t),
                (tokens, model.vocab_size / t, e)]
        if False in kinds:
            f = model.ffn_hidden_size
            cand += [(tokens, (mats - 1) * f / t, h), (tokens, h, f / t)]
        if True in kinds:
            fe = model.expert_ffn_hidden_size
            for ep in (d for d in EP_DEGREES if model.num_experts % d == 0):
                m_e = max(1, round(tokens * model.top_k * ep / model.num_experts))
                cand += [(m_e, (mats - 1) * fe / t, h), (m_e, h, fe / t)]
        out.update(tuple(max(1, round(d)) for d in s) for s in cand)
    return sorted(out, key=lambda s: (s[0] * s[1] * s[2], s))
