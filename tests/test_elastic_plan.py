"""Elastic membership with a plan (``--nnodes MIN:MAX --cluster FILE``): every rendezvous round re-plans for the
nodes present and resumes from the newest checkpoint; a node that returns joins at the next checkpoint.

The end-to-end test runs two real agents on this machine (c10d rendezvous on 127.0.0.1), kills one agent's process
group with SIGKILL, starts it again, and compares every step's loss with an uninterrupted single-process run on the
same samples. The rest runs in this process: the cluster subset, the round agreement over a store, the gate that
holds a joining node until the next checkpoint, and the refusals.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.errors import SpecError
from tangram_launch.launch import elastic
from tangram_launch.specs.cluster import ClusterSpec

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "scripts" / "elastic_train.py"
CLUSTER = """\
name: two-cpu-nodes
network:
  default: {bandwidth_GBps: 5, latency_us: 20}
  pairs:
    - {nodes: [a, b], bandwidth_GBps: 8, latency_us: 10}
nodes:
  - name: a
    host: localhost
    gpus:
      - {type: cpu, tflops: {bf16: 0.2, fp16: 0.2, fp32: 0.1}}
  - name: b
    host: localhost
    gpus:
      - {type: cpu, tflops: {bf16: 0.2, fp16: 0.2, fp32: 0.1}}
"""
TRAIN = ["--model", "tiny", "--global-batch", "8", "--seq-len", "32", "--dtype", "fp32", "--runtime", "torch"]
STEPS, SAVE_EVERY = 14, 2


def _cluster(tmp_path: Path) -> ClusterSpec:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return ClusterSpec.load(path)


# --- in-process ------------------------------------------------------------------------------------------------------

def test_a_subset_of_the_cluster_keeps_the_file_order_and_the_links_between_the_nodes_kept(tmp_path):
    cluster = _cluster(tmp_path)
    both = elastic.subset_cluster(cluster, ["b", "a"])
    assert both.node_names == ("a", "b") and both.link("a", "b").bandwidth_GBps == 8
    alone = elastic.subset_cluster(cluster, ["b"])
    assert alone.node_names == ("b",) and not alone.pair_links and alone.num_gpus == 1
    with pytest.raises(SpecError, match="node not in the cluster.*'c'"):
        elastic.subset_cluster(cluster, ["a", "c"])


def test_planning_a_round_gives_every_agent_the_same_bytes_and_only_the_nodes_present(tmp_path):
    from tangram_launch.launch import torchrun
    from tangram_launch.launch.planning import plan_inputs
    from tangram_launch.plan import Plan

    cluster = _cluster(tmp_path)
    request = plan_inputs(torchrun.TangramOptions(model="tiny", global_batch=8, seq_len=32, dtype="fp32",
                                                  runtime="torch"))
    agents = [elastic.ElasticPlanner(cluster=cluster, cluster_source="cluster.yaml", request=request, node=node,
                                     nproc_per_node=1, out_dir=str(tmp_path / node)) for node in ("a", "b")]
    both = [agent.plan_for(3, ["a", "b"]) for agent in agents]
    assert both[0].plan_hash == both[1].plan_hash and both[0].nodes == ("a", "b")
    assert Path(both[0].plan_path).read_bytes() == Path(both[1].plan_path).read_bytes()
    alone = agents[0].plan_for(4, ["a"])
    assert Plan.load(alone.plan_path).world_size == 1 and alone.plan_hash != both[0].plan_hash


def _store():
    import torch.distributed as dist

    return dist.HashStore()


def test_agents_of_a_round_agree_on_its_ordinal_and_its_nodes():
    import torch.distributed as dist

    base = _store()
    results: dict[int, tuple] = {}

    def agent(rank: int, node: str, rnd: int) -> None:
        store = dist.PrefixStore(f"torch.rendezvous.run.{rnd}", base)  # torch's round-scoped store
        results[rank] = elastic.agree_on_round(store, rank=rank, world_size=2, node=node, run_id="run", timeout_s=30)

    for rnd in (0, 1):
        threads = [threading.Thread(target=agent, args=(1, "b", rnd)),
                   threading.Thread(target=agent, args=(0, "a", rnd))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results[0] == results[1] == (rnd, ("a", "b"))
    store = dist.PrefixStore("torch.rendezvous.run.2", base)
    store.set("tangram/elastic/node/1", "a")  # another agent already claimed node a in this round
    with pytest.raises(SpecError, match="'a' is claimed by two agents in rendezvous round 2"):
        elastic.agree_on_round(store, rank=0, world_size=2, node="a", run_id="run", timeout_s=5)


def test_a_waiting_node_is_admitted_only_once_a_newer_checkpoint_is_complete():
    now = [0.0]
    newest = {"step": 4}
    gate = elastic.GrowAtCheckpoint("ckpt", poll_s=1.0, clock=lambda: now[0], newest=lambda d: newest["step"])
    assert gate.admit(0) == 0
    assert gate.admit(1) == 0  # arrives after step 4: waits for the next checkpoint
    now[0] = 5.0
    assert gate.admit(1) == 0  # still step 4
    newest["step"] = 6
    now[0] = 5.5
    assert gate.admit(1) == 0  # polled less than a second ago
    now[0] = 6.5
    assert gate.admit(1) == 1  # step 6 is complete: the agent restarts its workers now
    assert gate.admit(0) == 0
    newest["step"] = None
    fresh = elastic.GrowAtCheckpoint("ckpt", poll_s=0.0, clock=lambda: now[0], newest=lambda d: newest["step"])
    assert fresh.admit(2) == 0 and fresh.admit(2) == 0  # no checkpoint yet: wait for the first one
    newest["step"] = 2
    assert fresh.admit(2) == 2


def test_every_agent_of_a_round_is_given_the_worker_store_of_group_rank_0():
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    store = dist.PrefixStore("torch.rendezvous.run.5", dist.HashStore())
    rank0 = RendezvousInfo(store, 0, 2, RendezvousStoreInfo("host-a", 4001))  # kept from an earlier round
    assert elastic.same_worker_store(rank0) is rank0  # and published again for this round
    stale = RendezvousInfo(store, 1, 2, RendezvousStoreInfo("host-b", 5002))  # the store of a node now gone
    fixed = elastic.same_worker_store(stale).bootstrap_store_info
    assert (fixed.master_addr, fixed.master_port) == ("host-a", 4001)


class _Inner:
    """A one-agent rendezvous, as torch's handler answers it (a round-scoped store per round)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.base, self.round, self.waiting = dist.HashStore(), 0, 0

    def next_rendezvous(self):
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        self.round += 1
        store = dist.PrefixStore(f"torch.rendezvous.run.{self.round}", self.base)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", 4000))

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return "run"


