"""Floors a parallelizer prunes grids by, from a SliceCoster's per-layer terms: the least compute time of a stage's
layers, and the least memory a pipeline's stages need. The coster computes costs; these read its terms
(SliceCoster.layer_terms, edges) and say what no configuration of a grid can go below. planner/bounds.py lists them
with the test that checks each.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

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
            per_kind[k] += t.tp_fwd_s + t.tp_bwd_s + t.cp_fwd_s + t.cp_bwd_s + t.ep_fwd_s + t.ep_bwd_s
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
    shard, eshard = dp * cp, tp * dp * cp // (coster.etp(tp) * ep)  # expert grid (etp, ep, edp): SliceCoster
    pairs = tuple(sorted({(z, off) for z, _r, off in savers}))
    cache = {} if states is None else states

    def per_param(n: int) -> float:  # the least model-state bytes per parameter over the savers
        hit = cache.get(("per parameter", n, pairs))
        if hit is None:
            hit = cache["per parameter", n, pairs] = min(
                model_state_bytes(1.0, shard=n, zero_stage=z, offload=off, param_bytes=pb, grad_bytes=gb,
                                  optimizer_bytes=ob).total  # stored per parameter, held or not: the lesser
                for z, off in pairs for held in (True, False) for pb, gb, ob in (coster.kept_state_bytes(
                    z, off, held=held),))
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
    t = coster.layer_terms(kind, tp, cp, ep, dp, mbs)
    shard, eshard = dp * cp, tp * dp * cp // (coster.etp(tp) * ep)  # expert grid (etp, ep, edp): SliceCoster
    whole = coster.has_embedding and coster.has_head  # a slice of the whole model: its stages may or may not pipeline
    # (zero, offload) -> (layer's, per parameter), under the keys of what else they read
    cache = {} if states is None else states
    out = []
    for z, r, off in savers:
        held = held_under_pipelining(z)  # a pipelined stage holds ZeRO-1's states and no gathered working set
        key = ("layer states", kind, tp, cp, ep, dp, whole, z, off)
        hit = cache.get(key)
        if hit is None:  # a whole-model slice's stages pipeline (ZeRO-1's states) or not: the lesser of each part
            choices = (1,) if held and not whole else (z, 1) if held else (z,)
            # stored per parameter under the stage's own ZeRO stage, held (ZeRO-1's states: zs 1) or not
            parts = [_layer_states(t, shard, eshard, zs, off, *coster.kept_state_bytes(z, off, held=zs != z))
                     for zs in choices]
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


def layers_held(needs: np.ndarray, room_bytes: float, inflight: np.ndarray, most: int) -> np.ndarray:
    """The most layers (up to ``most``) a stage with each of ``inflight`` micro-batches in flight (columns) holds
    under each row of ``needs`` (a saver combination's per-layer (model states, activations per micro-batch,
    working sets): stage_need_parts' floors): n layers need at least n x (states + inflight x activations) +
    working sets, which must be within ``room_bytes`` (the capacity less the runtime overhead). The quotient is
    checked one up and one down, so that float rounding never makes it one short (which would raise the floors
    built on it)."""
    state, act, working = needs[:, 0:1], needs[:, 1:2], needs[:, 2:3]
    per_layer = state + inflight[None, :] * act
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.floor((room_bytes - working) / per_layer)
    n = np.clip(np.where(per_layer > 0.0, n, most), -1.0, most)  # (nothing per layer: memory bounds no stage)
    n = np.where((n + 1.0) * per_layer + working <= room_bytes, n + 1.0, n)
    n = np.where((n >= 1.0) & (n * per_layer + working > room_bytes), n - 1.0, n)
    return np.clip(n, 0.0, most).astype(np.int64)


def least_bottlenecks_s(per_layer_s: Sequence[float], most_stages: Sequence[int], layers_room: Sequence[int],
                        fewest_stages: Sequence[int], num_layers: int) -> list[float]:
    """out[x], x = 0 .. ``num_layers``: a floor under the slowest stage's seconds of any slice plan of x layers
    on one of some options (inf: none holds x layers). An option is one grid (tp, cp, ep, dp) under one recompute
    mode: a layer's least seconds there (``per_layer_s``), the most stages of its plans (``most_stages``) and
    the fewest (``fewest_stages``), and the most layers its most stages hold in all (``layers_room``: at their
    micro-batches in flight, layers_held). Every stage of a slice plan runs one grid and one saver combination,
    so a plan of pp <= x stages holding x layers has a stage of ceil(x / pp) layers or more, whose time is at
    least that many times the layer's seconds (a stage's time only adds to its layers'); and it holds no more
    than its pp stages do, which more stages only raise (a stage in front of the others does not change their
    micro-batches in flight)."""
    L = num_layers
    if not len(per_layer_s):
        return [0.0] + [math.inf] * L
    x = np.arange(L + 1)[None, :]
    most = np.asarray(most_stages, dtype=np.int64)[:, None]
    vals = np.asarray(per_layer_s, dtype=np.float64)[:, None] * (-(-x // most))
    vals[(x > np.asarray(layers_room)[:, None]) | (x < np.asarray(fewest_stages)[:, None])] = np.inf
    out = vals.min(axis=0)
    out[0] = 0.0
    return out.tolist()
