"""Slice queries made cheaper (issue 41: the exact search over every micro-batch size asks many more of them) answer
exactly what the plain paths answer: the score floor read before a grid's least fill is summed, a one-kind slice's
signatures and split from inputs kept per grid list (GridIndex.known), not rebuilt per grid and query, and one
grid's saver combinations compared on their distinct stages in exact_front."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.costmodel.breakdown import SliceCoster
from tangram_launch.costmodel.grid import StageTable, heads, least_fill, least_heads, least_terms
from tangram_launch.costmodel.partition import balanced_split
from tangram_launch.costmodel.slice_plan import latency_floor_s, score_floor_s
from tangram_launch.parallelizers import megatron
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec
from helpers_islands import uniform_island

# a one-kind model deep enough for pipelines of more than two stages (the one-kind signature path) and its MoE twin
DEEP = ModelSpec(name="d12", num_layers=12, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=11008,
                 vocab_size=32000, max_seq_len=1024, tied_embeddings=True)
DEEP_MOE = ModelSpec(name="d12-moe", num_layers=12, hidden_size=2048, num_heads=16, num_kv_heads=8,
                     ffn_hidden_size=4096, vocab_size=32000, max_seq_len=1024, num_experts=8, top_k=2,
                     moe_layer_frequency=2)
TRAIN = TrainingSpec(global_batch=32, seq_len=1024, dtype="fp16")
GPUS = ("a100-80gb", "v100-32gb", "t4")


_island = uniform_island


def _seen(r):
    """What a query answers: its plans (numbers and built stages, in order) and its counters."""
    return ([(p.layers, p.numbers(), p.stages) for p in r.plans], r.infeasible, r.configs_evaluated, r.bounded,
            r.screened)


def _plain_search(mp: pytest.MonkeyPatch) -> None:
    """Queries from here on take the general paths: StageTable.signature_heads and SliceCoster.split_sizes per grid
    (no one-kind inputs kept per grid list), every least fill summed before the score floor is read, and
    exact_front comparing every stage of two points (not one grid's distinct stages once)."""
    init, keep, front = megatron._GridSearch.__init__, megatron._GridSearch._keep_bounded, megatron._front

    def general(self, *a, **k):
        init(self, *a, **k)
        self.one_kind = None

    def eager(self, i, allowed, stages, columns, judged, grid_cut, least):
        if least[0] is None:
            least = [least_fill(columns, stages.sigs, least[1]), least[1]]
        keep(self, i, allowed, stages, columns, judged, grid_cut, least)

    mp.setattr(megatron._GridSearch, "__init__", general)
    mp.setattr(megatron._GridSearch, "_keep_bounded", eager)
    mp.setattr(megatron, "_front", lambda points, stage_times, alike=None: front(points, stage_times))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), stages=st.integers(1, 40), kinds=st.integers(1, 5), savers=st.integers(1, 6))
def test_least_heads_and_least_fill_are_least_terms_to_the_last_bit(data, stages, kinds, savers):
    """The score floor's terms (least_heads) and the fill summed apart (least_fill) are least_terms' numbers, for
    short pipelines and long ones (least_terms adds those two ways)."""
    seconds = st.floats(0.0, 5.0, allow_nan=False)
    pool = [[(data.draw(seconds), 1.0, 1.0, data.draw(seconds)) for _ in range(savers)] for _ in range(kinds)]
    sigs = [data.draw(st.integers(0, kinds - 1)) for _ in range(stages)]
    table = StageTable()
    key = tuple((0, 0, False) for _ in range(savers))
    table.rows[key] = dict(enumerate(pool))
    columns = table.stage_columns(sigs, key, 4, 1e12)
    bn, fill, tail = least_terms(columns, sigs, heads(sigs))
    assert least_heads(columns, heads(sigs)) == (bn, tail)
    assert least_fill(columns, sigs, heads(sigs)) == fill


@settings(max_examples=40, deadline=None)
@given(gpu=st.sampled_from(GPUS), per_node=st.sampled_from([2, 4, 8]), start=st.integers(0, 11),
       length=st.integers(2, 12), b=st.sampled_from([1, 2, 4]), data=st.data())
def test_a_one_kind_split_from_kept_weights_is_the_general_split(gpu, per_node, start, length, b, data):
    """SliceCoster.one_kind_split under one_kind_weights is balanced_split of the slice's layers each weighing the
    kind's rounded weight, with the embedding's and head's extras (split_sizes' general path)."""
    stop = min(12, start + length)
    if stop - start < 2:
        return
    q = SliceQuery(model=DEEP, training=TRAIN, layers=(start, stop), island=_island(gpu, per_node, 1),
                   microbatch_sequences=b, capabilities=MEGATRON)
    coster = SliceCoster(q)
    if coster.device_error:
        return
    tp, dp = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([d for d in (1, 2) if b % d == 0]))
    pp = data.draw(st.integers(2, stop - start))
    (w,), fe, le = coster._split_weights(tp, 1, 1, dp, b // dp)
    expected = balanced_split((w,) * (stop - start), pp, first_extra=fe, last_extra=le)
    assert coster.one_kind_split(coster.one_kind_weights(tp, 1, 1, dp, b // dp), pp) == expected
    assert coster.split_sizes(pp, tp, 1, 1, dp, b // dp) == expected


@pytest.mark.slow  # many whole-model queries, each twice: the slow tier keeps the unit tier short
@settings(max_examples=40, deadline=None)
@given(gpu=st.sampled_from(GPUS), per_node=st.sampled_from([1, 2, 4, 8]), nodes=st.integers(1, 4),
       b=st.sampled_from([1, 2, 4]), caps=st.sampled_from([TORCH, DEEPSPEED, MEGATRON]), moe=st.booleans(),
       cuts=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)))
def test_queries_of_many_slices_answer_as_the_general_paths(gpu, per_node, nodes, b, caps, moe, cuts):
    """One parallelizer answers slices of every length, with and without the embedding and head, unbounded and
    under bounds that cut from none to all of their plans (its per-grid-list inputs kept across those queries):
    the same plans in the same order, and the same counters, as the general paths with a fresh parallelizer."""
    model = DEEP_MOE if moe else DEEP
    if model.is_moe and not caps.expert_parallel:
        return
    isl = _island(gpu, per_node, nodes)
    shared = MegatronParallelizer()
    for layers in ((0, 12), (2, 12), (0, 9), (3, 10), (4, 5), (1, 12)):
        q = SliceQuery(model=model, training=TRAIN, layers=layers, island=isl, microbatch_sequences=b,
                       capabilities=caps)
        queries = [q]
        full = MegatronParallelizer().query(q)
        if full.plans:
            m = q.num_microbatches
            lats = sorted(latency_floor_s(p.numbers(), m) for p in full.plans)
            scores = sorted(score_floor_s(p.numbers(), m) for p in full.plans)
            queries.append(replace(q, latency_bound_s=lats[min(len(lats) - 1, int(cuts[0] * len(lats)))],
                                   score_bound_s=scores[min(len(scores) - 1, int(cuts[1] * len(scores)))]))
        for query in queries:
            fast = shared.query(query)
            with pytest.MonkeyPatch.context() as mp:
                _plain_search(mp)
                plain = MegatronParallelizer().query(query)
            assert _seen(fast) == _seen(plain)
