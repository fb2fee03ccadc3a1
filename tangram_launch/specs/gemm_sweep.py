"""The measured GEMM sweep of one GPU, as a cluster file holds it: ``measured.gemm_sweep_tflops``.

A mapping of math mode (``bf16``, ``fp16``, ``fp32``, ``tf32``) to rows ``[m, n, k, tflops]``: the achieved TFLOP/s
of C(m, n) = A(m, k) @ B(k, n), i.e. 2 m n k FLOPs per product, as the profiler timed it (the cost model's
``gemm_s(m, n, k)`` convention). Parsed here, at the spec boundary, so a hand-edited or damaged profile is refused
with the field that is wrong instead of pricing a plan from it.
"""
from __future__ import annotations

from typing import Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import DTYPES
from tangram_launch.specs.yamlio import positive_int, positive_number

SWEEP_KEY = "gemm_sweep_tflops"
ROW_HINT = "a list of [m, n, k, tflops]: positive integers m, n, k and achieved TFLOP/s > 0"


def parse_gemm_sweep(measured: Mapping[str, Any], *, where: str, source: str | None = None) -> None:
    """Refuse a ``gemm_sweep_tflops`` that is not dtype -> rows of [m, n, k, tflops] (SpecError naming the field);
    a sweep may list one shape once per dtype."""
    sweep = measured.get(SWEEP_KEY)
    if sweep is None:
        return
    field = f"{where}.measured.{SWEEP_KEY}"
    if not isinstance(sweep, Mapping):
        raise SpecError("expected a mapping of dtype to rows", source=source, field=field, value=sweep,
                        valid=f"e.g. {{bf16: [[4096, 4096, 4096, 610.0], ...]}}; dtypes: {', '.join(DTYPES)}")
    for dtype, rows in sweep.items():
        where_d = f"{field}.{dtype}"
        if dtype not in DTYPES:
            raise SpecError("unknown dtype", source=source, field=where_d, valid=", ".join(DTYPES))
        if not isinstance(rows, list) or not rows:
            raise SpecError("expected a non-empty list of rows", source=source, field=where_d, value=rows,
                            valid=ROW_HINT)
        seen: set[tuple[int, int, int]] = set()
        for i, row in enumerate(rows):
            where_r = f"{where_d}[{i}]"
            if not isinstance(row, (list, tuple)) or len(row) != 4:
                raise SpecError("expected [m, n, k, tflops]", source=source, field=where_r, value=row,
                                valid=ROW_HINT)
            shape = tuple(positive_int(v, field=f"{where_r}.{name}", source=source)
                          for v, name in zip(row[:3], "mnk"))
            positive_number(row[3], field=f"{where_r}.tflops", source=source)
            if shape in seen:
                raise SpecError("shape listed twice", source=source, field=where_r, value=list(row),
                                valid="each (m, n, k) once per dtype")
            seen.add(shape)


def slowest_sweep(sweeps: list[Mapping[str, list]]) -> dict[str, list[list]]:
    """The sweep of a group of GPUs priced as one (an island): per dtype every GPU swept, the shapes they all
    measured at the slowest GPU's rate (as islands take the slowest of every measured figure)."""
    out: dict[str, list[list]] = {}
    for dtype in sweeps[0]:
        tables = [{tuple(r[:3]): r[3] for r in s.get(dtype) or ()} for s in sweeps]
        common = [shape for shape in tables[0] if all(shape in t for t in tables)]
        if common:
            out[dtype] = [[*shape, min(t[shape] for t in tables)] for shape in common]
    return out
