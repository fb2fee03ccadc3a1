"""Micro-benchmarks with torch: GEMM throughput, memory bandwidth, collectives and point-to-point links.

Every figure comes from warm-up runs followed by several timed repetitions; the median is the figure and the
spread ((max - min) / median of the repetition times) says how much to trust it. Collective figures follow the
nccl-tests conventions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = bytes / time, and for all-reduce busbw = algbw * 2(n-1)/n, the per-link bandwidth a ring achieves,
comparable across group sizes. Bandwidths are GB/s (1e9 bytes per second) like every ``_gbps`` figure here.

Timed repetitions of local work last at least ``min_rep_s`` (on CPUs: of CPU time): a CFS quota (cgroups) or a
time-sliced neighbour only shows over whole scheduler periods (100 ms), so a 2 ms repetition would read full speed
on a core that delivers a third of it. Collectives and point-to-point tests run fixed counts (every rank must issue
the same number of calls) on messages large enough to reach the link's bandwidth.

Local benchmarks are sized by a time budget (``BenchConfig.budget_s`` each), not by a fixed shape or count: the
same profile must finish in seconds on a CPU where a dtype has no hardware support (bf16 matmul on a CPU without
AVX-512 BF16 or AMX runs tens of times slower than fp32) and use the full shape on a GPU. The GEMM starts small and
grows while the budget allows; a dtype whose first product is already far slower than the best dtype measured
before it is reported at that size (``stopped``). Repetitions are as many as fit in what is left of the budget.
The GEMM sweep (``gemm_sweep``: the model's layer shapes, the cost model's table) shares one budget among its
shapes, fewest FLOPs first, and leaves out the shapes that would not fit.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MiB = 2**20


@dataclass(frozen=True)
class Timing:
    """Seconds per operation for each timed repetition."""

    samples_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples_s or any(not (s > 0) for s in self.samples_s):
            raise ValueError(f"timing needs positive samples, got {self.samples_s!r}")

    @property
    def median_s(self) -> float:
        return float(statistics.median(self.samples_s))

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 means the repetitions agree within 5 %."""
        return (self.max_s - self.min_s) / self.median_s

    def to_dict(self) -> dict:
        return {"median_s": round_sig(self.median_s), "min_s": round_sig(self.min_s), "max_s": round_sig(self.max_s),
                "spread": round(self.spread, 4), "reps": len(self.samples_s)}


@dataclass(frozen=True)
class Measured:
    """A rate derived from a timing: ``value = work / median time`` (e.g. TFLOP/s or GB/s)."""

    value: float
    unit: str
    timing: Timing
    detail: tuple[tuple[str, Any], ...] = ()  # shape, bytes, group size: what was measured

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"value": round_sig(self.value), "unit": self.unit}
        d.update(self.timing.to_dict())
        d.update({k: v for k, v in self.detail})
        return d


