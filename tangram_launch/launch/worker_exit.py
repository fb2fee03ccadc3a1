"""Bad input that only a worker can detect ends the launch with exit status 2, as bad input the launcher detects.

A worker finds some mistakes only once it runs: another model's checkpoint, a shape that does not match, a plan
that does not fit the world. Without this the launcher saw "a worker exited with 1" and exited 1 like any crash.

* Worker side (:func:`exit_status_for`, called by boot and by the example scripts on a :class:`TangramError`, and
  :func:`usage_status` for their argparse usage errors): one line on stderr, no traceback, and exit status
  :data:`EXIT_WORKER_INPUT_ERROR` when the error is the user's input (``exit_code == 2``: SpecError and its
  subclasses) and the worker runs in a planned tangram-launch, which exports :data:`ENV_INPUT_ERROR_EXIT`
  (:func:`tangram_launch.launch.lifetime.worker_environment`); the error's own ``exit_code`` otherwise
  (``python script.py`` still exits 2, and a plain torchrun-style launch keeps torchrun's exit 1).
* Launcher side: when every failed worker refused its input (:func:`input_error_report`; peers the agent stopped
  after that do not count as failures of their own), the launcher prints each distinct worker line once (a worker
  told to use the status, whose line reached the error file, leaves stderr to the launcher: one line, not one per
  rank) and one line of its own, and exits 2, without torch's failure table, which is for crashes; torch's log lines
  about that failure are held meanwhile (:func:`failure_lines_held`) and released for any other outcome. A launch
  whose failed workers include a crash keeps torch's whole report, and exits 2 when one of them refused its input
  (:func:`launcher_status`); any other failure keeps torchrun's 1.

Why a status of its own rather than 2: a worker's 2 may be anything a script chose (argparse's usage error, or
``sys.exit(2)`` for a reason of its own); 65 is sysexits' EX_DATAERR ("the input data was incorrect"), which no
Python or torch failure uses, and the launcher only reads it from workers it told to use it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Iterator, Mapping, NoReturn

ENV_INPUT_ERROR_EXIT = "TANGRAM_INPUT_ERROR_EXIT"  # set by tangram-launch: the status its workers use for bad input
EXIT_WORKER_INPUT_ERROR = 65  # sysexits.h EX_DATAERR
EXIT_BAD_INPUT = 2  # SpecError.exit_code: what the launcher exits with
LINE_KEY = "tangram_line"  # the worker's one line, in its error file's extraInfo (torch's agent reads the rest)
# what torch's agent sends the workers it stops once one has failed (SIGTERM, then SIGKILL after a grace period)
AGENT_STOP_EXITCODES = (-int(signal.SIGTERM), -int(signal.SIGKILL))
# torch's log lines about a failed worker, as format strings: the agent's (multiprocessing.api: the failure, and
# its stopping the other workers) and the one torch's @record writes when the launcher has no error file of its own
FAILED_WORKER_MSG = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
STOPPING_MSGS = ("Sending process %s closing signal %s",
                 "Unable to shutdown process %s via %s, forcefully exiting via %s")
NO_PARENT_ERROR_FILE_MSG = "no error file defined for parent, to copy child error file (%s)"
FAILURE_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                   "torch.distributed.elastic.multiprocessing.errors.error_handler")


def exit_status_for(exc: BaseException, *, prog: str, env: Mapping[str, str] | None = None) -> int:
    """Print ``prog: error: <message>`` (no traceback); return the status to exit with.

    A worker that reports bad input to a tangram-launch that told it how (the status) leaves the printing to the
    launcher once the line is in its error file: every rank finds the same mistake, and the user reads it once."""
    env = os.environ if env is None else env
    line = f"{prog}: error: {exc}"
    status = usage_status(int(getattr(exc, "exit_code", 1) or 1), env)
    if not (_record_for_agent(exc, env, line) and status == EXIT_WORKER_INPUT_ERROR):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return status


def usage_status(status: int, env: Mapping[str, str] | None = None) -> int:
    """A script's argparse usage error (status 2) as bad input under tangram-launch; any other status unchanged."""
    env = os.environ if env is None else env
    if status == EXIT_BAD_INPUT and env.get(ENV_INPUT_ERROR_EXIT) == str(EXIT_WORKER_INPUT_ERROR):
        return EXIT_WORKER_INPUT_ERROR
    return status


