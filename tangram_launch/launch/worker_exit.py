"""Bad input that only a worker can detect ends the launch with exit status 2, as bad input the launcher detects.

A worker finds some mistakes only once it runs: another model's checkpoint, a shape that does not match, a plan
that does not fit the world. Without this the launcher saw "a worker exited with 1" and exited 1 like any crash.

* Worker side (:func:`exit_status_for`, called by boot and by the example scripts on a :class:`TangramError`, and
  :func:`usage_status` for their argparse usage errors): one line on stderr, no traceback, and exit status
  :data:`EXIT_WORKER_INPUT_ERROR` when the error is the user's input (``exit_code == 2``: SpecError and its
  subclasses) and the worker runs in a planned tangram-launch, which exports :data:`ENV_INPUT_ERROR_EXIT`
  (:func:`tangram_launch.launch.lifetime.worker_environment`); the error's own ``exit_code`` otherwise
  (``python script.py`` still exits 2, and a plain torchrun-style launch keeps torchrun's exit 1).
* Launcher side (:func:`launcher_status`): a launch whose failed workers include one that exited with that status
  ends with exit status 2 and a line naming the rank; any other failure keeps torchrun's 1.

Why a status of its own rather than 2: a worker's 2 may be anything a script chose (argparse's usage error, or
``sys.exit(2)`` for a reason of its own); 65 is sysexits' EX_DATAERR ("the input data was incorrect"), which no
Python or torch failure uses, and the launcher only reads it from workers it told to use it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Mapping, NoReturn

ENV_INPUT_ERROR_EXIT = "TANGRAM_INPUT_ERROR_EXIT"  # set by tangram-launch: the status its workers use for bad input
EXIT_WORKER_INPUT_ERROR = 65  # sysexits.h EX_DATAERR
EXIT_BAD_INPUT = 2  # SpecError.exit_code: what the launcher exits with


def exit_status_for(exc: BaseException, *, prog: str, env: Mapping[str, str] | None = None) -> int:
    """Print ``prog: error: <message>`` (no traceback); return the status to exit with."""
    env = os.environ if env is None else env
    sys.stderr.write(f"{prog}: error: {exc}\n")
    sys.stderr.flush()
    _record_for_agent(exc, env)
    return usage_status(int(getattr(exc, "exit_code", 1) or 1), env)


def usage_status(status: int, env: Mapping[str, str] | None = None) -> int:
    """A script's argparse usage error (status 2) as bad input under tangram-launch; any other status unchanged."""
    env = os.environ if env is None else env
    if status == EXIT_BAD_INPUT and env.get(ENV_INPUT_ERROR_EXIT) == str(EXIT_WORKER_INPUT_ERROR):
        return EXIT_WORKER_INPUT_ERROR
    return status


def _record_for_agent(exc: BaseException, env: Mapping[str, str]) -> None:
    """The worker's error file (``TORCHELASTIC_ERROR_FILE``), in the format torch's agent reads, with the message in
    place of a traceback: the launcher's failure table then shows the reason in one line."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"{type(exc).__name__}: {exc}"
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # the message is on stderr already


def end_worker(status: int) -> NoReturn:
    """Exit a worker that refused its input with ``status``, flushing stdio but skipping interpreter teardown.

    The message and the error file are written already. Tearing the interpreter down with a live gloo process group
    whose peer has exited first can abort in its destructor (SIGABRT), which the launcher reads as a crash, not as
    bad input; nothing is left to release that the process's exit does not release."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def launcher_status(failures: Mapping[int, Any]) -> tuple[int, str] | None:
    """(2, a line naming the rank) when a failed worker reported bad input; None otherwise.

    ``failures``: torch's ``ChildFailedError.failures`` (global rank -> ProcessFailure with ``exitcode``)."""
    ranks = sorted(r for r, f in failures.items() if getattr(f, "exitcode", None) == EXIT_WORKER_INPUT_ERROR)
    if not ranks:
        return None
    which = f"rank {ranks[0]}" + (f" (and {len(ranks) - 1} more)" if len(ranks) > 1 else "")
    return EXIT_BAD_INPUT, (f"tangram-launch: error: {which} refused its input (its message is above); "
                            f"exit status {EXIT_BAD_INPUT}")
