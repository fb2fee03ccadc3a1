"""A device's wake-up cost: what one micro-batch's compute costs more right after a wait than back to back.

A pipeline stage that is faster than the pipeline's slowest waits before each micro-batch (1F1B: before its forward
downstream of the slowest stage, before its backward upstream of it). On a CPU device the first calls after such a
wait run cold: while the worker slept the core idled or ran other work, and caches, TLB and branch state must be
refilled, once per wake-up whatever the rows. The layer profile times calls back to back and never sees it, so the
waiting stages of a CPU pipeline read faster in the plan than in the run report.

Measured as a stage would meet it: a stage-like call sequence (the embedding, one layer, the head with the loss:
forward, then backward through all three) run back to back, and run after a sleep of ``WAKE_SLEEP_S`` before each
call; the cost is the difference of the two medians (wall time: devices that share a core share it in both, as a
stage's replicas do, and a collective before each sleep wakes them together). Rounds alternate the two ways, so
load that drifts meets both alike. The cost model charges it
(costmodel/wake.py) once per micro-batch to every stage that waits, never to the slowest.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from profiler.bench import Measured, Timing, device_sync, warm_once_s

# a wait a stage meets in a pipeline of unequal stages: longer than a scheduler time slice (a few ms), so the core
# idles or runs other work meanwhile, as it does while a fast stage waits for a slow neighbour
WAKE_SLEEP_S = 0.02
WAKE_CALLS = 8  # calls per round of each way (a back-to-back block is timed whole)


def stage_sequence(model, shape, device: torch.device) -> Callable[[], None]:
    """One micro-batch through a stage-like sequence at ``shape`` (a profiler.layer.LayerShape at tp 1): tokens
    (B, T) -> embedding -> one layer of the model's first kind -> head and loss, then the backward through all."""
    from profiler.layer import _Embedding, _HeadLoss, build_layer
    from profiler.bench import DTYPES

    b, t, dtype = shape.micro_batch, shape.seq_len, DTYPES[shape.dtype]
    torch.manual_seed(0)
    embedding = _Embedding(model).to(device=device, dtype=dtype)
    layer = build_layer(model, model.layer_kind(0), device, shape.dtype)
    head = _HeadLoss(model).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (b, t), device=device, generator=gen)  # (B, T)

    def run() -> None:
        head(layer(embedding(tokens)), tokens).backward()

    return run


def time_wake_up(fn: Callable[[], Any], device: torch.device, *, budget_s: float,
                 between: Callable[[], Any] = lambda: None, agree: Callable[[int], int] = lambda n: n,
                 sleep_s: float = WAKE_SLEEP_S, calls: int = WAKE_CALLS, max_rounds: int = 12) -> Measured:
    """Microseconds ``fn`` costs more after a sleep of ``sleep_s`` than back to back (median against median, at
    least 0): rounds of ``calls`` back-to-back calls (one sample, their mean) and ``calls`` calls each after a sleep
    (one sample each), as many rounds as ``budget_s`` affords (``agree``: the minimum over the node's processes, so
    each issues the same ``between`` collectives: one before each back-to-back block and one before each sleep).

    Why a collective before each sleep: devices that share a core must compute at the same time after the wait as
    before it. Left to drift, two devices on one core slept and computed in turns, and a call after a sleep read
    1.6x faster than back to back (a whole core instead of half)."""
    sync = device_sync(device)
    once_s = warm_once_s(fn, sync)
    per_round_s = calls * (2.0 * once_s + sleep_s)
    rounds = agree(max(2, min(max_rounds, int(budget_s / per_round_s))))
    back_to_back, after_sleep = [], []
    for _ in range(rounds):
        between()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        back_to_back.append((time.perf_counter() - t0) / calls)
        for _ in range(calls):
            between()  # every device of the node wakes together, as a stage's replicas wake on one message
            time.sleep(sleep_s)
            t0 = time.perf_counter()
            fn()
            sync()
            after_sleep.append(time.perf_counter() - t0)
    cold_s, warm_s = statistics.median(after_sleep), statistics.median(back_to_back)
    return Measured(max(0.0, cold_s - warm_s) * 1e6, "us", Timing(tuple(after_sleep)),
                    (("back_to_back_s", warm_s), ("after_sleep_s", cold_s), ("sleep_s", sleep_s),
                     ("rounds", rounds), ("calls", calls),
                     ("timed", "embedding, one layer, head and loss, forward then backward: each call after a "
                               "sleep against blocks of back-to-back calls")))
