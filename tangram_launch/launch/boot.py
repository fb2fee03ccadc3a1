"""Worker bootstrap of a planned launch: check the plan, take the plan's rank, then run the script like python.

``tangram-launch --plan FILE`` has torch's elastic agent start, instead of ``python -u script.py args``::

    python -u -m tangram_launch.launch.boot --plan-file F --plan-hash H --node N --agent-id A -- script.py args
    python -u -m tangram_launch.launch.boot ... -- -m package.module args      # tangram-launch -m
    python -u -m tangram_launch.launch.boot ... -- --exec cmd args             # tangram-launch --no-python (exec's cmd)

Why a bootstrap: torch's agent numbers ranks agent by agent in rendezvous order, which on a heterogeneous cluster
is not the plan's layout (a stage's ranks must sit on its island).  Boot remaps ``RANK``/``ROLE_RANK`` so the worker
with local rank i on plan node N gets the rank of N's i-th local GPU in the plan, keeps torchrun's rank in
``TANGRAM_TORCHRUN_RANK`` and exports the ``TANGRAM_*`` variables of :mod:`tangram_launch.worker`.  Everything else
torchrun set (MASTER_ADDR/PORT, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_*) is left alone, so ``init_process_group``
with ``env://`` works unchanged: torch's agents host the TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), so which
worker holds rank 0 does not matter to the store.

Before anything else, boot ties the worker's life to its launcher (:mod:`tangram_launch.launch.lifetime`: a
``kill -9`` of tangram-launch takes its workers with it). A typed error (:class:`TangramError`) out of the script
is reported in one line, without a traceback; bad input exits with the status the launcher turns into its own
exit 2 (:mod:`tangram_launch.launch.worker_exit`).

Agents agree on the plan before the script runs (only when there is more than one agent): each worker connects
to that agent-hosted TCPStore at MASTER_ADDR:MASTER_PORT as a client, publishes ``<plan sha256> <agent id>`` under
``tangram/<run id>/plan/<node>`` (``tangram/<run id>/round/<r>/plan/<node>`` in round r > 0: torch keeps one store
across rounds), waits for every plan node's key and compares. An elastic launch plans anew at every round
(:mod:`tangram_launch.launch.elastic`): boot then reads the round's plan file and hash from the environment the
agent set for the round, and the check compares the plans of the nodes present.  A different plan on any agent, or
two agents claiming one node (which leaves another node missing), fails every worker as bad input, with a
message naming the node and host, before any collective is attempted (the launcher then exits 2).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Sequence

from tangram_launch import worker as W
from tangram_launch.errors import SpecError, TangramError
from tangram_launch.launch.worker_exit import EXIT_WORKER_INPUT_ERROR, end_worker, exit_status_for

ENV_CHECK_TIMEOUT_S = "TANGRAM_PLAN_CHECK_TIMEOUT_S"  # how long workers wait for every agent to publish its plan
DEFAULT_CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class BootArgs:
    plan_file: str
    plan_hash: str
    node: str
    agent_id: str
    mode: str  # "script" | "module" | "exec"
    target: str  # script path, module name or command
    args: tuple[str, ...]
    resume_dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("script", "module", "exec"):
            raise SpecError("unknown boot mode", field="mode", value=self.mode, valid="script, module, exec")


def parse_boot_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> BootArgs:
    """Boot's own options end at ``--``; everything after belongs to the target, untouched. Without
    ``--plan-file``/``--plan-hash``, the plan is the round's (an elastic launch: :mod:`.elastic`, from ``env``)."""
    argv = list(argv)
    if "--" not in argv:
        raise SpecError("missing '--' between boot options and the target", field="argv", value=argv)
    split = argv.index("--")
    own, rest = argv[:split], argv[split + 1:]
    opts: dict[str, str] = {}
    known = ("--plan-file", "--plan-hash", "--node", "--agent-id", "--resume")
    i = 0
    while i < len(own):
        if own[i] not in known or i + 1 >= len(own):
            raise SpecError("unknown or incomplete boot option", field="argv", value=own[i], valid=", ".join(known))
        opts[own[i]] = own[i + 1]
        i += 2
    from tangram_launch.launch.elastic import ENV_ROUND_PLAN_FILE, ENV_ROUND_PLAN_HASH

    env = os.environ if env is None else env
    for key, name in (("--plan-file", ENV_ROUND_PLAN_FILE), ("--plan-hash", ENV_ROUND_PLAN_HASH)):
        if key not in opts and env.get(name):
            opts[key] = env[name]
    for key in known[:4]:
        if key not in opts:
            raise SpecError("missing boot option", field=key)
    if not rest:
        raise SpecError("missing target after '--'", field="argv")
    if rest[0] in ("-m", "--exec"):
        if len(rest) < 2:
            raise SpecError(f"{rest[0]} needs a name", field="argv", value=rest)
        mode, target, args = ("module" if rest[0] == "-m" else "exec"), rest[1], rest[2:]
    else:
        mode, target, args = "script", rest[0], rest[1:]
    return BootArgs(plan_file=opts["--plan-file"], plan_hash=opts["--plan-hash"], node=opts["--node"],
                    agent_id=opts["--agent-id"], mode=mode, target=target, args=tuple(args),
                    resume_dir=opts.get("--resume"))


