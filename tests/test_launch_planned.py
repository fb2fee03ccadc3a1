"""Planned launch: ``tangram-launch --cluster FILE | --profile --model ... script`` plans, then launches by the plan.

Real launches on CPU (gloo): workers check their place against the plan file the launcher left in the log dir, and
the README's --profile command trains the tiny model twice, the second time from the cached profile. The rest runs
in-process: the profile cache, and the refusals (plan leaving GPUs out, multi-node --profile, missing model).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.launch import profile_cache
from tangram_launch.launch import planning as planned, torchrun as launch
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan
from tangram_launch.specs.cluster import ClusterSpec

REPO = Path(__file__).resolve().parent.parent
PLAN_WORKER = str(Path(__file__).parent / "scripts" / "plan_worker.py")
HETERO_CPU = """\
name: cpu-het-3
nodes:
  - name: local
    host: localhost
    gpus:
      - {type: cpu, tflops: {bf16: 0.4, fp16: 0.4, fp32: 0.2}}
      - {type: cpu, tflops: {bf16: 0.2, fp16: 0.2, fp32: 0.1}}
      - {type: cpu, tflops: {bf16: 0.2, fp16: 0.2, fp32: 0.1}}
"""

ONE_SLOW_CPU = """\
name: cpu-one-slow
nodes:
  - name: local
    host: localhost
    gpus:
      - {type: cpu, tflops: {bf16: 0.4, fp16: 0.4, fp32: 0.2}}
      - {type: cpu, tflops: {bf16: 0.0004, fp16: 0.0004, fp32: 0.0002}}
"""  # the second device is 1,000 times slower: the planner leaves it out


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(cache))
    return env


def _cli(*args: str, cache: Path, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", *args], cwd=REPO, env=_env(cache),
                          capture_output=True, text=True, timeout=timeout)


def _launch_plan_worker(tmp_path: Path, cluster_text: str, *, nproc: int):
    """tests/scripts/plan_worker.py launched on ``nproc`` workers, planned for the tiny model on this cluster:
    (the process, the cluster file, the workers' output dir, the log dir holding the plan)."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(cluster_text)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    proc = _cli("--standalone", "--nproc-per-node", str(nproc), "--log-dir", str(logs), "--cluster", str(cluster),
                "--model", "tiny", "--global-batch", "8", "--seq-len", "64", "--dtype", "fp32", PLAN_WORKER,
                str(out), cache=tmp_path / "cache")
    return proc, cluster, out, logs


