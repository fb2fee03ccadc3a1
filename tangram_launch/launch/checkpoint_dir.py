"""The launcher's hold on the run's checkpoint directory (``--checkpoint-dir``, default ``--resume``'s).

Takes the directory's lock (:mod:`tangram_launch.checkpoint_lock`; another run holding it: exit 2 naming it) for
the life of the launcher, across restart rounds, and exports to the workers the lock's token (their saves write
under it) and the directory (a restart round resumes from it, :mod:`tangram_launch.restart`).
"""
from __future__ import annotations

import os

from tangram_launch.checkpoint import lock as checkpoint_lock
from tangram_launch.errors import SpecError
from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR


def hold_checkpoint_dir(directory: str, *, shared_by_agents: bool = False) -> str:
    """Lock ``directory`` for this launcher and export it to the workers; returns its absolute path.

    ``shared_by_agents`` (an elastic launch): every agent of the job names the same directory and any of them may
    hold the round's rank 0, so no launcher locks it; the round's rank 0 takes the lock as it saves."""
    path = os.path.abspath(directory)
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(f"{path} is a file, not a checkpoint directory", field="--checkpoint-dir", value=directory,
                        valid="a directory (created if missing)")
    if not shared_by_agents:
        token = checkpoint_lock.acquire(path)
        os.environ[checkpoint_lock.ENV_LOCK_TOKEN] = token  # torch's agent passes its environment on to the workers
    os.environ[ENV_CHECKPOINT_DIR] = path
    return path
