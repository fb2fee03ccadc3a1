"""Train a Hugging Face transformers model with the torch runtime adapter, laid out by a Tangram plan.

    tangram-launch --standalone --nproc-per-node 2 --profile --model examples/models/tiny-llama \\
        --global-batch 8 --seq-len 64 examples/train_hf.py --hf-model examples/models/tiny-llama --steps 20 \\
        --save-dir ckpt --save-every 10
    tangram-launch --standalone --nproc-per-node 3 --cluster cluster.yaml --resume ckpt \\
        examples/train_hf.py --hf-model examples/models/tiny-llama --steps 40      # another layout, same run
    tangram-launch export ckpt --to hf out/      # then AutoModelForCausalLM.from_pretrained("out/")

``--hf-model``: a local Hugging Face folder (config.json, and *.safetensors when it has them: the starting
weights) or a config.json (random init, seeded per part so every layout starts alike); Llama, Mistral, Qwen2/3,
GPT-2 and OPT families (``runtime_adapters.hf_model``). The plan's model must be this config (plan it with
``--model`` pointing at the same folder). Data, checkpoints, resume and reporting are train_gpt.py's: byte-level
text (a vocabulary of >= 256) or ``--data synthetic``; checkpoints are layout-agnostic and carry the HF config, so
``tangram-launch export`` needs nothing else.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))  # the repository, when tangram-launch is not installed
    sys.path.insert(0, here)  # train_gpt (shared data handling)

import torch

from tangram_launch.errors import SpecError, TangramError
from train_gpt import build_parser, run


def attention_for(requested: str, training: dict, *, cuda: bool) -> str:
    """transformers' attention implementation: ``requested``, or under auto the one the plan priced: eager where it
    priced unfused attention (--attention-kernel eager) or on CPU (exact against an unsplit model), else sdpa. Eager
    on a GPU under a plan that priced a fused kernel keeps s x s scores the plan has no room for: refused."""
    priced = str(training.get("attention_kernel", "auto"))
    if requested == "auto":
        return "eager" if priced == "eager" or not cuda else "sdpa"
    if requested == "eager" and cuda and priced != "eager":
        raise SpecError("eager attention keeps the s x s scores, which this plan did not price (it priced the fused "
                        f"kernel '{priced}')", field="--attn", value=requested,
                        valid="sdpa or auto, or a plan made with --attention-kernel eager")
    return requested


def main(argv=None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--hf-model", required=True, metavar="PATH",
                        help="a local Hugging Face model folder or config.json")
    parser.add_argument("--attn", default="auto",
                        help="transformers attention implementation: eager, sdpa, or auto (default): what the plan "
                             "priced, sdpa on a GPU (fused: no s x s scores kept) unless the plan was made with "
                             "--attention-kernel eager; eager on CPU, bit for bit with an unsplit model")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: nothing is downloaded
    try:
        from runtime_adapters.hf_model import HFSource
        from runtime_adapters.registry import get_adapter

        source = HFSource.from_pretrained(args.hf_model)

        def setup(plan, place):
            source.set_attention(attention_for(args.attn, plan.training, cuda=torch.cuda.is_available()))
            return get_adapter("torch").setup(plan, place, seed=args.seed, timeout_s=args.timeout_s,
                                              model_source=source,
                                              optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr,
                                                                                             foreach=False))

        hf_config = {k: v for k, v in source.config.to_dict().items() if not k.startswith("_")}
        return run(args, setup, "torch", checkpoint_extra={"hf_config": hf_config})
    except TangramError as exc:  # one line; bad input ends tangram-launch with exit 2
        from tangram_launch.launch.worker_exit import exit_status_for

        return exit_status_for(exc, prog="train_hf")


if __name__ == "__main__":
    sys.exit(main())
