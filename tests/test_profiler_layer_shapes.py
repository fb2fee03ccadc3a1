"""``profile --model`` on real gloo workers: every layer kind, the embedding and the head at each planned micro-batch
size, sequence length and TP shard, within the layer budget, and the cost model prices from what it wrote."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import PROCESS_GROUP_TIMEOUT_S, SUBPROCESS_TIMEOUT_S

from profiler.layer import planned_shapes
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.measured_layers import measured_layer_key
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model

BUDGET_S = 10.0
MICRO_BATCHES, SEQ_LENS, TPS = (1, 2, 4), (32, 64), (1, 2)
_PHASE = re.compile(r"\[\s*([\d.]+)s\] (.*)")


@pytest.mark.distributed
def test_profile_times_every_planned_shape_within_its_layer_budget(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--quick", "--timeout-s",
           str(PROCESS_GROUP_TIMEOUT_S), "--standalone", "--nproc-per-node", "2", "--model", "tiny",
           "--micro-batch", ",".join(map(str, MICRO_BATCHES)), "--seq-len", ",".join(map(str, SEQ_LENS)),
           "--tp", ",".join(map(str, TPS)), "--layer-budget-s", str(BUDGET_S), "--layer-dtype", "fp32",
           "-o", str(out)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                       env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    spec = ClusterSpec.load(out)
    info = spec.profile["model"]
    model = load_model("tiny")
    # the planned order: tp 1 first, then each sequence length by micro-batch; the embedding and head at tp 1 only
    jobs = [(kind, shape) for shape in planned_shapes(model, micro_batches=list(MICRO_BATCHES), seq_lens=list(SEQ_LENS),
                                                      tps=list(TPS), dtype="fp32")
            for kind in (["dense", "embedding", "head"] if shape.tp == 1 else ["dense"])]
    assert (info["planned"], info["budget_s"]) == (len(jobs), BUDGET_S)
    # a loaded host may leave the last shapes out, never the first sequence length's at tp 1
    assert 3 * len(MICRO_BATCHES) <= info["measured"] <= len(jobs)
    # the layer phases, on rank 0's clock, took about the budget: from the first layer job to the next phase
    phases = [(float(m[1]), m[2]) for m in map(_PHASE.search, r.stderr.splitlines()) if m]
    first = next(i for i, (_, name) in enumerate(phases) if name.startswith("model layer"))
    after = next(t for t, name in phases[first:] if not name.startswith("model layer"))
    assert after - phases[first][0] <= 1.5 * BUDGET_S, phases[first:]
    measured = [measured_layer_key("tiny", kind, sh.seq_len, sh.micro_batch, sh.tp) for kind, sh in jobs]
    for gpu in spec.nodes[0].gpus:
        m = gpu.measured
        assert set(m["layer_forward_s"]) == set(measured[:info["measured"]])  # the planned order's first ones
        for key in m["layer_forward_s"]:  # (the embedding's backward is small enough to drown in a loaded host)
            assert m["layer_forward_backward_s"][key] > 0 and m["layer_forward_s"][key] > 0, key
            assert m["layer_activation_bytes"][key] > 0, key
            if "|dense|" in key:
                assert m["layer_forward_backward_s"][key] > m["layer_forward_s"][key], key
        # autograd saves a layer's activations in proportion to its rows
        act = {b: m["layer_activation_bytes"][measured_layer_key("tiny", "dense", SEQ_LENS[0], b, 1)]
               for b in MICRO_BATCHES}
        assert all(act[b] == b * act[1] for b in MICRO_BATCHES), act
        # the cost model prices a micro-batch between two measured ones from the measurements
        lc = layer_compute(model, 0, seq_len=SEQ_LENS[0], mbs=3, tp=1, cp=1, ep=1,
                           dev=DeviceModel.from_gpu(gpu, "fp32"))
        assert lc.measured and lc.priced.how == "interpolated"
        lo, hi = (m["layer_forward_s"][measured_layer_key("tiny", "dense", SEQ_LENS[0], b, 1)] for b in (2, 4))
        assert min(lo, hi) <= lc.forward_s <= max(lo, hi)


@pytest.mark.distributed
def test_back_to_back_layer_timing_times_every_shape_in_blocks(tmp_path: Path) -> None:
    """``--layer-timing back-to-back`` reaches every worker: each layer figure comes from blocks of calls without
    pause (what a CFS-throttled CPU device needs to show its mean speed), none from single calls."""
    out = tmp_path / "cluster.yaml"
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--quick", "--timeout-s",
           str(PROCESS_GROUP_TIMEOUT_S), "--standalone", "--nproc-per-node", "2", "--model", "tiny",
           "--micro-batch", "2", "--seq-len", "32", "--tp", "1", "--layer-budget-s", "6", "--layer-dtype", "fp32",
           "--layer-timing", "back-to-back", "-o", str(out)]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                       env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin",
                            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    spec = ClusterSpec.load(out)
    measured = spec.profile["model"]["measured"]  # of the layer, the embedding and the head at the one shape
    assert measured >= 1  # a loaded host may leave the last ones out of the budget, never the first
    timed = [figure["timed"] for device in spec.profile["devices"] for job in device["layer"].values()
             for figure in (job["forward"], job["forward_backward"])]
    assert len(timed) == 2 * measured * 2  # ranks x kinds measured x (forward, forward+backward)
    assert all(t.endswith("back-to-back calls, each block followed by an all-to-all") for t in timed), timed
    if measured == 3:  # every part at the one shape: the stage-like sequence is timed in blocks beside their sum
        for gpu in (g for node in spec.nodes for g in node.gpus):
            whole, parts = gpu.measured["stage_sequence_s"], gpu.measured["stage_sequence_parts_s"]
            assert set(whole) == set(parts) == {"2"} and whole["2"] > 0 and parts["2"] > 0, gpu.measured
