"""Floors under every pipeline that holds one slice/island pair, from the parallelizer's per-island compute floors,
so the planner skips a query whose pair can be part of no pipeline beating the plan found so far.

Each island holds one contiguous slice of a pipeline (compose.py), so a pipeline holding layers [a, b) on island k
puts the other layers on the other islands. Per island, the parallelizer's ``compute_floors`` give per layer kind
the least GPU-seconds and the least seconds of forward + backward per micro-batch over every grid it offers there
(no recompute or p2p; the TP / CP / EP communication every stage pays). Then, for any such pipeline,

    period >= max(GPU-seconds of [a, b) on k / GPUs of k,
                  least GPU-seconds of the other layers on the other islands / their capacity)
    fill   >= seconds of [a, b) on k + least seconds of the other layers on the other islands

(a stage of n GPUs runs its layers for at least their GPU-seconds / n; the slowest of several stages for at least
their total over all their GPUs). An island o whose every kind takes at least r_o times the least GPU-seconds
of any island does at most period x GPUs_o / r_o of least GPU-seconds, so the capacity is the sum of GPUs_o / r_o
(``capacity``: slow islands count for less; with r_o = 1 it is their GPUs). So its closed form is at least
(m - 1) x period + fill and its predicted iteration at least m x the slice's period + the fill in front of it
(plain 1F1B), or 1/v of that fill or the compute + each link at its ends four times (interleaved with 2 <= v
chunks, at most the most virtual stages; ``floor``). With the least links into and out of each island (``links``), a slice that does not
start at layer 0 has one in front of it and one that does not end at L one behind it: each bounds the period and
adds twice itself to the fill, the one in front to what is in front too (compose.py counts links so). A query is
skipped only when both cannot
beat the bounds (as ``SliceQuery.beyond_bound``). The floors depend on the slice's position only through the kinds
of the layers inside and outside it and whether it holds the embedding or the head, which the pair's redundancy key
fixes, so one representative's floor holds for its whole class. The lesser of the other islands' seconds floors is
also a tighter "outside" fill for the query's own bound (``outside_s``).
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

from tangram_launch.planner.bounds import beyond, chain_score_floor_s, slack_cut
from tangram_launch.planner.interleave import most_virtual_stages



def capacity(kinds: Sequence[str], floors: Mapping[int, Mapping[str, tuple[float, float]]],
             gpus: Mapping[int, int]) -> float:
    """Least GPU-seconds the islands ``floors`` can run per second of period: the sum of GPUs_o / r_o, r_o the
    least ratio over the kinds (and embedding, head) of island o's GPU-seconds floor to the least of any of them."""
    names = {*kinds, "embedding", "head"}
    least: dict[str, float] = {}
    for f in floors.values():
        for x in names & f.keys():
            least[x] = min(least.get(x, math.inf), f[x][0])
    out = 0.0
    for o, f in floors.items():  # (a kind an island has no floor for runs elsewhere: it bounds nothing there)
        ratios = [f[x][0] / least[x] for x in names & f.keys() if least[x] > 0.0]
        out += gpus[o] / (min(ratios) if ratios else 1.0)
    return out


