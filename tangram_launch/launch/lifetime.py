"""Workers die with their launcher: a ``kill -9`` of tangram-launch leaves no orphan training (and saving) on.

torch's agent starts each worker in a session of its own (``start_new_session=True``), so nothing reaches the
workers when the agent is killed with SIGKILL: they trained on and kept saving into a directory whose lock a second
launch then took over. Two guards:

* the launcher exports its pid (:func:`worker_environment`); boot, first thing in the worker, asks the kernel to send
  SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux; kept across ``exec``) and then checks that its
  parent is still that launcher: a launcher that died between the worker's fork and the ``prctl`` would otherwise
  go unnoticed (the classic race), and the worker stops at once;
* the checkpoint lock records the launcher (host, pid, start time, boot id) and every save re-checks it
  (:func:`tangram_launch.checkpoint.lock.ensure_held`): a worker whose launcher is gone, or whose lock another run
  took, stops saving with an error naming the directory (the guard where ``prctl`` is missing: not Linux, or a
  worker the launcher did not start through boot).

SIGKILL rather than SIGTERM: a script may catch SIGTERM and go on; a checkpoint save is atomic (a temporary
directory renamed at the end), so an abrupt end loses nothing that was committed.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from typing import Iterator, Mapping

logger = logging.getLogger(__name__)

ENV_LAUNCHER_PID = "TANGRAM_LAUNCHER_PID"  # pid of the tangram-launch process (torch's agent) that started us
PR_SET_PDEATHSIG = 1  # linux/prctl.h
EXIT_ORPHANED = 1


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """Launcher, around torch's run of a planned launch (a plain one keeps torchrun's worker environment): export
    this process's pid and the status workers exit with on bad input (:mod:`.worker_exit`); torch's agent passes
    its environment on to the workers. Restored afterwards."""
    from tangram_launch.launch.worker_exit import ENV_INPUT_ERROR_EXIT, EXIT_WORKER_INPUT_ERROR

    with exported({ENV_LAUNCHER_PID: str(os.getpid()), ENV_INPUT_ERROR_EXIT: str(EXIT_WORKER_INPUT_ERROR)}):
        yield


@contextlib.contextmanager
def exported(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment, which torch's agent passes on to the workers; restored
    afterwards (a launcher run in-process, as tests do, leaves the environment as it found it)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _prctl_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when the parent dies; False where prctl is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Worker (boot): SIGKILL this process when its launcher dies; exit now if it already has.

    Returns whether the death signal is armed (False outside tangram-launch, or without prctl)."""
    env = os.environ if env is None else env
    raw = env.get(ENV_LAUNCHER_PID)
    if not raw or not raw.isdigit():
        return False
    launcher = int(raw)
    armed = _prctl_death_signal(signal.SIGKILL)
    if os.getppid() != launcher and not _alive(launcher):  # it died before prctl took effect: we were orphaned
        sys.stderr.write(f"tangram-launch worker (pid {os.getpid()}): its launcher (pid {launcher}) is gone; "
                         "stopping before the script runs\n")
        sys.stderr.flush()
        os._exit(EXIT_ORPHANED)
    return armed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
