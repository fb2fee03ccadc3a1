"""Every command's --help answers without importing torch, and describes the options the command really takes."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tangram_launch.cli import COMMANDS, SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"usage: tangram-launch {command}" in capsys.readouterr().out


def test_profile_help_lists_only_options_torchs_parser_takes(capsys):
    from tangram_launch.commands import profile

    fast, full = argparse.ArgumentParser(), argparse.ArgumentParser()
    profile.add_help_arguments(fast)
    profile.add_arguments(full)
    strings = lambda p: {s for a in p._actions for s in a.option_strings}  # noqa: E731
    assert strings(fast) <= strings(full)
    assert {"--nproc-per-node", "--standalone", "--quick", "--model", "-o"} <= strings(fast)


def test_help_lists_every_command():
    assert [name for name, _ in COMMANDS] == list(SUBCOMMANDS)


@pytest.mark.distributed
def test_a_reader_that_stops_early_gets_no_traceback():
    import subprocess
    import sys

    from timeouts import SUBPROCESS_TIMEOUT_S

    cluster = str(Path(__file__).resolve().parent.parent / "examples" / "clusters" / "c3-full-het-iii.yaml")
    cmd = f"{sys.executable} -m tangram_launch.cli islands --cluster {cluster} | true"  # a reader gone at once
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr


@pytest.mark.parametrize("typo, suggested", [("--modle", "--model"), ("--global-bach", "--global-batch"),
                                             ("--nprocs-per-node", "--nproc-per-node"), ("--profle", "--profile")])
def test_a_misspelt_launcher_option_is_one_line_naming_the_nearest(typo, suggested, capsys):
    """(argparse takes an unambiguous prefix such as --profil as the option itself, as torchrun does)"""
    takes_value = typo in ("--modle", "--global-bach", "--nprocs-per-node")
    argv = ["--standalone", typo, *(["8"] if takes_value else []), "examples/train_gpt.py", "--steps", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"field '{typo}': unknown option" in err and suggested in err and len(err.strip().splitlines()) == 1
