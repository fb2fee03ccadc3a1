"""The bounds a slice query is answered under, in one place: the floors of a slice plan's closed form and score,
and the "beyond both bounds" test, each as a scalar and as an array form (numpy arrays of floors, one per grid).

They sit in the cost model because ``SliceQuery`` carries the planner's bounds down to the parallelizers, which
lie below the planner; ``planner/bounds.py`` lists every pruning bound, these among them, with why each is safe.
"""
from __future__ import annotations

import numpy as np

# relative slack on a bound: a floor summed in another order than the plan's own numbers may differ in the last bit,
# so plans that tie a bound up to float rounding are kept
BOUND_SLACK = 1e-9


def slack_cut(bound_s):
    """The threshold a floor must exceed to be beyond ``bound_s`` (a float or an array of them)."""
    return bound_s * (1.0 + BOUND_SLACK)


def latency_floor_of(bottleneck_s, fill_s, tail_s, num_microbatches: int):
    """(m - 1) x bottleneck + fill + tail: compose's closed form of any pipeline whose period, fill and tail are at
    least these (floats or arrays alike, the same float operations)."""
    return (num_microbatches - 1) * bottleneck_s + fill_s + tail_s


def score_floor_of(bottleneck_s, tail_s, num_microbatches: int):
    """m x bottleneck + tail: under the simulated 1F1B iteration and the interleaved one of any pipeline whose
    slowest stage takes at least ``bottleneck_s`` (its m forwards and backwards) and whose tail is at least
    ``tail_s`` (floats or arrays alike)."""
    return num_microbatches * bottleneck_s + tail_s


def beyond(latency_floor_s: float, score_floor_s: float, latency_cut_s: float, score_cut_s: float) -> bool:
    """Whether floors exceed both cuts (slack_cut of the bounds): no pipeline holding such a plan beats either."""
    return latency_floor_s > latency_cut_s and score_floor_s > score_cut_s


def beyond_floors(bottleneck_s: float, fill_s: float, tail_s: float, num_microbatches: int, latency_cut_s: float,
                  score_cut_s: float) -> bool:
    """beyond(latency_floor_of(...), score_floor_of(...), ...) in one call, the score floor only where the closed
    form's is beyond (the same float operations): for loops that judge many plans."""
    return ((num_microbatches - 1) * bottleneck_s + fill_s + tail_s > latency_cut_s
            and num_microbatches * bottleneck_s + tail_s > score_cut_s)


def beyond_each(bottleneck_s: list[float], fill_s: list[float], tail_s: list[float], num_microbatches: int,
                latency_cut_s: float, score_cut_s: float) -> list[bool]:
    """beyond_floors of each plan given as parallel lists of floors (a grid's saver combinations), in one pass (the
    same float operations)."""
    m1, m = num_microbatches - 1, num_microbatches
    return [m1 * b + f + t > latency_cut_s and m * b + t > score_cut_s for b, f, t in zip(bottleneck_s, fill_s, tail_s)]


def beyond_array(latency_floor_s: np.ndarray, score_floor_s: np.ndarray, latency_cut_s,
                 score_cut_s) -> np.ndarray:
    """beyond, element by element over arrays of floors (cuts: floats or arrays of the same length)."""
    return (latency_floor_s > latency_cut_s) & (score_floor_s > score_cut_s)
