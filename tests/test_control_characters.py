"""Control characters and NUL bytes in every YAML/JSON file the CLI reads: refused (SpecError naming the file, CLI
exit 2), never a traceback.

YAML allows only tab, newline, carriage return and printable characters anywhere in a stream (comments included);
JSON allows no raw character below U+0020 but tab, newline and carriage return. So a C0 control character inserted
anywhere must be refused, whatever the file is for. The parser functions are fuzzed here (unit tier); the real
console script is run on one file of each kind in tests/test_input_trust_cli.py (distributed tier).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bad_inputs import CLUSTER, PLAN, hf_config, run_cli, tiny_model
from tangram_launch.errors import SpecError

CONTROL = [chr(c) for c in range(0x20) if chr(c) not in "\t\n\r"]  # NUL and the other C0 characters
YAML_ONLY = ["\x7f", "\x80", "\x9f", "\ufffe", "\uffff"]  # not printable for YAML (JSON takes them in strings)
HAND_PLAN = {"stages": [{"layers": [0, 2], "island": "cpu", "tp": 1}, {"layers": [2, 4], "island": "cpu"}]}
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load_cluster(path: str) -> None:
    from tangram_launch.specs.cluster import ClusterSpec

    ClusterSpec.load(path)


def _load_model(path: str) -> None:
    from tangram_launch.specs.model import load_model

    load_model(path)


def _load_hand_plan(path: str) -> None:
    from tangram_launch.planner.manual import load_manual_plan

    load_manual_plan(path, num_layers=4, island_names=["cpu"])


def _load_frozen_plan(path: str) -> None:
    from tangram_launch.worker import read_plan_dict

    read_plan_dict(path)


def _load_hf_folder(path: str) -> None:
    from tangram_launch.specs.model import load_model

    load_model(os.path.dirname(path))  # the folder form: its config.json


def _load_hf_runtime_config(path: str) -> None:
    from runtime_adapters.hf_model import load_config

    load_config(os.path.dirname(path))  # what the workers of train_hf.py read


# kind -> (file name, seed text, parser); each seed parses cleanly as written.
INPUTS = {
    "cluster yaml": ("c.yaml", Path(CLUSTER).read_text(), _load_cluster),
    "model yaml": ("m.yaml", yaml.safe_dump(tiny_model()), _load_model),
    "model json": ("m.json", json.dumps(tiny_model(), indent=1), _load_model),
    "hf config.json": ("config.json", json.dumps(hf_config(), indent=1), _load_model),
    "hf folder": ("config.json", json.dumps(hf_config(), indent=1), _load_hf_folder),
    "hf config.json in a worker": ("config.json", json.dumps(hf_config(), indent=1), _load_hf_runtime_config),
    "hand-written plan yaml": ("hand.yaml", yaml.safe_dump(HAND_PLAN), _load_hand_plan),
    "frozen plan json": ("plan.json", PLAN.read_text(), _load_frozen_plan),
    "frozen plan yaml": ("plan.yaml", yaml.safe_dump(json.loads(PLAN.read_text())), _load_frozen_plan),
}


def _insert(text: str, position: float, chars: str) -> str:
    at = int(position * len(text))
    return text[:at] + chars + text[at:]


def _refused(kind: str, text: str) -> SpecError:
    name, _, parse = INPUTS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        with pytest.raises(SpecError) as info:
            parse(path)
        assert tmp in str(info.value), f"{kind}: the message names no file: {info.value}"
        return info.value


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_every_seed_parses(kind):
    name, text, parse = INPUTS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name)
        Path(path).write_text(text)
        parse(path)


@pytest.mark.parametrize("kind", sorted(INPUTS))
@FUZZ
@given(position=st.floats(0, 1), chars=st.text(st.sampled_from(CONTROL), min_size=1, max_size=4))
def test_a_control_character_anywhere_is_refused_naming_the_file(kind, position, chars):
    _refused(kind, _insert(INPUTS[kind][1], position, chars))


@pytest.mark.parametrize("kind", [k for k in sorted(INPUTS) if INPUTS[k][0].endswith(".yaml")])
@FUZZ
@given(position=st.floats(0, 1), chars=st.text(st.sampled_from(YAML_ONLY), min_size=1, max_size=3))
def test_a_character_yaml_calls_unprintable_is_refused(kind, position, chars):
    _refused(kind, _insert(INPUTS[kind][1], position, chars))


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_nul_bytes_only_and_the_reported_example(kind):
    for text in ("\x00" * 64, "\x00\x01\x02garbage: [\n", INPUTS[kind][1].replace("\n", "\n\x00", 1)):
        err = _refused(kind, text)
        assert "control character" in str(err) or "malformed JSON" in str(err), str(err)


@FUZZ
@given(position=st.floats(0, 1), chars=st.text(st.sampled_from(CONTROL), min_size=1, max_size=4))
def test_the_cli_exits_2_without_a_traceback(position, chars):
    """The same through the CLI's main (in this process): cluster, model, HF config, hand-written plan."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for kind, name in (("cluster yaml", "c.yaml"), ("model yaml", "m.yaml"), ("hf config.json", "config.json"),
                           ("hand-written plan yaml", "hand.yaml")):
            files[kind] = os.path.join(tmp, name)
            Path(files[kind]).write_text(_insert(INPUTS[kind][1], position, chars), newline="")
        runs = [["islands", "--cluster", files["cluster yaml"]],
                ["estimate", "--cluster", str(CLUSTER), "--model", files["model yaml"]],
                ["estimate", "--cluster", str(CLUSTER), "--model", files["hf config.json"]],
                ["plan", "--cluster", str(CLUSTER), "--model", "tiny", "--plan", files["hand-written plan yaml"],
                 "--workers", "1"]]
        for argv in runs:
            rc, err, _ = run_cli(argv)
            assert rc == 2 and "Traceback" not in err and tmp in err, (argv, rc, err[-1500:])


@FUZZ
@given(position=st.floats(0, 1), chars=st.text(st.sampled_from(CONTROL), min_size=1, max_size=4))
def test_a_profile_cache_seal_with_control_characters_is_not_reused(position, chars):
    """The profile cache's seal (JSON): unreadable means "profile again", never a traceback."""
    from tangram_launch.launch.profile_cache import seal, seal_problem

    with tempfile.TemporaryDirectory() as tmp:
        profile = os.path.join(tmp, "key.yaml")
        Path(profile).write_text(Path(CLUSTER).read_text())
        seal(profile, "key", {"gpu": "cpu"})
        assert seal_problem(profile, "key", {"gpu": "cpu"}) is None
        sealed = Path(profile + ".seal")
        sealed.write_text(_insert(sealed.read_text(), position, chars), newline="")
        assert "unreadable" in seal_problem(profile, "key", {"gpu": "cpu"})
