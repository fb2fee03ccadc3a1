"""Where a worker resumes from in a restart round (``--max-restarts N``): the run's newest complete checkpoint.

``tangram-launch --checkpoint-dir DIR`` (default: the ``--resume`` directory) exports ``TANGRAM_CHECKPOINT_DIR``; in
a restart round :func:`resume_dir_for_round` answers DIR as soon as it holds a complete checkpoint, so
:func:`tangram_launch.checkpoint.resume_directory` (what the examples load from) continues from the newest checkpoint
instead of step 0. The fresh rendezvous store of a round is the launcher's: :mod:`tangram_launch.launch.restart`.
"""
from __future__ import annotations

from typing import Mapping

ENV_CHECKPOINT_DIR = "TANGRAM_CHECKPOINT_DIR"  # the run's checkpoint directory (absolute), set by the launcher
ENV_RESUME_DIR = "TANGRAM_RESUME_DIR"  # same name as tangram_launch.worker.ENV_RESUME_DIR
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# An elastic launch's round ordinal, agreed by the agents of the round (tangram_launch.launch.elastic): torch's
# restart count is per agent, and a node that joins later starts counting at 0.
ENV_ROUND = "TANGRAM_ROUND"


def restart_round(env: Mapping[str, str]) -> int:
    """The round the workers run in: 0 is the run's first (an elastic launch's ordinal, else torch's count)."""
    try:
        return int(env.get(ENV_ROUND) or env.get(ENV_RESTART_COUNT, "0") or 0)
    except ValueError:
        return 0


def _has_complete_checkpoint(directory: str) -> bool:
    from tangram_launch.checkpoint.store import find_latest
    from tangram_launch.errors import SpecError

    try:
        find_latest(directory, checksums=False)  # sizes only: load_checkpoint verifies checksums over the ranks
    except SpecError:
        return False
    return True


def resume_dir_for_round(env: Mapping[str, str]) -> str | None:
    """Where a worker resumes from: the run's checkpoint directory in a restart round (once it holds a complete
    checkpoint), else ``--resume``'s directory, else None (a fresh start)."""
    ckpt = env.get(ENV_CHECKPOINT_DIR)
    if restart_round(env) > 0 and ckpt and _has_complete_checkpoint(ckpt):
        return ckpt
    return env.get(ENV_RESUME_DIR) or None
