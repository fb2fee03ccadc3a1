"""Elastic membership with a plan: ``--nnodes MIN:MAX`` and ``--cluster FILE`` re-plan at every rendezvous round.

    tangram-launch --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint head:29400 \\
        --max-restarts 3 --cluster cluster.yaml --node-name a --checkpoint-dir ckpt --model tiny ... \\
        examples/train_gpt.py --steps 100 --save-dir ckpt --save-every 10

A fixed plan is a snapshot of the nodes that started; an elastic job's nodes change between rounds. So the launcher
plans *after* each rendezvous, for the nodes present, through torch's public extension point for rendezvous: it
registers a backend that wraps the one asked for (``c10d``) and hands the rendezvous result to
:class:`PlannedRendezvous`, which torch's elastic agent calls like any handler. No torch code is replaced.

At each round (:meth:`PlannedRendezvous.next_rendezvous`, in the agent, before it starts the workers):

* the agents of the round agree on its *ordinal* (a counter in the rendezvous store that every round's first agent
  increments) and on who is present: each publishes its cluster node name under its group rank in the round's own
  store (torch prefixes it by the rendezvous round, so nothing of an earlier round is read);
* every agent plans for the present nodes, in the cluster file's order, with the planning request fixed at launch
  (model, batch, dtype decided once for the whole cluster, so every round trains the same run): the planner is
  deterministic, so agents with the same cluster file write the same bytes, and the workers' boot checks that they
  did (:func:`tangram_launch.launch.boot.check_agents_agree`, keyed by the round);
* the plan file, its sha256 and the ordinal go to the round's workers through the agent's environment
  (:data:`ENV_ROUND`, :data:`ENV_ROUND_PLAN_FILE`, :data:`ENV_ROUND_PLAN_HASH`); a round after the first resumes from
  the run's newest checkpoint (:mod:`tangram_launch.checkpoint.rounds`), under the new layout.

A lost node: the survivors' workers fail, torch's agent restarts them (``--max-restarts``), and the next round has
the nodes left. A node that returns waits in the rendezvous; torch's agent restarts the workers as soon as it
sees a waiting node, but :class:`GrowAtCheckpoint` shows it the waiting node only once the run's checkpoint
directory holds a checkpoint newer than the one there when the node arrived, so the job grows back right after the
next checkpoint (only the steps the workers finish before the agent stops them, about a second's, are trained
again). The agent hosting the rendezvous endpoint (torch's c10d store) must stay up.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tangram_launch.checkpoint.rounds import ENV_ROUND  # the round's ordinal, the same on every agent
from tangram_launch.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.launch.planning import PlanningRequest
    from tangram_launch.specs.cluster import ClusterSpec

logger = logging.getLogger(__name__)

ENV_ROUND_PLAN_FILE = "TANGRAM_ROUND_PLAN_FILE"  # the plan of this round, for boot
ENV_ROUND_PLAN_HASH = "TANGRAM_ROUND_PLAN_HASH"
ROUND_ENV = (ENV_ROUND, ENV_ROUND_PLAN_FILE, ENV_ROUND_PLAN_HASH)
AGREE_TIMEOUT_S = 120.0  # agents of a round publish their node within this time (they left the rendezvous together)
CHECKPOINT_POLL_S = 1.0  # how often a waiting node's agent looks for the next checkpoint


def subset_cluster(cluster: "ClusterSpec", present: Sequence[str]) -> "ClusterSpec":
    """The cluster restricted to the ``present`` nodes, in the cluster's own order (links between them kept)."""
    keep = set(present)
    unknown = sorted(keep - set(cluster.node_names))
    if unknown:
        raise SpecError("node not in the cluster", field="--node-name", value=unknown[0],
                        valid=", ".join(cluster.node_names))
    fabrics = tuple(replace(f, nodes=f.nodes & keep) for f in cluster.fabrics if f.nodes & keep)
    pairs = {k: v for k, v in cluster.pair_links.items() if k <= keep}
    return replace(cluster, nodes=tuple(n for n in cluster.nodes if n.name in keep), fabrics=fabrics,
                   pair_links=pairs)


@dataclass(frozen=True)
class RoundPlan:
    ordinal: int
    nodes: tuple[str, ...]
    plan_path: str
    plan_hash: str


