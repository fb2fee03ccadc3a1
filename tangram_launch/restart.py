"""Restart rounds (``--max-restarts N``): a fresh store for the new round, and resuming from the last checkpoint.

Why restarts failed with ``Gloo connectFullMesh failed ... Connection refused``: torch's agent shares its
rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps the same store, on the same
MASTER_PORT, for every restart round. ``init_process_group`` keys are not prefixed by the round, so a worker of
round 2 reads the addresses that the dead workers of round 1 published under the same keys and connects to a
closed port (or waits for a barrier count that round 1 already advanced: the hang of a plain gloo loop).
torch.distributed.run has the same behaviour; Tangram fixes it for planned launches, in boot, before the script:

* round 0 is left exactly as torchrun sets it up;
* in round r > 0 the worker with torchrun rank 0 (on the agent that hosts MASTER_ADDR) starts a new TCPStore on a
  free port, held for the life of the process, and publishes the port in the agent's store under
  ``tangram/<run id>/round/<r>/store_port``; every worker of the round waits for that key and sets MASTER_PORT to
  it, so ``init_process_group("env://")`` meets only this round's keys.

Resuming: ``tangram-launch --checkpoint-dir DIR`` (default: the ``--resume`` directory) exports
``TANGRAM_CHECKPOINT_DIR``; in a restart round :func:`resume_dir_for_round` answers DIR as soon as it holds a
complete checkpoint, so :func:`tangram_launch.checkpoint.resume_directory` (what the examples load from) continues
from the newest checkpoint instead of step 0.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Mapping

ENV_CHECKPOINT_DIR = "TANGRAM_CHECKPOINT_DIR"  # the run's checkpoint directory (absolute), set by the launcher
ENV_RESUME_DIR = "TANGRAM_RESUME_DIR"  # same name as tangram_launch.worker.ENV_RESUME_DIR
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ROUND_STORE_TIMEOUT_S = 300.0

_ROUND_STORES: list[Any] = []  # the round's TCPStore server lives as long as the worker process that hosts it


def restart_round(env: Mapping[str, str]) -> int:
    try:
        return int(env.get(ENV_RESTART_COUNT, "0") or 0)
    except ValueError:
        return 0


def _has_complete_checkpoint(directory: str) -> bool:
    from tangram_launch.checkpoint_store import find_latest
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


def fresh_round_store(env: Mapping[str, str], *, torchrun_rank: int) -> dict[str, str]:
    """In a restart round, the MASTER_PORT of a store only this round uses (see the module doc); {} in round 0."""
    rnd = restart_round(env)
    if rnd == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from torch.distributed import TCPStore

    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    timeout = timedelta(seconds=ROUND_STORE_TIMEOUT_S)
    agent = TCPStore(addr, port, is_master=False, timeout=timeout)
    key = f"tangram/{env.get('TORCHELASTIC_RUN_ID', 'none')}/round/{rnd}/store_port"
    if torchrun_rank == 0:
        server = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        _ROUND_STORES.append(server)
        agent.set(key, str(server.port))
    agent.wait([key], timeout)
    return {"MASTER_PORT": agent.get(key).decode()}


__all__ = ["ENV_CHECKPOINT_DIR", "restart_round", "resume_dir_for_round", "fresh_round_store"]
