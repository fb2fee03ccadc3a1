"""Scores for composer tests: the 1F1B event simulation of a sequence of options, as the planner's score."""
from __future__ import annotations

import math

from tangram_launch.costmodel.interleaved_schedule import simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import simulated_1f1b_s


def even(o, seq):
    """An option's stage times, its time split evenly over its stages."""
    return [o.time_s / o.num_stages] * o.num_stages


def with_bottleneck(o, seq):
    """An option's stage times consistent with its numbers: one stage of its bottleneck, the rest of its time
    split evenly over its other stages (none longer: time <= stages x bottleneck in random_instance)."""
    rest = (o.time_s - o.bottleneck_s) / (o.num_stages - 1) if o.num_stages > 1 else 0.0
    times = [rest] * (o.num_stages - 1)
    times.insert(len(seq) % o.num_stages, o.bottleneck_s)  # the slowest stage anywhere in the option
    return times


def stage_seconds(options, link, seq, stage_times=even):
    """Forward, backward (a third and two thirds of each of ``stage_times``) and one-way p2p seconds of a
    sequence's stages, with the links' p2p between options (build.Candidates.stage_times)."""
    fwd, bwd, p2p = [], [], []
    for n, oi in enumerate(seq):
        o = options[oi]
        if n:
            p2p.append(link[options[seq[n - 1]].island][o.island])
        p2p.extend([0.0] * (o.num_stages - 1))
        times = stage_times(o, seq)
        fwd.extend(t / 3 for t in times)
        bwd.extend(2 * t / 3 for t in times)
    return fwd, bwd, p2p


def simulated(options, link, m, stage_times=even):
    """A score as the planner's: the 1F1B event simulation of the options' stages (``stage_times``, a third
    forward) with the links' p2p between options, plus the tail."""
    def score(seq, metrics):
        return simulated_1f1b_s(*stage_seconds(options, link, seq, stage_times), m) + metrics.tail_s
    return score


def scheduled(options, link, m, schedules=("plain", "interleaved"), most_chunks=8):
    """A score as the planner's under ``schedules``: the plain 1F1B simulation (``simulated``, one stage of each
    option at its bottleneck) and/or interleaved 1F1B with 2..min(``most_chunks``, the fewest layers per stage)
    chunks (the event simulation of the op order the runtime runs, as build_plan's), where the stages divide the micro-batches (capabilities.schedule_problems); the least of them (inf for
    a pipeline that cannot interleave where only interleaved schedules count)."""
    plain = simulated(options, link, m, with_bottleneck)

    def score(seq, metrics):
        best = plain(seq, metrics) if "plain" in schedules else math.inf
        fewest = min((options[oi].stop - options[oi].start) // options[oi].num_stages for oi in seq)
        if m % sum(options[oi].num_stages for oi in seq):  # the stages must divide the micro-batches
            fewest = 1
        if "interleaved" in schedules:
            times = stage_seconds(options, link, seq, with_bottleneck)
            for v in range(2, min(most_chunks, fewest) + 1):
                best = min(best, simulated_interleaved_1f1b_s(*times, m, v) + metrics.tail_s)
        return best
    return score


def random_options(rng, num_layers: int, num_islands: int, *, fits, tail_max_s: float):
    """Random composer options over ``num_layers`` layers on ``num_islands`` islands: for every slice and island
    0-2 options of 1-3 stages, each with a bottleneck no longer than its time, a room behind it drawn from ``fits``
    and a tail of 0 or up to ``tail_max_s`` (small enough for brute force)."""
    from tangram_launch.planner.compose import Option

    options = []
    for a in range(num_layers):
        for b in range(a + 1, num_layers + 1):
            for k in range(num_islands):
                for _ in range(rng.choice([0, 1, 1, 2])):
                    ns = rng.choice([1, 1, 2, 3])
                    bn = rng.uniform(0.1, 2.0) * (b - a) / ns
                    options.append(Option(a, b, k, ns, rng.choice(fits), bn * rng.uniform(1.0, ns), bn,
                                          rng.choice([0.0, rng.uniform(0, tail_max_s)])))
    return options


def hopeful_on_both_paths(kernel, monkeypatch) -> dict:
    """Patch the composer's _hopeful to answer each call by its loop and by its numpy path, assert they agree (the
    same options and rooms, in the same order) and count the calls and those that dropped options (returned)."""
    hopeful = kernel._hopeful
    seen = {"calls": 0, "dropping": 0}

    def both(run, key, gidx, covered, group):
        answers = []
        for vector_at in (1 << 30, 1):
            monkeypatch.setattr(kernel, "_VECTOR_AT", vector_at)
            saved, run.hopeful = run.hopeful, {}
            answers.append(hopeful(run, key, gidx, covered, group))
            run.hopeful = saved
        assert answers[0] == answers[1]
        seen["calls"] += 1
        seen["dropping"] += len(answers[0][0]) < len(gidx)
        return answers[0]

    monkeypatch.setattr(kernel, "_hopeful", both)
    return seen


def many_options_instance(rng):
    """Options on 2-4 islands over 4-7 layers, many per slice, so that states gather many entries: (options, link,
    L, m, K, edges), edges an option's (first-stage forward, last-stage backward) seconds."""
    L, K = rng.randint(4, 7), rng.randint(2, 4)
    m = rng.choice([3, 4, 6, 8, 16])
    options = random_options(rng, L, K, fits=[0, 1, 2, 3, 1 << 30], tail_max_s=2.0)
    options += random_options(rng, L, K, fits=[1, 3, 1 << 30], tail_max_s=2.0)
    # (an infinite link: islands that cannot talk; an entry across one has an infinite fill)
    link = [[0.0 if i == j else rng.choice([0.0, rng.uniform(0, 1.0), rng.uniform(0, 1.0), math.inf])
             for j in range(K)] for i in range(K)]
    edges = [(o.bottleneck_s * rng.uniform(0.3, 1.0), o.bottleneck_s * rng.uniform(0.3, 1.0)) for o in options]
    return options, link, L, m, K, edges


def composable_instances(rng, count: int):
    """Of ``count`` many_options_instance draws, those with at least one composition: (options, link, L, m, K,
    edges, closed), closed the brute force's latencies (every_composition)."""
    from tangram_launch.planner.reference import every_composition

    for _ in range(count):
        options, link, L, m, K, edges = many_options_instance(rng)
        closed = [c.latency_s for c in every_composition(options, link, L, m)]
        if closed:
            yield options, link, L, m, K, edges, closed