def placement_env(env: Mapping[str, str], boot: BootArgs) -> dict[str, str]:
    """The variables to set for this worker (pure: reads the plan file, the torchrun env; returns the updates).

    Refuses (SpecError) a plan file whose bytes do not hash to what the launcher checked, an unknown node, and a
    torchrun world that differs from the plan (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE).
    """
    try:
        with open(boot.plan_file, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SpecError(f"cannot read the plan: {exc.strerror}", source=boot.plan_file) from None
    digest = W.sha256_bytes(data)
    if digest != boot.plan_hash:
        raise SpecError("plan file changed after the launcher checked it", source=boot.plan_file,
                        field="sha256", value=digest, valid=boot.plan_hash)
    plan = W.read_plan_dict(boot.plan_file, data)
    layout = W.RankLayout.from_plan_dict(plan, source=boot.plan_file)
    if boot.node not in layout.nodes:
        raise SpecError("node not in the plan", source=boot.plan_file, field="node", value=boot.node,
                        valid=", ".join(layout.nodes))
    expect = {"WORLD_SIZE": layout.world_size, "LOCAL_WORLD_SIZE": layout.gpu_count(boot.node),
              "GROUP_WORLD_SIZE": len(layout.nodes)}
    for name, want in expect.items():
        if name in env and int(env[name]) != want:
            raise SpecError(f"torchrun's {name} differs from the plan (plan node {boot.node!r})",
                            source=boot.plan_file, field=name, value=int(env[name]), valid=str(want))
    local_rank = int(env["LOCAL_RANK"])
    slot = layout.slot_for(boot.node, local_rank)
    out = {
        W.ENV_PLAN_FILE: os.path.abspath(boot.plan_file),
        W.ENV_PLAN_HASH: digest,
        W.ENV_NODE: boot.node,
        W.ENV_NODE_INDEX: str(layout.nodes.index(boot.node)),
        W.ENV_LOCAL_GPU: str(slot.local_gpu),
        W.ENV_TORCHRUN_RANK: env.get("RANK", ""),
        "RANK": str(slot.rank),
    }
    if "ROLE_RANK" in env:  # torchrun has one role: ROLE_RANK == RANK
        out[W.ENV_TORCHRUN_ROLE_RANK] = env["ROLE_RANK"]
        out["ROLE_RANK"] = str(slot.rank)
    if slot.stage is not None:
        out[W.ENV_STAGE] = str(slot.stage)
    if boot.resume_dir:
        out[W.ENV_RESUME_DIR] = os.path.abspath(boot.resume_dir)
    out.update(runtime_worker_env(env, W.plan_runtime(plan)))
    return out


def runtime_worker_env(env: Mapping[str, str], runtime: str) -> dict[str, str]:
    """The plan's runtime's worker environment (RuntimeCapabilities.worker_env) where ``env`` does not set the
    variable already: the user's own setting wins."""
    from tangram_launch.capabilities import capabilities_for

    return {k: v for k, v in capabilities_for(runtime).worker_env if k not in env}


def worker_env_overrides(env: Mapping[str, str], runtime: str) -> list[str]:
    """One line per variable of the runtime's worker environment that ``env`` sets otherwise: the workers keep the
    user's value, and the plan was priced for the runtime's (the launcher says so once, before any worker starts)."""
    from tangram_launch.capabilities import capabilities_for

    return [f"{k}={env[k]} is set here, so {runtime}'s workers keep it instead of {k}={v}, which the plan's "
            f"costs assume (docs/runtimes.md, worker environment)"
            for k, v in capabilities_for(runtime).worker_env if k in env and env[k] != v]


def check_agents_agree(*, store, run_id: str, node: str, plan_hash: str, agent_id: str,
                       plan_nodes: Sequence[str], timeout_s: float) -> None:
    """Every plan node's agent published the same plan hash, and no node was claimed twice (see module doc).

    ``store`` is a ``torch.distributed.Store`` client of the agent-hosted TCPStore.  Keys carry the run id; values
    are ``"<sha256> <agent id>"``.  Waiting for all nodes is what makes the check two-sided: a worker on a correct
    agent also fails when another agent brought a different plan, instead of hanging in init_process_group.
    """
    prefix = f"tangram/{run_id}/plan/"
    mine = f"{plan_hash} {agent_id}"
    store.set(prefix + node, mine)
    keys = [prefix + n for n in plan_nodes]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError on timeout
        present = {n: store.get(prefix + n).decode() for n in plan_nodes if store.check([prefix + n])}
        owner = present.get(node, mine).split(" ", 1)[-1]
        if owner != agent_id:
            raise SpecError(f"plan node {node!r} is claimed by two agents ({agent_id} and {owner}); give each agent "
                            "its own --node-name", field="--node-name", value=node) from None
        missing = [n for n in plan_nodes if n not in present]
        seen = ", ".join(f"{n} by {v.split(' ', 1)[-1]}" for n, v in present.items())
        raise SpecError(f"no agent registered plan node(s) {', '.join(missing)} within {timeout_s:g} s "
                        f"(registered: {seen}); start one agent per plan node with the same --plan",
                        field="--node-name", value=missing) from None
    for n, key in zip(plan_nodes, keys):
        value = store.get(key).decode()
        their_hash, _, their_agent = value.partition(" ")
        if their_hash != plan_hash:
            raise SpecError(f"agents disagree on the plan: node {n!r} ({their_agent}) launched sha256 "
                            f"{their_hash[:12]}, this agent ({agent_id}, node {node!r}) {plan_hash[:12]}; "
                            "give every agent the same plan file (byte for byte)", field="--plan")
    if store.get(prefix + node).decode() != mine:
        owner = store.get(prefix + node).decode().partition(" ")[2]
        raise SpecError(f"plan node {node!r} is claimed by two agents ({agent_id} and {owner}); give each agent "
                        "its own --node-name", field="--node-name", value=node)


def _check_across_agents(env: Mapping[str, str], boot: BootArgs) -> None:
    """Connect to the agent store (torch imported only here: single-agent launches skip it)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise SpecError("a planned multi-node launch needs torch's agent-hosted store (the plan's rank 0 may sit on "
                        "any node); unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE", field="TORCHELASTIC_USE_AGENT_STORE",
                        value=env.get("TORCHELASTIC_USE_AGENT_STORE"), valid="True")
    from torch.distributed import TCPStore

    timeout_s = float(env.get(ENV_CHECK_TIMEOUT_S, DEFAULT_CHECK_TIMEOUT_S))
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=timeout_s))
    layout = W.RankLayout.from_plan_dict(W.read_plan_dict(boot.plan_file), source=boot.plan_file)
    from tangram_launch.checkpoint.rounds import restart_round

    run_id, rnd = env.get("TORCHELASTIC_RUN_ID", "none"), restart_round(env)
    check_agents_agree(store=store, run_id=run_id if rnd == 0 else f"{run_id}/round/{rnd}", node=boot.node,
                       plan_hash=boot.plan_hash, agent_id=boot.agent_id, plan_nodes=layout.nodes,
                       timeout_s=timeout_s)


def run_target(boot: BootArgs) -> None:
    """Run the target exactly as ``python [-m]`` would: sys.argv, sys.path[0], ``__main__``; exec for commands."""
    if boot.mode == "exec":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(boot.target, [boot.target, *boot.args])  # same pid: the agent keeps watching it
    if boot.mode == "module":
        sys.argv = [boot.target, *boot.args]  # run_module replaces argv[0] with the module's file, as -m does
        runpy.run_module(boot.target, run_name="__main__", alter_sys=True)
        return
    script = boot.target
    sys.argv = [script, *boot.args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # python puts the script's directory first
    runpy.run_path(os.path.abspath(script), run_name="__main__")


def _report(exc: TangramError, boot: BootArgs | None, *, prog: str = "tangram-launch boot") -> int:
    """stderr for the user (one line, no traceback) and the elastic error file, so the agent's failure summary shows
    the reason. Returns the exit status (bad input: the one the launcher turns into 2, :mod:`.worker_exit`)."""
    where = f" (plan node {boot.node}, local rank {os.environ.get('LOCAL_RANK', '?')})" if boot else ""
    return exit_status_for(exc, prog=f"{prog}{where}")


def stop_quietly_on_sigint() -> None:
    """The agent forwards Ctrl-C to each worker as SIGINT: stop as on SIGTERM, without a KeyboardInterrupt
    traceback per worker. A script that wants to clean up on it installs its own handler."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from tangram_launch.launch.lifetime import die_with_launcher

    die_with_launcher()  # first: a worker never outlives the launcher that started it
    boot = None
    try:
        boot = parse_boot_args(argv)
        os.environ.update(placement_env(os.environ, boot))
        from tangram_launch.launch.restart import fresh_round_store  # restart rounds: a store of their own

        os.environ.update(fresh_round_store(os.environ, torchrun_rank=int(os.environ.get(W.ENV_TORCHRUN_RANK) or 0)))
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            _check_across_agents(os.environ, boot)
    except SpecError as exc:
        return _report(exc, boot)
    stop_quietly_on_sigint()
    try:
        run_target(boot)
    except TangramError as exc:  # the script's own typed error (another model's checkpoint, a shape mismatch)
        return _report(exc, boot, prog=os.path.basename(boot.target))
    except SystemExit as exc:  # the script reported its bad input itself (the example scripts do)
        if exc.code == EXIT_WORKER_INPUT_ERROR:
            return EXIT_WORKER_INPUT_ERROR
        raise
    return 0


if __name__ == "__main__":
    _status = main()
    if _status == EXIT_WORKER_INPUT_ERROR:  # without teardown: a gloo group whose peer left may abort in it
        end_worker(_status)
    if _status:  # no SystemExit(0): under --run-path this file runs inside torch's worker function
        sys.exit(_status)
