"""The launcher's command line without torch: Tangram's options, torchrun's option names, and ``--help``.

``torch.distributed.run.get_args_parser()`` stays the parser of every launch (:func:`tangram_launch.launch.torchrun.
build_parser`), but importing it costs seconds.  Two things must answer before that:

* ``tangram-launch --help`` (:func:`quick_help`): Tangram's options first, then the common torchrun ones;
  ``tangram-launch --help-torchrun`` prints torch's own parser.
* pre-flight (:func:`parse_early`): the same command line read by a parser with torchrun's option names and
  arities (:data:`TORCHRUN_OPTIONS`, checked against torch's parser by a test), so a missing script, plan file or
  package is refused in well under a second.  Whenever that reading could differ from torch's (an option it does
  not know, a ``PET_*`` default, a usage error), it gives up and the checks run after torch's parser instead.
"""
from __future__ import annotations

import argparse
import os
import shutil
import textwrap
from typing import Sequence

from tangram_launch.specs.constants import ATTENTION_KERNEL_HELP, ATTENTION_KERNELS, DTYPES, RUNTIMES

# torchrun's options, as torch's parser defines them: (option strings, metavar or None for a flag, help shown by
# `tangram-launch --help`, or None: not shown there).
TORCHRUN_OPTIONS: tuple[tuple[tuple[str, ...], str | None, str | None], ...] = (
    (("--nnodes",), "N|MIN:MAX",
     "nodes (a fixed plan: its node count; MIN:MAX with --cluster: planned for the nodes of each round)"),
    (("--nproc-per-node", "--nproc_per_node"), "N",
     "workers on this node: a number, or gpu, cpu, auto (a planned launch: the plan node's GPU count)"),
    (("--rdzv-backend", "--rdzv_backend"), "NAME", "rendezvous backend (c10d for multi-node jobs)"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "HOST:PORT", "rendezvous endpoint, the same on every node"),
    (("--rdzv-id", "--rdzv_id"), "ID", "job id shared by the nodes of one job"),
    (("--rdzv-conf", "--rdzv_conf"), "CONF", None),
    (("--standalone",), None, "one node, local rendezvous on a free port"),
    (("--max-restarts", "--max_restarts"), "N",
     "restart rounds after a worker fails (with --checkpoint-dir: from the newest checkpoint)"),
    (("--monitor-interval", "--monitor_interval"), "S", None),
    (("--start-method", "--start_method"), "METHOD", None),
    (("--event-log-handler", "--event_log_handler"), "NAME", None),
    (("--role",), "ROLE", None),
    (("-m", "--module"), None, "run the target as python -m MODULE"),
    (("--no-python", "--no_python"), None, "exec the target as a command, without python"),
    (("--run-path", "--run_path"), None, None),
    (("--log-dir", "--log_dir"), "DIR", "workers' logs (a planned launch keeps its plan in DIR/tangram/)"),
    (("-r", "--redirects"), "STD", None),
    (("-t", "--tee"), "STD", None),
    (("--local-ranks-filter", "--local_ranks_filter"), "RANKS", None),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "FILTERS", None),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "FILTERS", None),
    (("--node-rank", "--node_rank"), "N", "this node's rank (static rendezvous)"),
    (("--master-addr", "--master_addr"), "HOST", "rank 0's address (static rendezvous)"),
    (("--master-port", "--master_port"), "PORT", "rank 0's port (static rendezvous)"),
    (("--local-addr", "--local_addr"), "HOST", None),
    (("--logs-specs", "--logs_specs"), "NAME", None),
    (("--numa-binding", "--numa_binding"), "MODE", None),
    (("--signals-to-handle", "--signals_to_handle"), "SIGNALS", None),
    (("--shutdown-timeout", "--shutdown_timeout"), "S", None),
    (("--virtual-local-rank", "--virtual_local_rank"), None, None),
)

USAGE = ("tangram-launch [torchrun options] [tangram options] training_script [script args]\n"
         "       tangram-launch COMMAND [options]          (COMMAND --help for its options)")