def test_the_planning_rendezvous_plans_each_round_and_shows_waiting_nodes_only_after_a_checkpoint(tmp_path):
    from tangram_launch.launch import torchrun
    from tangram_launch.launch.planning import plan_inputs

    request = plan_inputs(torchrun.TangramOptions(model="tiny", global_batch=8, seq_len=32, dtype="fp32",
                                                  runtime="torch"))
    planner = elastic.ElasticPlanner(cluster=_cluster(tmp_path), cluster_source="cluster.yaml", request=request,
                                     node="a", nproc_per_node=1, out_dir=str(tmp_path / "plans"))
    newest = {"step": 2}
    gate = elastic.GrowAtCheckpoint("ckpt", poll_s=0.0, newest=lambda d: newest["step"])
    rounds: list = []
    inner = _Inner()
    handler = elastic.PlannedRendezvous(inner, backend="tangram-c10d-x", planner=planner, gate=gate,
                                        on_round=rounds.append)
    for _ in range(2):
        assert handler.next_rendezvous().bootstrap_store_info.master_port == 4000
    assert [(r.ordinal, r.nodes) for r in rounds] == [(0, ("a",)), (1, ("a",))]
    assert rounds[0].plan_hash == rounds[1].plan_hash and handler.get_backend() == "tangram-c10d-x"
    inner.waiting = 1
    assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0
    newest["step"] = 4
    assert handler.num_nodes_waiting() == 1


@pytest.mark.parametrize("change, message", [
    ({"nnodes": (1, 3)}, "--nnodes.*1:3.*MAX <= 2"),
    ({"nproc_per_node": 2}, "'--nproc-per-node': cluster node 'a' has 1 GPU.*got 2"),
    ({"rdzv_backend": "static"}, "needs a dynamic rendezvous"),
    ({"node": None}, "say which node this agent is.*valid: a, b"),
])
def test_an_elastic_launch_that_cannot_run_is_refused_before_any_rendezvous(tmp_path, change, message):
    args = {"node": "a", "nnodes": (1, 2), "nproc_per_node": 1, "rdzv_backend": "c10d", "max_restarts": 3,
            "source": "cluster.yaml", **change}
    with pytest.raises(SpecError, match=message):
        elastic.check_elastic_launch(_cluster(tmp_path), **args)


