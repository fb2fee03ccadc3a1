"""Pre-flight in process: the early reading of the command line is torch's, the checks refuse what the workers would.

The launcher reads its command line before importing torch (``launch/options.py``) to refuse mistakes in well under
a second; these tests hold that reading to torch's own parser (same options, same values, or no answer at all), and
each check to the refusal it stands in for. The same refusals through the real command line, with no worker started,
are in tests/test_preflight_cli.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import COMMANDS, main
from tangram_launch.errors import SpecError
from tangram_launch.launch import options, preflight
from tangram_launch.launch.torchrun import TangramOptions
from tangram_launch.specs.model import load_model

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_PLAN = REPO / "examples" / "data" / "plan-tiny-2cpu.json"
TRAIN_GPT = REPO / "examples" / "train_gpt.py"


def _torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


# --- the early reading ---------------------------------------------------------------------------------------------

def test_the_torchrun_table_has_torchs_options_and_arities():
    torch_options = {tuple(a.option_strings): a.nargs == 0 for a in _torch_parser()._actions
                     if a.option_strings and a.dest != "help"}
    ours = {strings: metavar is None for strings, metavar, _ in options.TORCHRUN_OPTIONS}
    assert ours == torch_options


# What pre-flight reads of torchrun's options, and all of Tangram's (the rest it never looks at).
READ = ("nnodes", "nproc_per_node", "standalone", "module", "no_python", "run_path", "training_script",
        "training_script_args", *(f.name for f in dataclasses.fields(TangramOptions)))


def _read(namespace: argparse.Namespace) -> dict:
    return {k: getattr(namespace, k) for k in READ}


COMMAND_LINES = [
    ["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "1"],
    ["--nnodes", "1:2", "--nproc_per_node", "3", "--rdzv-backend", "c10d", "--max_restarts", "2", "-r", "3",
     "--tee", "1", "--log-dir", "/tmp/x", "-m", "pkg.train", "--plan", "q"],
    ["--nproc-p", "4", "--plan", "p.json", "--node-name", "n0", "train.py", "--model", "m"],  # an abbreviation
    ["--no-python", "--nnodes=2", "--seq-len", "64", "--model", "tiny", "bash", "-c", "x"],
]


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_the_early_reading_is_torchs_reading(argv):
    from tangram_launch.launch.torchrun import build_parser

    assert _read(options.parse_early(argv, env={})) == _read(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv, env", [
    (["--no-such-option", "x", "train.py"], {}),  # an option a newer torch might have: its arity is unknown
    (["--standalone", "train.py"], {"PET_NPROC_PER_NODE": "3"}),  # torch's default would come from the env
    (["--global-batch", "0", "train.py"], {}),  # a usage error: torch's parser reports it
    (["--standalone"], {}),  # no script
    (["--nproc", "2", "train.py"], {}),  # ambiguous (--nproc-per-node, --nproc_per_node), as for torch
])
def test_the_early_reading_gives_up_where_it_could_differ_from_torchs(argv, env):
    assert options.parse_early(argv, env=env) is None


_values = st.sampled_from(["1", "2", "1:2", "x.py", "c10d", "p.json"])
_tokens = st.one_of(
    st.tuples(st.sampled_from([s for strings, _, _ in options.TORCHRUN_OPTIONS for s in strings]), _values),
    st.tuples(st.sampled_from(["--plan", "--model", "--node-name", "--seq-len", "--global-batch"]), _values),
    st.tuples(st.sampled_from(["--profile", "--standalone", "-m"])),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(_tokens, max_size=5), st.lists(st.sampled_from(["--lr", "1", "--plan", "-m"]), max_size=3))
def test_any_command_line_read_early_is_read_the_same_by_torchs_parser(pairs, script_args):
    from tangram_launch.launch.torchrun import build_parser

    argv = [t for pair in pairs for t in pair] + ["train.py", *script_args]
    early = options.parse_early(argv, env={})
    if early is None:
        return  # no early answer: pre-flight waits for torch's parser
    try:
        full = build_parser().parse_args(argv)
    except SystemExit:  # torch refuses a value it checks (--start-method 1): its message, after pre-flight's
        return
    assert _read(early) == _read(full)


@given(st.one_of(st.integers(1, 64).map(str), st.tuples(st.integers(1, 9), st.integers(1, 9)).map(
    lambda t: f"{t[0]}:{t[1]}")))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_nnodes_are_read_as_torch_reads_them(text):
    from torch.distributed.run import parse_min_max_nnodes

    assert preflight.nnodes_range(text) == parse_min_max_nnodes(text)


def test_literal_nproc_only_counts_numbers():
    assert options.literal_nproc("4") == 4
    assert options.literal_nproc("gpu") is None and options.literal_nproc("auto") is None


# --- --help ----------------------------------------------------------------------------------------------------------

def test_help_begins_with_the_commands_and_tangrams_options(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tangram-launch [torchrun options] [tangram options] training_script")
    sections = [line for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert sections == ["commands:", "tangram options:", "torchrun options:"]
    assert all(f"  {name} " in out for name, _ in COMMANDS)
    assert out.index("--cluster FILE") < out.index("torchrun options:") < out.index("--nproc-per-node N")
    assert "exit status:" in out


def test_help_lists_only_options_torchrun_has(capsys):
    main(["--help"])
    listed = capsys.readouterr().out.split("torchrun options:", 1)[1]
    torch_strings = {s for a in _torch_parser()._actions for s in a.option_strings}
    shown = {w.rstrip(",") for line in listed.splitlines() if line.startswith("  -") for w in line.split()
             if w.startswith("-")}
    assert shown and shown <= torch_strings


# --- the checks ------------------------------------------------------------------------------------------------------

def _args(argv: list[str]) -> argparse.Namespace:
    args = options.parse_early(argv, env={})
    assert args is not None
    return args


def _check(argv: list[str], **kw):
    args = _args(argv)
    return preflight.check_launch(args, nproc_per_node=lambda: options.literal_nproc(args.nproc_per_node), **kw)


def test_a_misspelled_script_is_refused_with_the_closest_name():
    with pytest.raises(SpecError, match=r"training script not found: examples/train_gtp.py .*did you mean "
                                        r"examples/train_gpt.py\?"):
        preflight.check_target(_args(["examples/train_gtp.py"]), cwd=str(REPO))
    preflight.check_target(_args(["examples/train_gpt.py"]), cwd=str(REPO))
    preflight.check_target(_args([str(TRAIN_GPT)]), cwd="/")


def test_modules_and_commands_are_found_without_importing_them(monkeypatch):
    monkeypatch.delitem(sys.modules, "tangram_launch.launch.hand_written", raising=False)
    preflight.check_target(_args(["-m", "tangram_launch.launch.hand_written"]), cwd=str(REPO))
    assert "tangram_launch.launch.hand_written" not in sys.modules  # found, not imported
    with pytest.raises(SpecError, match="no module named tangram_launch.launch.nope"):
        preflight.check_target(_args(["-m", "tangram_launch.launch.nope"]), cwd=str(REPO))
    preflight.check_target(_args(["--no-python", "sh", "-c", "true"]))
    with pytest.raises(SpecError, match="command not found: no-such-command-x"):
        preflight.check_target(_args(["--no-python", "no-such-command-x"]))


@pytest.mark.parametrize("runtime, module, extra", [("deepspeed", "deepspeed", "deepspeed"),
                                                    ("megatron", "megatron", "megatron")])
def test_a_runtime_without_its_package_names_the_extra(monkeypatch, runtime, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what `import deepspeed` meets when it is not installed
    with pytest.raises(SpecError, match=rf"runtime {runtime} needs the .* package, which is not installed .*"
                                        rf"pip install -e \"\.\[{extra}\]\"") as info:
        _check(["--runtime", runtime, "--standalone", str(TRAIN_GPT)])
    assert info.value.field == "--runtime" and info.value.exit_code == 2
    preflight.check_runtime_packages("torch", field="--runtime")  # torch needs no extra


def test_the_plans_runtime_is_checked_not_the_ignored_option(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    plan = REPO / "examples" / "data" / "plan-tiny-2cpu-deepspeed.json"
    with pytest.raises(SpecError, match="runtime deepspeed needs") as info:
        _check(["--nproc-per-node", "2", "--plan", str(plan), str(TRAIN_GPT)])
    assert info.value.field == "runtime" and info.value.source == str(plan)
    _check(["--nproc-per-node", "2", "--runtime", "deepspeed", "--plan", str(EXAMPLE_PLAN), str(TRAIN_GPT)])


def test_a_sequence_longer_than_the_learned_positions_is_refused():
    tiny = load_model("tiny")
    preflight.check_seq_len(tiny, tiny.num_position_embeddings, field="--seq-len")
    with pytest.raises(SpecError, match=r"model tiny has 64 learned positions.*\(got 128\); valid: at most 64"):
        _check(["--cluster", str(REPO / "examples" / "clusters" / "cpu-2.yaml"), "--model", "tiny", "--seq-len",
                "128", str(TRAIN_GPT)])
    rotary = load_model("llama3-8b")  # rotary positions: no table to run out of
    preflight.check_seq_len(rotary, 4 * rotary.max_seq_len, field="--seq-len")


def test_a_plan_files_sequence_length_is_checked_against_its_model(tmp_path):
    import json

    plan = json.loads(EXAMPLE_PLAN.read_text())
    plan["training"]["seq_len"] = 128
    path = tmp_path / "long.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(SpecError, match=r"field 'training.seq_len'.*plan again with --seq-len 64 or less"):
        preflight.read_plan_file(str(path), node_name=None, nnodes="1", nproc_per_node=2)


@pytest.mark.parametrize("edit, field, says", [
    # the second stage's first layer took hidden states as token ids (a traceback in the embedding)
    (lambda p: p["stages"][1].__setitem__("has_embedding", True), "stages[1].has_embedding",
     "only stage 0 holds the embedding"),
    (lambda p: p["stages"][0].__setitem__("has_head", True), "stages[0].has_head", "only stage 1 holds the head"),
])
def test_a_plan_with_an_embedding_or_head_off_its_end_stages_is_refused_before_any_worker(tmp_path, edit, field,
                                                                                        says):
    import json

    plan = json.loads(EXAMPLE_PLAN.read_text())
    edit(plan)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(SpecError, match=re.escape(says)) as info:
        _check(["--standalone", "--nproc-per-node", "2", "--plan", str(path), str(TRAIN_GPT)])
    assert f"field '{field}'" in str(info.value)


def test_a_plan_for_another_world_is_refused_before_torch_counts_workers():
    with pytest.raises(SpecError, match=r"plan node 'local' has 2 GPU\(s\) .*\(got 3\); valid: 2") as info:
        _check(["--standalone", "--nproc-per-node", "3", "--plan", str(EXAMPLE_PLAN), str(TRAIN_GPT)])
    assert info.value.field == "--nproc-per-node"
    # gpu/cpu/auto need torch to count devices: left to the check after torch's parser
    assert not _check(["--nproc-per-node", "auto", "--plan", str(EXAMPLE_PLAN), str(TRAIN_GPT)]).hand_written


def test_a_hand_written_plan_is_recognised_and_needs_a_model(tmp_path):
    path = tmp_path / "my-plan.yaml"
    path.write_text("stages:\n  - {layers: [0, 2], island: cpu}\n  - {layers: [2, 4], island: cpu}\n")
    with pytest.raises(SpecError, match="hand-written plan .* costed before the launch") as info:
        _check(["--standalone", "--nproc-per-node", "2", "--plan", str(path), str(TRAIN_GPT)])
    assert info.value.field == "--model" and "--cluster FILE" in str(info.value)
    checked = _check(["--standalone", "--nproc-per-node", "2", "--plan", str(path), "--model", "tiny",
                      "--cluster", str(REPO / "examples" / "clusters" / "cpu-2.yaml"), str(TRAIN_GPT)])
    assert checked.hand_written and checked.layout is None
    assert not preflight.is_hand_written({"stages": [{"island": "a", "gpus": []}], "rank_layout": []})


def test_the_plan_file_is_checked_before_the_script(tmp_path):
    with pytest.raises(SpecError, match="plan file not found"):
        _check(["--nproc-per-node", "2", "--plan", str(tmp_path / "nope.json"), "no-such-script.py"])
    with pytest.raises(SpecError, match="cluster file not found"):
        _check(["--cluster", str(tmp_path / "nope.yaml"), "--model", "tiny", "no-such-script.py"])
    with pytest.raises(SpecError, match="does not exist"):
        _check(["--resume", str(tmp_path / "ckpt"), "no-such-script.py"])
    _check(["--cluster", str(tmp_path / "nope.yaml"), str(TRAIN_GPT)], can_plan=False)  # refused later, as ever


# --- export says what it is doing ------------------------------------------------------------------------------------

def test_export_reports_each_phase(tmp_path, caplog):
    pytest.importorskip("transformers")
    from helpers_plans import make_plan
    from runtime_adapters.hf_model import HFSource
    from tangram_launch.checkpoint import LayerKeyMap, StageState, TrainingPosition, save_checkpoint

    source = HFSource.from_pretrained(REPO / "examples" / "models" / "tiny-llama")
    plan = make_plan(source.model_spec(), [(4, "n0")], global_batch=2, num_microbatches=1, seq_len=8)
    module = source.build_stage(None, plan.stages[0], 7)
    state = StageState.from_module(module, LayerKeyMap.for_stage(plan.stages[0], local_numbering="global"))
    save_checkpoint(tmp_path / "ckpt", plan=plan, state=state, position=TrainingPosition(1, 2))
    with caplog.at_level("INFO", logger="tangram_launch.commands.export"):
        assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"), "--config",
                     str(REPO / "examples" / "models" / "tiny-llama")]) == 0
    phases = [r.getMessage().split(":", 1)[0] for r in caplog.records if r.name == "tangram_launch.commands.export"]
    assert phases == ["export 1/4", "export 2/4", "export 3/4", "export 4/4"]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_estimate_refuses_a_sequence_longer_than_the_models_learned_positions(capsys):
    from tangram_launch.cli import main

    cluster = str(REPO / "examples" / "clusters" / "cpu-2.yaml")
    assert main(["estimate", "--cluster", cluster, "--model", "tiny", "--island", "cpu", "--seq-len", "128",
                 "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len" in err and "at most 64" in err and "Traceback" not in err


# --- CPU workers' threads ------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(0, 64).map(str), st.sampled_from(["", " ", "two", "-1", "1.5", "4,2"])),
       st.integers(1, 16), st.integers(1, 64))
def test_a_thread_warning_comes_exactly_when_cpu_workers_thread_pools_oversubscribe_the_cores(value, nproc, cores):
    text = preflight.cpu_thread_warning(value, nproc_per_node=nproc, cores=cores)
    valid = value is not None and value.strip().isdigit() and int(value) >= 1
    threads = int(value) if valid else cores  # a value OpenMP cannot read: a thread per core
    expected = value is not None and threads > 1 and threads * nproc > cores
    assert (text is not None) == expected
    if text is not None:  # it names the variable and its value, and a value that fits
        assert f"OMP_NUM_THREADS={value!r}" in text if not valid else f"OMP_NUM_THREADS={int(value)} " in text
        fix = int(text.rsplit("set OMP_NUM_THREADS=", 1)[1].split()[0])
        assert fix >= 1 and (fix * nproc <= cores or fix == 1)
