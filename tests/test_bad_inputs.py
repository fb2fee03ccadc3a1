"""Every bad input exits 2 with a message: no traceback, no hang, bounded memory (issue 15's list, and a fuzz run).

The CLI runs in this process (``tests/bad_inputs.run_cli``: an exception escaping ``main`` is a traceback and
fails the test; a run past its time bound fails it too). The listed cases are regression tests; the fuzz test
mutates valid cluster, model, HF config, hand-written plan and frozen plan files with a seeded generator and
asserts exit status 0, 2 or 3 within the bound (``TANGRAM_FUZZ_CASES`` per kind; the ``slow`` test runs 20x more).
"""
from __future__ import annotations

import json
import os
import random
import resource
from pathlib import Path

import pytest
import yaml

from bad_inputs import (CLUSTER, PLAN, cluster_yaml, frozen_plan, hf_config, hostile_files, mutate, run_cli,
                        tiny_model, write_doc)
from tangram_launch.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = REPO / "examples" / "clusters"
PRESETS = REPO / "tangram_launch" / "models"

EVERY_FILE_INPUT = {
    "cluster": lambda p: ["islands", "--cluster", p],
    "model": lambda p: ["plan", "--cluster", str(CLUSTER), "--model", p, "--workers", "1"],
    "hand-written plan": lambda p: ["plan", "--cluster", str(CLUSTER), "--model", "tiny", "--plan", p],
    "frozen plan at launch": lambda p: ["--standalone", "--nproc-per-node", "2", "--plan", p, "no-such-script.py"],
}
HOSTILE = {"invalid-utf8.yaml": "not UTF-8 text (byte 6", "deep-json.json": "nested deeper than 64 levels",
           "deep-yaml.yaml": "nested deeper than 64 levels", "deep-json-object.json": "nested deeper than 64 levels",
           "huge-int.yaml": "Exceeds the limit (4300 digits)", "huge-int.json": "Exceeds the limit (4300 digits)",
           "alias-bomb.yaml": "expands to more than 1000000 values (YAML aliases)",
           "too-big.yaml": "more than the 16777216 allowed",
           "duplicate-key.yaml": "key 'name' given twice in one mapping (lines 1 and 3)",
           "duplicate-key.json": "key 'name' given twice in one",  # "object"; "mapping" where read as YAML
           "fifo": "is a FIFO", "dev-zero": "is a device",
           "directory": "is a directory"}