DESCRIPTION = ("Tangram launcher: torchrun, plus planning and launching by a plan on heterogeneous GPU clusters. "
               "Without a tangram option it is torchrun (torch's own parser and launcher).")
EXIT_STATUS = ("exit status: 0 done; 1 a worker failed; 2 bad input, refused before any worker starts; 3 no plan "
               "fits; 128+N stopped by signal N (Ctrl-C: 130)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 10:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 10), got {value}")
    return value


def _window(text: str) -> int:
    value = _positive_int(text)
    if value < 4:  # a window's lower quartile must be able to leave a spike out
        raise argparse.ArgumentTypeError(f"expected at least 4 steps, got {value}")
    return value


def add_tangram_options(g: argparse._ActionsContainer, *, aliases: bool = True) -> None:
    """Tangram's options (``aliases``: also the underscore spellings torchrun accepts for its own options)."""

    def names(*spellings: str) -> tuple[str, ...]:
        return spellings if aliases else spellings[:1]

    g.add_argument("--cluster", metavar="FILE", default=None, help="Cluster spec YAML (plan at launch time).")
    g.add_argument("--profile", action="store_true",
                   help="Profile this node before planning (cached by hardware fingerprint, reused while unchanged).")
    g.add_argument("--reprofile", action="store_true",
                   help="Profile this node again even if a cached profile matches (implies --profile).")
    g.add_argument(*names("--profile-quick", "--profile_quick"), action="store_true",
                   help="With --profile: small sizes and few repetitions (a quick profile).")
    g.add_argument("--model", metavar="NAME|FILE", default=None, help="Model preset, YAML or HF config.json.")
    g.add_argument(*names("--global-batch", "--global_batch"), metavar="N", type=_positive_int, default=None,
                   help="Global batch size in sequences.")
    g.add_argument(*names("--seq-len", "--seq_len"), metavar="N", type=_positive_int, default=None,
                   help="Sequence length in tokens (at most the model's positions).")
    g.add_argument("--dtype", choices=DTYPES, default=None, help="Training dtype.")
    g.add_argument(*names("--attention-kernel", "--attention_kernel"), choices=ATTENTION_KERNELS, default=None,
                   help=ATTENTION_KERNEL_HELP)
    g.add_argument("--runtime", metavar="NAME", default=None,
                   help=f"Runtime the plan must run on ({', '.join(RUNTIMES)} or a registered third-party one; "
                        "deepspeed, megatron: their extra must be installed).")
    g.add_argument("--plan", metavar="FILE", default=None,
                   help="Launch by this plan: a plan file (JSON or YAML with a rank_layout), or a hand-written plan "
                        "(stages by island, costed first with --cluster and --model).")
    g.add_argument("--parallelizer", metavar="NAME", default=None, help="Per-island parallelizer to plan with.")
    g.add_argument(*names("--gpu-counts", "--gpu_counts"), choices=("tiling", "all"), default=None,
                   help="GPU counts a slice may use (default tiling; all: every count, slower), as tangram-launch "
                        "plan.")
    g.add_argument(*names("--node-name", "--node_name"), metavar="NAME", default=None,
                   help="Which plan node this agent is (default: matched by host name).")
    g.add_argument("--resume", metavar="DIR", default=None,
                   help="Resume from the newest complete checkpoint in this directory, or from the one checkpoint "
                        "DIR/step_N names.")
    g.add_argument(*names("--checkpoint-dir", "--checkpoint_dir"), metavar="DIR", default=None,
                   help="The run's checkpoint directory (default: the --resume one, or the one holding the "
                        "checkpoint it names): locked against other runs, and a restart round (--max-restarts) "
                        "resumes from its newest complete checkpoint.")
    g.add_argument(*names("--run-dir", "--run_dir"), metavar="DIR", default=None,
                   help="Where a planned launch writes its run report (run-report.json: predicted vs measured per "
                        "stage) and the workers' timings (default: tangram-runs/<time>-<plan hash>).")
    g.add_argument(*names("--report-every", "--report_every"), metavar="N", type=_positive_int, default=None,
                   help="Also print the predicted-vs-measured table every N steps (checked every 2 s: steps "
                        "faster than that print less often; default: at the end only).")
    g.add_argument("--adapt", action="store_true",
                   help="Re-plan while training: when a GPU runs slower than planned (a straggler) and the new plan's "
                        "gain over the horizon pays for a switch, checkpoint, restart under it and resume. Needs "
                        "--cluster and --checkpoint-dir. Without it the launcher only logs what it would do.")
    g.add_argument(*names("--adapt-horizon", "--adapt_horizon"), metavar="STEPS", type=_positive_int, default=None,
                   help="Steps a switch must pay off over (default: the steps left, as the script announces them).")
    g.add_argument(*names("--adapt-threshold", "--adapt_threshold"), metavar="FRACTION", type=_fraction,
                   default=None, help="A straggler runs this much slower than expected (default 0.15).")
    g.add_argument(*names("--adapt-window", "--adapt_window"), metavar="STEPS", type=_window, default=None,
                   help="Steps a straggler must stay slow (default 20, at least 4; one-off spikes do not count).")


