"""Megatron-core adapter on CPU: translation checked by Megatron's own constructors, groups and layers checked on
real gloo ranks.

What runs here (no GPU): ``initialize_model_parallel`` on 4 gloo ranks for several plans (tp x pp, pp x dp with
uneven layer splits, pp=4 uneven, cp x pp, MoE with ep), every rank's tp/cp/dp/pp(/ep) groups read back from
``parallel_state`` against ``Plan.place``, and the real ``GPTModel`` (``use_cpu_initialization=True``) each stage
builds: which global layers, embedding/head, TP-sharded widths, local experts. The generated configs are fed to the
real ``TransformerConfig`` / ``DistributedDataParallelConfig`` / ``OptimizerConfig``. What needs a GPU: Megatron's
forward/backward and optimizer step (benchmarks/gpu_check_megatron.sh).

This file is also the multi-rank worker: ``python tests/test_adapter_megatron.py worker OUT_DIR`` (env RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), in the style of torch's test_run.py (each rank writes OUT_DIR/rank<R>.json).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

if __name__ == "__main__":  # worker mode: make the repository importable without pytest's rootdir handling
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch
from timeouts import PROCESS_GROUP_TIMEOUT, SUBPROCESS_TIMEOUT_S

from runtime_adapters import megatron_adapter as MA
from runtime_adapters.megatron_adapter import MegatronAdapter
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction, interleaved_chunks
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------- plan builder
def make_plan(model: str | dict = "tiny", splits=(2, 2), *, tp=1, dp=1, cp=1, ep=1, zero=0, recompute="none",
              mbs=1, global_batch=None, seq_len=32, dtype="bf16", tps=None, schedule="1F1B",
              virtual_stages=1) -> Plan:
    """A valid Plan: ``splits`` layers per stage, one node per stage with the stage's GPUs in rank order."""
    model_dict = load_model(model).to_dict() if isinstance(model, str) else dict(model)
    assert sum(splits) == model_dict["num_layers"]
    recomputes = recompute if isinstance(recompute, (list, tuple)) else [recompute] * len(splits)
    tps = tps or [tp] * len(splits)
    num_micro = 4
    global_batch = global_batch or mbs * dp * num_micro
    stages, start = [], 0
    chunks = interleaved_chunks(splits, virtual_stages) if virtual_stages > 1 else [()] * len(splits)
    for i, n in enumerate(splits):
        size = tps[i] * dp * cp
        stages.append(Stage(index=i, layers=(start, start + n), island=f"isl{i}",
                            gpus=tuple((f"node{i}", g) for g in range(size)), tp=tps[i], dp=dp, cp=cp, ep=ep,
                            zero_stage=zero, recompute=recomputes[i], micro_batch_size=mbs,
                            has_embedding=i == 0, has_head=i == len(splits) - 1, chunks=chunks[i]))
        start += n
    pred = Prediction(iteration_time_s=1.0, tokens_per_s=1.0, mfu=0.1,
                      stages=tuple(StagePrediction(0.1, 0.2, 1.0, 80.0) for _ in splits))
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype=dtype).to_dict()
    return Plan(model=model_dict, training=training, stages=tuple(stages), num_microbatches=num_micro,
                predicted=pred, runtime="megatron", schedule=schedule, virtual_stages=virtual_stages)


def six_layer_tiny(num_layers: int = 6) -> dict:
    d = load_model("tiny").to_dict()
    d.update(name=f"tiny-{num_layers}l", num_layers=num_layers)
    return d


# The plans the 4-rank worker runs; the parent builds the same ones to check the workers' reports against.
SCENARIOS = {
    "tp2_pp2_1+3": lambda: make_plan("tiny", (1, 3), tp=2, recompute=["selective", "full"]),
    "pp2_dp2_3+1_zero1": lambda: make_plan("tiny", (3, 1), dp=2, zero=1),
    "pp4_3+1+1+1": lambda: make_plan(six_layer_tiny(), (3, 1, 1, 1), dtype="fp32"),
    "cp2_pp2": lambda: make_plan("tiny", (2, 2), cp=2, seq_len=32),
    "moe_pp2_dp2_ep2": lambda: make_plan("tiny-moe", (1, 3), dp=2, ep=2),
    "pp2_dp2_interleaved_v2": lambda: make_plan(six_layer_tiny(8), (5, 3), dp=2, schedule="interleaved-1F1B",
                                                virtual_stages=2),
}


