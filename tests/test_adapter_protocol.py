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
