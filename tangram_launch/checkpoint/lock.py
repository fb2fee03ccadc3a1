"""One writer per checkpoint directory: an exclusive lock file naming its owner.

``<dir>/.tangram-lock`` is created with ``O_CREAT | O_EXCL`` (atomic on local filesystems and on NFSv3+) and holds
JSON: host, pid, the process's start time (``/proc/<pid>/stat``) and the machine's boot id (so a reused pid, also
after a reboot, is not taken for the owner), a random token and the command line. Who takes it:

* the launcher, for ``--checkpoint-dir DIR`` (default: the ``--resume`` directory), for the whole run including
  restart rounds; it exports the token as ``TANGRAM_CHECKPOINT_LOCK`` so its workers write under its lock;
* otherwise rank 0 of a job at its first save, until the process exits.

Every save checks the lock again (:func:`ensure_held`). A worker of a launcher that holds the lock never takes it
itself: when the lock names another token (a second run took it over) or its owner, our launcher, is gone (an
orphaned worker), the save is refused, so a run that lost its lock stops saving.

A second run is refused (SpecError, exit 2) naming the owner. A lock whose owner is gone (same host, pid not alive
or alive with another start time) is stale and taken over, with a warning; a lock from another host cannot be
checked from here, so the message says which file to remove once that run is known to be gone.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import stat
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tangram_launch.errors import SpecError

logger = logging.getLogger(__name__)

LOCK_FILE = ".tangram-lock"
ENV_LOCK_TOKEN = "TANGRAM_CHECKPOINT_LOCK"  # token of the launcher's lock, inherited by its workers

# Locks this process holds: absolute directory -> token (released at exit). Per-process ownership is process state.
_HELD: dict[str, str] = {}


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class LockOwner:
    host: str
    pid: int
    token: str
    start: str | None = None
    created_unix_s: float = 0.0
    command: str = ""
    boot_id: str | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created_unix_s)) if self.created_unix_s else "?"
        return f"host {self.host}, pid {self.pid}, since {when}" + (f", `{self.command}`" if self.command else "")

    def alive(self) -> bool | None:
        """True/False on this host; None when the owner is on another host (cannot tell from here)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id is not None and _boot_id() not in (None, self.boot_id):
            return False  # the machine rebooted since: whatever has this pid now is not the owner
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return self.start is None or _start_ticks(self.pid) in (None, self.start)


def lock_path(directory: str) -> str:
    return os.path.join(os.path.abspath(directory), LOCK_FILE)


def read_owner(directory: str) -> LockOwner | None:
    try:
        d = json.loads(_read_small_regular_file(lock_path(directory)))
        return LockOwner(host=str(d["host"]), pid=int(d["pid"]), token=str(d["token"]), start=d.get("start"),
                         created_unix_s=float(d.get("created_unix_s", 0.0)), command=str(d.get("command", "")),
                         boot_id=d.get("boot_id") if isinstance(d.get("boot_id"), str) else None)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # half-written or foreign: unknown owner
        return LockOwner(host="?", pid=-1, token="")


def _read_small_regular_file(path: str, limit_bytes: int = 64 << 10) -> bytes:
    """The lock file's bytes: not through a symlink, never a FIFO or device (a reader would block), bounded."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit_bytes:
            raise ValueError("not a small regular file")
        return os.read(fd, limit_bytes)
    finally:
        os.close(fd)


def _create(path: str) -> str | None:
    token = uuid.uuid4().hex
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_ticks(os.getpid()), "token": token,
          "created_unix_s": time.time(), "command": " ".join(sys.argv)[:300], "boot_id": _boot_id()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    return token


def acquire(directory: str) -> str:
    """Take the lock of ``directory`` (created if missing) for this process; returns its token."""
    directory = os.path.abspath(directory)
    if directory in _HELD:
        return _HELD[directory]
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"cannot create the checkpoint directory: {exc.strerror}", field="checkpoint directory",
                        value=directory) from None
    path = lock_path(directory)
    for _ in range(3):
        token = _create(path)
        if token is not None:
            _HELD[directory] = token
            if len(_HELD) == 1:
                atexit.register(release_all)
            return token
        owner = read_owner(directory)
        if owner is None:
            continue  # released between our two looks
        alive = owner.alive()
        if alive is False or (owner.pid == -1 and _older_than(path, 60.0)):
            stale = f"{path}.stale-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(FileNotFoundError):  # another taker may have moved it first
                os.rename(path, stale)
                os.remove(stale)
                logger.warning("took over the stale checkpoint lock of %s (%s: no longer running)", directory,
                               owner.describe())
            continue
        how = ("it may still be running on that host; once it is gone, remove " + path) if alive is None else \
            "it is still running"
        raise SpecError(f"checkpoint directory {directory} is in use by another run ({owner.describe()}); {how}",
                        field="checkpoint directory", value=directory,
                        valid="a directory no other run writes to")
    raise SpecError("could not take the checkpoint lock (it changed hands repeatedly)", field="checkpoint directory",
                    value=directory)


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.path.getmtime(path) > seconds
    except OSError:
        return True


def ensure_held(directory: str, env: Any = None) -> None:
    """Before every write into ``directory``: the lock is this process's, or our launcher's and the launcher is
    still alive; without a launcher's lock, take it. SpecError when a launcher's run lost it (see the module doc)."""
    env = os.environ if env is None else env
    directory = os.path.abspath(directory)
    if directory in _HELD:
        return
    token = env.get(ENV_LOCK_TOKEN)
    owner = read_owner(directory)
    if not token or not (_launchers_directory(env, directory) or (owner is not None and owner.token == token)):
        acquire(directory)  # no launcher lock for this directory: the job's rank 0 takes its own
        return
    if owner is None or owner.token != token:
        now = f"now held by {owner.describe()}" if owner is not None else "the lock file is gone"
        raise SpecError(f"this run lost the lock of {directory} ({now}); not saving, so that two runs never write "
                        "one directory", field="checkpoint directory", value=directory)
    if owner.alive() is False:
        raise SpecError(f"the launcher that holds the lock of {directory} ({owner.describe()}) is gone; this worker "
                        "is an orphan and stops saving (resume with a new launch: --resume "
                        f"{directory})", field="checkpoint directory", value=directory)


def _launchers_directory(env: Any, directory: str) -> bool:
    """Is ``directory`` the one our launcher locked (``TANGRAM_CHECKPOINT_DIR``)? Its token says nothing about
    other directories a script writes to."""
    from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR

    locked = env.get(ENV_CHECKPOINT_DIR)
    return bool(locked) and os.path.abspath(locked) == directory


def release(directory: str) -> None:
    directory = os.path.abspath(directory)
    token = _HELD.pop(directory, None)
    if token is None:
        return
    owner = read_owner(directory)
    if owner is not None and owner.token == token:
        with contextlib.suppress(OSError):
            os.remove(lock_path(directory))


def release_all() -> None:
    for directory in list(_HELD):
        release(directory)


__all__ = ["LOCK_FILE", "ENV_LOCK_TOKEN", "LockOwner", "acquire", "ensure_held", "release", "release_all",
           "read_owner", "lock_path"]
