"""Floors a parallelizer prunes grids by, from a SliceCoster's per-layer terms: the least compute time of a stage's
layers, and the least memory a pipeline's stages need. The coster computes costs; these read its terms
(SliceCoster.layer_terms, edges) and say what no configuration of a grid can go below. planner/bounds.py lists them
with the test that checks each.
"""
from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Sequence

from tangram_launch.costmodel.memory import held_under_pipelining, model_state_bytes
from tangram_launch.costmodel.op_sac import OP_SAC_POLICIES
from tangram_launch.specs.constants import RECOMPUTE_MODES

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.costmodel.breakdown import SliceCoster


def time_floors(coster: "SliceCoster", tp: int, cp: int, ep: int, dp: int, *, with_comm: bool = False) -> tuple[
        dict[str, float], float, float]:
    """Floors under stage times on this grid: forward + backward compute per layer of each kind, of the
    embedding and of the head (0 where the slice has none). SliceCoster.fast_stage only adds to these (recompute,
    TP/CP/EP and p2p communication, exposed ZeRO collectives), so a stage takes at least the sum of its layers'
    floors: the planner's incumbent bound skips grids with them before costing their stages. ``with_comm``: plus the
    TP / CP / EP communication every stage pays whatever its memory savers (SliceCoster.fast_stage's fixed terms
    less p2p; the split's weights): the tighter floor the parallelizer skips a grid by."""
    mbs = coster.q.microbatch_sequences // dp
    per_kind = {}
    for k in coster.prefix:
        t = coster.layer_terms(k, tp, cp, ep, dp, mbs)
        per_kind[k] = t.fwd_s + t.bwd_s
        if with_comm:
            per_kind[k] += 2 * t.tp_fwd_s + t.cp_fwd_s + t.cp_bwd_s + t.ep_fwd_s + t.ep_bwd_s
    emb_s = head_s = 0.0
    if coster.has_embedding or coster.has_head:
        e = coster.edges(tp, cp, dp, mbs)
        if coster.has_embedding:
            emb_s = e["emb_fwd_s"] + e["emb_bwd_s"] + (e["emb_tp_s"] if with_comm else 0.0)
        if coster.has_head:
            head_s = e["head_fwd_s"] + e["head_bwd_s"] + (2 * e["head_tp_s"] if with_comm else 0.0)
    return per_kind, emb_s, head_s


def memory_floor_bytes(coster: "SliceCoster", tp: int, cp: int, ep: int, dp: int,
                       savers: Sequence[tuple[int, int, bool]], *,
                       states: dict | None = None) -> tuple[dict[str, float], float, float]:
    """Floors under a pipeline's memory for one micro-batch in flight under ``savers``, per layer of each kind
    and for the embedding and the head: a pipeline of this grid whose stages hold these needs, summed, at
    least what they add up to (static + activation bytes; runtime overhead left out). Over its stages that sum
    is under the heaviest stage's need, so a grid whose floor / pp is over the capacity fits no combination.

    Model-state bytes are linear in a stage's parameters under each saver, and activations in its layers under
    each recompute mode: the least coefficient of each (dense and expert states apart) times the layer's count
    is under every split's sum of per-stage least needs (working sets, edge activations and a tied head's
    copy only add). ``states``: a dict kept across calls of one context (its SliceCoster.state_bytes), where the
    model-state parts, which do not depend on the micro-batch size, are remembered."""
    mbs = coster.q.microbatch_sequences // dp
    pb, gb, ob = coster.state_bytes  # stored per parameter (SliceCoster.state_bytes)
    shard, eshard = dp * cp, tp * dp * cp // (coster.etp(tp) * ep)  # expert grid (etp, ep, edp): SliceCoster
    pairs = tuple(sorted({(z, off) for z, _r, off in savers}))
    cache = {} if states is None else states

    def per_param(n: int) -> float:  # the least model-state bytes per parameter over the savers
        hit = cache.get(("per parameter", n, pairs))
        if hit is None:
            hit = cache["per parameter", n, pairs] = min(
                model_state_bytes(1.0, shard=n, zero_stage=z, offload=off, param_bytes=pb, grad_bytes=gb,
                                  optimizer_bytes=ob).total for z, off in pairs)
        return hit

    dense_b, expert_b = per_param(shard), per_param(eshard)
    recomputes = {r for _zero, r, _off in savers}
    per_kind = {}
    for k in coster.prefix:
        t = coster.layer_terms(k, tp, cp, ep, dp, mbs)
        per_kind[k] = (t.dense_params * dense_b + t.expert_params * expert_b
                       + min(t.act_bytes[r] for r in recomputes) * coster.fragmentation)
    return (per_kind, coster.model.embedding_params() / tp * dense_b, coster.model.head_params() / tp * dense_b)


