"""One adapter protocol for every runtime, and the Megatron adapter reading its plan as safely as current_plan."""
from __future__ import annotations

import inspect

import pytest
from helpers_plans import make_plan

from runtime_adapters.base import RuntimeAdapter
from runtime_adapters.registry import BUILTIN_ADAPTERS, get_adapter
from tangram_launch import worker as W


@pytest.mark.parametrize("name", sorted(BUILTIN_ADAPTERS))
def test_every_builtin_adapter_sets_up_a_plan_and_place_the_same_way(name):
    adapter = get_adapter(name)
    assert isinstance(adapter, RuntimeAdapter) and adapter.name == name
    params = list(inspect.signature(adapter.setup).parameters.values())
    assert [p.name for p in params[:2]] == ["plan", "place"]
    assert params[1].default is None  # place defaults to plan.place(this rank)
    assert all(p.kind is p.KEYWORD_ONLY for p in params[2:])  # runtime options by name only


def test_an_adapter_without_setup_cannot_be_made():
    class Half(RuntimeAdapter):
        name = "half"

    with pytest.raises(TypeError):
        Half()


def test_megatron_plan_from_env_refuses_a_plan_changed_since_launch(tmp_path):
    from runtime_adapters import megatron_adapter as MA

    plan = make_plan("tiny", [(2, "n0"), (2, "n0")], global_batch=4, num_microbatches=2)
    path = tmp_path / "plan.json"
    plan.dump(path)
    digest = W.sha256_bytes(path.read_bytes())
    got, place = MA.plan_and_place_from_env({W.ENV_PLAN_FILE: str(path), W.ENV_PLAN_HASH: digest, "RANK": "1"})
    assert got == plan and place.stage.index == 1
    # a plan given by hand (no hash) is read as it is
    assert MA.plan_and_place_from_env({W.ENV_PLAN_FILE: str(path), "RANK": "0"})[1].stage.index == 0
    path.write_text(path.read_text().replace('"global_batch": 4', '"global_batch": 4 '))
    with pytest.raises(RuntimeError, match="changed since launch"):
        MA.plan_and_place_from_env({W.ENV_PLAN_FILE: str(path), W.ENV_PLAN_HASH: digest, "RANK": "1"})


@pytest.mark.distributed
def test_megatron_setup_builds_the_parallel_state_and_close_tears_it_down(tmp_path):
    """One gloo rank (in a child process: the default group and Megatron's state are per process)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    plan = make_plan("tiny", [(4, "n0")], global_batch=2, num_microbatches=1, runtime="megatron")
    path = tmp_path / "plan.json"
    plan.dump(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import json, sys\n"
        "import torch.distributed as dist\n"
        "from runtime_adapters.registry import get_adapter\n"
        "from tangram_launch.plan import Plan\n"
        "plan = Plan.load(sys.argv[1])\n"
        "ctx = get_adapter('megatron').setup(plan, timeout_s=60)\n"
        "out = {'tp': list(ctx.groups.tp), 'pp': list(ctx.groups.pp), 'rank': ctx.place.rank,\n"
        "       'owns': ctx.owns_default_group}\n"
        "ctx.close()\n"
        "out['after'] = dist.is_initialized()\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"tp": [0], "pp": [0], "rank": 0, "owns": True, "after": False}
