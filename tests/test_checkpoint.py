"""Layout-agnostic checkpoints: global names, atomic saves, torn/corrupt detection, refusals, and a real resume.

The multi-rank test trains ``runtime_adapters.gpt.StageModule`` with a small hand-written pipeline (send/recv of
activations and gradients between stages, a sum all-reduce of gradients inside a stage's data-parallel replicas) on
real gloo processes: layout A (2 ranks, layers 3+1) saves at step 2, is killed in the middle of its step-4 save, and
layout B (4 ranks, layers 1+2+1 with the middle stage replicated twice) resumes from step 2 and continues to step 4.
Losses and parameters must equal one uninterrupted process, which only holds if AdamW's state carried over.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S, SUBPROCESS_TIMEOUT_S
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from runtime_adapters.gpt import StageModule, build_model, lm_loss
from tangram_launch.checkpoint import store
from tangram_launch.checkpoint import (LayerKeyMap, StageState, TrainingPosition, describe, load_checkpoint,
                                       save_checkpoint)
from tangram_launch.checkpoint.keys import load_optimizer_state_by_name, optimizer_state_by_name
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction
from tangram_launch.specs.model import ModelSpec

# no linear biases: a key bias has a zero true gradient (softmax ignores a per-query constant), so its computed
# gradient is rounding noise that Adam would blow up to an O(lr) step, differently in differently-split runs
SPEC = ModelSpec(name="ckpt-gpt", num_layers=4, hidden_size=16, num_heads=2, num_kv_heads=2, ffn_hidden_size=32,
                 vocab_size=32, max_seq_len=8, linear_bias=False)
BATCH, SEQ = 4, 8
INIT_SEED = 0
TOL = dict(rtol=1e-5, atol=1e-6)


def plan_of(stages: list[tuple[int, int]], spec: ModelSpec = SPEC, microbatches: int = 1) -> Plan:
    """A plan from (num_layers, dp) per stage, all on one node's 'GPUs' 0, 1, ..."""
    built, start, gpu = [], 0, 0
    for i, (n, dp) in enumerate(stages):
        built.append(Stage(index=i, layers=(start, start + n), island="cpu",
                           gpus=tuple(("n0", gpu + k) for k in range(dp)), dp=dp,
                           micro_batch_size=BATCH // (dp * microbatches), has_embedding=i == 0,
                           has_head=i == len(stages) - 1))
        start, gpu = start + n, gpu + dp
    training = {"global_batch": BATCH, "seq_len": SEQ, "dtype": "fp32", "optimizer": "adamw", "grad_dtype": "fp32"}
    return Plan(model=spec.to_dict(), training=training, stages=tuple(built), num_microbatches=microbatches,
                predicted=Prediction(0.0, 0.0, 0.0, tuple(StagePrediction(0.0, 0.0, 0.0, 0.0) for _ in built)))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def batch(step: int) -> torch.Tensor:
    """The batch of optimizer step ``step`` (1-based): a function of the data position only."""
    return torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))