def stage_need_terms(coster: "SliceCoster", tp: int, cp: int, ep: int, dp: int, savers: Sequence[tuple[int, int, bool]],
                     kind: str, *, states: dict | None = None) -> list[tuple[float, float]]:
    """Per saver combination (a, b): a stage of n >= 1 layers of ``kind`` on this grid needs at least a x n + b
    bytes for one micro-batch in flight (model states and activations by the layer; the working sets of
    ZeRO-3 and full recompute; the embedding, head and runtime overhead left out, which only add). The stage
    with the most layers of a one-kind slice holds at least ceil(layers / pp) of them. ``states``: as
    stage_need_parts'."""
    return [(state + act, working) for state, act, working, _per_param in stage_need_parts(
        coster, tp, cp, ep, dp, savers, kind, states=states)[0]]


def _layer_states(t, shard: int, eshard: int, zero: int, offload: bool, pb: float, gb: float,
                  ob: float) -> tuple[float, float]:
    """(a layer's model-state bytes, bytes per dense parameter) under one ZeRO stage."""
    per_param = model_state_bytes(1.0, shard=shard, zero_stage=zero, offload=offload, param_bytes=pb, grad_bytes=gb,
                                  optimizer_bytes=ob).total
    state = model_state_bytes(t.dense_params, shard=shard, zero_stage=zero, offload=offload, param_bytes=pb,
                              grad_bytes=gb, optimizer_bytes=ob).total
    if t.expert_params:
        state += model_state_bytes(t.expert_params, shard=eshard, zero_stage=zero, offload=offload, param_bytes=pb,
                                   grad_bytes=gb, optimizer_bytes=ob).total
    return state, per_param


def stage_need_parts(coster: "SliceCoster", tp: int, cp: int, ep: int, dp: int, savers: Sequence[tuple[int, int, bool]],
                     kind: str, *, states: dict | None = None) -> tuple[list[tuple[float, float, float, float]], float,
                                                                      float]:
    """Per saver combination, what stage_need_terms adds up: a layer's model-state bytes, its activation bytes
    per micro-batch in flight, the working sets (ZeRO-3's gathered layer; full recompute's one layer rebuilt,
    where the stage holds a layer), and the model-state bytes per dense parameter (for the embedding's or the
    head's on a stage); then the embedding's and the head's activation bytes per micro-batch in flight. A stage
    of n >= 1 layers with k micro-batches in flight and e dense edge parameters needs at least
    n x (state + k x act) + e x per_param + working (+ k x the edges' activations it holds). ``states``: a dict kept
    across calls of one context (its SliceCoster.state_bytes), where each (zero, offload)'s layer and per-parameter
    model-state bytes, which do not depend on the micro-batch size, are remembered."""
    mbs = coster.q.microbatch_sequences // dp
    tr = coster.training
    pb, gb, ob = coster.state_bytes  # stored per parameter (SliceCoster.state_bytes)
    t = coster.layer_terms(kind, tp, cp, ep, dp, mbs)
    shard, eshard = dp * cp, tp * dp * cp // (coster.etp(tp) * ep)  # expert grid (etp, ep, edp): SliceCoster
    whole = coster.has_embedding and coster.has_head  # a slice of the whole model: its stages may or may not pipeline
    # (zero, offload) -> (layer's, per parameter), under the keys of what else they read
    cache = {} if states is None else states
    out = []
    for z, r, off in savers:
        held = held_under_pipelining(z, off)  # a pipelined stage holds ZeRO-1's states and no gathered working set
        key = ("layer states", kind, tp, cp, ep, dp, whole, z, off)
        hit = cache.get(key)
        if hit is None:  # a whole-model slice's stages pipeline (ZeRO-1's states) or not: the lesser of each part
            choices = (1,) if held and not whole else (z, 1) if held else (z,)
            parts = [_layer_states(t, shard, eshard, zs, off, pb, gb, ob) for zs in choices]
            hit = cache[key] = (min(x for x, _ in parts), min(y for _, y in parts))
        working = ((t.dense_params + t.expert_params) * (2 * tr.param_bytes + tr.grad_bytes) if z >= 3 and not held
                   else 0.0)
        if RECOMPUTE_MODES[r] == "full":  # _rec_part's working set: one layer's activations, rebuilt
            working += t.act_bytes[0]
        elif RECOMPUTE_MODES[r] == "selective" and coster.selective_policy in OP_SAC_POLICIES:
            working += t.act_bytes[0] - t.act_bytes[1]
        out.append((hit[0], t.act_bytes[r] * coster.fragmentation, working * coster.fragmentation, hit[1]))
    e = coster.edges(tp, cp, dp, mbs)
    return out, e["emb_act"] * coster.fragmentation, e["head_act"] * coster.fragmentation


