"""`tangram-launch profile` end to end: real torchrun agents and gloo workers on this CPU machine.

Each test runs the command as a user would (``python -m tangram_launch.cli profile ... --quick``) and checks the
written ClusterSpec with ClusterSpec.load and build_islands.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from timeouts import PROCESS_GROUP_TIMEOUT_S, SUBPROCESS_TIMEOUT_S

from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.islands import build_islands
from tangram_launch.specs.cluster import ClusterSpec

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
# A fifth of a core: on a busy 2-vCPU host an unthrottled process may get only a third to a half of a core, so a
# 33 % quota would hardly bind there; 15 % keeps the throttled rank clearly slower under that load too.
CGROUP_QUOTA_US = 15_000
CGROUP_PERIOD_US = 100_000


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU devices over gloo, also on a machine with GPUs
    env.update(extra)
    return env


def _profile_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tangram_launch.cli", "profile", "--quick", "--timeout-s", str(PROCESS_GROUP_TIMEOUT_S),
            *args]


def _run(args: list[str], cwd: Path, timeout: float = SUBPROCESS_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.distributed
def test_standalone_two_workers_write_a_cluster_spec(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cluster.yaml"
    r = _run(_profile_cmd("--standalone", "--nproc-per-node", "2", "-o", str(out)), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _leftovers(tmp_path) == ["cluster.yaml"]  # no staged or temporary files left
    spec = ClusterSpec.load(out)
    assert len(spec.nodes) == 1 and spec.nodes[0].num_gpus == 2
    assert spec.nodes[0].host == socket.gethostname()
    for g in spec.nodes[0].gpus:
        assert g.type == "cpu"
        m = g.measured
        # the measured GEMM figure is what islands and the planner read, in tflops too
        assert m["gemm_tflops"]["fp32"] > 0 and g.tflops["fp32"] == m["gemm_tflops"]["fp32"]
        assert m["catalog"]["tflops"]["fp32"] == 1.0  # the catalog placeholder, kept beside the measurement
        assert g.memory_bandwidth_GBps == m["memory_bandwidth_GBps"] > 0
        assert m["allreduce_busbw_gbps"] > 0 and m["allreduce_group_size"] == 2
        assert g.intra_node_bandwidth_GBps == pytest.approx(2 * m["allreduce_busbw_gbps"], rel=1e-3)
        # a reduce-scatter and an all-gather timed for their own bus bandwidth, which the cost model reads
        dev = DeviceModel.from_gpu(g, "fp32")
        assert m["reduce_scatter_busbw_gbps"] > 0 and m["all_gather_busbw_gbps"] > 0
        assert dev.reduce_scatter_busbw == pytest.approx(m["reduce_scatter_busbw_gbps"] * 1e9)
        assert dev.all_gather_busbw == pytest.approx(m["all_gather_busbw_gbps"] * 1e9)
        assert len(m["p2p_gbps"]) == 2 and sum(v is not None for v in m["p2p_gbps"]) == 1
        assert "collective_wait_us" not in m  # without --model there is no layer to run before the all-to-all
        assert "wake_up_us" not in m  # ... nor a stage-like micro-batch to time after a wait
        assert m["optimizer_tensor_us"] > 0
    assert spec.fingerprint.startswith("sha256:")
    assert spec.profile["backend"] == "gloo" and spec.profile["quick"] is True
    node = next(iter(spec.profile["nodes"].values()))
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        assert node[op]["group_size"] == 2 and node[op]["value"] > 0, node[op]
    islands = build_islands(spec)
    assert sum(i.num_gpus for i in islands.islands) == 2
    # the summary table on stdout
    assert "bf16 TFLOP/s" in r.stdout and f"wrote {out}" in r.stdout
    # each phase is announced as it starts, with the time since the worker started: one per GEMM dtype
    for dtype in spec.nodes[0].gpus[0].measured["gemm_tflops"]:
        assert re.search(rf"\[\s*\d+\.\ds\] GEMM {dtype} ", r.stderr), r.stderr[-3000:]
    # `tangram-launch islands` reads the file as written
    from tangram_launch.cli import main

    assert main(["islands", "--cluster", str(out)]) == 0
    assert "cpu" in capsys.readouterr().out


@pytest.mark.distributed
def test_two_agents_as_two_nodes_fill_the_node_matrix(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    port = _free_port()
    cmd = _profile_cmd("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex, "-o", str(out))
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=SUBPROCESS_TIMEOUT_S) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    spec = ClusterSpec.load(out)
    host = socket.gethostname()
    assert [n.name for n in spec.nodes] == [f"{host}-0", f"{host}-1"]  # two agents on one host
    a, b = spec.node_names
    link = spec.link(a, b)
    assert link.bandwidth_GBps > 0 and link.latency_us > 0
    inter = spec.profile["inter_node"]
    assert inter["nodes"] == [a, b]
    assert inter["bandwidth_GBps"][0][1] == inter["bandwidth_GBps"][1][0] == link.bandwidth_GBps
    assert inter["bandwidth_GBps"][0][0] is None
    assert inter["schedule"] == [[[a, b]]]
    # exactly one agent printed the summary (the node of global rank 0), the other says where the file went
    outs = [o for o, _ in results]
    assert sum("node-to-node bandwidth" in o for o in outs) == 1
    assert sum("wrote the ClusterSpec" in o for o in outs) == 1
    assert build_islands(spec).islands


@pytest.mark.distributed
def test_killed_worker_names_the_node_and_leaves_no_file(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    r = _run(_profile_cmd("--standalone", "--nproc-per-node", "2", "-o", str(out)), tmp_path,
             TANGRAM_PROFILE_TEST_EXIT_RANK="1")
    assert r.returncode == 1
    host = socket.gethostname()
    assert f"profiling failed on node '{host}'" in r.stderr
    assert "local rank 1 (global rank 1) stopped during 'GEMM" in r.stderr
    assert "Traceback" not in r.stderr.split("profiling failed")[-1]
    assert _leftovers(tmp_path) == []


@pytest.mark.distributed
def test_unreachable_node_fails_the_rendezvous_clearly(tmp_path: Path) -> None:
    out = tmp_path / "cluster.yaml"
    port = _free_port()
    r = _run(_profile_cmd("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=1", "-o", str(out)), tmp_path)
    assert r.returncode == 1
    assert f"rendezvous of 2 node(s) at 127.0.0.1:{port} did not complete on host {socket.gethostname()}" in r.stderr
    assert "a node is unreachable or was not started" in r.stderr
    assert _leftovers(tmp_path) == []


def _cgroup_or_skip() -> Path:
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        pytest.skip(f"no cgroup v1 cpu controller at {CGROUP_CPU}: cannot emulate a slower device here")
    group = CGROUP_CPU / f"tangram-profile-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(CGROUP_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(CGROUP_QUOTA_US))
    except OSError as exc:
        if group.exists():
            group.rmdir()
        pytest.skip(f"this machine does not allow creating a cpu cgroup ({exc}): cannot emulate a slower device")
    return group


@pytest.mark.distributed
def test_cgroup_throttled_worker_is_the_slower_device_and_its_own_island(tmp_path: Path) -> None:
    group = _cgroup_or_skip()
    out = tmp_path / "cluster.yaml"
    try:
        r = _run(_profile_cmd("--standalone", "--nproc-per-node", "2", "-o", str(out)), tmp_path,
                 TANGRAM_PROFILE_TEST_CGROUP=str(group), TANGRAM_PROFILE_TEST_CGROUP_LOCAL_RANK="1")
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    finally:
        group.rmdir()  # empty again: the workers have exited
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(stat["nr_throttled"]) > 0, "the worker never ran in the cgroup"
    spec = ClusterSpec.load(out)
    fast, slow = spec.nodes[0].gpus
    for dtype in ("fp32", "bf16"):
        assert slow.measured["gemm_tflops"][dtype] < fast.measured["gemm_tflops"][dtype], dtype
    iset = build_islands(spec)
    assert len(iset.islands) == 2
    [slow_island] = [i for i in iset.islands if any(g.local_index == 1 for g in i.gpus)]
    assert [str(g) for g in slow_island.gpus] == [f"{spec.nodes[0].name}:1"]
    assert iset.separations[0].constraint == "(1) compute"
    # the written file says so too
    raw = yaml.safe_load(out.read_text())
    assert raw["nodes"][0]["gpus"][1]["tflops"]["bf16"] == slow.measured["gemm_tflops"]["bf16"]


@pytest.mark.distributed
def test_model_profile_measures_the_wait_after_a_layer_and_the_optimizer_per_tensor(tmp_path: Path) -> None:
    """With --model, each node's tiny all-to-all is also timed right after the model's layer forward on every rank
    (collective_wait_us: what a training step's collectives pay), and each device times AdamW per parameter
    tensor; the cost model reads both."""
    from tangram_launch.costmodel.efficiency import DeviceModel

    out = tmp_path / "cluster.yaml"
    r = _run(_profile_cmd("--standalone", "--nproc-per-node", "2", "--model", "tiny-moe", "--seq-len", "32",
                          "--layer-dtype", "fp32", "-o", str(out)), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    spec = ClusterSpec.load(out)
    node = spec.profile["nodes"][spec.nodes[0].name]
    wait = node["collective_wait"]
    wakes = [d["wake_up"] for d in spec.profile["devices"]]
    assert len({w["rounds"] for w in wakes}) == 1 and wakes[0]["rounds"] >= 2
    assert all(w["after_sleep_s"] > 0 and w["back_to_back_s"] > 0 and w["sleep_s"] == 0.02 for w in wakes)
    assert all(w["waited_s"] >= w["sleep_s"] for w in wakes)  # the idle before each timed call: at least the sleep
    # as many calls as the budget affords on the slower member, the same on both: whole blocks, at least three
    assert 30 <= wait["reps"] <= spec.profile["bench"]["wait_reps"] and wait["reps"] % 10 == 0
    assert wait["group_size"] == 2
    for g in spec.nodes[0].gpus:
        m = g.measured
        assert m["collective_wait_us"] == wait["value"] > 0  # one node figure, on each of its devices
        assert m["optimizer_tensor_us"] > 0
        dev = DeviceModel.from_gpu(g, "fp32")
        assert dev.collective_wait_s == pytest.approx(m["collective_wait_us"] * 1e-6)
        assert dev.optimizer_tensor_s == pytest.approx(m["optimizer_tensor_us"] * 1e-6)
        assert m["optimizer_param_ns"] >= 0 and dev.optimizer_param_s == pytest.approx(m["optimizer_param_ns"] * 1e-9)
        assert m["host_op_us"] > 0 and dev.host_op_s == pytest.approx(m["host_op_us"] * 1e-6)  # the host's floor
        # FSDP2 over the node's two ranks: host work per unit (gloo: about a millisecond a pass), per dtype the units
        # gather in (each one the GEMM benchmark runs here), and AdamW per DTensor, dearer than per plain tensor
        assert set(m["fsdp_unit_forward_us"]) == set(m["fsdp_unit_backward_us"]) == set(m["gemm_tflops"])
        assert min(m["fsdp_unit_forward_us"].values()) > 0 and min(m["fsdp_unit_backward_us"].values()) > 0
        assert m["optimizer_sharded_tensor_us"] > m["optimizer_tensor_us"]
        assert (dev.fsdp_unit_forward_s, dev.optimizer_sharded_tensor_s) == pytest.approx(
            (m["fsdp_unit_forward_us"]["fp32"] * 1e-6, m["optimizer_sharded_tensor_us"] * 1e-6))
        assert node["fsdp_unit"]["fsdp_unit_backward_us"]["fp32"]["group_size"] == 2
        # the wake-up cost of a stage-like micro-batch after a wait, per device, in as many rounds on each
        assert m["wake_up_us"] >= 0 and m["wake_up_wait_us"] >= 0.02e6  # and the wait it was measured after
        # the embedding and the head + loss are timed beside the layer kinds, at the same shape
        for kind in ("dense", "moe", "embedding", "head"):
            key = f"tiny-moe|{kind}|seq=32|mbs=1|tp=1"
            assert m["layer_forward_backward_s"][key] > m["layer_forward_s"][key] > 0
        # the GEMM sweep: the model's own layer shapes (as many as the budget allows) and the large GEMM
        from tangram_launch.costmodel.gemm_curve import sweep_shapes
        from tangram_launch.specs.model import load_model

        swept = {tuple(r[:3]) for r in m["gemm_sweep_tflops"]["fp32"]}
        assert len(swept) >= 2 and len(swept - set(sweep_shapes(load_model("tiny-moe"), tokens=32))) <= 1
        assert dev.gemm_curve is not None and "gemm_sweep_tflops" in dev.sources
