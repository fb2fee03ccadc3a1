"""One op of a simulated pipeline schedule, as the timeline draws it (costmodel/pipeline.py for 1F1B,
costmodel/interleaved_schedule.py chunk by chunk)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    stage: int
    kind: str  # "F" | "B"
    micro: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ChunkBlock(Block):
    chunk: int = 0  # the model chunk of the stage (0 .. v - 1)
