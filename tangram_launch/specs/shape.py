"""The shape of one pipeline stage: its process grid (tp x cp x dp GPUs, experts spread over ep of the dp x cp
replicas) and its memory savers (ZeRO stage, recompute mode, offload).

One type for the cost model (``costmodel.ParallelConfig`` is a shape plus a pipeline depth), the runtimes'
capabilities and the Plan's stages (which keep these fields flat in their JSON). Keyword-only: ``StageShape(tp=2,
dp=4)``, never ``StageShape(2, 4)``, so that swapping dp and cp cannot go unnoticed.
"""
from __future__ import annotations

from dataclasses import dataclass

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import RECOMPUTE_MODES, ZERO_STAGES


def check_shape(*, tp: int, dp: int, cp: int, ep: int, zero_stage: int, recompute: str, where: str = "") -> None:
    """SpecError naming the first bad field (prefixed by ``where``, e.g. ``stages[2].``) and what is valid."""
    for name, v in (("tp", tp), ("dp", dp), ("cp", cp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError("must be a positive integer", field=f"{where}{name}", value=v, valid="an integer >= 1")
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in ZERO_STAGES:
        raise SpecError("unknown ZeRO stage", field=f"{where}zero_stage", value=zero_stage,
                        valid=", ".join(map(str, ZERO_STAGES)))
    if recompute not in RECOMPUTE_MODES:
        raise SpecError("unknown recompute mode", field=f"{where}recompute", value=recompute,
                        valid=", ".join(RECOMPUTE_MODES))
    if (dp * cp) % ep:
        raise SpecError("expert parallel size must divide dp*cp", field=f"{where}ep", value=ep,
                        valid=f"a divisor of {dp * cp}")


# field tuples already validated: the planner builds hundreds of thousands of shapes from a few dozen distinct ones
_VALID_SHAPES: set[tuple] = set()


@dataclass(frozen=True, kw_only=True)
class StageShape:
    """The parallel configuration of one stage, validated on construction."""

    tp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    offload: bool = False

    def __post_init__(self) -> None:
        key = (self.tp, self.dp, self.cp, self.ep, self.zero_stage, self.recompute)
        # exact types first (True == 1 would hit the cache for a bool field; a list is unhashable)
        if (type(self.tp) is int and type(self.dp) is int and type(self.cp) is int and type(self.ep) is int
                and type(self.zero_stage) is int and type(self.recompute) is str and key in _VALID_SHAPES):
            return
        check_shape(tp=self.tp, dp=self.dp, cp=self.cp, ep=self.ep, zero_stage=self.zero_stage,
                    recompute=self.recompute)
        _VALID_SHAPES.add(key)

    @property
    def stage_gpus(self) -> int:
        """GPUs of one stage: tp x cp x dp."""
        return self.tp * self.cp * self.dp

    def as_shape(self) -> "StageShape":
        """This shape alone (a subclass, such as a ParallelConfig, drops its extra fields)."""
        if type(self) is StageShape:
            return self
        return StageShape(tp=self.tp, dp=self.dp, cp=self.cp, ep=self.ep, zero_stage=self.zero_stage,
                          recompute=self.recompute, offload=self.offload)