@dataclass(frozen=True)
class ElasticPlanner:
    """What every round is planned from: the whole cluster, the request fixed at launch, this agent's node."""

    cluster: "ClusterSpec"
    cluster_source: str
    request: "PlanningRequest"
    node: str
    nproc_per_node: int
    out_dir: str

    def plan_for(self, ordinal: int, present: Sequence[str]) -> RoundPlan:
        """Plan for the present nodes and write the canonical plan file (the same bytes on every agent)."""
        from tangram_launch.launch.planning import check_plan_fits_launch, make_launch_plan, write_plan
        from tangram_launch.worker import sha256_bytes

        sub = subset_cluster(self.cluster, present)
        plan = make_launch_plan(sub, self.request)
        check_plan_fits_launch(plan, sub, nproc_per_node=self.nproc_per_node, node=self.node,
                               source=self.cluster_source)
        path = write_plan(plan, self.out_dir)
        with open(path, "rb") as f:
            digest = sha256_bytes(f.read())
        return RoundPlan(ordinal=ordinal, nodes=sub.node_names, plan_path=path, plan_hash=digest)


def agree_on_round(store: Any, *, rank: int, world_size: int, node: str, run_id: str,
                   timeout_s: float = AGREE_TIMEOUT_S) -> tuple[int, tuple[str, ...]]:
    """(ordinal, nodes by group rank) of the round whose store is ``store`` (torch's round-prefixed store).

    The ordinal counts rounds in the underlying rendezvous store, which lives as long as the job's rendezvous;
    group rank 0 takes it, the others read it. SpecError when two agents claim the same node."""
    if rank == 0:
        ordinal = store.underlying_store.add(f"tangram/elastic/{run_id}/rounds", 1) - 1
        store.set("tangram/elastic/ordinal", str(ordinal))
    store.set(f"tangram/elastic/node/{rank}", node)
    keys = ["tangram/elastic/ordinal", *(f"tangram/elastic/node/{r}" for r in range(world_size))]
    store.wait(keys, timedelta(seconds=timeout_s))
    ordinal = int(store.get(keys[0]).decode())
    nodes = tuple(store.get(k).decode() for k in keys[1:])
    twice = sorted({n for n in nodes if nodes.count(n) > 1})
    if twice:
        raise SpecError(f"cluster node {twice[0]!r} is claimed by two agents in rendezvous round {ordinal}; give "
                        "each agent its own --node-name", field="--node-name", value=twice[0])
    return ordinal, nodes


def newest_committed_step(directory: str) -> int | None:
    """The newest ``step_<N>`` a save committed (renamed from its temporary name when complete); the workers
    verify it when they load it. Read without the loader's warnings: the agent polls it."""
    from tangram_launch.checkpoint.store import list_candidates

    return next((c.step for c in list_candidates(directory) if c.committed), None)


class GrowAtCheckpoint:
    """What the agent is told about waiting nodes: none until the run's next checkpoint is complete.

    torch's agent restarts its workers the moment :meth:`RendezvousHandler.num_nodes_waiting` is positive; the
    steps since the last checkpoint would be trained twice. Holding the count back until a checkpoint newer than
    the one present when the node arrived exists makes the restart happen right after a save."""

    def __init__(self, directory: str, *, poll_s: float = CHECKPOINT_POLL_S,
                 clock: Callable[[], float] = time.monotonic,
                 newest: Callable[[str], int | None] = newest_committed_step) -> None:
        self.directory, self.poll_s, self.clock, self.newest = directory, poll_s, clock, newest
        self._baseline: int | None = None
        self._waiting_since: float | None = None
        self._last_poll = 0.0

    def admit(self, waiting: int) -> int:
        if waiting <= 0:
            self._waiting_since = None
            return 0
        now = self.clock()
        if self._waiting_since is None:
            self._waiting_since, self._last_poll = now, now
            self._baseline = self.newest(self.directory)
            logger.info("%d node(s) waiting to join: the job grows at the next checkpoint (newest now: %s)", waiting,
                        "none" if self._baseline is None else f"step {self._baseline}")
            return 0
        if now - self._last_poll < self.poll_s:
            return 0
        self._last_poll = now
        step = self.newest(self.directory)
        if step is None or (self._baseline is not None and step <= self._baseline):
            return 0
        logger.info("checkpoint step %d is complete: admitting %d waiting node(s) (re-planning)", step, waiting)
        self._waiting_since = None
        return waiting


