"""Every command's --help answers without importing torch, and describes the options the command really takes."""
from __future__ import annotations

import argparse

import pytest

from tangram_launch.cli import SUBCOMMANDS, main


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
