"""Train a small GPT with the DeepSpeed runtime adapter (pipeline engine), laid out by a Tangram plan.

    tangram-launch --standalone --nproc-per-node 2 --plan examples/data/plan-tiny-2cpu-deepspeed.json \\
        examples/train_gpt_deepspeed.py --steps 20 [--ds-config my_ds.json]
    torchrun --standalone --nproc-per-node 2 examples/train_gpt_deepspeed.py \\
        --plan examples/data/plan-tiny-2cpu-deepspeed.json

The plan sets DeepSpeed's layer partition, its (pipe, data) topology, micro-batch size, gradient accumulation
(= micro-batches), ZeRO stage and activation checkpointing; ``--ds-config`` adds your own keys (those that contradict
the plan are warned about and the plan's value is kept). Data handling and reporting are shared with train_gpt.py.
On CPU the first DeepSpeed start JIT-compiles its shm comm op once (about a minute; cached under
TORCH_EXTENSIONS_DIR).
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))  # the repository, when tangram-launch is not installed
    sys.path.insert(0, here)  # train_gpt (shared data handling)

import torch

from tangram_launch.errors import TangramError
from train_gpt import build_parser, run


def main(argv=None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--ds-config", help="a DeepSpeed config (JSON or YAML) merged with the plan's")
    args = parser.parse_args(argv)
    from runtime_adapters.deepspeed_adapter import DeepSpeedAdapter

    def setup(plan, place):
        return DeepSpeedAdapter().setup(plan, place, user_config=args.ds_config, seed=args.seed,
                                        timeout_s=args.timeout_s,
                                        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr, foreach=False))

    try:
        return run(args, setup, "deepspeed")
    except TangramError as exc:
        print(f"train_gpt_deepspeed: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
