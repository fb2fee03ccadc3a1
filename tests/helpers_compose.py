"""Scores for composer tests: the 1F1B event simulation of a sequence of options, as the planner's score."""
from __future__ import annotations

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


def simulated(options, link, m, stage_times=even):
    """A score as the planner's: the 1F1B event simulation of the options' stages (``stage_times``, a third
    forward) with the links' p2p between options, plus the tail."""
    def score(seq, metrics):
        fwd, bwd, p2p = [], [], []
        for n, oi in enumerate(seq):
            o = options[oi]
            if n:
                p2p.append(link[options[seq[n - 1]].island][o.island])
            p2p.extend([0.0] * (o.num_stages - 1))
            times = stage_times(o, seq)
            fwd.extend(t / 3 for t in times)
            bwd.extend(2 * t / 3 for t in times)
        return simulated_1f1b_s(fwd, bwd, p2p, m) + metrics.tail_s
    return score
