"""An MoE run saved under expert parallelism resumes without it: experts are kept by global expert index.

Real launches on CPU with the torch example: layout A (2 ranks, one stage, dp 2, ep 2: each rank holds 2 of the
4 experts of every MoE layer) trains 4 steps without interruption, saving at steps 2 and 4; layout B (2 ranks, two
pipeline stages, ep 1: stage 0 needs all experts of layer 1, which A's two ranks wrote) resumes from step 2 and trains
steps 3-4, whose losses must equal A's; so must those of layout C (4 ranks, dp 4, ep 4: one expert per rank). All
layouts route micro-batches of 2 sequences, so the token groups that share the auxiliary losses are the same (see
tests/test_moe_torch.py).
"""
from __future__ import annotations

import json
import os

import pytest

from helpers_plans import make_plan
from tangram_launch.checkpoint import store
from test_resume import EXAMPLES, _cli

LAYOUT_EP2 = [{"layers": 4, "gpus": "local", "dp": 2, "ep": 2}]  # micro-batches of 8 / (2 x 2) = 2 sequences
LAYOUT_PP2_EP1 = [(2, "local"), (2, "local")]  # micro-batches of 8 / 4 = 2 sequences
LAYOUT_EP4 = [{"layers": 4, "gpus": "local", "dp": 4, "ep": 4}]


@pytest.mark.distributed
def test_expert_parallel_checkpoint_resumes_without_expert_parallelism_and_with_more(tmp_path):
    plan_a, plan_b = tmp_path / "A.json", tmp_path / "B.json"
    make_plan("tiny-moe", LAYOUT_EP2, global_batch=8, num_microbatches=2, seq_len=32).dump(str(plan_a))
    make_plan("tiny-moe", LAYOUT_PP2_EP1, global_batch=8, num_microbatches=4, seq_len=32).dump(str(plan_b))
    example, ckpt = str(EXAMPLES / "train_gpt.py"), tmp_path / "ckpt"
    a = _cli(tmp_path, "--nproc-per-node", "2", "--plan", str(plan_a), example, "--steps", "4", "--save-dir",
             str(ckpt), "--save-every", "2", "--out", "a.json")
    assert a.returncode == 0, a.stderr[-3000:]
    manifest = store.read_manifest(str(ckpt / "step_2"))
    experts = {k.split(".")[4] for k in manifest["model"] if k.startswith("layers.1.mlp.experts.")}
    assert experts == {"0", "1", "2", "3"}  # written by two ranks, two experts each, under global indices
    os.remove(ckpt / "step_4" / store.MANIFEST)  # resume from step 2

    b = _cli(tmp_path, "--nproc-per-node", "2", "--plan", str(plan_b), "--resume", str(ckpt), example, "--steps",
             "4", "--out", "b.json")
    assert b.returncode == 0, b.stderr[-3000:]
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert ra["steps"] == [1, 2, 3, 4] and rb["steps"] == [3, 4]
    assert rb["resumed"]["step"] == 2 and rb["resumed"]["layout_changed"]
    assert rb["losses"] == pytest.approx(ra["losses"][2:], rel=1e-5, abs=1e-6)
    assert ra["losses"][3] < ra["losses"][0]  # it trains

    # and on 4 ranks with EP=4 (one expert per rank; micro-batches of 8 / 4 = 2 sequences again)
    plan_c = tmp_path / "C.json"
    make_plan("tiny-moe", LAYOUT_EP4, global_batch=8, num_microbatches=1, seq_len=32).dump(str(plan_c))
    c = _cli(tmp_path, "--nproc-per-node", "4", "--plan", str(plan_c), "--resume", str(ckpt), example, "--steps",
             "4", "--out", "c.json")
    assert c.returncode == 0, c.stderr[-3000:]
    rc = json.loads((tmp_path / "c.json").read_text())
    assert rc["steps"] == [3, 4] and rc["losses"] == pytest.approx(ra["losses"][2:], rel=1e-5, abs=1e-6)