class PlannedRendezvous:
    """A rendezvous handler that re-plans after every round (see the module doc); the rest is the inner one's."""

    def __init__(self, inner: Any, *, backend: str, planner: ElasticPlanner,
                 gate: GrowAtCheckpoint | None, on_round: Callable[[RoundPlan], None]) -> None:
        self._inner, self._backend, self._planner, self._gate, self._on_round = inner, backend, planner, gate, on_round

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> Any:
        info = same_worker_store(self._inner.next_rendezvous())
        ordinal, present = agree_on_round(info.store, rank=info.rank, world_size=info.world_size,
                                          node=self._planner.node, run_id=self._inner.get_run_id())
        self._on_round(self._planner.plan_for(ordinal, present))
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        return self._gate.admit(waiting) if self._gate is not None else waiting

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def same_worker_store(info: Any) -> Any:
    """The rendezvous result with the worker store every agent of the round uses.

    torch's dynamic rendezvous keeps an agent's worker-store address (``bootstrap_store_info``) from its first round
    and publishes it in a round's store only when it builds it anew; a node joining a running job builds it and
    waits for group rank 0 to publish, which a rank 0 keeping its address never does (the join times out), and an
    agent keeping an address that another node's store replaced would start its workers on the old one. So group
    rank 0 publishes its address in every round (the keys and values torch's build writes), and every other agent
    takes the published one."""
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    kept = info.bootstrap_store_info
    if kept is None:
        return info
    if info.rank == 0:
        info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, kept.master_addr)
        info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(kept.master_port))
        return info
    addr = info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
    port = int(info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
    if (addr, port) == (kept.master_addr, kept.master_port):
        return info
    logger.info("this round's worker store is %s:%d (rank 0's), not %s:%d", addr, port, kept.master_addr,
                kept.master_port)
    return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))


def register_backend(inner_backend: str, make: Callable[[Any, str], PlannedRendezvous]) -> str:
    """Register a rendezvous backend that wraps ``inner_backend`` (torch's registry, its public extension point);
    returns its name, unique to this launch (the registry keeps one creator per name)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    name = f"tangram-{inner_backend}-{uuid.uuid4().hex[:8]}"

    def create(params: RendezvousParameters) -> PlannedRendezvous:
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        inner = get_rendezvous_handler(RendezvousParameters(
            inner_backend, params.endpoint, params.run_id, params.min_nodes, params.max_nodes, params.local_addr,
            **params.config))
        return make(inner, name)

    rendezvous_handler_registry.register(name, create)
    return name


def check_elastic_launch(cluster: "ClusterSpec", *, node: str | None, nnodes: tuple[int, int], nproc_per_node: int,
                         rdzv_backend: str, max_restarts: int, source: str) -> str:
    """Refuse what cannot run elastically (before any rendezvous); returns this agent's cluster node."""
    min_nodes, max_nodes = nnodes
    if rdzv_backend == "static":
        raise SpecError("an elastic launch (--nnodes MIN:MAX) needs a dynamic rendezvous", field="--rdzv-backend",
                        value=rdzv_backend, valid="c10d")
    if max_nodes > len(cluster.nodes):
        raise SpecError(f"the cluster has {len(cluster.nodes)} node(s) ({', '.join(cluster.node_names)}); an "
                        "elastic launch plans for the nodes present, which must all be in it", source=source,
                        field="--nnodes", value=f"{min_nodes}:{max_nodes}", valid=f"MAX <= {len(cluster.nodes)}")
    if node is None:
        raise SpecError("this host matches no single cluster node; say which node this agent is", source=source,
                        field="--node-name", valid=", ".join(cluster.node_names))
    gpus = cluster.node(node).num_gpus
    if gpus != nproc_per_node:
        raise SpecError(f"cluster node {node!r} has {gpus} GPU(s); an elastic launch starts one worker per GPU of "
                        "the node", source=source, field="--nproc-per-node", value=nproc_per_node, valid=str(gpus))
    if max_restarts < 1:
        logger.warning("--max-restarts 0: a lost node ends the run; pass --max-restarts N to continue on the nodes "
                       "left (each loss uses one restart; a node joining does not)")
    return node


