"""Megatron-core checkpoints resharded on CPU: save a GPTModel's sharded state under one layout, load under another.

Megatron's forward/backward needs CUDA, so no training step runs here; what runs is everything a resume does to
the state. Every parameter of the real ``GPTModel`` (local spec, ``use_cpu_initialization``) and Adam's
``exp_avg``/``exp_avg_sq`` are filled from a generator seeded by the tensor's *global* name (``layers.2.mlp...``),
sliced by the rank's TP coordinate, so the expected value of every tensor on every rank of any layout is known
without the saving run. The optimizer is a plain ``torch.optim.Adam``: Megatron's DDP and optimizers allocate on
``torch.cuda.current_device()`` (measured: ``DistributedDataParallel`` fails in ``_ParamAndGradBuffer``).

One 4-rank gloo job saves and reloads, one 1-rank job reloads (a different world size):

* tangram_launch.checkpoint (global names): saved by pp2 x dp2 (layers 3+1), loaded by pp4 (1+1+1+1) and pp1.
* Megatron's dist_checkpointing (runtime_adapters.megatron_checkpoint): saved by tp2 x pp2 (3+1), loaded by
  tp1 x pp4 (1+1+1+1), tp2 x pp2 (1+3) and tp1 x pp1; between the jobs a corrupt and a torn newer checkpoint are
  planted, which the 1-rank load must skip by name.

This file is also the worker: ``python tests/test_checkpoint_megatron.py worker JOB OUT_DIR CKPT_DIR``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings

if __name__ in ("__main__", "__mp_main__"):  # worker (and its spawned helpers): make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch
from timeouts import PROCESS_GROUP_TIMEOUT, SUBPROCESS_TIMEOUT_S

from runtime_adapters.megatron_checkpoint import (MEGATRON_DIR, STATE_FORMAT, megatron_key_map,
                                                  megatron_stage_state)
from tangram_launch.checkpoint import store
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

STEP = 10  # the saved training step; Adam's per-parameter step is set to ADAM_STEP
ADAM_STEP = 7.0
LR, BETAS = 3e-4, (0.8, 0.95)  # saved hyperparameters; loaders start from FRESH ones
FRESH_LR, FRESH_BETAS = 1.0, (0.5, 0.5)


def make_plan(splits=(3, 1), *, tp=1, dp=1, model: dict | None = None) -> Plan:
    """A Megatron plan for the 'tiny' model (4 layers), fp32 so that Adam and the parameters share a dtype."""
    model = model or load_model("tiny").to_dict()
    stages, start = [], 0
    for i, n in enumerate(splits):
        stages.append(Stage(index=i, layers=(start, start + n), island=f"isl{i}",
                            gpus=tuple((f"node{i}", g) for g in range(tp * dp)), tp=tp, dp=dp,
                            micro_batch_size=1, has_embedding=i == 0, has_head=i == len(splits) - 1))
        start += n
    pred = Prediction(iteration_time_s=1.0, tokens_per_s=1.0, mfu=0.1,
                      stages=tuple(StagePrediction(0.1, 0.2, 1.0, 80.0) for _ in splits))
    training = TrainingSpec(global_batch=4 * dp, seq_len=32, dtype="fp32").to_dict()
    return Plan(model=model, training=training, stages=tuple(stages), num_microbatches=4, predicted=pred,
                runtime="megatron", schedule="1F1B")


# the layouts of the two jobs (name -> plan); world sizes 4 and 1
SAVE_TANGRAM = ("pp2_dp2_3+1", lambda: make_plan((3, 1), dp=2))
SAVE_MEGATRON = ("tp2_pp2_3+1", lambda: make_plan((3, 1), tp=2))
LOADS_4 = {"tangram": [("pp4_1+1+1+1", lambda: make_plan((1, 1, 1, 1)))],
           "megatron": [("tp1_pp4_1+1+1+1", lambda: make_plan((1, 1, 1, 1))),
                        ("tp2_pp2_1+3", lambda: make_plan((1, 3), tp=2))]}
LOADS_1 = {"tangram": [("pp1", lambda: make_plan((4,)))], "megatron": [("tp1_pp1", lambda: make_plan((4,)))]}


# ----------------------------------------------------------------------------------- expected values by name
def _value(global_name: str, shape: list[int], what: str) -> torch.Tensor:
    """The full (unsharded) tensor ``what`` of ``global_name``: depends on the name only, never on the layout."""
    seed = int.from_bytes(hashlib.sha256(f"{what}:{global_name}".encode()).digest()[:8], "little") >> 1
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return t.abs() + 0.01 if what == "exp_avg_sq" else t


def _expected(model, place):
    """(parameter, global name, {param, exp_avg, exp_avg_sq} as this rank's TP slice) for every parameter.

    The TP slice comes from the attributes Megatron's layers set on their parameters (``tensor_model_parallel``,
    ``partition_dim``), not from its checkpoint code, so the test does not check Megatron against itself.
    """
    keys = megatron_key_map(place.stage)
    tp, tp_rank = place.stage.tp, place.coords["tp"]
    for local, param in model.named_parameters():
        name = keys.to_global(local)
        shape = list(param.shape)
        dim = param.partition_dim if tp > 1 and getattr(param, "tensor_model_parallel", False) else None
        if dim is not None:
            shape[dim] *= tp
        full = {w: _value(name, shape, w) for w in ("param", "exp_avg", "exp_avg_sq")}
        yield param, name, {w: (t.chunk(tp, dim=dim)[tp_rank] if dim is not None else t) for w, t in full.items()}


def _fill(model, place, optimizer) -> None:
    with torch.no_grad():
        for param, _, exp in _expected(model, place):
            param.copy_(exp["param"])
            optimizer.state[param] = {"step": torch.tensor(ADAM_STEP), "exp_avg": exp["exp_avg"].clone(),
                                      "exp_avg_sq": exp["exp_avg_sq"].clone()}


def _check(model, place, optimizer) -> tuple[int, list[str]]:
    """(tensors compared, mismatches) between this rank's live state and the expected values."""
    checked, bad = 0, []
    for param, name, exp in _expected(model, place):
        checked += 1
        if not torch.equal(param.detach(), exp["param"]):
            bad.append(f"{name}: parameter")
        state = optimizer.state.get(param, {})
        for k in ("exp_avg", "exp_avg_sq"):
            checked += 1
            if k not in state or not torch.equal(state[k], exp[k]):
                bad.append(f"{name}: {k}")
        if float(state.get("step", -1.0)) != ADAM_STEP:
            bad.append(f"{name}: step {state.get('step')}")
    for group in optimizer.param_groups:
        if group["lr"] != LR or tuple(group["betas"]) != BETAS:
            bad.append(f"hyperparameters lr={group['lr']} betas={group['betas']}")
    return checked, bad


