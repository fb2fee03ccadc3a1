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
(``capacity``: slow islands count for less; with r_o = 1 it is their GPUs; ``capacities``: r_o over the layer
kinds, the embedding and head at their own ratio, tighter where they run relatively fast). So its closed form is
at least (m - 1) x period + fill and its predicted iteration at least m x the slice's period + the fill in front of it
(plain 1F1B), or 1/v of that fill or the compute + each link at its ends four times (interleaved with 2 <= v
chunks, at most the most virtual stages; ``floor``). With the least links into and out of each island (``links``), a slice that does not
start at layer 0 has one in front of it and one that does not end at L one behind it: each bounds the period and
adds twice itself to the fill, the one in front to what is in front too (compose.py counts links so). A query is
skipped only when both cannot
beat the bounds (as ``SliceQuery.beyond_bound``). The floors depend on the slice's position only through the kinds
of the layers inside and outside it and whether it holds the embedding or the head, which the pair's redundancy key
fixes, so one representative's floor holds for its whole class. The lesser of the other islands' seconds floors is
also a tighter "outside" fill for the query's own bound (``outside_s``).

Where the parallelizer gives bottleneck floors (per island, under the slowest stage of any x layers there with D
stages behind them: memory makes stages with several micro-batches in flight recompute), the pair's own period is at
least its island's for its length (D = 1 unless it ends at layer L), and the rest's at least the least slowest stage
of any placement of the other layers on the other islands (``spread_bottlenecks_s``; D = 1 where the pair ends at L,
so that every other island is in front of it, else on every other island but the last: ``spread_behind_s``).
"""
from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from tangram_launch.planner.bounds import beyond, chain_score_floor_s, slack_cut
from tangram_launch.planner.interleave import most_virtual_stages

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.planner.slices import Pair


class PipelineReach:
    """Which pairs some pipeline of the live pairs could hold, at one micro-batch size. A pipeline covers [0, L) with
    pairs on distinct islands, each once (compose.py), so a pair [a, b) on island k needs a chain of live pairs on
    the other islands from layer 0 to a and one from b to L, and as many other islands as it has such sides (a
    slice in the middle needs two). A pair is dead once its class's answer holds no plan (kill): its query kept
    every plan of it that could be in a pipeline beating bounds no tighter than the search's now, so it is in no
    pipeline that could beat them. Both chains are looked for ignoring which of the other islands they share (a
    relaxation: a pair this rules out is in no pipeline of live pairs), only that no island holds two pairs in a
    row of one chain (so with two islands the chains are exact: one pair on the other island)."""

    def __init__(self, pairs: Sequence["Pair"], num_layers: int) -> None:
        self.L = num_layers
        self.islands = sorted({p.island for p in pairs})
        self.members: dict[tuple, list[tuple[int, int, int]]] = {}  # key -> its pairs' (island, start, stop)
        self.stops: dict[int, dict[int, int]] = {}  # island -> start -> bit mask of the stops of its live pairs
        self.starts: dict[int, dict[int, int]] = {}  # island -> stop -> bit mask of the starts of its live pairs
        for p in pairs:
            a, b = p.layers
            self.members.setdefault(p.key, []).append((p.island, a, b))
            self._flip(p.island, a, b, on=True)
        self.dead: set[tuple] = set()
        self._reach: dict[int, tuple[int, int]] = {}  # island -> (layers reached from 0, layers reaching L)

    def copy(self) -> "PipelineReach":
        """The same reach, killed apart (its pairs are shared)."""
        out = PipelineReach.__new__(PipelineReach)
        out.L, out.islands, out.members = self.L, self.islands, self.members
        out.stops = {k: dict(row) for k, row in self.stops.items()}
        out.starts = {k: dict(row) for k, row in self.starts.items()}
        out.dead, out._reach = set(self.dead), dict(self._reach)
        return out

    def _flip(self, k: int, a: int, b: int, *, on: bool) -> None:
        for table, x, y in ((self.stops, a, b), (self.starts, b, a)):
            row = table.setdefault(k, {})
            row[x] = row.get(x, 0) | 1 << y if on else row.get(x, 0) & ~(1 << y)

    def kill(self, key: tuple) -> None:
        """Mark the pairs of ``key`` dead (their class's answer holds no plan)."""
        if key in self.dead:
            return
        self.dead.add(key)
        for k, a, b in self.members.get(key, ()):
            self._flip(k, a, b, on=False)
        self._reach.clear()

    def _of(self, k: int) -> tuple[int, int]:
        """(bit mask of the layers a chain of live pairs on islands other than k reaches from layer 0, of those
        from which such a chain reaches L), no island holding two pairs in a row."""
        hit = self._reach.get(k)
        if hit is None:
            others = [o for o in self.islands if o != k]
            hit = self._reach[k] = (self._chains(others, self.stops, range(self.L), 0),
                                    self._chains(others, self.starts, range(self.L, 0, -1), self.L))
        return hit

    @staticmethod
    def _chains(islands: Sequence[int], table: dict[int, dict[int, int]], order: range, origin: int) -> int:
        """Bit mask of the layers chains of ``table``'s spans over ``islands`` reach from ``origin``, visiting the
        layers in ``order`` (away from the origin: a layer's chains go on only after every span ending there was
        read); per island the layers reached by a chain whose last pair is on it, which it does not extend."""
        last = {o: 0 for o in islands}
        for x in order:
            if x == origin:
                for o in islands:
                    last[o] |= table[o].get(x, 0)
                continue
            ends = [q for q in islands if last[q] >> x & 1]  # the islands of the last pairs of chains reaching x
            if ends:
                for o in islands:
                    if len(ends) > 1 or ends[0] != o:
                        last[o] |= table[o].get(x, 0)
        out = 1 << origin
        for mask in last.values():
            out |= mask
        return out

    def prune(self) -> None:
        """Kill every class no pipeline of live pairs can hold, until none is left (one such class may have been
        another's only way to layer 0 or L)."""
        while True:
            gone = [key for key in self.members if key not in self.dead and not self.usable(key)]
            if not gone:
                return
            for key in gone:
                self.kill(key)

    def usable(self, key: tuple) -> bool:
        """Whether some pair of ``key`` could be in a pipeline of live pairs."""
        if key in self.dead:
            return False
        others = len(self.islands) - 1
        for k, a, b in self.members.get(key, ()):
            if (a > 0) + (b < self.L) > others:
                continue
            ahead, behind = self._of(k)
            if ahead >> a & 1 and behind >> b & 1:
                return True
        return False


def capacity(kinds: Sequence[str], floors: Mapping[int, Mapping[str, tuple[float, float]]],
             gpus: Mapping[int, int]) -> float:
    """Least GPU-seconds the islands ``floors`` can run per second of period: the sum of GPUs_o / r_o, r_o the
    least ratio over the kinds (and embedding, head) of island o's GPU-seconds floor to the least of any of them."""
    return capacities(kinds, floors, gpus).every


class Capacity(NamedTuple):
    """What some islands can run per second of period (capacities), in least GPU-seconds."""

    every: float  # capacity(): r_o over the layer kinds, the embedding and the head
    layers: float  # the same with r_o over the layer kinds only
    credit: float  # the least over the islands of r'_o / r_o, r'_o over the embedding and the head

    def period_s(self, layers_gs: float, edges_gs: float) -> float:
        """Least period of a pipeline whose stages on these islands run layers of ``layers_gs`` and embedding /
        head of ``edges_gs`` least GPU-seconds."""
        out = (layers_gs + edges_gs) / self.every
        tighter = (layers_gs + self.credit * edges_gs) / self.layers
        return tighter if tighter > out else out


def capacities(kinds: Sequence[str], floors: Mapping[int, Mapping[str, tuple[float, float]]],
               gpus: Mapping[int, int]) -> Capacity:
    """The islands' Capacity. A stage of g GPUs runs its layers and edges within the period P only if their
    GPU-seconds are at most P x g, so island o runs n_ox of each kind x with sum_x n_ox x gs_ox <= P x GPUs_o. With
    gs_ox >= r_o x least_x for the layer kinds and >= r'_o x least_x for the embedding and head, dividing by r_o
    and summing over the islands: least layer GPU-seconds + min_o(r'_o / r_o) x least edge GPU-seconds <= P x
    sum_o GPUs_o / r_o. Counting the embedding at its own ratio keeps a tiny embedding that runs nearly as fast on
    a slow island from counting that island as nearly fast (``every``, the bound with one ratio over everything)."""
    layer_names = set(kinds)
    edge_names = {"embedding", "head"} - layer_names
    least: dict[str, float] = {}
    for f in floors.values():
        for x in (layer_names | edge_names) & f.keys():
            least[x] = min(least.get(x, math.inf), f[x][0])
    every = layers = 0.0
    credit = math.inf
    for o, f in floors.items():  # (a kind an island has no floor for runs elsewhere: it bounds nothing there)
        r_layers = _least_ratio(layer_names, f, least)
        r_edges = _least_ratio(edge_names, f, least)
        r_every = min(r for r in (r_layers, r_edges) if r is not None) if (r_layers, r_edges) != (None, None) \
            else 1.0
        every += gpus[o] / r_every
        layers += gpus[o] / (1.0 if r_layers is None else r_layers)
        if r_edges is not None:
            credit = min(credit, r_edges / (1.0 if r_layers is None else r_layers))
    return Capacity(every, layers, 0.0 if credit == math.inf else credit)


def _least_ratio(names: set, f: Mapping[str, tuple[float, float]], least: Mapping[str, float]) -> float | None:
    """The least ratio of ``f``'s GPU-seconds floor to ``least`` over ``names`` (None: none to compare)."""
    ratios = [f[x][0] / least[x] for x in names & f.keys() if least[x] > 0.0]
    return min(ratios) if ratios else None


def spread_behind_s(tables: Sequence[Mapping[int, Sequence[float]]], num_layers: int) -> list[float]:
    """spread_bottlenecks_s over islands of which one holds the pipeline's last stage: per island its D -> table
    (bottleneck_floors with D = 0 and 1), every island but the last with one stage behind it at least; the least
    over which island is last."""
    if len(tables) < 2:
        return spread_bottlenecks_s([t[0] for t in tables], num_layers)
    out = [math.inf] * (num_layers + 1)
    for last in range(len(tables)):
        spread = spread_bottlenecks_s([t[0] if o == last else t[1] for o, t in enumerate(tables)], num_layers)
        out = [a if a < b else b for a, b in zip(out, spread)]
    return out


def spread_bottlenecks_s(tables: Sequence[Sequence[float]], num_layers: int) -> list[float]:
    """out[n], n = 0 .. ``num_layers``: a floor under the slowest stage of any n layers placed on the islands of
    ``tables`` (per island, bottleneck_floors' B: B[x] under the slowest stage of any x layers on it, inf where
    they fit nowhere), at most one slice each. Let X(P) be the most layers x with B[x] <= P, the count of the x
    >= 1 whose least B over x and beyond is <= P: a placement whose slowest stage is P puts at most X(P) layers on
    each island, so n <= the sum of the X(P), whose least P is the n-th least of those suffix minima over every
    island."""
    L = num_layers
    values: list[float] = []
    for table in tables:
        least = math.inf
        for x in range(L, 0, -1):
            if table[x] < least:
                least = table[x]
            if least < math.inf:
                values.append(least)
    values.sort()
    return [0.0] + [values[n - 1] if n <= len(values) else math.inf for n in range(1, L + 1)]


class PairFloors:
    """Floors for the pairs of one micro-batch size (``num_microbatches`` m)."""

    def __init__(self, kinds: Sequence[str], floors: Mapping[int, Mapping[str, tuple[float, float]]],
                 gpus: Mapping[int, int], num_microbatches: int,
                 links: tuple[Mapping[int, float], Mapping[int, float]] | None = None,
                 bottlenecks: Mapping[int, Mapping[int, Sequence[float]]] | None = None) -> None:
        """``kinds``: layer kind of each layer; ``floors``: island index -> kind (and "embedding", "head") ->
        (GPU-seconds, seconds), for every island that can hold a slice; ``gpus``: island index -> GPUs;
        ``links``: per island the least one-way link into it and out of it from another island a pipeline may
        use (bounds.least_links; default none); ``bottlenecks``: island index -> D (0 and 1) -> the
        parallelizer's bottleneck_floors (B[x]: under the slowest stage of x layers there with D or more stages
        behind them), where it has them."""
        self.m = num_microbatches
        self.L = len(kinds)
        self.gpus = dict(gpus)
        self.into, self.out_of = links if links is not None else ({}, {})
        self.bottlenecks = dict(bottlenecks or {})
        self._rest_bottlenecks: dict[tuple[int, int], list[float]] = {}  # (island, D) -> spread_bottlenecks_s
        self.own: dict[int, tuple] = {}  # island -> (GPU-s prefix, s prefix, embedding (gs, s), head (gs, s))
        self.rest: dict[int, tuple] = {}  # island -> the same over the least of the other islands
        self.rest_capacity: dict[int, Capacity] = {}  # island -> capacity of the other islands
        for k, f in floors.items():
            self.own[k] = self._prefixes(kinds, [f])
            others = {o: g for o, g in floors.items() if o != k}
            self.rest[k] = self._prefixes(kinds, list(others.values())) if others else None
            self.rest_capacity[k] = capacities(kinds, others, self.gpus)

    @staticmethod
    def _prefixes(kinds: Sequence[str], floors: Sequence[Mapping[str, tuple[float, float]]]) -> tuple:
        def least(kind: str, i: int) -> float:
            return min(f[kind][i] for f in floors)

        per_kind = {k: (least(k, 0), least(k, 1)) for k in {*kinds, "embedding", "head"}}
        gs = (0.0, *itertools.accumulate(per_kind[k][0] for k in kinds))
        ts = (0.0, *itertools.accumulate(per_kind[k][1] for k in kinds))
        return gs, ts, per_kind["embedding"], per_kind["head"]

    def _part(self, pref: tuple, start: int, stop: int, inside: bool) -> tuple[float, float, float]:
        """(GPU-seconds of the layers, of the embedding and head, seconds) floors of layers [start, stop) (inside)
        or of the layers outside them, with the embedding and head where they fall."""
        gs, ts, emb, head = pref
        if inside:
            g, t = gs[stop] - gs[start], ts[stop] - ts[start]
            with_emb, with_head = start == 0, stop == self.L
        else:
            g = gs[start] + gs[-1] - gs[stop]
            t = ts[start] + ts[-1] - ts[stop]
            with_emb, with_head = start > 0, stop < self.L
        e = 0.0
        if with_emb:
            e, t = e + emb[0], t + emb[1]
        if with_head:
            e, t = e + head[0], t + head[1]
        return g, e, t

    def floor(self, island: int, start: int, stop: int) -> tuple[float, float]:
        """(closed form, predicted iteration) floors of any pipeline holding [start, stop) on ``island``; (0, 0)
        for an island without floors, inf when the other layers have no other island to run on."""
        own = self.own.get(island)
        if own is None:
            return 0.0, 0.0
        g, e, t = self._part(own, start, stop, True)
        own_period = period = max((g + e) / self.gpus[island], self._own_bottleneck_s(island, start, stop))
        rest_period = front = into = out = 0.0
        if (start, stop) != (0, self.L):
            rest = self.rest[island]
            if rest is None:
                return math.inf, math.inf
            rg, re, rt = self._part(rest, start, stop, False)
            rest_period = max(self.rest_capacity[island].period_s(rg, re),
                              self._rest_bottleneck_s(island, self.L - (stop - start), int(stop == self.L)))
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

    def _own_bottleneck_s(self, island: int, start: int, stop: int) -> float:
        """Under the slowest stage of the slice [start, stop) on ``island`` (its bottleneck floors; 0 without):
        a slice that does not end at layer L has a stage of another island behind it."""
        tables = self.bottlenecks.get(island)
        return 0.0 if tables is None else tables[int(stop < self.L)][stop - start]

    def _rest_bottleneck_s(self, island: int, layers: int, behind: int) -> float:
        """Under the slowest stage of ``layers`` layers on the islands other than ``island`` (spread_bottlenecks_s
        of their floors, with ``behind`` (0 or 1) stages behind each: 1 where the pair ends at layer L, so that
        every other island is in front of it; an island without floors bounds nothing)."""
        if not self.bottlenecks:
            return 0.0
        hit = self._rest_bottlenecks.get((island, behind))
        if hit is None:
            free = [0.0] * (self.L + 1)
            tables = [self.bottlenecks.get(o, {0: free, 1: free}) for o in self.own if o != island]
            hit = self._rest_bottlenecks[island, behind] = (
                spread_bottlenecks_s([t[1] for t in tables], self.L) if behind else spread_behind_s(tables, self.L))
        return hit[layers]

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
        return self._part(rest, start, stop, False)[2]