class _Undecided(Exception):
    """The early reading cannot be sure it reads the command line as torch's parser will."""


class _EarlyParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]  # torch's parser will report it, its own way
        raise _Undecided(message)


def early_parser() -> argparse.ArgumentParser:
    """torchrun's option names and arities plus Tangram's options; values are kept as strings, as torch's are."""
    parser = _EarlyParser(prog="tangram-launch", add_help=False)
    for strings, metavar, _ in TORCHRUN_OPTIONS:
        if metavar:
            parser.add_argument(*strings)
        else:
            parser.add_argument(*strings, action="store_true")
    add_tangram_options(parser)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_early(argv: Sequence[str], env: "os._Environ[str] | dict[str, str] | None" = None
                ) -> argparse.Namespace | None:
    """The launch's command line as torch's parser will read it, or None where that is not certain."""
    env = os.environ if env is None else env
    if any(key.startswith("PET_") for key in env):  # torch's actions take defaults from PET_* variables
        return None
    try:
        args, unknown = early_parser().parse_known_args(list(argv))
    except _Undecided:
        return None
    if unknown:  # an option this table does not know (a newer torch): its arity is unknown
        return None
    if args.nnodes is None:
        args.nnodes = "1:1"
    if args.nproc_per_node is None:
        args.nproc_per_node = "1"
    return args


def literal_nproc(value: str) -> int | None:
    """``--nproc-per-node`` when it is a number; gpu, cpu and auto need torch to count devices."""
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def quick_help(commands: Sequence[tuple[str, str]]) -> str:
    """``tangram-launch --help``: the commands, Tangram's options, the common torchrun ones; no torch import."""
    width = min(100, shutil.get_terminal_size().columns - 2)  # argparse's own width, at most 100
    name_width = max(len(name) for name, _ in commands)
    listing = "\n".join(f"  {name.ljust(name_width)}  {what}" for name, what in commands)
    parser = argparse.ArgumentParser(
        prog="tangram-launch", usage=USAGE, add_help=False,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=width),
        description=f"{textwrap.fill(DESCRIPTION, width)}\n\ncommands:\n{listing}",
        epilog=textwrap.fill(EXIT_STATUS, width, subsequent_indent="  "))
    add_tangram_options(parser.add_argument_group("tangram options"), aliases=False)
    group = parser.add_argument_group("torchrun options", textwrap.fill(
        "The common ones. Every torchrun option works as in torchrun (torch's own parser): tangram-launch "
        "--help-torchrun lists them all.", width - 2))
    for strings, metavar, text in TORCHRUN_OPTIONS:
        if text is None:
            continue
        shown = strings if not strings[0].startswith("--") else strings[:1]  # -m/--module; --nnodes alone
        if metavar:
            group.add_argument(*shown, metavar=metavar, help=text)
        else:
            group.add_argument(*shown, action="store_true", help=text)
    return parser.format_help()