def test_the_launcher_refuses_an_elastic_launch_it_cannot_plan_before_any_rendezvous(tmp_path, monkeypatch):
    from helpers_plans import make_plan

    from tangram_launch.launch import torchrun as launch

    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    _cluster(tmp_path)
    elastic_world = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     "127.0.0.1:1"]
    script = str(REPO / "examples" / "train_gpt.py")
    with pytest.raises(SpecError, match="plans each round for the nodes present, from a cluster file") as info:
        launch.run([*elastic_world, "--model", "tiny", "--global-batch", "8", script])
    assert info.value.field == "--cluster"
    with pytest.raises(SpecError, match="the cluster has 2 node.*MAX <= 2"):
        launch.run([*elastic_world[:1], "1:3", *elastic_world[2:], "--cluster", str(tmp_path / "cluster.yaml"),
                    "--node-name", "a", *TRAIN, script])
    plan = tmp_path / "plan.json"
    make_plan("tiny", [(4, "local")], global_batch=8, num_microbatches=1).dump(str(plan))
    with pytest.raises(SpecError, match="a fixed plan is not elastic.*give --cluster FILE instead of --plan"):
        launch.run([*elastic_world, "--plan", str(plan), script])


def test_the_round_ordinal_is_the_round_of_restart_and_resume_and_boot_reads_the_round_plan(tmp_path):
    from tangram_launch.checkpoint.rounds import restart_round
    from tangram_launch.launch import boot

    assert restart_round({"TORCHELASTIC_RESTART_COUNT": "1", "TANGRAM_ROUND": "3"}) == 3  # a late node counts 0
    assert restart_round({"TORCHELASTIC_RESTART_COUNT": "1", "TANGRAM_ROUND": ""}) == 1
    env = {elastic.ENV_ROUND_PLAN_FILE: "/p/plan-1.json", elastic.ENV_ROUND_PLAN_HASH: "h1"}
    args = boot.parse_boot_args(["--node", "a", "--agent-id", "x:1", "--", "train.py"], env)
    assert (args.plan_file, args.plan_hash, args.node) == ("/p/plan-1.json", "h1", "a")
    with pytest.raises(SpecError, match="'--plan-file': missing boot option"):
        boot.parse_boot_args(["--node", "a", "--agent-id", "x:1", "--", "train.py"], {})


# --- two agents ------------------------------------------------------------------------------------------------------

def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(tmp_path: Path, record: str) -> list[str]:
    return [str(WORKER), str(tmp_path / record), str(tmp_path / "pace"), "--steps", str(STEPS), "--save-dir",
            str(tmp_path / "ckpt"), "--save-every", str(SAVE_EVERY), "--timeout-s", "30", "--quiet"]


