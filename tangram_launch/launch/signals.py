"""What the launcher says when it is stopped by a signal (torch's agent turns it into a SignalException).

torch's elastic agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by stopping its workers and raising
``SignalException``; the launcher prints one line instead of that traceback and exits ``128 + signal number``,
the shell's convention for a process ended by a signal (SIGTERM: 143, SIGINT: 130).
"""
from __future__ import annotations

import signal
from typing import Any


def stopped_line(sigval: Any, args: Any, planned: Any = None) -> str:
    try:
        name = signal.Signals(int(sigval)).name
    except (TypeError, ValueError):
        name = str(sigval)
    target = getattr(args, "training_script", "?")
    rest = list(getattr(args, "training_script_args", None) or ())
    if target == "tangram_launch.launch.boot" and "--" in rest:  # a planned launch: name the user's target, not boot
        target = " ".join(rest[rest.index("--") + 1:][:2])
    nproc = getattr(args, "nproc_per_node", "?")
    what = f"plan node {planned.node}'s" if planned is not None else "this node's"
    return (f"tangram-launch: stopped by {name}: {what} workers ({nproc} per node, {target}) were terminated; "
            f"exit status {128 + int(sigval)}")