def reference(steps: int, *, reset_optimizer_at: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(SPEC, seed=INIT_SEED)
    opt = adamw(model.parameters())
    losses = []
    for step in range(1, steps + 1):
        if step == reset_optimizer_at:
            opt = adamw(model.parameters())
        b = batch(step)
        loss = lm_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole_state(plan: Plan, *, seed: int = INIT_SEED, lr: float = 1e-2):
    """One process, one stage: the module, its optimizer and the StageState to save or load."""
    spec = ModelSpec.from_dict(plan.model)
    module = StageModule(spec, (0, spec.num_layers), has_embedding=True, has_head=True, seed=seed)
    opt = adamw(module.parameters())
    for g in opt.param_groups:
        g["lr"] = lr
    keys = LayerKeyMap.for_stage(plan.stages[0], local_numbering="global")
    return module, opt, StageState.from_module(module, keys, opt)


def train(module, opt, steps) -> None:
    for step in steps:
        b = batch(step)
        lm_loss(module(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# --- names --------------------------------------------------------------------------------------------------------

class LocalStage(nn.Module):
    """A stage numbering its layers locally (a ModuleList): layers.0 is the stage's first layer."""

    def __init__(self, layers: tuple[int, int], has_embedding: bool, has_head: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(8, 4) if has_embedding else None
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(*layers))
        self.head = nn.Linear(4, 8, bias=False) if has_head else None

    def forward(self, x):
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


def test_local_names_to_global_and_back():
    keys = LayerKeyMap(layers=(3, 5), has_embedding=False, has_head=True)
    local = LocalStage((3, 5), has_embedding=False, has_head=True).state_dict()
    glob = keys.rename_to_global(local)
    assert sorted(glob) == ["head.weight", "layers.3.bias", "layers.3.weight", "layers.4.bias", "layers.4.weight"]
    assert keys.rename_to_local(glob).keys() == local.keys()
    with pytest.raises(SpecError, match=r"layer 5 is outside this stage's layers \[3, 5\)"):
        keys.to_global("layers.2.weight")
    with pytest.raises(SpecError, match="no embedding part"):
        keys.to_global("embedding.weight")
    with pytest.raises(SpecError, match="neither the layer prefix nor a part prefix"):
        keys.to_global("blocks.0.weight")
    with pytest.raises(SpecError, match="not held by the stage"):
        keys.to_local("layers.2.weight")
    # globally numbered modules (runtime_adapters.gpt) pass through, range-checked
    g = LayerKeyMap(layers=(3, 5), has_embedding=False, has_head=True, local_numbering="global")
    assert g.to_global("layers.4.attn.q.weight") == "layers.4.attn.q.weight"
    with pytest.raises(SpecError, match="layer 0 is outside"):
        g.to_global("layers.0.attn.q.weight")
    # Megatron-core-like names: decoder.layers.<local j>, final norm and output layer belong to the head
    m = LayerKeyMap(layers=(2, 4), has_embedding=False, has_head=True, layer_prefix="decoder.layers.",
                    parts={"embedding.": "embedding.", "decoder.final_layernorm.": "head.final_layernorm.",
                           "output_layer.": "head.output_layer."})
    assert m.to_global("decoder.layers.1.mlp.linear_fc1.weight") == "layers.3.mlp.linear_fc1.weight"
    assert m.to_global("decoder.final_layernorm.weight") == "head.final_layernorm.weight"
    assert m.to_local("head.output_layer.weight") == "output_layer.weight"
    assert m.to_local("layers.2.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"


@pytest.mark.slow
def test_any_renaming_and_unnamed_optimizer_parameters():
    """DeepSpeed-style entries "<i>.<param>" over [embedding, layer 0, ..., head] rename through a function."""
    seq = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 8))  # stage: all
    last = 3

    def rename(key: str) -> str:
        i, _, rest = key.partition(".")
        return "embedding." + rest if i == "0" else "head." + rest if int(i) == last else f"layers.{int(i) - 1}.{rest}"

    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    state = StageState.from_module(seq, rename, opt)
    assert sorted(state.model) == ["embedding.weight", "head.bias", "head.weight", "layers.0.bias", "layers.0.weight",
                                   "layers.1.bias", "layers.1.weight"]
    with pytest.raises(SpecError, match="every optimizer parameter needs a global name"):
        StageState(model=state.model, optimizer=torch.optim.SGD(seq.parameters(), lr=0.1),
                   param_names={p: n for p, n in state.param_names.items() if n != "head.bias"})
    with pytest.raises(SpecError, match="not a global state name"):
        StageState(model={"blocks.0.weight": torch.zeros(1)})


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
])
@pytest.mark.slow
def test_optimizer_state_by_name_moves_between_layouts(make_opt):
    whole = LocalStage((0, 4), True, True, seed=1)
    whole_keys = LayerKeyMap(layers=(0, 4), has_embedding=True, has_head=True)
    opt = make_opt(whole.parameters())
    x = torch.randint(0, 8, (5,))
    for _ in range(2):
        whole(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    names = {p: whole_keys.to_global(n) for n, p in whole.named_parameters()}
    named = optimizer_state_by_name(opt, names)
    assert set(named.tensors) == set(names.values())  # every parameter, by global name
    # a stage holding layers [2, 4) and the head, numbered locally, with a fresh optimizer
    part = LocalStage((2, 4), False, True, seed=2)
    part_keys = LayerKeyMap(layers=(2, 4), has_embedding=False, has_head=True)
    part_opt = make_opt(part.parameters())
    part_names = {p: part_keys.to_global(n) for n, p in part.named_parameters()}
    load_optimizer_state_by_name(part_opt, part_names, named)
    for p, name in part_names.items():
        for k, v in part_opt.state[p].items():
            assert torch.equal(v, named.tensors[name][k]), (name, k)
        assert set(part_opt.state[p]) == set(named.tensors[name])


# --- one process: round trip, torn and corrupt checkpoints, retention, refusals -----------------------------------

def test_round_trip_restores_model_optimizer_position_and_rng(tmp_path):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    train(module, opt, range(1, 3))
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    save_checkpoint(tmp_path, plan=plan, state=state,
                    position=TrainingPosition(2, 8, data={"next_index": 8}, extra={"scheduler": {"last_epoch": 2}}))
    expect_draws = (torch.rand(3), random.random(), np.random.rand())
    m2, o2, s2 = whole_state(plan, seed=42, lr=0.5)
    loaded = load_checkpoint(tmp_path, plan=plan, state=s2)
    assert (torch.equal(torch.rand(3), expect_draws[0]) and random.random() == expect_draws[1]
            and np.random.rand() == expect_draws[2])
    assert loaded.rng == "per_rank" and not loaded.layout_changed and loaded.step == 2 and not loaded.skipped
    assert loaded.position == TrainingPosition(2, 8, data={"next_index": 8}, extra={"scheduler": {"last_epoch": 2}})
    for (k, a), (_, b) in zip(module.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert o2.param_groups[0]["lr"] == 1e-2 and o2.param_groups[0]["betas"] == (0.9, 0.95)
    train(module, opt, [3])
    train(m2, o2, [3])  # identical from here on: the Adam moments and step count came back exactly
    for (k, a), (_, b) in zip(module.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    info = describe(str(tmp_path))  # the launcher's torch-free view
    assert info.step == 2 and info.plan["stages"][0]["layers"] == [0, 4] and info.position.consumed_samples == 8
    manifest = store.read_manifest(info.path)
    assert manifest["layers"] == [0, 1, 2, 3] and "layers.3.mlp.fc_in.weight" in manifest["model"]
    assert set(manifest["optimizer"]["layers.0.attn.q.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def _corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_torn_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path, caplog):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    for step in (1, 2, 3):
        train(module, opt, [step])
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(step, step * BATCH),
                        keep_last=None)
    # a save torn before its manifest (temporary name), and a committed directory someone emptied of its manifest
    torn = tmp_path / "step_5.tmp-0123abcd"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step_4").mkdir()
    shard = next(p for p in (tmp_path / "step_3" / "state").iterdir() if p.suffix == ".distcp")
    _corrupt(str(shard))
    os.remove(tmp_path / "step_2" / "rng" / "rank_0.json")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    _, _, s2 = whole_state(plan, seed=9)
    with caplog.at_level(logging.WARNING, logger="tangram_launch"):
        loaded = load_checkpoint(tmp_path, plan=plan, state=s2)
    assert loaded.step == 1 and loaded.path == str(tmp_path / "step_1")
    reasons = {os.path.basename(s.path): s.reason for s in loaded.skipped}
    assert "torn" in reasons["step_5.tmp-0123abcd"] and "no manifest" in reasons["step_4"]
    assert f"checksum mismatch in state/{shard.name}" in reasons["step_3"]
    assert "missing file rng/rank_0.json" in reasons["step_2"]
    text = caplog.text
    for name in ("step_5.tmp-0123abcd", "step_4", "step_3", "step_2"):
        assert f"skipping checkpoint {tmp_path / name}" in text
    assert f"previous complete one, {tmp_path / 'step_1'}" in text
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # loading deletes nothing


def test_keep_last_and_never_overwrite(tmp_path):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    stale = tmp_path / "step_1.tmp-deadbeef"  # left by a crashed save
    stale.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(step, 0), keep_last=2)
        if step == 1:
            assert not stale.exists()  # removed once a newer save committed
    assert sorted(n for n in os.listdir(tmp_path) if n != ".tangram-lock") == ["step_3", "step_4"]
    manifest = (tmp_path / "step_4" / "manifest.json").read_bytes()
    with pytest.raises(SpecError, match="already exists; a complete checkpoint is never overwritten"):
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(4, 0), keep_last=2)
    assert (tmp_path / "step_4" / "manifest.json").read_bytes() == manifest
    assert sorted(n for n in os.listdir(tmp_path) if n != ".tangram-lock") == ["step_3", "step_4"]
    with pytest.raises(SpecError, match="keep_last"):
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(5, 0), keep_last=0)


def test_one_checkpoint_named_loads_that_step_and_newer_history_is_kept(tmp_path):
    """``DIR/step_N`` names one checkpoint (an older step, as Megatron's --ckpt-step chooses): load, describe and
    the launcher's directory read it; saves of the run resumed from it never prune the newer history's."""
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    saved = {}
    for step in (2, 4, 6):  # saved every 2 steps
        train(module, opt, [step])
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(step, 4 * step), keep_last=None)
        saved[step] = {k: v.clone() for k, v in module.state_dict().items()}
    m2, o2, s2 = whole_state(plan, seed=42)
    loaded = load_checkpoint(tmp_path / "step_4", plan=plan, state=s2)
    assert loaded.step == 4 and loaded.position.consumed_samples == 16
    assert all(torch.equal(v, saved[4][k]) for k, v in m2.state_dict().items())
    assert describe(str(tmp_path / "step_2")).step == 2 and describe(str(tmp_path)).step == 6
    assert store.home_directory(str(tmp_path / "step_2")) == str(tmp_path)
    assert store.home_directory(str(tmp_path)) == str(tmp_path)
    assert store.one_checkpoint(str(tmp_path / "nothing" / "step_2")) is None  # no manifest: not a checkpoint
    # resumed from step 2 and saving every step with keep_last=1: its step 3 goes in beside steps 4 and 6, which
    # neither count nor go (the older step 2 does); step 4 itself is never overwritten
    save_checkpoint(tmp_path, plan=plan, state=s2, position=TrainingPosition(3, 12), keep_last=1)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step_")) == ["step_3", "step_4", "step_6"]
    with pytest.raises(SpecError, match="already exists; a complete checkpoint is never overwritten"):
        save_checkpoint(tmp_path, plan=plan, state=s2, position=TrainingPosition(4, 16), keep_last=1)
    # a torn checkpoint named: the directory holding it is searched for that step, and says why it was skipped
    os.remove(tmp_path / "step_6" / store.POSITION_FILE)
    with pytest.raises(SpecError, match=r"no complete checkpoint in .*looked for step_6/.*step_6 \(step 6\)"):
        load_checkpoint(tmp_path / "step_6", plan=plan, state=s2)


