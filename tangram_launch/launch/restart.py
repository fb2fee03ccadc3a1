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

Resuming from the newest checkpoint in a restart round: :mod:`tangram_launch.checkpoint.rounds`.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Mapping

from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR, restart_round

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


__all__ = ["ENV_CHECKPOINT_DIR", "fresh_round_store"]