@pytest.mark.distributed
def test_planned_launch_from_a_cluster_file_places_workers_by_the_plan(tmp_path):
    proc, cluster, out, logs = _launch_plan_worker(tmp_path, HETERO_CPU, nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted((logs / "tangram").glob("plan-*.json"))
    assert len(files) == 1, files
    plan = Plan.load(files[0])
    assert plan.num_stages > 1 and plan.world_size == 3  # the fast device and the slow ones form a pipeline
    assert "stage  layers  island" in proc.stderr and "plan written to" in proc.stderr  # the summary, on stderr
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(records) == [0, 1, 2]
    for rank, rec in records.items():
        row = plan.rank_layout[rank]
        stage = plan.stages[row.stage]
        assert (rec["stage"], rec["layers"]) == (row.stage, list(stage.layers)), rank
        assert (rec["place_stage"], rec["place_layers"]) == (row.stage, list(stage.layers)), rank
        assert rec["env"]["TANGRAM_PLAN_FILE"].startswith(str(logs))
        assert rec["all_reduce"] == 7.0  # 2**0 + 2**1 + 2**2: three distinct ranks
    # Deterministic and canonical: planning again in this process gives the same bytes, without wall-clock figures.
    inputs = planned.plan_inputs(launch.TangramOptions(model="tiny", global_batch=8, seq_len=64, dtype="fp32"))
    again = planned.canonical_plan_bytes(planned.make_launch_plan(ClusterSpec.load(cluster), inputs))
    assert files[0].read_bytes() == again
    assert "planning_time_s" not in json.loads(again)["planner"]


@pytest.mark.distributed
def test_profile_plan_and_train_then_reuse_the_cached_profile(tmp_path):
    """The README's command: profile this node, plan, train 2 steps; the second launch reuses the profile."""
    cache = tmp_path / "cache"
    cmd = ["--standalone", "--nproc-per-node", "2", "--profile", "--model", "tiny", "--global-batch", "8",
           "--seq-len", "64", "examples/train_gpt.py", "--steps", "2"]
    first = _cli(*cmd, cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no cached profile for hardware fingerprint" in first.stderr
    assert "step    2  loss" in first.stdout
    profiles = list((cache / "profiles").glob("*.yaml"))
    assert len(profiles) == 1
    spec = ClusterSpec.load(profiles[0])
    assert spec.num_gpus == 2 and spec.profile.get("tool") == "tangram-launch profile"
    live = planned.live_fingerprint(2)
    assert profiles[0].stem == live.split(":", 1)[1]
    assert spec.fingerprint == live  # on a CPU node the cheap fingerprint is the profiler's own
    plans = list((cache / "plans").glob("plan-*.json"))
    assert len(plans) == 1

    second = _cli(*cmd, cache=cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "reusing the cached profile" in second.stderr
    assert "profiling: tangram-launch" not in second.stderr and "no cached profile" not in second.stderr
    assert "step    2  loss" in second.stdout
    assert list((cache / "plans").glob("plan-*.json")) == plans  # the same plan, byte for byte


def test_profile_cache_is_keyed_by_the_hardware_fingerprint(tmp_path):
    src = REPO / "examples" / "clusters" / "profiled-cpu-2.yaml"  # a quick profile of 2 CPU devices
    key = "sha256:" + "ab" * 16
    path = tmp_path / "profiles" / ("ab" * 16 + ".yaml")
    path.parent.mkdir()
    path.write_text(src.read_text())
    profile_cache.seal(str(path), key, ClusterSpec.load(path).fingerprint)  # as the profiler's caching does
    assert planned.cached_profile(str(tmp_path), key, nproc_per_node=2, need_full=False).num_gpus == 2
    assert planned.cached_profile(str(tmp_path), "sha256:" + "cd" * 16, nproc_per_node=2, need_full=False) is None
    assert planned.cached_profile(str(tmp_path), key, nproc_per_node=2, need_full=True) is None  # quick != full
    assert planned.cached_profile(str(tmp_path), key, nproc_per_node=3, need_full=False) is None
    # the identity changes with the hardware: one more worker device, another host
    assert planned.live_fingerprint(2) != planned.live_fingerprint(3)
    assert planned.live_fingerprint(2) != planned.live_fingerprint(2, host="another-host")


@pytest.mark.parametrize("nproc", [1, 2, 3])
@pytest.mark.parametrize("value", [None, "", "1", "2", "eight"])
def test_the_launchers_cpu_thread_identity_is_what_torchrun_hands_its_workers(monkeypatch, nproc, value):
    """The launcher reads the identity before torchrun's rule runs, a worker after it (torch's own
    config_from_args, which sets OMP_NUM_THREADS=1 for several workers where it is unset): both read the same."""
    from torch.distributed.run import config_from_args, get_args_parser

    from profiler.assemble import cpu_threads_identity

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if value is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    before = cpu_threads_identity(os.environ, nproc)
    config_from_args(get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "train.py"]))
    assert cpu_threads_identity(dict(os.environ), nproc) == before


def test_a_cpu_workers_threads_are_part_of_its_fingerprint(monkeypatch):
    """A profile measured on 2 threads per CPU worker is not reused for 1 (nor the other way)."""
    from profiler.inventory import read_node_inventory

    if read_node_inventory().gpus:  # pragma: no cover - GPU devices are told apart by their UUIDs
        pytest.skip("this node has GPUs: its devices are GPUs")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    unset = planned.live_fingerprint(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert planned.live_fingerprint(2) == unset  # torchrun gives several workers 1 thread where it is unset
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert planned.live_fingerprint(2) != unset
    monkeypatch.delenv("OMP_NUM_THREADS")
    alone = planned.live_fingerprint(1)  # one worker alone keeps torch's default: a thread per core
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert planned.live_fingerprint(1) != alone


def test_a_plan_that_leaves_gpus_out_is_refused_with_what_to_launch(tmp_path):
    from helpers_plans import make_plan

    cluster = ClusterSpec.from_dict({"name": "c", "nodes": [{"name": "local", "gpu": "cpu", "count": 2}]})
    plan = make_plan("tiny", [(4, "local")], global_batch=8, num_microbatches=1)  # uses local:0 only
    with pytest.raises(SpecError, match=r"uses 1 of the cluster's 2 GPUs .*launch --nproc-per-node 1 on node "
                                        r"local") as info:
        planned.check_plan_fits_launch(plan, cluster, nproc_per_node=2, node="local")
    assert info.value.field == "--nproc-per-node" and info.value.exit_code == 2
    planned.check_plan_fits_launch(plan, cluster, nproc_per_node=1, node="local")  # what the message suggests
    # a single-node launch of a one-node cluster starts only the workers the plan uses, on its GPUs
    planned.check_plan_fits_launch(plan, cluster, nproc_per_node=2, node="local", single_node=True)
    layout = json.loads(plan.to_json())
    assert planned.workers_for_plan(layout, "local", 2, None) == (1, {"CUDA_VISIBLE_DEVICES": "0"})
    assert planned.workers_for_plan(layout, "local", 1, None) is None  # already what the plan uses
    layout["rank_layout"][0]["local_gpu"] = 1  # the plan's GPU is the node's second, in the numbering given
    assert planned.workers_for_plan(layout, "local", 2, "4,5") == (1, {"CUDA_VISIBLE_DEVICES": "5"})


@pytest.mark.distributed
def test_a_single_node_launch_starts_only_the_workers_the_plan_uses(tmp_path):
    proc, _, out, logs = _launch_plan_worker(tmp_path, ONE_SLOW_CPU, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = Plan.load(sorted((logs / "tangram").glob("plan-*.json"))[0])
    assert plan.world_size == 1, plan.rank_layout
    assert "the plan uses 1 of this node's 2 devices: starting 1 worker(s)" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("rank*.json")) == ["rank0.json"]


def test_planning_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path))
    tail = ["--nproc-per-node", "2", str(REPO / "examples" / "train_gpt.py")]  # a script that exists (pre-flight)
    with pytest.raises(SpecError, match="single node only") as info:
        launch.run(["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--profile", "--model", "tiny", *tail])
    assert info.value.field == "--profile"
    with pytest.raises(SpecError, match="either --cluster FILE or --profile"):
        launch.run(["--standalone", "--cluster", "c.yaml", "--profile", "--model", "tiny", *tail])
    with pytest.raises(SpecError, match="needs a model") as info:
        launch.run(["--standalone", "--cluster", str(REPO / "examples" / "clusters" / "cpu-2.yaml"), *tail])
    assert info.value.field == "--model"
    with pytest.raises(SpecError, match="planning at launch time is not available"):
        launch.run(["--standalone", "--cluster", "c.yaml", "--model", "tiny", *tail], plan_provider=None)
    assert not list(tmp_path.rglob("*.yaml"))  # nothing was profiled
