"""What the launcher says when it is stopped by a signal (torch's agent turns it into a SignalException).

torch's elastic agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by stopping its workers and raising
``SignalException``; the launcher prints one line instead of that traceback and exits ``128 + signal number``,
the shell's convention for a process ended by a signal (SIGTERM: 143, SIGINT: 130).  The agent's own log lines
about that shutdown ("Received 2 death signal", "Sending process N closing signal SIGINT") say the same and are
left out (:func:`quiet_agent_shutdown`); the workers of a planned launch stop on SIGINT without a traceback
(:mod:`tangram_launch.launch.boot`).
"""
from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any, Iterator

# torch's loggers of the agent's shutdown, and the messages (format strings) the one line replaces
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"
DEATH_SIGNAL_MSG = "Received %s death signal, shutting down workers"
CLOSING_MSG = "Sending process %s closing signal %s"

INTERRUPTED_LINE = "tangram-launch: interrupted (SIGINT); exit status 130"


def stopped_line(sigval: Any, args: Any, planned: Any = None) -> str:
    try:
        name = signal.Signals(int(sigval)).name
    except (TypeError, ValueError):
        name = str(sigval)
    target = getattr(args, "training_script", "?")
    rest = list(getattr(args, "training_script_args", None) or ())
    if target == "tangram_launch.launch.boot" and "--" in rest:  # a planned launch: name the user's target, not boot
        after = rest[rest.index("--") + 1:]
        target = " ".join(after[:2] if after[:1] in (["-m"], ["--exec"]) else after[:1])
    nproc = getattr(args, "nproc_per_node", "?")
    what = f"plan node {planned.node}'s" if planned is not None else "this node's"
    return (f"tangram-launch: stopped by {name}: {what} workers ({nproc} per node, {target}) were terminated; "
            f"exit status {128 + int(sigval)}")


class _AgentShutdownLines(logging.Filter):
    """Drops the agent's "death signal" line and, after it, its "closing signal" lines (stopped_line says both)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == DEATH_SIGNAL_MSG:
            self.stopping = True
            return False
        return not (self.stopping and record.msg == CLOSING_MSG)


@contextlib.contextmanager
def quiet_agent_shutdown() -> Iterator[None]:
    """While the agent runs: its shutdown-on-signal lines are left out (other warnings are kept)."""
    quiet = _AgentShutdownLines()
    loggers = [logging.getLogger(AGENT_LOGGER), logging.getLogger(PROCESSES_LOGGER)]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)
