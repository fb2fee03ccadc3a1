"""The launcher's hold on the run's checkpoint directory (``--checkpoint-dir``, default ``--resume``'s).

Takes the directory's lock (:mod:`tangram_launch.checkpoint_lock`; another run holding it: exit 2 naming it) for
the life of the launcher, across restart rounds, and exports to the workers the lock's token (their saves write
under it) and the directory (a restart round resumes from it, :mod:`tangram_launch.restart`). A resumed run's
directory must not hold a complete checkpoint newer than the one resumed (:func:`check_one_history`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tangram_launch.checkpoint import lock as checkpoint_lock
from tangram_launch.errors import SpecError
from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR

if TYPE_CHECKING:
    from tangram_launch.checkpoint.store import CheckpointInfo


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


def check_one_history(directory: str, resumed: "CheckpointInfo", *, field: str = "--checkpoint-dir") -> None:
    """Refuse a run's checkpoint directory that holds a complete checkpoint newer than the one resumed (an older
    step chosen with ``--resume DIR/step_N``, or another directory's): its saves would sit beside another history's,
    and a restart round would resume the newest of those instead of this run's. A newer checkpoint that does not
    verify is the loader's to skip, not another history."""
    from tangram_launch.checkpoint.store import find_latest, list_candidates

    if not any(c.committed and c.step > resumed.step for c in list_candidates(directory)):
        return
    try:
        newest = find_latest(directory, checksums=True)  # every byte of the newer ones, as loading would read them
    except SpecError:
        return
    if newest.step <= resumed.step:
        return
    path = os.path.abspath(directory)
    raise SpecError(f"{path} holds {newest.path} (step {newest.step}), newer than the resumed {resumed.path} (step "
                    f"{resumed.step}): this run's checkpoints would sit beside another history's, and a restart "
                    "would resume the newer one", field=field, value=path,
                    valid="a directory for this run's checkpoints (--checkpoint-dir NEW_DIR, and the script's own "
                          f"save directory there too), or move the checkpoints after step {resumed.step} out of "
                          f"{path}")