def _record_for_agent(exc: BaseException, env: Mapping[str, str], line: str) -> bool:
    """The worker's error file (``TORCHELASTIC_ERROR_FILE``), in the format torch's agent reads, with the message in
    place of a traceback (a failure table then shows the reason in one line) and the worker's ``line`` for the
    launcher to print. False when there is no such file to write."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    text = f"{type(exc).__name__}: {exc}"
    data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time())),
                                                       LINE_KEY: line}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


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
    ranks = _refused_ranks(failures)
    if not ranks:
        return None
    return EXIT_BAD_INPUT, _refused_line(ranks, "its message is above")


def input_error_report(failures: Mapping[int, Any]) -> tuple[int, list[str]] | None:
    """(2, the lines to print) when every failed worker refused its input; None when any crashed.

    A worker that exited with a signal the agent stops workers with (SIGTERM, SIGKILL), no earlier than the first
    refusal, was stopped because of it (torch's agent stops the group when one worker fails) and is no failure of
    its own. The lines: each distinct worker message once (the lowest rank's line), then the launcher's."""
    ranks = _refused_ranks(failures)
    if not ranks:
        return None
    first_s = min(getattr(failures[r], "timestamp", 0) for r in ranks)
    for rank, failure in failures.items():
        if rank not in ranks and not (getattr(failure, "exitcode", None) in AGENT_STOP_EXITCODES
                                      and getattr(failure, "timestamp", 0) >= first_s):
            return None
    stopped = len(failures) - len(ranks)
    return EXIT_BAD_INPUT, [*worker_lines(failures), _refused_line(ranks, f"{stopped} other worker(s) stopped"
                                                                   if stopped else "")]


def worker_lines(failures: Mapping[int, Any]) -> list[str]:
    """The lines of the workers that refused their input and left them to the launcher (in their error files,
    :func:`_record_for_agent`), each distinct message once (the lowest rank's line)."""
    lines: dict[str, str] = {}
    for rank in _refused_ranks(failures):
        message, line = _worker_message(failures[rank])
        if line is not None:
            lines.setdefault(message, line)
    return list(lines.values())


def _refused_ranks(failures: Mapping[int, Any]) -> list[int]:
    return sorted(r for r, f in failures.items() if getattr(f, "exitcode", None) == EXIT_WORKER_INPUT_ERROR)


def _refused_line(ranks: list[int], note: str) -> str:
    which = f"rank {ranks[0]}" + (f" (and {len(ranks) - 1} more)" if len(ranks) > 1 else "")
    note = f" ({note})" if note else ""
    return f"tangram-launch: error: {which} refused its input{note}; exit status {EXIT_BAD_INPUT}"


def _worker_message(failure: Any) -> tuple[str, str | None]:
    """(the message, the worker's line) from a failure's error file (:func:`_record_for_agent`); the line is None
    when the worker printed it itself (argparse's usage error, no error file)."""
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, Mapping) else None
    if not isinstance(message, Mapping):
        return "", None
    extra = message.get("extraInfo")
    line = extra.get(LINE_KEY) if isinstance(extra, Mapping) else None
    return str(message.get("message")), (line if isinstance(line, str) else None)


class HeldLines(logging.Filter):
    """Holds torch's log lines about a failed worker (:data:`FAILED_WORKER_MSG` for a worker that refused its input,
    :data:`STOPPING_MSGS`, :data:`NO_PARENT_ERROR_FILE_MSG`) until the launcher knows whether the failure was bad
    input. The agent's line for a worker that failed otherwise settles it: the lines held before it go out first, in
    torch's order, and nothing is held after it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.crashed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.crashed:
            return True
        failed = record.msg == FAILED_WORKER_MSG and bool(record.args)
        if failed and record.args[0] != EXIT_WORKER_INPUT_ERROR:  # type: ignore[index]
            self.crashed = True
            self.release()
            return True
        if failed or record.msg in STOPPING_MSGS or record.msg == NO_PARENT_ERROR_FILE_MSG:
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        """Log the held lines after all (a crash: torch's report stays whole)."""
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


@contextlib.contextmanager
def failure_lines_held() -> Iterator[HeldLines]:
    """While torch's agent runs the workers: its failure lines are held (see :class:`HeldLines`); release them
    after this context unless the outcome was bad input (the filters before it, such as
    :func:`tangram_launch.launch.signals.quiet_agent_shutdown`'s, drop a line before it is held)."""
    held = HeldLines()
    loggers = [logging.getLogger(name) for name in FAILURE_LOGGERS]
    for lg in loggers:
        lg.addFilter(held)
    try:
        yield held
    finally:
        for lg in loggers:
            lg.removeFilter(held)


def workers_told(env: Mapping[str, str] | None = None) -> bool:
    """Whether this launcher's workers run with the bad-input status (a planned launch exports it)."""
    env = os.environ if env is None else env
    return env.get(ENV_INPUT_ERROR_EXIT) == str(EXIT_WORKER_INPUT_ERROR)
