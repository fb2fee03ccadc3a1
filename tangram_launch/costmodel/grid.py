"""Stage costs shared across slice queries, and a configuration grid's memory-saver combinations judged at once.

A slice query costs every (grid, memory savers) configuration of one slice on one island; the stages those
configurations cut the slice into recur across queries: a 12-layer slice in two stages has the same 6-layer stages
as a 6-layer slice in one, and a stage without embedding or head costs the same wherever it sits. A stage's cost
depends only on its **signature**

    (b, tp, dp, cp, ep, layer count per kind, has embedding, has head, tied-embedding sync link class,
     p2p link classes to the next and previous stage of the slice)

within one *context* (island, model, training, runtime, cost-model options), so ``StageTable`` keeps, per context,
the costed stage for each signature and the numbers of every memory-saver combination, so that a grid is judged
from cached numbers without calling the cost model per configuration. The numbers are the cost model's own
(``SliceCoster.fast_stage``) and the sums run in the same order as Python's ``sum``, so plans are bit-for-bit the
ones the per-configuration loop found.
"""
from __future__ import annotations

from functools import reduce
from operator import add, itemgetter
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.costmodel.breakdown import SliceCoster, StageSums

SATURATED = 1 << 30  # SlicePlan.max_stages_after's "fits at any depth"
INFEASIBLE_FILL = float("inf")  # judge_columns' fill of a combination that fits nowhere (nobody ranks it)
_MAX_CONTEXTS = 8  # contexts kept per table (a planning run has one per island and micro-batch size in flight)


class GridIndex:
    """A context's grids at one micro-batch size, as arrays: a query masks those its slice can hold and its bounds
    allow with a few array operations instead of a Python test per grid (thousands on a large island)."""

    def __init__(self, checked: Sequence[tuple]) -> None:
        """``checked``: (grid, its shape problems) in the enumerator's order."""
        self.problems = [(g.pp, p) for g, p in checked if p]  # (pp, problems) of the grids no slice can run
        self.grids = [g for g, p in checked if not p]
        self.pp = np.array([g.pp for g in self.grids], dtype=np.float64)
        self.dims = [(g.tp, g.pp, g.dp, g.cp, g.ep) for g in self.grids]  # what StageTable's methods take of a grid
        # the distinct pp, and each grid's among them: per-pp numbers (a query's score bound) read per grid at once
        self.pp_values = sorted({g.pp for g in self.grids})
        self.pp_list = [self.pp_values.index(g.pp) for g in self.grids]
        self.pp_ids = np.array(self.pp_list, dtype=np.intp)
        ids: dict[tuple, int] = {}
        self.fkey_list = [ids.setdefault((g.tp, g.cp, g.ep, g.dp), len(ids)) for g in self.grids]
        self.fkey_ids = np.array(self.fkey_list, dtype=np.intp)
        self.fkeys = list(ids)  # (tp, cp, ep, dp): what a grid's compute floor depends on
        # what the parallelizer's saver combinations depend on of a grid (megatron.savers)
        self.saver_keys = [(g.tp > 1, g.cp > 1, g.ep > 1, g.dp * g.cp == 1, g.pp > 1) for g in self.grids]
        # the distinct (fkeys' index, saver key) pairs, what a grid's memory floor depends on, each with its first
        # grid; and each grid's pair
        firsts: dict[tuple, int] = {}
        for i, pair in enumerate(zip(self.fkey_list, self.saver_keys)):
            firsts.setdefault(pair, i)
        number = {pair: n for n, pair in enumerate(firsts)}
        self.pairs = [(f, skey, self.grids[i]) for (f, skey), i in firsts.items()]
        self.pair_ids = np.array([number[pair] for pair in zip(self.fkey_list, self.saver_keys)], dtype=np.intp)
        # (layer kind, slice's embedding, head) -> per grid, (StageTable.known_sids, signature dims, stage GPUs) or
        # None until a one-kind query of this micro-batch size costs the grid (StageTable.one_kind_heads' inputs)
        self.known: dict[tuple, list] = {}


