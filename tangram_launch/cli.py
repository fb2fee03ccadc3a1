"""The ``tangram-launch`` console script.

    tangram-launch islands  --cluster FILE                     # GPU islands and why GPUs were split apart
    tangram-launch estimate --cluster FILE --model NAME ...    # cost breakdown of one configuration on one island
    tangram-launch plan     --cluster FILE --model NAME ...    # the heterogeneous plan (table, JSON or YAML)
    tangram-launch profile  [torchrun args] -o cluster.yaml    # measure a live cluster, write its ClusterSpec
    tangram-launch export   CKPT_DIR --to hf OUT_DIR           # a checkpoint as a Hugging Face model folder
    tangram-launch calibrate RUN_DIR/run-report.json           # fold measured stage times into the run's cluster
    tangram-launch report   RUN_DIR/run-report.json            # a run's adaptations: table and timeline
    tangram-launch [torchrun args] [tangram args] script.py    # launch, exactly like torchrun (plus planning)

User errors exit with status 2, infeasible requests with 3, both without a traceback; Ctrl-C exits with 130.
``--help`` and every refusal that needs no planning answer without importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tangram_launch.errors import TangramError

SUBCOMMANDS = {
    "islands": "tangram_launch.commands.islands",
    "estimate": "tangram_launch.commands.estimate",
    "plan": "tangram_launch.commands.plan",
    "profile": "tangram_launch.commands.profile",
    "export": "tangram_launch.commands.export",
    "calibrate": "tangram_launch.commands.calibrate",
    "report": "tangram_launch.commands.report",
}
COMMANDS = (  # what `tangram-launch --help` lists
    ("islands", "GPU islands of a cluster file, and why GPUs were split apart"),
    ("estimate", "cost breakdown of one configuration on one island"),
    ("plan", "the heterogeneous plan (table, JSON, YAML), or a hand-written one costed"),
    ("profile", "measure a live cluster, write its ClusterSpec"),
    ("export", "a checkpoint as a Hugging Face model folder"),
    ("calibrate", "fold a run's measured stage times into the cluster it planned from"),
    ("report", "a run's history: predicted vs measured, adaptations, a timeline"),
)
HELP_TORCHRUN = "--help-torchrun"


def _run_subcommand(name: str, argv: list[str]) -> int:
    """Each command module provides ``add_arguments(parser)`` and ``run(args) -> int``."""
    module = importlib.import_module(SUBCOMMANDS[name])
    parser = argparse.ArgumentParser(prog=f"tangram-launch {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    fast_help = getattr(module, "add_help_arguments", None)
    if fast_help is not None and any(a in ("-h", "--help") for a in argv):
        fast_help(parser)  # the same options, described without importing torch
    else:
        module.add_arguments(parser)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)


def _help(argv: list[str]) -> int:
    """``--help``: Tangram's options first, without torch; ``--help-torchrun``: torch's own parser's help."""
    if argv[0] == HELP_TORCHRUN:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
        parser.prog = "tangram-launch"
        parser.print_help()
        return 0
    from tangram_launch.launch.options import quick_help

    print(quick_help(COMMANDS), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[tangram] %(message)s")
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _run_subcommand(argv[0], argv[1:])
        if not argv:  # torchrun would only say "training_script is required": show the commands first
            print("usage:" + __doc__.strip().split("\n", 1)[1].split("\n\n")[0], file=sys.stderr)
            print("\nThe launcher's options (Tangram's and the common torchrun ones): tangram-launch --help; a "
                  "command's: tangram-launch COMMAND --help", file=sys.stderr)
            return 2
        if argv[0] in ("-h", "--help", HELP_TORCHRUN):
            return _help(argv)
        from tangram_launch.launch import torchrun as launch

        return int(launch.run(argv) or 0)
    except TangramError as exc:
        print(f"tangram-launch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before or after the workers ran (planning, profiling): no traceback
        from tangram_launch.launch.signals import INTERRUPTED_LINE

        print(INTERRUPTED_LINE, file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tangram-launch plan ... | head`: the reader had enough, as with any Unix tool
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