def test_refusals_name_what_does_not_match(tmp_path):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    with pytest.raises(SpecError) as exc:
        load_checkpoint(tmp_path / "nothing", plan=plan, state=state)
    assert f"no complete checkpoint in {tmp_path / 'nothing'}" in str(exc.value) and "step_<N>" in str(exc.value)
    save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(1, 4))
    # one checkpoint named, with another step asked for: both named, and what would be valid
    with pytest.raises(SpecError, match=r"step_1 is the checkpoint of step 1, not of step 3") as exc:
        load_checkpoint(tmp_path / "step_1", plan=plan, state=state, step=3)
    assert exc.value.field == "step" and f"the directory {tmp_path} to choose any of its steps" in str(exc.value)
    # a different model: hidden size
    wider = ModelSpec.from_dict({**SPEC.to_dict(), "name": "wider", "hidden_size": 32})
    wplan = plan_of([(4, 1)], spec=wider)
    _, _, wstate = whole_state(wplan)
    with pytest.raises(SpecError, match=r"different model.*hidden_size: 16 in the checkpoint, 32 in the plan") as exc:
        load_checkpoint(tmp_path, plan=wplan, state=wstate)
    assert exc.value.field == "model.hidden_size"
    # a deeper model: the layers the checkpoint lacks are named
    deeper = ModelSpec.from_dict({**SPEC.to_dict(), "num_layers": 6})
    dplan = plan_of([(6, 1)], spec=deeper)
    _, _, dstate = whole_state(dplan)
    with pytest.raises(SpecError, match=r"num_layers: 4 in the checkpoint, 6 in the plan \(missing layers 4-5\)"):
        load_checkpoint(tmp_path, plan=dplan, state=dstate)
    # same model dims, but the checkpoint lacks a layer (a partial or foreign checkpoint)
    path = tmp_path / "step_1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["model"] = {k: v for k, v in manifest["model"].items() if not k.startswith("layers.2.")}
    manifest["layers"] = [0, 1, 3]
    path.write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match=r"step_1 lacks layers 2 \(it holds layers 0-1, 3\); missing keys: layers\.2\."):
        load_checkpoint(tmp_path, plan=plan, state=state)
    # saving a state that does not cover the model is refused before anything is written
    partial = StageState(model={k: v for k, v in state.model.items() if not k.startswith("layers.3.")})
    with pytest.raises(SpecError, match="no rank holds layers 3"):
        save_checkpoint(tmp_path / "p", plan=plan, state=partial, position=TrainingPosition(1, 0))
    assert not (tmp_path / "p").exists()