# ------------------------------------------------------------------------------------------- pure translation
@pytest.mark.slow  # imports megatron.core (3-4 s of CPU): the slow tier, keeping the unit tier under a minute
def test_interleaved_layout_lists_every_chunk_chunk_major():
    plan = make_plan(six_layer_tiny(8), (5, 3), schedule="interleaved-1F1B", virtual_stages=2)
    assert [s.chunks for s in plan.stages] == [((0, 3), (5, 7)), ((3, 5), (7, 8))]
    assert MA.pipeline_layout(plan) == "Ettt|tt|tt|tL"
    kw = MA.transformer_config_kwargs(plan, 0)
    assert kw["virtual_pipeline_model_parallel_size"] == 2
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(**{**kw, "pipeline_model_parallel_size": 2})  # Megatron accepts layout and vpp together
    assert not [p for p in MA.megatron_plan_problems(plan) if "schedule" in p]


def test_layout_strings_follow_the_plans_split():
    assert MA.pipeline_layout(make_plan("tiny", (3, 1))) == "Ettt|tL"
    assert MA.pipeline_layout(make_plan("tiny", (1, 3))) == "Et|tttL"
    assert MA.pipeline_layout(make_plan(six_layer_tiny(), (3, 1, 1, 1))) == "Ettt|t|t|tL"
    assert MA.pipeline_layout(make_plan("tiny", (4,))) is None


def test_recompute_and_zero_translate():
    plan = make_plan("tiny", (2, 2), recompute=["selective", "full"], dp=2, zero=1)
    s0 = MA.transformer_config_kwargs(plan, 0)
    s1 = MA.transformer_config_kwargs(plan, 1)
    assert (s0["recompute_granularity"], s0["recompute_method"], s0["recompute_num_layers"]) == ("selective", None,
                                                                                                  None)
    assert (s1["recompute_granularity"], s1["recompute_method"], s1["recompute_num_layers"]) == ("full", "uniform", 1)
    assert MA.ddp_config_kwargs(plan)["use_distributed_optimizer"] is True
    assert MA.optimizer_config_kwargs(plan, lr=1e-3)["use_distributed_optimizer"] is True
    plain = make_plan("tiny", (2, 2), dp=2, zero=0)
    assert MA.ddp_config_kwargs(plain)["use_distributed_optimizer"] is False
    assert MA.transformer_config_kwargs(plain, 0)["recompute_granularity"] is None


def test_parallel_batch_and_dtype_fields():
    plan = make_plan("tiny", (3, 1), tp=2, dp=2, mbs=2, seq_len=64)
    ps = MA.parallel_state_kwargs(plan, distributed_timeout_minutes=1)
    assert ps == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 1,
                  "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2, "order": "tp-cp-ep-dp-pp",
                  "distributed_timeout_minutes": 1, "create_gloo_process_groups": True}
    kw = MA.transformer_config_kwargs(plan, 1)
    assert kw["sequence_parallel"] is True and kw["tensor_model_parallel_size"] == 2
    assert kw["bf16"] is True and kw["fp16"] is False and kw["params_dtype"] is torch.bfloat16
    assert kw["pipeline_dtype"] is torch.bfloat16
    assert MA.transformer_config_kwargs(plan, 1, sequence_parallel=False)["sequence_parallel"] is False
    assert MA.schedule_kwargs(plan) == {"num_microbatches": 4, "micro_batch_size": 2, "seq_length": 64}
    # invariant the schedule relies on: mbs * dp * m == global batch
    assert 2 * 2 * 4 == plan.training["global_batch"]
    fp16 = MA.transformer_config_kwargs(make_plan("tiny", (4,), dtype="fp16"), 0)
    assert fp16["fp16"] is True and fp16["bf16"] is False and fp16["sequence_parallel"] is False
    with pytest.raises(SpecError, match="stage_index"):
        MA.transformer_config_kwargs(plan, 2)


