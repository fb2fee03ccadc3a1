"""The worker's layer jobs, in one process: every planned shape in order while the budget lasts, a shape the device
cannot hold left out (the others still measured)."""
from __future__ import annotations

import argparse
import time

import torch

from profiler import bench, layer
from profiler.worker import Progress, RankEnv, _profile_layer


def _args(**kw) -> argparse.Namespace:
    base = dict(model="tiny", seq_len=[32], micro_batch=[1, 2, 4], tp=[1, 2], layer_budget_s=None, layer_dtype="fp32",
                quick=True)
    return argparse.Namespace(**{**base, **kw})


def _run(args):
    env = RankEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)
    cfg = bench.BenchConfig.for_device("cpu", quick=True)
    return _profile_layer(args, torch.device("cpu"), cfg, Progress(None, env, "host", verbose=False))


def test_a_shape_that_does_not_fit_is_left_out_and_the_rest_measured(monkeypatch):
    calls = []

    def fake(model, kind, shape, device, **kw):
        calls.append((kind, shape.micro_batch, shape.tp))
        if shape.micro_batch == 4 and kind == "dense":
            raise torch.OutOfMemoryError("no room")
        return {"forward": kind}

    monkeypatch.setattr(layer, "time_layer", fake)
    out, info, stand_in = _run(_args())
    # tp 1 first (dense, embedding, head per micro-batch), then the tp 2 shards (dense only)
    assert calls == [(k, b, 1) for b in (1, 2, 4) for k in ("dense", "embedding", "head")] + [
        ("dense", b, 2) for b in (1, 2, 4)]
    assert len(out) == len(calls) - 2 and info["planned"] == len(calls) and info["measured"] == len(out)
    assert not any(key.startswith("dense|b=4") for key in out)
    stand_in()  # the collective-wait stand-in still runs a layer


def test_a_spent_budget_stops_at_the_same_job_on_every_member(monkeypatch):
    seen = []

    def slow(model, kind, shape, device, **kw):
        seen.append(kw["budget_s"])
        time.sleep(0.05)  # longer than a job's share of the budget
        return {"forward": kind}

    monkeypatch.setattr(layer, "time_layer", slow)
    out, info, _ = _run(_args(layer_budget_s=0.1))
    assert 1 <= info["measured"] < info["planned"] == 12 and len(out) == info["measured"] == len(seen)
    assert all(b == 0.1 / 12 for b in seen)  # each job's share of the budget