# ------------------------------------------------------------------------------------------------ the worker
def _build(adapter, plan: Plan, rank: int, lr: float, betas: tuple[float, float]):
    place = plan.place(rank)
    adapter.initialize(plan, place, timeout=PROCESS_GROUP_TIMEOUT)
    model = adapter.build_gpt_model(plan, place, use_cpu_initialization=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    return place, model, optimizer


def _route(route: str, ckpt_dir: str):
    """(save, load) for a route: both take (plan, place, model, optimizer)."""
    from runtime_adapters.megatron_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint
    from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint

    position = TrainingPosition(step=STEP, consumed_samples=STEP * 4, data={"epoch": 1})
    directory = os.path.join(ckpt_dir, route)
    if route == "tangram":
        def save(plan, place, model, opt):
            save_checkpoint(directory, plan=plan, state=megatron_stage_state(model, place, opt), position=position)

        def load(plan, place, model, opt):
            return load_checkpoint(directory, plan=plan, state=megatron_stage_state(model, place, opt))
    else:
        def save(plan, place, model, opt):
            save_megatron_checkpoint(directory, plan=plan, model=model, optimizer=opt, position=position)

        def load(plan, place, model, opt):
            return load_megatron_checkpoint(directory, plan=plan, model=model, optimizer=opt)
    return save, load


def _load_and_check(adapter, route: str, ckpt_dir: str, plan: Plan, rank: int) -> dict:
    place, model, opt = _build(adapter, plan, rank, FRESH_LR, FRESH_BETAS)
    _, before = _check(model, place, opt)
    loaded = _route(route, ckpt_dir)[1](plan, place, model, opt)
    checked, bad = _check(model, place, opt)
    import torch.distributed as dist

    dist.barrier()
    adapter.destroy()
    return {"checked": checked, "params": sum(1 for _ in model.parameters()), "mismatches_before": len(before),
            "mismatches": bad, "step": loaded.step, "consumed_samples": loaded.position.consumed_samples,
            "layout_changed": loaded.layout_changed, "skipped": [s.path for s in loaded.skipped]}


def _refusals(adapter, ckpt_dir: str, rank: int) -> dict:
    """1-rank job: what must be refused, and Megatron's own save strategy on this machine."""
    from megatron.core import dist_checkpointing

    from runtime_adapters.megatron_checkpoint import load_megatron_checkpoint, sharded_state_dict

    out = {"cuda": torch.cuda.is_available()}
    plan = make_plan((4,))
    place, model, opt = _build(adapter, plan, rank, FRESH_LR, FRESH_BETAS)
    other = load_model("tiny").to_dict()
    other["ffn_hidden_size"] = 128
    for name, kwargs in (("other_model", dict(directory=os.path.join(ckpt_dir, "megatron"),
                                              plan=make_plan((4,), model=other))),
                         ("tangram_format", dict(directory=os.path.join(ckpt_dir, "tangram"), plan=plan))):
        try:
            load_megatron_checkpoint(model=model, optimizer=opt, **kwargs)
            out[name] = None
        except SpecError as exc:
            out[name] = str(exc)
    try:  # Megatron's default torch_dist strategy, as shipped
        target = os.path.join(ckpt_dir, "default_strategy")
        os.makedirs(target)
        dist_checkpointing.save(sharded_state_dict(model), target)
        out["default_save"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the report says what Megatron raised
        out["default_save"] = f"{type(exc).__name__}: {exc}"
    import torch.distributed as dist

    dist.barrier()
    adapter.destroy()
    return out


def _worker(job: str, out_dir: str, ckpt_dir: str) -> None:
    import torch.distributed as dist

    from runtime_adapters.megatron_adapter import MegatronAdapter

    warnings.simplefilter("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    adapter = MegatronAdapter()
    report: dict = {}
    try:
        if job == "four":
            for route, (name, plan_fn) in (("tangram", SAVE_TANGRAM), ("megatron", SAVE_MEGATRON)):
                plan = plan_fn()
                place, model, opt = _build(adapter, plan, rank, LR, BETAS)
                _fill(model, place, opt)
                _route(route, ckpt_dir)[0](plan, place, model, opt)
                report[f"save/{route}/{name}"] = {"checked": _check(model, place, opt)[0]}
                dist.barrier()
                adapter.destroy()
        for route, loads in (LOADS_4 if job == "four" else LOADS_1).items():
            for name, plan_fn in loads:
                report[f"load/{route}/{name}"] = _load_and_check(adapter, route, ckpt_dir, plan_fn(), rank)
        if job == "one":
            report["refusals"] = _refusals(adapter, ckpt_dir, rank)
    finally:
        path = os.path.join(out_dir, f"{job}_rank{rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(job: str, world: int, out, ckpt) -> dict[int, dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", job, str(out), str(ckpt)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"megatron checkpoint job '{job}' timed out")
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- {job} rank {r} failed:\n{outputs[r][-3000:]}" for r in failed)
    return {r: json.loads((out / f"{job}_rank{r}.json").read_text()) for r in range(world)}


def _plant_bad_checkpoints(directory) -> list[str]:
    """A newer corrupt copy (one flipped byte in a shard) and a newer torn save (temporary name)."""
    good = directory / f"step_{STEP}"
    corrupt = directory / f"step_{STEP + 5}"
    shutil.copytree(good, corrupt)
    shard = sorted((corrupt / MEGATRON_DIR).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    torn = directory / f"step_{STEP + 10}.tmp-0123456789ab"
    shutil.copytree(good, torn)
    (torn / store.MANIFEST).unlink()
    return [str(torn), str(corrupt)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_ckpt_reports")
    ckpt = tmp_path_factory.mktemp("megatron_ckpt")
    four = _run_job("four", 4, out, ckpt)
    describe_before = store.describe(str(ckpt / "megatron"))
    planted = _plant_bad_checkpoints(ckpt / "megatron")
    one = _run_job("one", 1, out, ckpt)
    return {"four": four, "one": one, "ckpt": ckpt, "planted": planted, "describe": describe_before}


def _loads(jobs, route: str):
    for job, loads in (("four", LOADS_4), ("one", LOADS_1)):
        for name, plan_fn in loads[route]:
            yield job, name, plan_fn(), {r: rep[f"load/{route}/{name}"] for r, rep in jobs[job].items()}


def _assert_every_tensor_restored(jobs, route: str) -> None:
    for job, name, plan, reports in _loads(jobs, route):
        assert len(reports) == plan.world_size
        for rank, rep in reports.items():
            assert rep["mismatches"] == [], (name, rank, rep["mismatches"][:10])
            assert rep["checked"] == 3 * rep["params"] > 0, (name, rank, rep)  # parameter + exp_avg + exp_avg_sq
            assert rep["mismatches_before"] > 0, (name, rank)  # the fresh model differed: the load did the work
            assert (rep["step"], rep["consumed_samples"]) == (STEP, STEP * 4)
            assert rep["layout_changed"] is True


# ------------------------------------------------------------------------------------------------------ tests
def test_megatron_names_map_to_global_layer_names():
    """GPTModel's local names on a middle/last stage <-> the global names both routes key expected values by."""
    plan = make_plan((1, 2, 1))
    keys = megatron_key_map(plan.stages[1])
    assert keys.to_global("decoder.layers.1.mlp.linear_fc1.weight") == "layers.2.mlp.linear_fc1.weight"
    assert keys.to_local("layers.1.self_attention.linear_qkv.bias") == "decoder.layers.0.self_attention.linear_qkv.bias"
    last = megatron_key_map(plan.stages[2])
    assert last.to_global("decoder.final_layernorm.weight") == "head.final_layernorm.weight"
    assert last.to_global("output_layer.weight") == "head.output_layer.weight"
    assert megatron_key_map(plan.stages[0]).to_global("embedding.word_embeddings.weight") == \
        "embedding.word_embeddings.weight"
    with pytest.raises(SpecError, match="outside this stage"):
        keys.to_global("decoder.layers.2.mlp.linear_fc1.weight")


def test_tangram_route_refuses_tensor_parallel_stages():
    plan = make_plan((3, 1), tp=2)
    with pytest.raises(SpecError, match="save_megatron_checkpoint"):
        megatron_stage_state(None, plan.place(0))


@pytest.mark.distributed
def test_tangram_checkpoint_of_megatron_stages_reshards_the_pipeline(jobs):
    """Global names: pp2 x dp2 (3+1) -> pp4 (1+1+1+1) on 4 ranks and -> pp1 on 1 rank; parameters, Adam state
    and hyperparameters equal the expected values on every rank."""
    saved = jobs["four"]
    assert all(saved[r][f"save/tangram/{SAVE_TANGRAM[0]}"]["checked"] > 0 for r in range(4))
    _assert_every_tensor_restored(jobs, "tangram")


@pytest.mark.distributed
def test_dist_checkpointing_reshards_tensor_and_pipeline_parallelism(jobs):
    """Megatron's format: tp2 x pp2 (3+1) -> tp1 x pp4, tp2 x pp2 (1+3) and tp1 x pp1 (a different world size)."""
    _assert_every_tensor_restored(jobs, "megatron")


@pytest.mark.distributed
def test_megatron_checkpoint_is_a_verified_tangram_directory(jobs):
    """Manifest with checksums, plan and position around Megatron's files (what --resume reads), and the shards
    describe their TP slicing: linear_qkv is one [layers, 3*hidden, hidden] tensor saved as [1, 96, 64] slices."""
    import torch.distributed.checkpoint as dcp

    info = jobs["describe"]
    assert info.step == STEP and info.position.consumed_samples == STEP * 4 and info.skipped == ()
    assert Plan.from_dict(info.plan).content_hash() == SAVE_MEGATRON[1]().content_hash()
    manifest = store.read_manifest(info.path)
    assert manifest["state_format"] == STATE_FORMAT and manifest["has_optimizer"] is True
    assert {f"{MEGATRON_DIR}/.metadata", f"{MEGATRON_DIR}/common.pt", store.PLAN_FILE,
            store.POSITION_FILE} <= set(manifest["files"])
    assert store.check_files(info.path, manifest) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = dcp.FileSystemReader(os.path.join(info.path, MEGATRON_DIR)).read_metadata()
    for key in ("decoder.layers.self_attention.linear_qkv.weight",
                "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"):
        entry = meta.state_dict_metadata[key]
        assert list(entry.size) == [4, 192, 64]
        assert sorted(tuple(c.offsets) for c in entry.chunks) == [(i, r, 0) for i in range(4) for r in (0, 96)]
        assert {tuple(c.sizes) for c in entry.chunks} == {(1, 96, 64)}


@pytest.mark.distributed
def test_resume_skips_a_corrupt_and_a_torn_newer_checkpoint(jobs):
    rep = jobs["one"][0]["load/megatron/tp1_pp1"]
    assert rep["step"] == STEP and rep["mismatches"] == []
    assert rep["skipped"] == jobs["planted"]  # newest first: the torn one, then the corrupt one


@pytest.mark.distributed
def test_mismatched_model_and_foreign_format_are_refused(jobs):
    refusals = jobs["one"][0]["refusals"]
    assert "different model" in refusals["other_model"] and "ffn_hidden_size: 256 in the checkpoint, 128" \
        in refusals["other_model"]
    assert refusals["tangram_format"] and "state_format" in refusals["tangram_format"]


@pytest.mark.distributed
def test_megatron_default_save_strategy_needs_cuda(jobs):
    """Why the sync strategy exists: megatron-core 0.16.1's torch_dist save calls torch.cuda.synchronize(). A CPU
    build of torch says it was not compiled with CUDA; a CUDA build on a machine without a GPU finds no driver."""
    result = jobs["one"][0]["refusals"]["default_save"]
    if jobs["one"][0]["refusals"]["cuda"]:
        assert result == "ok"
    else:
        assert "CUDA" in result or "NVIDIA driver" in result, result


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit("usage: test_checkpoint_megatron.py worker JOB OUT_DIR CKPT_DIR")