def test_moe_fields_use_our_layer_pattern():
    plan = make_plan("tiny-moe", (2, 2), dp=2, ep=2)
    kw = MA.transformer_config_kwargs(plan, 0)
    # tiny-moe: MoE every 2nd layer, 0-based layers 1 and 3 (Megatron's int freq would pick 0 and 2)
    assert kw["moe_layer_freq"] == [0, 1, 0, 1]
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (4, 2, 128)
    assert kw["expert_model_parallel_size"] == 2
    assert kw["gated_linear_unit"] is True and kw["normalization"] == "RMSNorm"
    assert "num_moe_experts" not in MA.transformer_config_kwargs(make_plan("tiny", (2, 2)), 0)


def test_gpt_model_kwargs_pad_vocab_and_place_embedding():
    plan = make_plan("tiny", (1, 3), tp=2)
    first, last = MA.gpt_model_kwargs(plan, plan.place(0)), MA.gpt_model_kwargs(plan, plan.place(2))
    assert first["pre_process"] and not first["post_process"]
    assert last["post_process"] and not last["pre_process"]
    assert first["vocab_size"] == 256 and first["vocab_size"] % 2 == 0
    assert MA.padded_vocab_size(50257, 8) == 51200
    assert first["position_embedding_type"] == "learned_absolute"


def _megatron_config(kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**kwargs)


@pytest.mark.slow  # imports megatron.core (3-4 s of CPU): the slow tier, keeping the unit tier under a minute
@pytest.mark.parametrize("name, plan_fn, stage", [
    ("dense tp2 pp2 uneven, selective", lambda: make_plan("tiny", (3, 1), tp=2, recompute="selective"), 0),
    ("dense pp4 uneven, full recompute", lambda: make_plan(six_layer_tiny(), (3, 1, 1, 1), recompute="full"), 2),
    ("cp2 pp2", lambda: make_plan("tiny", (2, 2), cp=2), 1),
    ("moe ep2 dp2 pp2, full", lambda: make_plan("tiny-moe", (1, 3), dp=2, ep=2, recompute="full"), 1),
    ("moe single stage fp32", lambda: make_plan("tiny-moe", (4,), dp=2, ep=2, dtype="fp32"), 0),
    ("llama3-8b tp4 pp2, zero1", lambda: make_plan("llama3-8b", (17, 15), tp=4, dp=2, zero=1, seq_len=4096), 1),
    ("mixtral-8x7b-16l ep2", lambda: make_plan("mixtral-8x7b-16l", (9, 7), tp=2, dp=2, ep=2, seq_len=4096), 0),
])
def test_generated_config_validates_in_megatron(name, plan_fn, stage):
    """Megatron's own __post_init__ checks (layout vs num_layers, recompute combos, MoE, SP) accept our kwargs."""
    plan = plan_fn()
    assert MegatronAdapter().plan_problems(plan) == []
    kwargs = MA.transformer_config_kwargs(plan, stage)
    cfg = _megatron_config(kwargs)
    if plan.num_stages > 1:
        layout = cfg.pipeline_model_parallel_layout  # parsed by Megatron into its PipelineParallelLayerLayout
        for s in plan.stages:
            ids = layout.get_layer_id_list(pp_rank=s.index)
            assert ids == list(range(*s.layers)), (s.index, ids)
    assert cfg.recompute_granularity == kwargs["recompute_granularity"]
    assert cfg.context_parallel_size == plan.stages[0].cp
    assert cfg.expert_model_parallel_size == plan.stages[0].ep
    assert cfg.num_query_groups == kwargs["num_query_groups"]


