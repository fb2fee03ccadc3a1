"""ModelSpec: parameter counts against published figures, FLOPs against the literature, loading, and bad input."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tangram_launch.errors import SpecError
from tangram_launch.specs.model import (
    ModelSpec,
    field_names,
    from_hf_config,
    load_model,
    preset_names,
)
from tangram_launch.specs.yamlio import dump_yaml_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "models"


# ---------------------------------------------------------------------------------------------- published totals
# (preset, published total, published active or None, relative tolerance, source of the figure)
PUBLISHED = [
    # Llama 3 model cards / HF safetensors metadata: 8,030,261,248 parameters ("8.03B").
    ("llama3-8b", 8.03e9, None, 0.01, "meta-llama/Meta-Llama-3-8B model card (8.03B)"),
    # HF safetensors metadata of meta-llama/Meta-Llama-3-70B: 70.6B.
    ("llama3-70b", 70.6e9, None, 0.01, "meta-llama/Meta-Llama-3-70B (70.6B)"),
    # Llama 3.1 405B: HF safetensors metadata 405.9B (Grattafiori et al. 2024 call it 405B).
    ("llama3-405b", 405.9e9, None, 0.01, "meta-llama/Llama-3.1-405B (405.9B)"),
    # Jiang et al. 2024, "Mixtral of Experts", sec. 2: 47B total, 13B active; Mistral AI's release: 46.7B / 12.9B.
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01, "Mixtral of Experts / Mistral AI announcement (46.7B, 12.9B active)"),
    # Qwen3 Technical Report (2025), Table 2 / Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated.
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02, "Qwen3-30B-A3B model card (30.5B, 3.3B activated)"),
    # Brown et al. 2020, Table 2.1: 13.0B (with d_model 5140 and vocab 50257; ours uses 5120 / 51200).
    ("gpt3-13b", 13.0e9, None, 0.02, "GPT-3 paper Table 2.1 (13.0B)"),
    # Brown et al. 2020, Table 2.1: GPT-3 XL 1.3B.
    ("gpt3-1.3b", 1.3e9, None, 0.02, "GPT-3 paper Table 2.1 (1.3B)"),
    # Zhang et al. 2022 / facebook/opt-350m: 331M parameters (HF safetensors metadata 331,196,416).
    ("opt-350m", 331e6, None, 0.01, "facebook/opt-350m (331M)"),
    # Alpa benchmark suite names the GShard MoE models by size (Zheng et al. 2022; Tangram paper Fig. 9).
    ("gshard-moe-2.4b", 2.4e9, None, 0.02, "Alpa moe_specs '2.4B'"),
    ("gshard-moe-7.1b", 7.1e9, None, 0.02, "Alpa moe_specs '7.1B'"),
    ("gshard-moe-10b", 10.0e9, None, 0.03, "Alpa moe_specs '10B'"),
]


@pytest.mark.parametrize("name,total,active,rel,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_parameter_totals_match_published(name, total, active, rel, source):
    spec = load_model(name)
    assert spec.total_params() == pytest.approx(total, rel=rel), source
    if active is not None:
        assert spec.active_params() == pytest.approx(active, rel=rel), source
    else:
        assert spec.active_params() == spec.total_params() or spec.is_moe


def test_exact_counts_of_known_checkpoints():
    # Exact tensor sums of the released checkpoints (HF safetensors metadata): a miscount of a single norm shows.
    assert load_model("llama3-8b").total_params() == 8_030_261_248
    assert load_model("opt-350m").total_params() == 331_196_416
    assert load_model("mixtral-8x7b").total_params() == 46_702_792_704


def test_trimmed_models_have_half_the_layers():
    for full, trimmed in (("mixtral-8x7b", "mixtral-8x7b-16l"), ("qwen3-30b-a3b", "qwen3-30b-a3b-24l")):
        a, b = load_model(full), load_model(trimmed)
        assert b.num_layers * 2 == a.num_layers
        assert dataclasses.replace(a, name=b.name, num_layers=b.num_layers, citation=b.citation) == b
        per_layer = a.layer_params(0)
        assert a.total_params() - b.total_params() == per_layer * b.num_layers


def test_required_presets_present_and_names_unambiguous():
    names = preset_names()
    for required in ("gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "llama3-8b", "llama3-70b", "llama3-405b",
                     "mixtral-8x7b", "mixtral-8x7b-16l", "qwen3-30b-a3b", "qwen3-30b-a3b-24l", "gshard-moe-2.4b",
                     "gshard-moe-7.1b", "gshard-moe-10b", "opt-350m", "tiny", "tiny-moe"):
        assert required in names
    for name in names:
        spec = load_model(name)
        assert spec.name == name
        assert spec.citation, f"preset {name} has no citation"
    # gpt3-1.3b and gpt3-13b must stay apart under normalisation.
    assert load_model("GPT3_1.3B").num_layers == 24 and load_model("gpt3-13b").num_layers == 40


def test_paper_scenario_shapes():
    g = load_model("gpt3-13b")
    assert (g.num_layers, g.hidden_size, g.num_heads, g.vocab_size, g.max_seq_len) == (40, 5120, 40, 51200, 2048)
    q = load_model("qwen3-30b-a3b")
    assert (q.num_experts, q.top_k, q.expert_ffn_hidden_size, q.head_dim, q.num_kv_heads) == (128, 8, 768, 128, 4)
    for name, hidden, experts in (("gshard-moe-2.4b", 1024, 16), ("gshard-moe-7.1b", 1280, 32),
                                  ("gshard-moe-10b", 1536, 32)):
        m = load_model(name)
        assert (m.num_layers, m.hidden_size, m.num_experts, m.top_k, m.moe_layer_frequency) == (16, hidden, experts,
                                                                                                 2, 2)
        assert [m.layer_kind(i) for i in range(4)] == ["dense", "moe", "dense", "moe"]
        assert m.num_moe_layers == 8


def test_tiny_presets_are_small():
    tiny, tiny_moe = load_model("tiny"), load_model("tiny-moe")
    assert tiny.total_params() < 500_000 and tiny.max_seq_len <= 128 and not tiny.is_moe
    assert tiny_moe.is_moe and tiny_moe.total_params() < 1_000_000
    assert {tiny_moe.layer_kind(i) for i in range(tiny_moe.num_layers)} == {"dense", "moe"}
    assert tiny_moe.active_params() < tiny_moe.total_params()


# ---------------------------------------------------------------------------------------------- per-layer counts
def test_layer_counts_by_hand_llama3_8b():
    m = load_model("llama3-8b")
    h, kv, f = 4096, 8 * 128, 14336
    attention = h * h + 2 * h * kv + h * h
    assert m.layer_params(0) == attention + 3 * h * f + 2 * h        # 2 RMSNorms, weight only
    assert m.embedding_params() == 128256 * h
    assert m.head_params() == 128256 * h + h                           # untied output + final norm
    assert m.layer_active_params(5) == m.layer_params(5)


def test_moe_layer_counts_by_hand_mixtral():
    m = load_model("mixtral-8x7b")
    h, f = 4096, 14336
    common = 2 * h * h + 2 * h * 1024 + 2 * h
    assert m.layer_params(3) == common + 8 * 3 * h * f + h * 8      # 8 experts + router (no bias)
    assert m.layer_active_params(3) == common + 2 * 3 * h * f + h * 8
    assert m.layer_kind(3) == "moe"


def test_opt_projected_embedding():
    m = load_model("opt-350m")
    assert m.embedding_dim == 512 and m.hidden_size == 1024
    # tokens 50272 x 512, positions 2050 x 1024, project_in 512 x 1024
    assert m.embedding_params() == 50272 * 512 + 2050 * 1024 + 512 * 1024
    assert m.head_params() == 1024 * 512                               # project_out only: tied, no final norm
    assert m.output_embedding_params() == 50272 * 512
    assert m.head_forward_flops_per_token() == 2 * 50272 * 512 + 2 * 1024 * 512


def test_dense_layer_override_and_shared_experts():
    base = dict(name="x", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                vocab_size=100, ffn_type="swiglu", num_experts=4, top_k=1, expert_ffn_hidden_size=32,
                linear_bias=False, position_embedding="rotary", norm_type="rmsnorm")
    m = ModelSpec(**base, dense_layer_indices=(0,))
    assert [m.layer_kind(i) for i in range(4)] == ["dense", "moe", "moe", "moe"]
    assert m.layer_params(0) - m._layer_common_params() == 3 * 64 * 128
    s = ModelSpec(**base, num_shared_experts=1, shared_expert_ffn_hidden_size=96)
    assert s.layer_active_params(1) - m.layer_active_params(1) == 3 * 64 * 96
    assert s.layer_forward_flops_per_token(1, 8) - m.layer_forward_flops_per_token(1, 8) == 2 * 3 * 64 * 96


# ---------------------------------------------------------------------------------------------- FLOPs
def test_narayanan_formula_exact_non_causal():
    # Narayanan et al. 2021 (SC'21), eq. (3) without recompute: F = 72 B s l h^2 (1 + s/(6h) + V/(12 h l)).
    m = load_model("gpt3-13b")
    b, s, l, h, v = 8, 2048, m.num_layers, m.hidden_size, m.vocab_size
    expected = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * h * l))
    training = 3 * m.forward_flops_per_token(s, causal=False) * b * s
    assert training == pytest.approx(expected, rel=1e-12)


def test_causal_halves_the_attention_term():
    m = load_model("llama3-8b")
    s = 8192
    diff = m.layer_forward_flops_per_token(0, s, causal=False) - m.layer_forward_flops_per_token(0, s)
    assert diff == pytest.approx(2 * m.q_dim * s)                      # half of 4 * q_dim * s
    whole = m.forward_flops_per_token(s, causal=False) - m.forward_flops_per_token(s)
    assert whole == pytest.approx(m.num_layers * diff)
    assert m.layer_flops_breakdown(0, s)["attention"] == pytest.approx(2 * m.q_dim * s)


def test_gqa_shrinks_kv_projection_flops():
    m = load_model("llama3-8b")
    mha = dataclasses.replace(m, num_kv_heads=m.num_heads)
    assert m.layer_flops_breakdown(0, 16)["qkv"] == 2 * 4096 * (4096 + 2 * 1024)
    assert mha.layer_flops_breakdown(0, 16)["qkv"] == 2 * 4096 * 3 * 4096
    assert mha.total_params() - m.total_params() == 32 * 2 * 4096 * (4096 - 1024)


@pytest.mark.parametrize("name", ["gpt3-13b", "llama3-8b", "llama3-70b", "mixtral-8x7b", "qwen3-30b-a3b",
                                  "gshard-moe-2.4b", "opt-350m"])
def test_six_n_rule_short_sequence(name):
    # Kaplan et al. 2020, sec. 2.1: training C ~ 6N per token, N = parameters that multiply activations (here the
    # active ones), when the sequence is short (the attention term 2 n_layer n_ctx d_attn is small). At s = 128 the
    # matmul count lands within 1 % (norm and bias parameters do no matmul work: below 0.5 %).
    m = load_model(name)
    training = 3 * m.forward_flops_per_token(128)
    assert training == pytest.approx(6 * m.active_matmul_params(), rel=0.01)
    # Plain "6 x active params" (embedding lookups included) is looser: within 7 % where the vocabulary is a small
    # share of the model.
    if name in ("gpt3-13b", "llama3-70b", "mixtral-8x7b"):
        assert training == pytest.approx(6 * m.active_params(), rel=0.07)


def test_moe_flops_use_top_k_experts_only():
    m = load_model("mixtral-8x7b")
    dense_equiv = dataclasses.replace(m, num_experts=0, top_k=0, expert_ffn_hidden_size=None,
                                      ffn_hidden_size=2 * 14336)      # top-2 of 14336 = one FFN twice as wide
    diff = m.layer_forward_flops_per_token(0, 64) - dense_equiv.layer_forward_flops_per_token(0, 64)
    assert diff == 2 * 4096 * 8                                        # the router is the only difference


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", preset_names())
def test_dict_and_yaml_round_trip(name, tmp_path):
    m = load_model(name)
    assert ModelSpec.from_dict(m.to_dict()) == m
    path = tmp_path / f"{name}.yaml"
    dump_yaml_file(m.to_dict(), path)
    again = load_model(str(path))
    assert again == m and again.total_params() == m.total_params()
    routing = {"router_type", "router_norm_topk", "capacity_factor"}  # left out where None (dense; dropless MoE)
    at_default = {"activation_impl"} if m.activation_impl == "kernel" else set()  # left out at its default
    assert set(m.to_dict()) == {k for k in field_names()
                                if not (k in routing and getattr(m, k) is None) and k not in at_default}
    assert routing <= set(m.to_dict()) or not m.num_experts or m.capacity_factor is None


LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN3_MOE_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 151936,
}
OPT_350M_HF = {
    "_name_or_path": "facebook/opt-350m", "activation_function": "relu", "architectures": ["OPTForCausalLM"],
    "do_layer_norm_before": False, "enable_bias": True, "ffn_dim": 4096, "hidden_size": 1024,
    "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 16, "num_hidden_layers": 24,
    "vocab_size": 50272, "word_embed_proj_dim": 512,
}
GPT2_HF = {
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "vocab_size": 50257,
}


def _write_json(tmp_path: Path, name: str, cfg: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(folder / "config.json")


@pytest.mark.parametrize("preset,cfg", [("llama3-8b", LLAMA3_8B_HF), ("qwen3-30b-a3b", QWEN3_MOE_HF),
                                        ("opt-350m", OPT_350M_HF)])
def test_hf_config_matches_preset(preset, cfg, tmp_path):
    hf = load_model(_write_json(tmp_path, preset, cfg))
    p = load_model(preset)
    assert hf.total_params() == p.total_params() and hf.active_params() == p.active_params()
    assert dataclasses.replace(hf, name=p.name, citation=p.citation) == p
    assert hf.forward_flops_per_token(4096) == p.forward_flops_per_token(4096)


def test_hf_mixtral_config_example_matches_preset(tmp_path):
    example = load_model(str(EXAMPLES / "mixtral-8x7b" / "config.json"))
    p = load_model("mixtral-8x7b")
    assert example.name == "mixtral-8x7b"                              # named after its folder
    assert dataclasses.replace(example, citation=p.citation) == p
    # Written to tmp_path and loaded as a folder, with the pretty-printing changed: same counts.
    cfg = json.loads((EXAMPLES / "mixtral-8x7b" / "config.json").read_text())
    path = _write_json(tmp_path, "mixtral-like", cfg)
    by_folder = load_model(str(Path(path).parent))
    assert (by_folder.total_params(), by_folder.active_params()) == (p.total_params(), p.active_params())


def test_hf_gpt2_style_keys():
    m = from_hf_config(GPT2_HF, name="gpt2")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.ffn_hidden_size) == (12, 768, 12, 3072)
    assert m.tied_embeddings and m.position_embedding == "learned" and m.norm_type == "layernorm"
    assert m.total_params() == 124_439_808                             # GPT-2 small, "124M" (HF model card)


def test_hf_qwen2_moe_shared_expert():
    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
           "num_hidden_layers": 24, "intermediate_size": 5632, "moe_intermediate_size": 1408,
           "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
           "vocab_size": 151936, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "decoder_sparse_step": 1,
           "tie_word_embeddings": False}
    m = from_hf_config(cfg, name="qwen1.5-moe-a2.7b")
    assert m.num_shared_experts == 1 and m.shared_expert_gate and m.qkv_bias and not m.linear_bias
    # Qwen/Qwen1.5-MoE-A2.7B: 14,315,784,192 parameters (KerasHub preset metadata), "2.7B activated" (model card).
    assert m.total_params() == 14_315_784_192
    assert m.active_params() == pytest.approx(2.7e9, rel=0.01)


def test_example_yaml_loads():
    m = load_model(str(EXAMPLES / "llama3.2-1b.yaml"))
    assert m.total_params() == pytest.approx(1.24e9, rel=0.01)        # meta-llama/Llama-3.2-1B: 1.24B
    assert m.tied_embeddings and m.head_params() == 2048               # final norm only


def test_preset_name_normalised():
    assert load_model("Llama3_8B") == load_model("llama3-8b") == load_model(" LLAMA-3-8B ")
    assert load_model("Mixtral_8x7B_16L").num_layers == 16


# ---------------------------------------------------------------------------------------------- bad input
GOOD = dict(name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=128, vocab_size=100)


@pytest.mark.parametrize("changes,field", [
    ({"num_layers": 0}, "num_layers"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
    ({"num_layers": True}, "num_layers"),
    ({"num_layers": 2.5}, "num_layers"),
    ({"num_heads": 3}, "num_heads"),                                 # 3 does not divide 64
    ({"num_kv_heads": 3}, "num_kv_heads"),                           # 3 does not divide 4
    ({"head_dim": 0}, "head_dim"),
    ({"num_experts": 4, "top_k": 5}, "top_k"),
    ({"num_experts": 4}, "top_k"),                                   # experts without top_k
    ({"top_k": 2}, "top_k"),                                         # top_k without experts
    ({"num_experts": -1}, "num_experts"),
    ({"num_experts": 4, "top_k": 2, "moe_layer_frequency": 3}, "moe_layer_frequency"),   # 2 layers: none MoE
    ({"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 0}, "expert_ffn_hidden_size"),
    ({"ffn_type": "swigl"}, "ffn_type"),
    ({"norm_type": "batchnorm"}, "norm_type"),
    ({"position_embedding": "sinusoid"}, "position_embedding"),
    ({"max_seq_len": 4096, "num_position_embeddings": 2048}, "num_position_embeddings"),
    ({"tied_embeddings": "yes"}, "tied_embeddings"),
    ({"embedding_dim": 0}, "embedding_dim"),
    ({"num_experts": 4, "top_k": 1, "dense_layer_indices": (7,)}, "dense_layer_indices"),
])
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(SpecError) as info:
        ModelSpec(**{**GOOD, **changes})
    assert info.value.field == field
    assert field in str(info.value)
    assert info.value.valid                                           # says what would be valid


def test_bad_messages_carry_value_and_hint():
    with pytest.raises(SpecError, match=r"did you mean 'swiglu'"):
        ModelSpec(**{**GOOD, "ffn_type": "swigl"})
    with pytest.raises(SpecError, match=r"got 5.*1\.\.4"):
        ModelSpec(**{**GOOD, "num_experts": 4, "top_k": 5})


def test_unknown_yaml_key_names_file_and_suggests(tmp_path):
    path = tmp_path / "m.yaml"
    dump_yaml_file({**GOOD, "num_layer": 3}, path)
    with pytest.raises(SpecError) as info:
        load_model(str(path))
    assert info.value.field == "num_layer"
    assert "num_layers" in str(info.value) and str(path) in str(info.value)


def test_bad_value_in_yaml_names_file(tmp_path):
    path = tmp_path / "m.yaml"
    dump_yaml_file({**GOOD, "num_kv_heads": 3}, path)
    with pytest.raises(SpecError) as info:
        load_model(str(path))
    assert info.value.field == "num_kv_heads" and str(path) in str(info.value)


def test_missing_required_field(tmp_path):
    path = tmp_path / "m.yaml"
    dump_yaml_file({k: v for k, v in GOOD.items() if k != "vocab_size"}, path)
    with pytest.raises(SpecError, match="vocab_size"):
        load_model(str(path))


def test_unknown_preset_lists_presets_and_suggests():
    with pytest.raises(SpecError) as info:
        load_model("llama3-8")
    text = str(info.value)
    assert "'llama3-8'" in text and "did you mean 'llama3-8b'" in text and "mixtral-8x7b" in text


def test_missing_file_path_is_not_a_preset_error(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        load_model(str(tmp_path / "nope.yaml"))


def test_malformed_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "num_hidden_layers": 2,,}')
    with pytest.raises(SpecError, match="malformed JSON at line 1"):
        load_model(str(path))


def test_hf_errors_name_the_config_key(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B_HF.items() if k != "num_hidden_layers"}
    with pytest.raises(SpecError) as info:
        load_model(_write_json(tmp_path, "a", cfg))
    assert info.value.field == "num_hidden_layers"
    with pytest.raises(SpecError) as info:
        load_model(_write_json(tmp_path, "b", {**LLAMA3_8B_HF, "num_key_value_heads": 5}))
    assert info.value.field == "num_kv_heads" and "num_key_value_heads" in str(info.value)
    with pytest.raises(SpecError, match="latent attention") as info:
        from_hf_config({**LLAMA3_8B_HF, "model_type": "deepseek_v3", "kv_lora_rank": 512})
    assert info.value.field == "kv_lora_rank"


def test_layer_index_out_of_range():
    m = load_model("tiny")
    with pytest.raises(SpecError, match="layer"):
        m.layer_params(m.num_layers)
    with pytest.raises(SpecError, match="seq_len"):
        m.layer_forward_flops_per_token(0, 0)


def test_hf_config_without_hidden_act_takes_transformers_default():
    """transformers' LlamaConfig defaults hidden_act to silu; a config that omits it is still SwiGLU."""
    cfg = {k: v for k, v in LLAMA3_8B_HF.items() if k != "hidden_act"}
    assert from_hf_config(cfg, name="llama").ffn_type == from_hf_config(LLAMA3_8B_HF, name="llama").ffn_type
    assert from_hf_config({k: v for k, v in GPT2_HF.items() if k != "activation_function"}, name="g").ffn_type \
        == from_hf_config(GPT2_HF, name="g").ffn_type
