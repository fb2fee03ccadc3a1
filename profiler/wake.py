"""A device's wake-up cost: what one micro-batch's compute costs more right after a wait than back to back.

A pipeline stage that is faster than the pipeline's slowest waits before each micro-batch (1F1B: before its forward
downstream of the slowest stage, before its backward upstream of it). On a CPU device the first calls after such a
wait run cold: while the worker slept the core idled or ran other work, and caches, TLB and branch state must be
refilled, once per wake-up whatever the rows. The layer profile times calls back to back and never sees it, so the
waiting stages of a CPU pipeline read faster in the plan than in the run report.

Measured as a stage would meet it: a stage-like call sequence (the embedding, the model's layers, as many as the
budget affords, the head with the loss: forward, then backward through all) run back to back, and run after a
sleep of ``WAKE_SLEEP_S`` before each call; the cost is the difference of the two medians (wall time: devices that
share a core share it in both, as a stage's replicas do, and a collective before each sleep wakes them together).
Rounds alternate the two ways, so load that drifts meets both alike. The cost model charges it (costmodel/wake.py)
once per micro-batch to every stage that waits, never to the slowest, in proportion to how long the stage waits
against how long the devices waited here (``waited_s``: the collective's wait for slower peers and the sleep): on a
host with other work, that work evicts the stage's working set while it waits, so a longer wait starts colder.
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


def stage_sequence(model, shape, device: torch.device, layers: int = 1) -> Callable[[], None]:
    """One micro-batch through a stage-like sequence at ``shape`` (a profiler.layer.LayerShape at tp 1): tokens
    (B, T) -> embedding -> the model's first ``layers`` layers -> head and loss, then the backward through all."""
    from profiler.layer import _Embedding, _HeadLoss, build_layer
    from profiler.bench import DTYPES

    b, t, dtype = shape.micro_batch, shape.seq_len, DTYPES[shape.dtype]
    torch.manual_seed(0)
    embedding = _Embedding(model).to(device=device, dtype=dtype)
    body = torch.nn.Sequential(*(build_layer(model, model.layer_kind(i), device, shape.dtype) for i in range(layers)))
    head = _HeadLoss(model).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (b, t), device=device, generator=gen)  # (B, T)

    def run() -> None:
        head(body(embedding(tokens)), tokens).backward()

    return run


def stage_layers(model, shape, device: torch.device, *, budget_s: float, calls: int = WAKE_CALLS,
                 agree: Callable[[int], int] = lambda n: n) -> int:
    """How many of the model's layers the stage-like sequence holds on a CPU: all of them where a call of the
    sequence takes at most a quarter of the rounds' share of ``budget_s`` of process time (two rounds of ``calls``
    calls each way), else as many as do (at least one); ``agree``: the smallest over the node, so devices that
    share a core run the same sequence.

    Why as many as fit: after a wait the stage's whole working set (weights, activations) must come back into the
    caches, so a small model's cold start grows with the layers the stage holds; a stage of the whole model is the
    largest any plan has, and larger stages' layers exceed the caches anyway. A GPU runs one layer: its layers
    outgrow its caches, and more of them would take memory the layer profile measured for training."""
    if device.type != "cpu":
        return agree(1)
    # process time: a throttled device's wall time per call is its quota's, and its layers would decide its peers'
    once_s = warm_once_s(stage_sequence(model, shape, device), device_sync(device), time.process_time)
    fits = int(budget_s / (4 * 2 * calls) / once_s)
    return agree(max(1, min(model.num_layers, fits)))


def time_wake_up(fn: Callable[[], Any], device: torch.device, *, budget_s: float,
                 between: Callable[[], Any] = lambda: None, agree: Callable[[int], int] = lambda n: n,
                 sleep_s: float = WAKE_SLEEP_S, calls: int = WAKE_CALLS, max_rounds: int = 12,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Any] = time.sleep) -> Measured:
    """Microseconds ``fn`` costs more after a sleep of ``sleep_s`` than back to back (median against median, at
    least 0): rounds of ``calls`` back-to-back calls (one sample, their mean) and ``calls`` calls each after a sleep
    (one sample each), as many rounds as ``budget_s`` affords (``agree``: the minimum over the node's processes, so
    each issues the same ``between`` collectives: one before each back-to-back block and one before each sleep).

    Why a collective before each sleep: devices that share a core must compute at the same time after the wait as
    before it. Left to drift, two devices on one core slept and computed in turns, and a call after a sleep read
    1.6x faster than back to back (a whole core instead of half)."""
    sync = device_sync(device)
    once_s = warm_once_s(fn, sync, clock)
    per_round_s = calls * (2.0 * once_s + sleep_s)
    rounds = agree(max(2, min(max_rounds, int(budget_s / per_round_s))))
    back_to_back, after_sleep, waited = [], [], []
    for _ in range(rounds):
        between()
        t0 = clock()
        for _ in range(calls):
            fn()
        sync()
        back_to_back.append((clock() - t0) / calls)
        for _ in range(calls):
            ended = clock()
            between()  # every device of the node wakes together, as a stage's replicas wake on one message
            sleep(sleep_s)
            t0 = clock()
            fn()
            sync()
            after_sleep.append(clock() - t0)
            waited.append(t0 - ended)  # idle before the call: the collective's wait for slower peers, the sleep
    cold_s, warm_s = statistics.median(after_sleep), statistics.median(back_to_back)
    return Measured(max(0.0, cold_s - warm_s) * 1e6, "us", Timing(tuple(after_sleep)),
                    (("back_to_back_s", warm_s), ("after_sleep_s", cold_s), ("sleep_s", sleep_s),
                     ("waited_s", statistics.median(waited)),
                     ("rounds", rounds), ("calls", calls),
                     ("timed", "embedding, layers, head and loss, forward then backward: each call after a "
                               "sleep against blocks of back-to-back calls")))