@pytest.mark.slow  # imports megatron.core (3-4 s of CPU): the slow tier, keeping the unit tier under a minute
def test_ddp_and_optimizer_configs_validate_in_megatron():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    plan = make_plan("tiny", (2, 2), dp=2, zero=1)
    ddp = DistributedDataParallelConfig(**MA.ddp_config_kwargs(plan))
    opt = OptimizerConfig(**MA.optimizer_config_kwargs(plan, lr=3e-4))
    assert ddp.use_distributed_optimizer and opt.use_distributed_optimizer and opt.bf16
    assert opt.optimizer == "adam" and opt.lr == 3e-4


@pytest.mark.slow  # imports megatron.core (3-4 s of CPU), like the validations it is the reference for
def test_megatron_rejects_a_layout_that_does_not_cover_the_model():
    """The reference check works: Megatron refuses a layout whose layer count differs from num_layers."""
    kwargs = MA.transformer_config_kwargs(make_plan("tiny", (3, 1)), 0)
    kwargs["pipeline_model_parallel_layout"] = "Ettt|L"
    with pytest.raises(AssertionError, match="num_layers"):
        _megatron_config(kwargs)


# ----------------------------------------------------------------------------------------- refusal by capability
def test_different_tp_per_stage_is_refused_before_any_process_group():
    import torch.distributed as dist

    plan = make_plan("tiny", (2, 2), tps=[2, 1])
    with pytest.raises(InfeasibleError) as err:
        MegatronAdapter().initialize(plan, plan.place(0))
    assert any("one (tp, dp, cp) grid" in r for r in err.value.reasons)
    assert not dist.is_initialized()


@pytest.mark.parametrize("plan_fn, reason", [
    (lambda: make_plan("tiny", (2, 2), dp=2, zero=2), "ZeRO stage <= 1"),
    (lambda: make_plan("tiny", (2, 2), schedule="gpipe"), "1F1B"),
    (lambda: make_plan("tiny", (2, 2), dp=2, ep=2), "needs an MoE model"),
    (lambda: make_plan("tiny", (2, 2), tp=8), "must divide num_heads"),
    (lambda: make_plan("opt-350m", (12, 12)), "projected embedding"),
])
def test_plans_megatron_cannot_run_are_refused(plan_fn, reason):
    plan = plan_fn()
    with pytest.raises(InfeasibleError) as err:
        MegatronAdapter().check_plan(plan)
    assert any(reason in r for r in err.value.reasons), err.value.reasons


def test_environment_problems_without_transformer_engine():
    """Measured on an H200 with megatron-core 0.16.1 and no Transformer Engine: an MoE forward raises NameError
    (te_general_gemm); CP has no local attention. The adapter names both instead of failing inside Megatron."""
    adapter = MegatronAdapter()
    assert adapter.environment_problems(make_plan("tiny", (2, 2), dp=2)) == []
    moe = adapter.environment_problems(make_plan("tiny-moe", (2, 2), dp=2, ep=2))
    if adapter.transformer_engine_available():  # with TE both run: nothing to refuse
        assert moe == [] and adapter.environment_problems(make_plan("tiny", (2, 2), cp=2)) == []
        return
    assert len(moe) == 1 and "need Transformer Engine" in moe[0]
    cp = adapter.environment_problems(make_plan("tiny", (2, 2), cp=2))
    assert len(cp) == 1 and cp[0].startswith("cp=2")
    with pytest.raises(InfeasibleError, match="on this machine"):
        adapter.check_environment(make_plan("tiny-moe", (4,)))


def test_registry_finds_the_adapter():
    from runtime_adapters.registry import get_adapter

    adapter = get_adapter("megatron")
    assert isinstance(adapter, MegatronAdapter) and adapter.capabilities.name == "megatron"


def test_expert_group_formula():
    plan = make_plan("tiny-moe", (2, 2), tp=2, dp=2, ep=2)  # 4 ranks per stage: tp fastest, then dp
    assert MA.expert_group(plan, 0) == (0, 2) and MA.expert_group(plan, 3) == (1, 3)
    assert MA.expert_group(plan, 5) == (5, 7)


