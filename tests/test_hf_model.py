"""Hugging Face models and a user's layered model under a plan (torch runtime), against the unsplit model.

Tiny configs are built here (HF_HUB_OFFLINE=1: nothing is downloaded). The multi-rank test starts its 2 gloo
processes once and trains every case one after the other: a tiny Llama as 2 stages (recompute full / selective),
as 1 stage x dp 2 (all-reduce, and FSDP2 ZeRO-3), as 1 stage x tp 2 (DTensor on the HF module names) and as 2
stages in bf16; a tiny OPT as 2 stages and as dp 2; and a user model through ``LayeredSource`` as 2 stages. Each case's losses and every
updated parameter must equal ``AutoModelForCausalLM`` (HF's own forward, eager attention) trained in this process
on the same batches from the same weights. The end-to-end test trains with ``examples/train_hf.py`` through
``tangram-launch``, exports with ``tangram-launch export --to hf``, loads with ``from_pretrained`` and resumes
under another layout.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from helpers_plans import make_plan  # noqa: E402
from timeouts import PROCESS_GROUP_TIMEOUT, PROCESS_GROUP_TIMEOUT_S, SUBPROCESS_TIMEOUT_S  # noqa: E402
from runtime_adapters.gpt import lm_loss  # noqa: E402
from runtime_adapters.hf_model import (FAMILIES, HFSource, config_from_dict, family_of, global_name,  # noqa: E402
                                       to_hf_state_dict)
from runtime_adapters.model_source import LayeredSource  # noqa: E402
from runtime_adapters.torch_native import TorchAdapter  # noqa: E402
from tangram_launch.checkpoint import store  # noqa: E402
from tangram_launch.errors import InfeasibleError, SpecError  # noqa: E402
from tangram_launch.plan import Plan, Stage  # noqa: E402
from tangram_launch.specs.model import load_model  # noqa: E402

SEED = 7
STEPS = 2
REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama"


def _llama(**kw) -> dict:
    return {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
            "max_position_embeddings": 64, "tie_word_embeddings": False, **kw}


def _opt(**kw) -> dict:
    return {"model_type": "opt", "vocab_size": 128, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": 64, "word_embed_proj_dim": 16, "dropout": 0.0,
            "tie_word_embeddings": False, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, **kw}


def _gpt2(**kw) -> dict:
    return {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 0, **kw}


def _source(cfg: dict) -> HFSource:
    config = config_from_dict(cfg)
    config._attn_implementation = "eager"
    return HFSource(config)


def _sgd(params):
    """SGD, not Adam: Adam turns fp-level noise in a near-zero gradient into an O(lr) update (test_adapter_torch)."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _whole_stage(num_layers: int) -> Stage:
    return Stage(index=0, layers=(0, num_layers), island="i", gpus=(("n0", 0),), tp=1, dp=1, ep=1, zero_stage=0,
                 recompute="none", micro_batch_size=1, has_embedding=True, has_head=True)


# --- a user's own layered model (the README recipe) ----------------------------------------------------------------