def _agent(tmp_path: Path, node: str, port: int, *, host: bool, log: str) -> subprocess.Popen:
    conf = f"is_host={int(host)},last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=5"
    cmd = [sys.executable, "-m", "tangram_launch.cli", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", conf,
           "--max-restarts", "3", "--cluster", str(tmp_path / "cluster.yaml"), "--node-name", node,
           "--checkpoint-dir", str(tmp_path / "ckpt"), *TRAIN, *_script(tmp_path, "steps.jsonl")]
    with open(tmp_path / log, "w") as out:  # a session of its own: killpg takes the agent, PDEATHSIG its workers
        return subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, until, procs: list[subprocess.Popen], tmp_path: Path, timeout_s: float = SUBPROCESS_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = until()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                logs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp_path.glob("*.log")))
                pytest.fail(f"an agent exited ({p.returncode}) while waiting for {what}:\n{logs}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _newest_checkpoint(tmp_path: Path) -> int | None:
    """The newest committed step (a save renames its temporary directory to ``step_<N>`` when complete)."""
    steps = [int(p.name[5:]) for p in (tmp_path / "ckpt").glob("step_*") if p.name[5:].isdigit()]
    return max(steps, default=None)


@pytest.mark.distributed
def test_a_lost_node_re_plans_the_survivor_and_a_returning_node_grows_the_job_back_with_the_same_losses(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "no-pace").write_text("0")
    single = tmp_path / "single.yaml"
    single.write_text(CLUSTER.split("  - name: b")[0].replace("  pairs:\n    - {nodes: [a, b], bandwidth_GBps: 8, "
                                                              "latency_us: 10}\n", ""))
    # the uninterrupted single-process run, beside the elastic one (it is read at the end)
    ref = subprocess.Popen([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "1",
                            "--cluster", str(single), *TRAIN, str(WORKER), str(tmp_path / "ref.jsonl"),
                            str(tmp_path / "no-pace"), "--steps", str(STEPS), "--quiet"], cwd=tmp_path,
                           env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    (tmp_path / "pace").write_text("1.0")  # after each step: no save completes between a look and the kill
    port, steps = _free_port(), tmp_path / "steps.jsonl"
    a = _agent(tmp_path, "a", port, host=True, log="a.log")  # hosts the rendezvous store: it must stay up
    b = _agent(tmp_path, "b", port, host=False, log="b1.log")
    try:
        # both nodes train; once step 4 is saved and step 5 is done, node b is lost (its agent's process group)
        _wait("two nodes past a checkpoint", lambda: _newest_checkpoint(tmp_path) and any(
            r["world"] == 2 and r["step"] > _newest_checkpoint(tmp_path) >= 4 for r in _records(steps)), [a, b],
            tmp_path)
        lost_after = _newest_checkpoint(tmp_path)
        killed_at = time.time()
        os.killpg(b.pid, signal.SIGKILL)
        b.wait(60)
        # the survivor re-plans for itself and continues from the newest checkpoint
        alone = _wait("the survivor alone", lambda: [r for r in _records(steps) if r["world"] == 1 and
                                                     r["t"] > killed_at], [a], tmp_path)
        (tmp_path / "pace").write_text("2.0")  # slow enough for node b to come back before the run ends
        before = (tmp_path / "a.log").read_text().count("waiting to join")
        b = _agent(tmp_path, "b", port, host=False, log="b2.log")
        _wait("node b waiting to join", lambda: (tmp_path / "a.log").read_text().count("waiting to join") > before,
              [a, b], tmp_path)
        (tmp_path / "pace").write_text("0.2")
        assert a.wait(SUBPROCESS_TIMEOUT_S) == 0, (tmp_path / "a.log").read_text()[-4000:]
        assert b.wait(SUBPROCESS_TIMEOUT_S) == 0, (tmp_path / "b2.log").read_text()[-4000:]
        _, ref_err = ref.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        assert ref.returncode == 0, ref_err[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if ref.poll() is None:
            ref.kill()
    want = {r["step"]: r["loss"] for r in _records(tmp_path / "ref.jsonl")}
    assert sorted(want) == list(range(1, STEPS + 1))
    records = _records(steps)
    timeline = f"node b killed at +{killed_at - records[0]['t']:.1f} s; step/world at time: " + "; ".join(
        f"{r['step']}/{r['world']} +{r['t'] - records[0]['t']:.1f}" for r in records)
    phases = [records[0]["world"]]
    for r in records[1:]:
        if r["world"] != phases[-1]:
            phases.append(r["world"])
    # both nodes, node b lost, node b back (when node b came to the first round after it closed, it joined at
    # the first checkpoint: one more round of node a alone at the start)
    assert phases in ([2, 1, 2], [1, 2, 1, 2]), timeline
    first_alone = next(i for i, r in enumerate(records) if r["world"] == 1 and r["t"] > killed_at)
    assert records[first_alone]["step"] == alone[0]["step"] == lost_after + 1, timeline  # the newest checkpoint
    regrown = next(i for i, r in enumerate(records) if i > first_alone and r["world"] == 2)
    joined_at = records[regrown]["step"] - 1
    assert joined_at % SAVE_EVERY == 0 and joined_at > lost_after, timeline  # a checkpoint the survivor wrote
    log = (tmp_path / "a.log").read_text()
    arrived = re.findall(r"waiting to join: the job grows at the next checkpoint \(newest now: step (\d+)\)", log)
    admitted = re.findall(r"checkpoint step (\d+) is complete: admitting 1 waiting node", log)
    assert arrived and admitted and int(arrived[-1]) < int(admitted[-1]) <= joined_at, timeline
    assert records[-1]["step"] == STEPS
    assert {r["step"] for r in records} == set(range(1, STEPS + 1))
    for r in records:  # every step, in every round and layout, as the uninterrupted run
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-5, abs=1e-6), r
    assert "node(s) a present" in log and log.count("node(s) a, b present") >= 2
    assert "world size 2 -> 1" in log and "world size 1 -> 2" in log