# ---------------------------------------------------------------------------------------------- real gloo ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(out_dir: str) -> None:
    """One rank: for each scenario initialise Megatron from the plan, read back groups, build this stage's model."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    adapter = MegatronAdapter()
    report = {}
    try:
        for name, plan_fn in SCENARIOS.items():
            plan = plan_fn()
            place = plan.place(rank)
            groups = adapter.initialize(plan, place, timeout=PROCESS_GROUP_TIMEOUT)
            entry = {"tp": list(groups.tp), "cp": list(groups.cp), "dp": list(groups.dp), "pp": list(groups.pp),
                     "ep": list(groups.ep), "coords": dict(groups.coords)}
            overrides = {"use_cpu_initialization": True}
            if plan.model["num_experts"]:
                # the all-to-all dispatcher makes a torch.cuda.Stream when built; all-gather builds on CPU
                overrides["moe_token_dispatcher_type"] = "allgather"
            try:
                model = adapter.build_gpt_model(plan, place, **overrides)
            except InfeasibleError as exc:
                entry["build_error"] = str(exc)
            else:
                chunks = model if isinstance(model, list) else [model]  # interleaved 1F1B: one model per chunk
                entry["chunks"] = len(chunks)
                entry["layers"] = [i for c in chunks for i in MA.held_layers(c)]
                entry["has_embedding"] = hasattr(chunks[0], "embedding")
                entry["has_output_layer"] = hasattr(chunks[-1], "output_layer")
                entry["vpp"] = chunks[0].config.virtual_pipeline_model_parallel_size
                model = chunks[0]
                entry["recompute"] = model.config.recompute_granularity
                entry["sequence_parallel"] = model.config.sequence_parallel
                entry["param_dtype"] = str(next(model.parameters()).dtype)
                layer0 = model.decoder.layers[0]
                mlp = layer0.mlp
                entry["local_experts"] = [getattr(layer.mlp, "num_local_experts", 0) for layer in model.decoder.layers]
                if hasattr(mlp, "linear_fc1"):
                    entry["fc1_rows"] = int(mlp.linear_fc1.weight.shape[0])
                entry["qkv_rows"] = int(layer0.self_attention.linear_qkv.weight.shape[0])
            report[name] = entry
            dist.barrier()
            adapter.destroy()
    finally:
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_reports(tmp_path_factory):
    """Run the 4-rank worker once; every scenario's per-rank report."""
    out = tmp_path_factory.mktemp("megatron_ranks")
    world = 4
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=SUBPROCESS_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("megatron gloo workers timed out")
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- rank {r} failed:\n{outputs[r][-2000:]}" for r in failed)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_megatron_groups_equal_the_plans(gloo_reports, name):
    """Plan rank r is Megatron rank r: tp/cp/dp/pp groups and coordinates match Plan.place on every rank."""
    plan = SCENARIOS[name]()
    for rank in range(plan.world_size):
        got, place = gloo_reports[rank][name], plan.place(rank)
        assert got["tp"] == list(place.tp_group), (rank, got)
        assert got["cp"] == list(place.cp_group), (rank, got)
        assert got["dp"] == list(place.dp_group), (rank, got)
        assert got["pp"] == list(place.pp_group), (rank, got)
        assert got["coords"] == dict(place.coords), (rank, got)
        assert got["ep"] == list(MA.expert_group(plan, rank)), (rank, got)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.startswith("cp")])
