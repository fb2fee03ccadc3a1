"""A model folder's own code (``auto_map``) is never imported: not by the planner, not by the workers' HF source.

An unknown ``model_type`` is refused with the supported list (the planner's and the runtime's); a known one with an
``auto_map`` loads transformers' built-in class and leaves the folder's code alone. The same through the real CLI
and a launch of examples/train_hf.py, with "y" on stdin and with stdin closed: tests/test_input_trust_cli.py.
"""
from __future__ import annotations

import pytest

from hf_remote_code import remote_code_folder
from tangram_launch.errors import SpecError
from tangram_launch.specs.model import HF_MODEL_TYPES, load_model

transformers = pytest.importorskip("transformers")

from runtime_adapters.hf_model import FAMILIES, HFSource, config_from_dict  # noqa: E402


def test_the_planner_refuses_an_unknown_model_type_with_the_supported_list(tmp_path):
    folder, marker = remote_code_folder(tmp_path)
    for path in (folder, folder / "config.json"):
        with pytest.raises(SpecError) as info:
            load_model(str(path))
        err = info.value
        assert err.field == "model_type" and err.value == "evil-llama" and str(folder) in str(err)
        assert all(t in str(err) for t in ("llama", "mixtral", "qwen3_moe", "gpt2", "opt"))
    assert not marker.exists()


def test_the_workers_hf_source_refuses_it_before_transformers_sees_it(tmp_path):
    folder, marker = remote_code_folder(tmp_path)
    for path in (folder, folder / "config.json"):
        with pytest.raises(SpecError) as info:
            HFSource.from_pretrained(path)
        assert info.value.field == "model_type" and all(f in str(info.value) for f in FAMILIES)
    with pytest.raises(SpecError):  # a checkpoint's carried config (export) takes the same check
        config_from_dict({"model_type": "evil-llama", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}})
    assert not marker.exists()


def test_a_known_model_type_with_auto_map_loads_the_builtin_class_only(tmp_path):
    folder, marker = remote_code_folder(tmp_path, model_type="llama")
    source = HFSource.from_pretrained(folder)
    assert type(source.config) is transformers.LlamaConfig
    assert not hasattr(source.config, "auto_map") or not source.config.auto_map
    assert load_model(str(folder)).num_layers == 2
    assert not marker.exists()


def test_every_runtime_family_is_a_planner_model_type():
    assert set(FAMILIES) <= HF_MODEL_TYPES