def round_sig(x: float, digits: int = 4) -> float:
    """Round to significant digits (figures in YAML stay readable)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repetition counts for one device kind; ``quick`` keeps a profile under a minute."""

    device_type: str  # "cuda" | "cpu"
    quick: bool
    gemm_shape: tuple[int, int, int]  # (m, k, n): tokens x hidden times hidden x out, as in a transformer layer
    gemm_dtypes: tuple[str, ...]
    copy_bytes: int
    allreduce_bytes: int
    p2p_bytes: int
    warmup: int
    reps: int
    comm_reps: int
    latency_reps: int
    min_rep_s: float
    wait_reps: int = 200  # collective_wait_us: (layer forward, tiny all-to-all) pairs, in blocks of WAIT_BLOCK
    budget_s: float = 2.0  # wall seconds each local benchmark may take (a GEMM dtype, the copy, a layer kind)

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        for name in ("warmup", "reps", "comm_reps", "latency_reps", "wait_reps"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s}")
        unknown = [d for d in self.gemm_dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"unknown GEMM dtypes {unknown}; valid: {', '.join(DTYPES)}")

    @classmethod
    def for_device(cls, device_type: str, *, quick: bool, budget_s: float | None = None) -> "BenchConfig":
        """The sizes for ``device_type``; ``budget_s`` replaces the default budget of each local benchmark."""
        if device_type == "cuda":
            # 8192^3: 1.1 TFLOP per bf16 GEMM, ~1.4 ms on an H100; a training layer's FFN GEMM at 8k tokens x 8k hidden.
            return cls(device_type, quick, gemm_shape=(8192, 8192, 8192), gemm_dtypes=("bf16", "fp16", "fp32"),
                       copy_bytes=(512 if quick else 2048) * MiB, allreduce_bytes=(128 if quick else 512) * MiB,
                       p2p_bytes=(64 if quick else 256) * MiB, warmup=2 if quick else 5, reps=5 if quick else 20,
                       comm_reps=5 if quick else 20, latency_reps=20 if quick else 100,
                       min_rep_s=0.02 if quick else 0.1, wait_reps=50 if quick else 100,
                       budget_s=budget_s or (2.0 if quick else 10.0))
        # One CPU "device" is one process; torchrun gives each OMP_NUM_THREADS=1 when it starts several. The 1024^3
        # GEMM is the largest tried; a CPU whose GEMM is slow stops growing it before that.
        return cls(device_type, quick, gemm_shape=(1024, 1024, 1024), gemm_dtypes=("fp32", "bf16"),
                   copy_bytes=(64 if quick else 256) * MiB, allreduce_bytes=(8 if quick else 32) * MiB,
                   p2p_bytes=(8 if quick else 32) * MiB, warmup=1 if quick else 2, reps=9 if quick else 11,
                   comm_reps=5 if quick else 11, latency_reps=20 if quick else 50,
                   min_rep_s=0.05 if quick else 0.25, wait_reps=200 if quick else 400,
                   budget_s=budget_s or (0.4 if quick else 1.0))

    def to_dict(self) -> dict:
        return {"gemm_shape_mkn": list(self.gemm_shape), "gemm_dtypes": list(self.gemm_dtypes),
                "copy_bytes": self.copy_bytes, "allreduce_bytes": self.allreduce_bytes, "p2p_bytes": self.p2p_bytes,
                "warmup": self.warmup, "reps": self.reps, "comm_reps": self.comm_reps,
                "latency_reps": self.latency_reps, "min_rep_s": self.min_rep_s, "wait_reps": self.wait_reps,
                "budget_s": self.budget_s}


def device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_repeated(fn: Callable[[], Any], *, warmup: int, reps: int, inner: int = 1,
                  sync: Callable[[], None] = lambda: None, between: Callable[[], Any] = lambda: None) -> Timing:
    """Seconds per call of ``fn``: ``warmup`` untimed repetitions, then ``reps`` timed ones of ``inner`` calls, each
    followed by ``between`` (untimed)."""
    for _ in range(warmup * inner):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
        between()
    return Timing(tuple(samples))


def time_interleaved(fn: Callable[[], Any], between: Callable[[], Any], *, warmup: int, blocks: int,
                     calls: int) -> Timing:
    """Seconds per call of ``fn`` when each call is followed by ``between`` (untimed; a collective), as a training
    step runs its layers: one sample per block of ``calls`` calls, the block's mean (its slow calls count).

    On a host shared with other work, a process that computes without pause competes with it for whole time slices,
    while one that waits at a collective after every layer gets the core back first when it wakes (the scheduler
    credits sleepers): tiny-moe's MoE layer forward read 2.6-4.4 ms timed back to back and 1.2-1.3 ms with an
    all-to-all after each call, 2 ranks on 2 shared cores at load 8. Call counts are fixed, so every member of
    ``between``'s group issues the same collectives.
    """
    for _ in range(warmup):
        fn()
        between()
    samples = []
    for _ in range(blocks):
        total = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
            between()
        samples.append(total / calls)
    return Timing(tuple(samples))


