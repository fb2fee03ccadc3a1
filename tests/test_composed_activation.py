"""A GELU written as separate tensor ops (ModelSpec.activation_impl: Hugging Face's gelu_new, minGPT's NewGELU) keeps
each op's operands for the backward, where one kernel keeps its input: the cost model's figures against autograd's
own saved tensors, counted with saved-tensor hooks on transformers' GPT2Block and activation functions, and the CLI's
estimate of a GPT-2 config.json that names one or the other activation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the test extra installs it (setup.py): these tests never skip
from torch.overrides import TorchFunctionMode
from transformers.activations import ACT2FN
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from tangram_launch.cli import main
from tangram_launch.costmodel.compute import ffn_elementwise_bytes_per_token
from tangram_launch.costmodel.composed_activation import COMPOSED
from tangram_launch.costmodel.host_floor import layer_host_ops
from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION, composed_activation_saved_bytes, \
    layer_activation_bytes
from tangram_launch.errors import SpecError
from tangram_launch.specs.model import ACTIVATION_IMPLS, ModelSpec, from_hf_config

pytestmark = pytest.mark.unit

IMPLS = tuple(COMPOSED)  # every composed implementation the cost model prices
CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "c1-v100-only.yaml"
H, F, TOKENS = 64, 256, 2 * 16


def _saved_bytes(fn, x: torch.Tensor) -> dict[int, int]:
    """Bytes of every storage autograd keeps for the backward of fn(x), by storage."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return seen


class _CudaAutocastPow(TorchFunctionMode):
    """pow as CUDA autocast runs it: on an fp32 copy of its input (pow is on CUDA autocast's fp32 list, not on the
    CPU's, so this machine's autocast cannot show it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.pow, torch.Tensor.pow, torch.Tensor.__pow__) and args[0].dtype in (torch.float16,
                                                                                             torch.bfloat16):
            args = (args[0].float(), *args[1:])
        return func(*args, **(kwargs or {}))


def _beyond_input(fn, dtype: torch.dtype, *, cuda_autocast: bool = False) -> float:
    """Bytes per element fn keeps beyond what F.gelu keeps (its input)."""
    x = (torch.randn(8, 64, dtype=dtype, requires_grad=True) * 1.0)  # a non-leaf input, as a GEMM's output is
    if cuda_autocast:
        plain = fn

        def fn(t):
            with _CudaAutocastPow():
                return plain(t)
    kept = _saved_bytes(fn, x)
    kernel = _saved_bytes(torch.nn.functional.gelu, x)
    return (sum(kept.values()) - sum(kernel.values())) / x.numel()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_activations_keep_what_the_cost_model_counts(impl, dtype):
    p = torch.tensor([], dtype=dtype).element_size()
    assert _beyond_input(ACT2FN[impl], dtype) == composed_activation_saved_bytes(impl, p, autocast=False)


def test_gelu_new_under_cuda_autocast_keeps_fp32_copies():
    # CUDA autocast runs pow in fp32: it keeps an fp32 copy of the input instead of the input, and tanh, 1 + tanh
    # follow it into fp32; 0.5 x stays 16-bit: 4 + 4 + 4 + 2 against the kernel's 2
    got = _beyond_input(ACT2FN["gelu_new"], torch.bfloat16, cuda_autocast=True)
    assert got == composed_activation_saved_bytes("gelu_new", 2, autocast=True) == 12.0
    assert composed_activation_saved_bytes("gelu_new", 4, autocast=True) == 12.0  # fp32: nothing to promote
    assert composed_activation_saved_bytes("kernel", 2) == 0.0


def _gpt2(act: str) -> ModelSpec:
    return from_hf_config({"model_type": "gpt2", "n_embd": H, "n_head": 4, "n_layer": 1, "n_positions": 16,
                           "vocab_size": 128, "n_inner": F, "activation_function": act})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpt2_block_keeps_the_difference_the_cost_model_prices(dtype):
    """transformers' GPT2Block with gelu_new against gelu_pytorch_tanh (one kernel, the same formula): the bytes
    autograd keeps differ by what layer_activation_bytes adds for the composed activation."""
    def block_bytes(act):
        cfg = transformers.GPT2Config(n_embd=H, n_head=4, n_layer=1, n_inner=F, activation_function=act,
                                      resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        cfg._attn_implementation = "eager"
        block = GPT2Block(cfg).to(dtype)
        x = torch.randn(2, 16, H, dtype=dtype, requires_grad=True) * 1.0
        return sum(_saved_bytes(lambda t: block(t)[0], x).values())

    p = torch.tensor([], dtype=dtype).element_size()
    measured = block_bytes("gelu_new") - block_bytes("gelu_pytorch_tanh")
    kw = dict(seq_len=16, mbs=2, dtype_bytes=p, autocast=False)
    priced = layer_activation_bytes(_gpt2("gelu_new"), 0, **kw) - layer_activation_bytes(_gpt2("gelu_pytorch_tanh"),
                                                                                       0, **kw)
    assert measured == priced == TOKENS * F * 3 * p


def test_full_recompute_and_op_sac_keep_no_more():
    composed, kernel = _gpt2("gelu_new"), _gpt2("gelu_pytorch_tanh")
    kw = dict(seq_len=16, mbs=2, dtype_bytes=2)
    assert layer_activation_bytes(composed, 0, recompute="full", **kw) == \
        layer_activation_bytes(kernel, 0, recompute="full", **kw)
    # torchtitan's op-level SAC saves matmul outputs only: the activation is recomputed from them
    assert layer_activation_bytes(composed, 0, recompute="selective", selective_policy="op-sac", **kw) == \
        layer_activation_bytes(kernel, 0, recompute="selective", selective_policy="op-sac", **kw)
    # Megatron's selective recompute reruns the attention core only: the FFN keeps it
    assert layer_activation_bytes(composed, 0, recompute="selective", **kw) - \
        layer_activation_bytes(kernel, 0, recompute="selective", **kw) == TOKENS * F * 12.0


def test_a_composed_activation_moves_and_dispatches_more():
    composed, kernel = _gpt2("gelu_new"), _gpt2("gelu_pytorch_tanh")
    assert ffn_elementwise_bytes_per_token(composed, F, 2, True) == 76 * F  # autocast: the fp32 chain
    assert ffn_elementwise_bytes_per_token(composed, F, 2, True, autocast=False) == 18 * 2 * F
    assert ffn_elementwise_bytes_per_token(kernel, F, 2, True) == 2 * 2 * F
    fwd, bwd = layer_host_ops(composed, 0)
    assert (fwd, bwd) == tuple(a + b for a, b in zip(layer_host_ops(kernel, 0), COMPOSED["gelu_new"].ops))


@pytest.mark.parametrize("impl", IMPLS)
def test_the_dispatched_operators_are_counted(impl):
    """COMPOSED's operator counts against the aten operators transformers' activation dispatches beyond F.gelu's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def count(fn):
        x = torch.randn(8, 16, requires_grad=True) * 1.0
        Count.n = 0
        with Count():
            y = fn(x)
        fwd, Count.n = Count.n, 0
        with Count():
            y.backward(torch.ones_like(y))
        return fwd, Count.n

    composed, kernel = count(ACT2FN[impl]), count(torch.nn.functional.gelu)
    assert (composed[0] - kernel[0], composed[1] - kernel[1]) == COMPOSED[impl].ops