class TokenMixer(nn.Module):
    """A user block: causal mean over the past tokens, then an MLP; (B, T, H) -> (B, T, H)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal_mean = torch.cumsum(x, dim=1) / torch.arange(1, t + 1, device=x.device)[None, :, None]
        return x + self.down(torch.relu(self.up(self.norm(causal_mean))))


def _user_source(spec: dict) -> LayeredSource:
    h, v = spec["hidden_size"], spec["vocab_size"]
    return LayeredSource(embedding=lambda: nn.Embedding(v, h), layer=lambda i: TokenMixer(h),
                         head=lambda: nn.Sequential(nn.LayerNorm(h), nn.Linear(h, v)),
                         num_layers=spec["num_layers"], tp_plan=lambda i: {"up": "colwise", "down": "rowwise"})


def _cases() -> dict[str, tuple[str, dict, Plan]]:
    """name -> (source kind, config, plan)."""
    llama, opt = _source(_llama()).model_spec(), _source(_opt()).model_spec()
    tiny = load_model("tiny")
    kw = {"global_batch": 4, "num_microbatches": 2, "seq_len": 16}
    return {
        "llama-pp2": ("hf", _llama(), make_plan(llama, [{"layers": 3, "gpus": "n0", "recompute": "full"},
                                                        {"layers": 1, "gpus": "n0", "recompute": "selective"}],
                                                **kw)),
        "llama-dp2": ("hf", _llama(), make_plan(llama, [(4, "n0", 1, 2)], **kw)),
        "llama-dp2-zero3": ("hf", _llama(), make_plan(llama, [(4, "n0", 1, 2, 3)], **kw)),
        "llama-tp2": ("hf", _llama(), make_plan(llama, [(4, "n0", 2, 1)], **kw)),
        "opt-pp2": ("hf", _opt(), make_plan(opt, [(1, "n0"), (3, "n0")], **kw)),
        "opt-dp2": ("hf", _opt(), make_plan(opt, [(4, "n0", 1, 2)], **kw)),
        "llama-pp2-bf16": ("hf", _llama(), make_plan(llama, [(2, "n0"), (2, "n0")], dtype="bf16", **kw)),
        "user-pp2": ("user", tiny.to_dict(), make_plan(tiny, [{"layers": 2, "gpus": "n0", "recompute": "full"},
                                                              (2, "n0")], **kw)),
    }


def _build_source(kind: str, cfg: dict):
    return _source(cfg) if kind == "hf" else _user_source(cfg)


def _batches(plan: Plan) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    gb, seq = plan.training["global_batch"], plan.training["seq_len"]
    return [torch.randint(0, plan.model["vocab_size"], (gb, seq + 1), generator=g) for _ in range(STEPS)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    for name, kind, cfg, plan_dict in cases:
        plan = Plan.from_dict(plan_dict)
        ctx = TorchAdapter().setup(plan, plan.place(rank), seed=SEED, timeout_s=PROCESS_GROUP_TIMEOUT_S,
                                   optimizer_factory=_sgd, model_source=_build_source(kind, cfg))
        losses = [ctx.train_step(b) for b in _batches(plan)]
        state = ctx.global_state_dict()
        if ctx.place.coords["dp"] == 0 and ctx.place.coords["tp"] == 0:
            torch.save({"losses": losses, "state": state}, os.path.join(out_dir, f"{name}-{ctx.place.stage.index}.pt"))
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def _reference(kind: str, cfg: dict, plan: Plan):
    """The unsplit model in this process: for HF, AutoModelForCausalLM loaded with the seeded whole-model weights."""
    source = _build_source(kind, cfg)
    whole = source.build_stage(None, _whole_stage(plan.model["num_layers"]), SEED)
    if kind == "hf":
        model = transformers.AutoModelForCausalLM.from_config(source.config)
        result = model.load_state_dict(to_hf_state_dict(dict(whole.named_parameters()), source.config), strict=False)
        assert not result.missing_keys and not result.unexpected_keys
        forward = lambda tokens: model(input_ids=tokens).logits  # noqa: E731  HF's own forward
    else:
        model, forward = whole, whole
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = _sgd(list(model.parameters()))
    losses = []
    bf16 = plan.training["dtype"] == "bf16"
    for b in _batches(plan):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as the stages run a bf16 plan
            logits = forward(b[:, :-1])
        loss = lm_loss(logits, b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    if kind == "hf":
        layout = family_of(source.config)
        state = {global_name(k, layout): v for k, v in state.items()}
        init = {global_name(k, layout): v for k, v in init.items()}
    return losses, state, init


@pytest.mark.distributed
def test_hf_and_user_models_in_every_layout_match_the_unsplit_model(tmp_path):
    cases = _cases()
    mp.start_processes(_worker, args=(2, _free_port(), [(n, k, c, p.to_dict()) for n, (k, c, p) in cases.items()],
                                      str(tmp_path)), nprocs=2, start_method="fork", join=True)
    for name, (kind, cfg, plan) in cases.items():
        ref_losses, ref_state, init = _reference(kind, cfg, plan)
        tol = 2e-5 if plan.training["dtype"] == "fp32" else 2e-3  # autocast: same ops, bf16 rounding
        got: dict[str, torch.Tensor] = {}
        for s in range(plan.num_stages):
            rec = torch.load(tmp_path / f"{name}-{s}.pt")
            assert rec["losses"] == pytest.approx(ref_losses, abs=tol), name
            got.update(rec["state"])
        assert set(got) == set(ref_state), name
        for key, ref in ref_state.items():
            torch.testing.assert_close(got[key], ref, atol=tol, rtol=5 * tol, msg=lambda m: f"{name} {key}: {m}")
        assert max((ref_state[k] - init[k]).abs().max().item() for k in ref_state) > 1e-2, name  # it trained


# --- in one process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [_llama(), _llama(model_type="qwen2"), _llama(model_type="qwen3", head_dim=8), _opt(),
                                 _llama(model_type="mistral", sliding_window=4), _gpt2()],
                         ids=["llama", "qwen2", "qwen3", "opt", "mistral-sliding", "gpt2"])
def test_stages_compose_to_the_hf_model(cfg):
    source = _source(cfg)
    n = 4
    stages = [Stage(index=i, layers=r, island="i", gpus=(("n0", i),), tp=1, dp=1, ep=1, zero_stage=0,
                    recompute="none", micro_batch_size=1, has_embedding=r[0] == 0, has_head=r[1] == n)
              for i, r in enumerate([(0, 1), (1, 3), (3, 4)])]
    parts = [source.build_stage(None, s, SEED) for s in stages]
    whole = source.build_stage(None, _whole_stage(n), SEED)
    model = transformers.AutoModelForCausalLM.from_config(source.config)
    model.load_state_dict(to_hf_state_dict(dict(whole.named_parameters()), source.config))
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    x = tokens
    with torch.no_grad():
        for p in parts:
            x = p(x)
        ref = model(input_ids=tokens).logits
    torch.testing.assert_close(x, ref, atol=0, rtol=0)
    assert {k for p in parts for k, _ in p.named_parameters()} == {k for k, _ in whole.named_parameters()}


def test_selective_and_full_recompute_give_the_same_gradients():
    source = _source(_llama())
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode in ("none", "selective", "full"):
        m = source.build_stage(None, _whole_stage(4), SEED)
        m.set_recompute(mode)
        lm_loss(m(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads[mode] = {k: p.grad for k, p in m.named_parameters()}
    for mode in ("selective", "full"):
        for k, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][k], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{mode} {k}: {m}")


def test_unsupported_architecture_is_refused_with_the_supported_list():
    config = transformers.AutoConfig.for_model("bert")
    with pytest.raises(SpecError) as err:
        HFSource(config)
    assert err.value.field == "config.model_type" and err.value.value == "bert"
    for family in FAMILIES:
        assert family in str(err.value)


def test_plan_problems_name_what_the_hf_source_cannot_build():
    llama = _source(_llama())
    spec = llama.model_spec()
    assert TorchAdapter().plan_problems(make_plan(spec, [(2, "n0"), (2, "n0")], global_batch=4,
                                                  num_microbatches=2), model_source=llama) == []
    other = make_plan(_source(_llama(hidden_size=64)).model_spec(), [(4, "n0")], global_batch=4, num_microbatches=2)
    assert any("hidden_size is 64 in the plan but 32" in p
               for p in TorchAdapter().plan_problems(other, model_source=llama))
    gpt2 = _source(_gpt2())
    problems = TorchAdapter().plan_problems(make_plan(gpt2.model_spec(), [(4, "n0", 2, 1)], global_batch=4,
                                                      num_microbatches=2), model_source=gpt2)
    assert any("tp=2, but gpt2 has no tensor-parallel plan: its q/k/v projection is one fused Conv1D" in p
               for p in problems)
    opt = _source(_opt())
    problems = TorchAdapter().plan_problems(make_plan(opt.model_spec(), [(4, "n0", 2, 1)], global_batch=4,
                                                      num_microbatches=2), model_source=opt)
    assert any("tp=2, but opt has no tensor-parallel plan: its attention reshapes" in p for p in problems)
    tied = _source(_llama(tie_word_embeddings=True))
    problems = TorchAdapter().plan_problems(make_plan(tied.model_spec(), [(2, "n0"), (2, "n0")], global_batch=4,
                                                      num_microbatches=2), model_source=tied)
    assert any("tied embeddings" in p for p in problems)
    with pytest.raises(InfeasibleError, match="tied embeddings"):  # refused before any process group exists
        TorchAdapter().setup(make_plan(tied.model_spec(), [(2, "n0"), (2, "n0")], global_batch=4,
                                       num_microbatches=2), model_source=tied)
    assert not dist.is_initialized()


def test_a_layered_source_refuses_what_a_generic_layer_cannot_do():
    tiny = load_model("tiny")
    source = _user_source(tiny.to_dict())
    plan = make_plan(tiny, [{"layers": 2, "gpus": "n0", "recompute": "selective"}, (2, "n0")], global_batch=4,
                     num_microbatches=2)
    assert TorchAdapter().plan_problems(plan, model_source=source) == [
        "stage 0: recompute 'selective' (a LayeredSource recomputes whole layers: none, full)"]
    short = LayeredSource(embedding=nn.Identity, layer=lambda i: nn.Identity(), head=nn.Identity, num_layers=3)
    problems = TorchAdapter().plan_problems(make_plan(tiny, [(4, "n0", 2, 1)], global_batch=4, num_microbatches=2),
                                            model_source=short)
    assert problems == ["model: the plan's model has 4 layers, the LayeredSource 3",
                        "stage 0: tp=2 needs LayeredSource(tp_plan=...)"]
    with pytest.raises(SpecError, match="num_layers"):
        LayeredSource(embedding=nn.Identity, layer=lambda i: nn.Identity(), head=nn.Identity, num_layers=0)


def test_a_local_pretrained_folder_gives_the_starting_weights(tmp_path):
    config = config_from_dict(_opt())
    torch.manual_seed(0)
    pretrained = transformers.AutoModelForCausalLM.from_config(config)
    pretrained.save_pretrained(tmp_path / "m")
    source = HFSource.from_pretrained(tmp_path / "m")
    assert source.weights == str(tmp_path / "m")
    stage = Stage(index=1, layers=(2, 4), island="i", gpus=(("n0", 1),), tp=1, dp=1, ep=1, zero_stage=0,
                  recompute="none", micro_batch_size=1, has_embedding=False, has_head=True)
    part = source.build_stage(None, stage, SEED)
    ref = dict(pretrained.named_parameters())
    layout = family_of(config)
    names = [k for k, _ in part.named_parameters()]
    assert names and all(k.startswith(("layers.2.", "layers.3.", "head.")) for k in names)
    for key, p in part.named_parameters():
        torch.testing.assert_close(p, ref[f"{_hf(key, layout)}"], atol=0, rtol=0)


def _hf(key, layout):
    from runtime_adapters.hf_model import hf_name

    return hf_name(key, layout)


# --- end to end: train_hf.py, export, from_pretrained, resume ---------------------------------------------------

def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    return env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


@pytest.mark.distributed
def test_train_export_from_pretrained_and_resume_under_another_layout(tmp_path):
    spec = load_model(str(TINY_LLAMA))
    plans = {}
    for name, stages in (("A", [(3, "local"), (1, "local")]), ("B", [(1, "local"), (2, "local"), (1, "local")])):
        plans[name] = str(tmp_path / f"{name}.json")
        make_plan(spec, stages, global_batch=8, num_microbatches=4, seq_len=32).dump(plans[name])
    example, ckpt = str(REPO / "examples" / "train_hf.py"), tmp_path / "ckpt"
    common = ("--hf-model", str(TINY_LLAMA), "--steps", "4")
    a = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plans["A"], example, *common,
             "--save-dir", str(ckpt), "--save-every", "2", "--out", "a.json")
    assert a.returncode == 0, a.stderr[-3000:]
    ra = json.loads((tmp_path / "a.json").read_text())

    # export step 2 (written by 2 stages) and load it with transformers: its loss on step 3's batch is step 3's loss
    e = _cli(tmp_path, "export", str(ckpt), "--to", "hf", str(tmp_path / "hf"), "--step", "2")
    assert e.returncode == 0, e.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from train_gpt import TokenBatches
    finally:
        sys.path.remove(str(REPO / "examples"))
    data = TokenBatches(str(REPO / "examples" / "data" / "corpus.txt"), global_batch=8, seq_len=32,
                        vocab_size=256, seed=1234)
    batch = data.batch(16)  # step 3 takes samples 16..23
    with torch.no_grad():
        loss = lm_loss(model(input_ids=batch[:, :-1]).logits, batch[:, 1:]).item()
    assert loss == pytest.approx(ra["losses"][2], rel=1e-5, abs=1e-6)

    # resume under 3 stages from step 2 (step 4's save torn): steps 3-4 continue the uninterrupted run
    os.remove(ckpt / "step_4" / store.MANIFEST)
    b = _cli(tmp_path, "--standalone", "--nproc-per-node", "3", "--plan", plans["B"], "--resume", str(ckpt),
             example, *common, "--out", "b.json")
    assert b.returncode == 0, b.stderr[-3000:]
    rb = json.loads((tmp_path / "b.json").read_text())
    assert rb["steps"] == [3, 4] and rb["resumed"]["layout_changed"]
    assert rb["losses"] == pytest.approx(ra["losses"][2:], rel=1e-5, abs=1e-6)


def test_export_refuses_a_config_that_is_not_the_checkpoints_model(tmp_path, capsys):
    from tangram_launch.checkpoint import LayerKeyMap, StageState, TrainingPosition, save_checkpoint
    from tangram_launch.cli import main

    source = HFSource.from_pretrained(TINY_LLAMA)
    plan = make_plan(source.model_spec(), [(4, "n0")], global_batch=2, num_microbatches=1, seq_len=8)
    module = source.build_stage(None, plan.stages[0], SEED)
    state = StageState.from_module(module, LayerKeyMap.for_stage(plan.stages[0], local_numbering="global"))
    save_checkpoint(tmp_path / "ckpt", plan=plan, state=state, position=TrainingPosition(1, 2))  # no HF config
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out")]) == 2
    assert "carries no Hugging Face config" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(_llama()))
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"),
                 "--config", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "does not describe the checkpoint's model" in err and "hidden_size: 32 in the config, 64 in the checkpoint" in err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"),
                 "--config", str(TINY_LLAMA)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for key, p in module.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[_hf(key, source.layout)], p, atol=0, rtol=0)