class PairFloors:
    """Floors for the pairs of one micro-batch size (``num_microbatches`` m)."""

    def __init__(self, kinds: Sequence[str], floors: Mapping[int, Mapping[str, tuple[float, float]]],
                 gpus: Mapping[int, int], num_microbatches: int,
                 links: tuple[Mapping[int, float], Mapping[int, float]] | None = None) -> None:
        """``kinds``: layer kind of each layer; ``floors``: island index -> kind (and "embedding", "head") ->
        (GPU-seconds, seconds), for every island that can hold a slice; ``gpus``: island index -> GPUs;
        ``links``: per island the least one-way link into it and out of it from another island a pipeline may
        use (bounds.least_links; default none)."""
        self.m = num_microbatches
        self.L = len(kinds)
        self.gpus = dict(gpus)
        self.into, self.out_of = links if links is not None else ({}, {})
        self.own: dict[int, tuple] = {}  # island -> (GPU-s prefix, s prefix, embedding (gs, s), head (gs, s))
        self.rest: dict[int, tuple] = {}  # island -> the same over the least of the other islands
        self.rest_capacity: dict[int, float] = {}  # island -> capacity of the other islands
        for k, f in floors.items():
            self.own[k] = self._prefixes(kinds, [f])
            others = {o: g for o, g in floors.items() if o != k}
            self.rest[k] = self._prefixes(kinds, list(others.values())) if others else None
            self.rest_capacity[k] = capacity(kinds, others, self.gpus)

    @staticmethod
    def _prefixes(kinds: Sequence[str], floors: Sequence[Mapping[str, tuple[float, float]]]) -> tuple:
        def least(kind: str, i: int) -> float:
            return min(f[kind][i] for f in floors)

        per_kind = {k: (least(k, 0), least(k, 1)) for k in {*kinds, "embedding", "head"}}
        gs = (0.0, *itertools.accumulate(per_kind[k][0] for k in kinds))
        ts = (0.0, *itertools.accumulate(per_kind[k][1] for k in kinds))
        return gs, ts, per_kind["embedding"], per_kind["head"]

    def _part(self, pref: tuple, start: int, stop: int, inside: bool) -> tuple[float, float]:
        """(GPU-seconds, seconds) floors of layers [start, stop) (inside) or of the layers outside them, with the
        embedding and head where they fall."""
        gs, ts, emb, head = pref
        if inside:
            g, t = gs[stop] - gs[start], ts[stop] - ts[start]
            with_emb, with_head = start == 0, stop == self.L
        else:
            g = gs[start] + gs[-1] - gs[stop]
            t = ts[start] + ts[-1] - ts[stop]
            with_emb, with_head = start > 0, stop < self.L
        if with_emb:
            g, t = g + emb[0], t + emb[1]
        if with_head:
            g, t = g + head[0], t + head[1]
        return g, t

    def floor(self, island: int, start: int, stop: int) -> tuple[float, float]:
        """(closed form, predicted iteration) floors of any pipeline holding [start, stop) on ``island``; (0, 0)
        for an island without floors, inf when the other layers have no other island to run on."""
        own = self.own.get(island)
        if own is None:
            return 0.0, 0.0
        g, t = self._part(own, start, stop, True)
        own_period = period = g / self.gpus[island]
        rest_period = front = into = out = 0.0
        if (start, stop) != (0, self.L):
            rest = self.rest[island]
            if rest is None:
                return math.inf, math.inf
            rg, rt = self._part(rest, start, stop, False)
            rest_period = rg / self.rest_capacity[island]
            period = max(period, rest_period)
            t += rt
        compute_s = t  # every layer's least forward + backward seconds, links left out (chain_score_floor_s)
        if (start, stop) != (0, self.L):
            front = self.front_s(island, start)  # layers [0, start) and the embedding, in front of it
            # the links at its ends (compose: a boundary's link bounds the period and adds twice itself to the fill;
            # the one in front delays the first micro-batch's arrival as much)
            into = self.into.get(island, 0.0) if start > 0 else 0.0
            out = self.out_of.get(island, 0.0) if stop < self.L else 0.0
            period = max(period, into, out)
            t += 2.0 * (into + out)
            front += 2.0 * into
        m = self.m
        # predicted iteration: plain 1F1B runs the slice's slowest stage m times after the fill in front of it
        # (bounds.plain_1f1b_floor_s); interleaved, after 1/v of it, or micro-batch 0's way through every chunk,
        # each link v >= 2 times each way (interleaved_schedule.interleaved_floor_s), with v at most
        # interleave.most_virtual_stages of the slice's layers (none below 2: no interleaving); the lesser. Not
        # m x period: the period may be a link, which the simulations take as latency. Either is at least
        # micro-batch 0's way through every layer's compute (bounds.chain_score_floor_s)
        plain = max(m * own_period + front, m * rest_period)
        v = most_virtual_stages(stop - start)
        if v >= 2:
            inter = max(m * own_period + front / v, m * rest_period, compute_s + 4.0 * (into + out))
            plain = plain if plain < inter else inter
        return (m - 1) * period + t, chain_score_floor_s(plain, compute_s)

    def beyond(self, island: int, start: int, stop: int, latency_bound_s: float, score_bound_s: float) -> bool:
        """Whether no pipeline holding the pair can beat either bound."""
        lat, score = self.floor(island, start, stop)
        return beyond(lat, score, slack_cut(latency_bound_s), slack_cut(score_bound_s))

    def front_s(self, island: int, start: int) -> float | None:
        """Least seconds of layers [0, start) and the embedding on the other islands (None: no floors for it)."""
        rest = self.rest.get(island)
        if rest is None or start == 0:
            return None if rest is None else 0.0
        _gs, ts, emb, _head = rest
        return ts[start] + emb[1]

    def outside_s(self, island: int, start: int, stop: int) -> float | None:
        """Least seconds of the layers outside [start, stop) on the other islands (None: no floors for it)."""
        rest = self.rest.get(island)
        if rest is None:
            return None
        return self._part(rest, start, stop, False)[1]