def test_hugging_face_configs_name_their_activation():
    assert _gpt2("gelu_new").activation_impl == "gelu_new"
    assert _gpt2("gelu_pytorch_tanh").activation_impl == "kernel"
    no_key = from_hf_config({"model_type": "gpt2", "n_embd": H, "n_head": 4, "n_layer": 1, "vocab_size": 128})
    assert no_key.activation_impl == "gelu_new"  # GPT2Config's default activation_function
    assert from_hf_config({"model_type": "llama", "hidden_size": H, "num_attention_heads": 4, "num_hidden_layers": 1,
                           "intermediate_size": F, "vocab_size": 128}).activation_impl == "kernel"
    # the plan's model record keeps the key only where it is not the default (earlier plans' bytes unchanged)
    assert "activation_impl" not in _gpt2("gelu_pytorch_tanh").to_dict()
    assert ModelSpec.from_dict(_gpt2("gelu_new").to_dict()) == _gpt2("gelu_new")


def test_an_unknown_activation_impl_names_the_field():
    with pytest.raises(SpecError) as exc:
        ModelSpec(name="m", num_layers=1, hidden_size=H, num_heads=4, num_kv_heads=4, ffn_hidden_size=F,
                  vocab_size=128, activation_impl="gelu_newest")
    assert exc.value.field == "activation_impl" and exc.value.value == "gelu_newest"
    assert all(impl in str(exc.value) for impl in ACTIVATION_IMPLS)


def test_estimate_of_a_gpt2_config_prices_its_activation(tmp_path, capsys):
    """`tangram-launch estimate` on two GPT-2 config.json files that differ only in activation_function: the
    composed one keeps 12 bytes more per FFN element of each layer (autocast, fp16; the activations' fragmentation
    allowance on top), and runs longer."""
    got = {}
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        cfg = tmp_path / f"{act}.json"
        cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
                                   "n_positions": 1024, "vocab_size": 50257, "activation_function": act}))
        assert main(["estimate", "--cluster", str(CLUSTER), "--model", str(cfg), "--dp", "1", "--mbs", "4",
                     "--global-batch", "4", "--seq-len", "1024", "--dtype", "fp16", "--format", "json"]) == 0
        got[act] = json.loads(capsys.readouterr().out)["stages"][0]
    extra = got["gelu_new"]["activation_bytes"] - got["gelu_pytorch_tanh"]["activation_bytes"]
    assert extra == pytest.approx(12 * 4 * 1024 * 3072 * 12 * (1 + FRAGMENTATION_FRACTION), rel=1e-9)
    assert got["gelu_new"]["forward_s"] > got["gelu_pytorch_tanh"]["forward_s"]


def test_every_composed_implementation_the_spec_accepts_is_priced():
    assert set(COMPOSED) == set(ACTIVATION_IMPLS) - {"kernel"}
