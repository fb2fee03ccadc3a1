"""Restart rounds (``--max-restarts N``): a fresh store for the new round, and resuming from the last checkpoint.

Why restarts failed with ``Gloo connectFullMesh failed ... Connection refused``: torch's agent shares its
rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps the same store, on the same
MASTER_PORT, for every restart round. ``init_process_group`` keys are not prefixed by the round, so a worker of
round 2 reads the addresses that the dead workers of round 1 published under the same keys and connects to a
closed port (or waits for a barrier count that round 1 already advanced: the hang of a plain gloo loop).
torch.distributed.run has the same behaviour; Tangram fixes it for planned launches, in boot, before the script:

* round 0 is left exactly as torchrun sets it up;
* in round r > 0 (torch's restart count; in an elastic launch, the round ordinal every agent agreed on:
  :func:`tangram_launch.checkpoint.rounds.restart_round`) the worker with torchrun rank 0 (on the agent that hosts
  MASTER_ADDR) starts a new TCPStore on a free port, held for the life of the process, and publishes the port in
  the agent's store under
  ``tangram/<run id>/round/<r>/store_port``; every worker of the round waits for that key and sets MASTER_PORT to
  it, so ``init_process_group("env://")`` meets only this round's keys.

Resuming from the newest checkpoint in a restart round: :mod:`tangram_launch.checkpoint.rounds` for the launcher's
``--checkpoint-dir``, and :func:`resume_dir_for_script` for a script's own save directory: a run restarted without
``--checkpoint-dir`` used to begin again at step 1 and die at "step_N already exists".
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Mapping

from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR, resume_dir_for_round, restart_round

ROUND_STORE_TIMEOUT_S = 300.0

_ROUND_STORES: list[Any] = []  # the round's TCPStore server lives as long as the worker process that hosts it


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


def resume_dir_for_script(script_resume: str | None, save_dir: str | None,
                          env: Mapping[str, str] | None = None) -> str | None:
    """Where a training script resumes from (None: a fresh start).

    Round 0: the script's own ``--resume``, else the launcher's (``tangram-launch --resume``). A restart round
    (``--max-restarts``) continues the run: the directory with the newest complete checkpoint among the script's
    save directory, the launcher's ``--checkpoint-dir`` and those two (every rank reads the same files, so every
    rank picks the same one)."""
    env = os.environ if env is None else env
    launcher = resume_dir_for_round(env)
    if restart_round(env) == 0:
        return script_resume or launcher
    best, best_step = None, -1
    for directory in dict.fromkeys(os.path.abspath(d) for d in (save_dir, env.get(ENV_CHECKPOINT_DIR), script_resume,
                                                                 launcher) if d):
        step = newest_step(directory)
        if step is not None and step > best_step:
            best, best_step = directory, step
    return best or script_resume or launcher


def newest_step(directory: str) -> int | None:
    from tangram_launch.checkpoint.store import find_latest
    from tangram_launch.errors import SpecError

    if not os.path.isdir(directory):
        return None
    try:
        return find_latest(directory, checksums=False).step  # sizes only: loading verifies the checksums
    except SpecError:
        return None


__all__ = ["ENV_CHECKPOINT_DIR", "fresh_round_store", "resume_dir_for_script", "newest_step"]
