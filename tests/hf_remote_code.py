"""A Hugging Face model folder that carries its own code (``auto_map``): importing that code writes a marker file.

Used by tests/test_hf_remote_code.py (parsers, in process) and tests/test_input_trust_cli.py (the real CLI and a
launch of examples/train_hf.py). The marker never appearing is the proof that the folder's code was never imported.
"""
from __future__ import annotations

import json
from pathlib import Path

from bad_inputs import hf_config

CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("the model folder's code ran")
from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = {model_type!r}


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


def remote_code_folder(root: Path, *, model_type: str = "evil-llama") -> tuple[Path, Path]:
    """(the model folder, the marker file its code would write); the config is tiny-llama's apart from
    ``model_type`` and ``auto_map``."""
    folder, marker = root / f"model-{model_type}", root / f"marker-{model_type}"
    folder.mkdir(parents=True)
    for module in ("configuration_evil", "modeling_evil"):
        (folder / f"{module}.py").write_text(CODE.format(marker=str(marker), model_type=model_type))
    cfg = {**hf_config(), "model_type": model_type,
           "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder, marker
