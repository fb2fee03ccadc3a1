"""Per-step stage timings on every worker: what the run measured, to set beside what the plan predicted.

Each rank times its stage module's forward and backward with module hooks (no wrapper, so parameter names and
checkpoints are unchanged) and appends one JSON line per step to ``$TANGRAM_RUN_DIR/timings/rank<R>.jsonl``:

    {"rank": 0, "stage": 0, "dp": 0, "tp": 0, "step": 3, "microbatches": 4,
     "forward_s": 0.0123, "backward_s": 0.0251, "step_s": 0.0712,
     "pipeline_s": 0.0601, "sync_s": 0.0042, "optimizer_s": 0.0051}

``forward_s`` / ``backward_s`` are this rank's totals over the step's micro-batches (divide by ``microbatches`` for
the plan's per-micro-batch figures); ``step_s`` is the whole ``train_step``, waits and optimizer included. Where the
runtime marks the optimizer step (``optimizer_begins`` / ``optimizer_ends``), the step splits into three parts that
sum to ``step_s``: ``pipeline_s`` (to the end of the stage's last backward: the schedule's forwards, backwards,
bubbles and p2p), ``optimizer_s`` (the step and clearing the gradients) and ``sync_s``, the rest: from the last
backward to the optimizer step (the gradient synchronisation left exposed, the schedule's own work after its last
backward) and after it (the loss report's collectives, which wait for the other stages), as the plan's tail prices
them. On a CUDA device the line also holds the caching allocator's peaks since the process started,
``memory_allocated_peak_bytes`` and ``memory_reserved_peak_bytes`` (``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``, host-side reads), for the report's predicted against measured memory.

Backward runs from the stage's output gradients being ready (a full-backward pre-hook) to the gradient of the stage's
input (a tensor hook), or, on the first stage whose input is token ids, to the last gradient its parameters receive
after that of its first activation that needs one (the embedding's output: the embedding's own backward counts); a
recompute forward inside it counts as backward, as the plan's ``backward_s`` does. The last stage's loss is timed too
(``timed_loss``): its forward joins the stage's forward and its backward the stage's backward, as the plan prices the
head with its loss. Tensor
hooks see activations, not parameters, so sharded (FSDP2) and offloaded parameters time alike. On CPU the clock is
``perf_counter``; on a CUDA device the marks are CUDA events read once per step, so timing adds no synchronisation
inside the step. The launcher reads the files (no collective on
the training path) and writes ``run-report.json``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

ENV_RUN_DIR = "TANGRAM_RUN_DIR"
LOSS_KEY = "loss"  # the open-span key of the loss's backward (modules are keyed by id)


def timings_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "timings", f"rank{rank}.jsonl")


class _Clock:
    """perf_counter marks on CPU; CUDA events (read once per step) on a GPU."""

    def __init__(self, device: Any):
        import torch

        self.cuda = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def memory_peaks(self) -> dict:
        """The CUDA caching allocator's peaks since the process started (bytes: the live tensors', what it
        reserved), read on the host without a sync; none on CPU, where no allocator keeps such figures."""
        if not self.cuda:
            return {}
        import torch

        return {"memory_allocated_peak_bytes": int(torch.cuda.max_memory_allocated()),
                "memory_reserved_peak_bytes": int(torch.cuda.max_memory_reserved())}


@dataclass
class StageTimer:
    """Hooks on one stage module (or each model chunk of an interleaved stage); ``end_step`` writes the line."""

    path: str
    coords: dict
    microbatches: int
    clock: _Clock
    _spans: dict = field(default_factory=lambda: {"forward": [], "backward": []})  # [start, end] marks
    _last_backward: dict = field(default_factory=dict)  # module key -> its latest closed backward span
    _open: dict = field(default_factory=dict)
    _handles: list = field(default_factory=list)
    _step_start: Any = None
    _optimizer: list = field(default_factory=list)  # [begin, end] marks of this step's optimizer step

    @classmethod
    def attach(cls, modules: list, *, run_dir: str, rank: int, coords: dict, microbatches: int,
               device: Any) -> "StageTimer":
        os.makedirs(os.path.dirname(timings_path(run_dir, rank)), exist_ok=True)
        timer = cls(path=timings_path(run_dir, rank), coords=dict(coords), microbatches=microbatches,
                    clock=_Clock(device))
        for module in modules:
            timer.watch(module)
        return timer

    def watch_optimizer(self, optimizer: Any) -> None:
        """Mark the optimizer step from the optimizer's own step hooks (``torch.optim.Optimizer``'s public
        ``register_step_pre_hook`` / ``register_step_post_hook``), for a runtime that steps it inside its own
        training call (DeepSpeed's ``train_batch``, Megatron's optimizer wrapper): what the runtime does around the
        step (unscaling, norms, gathering updated shards) then counts as sync."""
        self._handles += [optimizer.register_step_pre_hook(lambda *_: self.optimizer_begins()),
                          optimizer.register_step_post_hook(lambda *_: self.optimizer_ends())]

    def watch(self, module: Any) -> None:
        """Time ``module``'s forwards and backwards from now on (``attach`` watches the modules it is given)."""
        import warnings

        # the first stage's input is token ids: its backward pre-hook fires on the output gradients, which is the
        # start this timer wants, so torch's note about it says nothing here
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                                  "respect to module outputs")
        key = id(module)
        first_stage: set = set()  # {key} once the module is seen taking token ids
        want_mark: dict = {}  # set while a forward looks for the first tensor whose gradient ends the backward
        child_hooks: dict = {}  # child module -> its forward hook, kept only while they may be needed

        def drop_child_hooks(keep: Any = None) -> None:  # a Python call per child and forward is not free
            for child in [c for c in child_hooks if c is not keep]:
                child_hooks.pop(child).remove()

        def end_backward(_grad):
            start = self._open.pop(("backward", key), None)
            if start is not None:
                self._spans["backward"].append(span := [start, self.clock.mark()])
                self._last_backward[key] = span

        def param_grad(_param):  # first stage: the embedding's backward runs after its output's gradient
            span = self._last_backward.get(key)
            if span is not None and ("backward", key) not in self._open:
                span[1] = self.clock.mark()

        def forward_pre(_m, args):
            if ("backward", key) in self._open:  # a recompute forward belongs to the backward around it
                return
            self._open[("forward", key)] = self.clock.mark()
            marked = _first_grad_tensor(args)
            if marked is not None:  # a later stage: the backward ends at its input's gradient
                marked.register_hook(end_backward)
                drop_child_hooks()
            else:  # token ids in: it ends at the gradient of the first activation that needs one (the embedding's)
                want_mark[key] = True

        def child_post(child, _args, out):
            if want_mark.get(key):
                marked = _first_grad_tensor(out if isinstance(out, (tuple, list)) else (out,))
                if marked is not None:
                    want_mark[key] = False
                    marked.register_hook(end_backward)
                    if key not in first_stage:
                        first_stage.add(key)
                        drop_child_hooks(keep=child)  # the same child marks every later micro-batch
                        self._handles += [p.register_post_accumulate_grad_hook(param_grad)
                                          for p in module.parameters() if p.requires_grad]

        def forward_post(_m, _args, _out):
            want_mark[key] = False
            start = self._open.pop(("forward", key), None)
            if start is not None:
                self._spans["forward"].append([start, self.clock.mark()])

        def backward_pre(_m, _grad_out):
            now = self.clock.mark()
            loss_start = self._open.pop(("backward", LOSS_KEY), None)
            if loss_start is not None:  # the loss's backward ran up to here
                self._spans["backward"].append([loss_start, now])
            self._open[("backward", key)] = now

        self._handles += [module.register_forward_pre_hook(forward_pre),
                          module.register_forward_hook(forward_post),
                          module.register_full_backward_pre_hook(backward_pre)]
        child_hooks.update({child: child.register_forward_hook(child_post)
                            for child in module.modules() if child is not module})
        self._handles += list(child_hooks.values())

    def timed_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` timed as part of this stage: its forward is added to the stage's forward, and its backward (from
        the loss's gradient to the stage's output gradients) to the stage's backward."""
        import torch

        class _LossBackwardStarts(torch.autograd.Function):
            """The identity on the loss; its backward, the first step of the stage's backward, marks the start."""

            @staticmethod
            def forward(ctx, loss):
                return loss.view_as(loss)

            @staticmethod
            def backward(ctx, grad):
                self._open[("backward", LOSS_KEY)] = self.clock.mark()
                return grad

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock.mark()
            loss = loss_fn(*args, **kwargs)
            self._spans["forward"].append([start, self.clock.mark()])
            return _LossBackwardStarts.apply(loss) if loss.requires_grad else loss

        return timed

    def start_step(self) -> None:
        self._step_start = self.clock.mark()
        self._optimizer = []

    def optimizer_begins(self) -> None:
        """The schedule and any gradient synchronisation after it are done; the optimizer step starts."""
        self._optimizer = [self.clock.mark()]

    def optimizer_ends(self) -> None:
        if len(self._optimizer) == 1:
            self._optimizer.append(self.clock.mark())

    def _parts(self, end: Any) -> dict:
        """pipeline_s, sync_s, optimizer_s of the step (empty unless the optimizer step was marked): from the step's
        start to the last backward's end (the latest closed span, whose end the first stage moves to its parameters'
        last gradient); the optimizer's begin to its end; and the rest of the step."""
        if self._step_start is None or len(self._optimizer) != 2:
            return {}
        begin, done = self._optimizer
        spans = self._spans["backward"]
        last = spans[-1][1] if spans else begin
        return {"pipeline_s": self.clock.seconds(self._step_start, last),
                "sync_s": max(0.0, self.clock.seconds(last, begin)) + self.clock.seconds(done, end),
                "optimizer_s": self.clock.seconds(begin, done)}

    def end_step(self, step: int) -> dict:
        """Close the step: total forward and backward seconds, the step's wall time and its parts, and on a GPU the
        allocator's memory peaks; append them to the file."""
        end = self.clock.mark()
        line = {**self.coords, "step": step, "microbatches": self.microbatches,
                "forward_s": sum(self.clock.seconds(a, b) for a, b in self._spans["forward"]),
                "backward_s": sum(self.clock.seconds(a, b) for a, b in self._spans["backward"]),
                "backward_spans": len(self._spans["backward"]),
                "step_s": self.clock.seconds(self._step_start, end) if self._step_start is not None else None,
                **self._parts(end), **self.clock.memory_peaks()}
        self._spans = {"forward": [], "backward": []}
        self._open.clear()
        self._last_backward.clear()
        self._optimizer = []
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_grad_tensor(values: Any) -> Any:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def timer_from_env(modules: list, *, rank: int, coords: dict, microbatches: int, device: Any) -> StageTimer | None:
    """A timer when the launcher asked for timings (``TANGRAM_RUN_DIR`` set), else None."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return None
    return StageTimer.attach(modules, run_dir=run_dir, rank=rank, coords=coords, microbatches=microbatches,
                             device=device)