def layers_held(needs: Sequence[tuple[float, float, float]], room_bytes: float, inflight: int) -> int:
    """The most layers a stage with ``inflight`` micro-batches in flight can hold under any of ``needs`` ((model
    states, activations per micro-batch, working sets) per layer: stage_need_parts' floors, a saver combination
    each): n layers need at least n x (states + inflight x activations) + working sets, which must be within
    ``room_bytes`` (the capacity less the runtime overhead). Counted up from the quotient, so that float rounding
    never makes it one short (which would raise the floors built on it)."""
    most = 0
    for state, act, working in needs:
        per_layer, left = state + inflight * act, room_bytes - working
        if left < 0.0:
            continue
        if per_layer <= 0.0:
            return 1 << 30  # (nothing per layer: memory bounds no stage)
        n = max(0, int(left // per_layer) - 1)
        while (n + 1) * per_layer + working <= room_bytes:
            n += 1
        most = max(most, n)
    return most


def least_bottlenecks_s(modes: Sequence[tuple[float, Sequence[int]]], stage_counts: Sequence[int],
                        num_layers: int) -> list[float]:
    """out[x], x = 0 .. ``num_layers``: a floor under the slowest stage's seconds of any slice plan of x layers on
    one grid (tp, cp, ep, dp) whose stage count is one of ``stage_counts`` (inf: none holds x layers).

    ``modes``: per recompute mode, (a layer's least seconds under it, held), held[i] the most layers the stage
    i + 1 places from the slice's end can hold under that mode (layers_held at its micro-batches in flight, fewer
    the further in front: nonincreasing). Every stage of a slice plan runs one grid and one saver combination, so
    a plan of pp stages splits x layers as n_1 .. n_pp from the back with n_i <= held[i - 1], and its slowest stage
    takes at least max n_i x the layer's seconds (its stage time only adds to its layers'), at least c x seconds
    with c the least count for which sum min(held[i], c) >= x. More stages only add room (a stage in front of the
    others does not change theirs), so the most stages up to x of those whose front stage holds a layer give the
    least c."""
    L = num_layers
    out = [0.0] + [math.inf] * L
    for per_layer_s, held in modes:
        pps = sorted(pp for pp in stage_counts if pp <= len(held) and held[pp - 1] >= 1)
        if not pps:
            continue
        room = list(itertools.accumulate(held[:pps[-1]], initial=0))  # room[pp]: the layers pp stages hold
        j = 0
        for x in range(pps[0], L + 1):
            while j + 1 < len(pps) and pps[j + 1] <= x:
                j += 1
            pp = pps[j]
            if room[pp] < x:
                continue
            c = -(-x // pp)
            if held[pp - 1] < c:  # the front stage cannot take an even share: the others take more
                while sum(h if h < c else c for h in held[:pp]) < x:
                    c += 1
            t = per_layer_s * c
            if t < out[x]:
                out[x] = t
    return out