def time_blocks(fn: Callable[[], Any], between: Callable[[], Any], *, blocks: int, calls: int,
                sync: Callable[[], None] = lambda: None) -> Timing:
    """Seconds per call of ``fn`` over blocks of ``calls`` back-to-back calls, each block followed by ``between``
    (untimed; a collective): one sample per block, its wall time over ``calls``.

    What it is for: a CPU device slowed by a CFS quota runs at full speed until its quota is spent, then waits (the
    kernel enforces the quota at its tick, so in bursts of milliseconds): it has its mean speed only while it computes
    without pause, as the busiest stage of a pipeline does. A block long against the quota period measures that;
    the collective between blocks starts every process's block together, so devices that share a core share it
    while they are timed, as the replicas of one stage do in training."""
    return time_repeated(fn, warmup=0, reps=blocks, inner=calls, sync=sync, between=between)


def time_blocks_split(forward: Callable[[], Any], backward: Callable[[Any], Any], between: Callable[[], Any], *,
                      blocks: int, calls: int, sync: Callable[[], None] = lambda: None,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[Timing, Timing]:
    """(forward+backward, forward) seconds per call over blocks of ``calls`` back-to-back calls, each call's
    ``forward()`` then ``backward(what it returned)``, each block followed by ``between`` (untimed, as in
    ``time_blocks``): the forward timed inside the same calls, as a training step runs it.

    Why inside: a forward run alone in a loop, its graph dropped at once, reads cheaper than one that a backward
    follows, as in training, and the backward taken as the difference dearer by as much; most on a throttled CPU
    device, whose bursts start on caches other work used meanwhile (benchmarks/README.md)."""
    fb, fwd = [], []
    for _ in range(blocks):
        forward_s = 0.0
        t0 = clock()
        for _ in range(calls):
            t = clock()
            out = forward()
            sync()
            forward_s += clock() - t
            backward(out)
        sync()
        fb.append((clock() - t0) / calls)
        fwd.append(forward_s / calls)
        between()
    return Timing(tuple(fb)), Timing(tuple(fwd))


def calibrate_inner(fn: Callable[[], Any], *, min_rep_s: float, sync: Callable[[], None] = lambda: None,
                    clock: Callable[[], float] = time.perf_counter, max_inner: int = 10_000) -> int:
    """Calls per repetition so that one repetition lasts at least ``min_rep_s`` on ``clock`` (the first call
    also warms up). CPU devices calibrate on process CPU time: a call that happened to run inside its quota would
    otherwise look cheap, and a repetition that fits one quota period reads full speed on a throttled core."""
    return _inner_for(warm_once_s(fn, sync, clock), min_rep_s, max_inner)


def _inner_for(once_s: float, min_rep_s: float, max_inner: int = 10_000) -> int:
    return max(1, min(max_inner, math.ceil(min_rep_s / max(once_s, 1e-7))))


def calibration_clock(device: torch.device) -> Callable[[], float]:
    return time.process_time if device.type == "cpu" else time.perf_counter


def time_within(fn: Callable[[], Any], *, once_s: float, budget_s: float, min_rep_s: float, max_reps: int,
                sync: Callable[[], None] = lambda: None) -> Timing:
    """Seconds per call of an already warm ``fn`` (one call took ``once_s``): repetitions of at least ``min_rep_s``,
    as many as fit in ``budget_s`` of wall time (at least one, at most ``max_reps``).

    The count follows the budget, so a slow call gives a figure from fewer repetitions instead of a profile that
    runs for minutes; the budget is checked after each repetition, so calls that turn out slower than ``once_s``
    (a throttled core) stop the repetitions early too."""
    inner = _inner_for(once_s, min_rep_s)
    deadline = time.perf_counter() + budget_s
    samples: list[float] = []
    while len(samples) < max_reps:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        now = time.perf_counter()
        samples.append((now - t0) / inner)
        if now + (now - t0) > deadline:  # another repetition would end past the budget
            break
    return Timing(tuple(samples))


def warm_once_s(fn: Callable[[], Any], sync: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call on ``clock`` after a first, untimed one (allocation, kernel selection, a JIT). CPU
    devices pass process time (``calibration_clock``): a call that a CFS quota paused would look slow in wall time
    and give repetitions too short to span a quota period."""
    fn()
    sync()
    t0 = clock()
    fn()
    sync()
    return max(clock() - t0, 1e-7)


def time_budgeted(fn: Callable[[], Any], budget_s: float, *, min_rep_s: float, max_reps: int,
                  sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Warm ``fn`` up and time it within ``budget_s`` wall seconds in all (``warm_once_s`` then ``time_within``)."""
    started = time.perf_counter()
    once = warm_once_s(fn, sync, clock)
    left = max(budget_s - (time.perf_counter() - started), 0.0)
    return time_within(fn, once_s=once, budget_s=left, min_rep_s=min_rep_s, max_reps=max_reps, sync=sync)


# --------------------------------------------------------------------------------------------- local work

def dtype_supported(device: torch.device, dtype: str) -> bool:
    """Whether a matrix product in ``dtype`` runs on this device (CPUs without fp16 kernels say no)."""
    try:
        a = torch.ones(8, 8, dtype=DTYPES[dtype], device=device)
        torch.mm(a, a)
        return True
    except (RuntimeError, TypeError):
        return False


GEMM_SHARED_BLOCKS = 3  # at least this many blocks where devices share cores (a median of three)
HOPELESS_RATIO = 20.0  # a dtype this many times slower than the best before it is not grown past its first size


def gemm_sizes(shape: tuple[int, int, int], steps: int = 3) -> list[tuple[int, int, int]]:
    """Shapes tried in order, smallest first: ``shape`` halved ``steps - 1`` times per dimension (at least 1 each),
    then doubled back up to ``shape`` (8x the work at each step)."""
    out = [tuple(shape)]
    for _ in range(steps - 1):
        out.insert(0, tuple(max(1, d // 2) for d in out[0]))
    return [s for i, s in enumerate(out) if i == 0 or s != out[i - 1]]


def gemm_tflops(device: torch.device, dtype: str, cfg: BenchConfig, *, best_tflops: float | None = None,
                agree: Callable[[int], int] | None = None) -> Measured:
    """Dense GEMM throughput: C(m,n) = A(m,k) @ B(k,n), 2mkn FLOPs per product, within ``cfg.budget_s``.

    The product grows from a quarter of ``cfg.gemm_shape`` per dimension while the next size (8x the work) still
    fits in the budget left; the figure is that of the last size reached (``shape_mkn``). With ``best_tflops``
    (the fastest dtype measured before this one), a dtype whose first product is ``HOPELESS_RATIO`` times slower
    is timed at that size only and says so (``stopped``): a dtype without hardware support, which training on
    this device should not use, measured in a second instead of minutes.

    With ``agree`` (the smallest of a count over the devices that share cores), every one of them grows only
    while all of them do, then times the same blocks of calls as the others, each block started together: devices
    timed at different sizes, or one alone on the core after the other stopped (its repetitions were fewer or
    shorter), read figures up to twice apart, enough to split alike devices into islands."""
    gen = torch.Generator(device=device).manual_seed(0)
    sync = device_sync(device)
    started = time.perf_counter()
    stopped = None
    sizes = gemm_sizes(cfg.gemm_shape)
    for i, (m, k, n) in enumerate(sizes):
        step = _gemm_step(device, dtype, m, k, n, gen)
        once = warm_once_s(step, sync, calibration_clock(device))  # calibrates repetitions (CPU: process time)
        wall = warm_once_s(step, sync)  # compares with the figures before it, which are wall time too
        rate = 2.0 * m * k * n / wall / 1e12
        if i == 0 and best_tflops and rate * HOPELESS_RATIO < best_tflops:
            stopped = f"{best_tflops / rate:.0f}x slower than the fastest dtype at {m}x{k}x{n}: not grown"
        left = cfg.budget_s - (time.perf_counter() - started)
        next_rep = max(8.0 * wall, cfg.min_rep_s)  # one repetition at the next size
        # its three warm-up calls, three repetitions
        grow = not stopped and i + 1 < len(sizes) and 24.0 * wall + 3 * next_rep <= left
        if not (agree(int(grow)) if agree else grow):
            break
    left = max(cfg.budget_s - (time.perf_counter() - started), 0.0)
    if agree:  # the same blocks of calls on every device, each block started together (time_blocks)
        calls = agree(_inner_for(once, cfg.min_rep_s))
        blocks = agree(max(GEMM_SHARED_BLOCKS, min(cfg.reps, int(left / max(calls * wall, 1e-9)))))
        timing = time_blocks(step, lambda: agree(1), blocks=blocks, calls=calls, sync=sync)
    else:
        timing = time_within(step, once_s=once, budget_s=left, min_rep_s=cfg.min_rep_s, max_reps=cfg.reps,
                             sync=sync)
    detail: tuple[tuple[str, Any], ...] = (("shape_mkn", [m, k, n]), ("dtype", dtype))
    if stopped:
        detail += (("stopped", stopped),)
    return Measured(2.0 * m * k * n / timing.median_s / 1e12, "TFLOP/s", timing, detail)


def _gemm_step(device: torch.device, dtype: str, m: int, k: int, n: int,
               gen: torch.Generator) -> Callable[[], None]:
    """One product C(m, n) = A(m, k) @ B(k, n) in ``dtype`` into a preallocated output."""
    t = DTYPES[dtype]
    # Random data: zeros or constants let some GPUs skip work (and read ~10 % faster than real training).
    a = torch.randn(m, k, device=device, dtype=torch.float32, generator=gen).to(t)  # (m, k)
    b = torch.randn(k, n, device=device, dtype=torch.float32, generator=gen).to(t)  # (k, n)
    out = torch.empty(m, n, device=device, dtype=t)  # (m, n)

    def step() -> None:
        torch.mm(a, b, out=out)

    return step


def gemm_sweep(device: torch.device, dtype: str, shapes: Sequence[tuple[int, int, int]], cfg: BenchConfig, *,
               budget_s: float | None = None, tflops_hint: float | None = None) -> list[Measured]:
    """Achieved TFLOP/s of each (m, n, k) of ``shapes`` (C(m, n) = A(m, k) @ B(k, n); give them fewest FLOPs
    first) within ``budget_s`` wall seconds in all (default ``cfg.budget_s``): the table the cost model
    interpolates (costmodel.gemm_curve).

    Shapes are timed in order while the budget left holds one more repetition and the two warm-up calls, the time
    of one product predicted from the rate of the shape before it (the first: ``tflops_hint``, the dtype's
    large-GEMM figure); the larger shapes left over are not run: past the measured range the cost model follows
    the catalog curve. On a GPU each shape gets an equal share of the budget left. A CPU's repetitions last
    ``cfg.min_rep_s`` of CPU time as every CPU benchmark's do (a CFS quota shows only over whole periods), so a
    short budget measures the smaller shapes only."""
    budget = cfg.budget_s if budget_s is None else budget_s
    gen = torch.Generator(device=device).manual_seed(0)
    sync = device_sync(device)
    started = time.perf_counter()
    rate = tflops_hint
    out: list[Measured] = []
    for i, (m, n, k) in enumerate(shapes):
        left = budget - (time.perf_counter() - started)
        share = left / (len(shapes) - i)
        min_rep_s = cfg.min_rep_s if device.type == "cpu" else min(cfg.min_rep_s, share / 3)
        flops = 2.0 * m * n * k
        once_s = flops / (rate * 1e12) if rate else 0.0
        if left < max(min_rep_s, once_s) + 2 * once_s:
            break
        t0 = time.perf_counter()
        step = _gemm_step(device, dtype, m, k, n, gen)
        once = warm_once_s(step, sync, calibration_clock(device))
        timing = time_within(step, once_s=once, budget_s=max(share - (time.perf_counter() - t0), 0.0),
                             min_rep_s=min_rep_s, max_reps=cfg.reps, sync=sync)
        out.append(Measured(flops / timing.median_s / 1e12, "TFLOP/s", timing,
                            (("shape_mnk", [m, n, k]), ("dtype", dtype))))
        rate = out[-1].value
    return out


def copy_bandwidth_gbps(device: torch.device, cfg: BenchConfig) -> Measured:
    """Device memory bandwidth from a large copy: each byte copied is read once and written once."""
    numel = cfg.copy_bytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)

    timing = time_budgeted(step, cfg.budget_s, min_rep_s=cfg.min_rep_s, max_reps=cfg.reps, sync=device_sync(device),
                           clock=calibration_clock(device))
    moved = 2.0 * numel * 4
    return Measured(moved / timing.median_s / 1e9, "GB/s", timing, (("bytes", numel * 4), ("counted", "read+write")))


# --------------------------------------------------------------------------------------------- communication

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
BANDWIDTH_OPS = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)  # the collectives the profile times for bandwidth


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests: busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for a reduce-scatter or all-gather (the
    buffer is the whole gathered one): what a ring moves over each link, so a perfect ring reads one busbw for all."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    return (2.0 if op == ALL_REDUCE else 1.0) * (n - 1) / n


def _collective_call(op: str, numel: int, group: Any, group_size: int, device: torch.device) -> Callable[[], Any]:
    """One call of ``op`` on a whole buffer of ``numel`` fp32 elements (a multiple of ``group_size``)."""
    whole = torch.ones(numel, dtype=torch.float32, device=device)
    if op == ALL_REDUCE:
        return lambda: dist.all_reduce(whole, group=group)
    shard = torch.ones(numel // group_size, dtype=torch.float32, device=device)
    if op == REDUCE_SCATTER:
        return lambda: dist.reduce_scatter_tensor(shard, whole, group=group)
    if op == ALL_GATHER:
        return lambda: dist.all_gather_into_tensor(whole, shard, group=group)
    raise ValueError(f"unknown collective {op!r}; valid: {', '.join(BANDWIDTH_OPS)}")


def collective_busbw_gbps(op: str, group: Any, group_size: int, device: torch.device, cfg: BenchConfig) -> Measured:
    """``op`` (BANDWIDTH_OPS) over ``group`` on ``cfg.allreduce_bytes``, the whole buffer; every member calls it
    with the same config. Returns bus bandwidth. Backends do not run every collective as a ring of the all-reduce's
    speed (gloo's reduce-scatter read 2x its all-reduce's time on 2 CPU ranks, where a ring takes half), so each
    is timed."""
    numel = cfg.allreduce_bytes // 4 // max(1, group_size) * max(1, group_size)
    call = _collective_call(op, numel, group, group_size, device)
    sync = device_sync(device)
    for _ in range(max(1, cfg.warmup)):
        call()
    sync()
    samples = []
    for _ in range(cfg.comm_reps):
        dist.barrier(group=group, **barrier_kwargs(device))
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        samples.append(time.perf_counter() - t0)
    timing = Timing(tuple(samples))
    algbw = numel * 4 / timing.median_s / 1e9
    return Measured(algbw * busbw_factor(op, group_size), "GB/s", timing,
                    (("op", op), ("bytes", numel * 4), ("group_size", group_size),
                     ("algbw_gbps", round_sig(algbw))))


def _tiny_all_to_all_after(compute: Callable[[], Any], group: Any, group_size: int, device: torch.device, reps: int,
                           *, warmup: int, warm_compute: bool) -> list[float]:
    """Seconds of ``reps`` tiny all-to-alls (one float per rank) over ``group``, each right after ``compute`` on
    every member with no barrier in between, after ``warmup`` untimed calls (each after ``compute`` too when
    ``warm_compute``) and one barrier."""
    buf = torch.ones(group_size, dtype=torch.float32, device=device)
    out = torch.empty_like(buf)
    sync = device_sync(device)
    for _ in range(warmup):
        if warm_compute:
            compute()
        dist.all_to_all_single(out, buf, group=group)
    dist.barrier(group=group, **barrier_kwargs(device))
    sync()
    samples = []
    for _ in range(reps):
        compute()
        sync()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, buf, group=group)
        sync()
        samples.append(time.perf_counter() - t0)
    return samples


def collective_latency_us(group: Any, group_size: int, device: torch.device, cfg: BenchConfig) -> Measured:
    """Time of one all-to-all of a tiny buffer (one float per rank) over ``group``, as a training loop meets it:
    right after a short burst of compute (one 256^3 GEMM), without a barrier in between.

    What a small collective costs whatever its size: the runtime's fixed cost per call plus the wait for the last
    member to arrive when identical work takes the members different times (gloo on one shared host: ~70-150 us
    back to back, ~0.2-1.3 ms after compute at load 2-4; NVLink NCCL a few us). The cost model charges it per ring
    step (``value / (n - 1)``), so MoE dispatch and combine of a few KiB, or a micro-batch's tiny TP all-reduces,
    are not costed as free. value = microseconds.
    """
    a = torch.randn(256, 256, device=device)
    # the compute each member does before the collective: same work, its own time
    samples = _tiny_all_to_all_after(lambda: torch.mm(a, a), group, group_size, device, cfg.latency_reps,
                                     warmup=max(1, cfg.warmup), warm_compute=False)
    timing = Timing(tuple(samples))
    return Measured(timing.median_s * 1e6, "us", timing, (("bytes", group_size * 4), ("group_size", group_size),
                                                          ("op", "all_to_all_single after a 256^3 GEMM")))


WAIT_BLOCK = 10  # collectives per block of collective_wait_us: a training step holds tens of them


def collective_wait_us(group: Any, group_size: int, device: torch.device, cfg: BenchConfig,
                       compute: Callable[[], Any], *, agree: Callable[[int], int] = lambda n: n) -> Measured:
    """Time of one tiny all-to-all over ``group`` right after ``compute`` (one transformer layer's forward at the
    planned shape) on every member, no barrier in between: what each collective of a training step costs.

    Identical work takes the members different times on shared cores (the OS runs something else on one of them
    for a while), so at every collective the others wait for the last; ``collective_latency_us`` (after a 256^3
    GEMM) sees little of that. Measured with tiny-moe on 2 gloo ranks of one 2-core host: 0.2-0.7 ms after a
    GEMM, 1-2 ms after a layer, as in training's own all-to-alls (torch profiler); on NVLink GPUs, microseconds.

    The figure is the median over blocks of ``WAIT_BLOCK`` consecutive calls of the block's mean over calls and
    members: a block is like the collectives of one training step, whose slow calls the step pays (a mean), while
    a burst of other work on the host spoils a few blocks, not the figure (a median, like a run's median step).
    The cost model charges it per collective call on the node. value = microseconds.

    The call count fits ``cfg.budget_s`` (at least three blocks, at most ``cfg.wait_reps`` calls), the same on every
    member: ``agree`` gives the smallest count any member can afford.
    """
    once = warm_once_s(compute, device_sync(device))
    affordable = int(cfg.budget_s / once) // WAIT_BLOCK * WAIT_BLOCK
    reps = agree(max(3 * WAIT_BLOCK, min(cfg.wait_reps, affordable)))
    samples = _tiny_all_to_all_after(compute, group, group_size, device, reps, warmup=1, warm_compute=True)
    timing = Timing(tuple(samples))
    blocks = [samples[i:i + WAIT_BLOCK] for i in range(0, len(samples), WAIT_BLOCK)]
    means = torch.tensor([statistics.fmean(b) for b in blocks], dtype=torch.float64, device=device)
    dist.all_reduce(means, group=group)  # summed over the members: each waits for the others in turn
    value_s = statistics.median((means / group_size).tolist())
    return Measured(value_s * 1e6, "us", timing, (("bytes", group_size * 4), ("group_size", group_size),
                                                  ("statistic", f"median over blocks of {WAIT_BLOCK} calls of the "
                                                                f"mean over calls and members"),
                                                  ("op", "all_to_all_single after one layer forward")))


def _adamw_step_timing(device: torch.device, cfg: BenchConfig, tensors: int, numel: int):
    """One torch.optim.AdamW step (``foreach=False``, as the torch runtime runs it) over ``tensors`` tensors of
    ``numel`` elements with gradients, timed."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, device=device, generator=gen)) for _ in range(tensors)]
    for q in params:
        q.grad = torch.randn(numel, device=device, generator=gen)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    # two figures (per tensor, per parameter) share one benchmark's budget
    return time_budgeted(opt.step, cfg.budget_s / 2, min_rep_s=cfg.min_rep_s, max_reps=cfg.reps,
                         sync=device_sync(device), clock=calibration_clock(device))


def optimizer_tensor_us(device: torch.device, cfg: BenchConfig, *, tensors: int = 256, numel: int = 64) -> Measured:
    """Fixed cost per parameter tensor of one torch.optim.AdamW step as the torch runtime runs it (``foreach=False``:
    one update per tensor, a dozen small kernels each), from ``tensors`` tiny tensors whose memory traffic is
    negligible. A model of many small tensors pays it where the cost model's memory-bound term sees nothing
    (tiny-moe on a CPU: ~10 us a tensor). value = microseconds per tensor.
    """
    timing = _adamw_step_timing(device, cfg, tensors, numel)
    return Measured(timing.median_s / tensors * 1e6, "us", timing,
                    (("tensors", tensors), ("numel", numel), ("op", "AdamW(foreach=False).step")))


def optimizer_param_ns(device: torch.device, cfg: BenchConfig, tensor_us: float, *, tensors: int = 16,
                       numel: int = 16384) -> Measured:
    """Cost per parameter of one torch.optim.AdamW step as the torch runtime runs it (``foreach=False``), beyond
    the fixed cost per tensor (``tensor_us``, from ``optimizer_tensor_us``): ``tensors`` tensors of ``numel``
    elements, their step less ``tensors x tensor_us``, per element. AdamW without foreach makes about ten passes
    over each tensor (decay, two moments, square root, division, update), not the four reads and writes of a
    fused kernel: tiny-moe's 330k parameters on a CPU took 3.3 ms a step against 1.9 ms from the per-tensor cost
    and 0.4 ms from the memory-bound term. value = nanoseconds per parameter (0 or more)."""
    timing = _adamw_step_timing(device, cfg, tensors, numel)
    per_param_s = max(0.0, timing.median_s - tensors * tensor_us * 1e-6) / (tensors * numel)
    return Measured(per_param_s * 1e9, "ns", timing,
                    (("tensors", tensors), ("numel", numel), ("tensor_us", tensor_us),
                     ("op", "AdamW(foreach=False).step, less the per-tensor cost")))


def barrier_kwargs(device: torch.device) -> dict:
    return {"device_ids": [device.index]} if device.type == "cuda" and device.index is not None else {}


def ping_pong(peer: int, *, initiator: bool, nbytes: int, reps: int, warmup: int,
              device: torch.device) -> Timing | None:
    """Round trips of an ``nbytes`` message with ``peer`` (global rank); the initiator returns round-trip times.

    One direction at a time, as nccl-tests' sendrecv measures a single link: bandwidth = 2 * bytes / round trip,
    latency = round trip / 2 for a tiny message.
    """
    numel = max(1, nbytes // 4)
    buf = torch.zeros(numel, dtype=torch.float32, device=device)
    sync = device_sync(device)
    samples = []
    for i in range(warmup + reps):
        sync()
        t0 = time.perf_counter()
        if initiator:
            dist.send(buf, dst=peer)
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.send(buf, dst=peer)
        sync()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return Timing(tuple(samples)) if initiator else None


def round_robin(players: Sequence[Any]) -> list[list[tuple[Any, Any]]]:
    """Round-robin tournament (circle method): every pair meets exactly once, nobody plays twice in a round.

    n players give n-1 rounds of n/2 pairs (n odd: n rounds, one player sits each round out). Pairs are
    (first, second) with the first the lower-position player, so the initiator is deterministic.
    """
    items = list(players)
    if len(items) < 2:
        return []
    bye = object()
    if len(items) % 2:
        items.append(bye)
    n = len(items)
    order = list(range(n))
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = order[i], order[n - 1 - i]
            if items[a] is bye or items[b] is bye:
                continue
            lo, hi = min(a, b), max(a, b)
            pairs.append((items[lo], items[hi]))
        rounds.append(pairs)
        order = [order[0]] + [order[-1]] + order[1:-1]  # keep the first fixed, rotate the rest
    return rounds