class StageTable:
    """Costed stages by signature, for the slice queries of one context (see the module docstring)."""

    def __init__(self) -> None:
        self.layer_cache: dict = {}  # shared with every SliceCoster of the context (keys: kind, tp, cp, ep, dp, mbs)
        self.edge_cache: dict = {}
        self.split_cache: dict = {}
        self.sig_ids: dict[tuple, int] = {}  # signature -> its number (the keys below use numbers)
        self.counts: dict[tuple[int, int], tuple] = {}  # layer range -> layers per kind
        self.sums: dict[int, "StageSums"] = {}  # signature -> the stage's sums (from the first query that met it)
        # signature -> what its ZeRO / offload terms depend on: (tp, dp, cp, ep, layers per kind, embedding, head,
        # tied-embedding link), not the micro-batch size nor the p2p links; stages alike in it share those terms
        self.state_keys: list[tuple] = []
        self.zero_parts: dict[tuple, dict] = {}  # state key -> SliceCoster's (zero, offload) -> ZeroPart
        self.rows: dict[tuple, dict[int, list]] = {}  # savers -> signature -> stage_rows' numbers
        # savers -> signature -> each combination's (forward_s, backward_s), made with its rows (fast_rows' halves)
        self.halves: dict[tuple, dict[int, list]] = {}
        self.columns: dict[tuple, dict[int, tuple]] = {}  # (savers, m, capacity) -> signature -> stage_columns
        self.explained: dict[tuple, tuple] = {}  # (signature, zero, r, offload) -> stage_numbers
        self.grid_lists: dict[tuple, GridIndex] = {}  # (grid enumerator, b, cap on stages) -> the grids listed
        self.grid_classes: dict[tuple, list] = {}  # the same key -> each listed grid's cross-stage class (megatron)
        # (stage sizes, stage GPUs, GPUs per node) -> a one-kind pipeline's distinct stages and each stage's
        self.patterns: dict[tuple, tuple] = {}
        # (stages, stage GPUs, GPUs per node) -> _stage_links and each stage's links and place as a number
        self.links: dict[tuple, tuple] = {}
        self.stage_sids: dict[tuple, dict] = {}  # (b, tp, dp, cp, ep; kind; slice's embedding, head) -> key -> sid
        self.saver_lists: dict[tuple, dict] = {}  # (saver enumerator, pipelined) -> grid flags -> combinations
        self.floors: dict[tuple, tuple] = {}  # (b, (tp, cp, ep, dp), slice's kinds and edges) -> time_floors
        self.floor_arrays: dict[tuple, tuple] = {}  # (grid list key, slice's kinds and edges) -> megatron._floor_arrays
        # (grid list key, (saver enumerator, pipelined), slice's layer kinds) -> megatron._memory_arrays
        self.memory_floors: dict[tuple, tuple] = {}
        self.state_floors: dict[tuple, tuple] = {}  # slice_floors' model-state parts (``states``), any b
        self.layer_kinds: tuple[str, ...] | None = None  # the context model's, by layer (model_kinds)
        self.device = None  # the context's DeviceModel (SliceCoster's device), once a query has built it

    def model_kinds(self, model) -> tuple[str, ...]:
        """The context model's layer kinds (model.layer_kind of every layer), listed once."""
        if self.layer_kinds is None:
            self.layer_kinds = tuple(model.layer_kind(i) for i in range(model.num_layers))
        return self.layer_kinds

    def attach(self, coster: "SliceCoster") -> None:
        """Let a query's coster share the context's per-layer, embedding/head and split caches."""
        coster._layer_cache = self.layer_cache
        coster._edge_cache = self.edge_cache
        coster._split_cache = self.split_cache

    def signatures(self, coster: "SliceCoster", tp: int, pp: int, dp: int, cp: int, ep: int,
                   sizes: tuple[int, ...] | None = None) -> list[int]:
        """signature_heads' signatures alone."""
        return self.signature_heads(coster, tp, pp, dp, cp, ep, sizes)[0]

    def signature_heads(self, coster: "SliceCoster", tp: int, pp: int, dp: int, cp: int, ep: int,
                        sizes: tuple[int, ...] | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        """(signatures, heads(signatures)): each stage's signature (what SliceCoster.stage_sums depends on) of the
        grid, as the signature's number in this table: the other methods take numbers, so a signature is hashed
        once; and each distinct signature with its first stage (a one-kind pipeline's from its pattern, not by
        searching the list). ``sizes``: the grid's split
        (coster.split_sizes' answer), where the caller has it already; its stages' layer ranges are
        coster.stage_ranges(sizes), taken here only where a signature needs them (not for a slice of one kind)."""
        q = coster.q
        b = q.microbatch_sequences
        if sizes is None:
            sizes = coster.split_sizes(pp, tp, cp, ep, dp, b // dp)
        g = coster.island.gpus_per_node
        stage_gpus = tp * cp * dp
        tied = coster.model.tied_embeddings
        if len(coster.prefix) == 1 and pp > 2:
            return self._one_kind_signatures(coster, sizes, (b, tp, dp, cp, ep), stage_gpus, g, tied)
        first, last = q.layers
        counts_of = self.counts
        ids = self.sig_ids
        sids = []
        q_emb, q_head = coster.has_embedding, coster.has_head
        for j, (a, z) in enumerate(coster.stage_ranges(sizes)):
            has_emb = q_emb and a == first
            has_head = q_head and z == last
            counts = counts_of.get((a, z))  # layers per kind in [a, z): the model's, the same in every query
            if counts is None:
                counts = counts_of[a, z] = tuple(sorted(
                    (k, pre[z - first] - pre[a - first]) for k, pre in coster.prefix.items()
                    if pre[z - first] != pre[a - first]))
            tied_link = (q_emb, j if q_emb else -1) if (tied and has_head and not has_emb) else None
            nxt = None
            if j < pp - 1:
                boundary = (j + 1) * stage_gpus
                nxt = (boundary - 1) // g == boundary // g
            prev = None
            if j > 0:
                boundary = j * stage_gpus
                prev = (boundary - 1) // g == boundary // g
            sig = (b, tp, dp, cp, ep, counts, has_emb, has_head, tied_link, nxt, prev)
            sid = ids.get(sig)
            if sid is None:
                sid = ids[sig] = len(ids)
                self.state_keys.append(sig[1:9])
            sids.append(sid)
        return sids, heads(sids)

    def _one_kind_signatures(self, coster: "SliceCoster", sizes: tuple[int, ...], dims: tuple,
                             stage_gpus: int, g: int, tied: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """signature_heads() of a slice of one layer kind: a stage's signature then depends on its layer count, its
        links and whether it is the first or last stage, so the many alike middle stages of a long pipeline are
        looked up once (the same numbers as the general loop). Which stages are alike depends only on the sizes and
        the links: that pattern is found once per (sizes, stage GPUs, GPUs per node) for every query and grid."""
        kind = next(iter(coster.prefix))
        q_emb, q_head = coster.has_embedding, coster.has_head
        return self.one_kind_heads(self.known_sids(dims, kind, q_emb, q_head), sizes, dims, stage_gpus, g,
                                   (kind, q_emb, q_head, tied))

    def known_sids(self, dims: tuple, kind: str, q_emb: bool, q_head: bool) -> dict:
        """The signatures met so far of one-kind stages of a grid (``dims``: b, tp, dp, cp, ep) in slices with or
        without the embedding and head, by _pattern's stage key (one_kind_heads)."""
        known = self.stage_sids.get((dims, kind, q_emb, q_head))
        if known is None:
            known = self.stage_sids[dims, kind, q_emb, q_head] = {}
        return known

    def one_kind_heads(self, known: dict, sizes: tuple[int, ...], dims: tuple, stage_gpus: int, g: int,
                       slice_kind: tuple[str, bool, bool, bool]) -> tuple[list[int], list[tuple[int, int]]]:
        """_one_kind_signatures' answer, for a caller that holds the grid's ``known`` (known_sids) and the slice's
        (layer kind, embedding, head, tied embeddings) already (a query's hot loop: read once, not per grid)."""
        pp = len(sizes)
        pattern = self.patterns.get((sizes, stage_gpus, g))
        if pattern is None:
            pattern = self.patterns[sizes, stage_gpus, g] = self._pattern(sizes, stage_gpus, g)
        distinct, order, firsts, keys = pattern
        kind, q_emb, q_head, tied = slice_kind
        # a stage's key (size, links, first/last position, as _pattern's int) and these give its signature (pp > 2:
        # the first stage is never the last): stages met before under them are looked up by their key alone
        local = list(map(known.get, distinct))
        if None in local:
            ids = self.sig_ids
            for k, sid in enumerate(local):
                if sid is not None:
                    continue
                size, (nxt, prev), j = keys[k]
                has_emb = q_emb and j == 0
                has_head = q_head and j == pp - 1
                tied_link = (q_emb, j if q_emb else -1) if (tied and has_head and not has_emb) else None
                sig = (*dims, ((kind, size),), has_emb, has_head, tied_link, nxt, prev)
                sid = ids.get(sig)
                if sid is None:
                    sid = ids[sig] = len(ids)
                    self.state_keys.append(sig[1:9])
                known[distinct[k]] = local[k] = sid
        # distinct keys come front to back, so the first key of each signature is where that signature first is
        # (distinct keys have distinct signatures, but that is not relied on)
        if len(set(local)) == len(local):
            return list(map(local.__getitem__, order)), list(zip(local, firsts))
        seen: dict[int, int] = {}
        for sid, j in zip(local, firsts):
            seen.setdefault(sid, j)
        return list(map(local.__getitem__, order)), list(seen.items())

    def _pattern(self, sizes: tuple[int, ...], stage_gpus: int, g: int) -> tuple[tuple, list[int], list[int], tuple]:
        """A one-kind pipeline's stages alike: its distinct stage keys front to back, each stage's among them, each
        key's first stage, and what each key stands for (size, links, and position: 0 first, pp - 1 last, else 1).
        A key is one int: size, links and first / middle / last (the last stage's with its position too)."""
        pp = len(sizes)
        place = self.links.get((pp, stage_gpus, g))
        if place is None:  # (the same for every split into pp stages of this grid's GPUs)
            links = _stage_links(pp, stage_gpus, g)
            codes = [_LINK_CODE[nxt] * 9 + _LINK_CODE[prev] * 3 for nxt, prev in links]  # < 27: fits _KEY_SCALE
            codes[0] += 1
            codes[-1] += 2 + ((pp - 1) << 20)
            place = self.links[pp, stage_gpus, g] = (codes, links)
        codes, links = place
        keys = list(map(add, map(_KEY_SCALE.__mul__, sizes), codes))
        distinct = list(dict.fromkeys(keys))
        firsts = list(map(keys.index, distinct))
        at = {key: k for k, key in enumerate(distinct)}
        last = pp - 1
        meaning = tuple((sizes[j], links[j], j if j == 0 or j == last else 1) for j in firsts)
        return tuple(distinct), list(map(at.__getitem__, keys)), firsts, meaning

    def stage_rows(self, coster: "SliceCoster", grid: tuple[int, int, int, int, int], sids: Sequence[int],
                   savers: tuple[tuple[int, int, bool], ...], sizes: Sequence[int] | None = None) -> list[list[tuple]]:
        """Per stage, for every saver combination: (time_s, static_bytes, activation_bytes, dp_sync_s +
        optimizer_s) from SliceCoster.fast_stage. ``sizes``: the grid's split, where the caller has it."""
        return list(map(self.cost_stages(coster, grid, sids, savers, sizes).__getitem__, sids))

    def cost_stages(self, coster: "SliceCoster", grid: tuple[int, int, int, int, int], sids: Sequence[int],
                    savers: tuple[tuple[int, int, bool], ...], sizes: Sequence[int] | None = None) -> dict[int, list]:
        """stage_rows' numbers made where missing, by signature: the dict that holds every stage's rows under
        these savers (a caller that reads few of them takes them from it instead of a list per stage)."""
        return self._cost(coster, grid, sids, set(sids), savers, sizes)

    def saver_columns(self, savers: tuple[tuple[int, int, bool], ...], m: int, cap: float) -> "SaverColumns":
        """The dicts that hold stage_rows' and stage_columns' numbers under ``savers`` (and m, cap), for a caller
        that judges many grids under the same few saver lists (it looks them up once, not per grid)."""
        rows = self.rows.get(savers)
        if rows is None:
            rows = self.rows[savers] = {}
        key = (savers, m, cap)
        columns = self.columns.get(key)
        if columns is None:
            columns = self.columns[key] = {}
        halves = self.halves.get(savers)
        if halves is None:
            halves = self.halves[savers] = {}
        return SaverColumns(savers, rows, columns, m, cap, halves)

    def costed_columns(self, coster: "SliceCoster", grid: tuple[int, int, int, int, int], sids: Sequence[int],
                       savers: "SaverColumns", sizes: Sequence[int],
                       stage_heads: Sequence[tuple[int, int]]) -> tuple[dict[int, list], dict[int, tuple]]:
        """cost_stages, then stage_columns, of the distinct signatures (``stage_heads``: heads(sids)), under
        saver_columns' ``savers``: (rows, columns) by signature."""
        sums, rows, columns = self.sums, savers.rows, savers.columns
        new = [j for sid, j in stage_heads if sid not in sums]
        if new:
            self._cost_sums(coster, grid, sids, new, sizes)
        for sid, _ in stage_heads:
            if sid not in columns:
                row = rows.get(sid)
                if row is None:
                    halves = savers.halves[sid] = []
                    row = rows[sid] = coster.fast_rows(sums[sid], savers.savers, halves)
                columns[sid] = _columns(row, savers.m, savers.cap)
        return rows, columns

    def _cost_sums(self, coster: "SliceCoster", grid: tuple[int, int, int, int, int], sids: Sequence[int],
                   new: list[int], sizes: Sequence[int] | None) -> None:
        """The stage sums of the stages ``new`` (positions, front to back: each missing signature's first)."""
        sums = self.sums
        tp, pp, dp, cp, ep = grid
        for j, st in zip(new, coster.stage_sums(tp, pp, dp, cp, ep, stages=new, sizes=sizes)):
            sid = sids[j]
            sums[sid] = st
            # the same ZeRO / offload terms as every costed stage alike in them (any micro-batch size)
            st.zero_parts = self.zero_parts.setdefault(self.state_keys[sid], st.zero_parts)

    def _cost(self, coster: "SliceCoster", grid: tuple[int, int, int, int, int], sids: Sequence[int],
              distinct: set[int], savers: tuple[tuple[int, int, bool], ...], sizes: Sequence[int] | None) -> dict:
        """cost_stages of the signatures ``distinct`` (those of ``sids``)."""
        sums = self.sums
        missing = distinct.difference(sums)
        if missing:  # cost those stages only, each once (at its first stage); later queries reuse them by signature
            self._cost_sums(coster, grid, sids, sorted(map(sids.index, missing)), sizes)
        by_sid = self.rows.get(savers)
        if by_sid is None:
            by_sid = self.rows[savers] = {}
        halves = self.halves.get(savers)
        if halves is None:
            halves = self.halves[savers] = {}
        for sid in distinct.difference(by_sid):
            by_sid[sid] = coster.fast_rows(sums[sid], savers, halves.setdefault(sid, []))
        return by_sid

    def stage_columns(self, sids: Sequence[int], savers: tuple[tuple[int, int, bool], ...], m: int,
                      cap: float) -> dict[int, tuple]:
        """Per signature among ``sids`` (stage_rows called first), its numbers by saver combination as columns for
        judge_columns: (time_s list, tail_s list, the most micro-batches in flight that fit, the fit_depth term
        int((cap - static) // act) where m of them do not fit, else _UNLIMITED; the largest of those most, the
        least time_s and the least tail_s)."""
        return self._columns_of(set(sids), self.rows[savers], savers, m, cap)

    def _columns_of(self, distinct: set[int], rows: Mapping[int, list], savers: tuple[tuple[int, int, bool], ...],
                    m: int, cap: float) -> dict[int, tuple]:
        """stage_columns of the signatures ``distinct``, from their rows under ``savers``."""
        key = (savers, m, cap)
        by_sid = self.columns.get(key)
        if by_sid is None:
            by_sid = self.columns[key] = {}
        for sid in distinct.difference(by_sid):
            by_sid[sid] = _columns(rows[sid], m, cap)
        return by_sid

    def explained_stage(self, coster: "SliceCoster", sid: int, cfg) -> tuple:
        """stage_numbers of one costed stage (its breakdown notes embedding and head)."""
        key = (sid, cfg.zero_stage, cfg.recompute, cfg.offload)
        hit = self.explained.get(key)
        if hit is None:
            st = self.sums[sid]
            numbers, bd = coster.stage_numbers(st, cfg)
            bd["has_embedding"] = st.has_embedding
            bd["has_head"] = st.has_head
            hit = self.explained[key] = (*numbers, bd, st.p2p_bytes)
        return hit


class SaverColumns(NamedTuple):
    """StageTable.saver_columns' answer: the saver combinations, the rows and columns kept by signature under them,
    and the m and capacity the columns are judged at."""

    savers: tuple
    rows: dict
    columns: dict
    m: int
    cap: float
    halves: dict  # signature -> each combination's (forward_s, backward_s) (StageTable.halves)


def heads(sids: Sequence[int]) -> list[tuple[int, int]]:
    """Each distinct signature of a grid's stages, front to back, with its first position (where it holds the most
    micro-batches in flight)."""
    return [(sid, sids.index(sid)) for sid in dict.fromkeys(sids)]


def _stage_links(pp: int, stage_gpus: int, g: int) -> list[tuple[bool | None, bool | None]]:
    """Per stage of a pipeline of ``pp`` stages of ``stage_gpus`` GPUs laid out node by node: whether its link to
    the next and to the previous stage stays inside a node (None: no such stage)."""
    out = []
    for j in range(pp):
        nxt = prev = None
        if j < pp - 1:
            boundary = (j + 1) * stage_gpus
            nxt = (boundary - 1) // g == boundary // g
        if j > 0:
            boundary = j * stage_gpus
            prev = (boundary - 1) // g == boundary // g
        out.append((nxt, prev))
    return out


_KEY_SCALE = 32  # StageTable._pattern's int keys: size x this + links and place (< 27) + last position << 20
_LINK_CODE = {None: 0, True: 1, False: 2}  # a link to the next / previous stage: none, inside a node, between
_UNLIMITED = 2 * SATURATED  # stage_columns' depth term of a combination whose memory never limits the depth


def _columns(row: Sequence[tuple], m: int, cap: float) -> tuple:
    """stage_columns of one signature (see there), and room for its depth terms (_head_depths). A stage
    holding k micro-batches needs static + act * k bytes, which never decreases with k (nor does its float
    rounding), so the most that fit is a threshold."""
    times, tails, most, term = [], [], [], []
    for time_s, static, act, tail_s in row:
        times.append(time_s)
        tails.append(tail_s)
        if static + act * m <= cap:
            most.append(m)
            term.append(_UNLIMITED)
            continue
        if static + act > cap:  # not even one micro-batch (act may be 0 here)
            most.append(0)
            term.append(-1)
            continue
        k = int((cap - static) // act)
        term.append(k)
        k = max(1, min(k, m - 1))
        while k + 1 < m and static + act * (k + 1) <= cap:
            k += 1
        while k > 1 and static + act * k > cap:
            k -= 1
        most.append(k)
    # {}: _head_depths', by the stage's distance from the pipeline's end
    return times, tails, most, term, max(most), min(times), min(tails), {}


def judge_columns(columns: Mapping[int, tuple], sids: Sequence[int], num_microbatches: int,
                  stage_heads: Sequence[tuple[int, int]] | None = None) -> tuple[
        list[float], list[float] | None, list[float], list[int]] | None:
    """For each saver combination of a grid, from StageTable.stage_columns: (bottleneck_s, fill_s, tail_s, depth)
    lists. Per combination the plain computation is max, sum (added front to back, as Python's sum) and max of the
    stages' time, time and dp_sync_s + optimizer_s, and fit_depth of their memory; here each distinct stage is
    judged once, at its first position (where it holds the most micro-batches, so its memory and depth limit are
    tightest). Bottleneck, tail and fill are the plain computation's to the last bit; depth is fit_depth's wherever
    either is >= 0 (where a combination fits nowhere both are negative). fill is None when no combination fits, and
    INFEASIBLE_FILL for a combination that does not (nobody reads those). None instead of the four lists when one
    stage fits no combination at its place (nothing to judge). fit_depth's peak memory is left to peak_memory, for
    the rare query where nothing fits at all. ``stage_heads``: heads(sids), where the caller has them. The two
    halves: judge_heads (bottleneck, tail, depth), then judge_fill."""
    judged = judge_heads(columns, len(sids), num_microbatches, heads(sids) if stage_heads is None else stage_heads)
    if judged is None:
        return None
    bn, tail, depth = judged
    return bn, judge_fill(columns, sids, depth), tail, depth


def judge_heads(columns: Mapping[int, tuple], num_stages: int, num_microbatches: int,
                stage_heads: Sequence[tuple[int, int]]) -> tuple[list[float], list[float], list[int]] | None:
    """judge_columns' (bottleneck_s, tail_s, depth) lists of a grid of ``num_stages`` stages, from its distinct
    stages alone (``stage_heads``: heads of its signatures), or None where one fits no combination at its place."""
    m, n = num_microbatches, num_stages
    judged = []
    for sid, first in stage_heads:  # each distinct stage at its first place
        after = n - first
        inflight = after if after < m else m
        col = columns[sid]
        if inflight > col[4]:  # this stage fits no combination here (most grids of a large model)
            return None
        judged.append((col, after, inflight))
    col, after, inflight = judged[0]
    bn, tail = col[0], col[1]
    depth = col[7].get(after) or _head_depths(col, after, inflight)
    # per combination max / min of two, as the builtins pick them (the second only where strictly beyond the first)
    for col, after, inflight in judged[1:]:
        bn = [y if y > x else x for x, y in zip(bn, col[0])]
        tail = [y if y > x else x for x, y in zip(tail, col[1])]
        depth = [y if y < x else x for x, y in zip(depth, col[7].get(after) or _head_depths(col, after, inflight))]
    return bn, tail, depth


def judge_fill(columns: Mapping[int, tuple], sids: Sequence[int], depth: Sequence[int]) -> list[float] | None:
    """judge_columns' fill_s of each saver combination: its stages' times added front to back (None where no
    combination fits: depth < 0 for all)."""
    fits = [s for s, d in enumerate(depth) if d >= 0]
    if not fits:
        return None
    n = len(sids)
    stage_times = [columns[sid][0] for sid in sids]
    if len(fits) * 4 < len(depth):  # few fit: add up only theirs, stage by stage, front to back
        fill = [INFEASIBLE_FILL] * len(depth)
        for s in fits:
            f = stage_times[0][s]
            for t in stage_times[1:]:
                f += t[s]
            fill[s] = f
        return fill
    # per combination, its stages' times added front to back, one add at a time (as Python's sum of 3.11): a pass
    # per combination, or where stages are fewer than combinations a pass per stage (the same adds, fewer calls)
    if n < len(depth):
        fill = list(stage_times[0])
        for times in stage_times[1:]:
            fill = list(map(add, fill, times))
    else:
        fill = [reduce(add, times) for times in zip(*stage_times)]
    return fill


def fills_of(columns: Mapping[int, tuple], sids: Sequence[int], combos: Sequence[int]) -> list[float]:
    """judge_fill's fill_s of the saver combinations ``combos`` alone (indices; the same adds, front to back): for
    a caller that has ruled the others out without their fills."""
    times = {sid: columns[sid][0] for sid in dict.fromkeys(sids)}
    if len(combos) > 2:  # the stages' times per combination, at once
        per_combination = list(zip(*map(times.__getitem__, sids)))
        return [reduce(add, per_combination[s]) for s in combos]
    out = []
    for s in combos:
        at = {sid: t[s] for sid, t in times.items()}
        out.append(reduce(add, map(at.__getitem__, sids)))
    return out


def _head_depths(col: tuple, after: int, inflight: int) -> list[int]:
    """A distinct stage's share of judge_columns' depth, ``after`` stages from the pipeline's end (``inflight``
    micro-batches in flight there): per combination fit_depth's term - after, at most SATURATED, or -1 where the
    stage does not fit (the least of these over the stages is the depth: taking the least commutes with the
    clamp, and a negative one means "fits nowhere"). Remembered in the column: the same signature sits at the
    same distance from the end in many grids and queries."""
    hit = col[7][after] = [-1 if inflight > k else (x - after if x - after < SATURATED else SATURATED)
                           for x, k in zip(col[3], col[2])]
    return hit


_LEAST_TIME, _LEAST_TAIL = itemgetter(5), itemgetter(6)  # a stage_columns entry's least time_s and tail_s


def least_floors(columns: Mapping[int, tuple], sids: Sequence[int], num_microbatches: int,
                 stage_heads: Sequence[tuple[int, int]] | None = None) -> tuple[float, float]:
    """Under every saver combination's (m - 1) x bottleneck + fill + tail and m x bottleneck + tail
    (slice_plan.latency_floor_s, score_floor_s): the same sums of each stage's least time and tail over the
    combinations, in the same order (float rounding is monotone, so these are below to the last bit).
    ``stage_heads``: heads(sids), where the caller has them."""
    m = num_microbatches
    bn, fill, tail = least_terms(columns, sids, stage_heads)
    return (m - 1) * bn + fill + tail, m * bn + tail


def least_terms(columns: Mapping[int, tuple], sids: Sequence[int],
                stage_heads: Sequence[tuple[int, int]] | None = None) -> tuple[float, float, float]:
    """least_floors' terms: the largest least time and least tail over the distinct stages, and the least times
    added front to back (under every combination's fill to the last bit)."""
    distinct = [columns[sid] for sid in dict.fromkeys(sids)] if stage_heads is None else [
        columns[sid] for sid, _ in stage_heads]
    tail = max(map(_LEAST_TAIL, distinct))
    if len(sids) > 8:  # a long pipeline: each distinct stage's least time looked up once
        least = dict(zip(dict.fromkeys(sids) if stage_heads is None else [sid for sid, _ in stage_heads],
                         map(_LEAST_TIME, distinct)))
        return max(least.values()), reduce(add, map(least.__getitem__, sids)), tail  # (front to back)
    bn = max(map(_LEAST_TIME, distinct))
    fill = reduce(add, map(_LEAST_TIME, map(columns.__getitem__, sids)))  # front to back, one add at a time
    return bn, fill, tail


def least_heads(columns: Mapping[int, tuple], stage_heads: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """least_terms' largest least time and least tail alone, from the distinct stages (``stage_heads``): the score
    floor m x bottleneck + tail needs no fill, so a caller whose grid that floor does not rule out sums the fill
    (least_fill) only where a latency floor is needed."""
    distinct = [columns[sid] for sid, _ in stage_heads]
    return max(map(_LEAST_TIME, distinct)), max(map(_LEAST_TAIL, distinct))


def least_fill(columns: Mapping[int, tuple], sids: Sequence[int], stage_heads: Sequence[tuple[int, int]]) -> float:
    """least_terms' fill: each stage's least time added front to back (each distinct stage's looked up once)."""
    least = {sid: columns[sid][5] for sid, _ in stage_heads}
    return reduce(add, map(least.__getitem__, sids))


def peak_memory(rows: Sequence[Sequence[tuple]], s: int, num_microbatches: int) -> float:
    """fit_depth's peak0 of saver combination s: the most memory any stage needs with no stage after the slice."""
    m = num_microbatches
    n = len(rows)
    peak0 = 0.0
    for j, r in enumerate(rows):
        _time_s, static, act, _tail_s = r[s]
        mem = static + act * (n - j if n - j < m else m)
        if mem > peak0:
            peak0 = mem
    return peak0


class StageTables:
    """A few StageTables by context key, oldest dropped first (bounded memory across planning runs)."""

    def __init__(self) -> None:
        self._tables: dict[bytes, StageTable] = {}

    def get(self, key: bytes) -> StageTable:
        t = self._tables.get(key)
        if t is None:
            if len(self._tables) >= _MAX_CONTEXTS:
                self._tables.pop(next(iter(self._tables)))
            t = self._tables[key] = StageTable()
        return t


def fit_depth(memory: Sequence[tuple[float, float]], m: int, cap: float) -> tuple[int, float]:
    """(largest number of following global stages at which every stage fits, negative if none; peak memory with
    none) for stages given as (static_bytes, activation_bytes per micro-batch), front to back.

    Stage j of n holds min(n - j + D, m) micro-batches with D stages after the slice (base.StageCost.memory_bytes);
    this is SlicePlan.max_stages_after in closed form."""
    n = len(memory)
    depth = SATURATED
    peak0 = 0.0
    for j, (static, act) in enumerate(memory):
        inflight = n - j if n - j < m else m
        mem = static + act * inflight
        if mem > peak0:
            peak0 = mem
        if mem > cap:
            depth = -1
        elif depth >= 0 and static + act * m > cap:
            d = int((cap - static) // act) - (n - j)
            if d < depth:
                depth = d
    return depth, peak0