def launch_elastic(options: Any, *, staging: str, resume: Any, launch: Callable[[Any, Any], int],
                   route: Callable[[Any, Sequence[str]], Any]) -> int:
    """Run torch's agent with the planning rendezvous (see the module doc); ``launch`` and ``route`` are the
    launcher's (:mod:`tangram_launch.launch.torchrun`): torch's run under its error handling, and torchrun's
    arguments with boot, given its options, as the target."""
    import socket

    from tangram_launch.launch import preflight
    from tangram_launch.launch.lifetime import exported, worker_environment
    from tangram_launch.launch.planning import planning_request, this_node
    from tangram_launch.specs.cluster import ClusterSpec

    opts, args = options.tangram, options.torchrun
    if not opts.cluster:
        raise SpecError("an elastic launch (--nnodes MIN:MAX) plans each round for the nodes present, from a cluster "
                        "file that lists every node the job may have", field="--cluster",
                        valid="--cluster FILE (profile once with `tangram-launch profile`)")
    cluster = ClusterSpec.load(opts.cluster)
    node = check_elastic_launch(cluster, node=this_node(cluster, opts.node_name),
                                nnodes=preflight.nnodes_range(args.nnodes), nproc_per_node=options.nproc_per_node,
                                rdzv_backend=args.rdzv_backend, max_restarts=int(args.max_restarts),
                                source=opts.cluster)
    request = planning_request(opts, resume=resume, cluster=cluster, progress=False)  # decided once, for all rounds
    preflight.check_runtime_packages(request.runtime, field="--runtime", source=opts.cluster)
    logger.info("elastic launch: agent of cluster node %r; every rendezvous round plans %s (global batch %d x %d "
                "tokens, %s) for the nodes present", node, request.model.name, request.global_batch,
                request.seq_len, request.dtype)
    planner = ElasticPlanner(cluster=cluster, cluster_source=opts.cluster, request=request, node=node,
                             nproc_per_node=options.nproc_per_node, out_dir=staging)
    from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR

    ckpt_dir = os.environ.get(ENV_CHECKPOINT_DIR)
    gate = GrowAtCheckpoint(ckpt_dir) if ckpt_dir else None
    if gate is None:
        logger.warning("no --checkpoint-dir: a node that joins restarts the workers at once, and the steps since "
                       "the last checkpoint are trained again; with --checkpoint-dir DIR (the script's save "
                       "directory) it joins at the next checkpoint")
    rounds: list[RoundPlan] = []

    def on_round(rp: RoundPlan) -> None:
        _log_round(rp, rounds[-1] if rounds else None)
        rounds.append(rp)
        os.environ.update({ENV_ROUND: str(rp.ordinal), ENV_ROUND_PLAN_FILE: rp.plan_path,
                           ENV_ROUND_PLAN_HASH: rp.plan_hash})  # the agent starts the round's workers with these

    backend = register_backend(args.rdzv_backend, lambda inner, name: PlannedRendezvous(
        inner, backend=name, planner=planner, gate=gate, on_round=on_round))
    boot_opts = ["--node", node, "--agent-id", f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"]
    if opts.resume:
        boot_opts += ["--resume", os.path.abspath(opts.resume)]
    routed = route(args, boot_opts)
    routed.rdzv_backend = backend
    with exported({name: "" for name in ROUND_ENV}), worker_environment():
        return launch(routed, None)


def _log_round(rp: RoundPlan, before: RoundPlan | None) -> None:
    from tangram_launch.launch.planning import plan_changes
    from tangram_launch.worker import read_plan_dict

    new = read_plan_dict(rp.plan_path)
    logger.info("rendezvous round %d: node(s) %s present; plan %s (sha256 %s, %d rank(s))", rp.ordinal,
                ", ".join(rp.nodes), rp.plan_path, rp.plan_hash[:12], len(new.get("rank_layout") or ()))
    if before is not None and before.plan_hash != rp.plan_hash:
        for line in plan_changes(read_plan_dict(before.plan_path), new):
            logger.info("  %s", line)


__all__ = ["launch_elastic", "ENV_ROUND", "ENV_ROUND_PLAN_FILE", "ENV_ROUND_PLAN_HASH", "ROUND_ENV", "subset_cluster",
           "RoundPlan", "ElasticPlanner", "agree_on_round", "newest_committed_step", "GrowAtCheckpoint",
           "PlannedRendezvous", "same_worker_store", "register_backend", "check_elastic_launch"]