def _refused(argv: list[str], expect: str, *, bound_s: float = 20.0) -> str:
    rc, err, seconds = run_cli(argv, time_bound_s=bound_s)
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and expect in err, err[-2000:]
    return err


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return hostile_files(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize("kind", sorted(EVERY_FILE_INPUT))
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_every_file_input_refuses_hostile_files_quickly(hostile, kind, name):
    if kind == "model" and name == "directory":
        expect = "folder has no config.json"  # a model may be an HF folder
    else:
        expect = HOSTILE[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(EVERY_FILE_INPUT[kind](hostile[name]), expect, bound_s=10.0 if kind != "frozen plan at launch" else 20)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"{name} as {kind} cost {grown_mib:.0f} MiB"


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("node, expect", [
    ({"count": 1e30}, "'nodes[0] (n0).count': expected a positive integer (got 1e+30)"),
    ({"count": "1e30"}, "expected a positive integer (got '1e30')"),
    ({"count": 10 ** 6}, "'nodes[0] (n0).count': more GPUs than a node holds (got 1000000)"),
    ({"tflops": {"bf16": float("nan")}}, "'nodes[0] (n0).tflops.bf16': must be a finite number (got nan)"),
    ({"tflops": {"bf16": float("inf")}}, "'nodes[0] (n0).tflops.bf16': must be a finite number (got inf)"),
    ({"memory_gib": float("nan")}, "memory_gib': must be a finite number (got nan)"),
])
def test_cluster_values_that_are_not_hardware(tmp_path, node, expect):
    _refused(["plan", "--cluster", _write(tmp_path, "c.yaml", cluster_yaml(**node)), "--model", "tiny"], expect)


@pytest.mark.parametrize("change, expect", [
    ({"ffn_type": ["gelu"]}, "field 'ffn_type': unknown FFN type"),
    ({"num_layers": 10 ** 9}, "field 'num_layers': more layers than any model this planner is meant for"),
    ({"num_layers": 1e30}, "field 'num_layers': expected an integer (got 1e+30)"),
    ({"num_layers": 100_000}, "field 'num_layers': more layers"),
    ({"num_layers": 4.0}, "field 'num_layers': expected an integer (got 4.0)"),
    ({"hidden_size": 10 ** 12}, "field 'hidden_size': physically absurd size"),
    ({"norm_type": {"a": 1}}, "field 'norm_type': unknown norm type"),
])
def test_model_values_that_are_not_a_model(tmp_path, change, expect):
    path = _write(tmp_path, "m.yaml", yaml.safe_dump({**tiny_model(), **change}))
    _refused(["plan", "--cluster", str(CLUSTER), "--model", path], expect, bound_s=10)


@pytest.mark.parametrize("change, expect", [
    ({"num_experts": 4, "num_experts_per_tok": 2, "model_type": "qwen2_moe", "moe_intermediate_size": 32,
      "mlp_only_layers": 5}, "field 'mlp_only_layers': expected a list of layer indices (got 5)"),
    ({"max_position_embeddings": "x"}, "field 'max_seq_len': expected an integer (got 'x')"),
    ({"num_hidden_layers": 10 ** 9}, "field 'num_layers': more layers"),
    ({"model_type": "opt", "architectures": ["OPTForCausalLM"], "ffn_dim": 128, "do_layer_norm_before": "lots"},
     "field 'do_layer_norm_before': expected true or false (got 'lots')"),
])
def test_hf_config_oddities(tmp_path, change, expect):
    path = _write(tmp_path, "config.json", json.dumps({**hf_config(), **change}))
    _refused(["plan", "--cluster", str(CLUSTER), "--model", path], expect, bound_s=10)


@pytest.mark.parametrize("change, expect", [
    ({"stages": "x"}, "field 'stages': wrong type (got 'x')"),
    ({"model": "tiny"}, "field 'model': wrong type (got 'tiny')"),
    ({"version": None}, "field 'version': wrong type (got None)"),
    ({"islands_used": True}, "field 'islands_used': wrong type (got True)"),
    ({"num_microbatches": 4.0}, "field 'num_microbatches': wrong type (got 4.0)"),
])
def test_frozen_plan_oddities_at_launch(tmp_path, change, expect):
    path = _write(tmp_path, "plan.json", json.dumps(frozen_plan(**change)))
    _refused(["--standalone", "--nproc-per-node", "2", "--plan", path, "no-such-script.py"], expect)


@pytest.mark.parametrize("text, expect", [
    ('"num_microbatches": NaN', "NaN is not a number JSON allows"),
    ('"num_microbatches": Infinity', "Infinity is not a number JSON allows"),
])
def test_frozen_plan_nan_and_inf_in_integer_fields(tmp_path, text, expect):
    raw = PLAN.read_text().replace('"num_microbatches": 4', text)
    assert text in raw
    _refused(["--standalone", "--nproc-per-node", "2", "--plan", _write(tmp_path, "p.json", raw), "x.py"], expect)


def test_zero_stage_one_point_zero_in_a_hand_written_plan(tmp_path):
    doc = {"stages": [{"layers": [0, 4], "island": "cpu", "zero_stage": 1.0}]}
    path = _write(tmp_path, "hand.yaml", yaml.safe_dump(doc))
    _refused(["plan", "--cluster", str(CLUSTER), "--model", "tiny", "--plan", path],
             "field 'stages[0].zero_stage': unknown ZeRO stage (got 1.0)")


def test_frozen_plan_stage_fields_must_be_integers(tmp_path):
    plan = frozen_plan()
    plan["stages"][0]["zero_stage"] = 1.0
    _refused(["--standalone", "--nproc-per-node", "2", "--plan", _write(tmp_path, "p.json", json.dumps(plan)),
              "x.py"], "field 'stages[0].zero_stage': expected an integer (got 1.0)")


@pytest.mark.parametrize("extra, expect", [
    (["--global-batch", "10000000000"], "field 'global_batch': larger than any global batch a run uses"),
    (["--balance-tolerance", "nan"], "field '--balance-tolerance': must be a finite number >= 0 (got nan)"),
    (["-o", "{tmp}/missing/p.json"], "field '--output': the directory {tmp}/missing does not exist"),
    (["-o", "{tmp}"], "field '--output': is a directory; give a file name"),
    (["--timeline", "{tmp}/missing/t.svg"], "field '--timeline': the directory {tmp}/missing does not exist"),
    (["--stages-out", "{tmp}"], "field '--stages-out': is a directory; give a file name"),
    # a directory that passes the up-front check but takes no files: refused when written, not a traceback
    (["-o", "/proc/p.json"], "/proc/p.json: cannot write the file (No such file or directory)"),
])
def test_plan_command_options(tmp_path, extra, expect):
    extra = [e.format(tmp=tmp_path) for e in extra]
    _refused(["plan", "--cluster", str(CLUSTER), "--model", "tiny", *extra], expect.format(tmp=tmp_path), bound_s=10)


def test_other_command_options(tmp_path):
    _refused(["islands", "--cluster", str(CLUSTER), "--draw", str(tmp_path / "no" / "i.svg")],
             f"field '--draw': the directory {tmp_path / 'no'} does not exist")
    _refused(["islands", "--cluster", str(CLUSTER), "--draw", str(tmp_path)], "field '--draw': is a directory")
    _refused(["estimate", "--cluster", str(CLUSTER), "--model", "tiny", "--stages-after", "-5"],
             "field '--stages-after': must not be negative (got -5)")


def test_resume_from_a_file_says_it_is_a_file(tmp_path):
    _refused(["--standalone", "--nproc-per-node", "1", "--resume", str(CLUSTER), "x.py"],
             f"{CLUSTER} is a file, not a checkpoint directory")


# --- fuzz ------------------------------------------------------------------------------------------------------------

def _seeds() -> dict[str, tuple[str, object]]:
    hand = {"stages": [{"layers": [0, 2], "island": "cpu", "tp": 1}, {"layers": [2, 4], "island": "cpu"}]}
    return {
        "cluster": ("c.yaml", yaml.safe_load(Path(CLUSTER).read_text())),
        "cluster with a network": ("c.yaml", yaml.safe_load((CLUSTERS / "c3-4-islands-20gpu.yaml").read_text())),
        "model": ("m.yaml", tiny_model()),
        "MoE model": ("m.yaml", yaml.safe_load((PRESETS / "tiny-moe.yaml").read_text())),
        "hf config": ("config.json", hf_config()),
        "hand-written plan": ("hand.yaml", hand),
        "frozen plan": ("plan.json", json.loads(PLAN.read_text())),
    }


def _argv(kind: str, path: str) -> list[str]:
    return {"cluster": ["islands", "--cluster", path],
            "cluster with a network": ["plan", "--cluster", path, "--model", "tiny", "--workers", "1"],
            "model": ["estimate", "--cluster", str(CLUSTER), "--model", path],
            "MoE model": ["plan", "--cluster", str(CLUSTER), "--model", path, "--workers", "1"],
            "hf config": ["estimate", "--cluster", str(CLUSTER), "--model", path],
            "hand-written plan": ["plan", "--cluster", str(CLUSTER), "--model", "tiny", "--plan", path,
                                  "--workers", "1"]}[kind]


def _check_frozen_plan(path: str, tmp_path: Path) -> int:
    """The launcher's whole check of a frozen plan, without starting workers: 0 (accepted) or 2 (SpecError)."""
    from tangram_launch.launch import torchrun as launch

    args = launch.build_parser().parse_args(["--standalone", "--nproc-per-node", "2", "--plan", path, "x.py"])
    try:
        launch.prepare_planned_launch(args, path, node_name=None, staging_dir=str(tmp_path))
    except SpecError:
        return 2
    return 0


def _fuzz(tmp_path: Path, cases: int, seed: int) -> dict[str, dict[int, int]]:
    rng = random.Random(seed)
    tally: dict[str, dict[int, int]] = {}
    for kind, (name, doc) in _seeds().items():
        for i in range(cases):
            bad = mutate(doc, rng)
            path = write_doc(tmp_path / f"{kind.replace(' ', '-')}-{i}{Path(name).suffix}", bad, rng)
            if kind == "hf config":
                os.replace(path, tmp_path / "config.json")
                path = str(tmp_path / "config.json")
            if kind == "frozen plan":
                rc = _check_frozen_plan(path, tmp_path)
            else:
                rc, err, _ = run_cli(_argv(kind, path), time_bound_s=20)
                assert "Traceback" not in err, (kind, bad, err[-2000:])
            assert rc in (0, 2, 3), (kind, bad, rc)
            tally.setdefault(kind, {}).setdefault(rc, 0)
            tally[kind][rc] += 1
    return tally


def test_fuzz_malformed_inputs_exit_0_2_or_3_without_a_traceback(tmp_path):
    cases = int(os.environ.get("TANGRAM_FUZZ_CASES", "12"))
    tally = _fuzz(tmp_path, cases, seed=15)
    assert all(sum(t.values()) == cases for t in tally.values()) and len(tally) == 7
    assert all(t.get(2, 0) > 0 for t in tally.values())  # the mutations do reach the validation


@pytest.mark.slow
def test_fuzz_long_run(tmp_path):
    if not os.environ.get("TANGRAM_FUZZ_LONG"):
        pytest.skip("set TANGRAM_FUZZ_LONG=1 (and run -m slow) for the long fuzz run")
    for seed in range(20):
        _fuzz(tmp_path, int(os.environ.get("TANGRAM_FUZZ_CASES", "12")), seed=1000 + seed)