# --- real gloo processes: layout A -> torn save -> layout B ---------------------------------------------------------

LAYOUT_A = [(3, 1), (1, 1)]  # 2 ranks
LAYOUT_B = [(1, 1), (2, 2), (1, 1)]  # 4 ranks: the middle stage has two data-parallel replicas


class Pipeline:
    """A plain pipeline over the plan: stage s's dp replicas each take a contiguous block of the batch's rows; every
    rank sends its activations to every rank of the next stage and its input gradients (zero outside its rows) to
    every rank of the previous one. Replicated stages are sharded with FSDP2 (ZeRO-3: DTensor parameters and
    optimizer state), so loading reshards plain tensors into DTensors and back. Each replica holds a share of the
    mean loss, so gradients must be summed: the backward seed is scaled by dp (exact for a power of two) to undo
    FSDP2's averaging."""

    def __init__(self, plan: Plan, rank: int, seed: int) -> None:
        self.plan, self.place = plan, plan.place(rank)
        self.stage_ranks = [[r.rank for r in plan.rank_layout if r.stage == s.index] for s in plan.stages]
        self.dp_group = None
        for ranks in self.stage_ranks:  # new_group is collective: every rank creates every group
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                self.dp_group = g
        st = self.place.stage
        self.module = StageModule(SPEC, st.layers, has_embedding=st.has_embedding, has_head=st.has_head, seed=seed)
        self.scale = 1.0
        if self.dp_group is not None:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.module, mesh=DeviceMesh.from_group(self.dp_group, "cpu"))
            self.scale = float(st.dp)
        self.optimizer = adamw(self.module.parameters())  # after sharding: over the DTensor parameters

    def rows(self, stage: int, dp: int) -> slice:
        n = BATCH // len(self.stage_ranks[stage])
        return slice(dp * n, (dp + 1) * n)

    def step(self, tokens: torch.Tensor) -> float | None:
        s, d = self.place.stage.index, self.place.coords["dp"]
        mine = self.rows(s, d)
        if s == 0:
            inp = tokens[mine, :-1]
        else:
            full = torch.empty(BATCH, SEQ, SPEC.hidden_size)
            for k, src in enumerate(self.stage_ranks[s - 1]):
                buf = torch.empty_like(full[self.rows(s - 1, k)])
                dist.recv(buf, src)
                full[self.rows(s - 1, k)] = buf
            inp = full[mine].clone().requires_grad_()
        out = self.module(inp)
        loss = None
        if self.place.is_last_stage:
            logits = out.reshape(-1, SPEC.vocab_size)
            loss = F.cross_entropy(logits, tokens[mine, 1:].reshape(-1), reduction="sum") / (BATCH * SEQ)
            (loss * self.scale).backward()
        else:
            for dst in self.stage_ranks[s + 1]:
                dist.send(out.detach().contiguous(), dst)
            grad = torch.zeros(BATCH, SEQ, SPEC.hidden_size)
            for src in self.stage_ranks[s + 1]:
                buf = torch.empty_like(grad)
                dist.recv(buf, src)
                grad += buf
            out.backward(grad[mine] * self.scale)
        if s > 0:
            g = torch.zeros(BATCH, SEQ, SPEC.hidden_size)
            g[mine] = inp.grad / self.scale  # the input gradient of this rank's rows, unscaled
            for dst in self.stage_ranks[s - 1]:
                dist.send(g, dst)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if loss is None else loss.item()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _draws() -> list:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _worker(rank: int, world: int, port: int, plan_dict: dict, job: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    records = _Records()
    logging.getLogger("tangram_launch").addHandler(records)
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    plan = Plan.from_dict(plan_dict)
    pipe = Pipeline(plan, rank, seed=job["init_seed"])
    state = StageState.from_module(pipe.module, LayerKeyMap.for_stage(pipe.place.stage, local_numbering="global"),
                                   pipe.optimizer)
    result: dict = {"losses": {}}
    out = os.path.join(out_dir, f"{job['name']}-rank{rank}.pt")
    first = 1
    if job["resume"]:
        loaded = load_checkpoint(job["dir"], plan=plan, state=state)
        result["loaded"] = {"step": loaded.step, "skipped": [s.path for s in loaded.skipped], "rng": loaded.rng,
                            "position": loaded.position.to_dict(), "layout_changed": loaded.layout_changed}
        result["draws_after_load"] = _draws()
        first = loaded.position.consumed_samples // BATCH + 1
    for step in range(first, job["until"] + 1):
        loss = pipe.step(batch(step))
        if loss is not None:
            result["losses"][step] = loss
        torch.save(result, out)
        if step in job["save_at"]:
            if step == job.get("crash_at") and rank == job.get("crash_rank"):
                # killed after its DCP shard and RNG file are on disk, before any checksum or the manifest
                store.hash_files = lambda *a, **k: os._exit(17)
            save_checkpoint(job["dir"], plan=plan, state=state, keep_last=2,
                            position=TrainingPosition(step, step * BATCH, data={"next_batch": step + 1}))
            if step == 2:
                result["draws_after_save"] = _draws()
    result["state"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                       for k, v in state.model.items()}
    result["sharded"] = sorted(k for k, v in state.model.items() if isinstance(v, DTensor))
    result["warnings"] = records.messages
    torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adapter_worker(rank: int, world: int, port: int, plan_dict: dict, job: dict, out_dir: str) -> None:
    """The torch runtime adapter resumes a checkpoint another program wrote under another layout."""
    from runtime_adapters.torch_native import TorchAdapter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    plan = Plan.from_dict(plan_dict)
    ctx = TorchAdapter().setup(plan, plan.place(rank), seed=job["init_seed"], optimizer_factory=adamw,
                               timeout_s=PROCESS_GROUP_TIMEOUT_S)
    state = StageState.from_module(ctx.module, LayerKeyMap.for_stage(ctx.place.stage, local_numbering="global"),
                                   ctx.optimizer)
    loaded = load_checkpoint(job["dir"], plan=plan, state=state)
    losses = {step: ctx.train_step(batch(step))
              for step in range(loaded.position.consumed_samples // BATCH + 1, job["until"] + 1)}
    save_checkpoint(job["dir"], plan=plan, state=state, position=TrainingPosition(job["until"], job["until"] * BATCH))
    torch.save({"losses": losses, "loaded": loaded.step,
                "state": {k: v.detach().clone() for k, v in state.model.items()}},
               os.path.join(out_dir, f"{job['name']}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, plan: Plan, job: dict, out_dir: str, worker=_worker) -> list[int | None]:
    os.makedirs(out_dir, exist_ok=True)
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    try:
        ctx = mp.start_processes(worker, args=(world, _free_port(), plan.to_dict(), job, out_dir), nprocs=world,
                                 join=False, start_method="spawn")
    finally:
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    for p in ctx.processes:
        p.join(SUBPROCESS_TIMEOUT_S)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    return codes


def _results(out_dir: str, name: str, world: int) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"{name}-rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module")
def ref():
    return reference(4)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Layout A: steps 1-4, a complete save at 2, rank 1 killed in the middle of the save at 4."""
    root = tmp_path_factory.mktemp("layout_a")
    ckpt, out = str(root / "ckpt"), str(root / "out")
    codes = _spawn(2, plan_of(LAYOUT_A), dict(name="A", init_seed=INIT_SEED, resume=False, until=4, save_at=[2, 4],
                                              crash_at=4, crash_rank=1, dir=ckpt), out)
    return codes, ckpt, _results(out, "A", 2)


def _resumable_copy(ckpt: str, tmp_path) -> str:
    """Each resume works on its own copy of A's directory (torn save included)."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, dst)
    return dst


def _assert_state(got: dict[str, torch.Tensor], expect: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expect.keys()
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], **TOL, msg=k)


@pytest.mark.distributed
def test_torn_save_leaves_only_a_temporary_directory(run_a, ref):
    codes, ckpt, a = run_a
    assert codes[1] == 17 and codes[0] != 0, codes  # rank 0 fails in the save's collective when its peer dies
    assert [a[1]["losses"][s] for s in (1, 2, 3, 4)] == pytest.approx(ref[0], rel=TOL["rtol"], abs=TOL["atol"])
    names = sorted(n for n in os.listdir(ckpt) if n != ".tangram-lock")
    assert names[0] == "step_2" and len(names) == 2 and names[1].startswith("step_4.tmp-"), names
    assert not os.path.exists(os.path.join(ckpt, names[1], "manifest.json"))
    assert os.listdir(os.path.join(ckpt, names[1], "state"))  # some shards were written before the kill
    assert os.path.exists(os.path.join(ckpt, "step_2", "manifest.json"))


@pytest.mark.distributed
def test_resume_under_a_new_layout_after_a_torn_save(run_a, ref, tmp_path):
    _, src, a = run_a
    ref_losses, ref_state = ref
    ckpt = _resumable_copy(src, tmp_path)
    torn = os.path.join(ckpt, next(n for n in os.listdir(ckpt) if ".tmp-" in n))
    # layout B (4 ranks, 1+2+1, FSDP2-sharded middle stage, different initial weights) resumes, runs steps 3-4
    codes = _spawn(4, plan_of(LAYOUT_B), dict(name="B", init_seed=INIT_SEED + 1, resume=True, until=4, save_at=[4],
                                              dir=ckpt), str(tmp_path / "out"))
    assert codes == [0, 0, 0, 0], codes
    b = _results(str(tmp_path / "out"), "B", 4)
    for r in b:
        assert r["loaded"]["step"] == 2 and r["loaded"]["position"]["consumed_samples"] == 2 * BATCH
        assert r["loaded"]["skipped"] == [torn] and r["loaded"]["layout_changed"]
        # a new layout gets rank 0's RNG states on every rank: the draws rank 0 of A made right after saving
        assert r["loaded"]["rng"] == "global" and r["draws_after_load"] == a[0]["draws_after_save"]
    assert any(f"skipping checkpoint {torn}" in m and "torn" in m
               and f"previous complete one, {os.path.join(ckpt, 'step_2')}" in m for m in b[0]["warnings"])
    assert [b[3]["losses"][s] for s in (3, 4)] == pytest.approx(ref_losses[2:], rel=TOL["rtol"], abs=TOL["atol"])
    got = {}
    for r in b:
        got.update(r["state"])
    _assert_state(got, ref_state)
    assert b[1]["sharded"] and b[1]["sharded"] == sorted(b[1]["state"])  # stage 1 really held DTensor shards
    # keep_last=2 kept steps 2 and 4; the torn directory went with the first successful save after it
    assert sorted(n for n in os.listdir(ckpt) if n != ".tangram-lock") == ["step_2", "step_4"]

    # a third layout (one process) loads B's step-4 checkpoint, written from shards, exactly
    one = plan_of([(4, 1)])
    module, opt, state = whole_state(one, seed=7)
    loaded = load_checkpoint(ckpt, plan=one, state=state)
    assert loaded.step == 4 and loaded.saved_plan == plan_of(LAYOUT_B)
    for k, v in state.model.items():
        assert torch.equal(v, got[k]), k
    assert all(float(s["step"]) == 4.0 for s in opt.state.values()) and len(opt.state) == len(ref_state)

    # control: without the optimizer state the run would not match, so the comparison above can tell
    _, fresh_state = reference(4, reset_optimizer_at=3)
    assert max((fresh_state[k] - ref_state[k]).abs().max().item() for k in ref_state) > 100 * TOL["atol"]


@pytest.mark.distributed
def test_torch_adapter_resumes_under_another_layout(run_a, ref, tmp_path):
    """runtime_adapters.torch_native (1F1B over 3 ranks, layers 1+2+1, 4 micro-batches) continues A's step 2."""
    ckpt = _resumable_copy(run_a[1], tmp_path)
    plan = plan_of([(1, 1), (2, 1), (1, 1)], microbatches=4)
    codes = _spawn(3, plan, dict(name="T", init_seed=INIT_SEED + 1, until=4, dir=ckpt), str(tmp_path / "out"),
                   worker=_adapter_worker)
    assert codes == [0, 0, 0], codes
    t = _results(str(tmp_path / "out"), "T", 3)
    assert all(r["loaded"] == 2 for r in t)
    assert [t[2]["losses"][s] for s in (3, 4)] == pytest.approx(ref[0][2:], rel=TOL["rtol"], abs=TOL["atol"])
    got = {}
    for r in t:
        got.update(r["state"])
    _assert_state(got, ref[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the CPU-only CI has none")
def test_cuda_round_trip(tmp_path):
    """CUDA parameters and optimizer state (0-dim Adam steps stay on the CPU) and the CUDA RNG come back."""
    plan = plan_of([(4, 1)])
    module = StageModule(SPEC, (0, 4), has_embedding=True, has_head=True, seed=INIT_SEED).cuda()
    opt = adamw(module.parameters())
    keys = LayerKeyMap.for_stage(plan.stages[0], local_numbering="global")
    for step in (1, 2):
        b = batch(step).cuda()
        lm_loss(module(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.manual_seed(11)
    save_checkpoint(tmp_path, plan=plan, state=StageState.from_module(module, keys, opt),
                    position=TrainingPosition(2, 8))
    expect = torch.rand(4, device="cuda")
    other = StageModule(SPEC, (0, 4), has_embedding=True, has_head=True, seed=5).cuda()
    opt2 = adamw(other.parameters())
    load_checkpoint(tmp_path, plan=plan, state=StageState.from_module(other, keys, opt2))
    assert torch.equal(torch.rand(4, device="cuda"), expect)
    for (k, a), (_, b) in zip(module.state_dict().items(), other.state_dict().items()):
        assert b.is_cuda and torch.equal(a, b), k
    for p, q in zip(module.parameters(), other.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][k].cpu(), v.cpu()) and opt2.state[q][k].device == v.device, k


@settings(max_examples=60, deadline=None)
@given(steps=st.sets(st.integers(0, 10**6), min_size=1, max_size=5), data=st.data())
def test_a_named_checkpoint_is_its_directory_at_its_step(steps, data):
    """For any checkpoint directory: ``DIR/step_N`` (with or without a trailing slash) is DIR at step N, DIR itself
    and a step directory without a manifest are directories, and a step other than N is refused naming both."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        for s in steps:
            os.makedirs(os.path.join(root, f"step_{s}"))
            if s % 3:  # the others: no manifest (not a checkpoint, whatever the name)
                open(os.path.join(root, f"step_{s}", store.MANIFEST), "w").close()
        step = data.draw(st.sampled_from(sorted(steps)))
        path = os.path.join(root, f"step_{step}") + data.draw(st.sampled_from(["", os.sep]))
        assert store.checkpoint_location(root, None) == (root, None)
        assert store.home_directory(root) == root
        if not step % 3:
            assert store.checkpoint_location(path, None) == (path, None) and store.home_directory(path) == path
            return
        assert store.checkpoint_location(path, None) == (root, step) == store.checkpoint_location(path, step)
        assert store.home_directory(path) == root
        with pytest.raises(SpecError, match=f"checkpoint of step {step}, not of step {step + 1}"):
            store.checkpoint_location(path, step + 1)
