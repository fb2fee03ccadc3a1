"""``current_plan().plan`` is built from the bytes the worker verified at start, not from the file read again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tangram_launch import worker as W

PLAN = Path(__file__).resolve().parent.parent / "examples" / "data" / "plan-tiny-2cpu.json"


def test_the_plan_is_read_once_and_a_later_change_of_the_file_does_not_reach_it(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    shutil.copy(PLAN, path)
    data = path.read_bytes()
    monkeypatch.setenv(W.ENV_PLAN_FILE, str(path))
    monkeypatch.setenv(W.ENV_PLAN_HASH, W.sha256_bytes(data))
    monkeypatch.setenv(W.ENV_NODE, "local")
    monkeypatch.setenv("RANK", "0")
    me = W.current_plan()
    changed = json.loads(data)
    changed["num_microbatches"] = 2
    changed["training"]["global_batch"] = 4
    path.write_text(json.dumps(changed))  # another plan appears under the same name while ranks start
    assert me.plan.num_microbatches == 4 and me.plan.training["global_batch"] == 8
    assert me.plan_hash == W.sha256_bytes(data)
