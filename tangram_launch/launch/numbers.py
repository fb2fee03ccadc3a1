"""Numbers a training script takes and produces: absurd hyper-parameters refused at start, a non-finite loss stops
the run (the example scripts call both; any script can).

``--lr 1e30`` used to be accepted and the loss went to nan without a word, and every later checkpoint held nan
weights. Now:

* :func:`check_hyperparameter` refuses a value that is not a finite number within its range before anything runs
  (SpecError naming the flag: exit 2, under tangram-launch too);
* :func:`check_loss` stops the run at the first non-finite loss, naming the step and this worker's stage, before
  the step is checkpointed (the caller checks before saving), so the newest checkpoint is the last good one. The
  same stop as Megatron-LM's ``check_for_nan_in_loss_and_grad``; the loss must be the same on every rank (the
  runtimes broadcast it), so every rank stops at the same step and none waits in a collective.
"""
from __future__ import annotations

import math
from typing import Any

from tangram_launch.errors import SpecError, TangramError

# The largest learning rate a run of these models could mean: LLM recipes use 1e-5..1e-2, large-batch SGD up to ~10.
MAX_LEARNING_RATE = 10.0


class NonFiniteLossError(TangramError):
    """The loss became nan or inf: the run stops, its checkpoints hold only steps before it."""

    exit_code = 1  # a failed run, not a refused input: the inputs were valid numbers


def check_hyperparameter(value: Any, *, flag: str, high: float = math.inf, allow_zero: bool = False) -> float:
    """``value`` as a finite float in (0, high] ([0, high] with ``allow_zero``), else a SpecError naming ``flag``."""
    valid = f"a finite number {'>= 0' if allow_zero else '> 0'}" + (f" and <= {high:g}" if math.isfinite(high) else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError("expected a number", field=flag, value=value, valid=valid)
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) or v > high:
        raise SpecError("out of range", field=flag, value=value, valid=valid)
    return v


def check_loss(loss: float, *, step: int, stage: Any = None) -> None:
    """NonFiniteLossError when ``loss`` is nan or inf (see the module doc)."""
    if math.isfinite(loss):
        return
    where = f" on stage {stage}" if stage is not None else ""
    raise NonFiniteLossError(f"the loss is {loss} at step {step}{where}; the run stops before saving this step, so "
                             "the newest checkpoint is the last good one (lower --lr, or check the data, then "
                             "resume from it)")
