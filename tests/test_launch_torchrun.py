"""tangram-launch as torchrun, and the planned launch mechanism (rank remapping through tangram_launch.launch.boot).

Real processes in the style of torch's test_run.py: each worker writes a file named by its rank.  The launcher is
started as ``python -m tangram_launch.launch``; torchrun as ``python -m torch.distributed.run``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.launch import boot, torchrun as launch
from tangram_launch import worker as W
from tangram_launch.errors import SpecError

SCRIPTS = Path(__file__).parent / "scripts"
DUMP_ENV = str(SCRIPTS / "dump_env.py")
# Values that legitimately differ between two launches of the same job.
VOLATILE = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    for key in [k for k in env if k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))]:
        del env[key]
    return env


def _run(args: list[str], *, cwd: Path | None = None, timeout: float = SUBPROCESS_TIMEOUT_S,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def _tangram(*args: str, **kw) -> subprocess.CompletedProcess:
    return _run(["-m", "tangram_launch.launch", *args], **kw)


def _torchrun(*args: str, **kw) -> subprocess.CompletedProcess:
    return _run(["-m", "torch.distributed.run", *args], **kw)


def _records(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout_plan(rows: list[tuple[int, str, int, int]], **extra) -> dict:
    """A hand-written plan: rank_layout rows (rank, node, local_gpu, stage) in the order given."""
    return {"rank_layout": [{"rank": r, "node": n, "local_gpu": g, "stage": s} for r, n, g, s in rows], **extra}


def _write(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data, indent=1))
    return str(path)


def _full_plan() -> dict:
    """A real tangram Plan: 3 one-GPU stages on 2 nodes of different sizes, ranks not contiguous by node.

    rank 0 -> n1 GPU 1 (stage 0, island fast), rank 1 -> n0 GPU 0 (stage 1, slow), rank 2 -> n1 GPU 0 (stage 2).
    """
    def stage(i, node, gpu, island):
        return {"index": i, "layers": [2 * i, 2 * i + 2], "island": island, "gpus": [{"node": node, "local_gpu": gpu}],
                "micro_batch_size": 1, "has_embedding": i == 0, "has_head": i == 2}

    stages = [stage(0, "n1", 1, "fast"), stage(1, "n0", 0, "slow"), stage(2, "n1", 0, "fast")]
    return {
        "version": 1, "model": {"name": "toy", "num_layers": 6}, "training": {"global_batch": 2},
        "num_microbatches": 2, "stages": stages,
        "rank_layout": [{"rank": s["index"], "node": s["gpus"][0]["node"], "local_gpu": s["gpus"][0]["local_gpu"],
                         "stage": s["index"], "coords": {"pp": s["index"], "dp": 0, "cp": 0, "tp": 0}}
                        for s in stages],
        "predicted": {"iteration_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1,
                      "stages": [{"forward_s": 0.1, "backward_s": 0.2, "peak_memory_gib": 1.0,
                                  "capacity_gib": 16.0}] * 3},
    }


# --- parser ------------------------------------------------------------------------------------------------------

def test_parser_is_torchruns_plus_a_tangram_group(monkeypatch):
    from torch.distributed.run import get_args_parser

    argv = ["--nnodes", "1:2", "--nproc_per_node", "3", "--rdzv-backend", "c10d", "--max_restarts", "2", "-r", "3",
            "--tee", "1", "--log-dir", "/tmp/x", "-m", "pkg.train", "--lr", "1"]
    ours, theirs = vars(launch.build_parser().parse_args(argv)), vars(get_args_parser().parse_args(argv))
    assert {k: ours[k] for k in theirs} == theirs
    assert launch.TangramOptions.from_args(launch.build_parser().parse_args(argv)).given() == []
    # PET_* fallbacks come from torch's own actions.
    monkeypatch.setenv("PET_NPROC_PER_NODE", "5")
    assert launch.build_parser().parse_args(["s.py"]).nproc_per_node == "5"
    # Tangram options before the script are ours; after it they belong to the script, untouched.
    args = launch.build_parser().parse_args(
        ["--plan", "p.json", "--node-name", "n0", "--global-batch", "8", "train.py", "--plan", "q", "--model", "m"])
    opts = launch.TangramOptions.from_args(args)
    assert (opts.plan, opts.node_name, opts.global_batch) == ("p.json", "n0", 8)
    assert args.training_script == "train.py" and args.training_script_args == ["--plan", "q", "--model", "m"]
    with pytest.raises(SystemExit):
        launch.build_parser().parse_args(["--dtype", "int8", "s.py"])


# --- rank layout and boot (in process) ---------------------------------------------------------------------------

def test_rank_layout_refuses_gaps_and_shared_gpus():
    ok = W.RankLayout.from_plan_dict(_layout_plan([(2, "b", 0, 1), (0, "a", 1, 0), (1, "b", 1, 1), (3, "a", 0, 0)]))
    assert ok.nodes == ("b", "a") and ok.world_size == 4
    assert [s.rank for s in ok.local_slots("a")] == [3, 0]  # ordered by local GPU
    assert ok.slot_for("b", 1).rank == 1 and ok.slot_for("a", 0).local_gpu == 0
    with pytest.raises(SpecError, match="each exactly once"):
        W.RankLayout.from_plan_dict(_layout_plan([(0, "a", 0, 0), (2, "a", 1, 0)]))
    with pytest.raises(SpecError, match="share GPU a:0"):
        W.RankLayout.from_plan_dict(_layout_plan([(0, "a", 0, 0), (1, "a", 0, 0)]))
    with pytest.raises(SpecError, match="rank_layout"):
        W.RankLayout.from_plan_dict({"stages": []})


def test_boot_remaps_rank_and_refuses_a_changed_plan(tmp_path):
    plan = tmp_path / "plan.json"
    data = json.dumps(_layout_plan([(0, "n1", 1, 0), (1, "n0", 0, 1), (2, "n1", 0, 2)])).encode()
    plan.write_bytes(data)
    args = boot.parse_boot_args(["--plan-file", str(plan), "--plan-hash", W.sha256_bytes(data), "--node", "n1",
                                 "--agent-id", "h:1", "--", "-m", "pkg.mod", "--x", "--", "y"])
    assert (args.mode, args.target, args.args) == ("module", "pkg.mod", ("--x", "--", "y"))
    env = {"RANK": "1", "ROLE_RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2",
           "GROUP_WORLD_SIZE": "2"}
    out = boot.placement_env(env, args)
    assert out["RANK"] == out["ROLE_RANK"] == "0"  # local rank 1 takes n1's second GPU (GPU 1), which is rank 0
    assert (out["TANGRAM_TORCHRUN_RANK"], out["TANGRAM_LOCAL_GPU"], out["TANGRAM_STAGE"]) == ("1", "1", "0")
    assert (out["TANGRAM_NODE"], out["TANGRAM_NODE_INDEX"]) == ("n1", "0")
    with pytest.raises(SpecError, match="LOCAL_WORLD_SIZE"):
        boot.placement_env({**env, "LOCAL_WORLD_SIZE": "3"}, args)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out  # the torch runtime (a plan without one) sets nothing more
    plan.write_bytes(data + b" ")
    with pytest.raises(SpecError, match="changed after the launcher checked it"):
        boot.placement_env(env, args)


def test_boot_sets_the_plan_runtimes_worker_environment_unless_the_user_did(tmp_path):
    """A Megatron-core plan's workers start with CUDA_DEVICE_MAX_CONNECTIONS=1 (its linear layers overlap the
    backward's TP collective with a GEMM only so, and the planner prices that overlap); the user's value wins."""
    plan = tmp_path / "plan.json"
    data = json.dumps(_layout_plan([(0, "n0", 0, 0), (1, "n0", 1, 1)], runtime="megatron")).encode()
    plan.write_bytes(data)
    args = boot.parse_boot_args(["--plan-file", str(plan), "--plan-hash", W.sha256_bytes(data), "--node", "n0",
                                 "--agent-id", "h:1", "--", "train.py"])
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert boot.placement_env(env, args)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in boot.placement_env({**env, "CUDA_DEVICE_MAX_CONNECTIONS": "8"}, args)
    # the launcher says once that the user's value stands against the one the plan's costs assume
    [line] = boot.worker_env_overrides({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "megatron")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in line and "CUDA_DEVICE_MAX_CONNECTIONS=1" in line
    assert boot.worker_env_overrides({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "megatron") == []
    assert boot.worker_env_overrides({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "torch") == []


def test_agents_must_agree_on_the_plan_through_the_agent_store():
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    common = dict(store=client, plan_nodes=("a", "b"), timeout_s=0.5)
    client.set("tangram/r1/plan/b", "h1 host-b:1")  # agent b published the same plan
    boot.check_agents_agree(run_id="r1", node="a", plan_hash="h1", agent_id="host-a:1", **common)
    client.set("tangram/r2/plan/b", "h2 host-b:1")  # agent b brought another plan
    with pytest.raises(SpecError, match=r"node 'b' \(host-b:1\) launched sha256 h2"):
        boot.check_agents_agree(run_id="r2", node="a", plan_hash="h1", agent_id="host-a:1", **common)
    never = dict(common, timeout_s=0.1)  # no agent ever comes: the whole timeout is waited out
    with pytest.raises(SpecError, match="no agent registered plan node.s. b within 0.1 s"):
        boot.check_agents_agree(run_id="r3", node="a", plan_hash="h1", agent_id="host-a:1", **never)
    client.set("tangram/r4/plan/a", "h1 host-x:9")  # a second agent also calls itself "a"; no "b" ever comes
    with pytest.raises(SpecError, match="no agent registered"):
        boot.check_agents_agree(run_id="r4", node="a", plan_hash="h1", agent_id="host-a:1", **never)


def test_current_plan_outside_a_planned_launch(monkeypatch):
    monkeypatch.delenv(W.ENV_PLAN_FILE, raising=False)
    assert not W.in_tangram_launch()
    with pytest.raises(RuntimeError, match="not started by `tangram-launch --plan"):
        W.current_plan()


def test_node_name_from_host_name():
    plan = _layout_plan([(0, "x", 0, 0), (1, "y", 0, 0)], cluster={"nodes": [{"name": "y", "host": "box-7"}]})
    layout = W.RankLayout.from_plan_dict(plan)
    assert launch.resolve_node_name(layout, plan, None, host_names={"box-7", "box-7.lan"}) == "y"
    assert launch.resolve_node_name(layout, plan, None, host_names={"x"}) == "x"
    with pytest.raises(SpecError, match="matches no plan node"):
        launch.resolve_node_name(layout, plan, None, host_names={"elsewhere"})
    with pytest.raises(SpecError, match="did you mean 'y'"):
        launch.resolve_node_name(layout, plan, "yy", host_names=set())


@pytest.mark.distributed
def test_plan_world_mismatch_is_refused_before_any_worker(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    plan = _write(tmp_path / "plan.json", _full_plan())
    tail = [DUMP_ENV, str(out)]
    cases = {
        "--nproc-per-node": (["--nnodes", "2", "--nproc-per-node", "2", "--node-name", "n0"],
                             r"plan node 'n0' has 1 GPU\(s\) .* \(got 2\)"),
        "--nnodes": (["--nnodes", "1", "--nproc-per-node", "2", "--node-name", "n1"],
                     r"the plan has 2 node\(s\) \(n1, n0\).*\(got '1'\); valid: 2"),
        "--node-name": (["--nnodes", "2", "--nproc-per-node", "1", "--node-name", "n2"],
                        r"no such node in the plan \(got 'n2'\)"),
    }
    for field, (opts, pattern) in cases.items():
        with pytest.raises(SpecError, match=pattern) as info:
            launch.run([*opts, "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--plan", plan, *tail])
        assert info.value.field == field and info.value.exit_code == 2
    bad = _write(tmp_path / "bad.json", {**_full_plan(), "num_microbatches": 3})  # a Plan must validate as one
    with pytest.raises(SpecError, match="must equal the global batch 2"):
        launch.run(["--nnodes", "2", "--node-name", "n0", "--plan", bad, *tail])
    with pytest.raises(SpecError, match="planning at launch time"):  # the seam without a plan provider
        launch.run(["--cluster", "c.yaml", "--model", "m", *tail], plan_provider=None)
    with pytest.raises(SpecError, match="c.yaml"):  # with the default provider: the missing file is named
        launch.run(["--cluster", "c.yaml", "--model", "tiny", *tail])
    # Through the command line: exit status 2, the difference named, and no worker ever started.
    solo = _write(tmp_path / "solo.json", _layout_plan([(0, "solo", 1, 0), (1, "solo", 0, 1)]))
    proc = _tangram("--standalone", "--nproc-per-node", "3", "--plan", solo, *tail)
    assert proc.returncode == 2, proc.stderr
    assert "field '--nproc-per-node': plan node 'solo' has 2 GPU(s) (local GPUs 0, 1) (got 3)" in proc.stderr
    assert list(out.iterdir()) == []


# --- real launches -----------------------------------------------------------------------------------------------

@pytest.mark.distributed
def test_same_worker_environment_as_torchrun(tmp_path):
    a, b = tmp_path / "torchrun", tmp_path / "tangram"
    a.mkdir(), b.mkdir()
    ref = _torchrun("--standalone", "--nproc-per-node", "2", DUMP_ENV, str(a), "--lr", "1", cwd=tmp_path)
    got = _tangram("--standalone", "--nproc-per-node", "2", DUMP_ENV, str(b), "--lr", "1", cwd=tmp_path)
    assert ref.returncode == 0 and got.returncode == 0, got.stderr
    ref_records, records = _records(a), _records(b)
    assert sorted(records) == sorted(ref_records) == [0, 1]
    for rank in (0, 1):
        want, have = ref_records[rank], records[rank]
        assert have["argv"] == [DUMP_ENV, str(b), "--lr", "1"] and want["argv"][2:] == have["argv"][2:]
        assert (have["name"], have["path0"]) == (want["name"], want["path0"]) == ("__main__", str(SCRIPTS))
        strip = lambda e: {k: v for k, v in e.items() if k not in VOLATILE}  # noqa: E731
        assert strip(have["env"]) == strip(want["env"])
        assert VOLATILE <= set(have["env"])
        assert have["env"]["RANK"] == str(rank) and have["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert not any(k.startswith("TANGRAM_") for k in have["env"])


@pytest.mark.distributed
def test_planned_module_and_no_python_targets(tmp_path):
    """boot's -m and --exec paths run the target as python would, with the plan's ranks."""
    plan = _write(tmp_path / "plan.json", _layout_plan([(0, "solo", 1, 0), (1, "solo", 0, 1)]))
    # the same layout for Megatron-core: its workers also start with the runtime's environment
    megatron = _write(tmp_path / "megatron.json", _layout_plan([(0, "solo", 1, 0), (1, "solo", 0, 1)],
                                                               runtime="megatron"))
    mod, exe = tmp_path / "mod", tmp_path / "exe"
    mod.mkdir(), exe.mkdir()
    m = _tangram("--standalone", "--nproc-per-node", "2", "--plan", plan, "-m", "dump_env", str(mod), "a",
                 cwd=SCRIPTS)
    e = _tangram("--standalone", "--nproc-per-node", "2", "--plan", megatron, "--no-python", sys.executable,
                 DUMP_ENV, str(exe), "a", cwd=SCRIPTS)
    assert m.returncode == 0 and e.returncode == 0, m.stderr + e.stderr
    for records in (_records(mod), _records(exe)):
        assert sorted(records) == [0, 1]
        for rank, rec in records.items():
            env = rec["env"]
            # local rank i takes the node's i-th GPU: LOCAL_RANK 1 -> GPU 1 -> plan rank 0
            assert (env["LOCAL_RANK"], env["TANGRAM_LOCAL_GPU"]) == (str(1 - rank), str(1 - rank))
            assert env["TANGRAM_TORCHRUN_RANK"] == str(1 - rank) and env["TANGRAM_NODE"] == "solo"
            assert rec["name"] == "__main__" and rec["argv"][2:] == ["a"]
            assert not Path(env["TANGRAM_PLAN_FILE"]).exists()  # the temporary copy is removed after the job
    for records, path, cuda_env in ((_records(mod), plan, None), (_records(exe), megatron, "1")):
        for rec in records.values():
            assert rec["env"]["TANGRAM_PLAN_HASH"] == W.sha256_bytes(Path(path).read_bytes())
            assert rec["env"].get("CUDA_DEVICE_MAX_CONNECTIONS") == cuda_env
    # the user's own value stands, and the launcher says once that the plan's costs assume the runtime's
    own = tmp_path / "own"
    own.mkdir()
    o = _tangram("--standalone", "--nproc-per-node", "2", "--plan", megatron, DUMP_ENV, str(own), cwd=SCRIPTS,
                 env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert o.returncode == 0, o.stderr
    assert o.stderr.count("CUDA_DEVICE_MAX_CONNECTIONS=8 is set here") == 1, o.stderr
    assert {rec["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] for rec in _records(own).values()} == {"8"}
    for rec in _records(mod).values():  # as `python -m dump_env`: argv[0] is the module's file, cwd first on the path
        assert (rec["argv"][0], rec["path0"]) == (DUMP_ENV, str(SCRIPTS))
    for rec in _records(exe).values():  # as `python dump_env.py`
        assert (rec["argv"][0], rec["path0"]) == (DUMP_ENV, str(SCRIPTS))


@pytest.mark.distributed
def test_dying_worker_restarts_then_fails_like_torchrun(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir(), out.mkdir()
    die = [str(SCRIPTS / "die.py")]
    want = _torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *die, str(ref), "1", "3")
    got = _tangram("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *die, str(out), "1", "3")
    assert want.returncode != 0 and got.returncode == want.returncode
    expected = {f"attempt{a}.rank{r}" for a in (0, 1) for r in (0, 1)}  # one restart, then give up
    assert {p.name for p in out.iterdir()} == {p.name for p in ref.iterdir()} == expected
    assert "rank      : 1 (local_rank: 1)" in got.stderr and "exitcode  : 3" in got.stderr  # torchrun's table
    assert "first failure: host " in got.stderr and "rank 1 (local rank 1) exited with code 3" in got.stderr

    # Planned: the summary names the plan rank, its stage and island.
    planned = tmp_path / "planned"
    planned.mkdir()
    layout = _layout_plan([(0, "solo", 1, 0), (1, "solo", 0, 1)])
    for row, island in zip(layout["rank_layout"], ("a100", "v100")):
        row["island"] = island  # extra row keys are carried along; no "stages": not a full Plan
    plan = _write(tmp_path / "plan.json", layout)
    got = _tangram("--standalone", "--nproc-per-node", "2", "--plan", plan, *die, str(planned), "1", "4")
    assert got.returncode == want.returncode
    assert ("rank 1 (torchrun rank 0, local rank 0; plan node solo, local GPU 0, stage 1, island v100) exited with "
            "code 4") in got.stderr
    assert (planned / "attempt0.rank1").read_text() == "0"  # plan rank 1 was torchrun rank 0


@pytest.mark.distributed
def test_two_agents_of_different_sizes_follow_the_plan(tmp_path):
    """Two agents on localhost (1 and 2 workers) as plan nodes n0 and n1; gloo works with the remapped ranks."""
    out = tmp_path / "out"
    out.mkdir()
    plan = _write(tmp_path / "plan.json", _full_plan())
    common = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
              "--rdzv-id", "two-agents", "--plan", plan, "--log-dir", str(tmp_path / "logs")]
    script = [str(SCRIPTS / "plan_worker.py"), str(out)]
    cmd = [sys.executable, "-m", "tangram_launch.launch", *common]
    agents = [subprocess.Popen([*cmd, "--node-name", node, "--nproc-per-node", n, *script], env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for node, n in (("n0", "1"), ("n1", "2"))]
    try:
        logs = [a.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    records = _records(out)
    assert sorted(records) == [0, 1, 2]
    expect = {0: ("n1", 1, 0, (0, 2), "fast"), 1: ("n0", 0, 1, (2, 4), "slow"), 2: ("n1", 0, 2, (4, 6), "fast")}
    for rank, (node, gpu, stage, layers, island) in expect.items():
        rec = records[rank]
        env = rec["env"]
        assert (env["RANK"], env["TANGRAM_NODE"], env["TANGRAM_LOCAL_GPU"]) == (str(rank), node, str(gpu))
        assert env["LOCAL_RANK"] == str(gpu)  # local rank i takes the node's i-th GPU
        assert env["LOCAL_WORLD_SIZE"] == ("1" if node == "n0" else "2") and env["WORLD_SIZE"] == "3"
        assert rec["dist_rank"] == rank and rec["all_reduce"] == 7.0  # 2**0 + 2**1 + 2**2
        assert rec["places"] == [[0, "n1", 1], [1, "n0", 0], [2, "n1", 0]]
        assert (rec["stage"], tuple(rec["layers"]), rec["island"]) == (stage, layers, island)
        assert (rec["place_stage"], tuple(rec["place_layers"])) == (stage, layers)  # tangram_launch.plan agrees
    assert len(list((tmp_path / "logs" / "tangram").glob("plan-*.json"))) == 1  # the copy workers read