def test_each_stage_builds_its_layers(gloo_reports, name):
    """The GPTModel each rank builds holds exactly its stage's global layers, embedding first, head last."""
    plan = SCENARIOS[name]()
    model = load_model(plan.model["name"]) if plan.model["name"] not in ("tiny-6l", "tiny-8l") else None
    for rank in range(plan.world_size):
        got, place = gloo_reports[rank][name], plan.place(rank)
        held = place.stage.chunks or (place.layers,)  # interleaved: the stage's model chunks, in order
        assert got["layers"] == [i for a, b in held for i in range(a, b)], (rank, got["layers"], held)
        assert got["chunks"] == plan.virtual_stages
        assert got["vpp"] == (plan.virtual_stages if plan.virtual_stages > 1 else None)
        assert got["has_embedding"] == place.is_first_stage
        assert got["has_output_layer"] == place.is_last_stage
        assert got["recompute"] == MA.recompute_kwargs(place.stage.recompute)["recompute_granularity"]
        # sequence parallelism (tp > 1) is off without Transformer Engine/Apex norms: the torch-norm fallback asserts
        tp = place.stage.tp
        fused_norms = MegatronAdapter.transformer_engine_available() or MA._apex_available()
        assert got["sequence_parallel"] is (tp > 1 and fused_norms)
        heads, kv, hd = plan.model["num_heads"], plan.model["num_kv_heads"], plan.model["head_dim"]
        assert got["qkv_rows"] == (heads + 2 * kv) * hd // tp  # column-parallel QKV: sharded over tp
        if model is not None and model.is_moe:
            per_rank = model.num_experts // place.stage.ep
            assert got["local_experts"] == [per_rank if model.is_moe_layer(i) else 0 for i in range(*place.layers)]
        elif "fc1_rows" in got:
            assert got["fc1_rows"] == plan.model["ffn_hidden_size"] // tp
    assert gloo_reports[0][name]["param_dtype"] == ("torch.float32" if plan.training["dtype"] == "fp32"
                                                    else "torch.bfloat16")


@pytest.mark.distributed
def test_context_parallel_needs_transformer_engine(gloo_reports):
    """cp>1: groups are built (above), but the local spec has no CP attention; the adapter says so plainly."""
    for rank in range(4):
        got = gloo_reports[rank]["cp2_pp2"]
        if MegatronAdapter.transformer_engine_available():
            assert "layers" in got
        else:
            assert "Transformer Engine" in got["build_error"]


# --------------------------------------------------------------------------------------------------- the example
@pytest.mark.distributed
def test_example_on_cpu_fails_with_a_clear_message(tmp_path):
    plan = make_plan("tiny", (4,))
    path = tmp_path / "plan.json"
    plan.dump(path)
    env = dict(os.environ, TANGRAM_PLAN_FILE=str(path), RANK="0", WORLD_SIZE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TANGRAM_PLAN_HASH", None)
    res = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_gpt_megatron.py"), "--plan",
                          str(path)], env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode != 0
    assert "needs CUDA" in res.stderr and "Traceback" not in res.stderr, res.stderr


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: test_adapter_megatron.py worker OUT_DIR")


def test_dropout_follows_the_model_spec():
    """Megatron's TransformerConfig drops out at 0.1 for every model; the adapter passes the spec's dropout, so a
    Llama-style model trains without it, as the spec (and the planner, which prices no masks) says."""
    gpt = MA.transformer_config_kwargs(make_plan("tiny", (2, 2)), 0)  # learned positions: GPT-2's dropout
    assert (gpt["hidden_dropout"], gpt["attention_dropout"]) == (0.1, 0.1)
    llama = MA.transformer_config_kwargs(make_plan("llama3-8b", (17, 15), tp=4, dp=2, seq_len=4096), 1)
    assert (llama["hidden_dropout"], llama["attention_dropout"]) == (0.0, 0.0)
    spec = load_model("tiny").to_dict()
    off = MA.transformer_config_kwargs(make_plan({**spec, "dropout": False}, (4,)), 0)
    assert (off["hidden_dropout"], off["attention_dropout"]) == (0.0, 0.0)


@pytest.mark.slow  # imports megatron.core
def test_megatron_builds_the_specs_dropout():
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = MA.transformer_config_kwargs(make_plan("tiny-moe", (2, 2)), 0)
    default = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert default.hidden_dropout == default.attention_dropout == 0.1  # what ran before the adapter set them
    config = TransformerConfig(**{**kw, "pipeline_model_parallel_size": 2})
    assert config.hidden_dropout == config.attention_dropout == 0.0  # tiny-moe: rotary, no dropout
