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

Checkpoints (``--save-dir``, ``--save-every``, ``--resume`` / ``tangram-launch --resume``) go through
tangram_launch.checkpoint like train_gpt.py's: DeepSpeed's PipelineModule names its entries ``<i>.<param>`` over
[embedding, layer 0, ..., layer L-1, head] with global indices, which :func:`deepspeed_stage_state` renames to the
global convention (``embedding.*``, ``layers.<i>.*``, ``head.*``), with the optimizer's state keyed by the same
names, so a checkpoint written by either example (any layout) resumes in the other. Supported when DeepSpeed runs
the given torch optimizer itself (ZeRO 0, fp32); a ZeRO-1 or bf16/fp16 engine wraps it in its own flat-buffer
optimizer, which is refused with a clear error.
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
from train_gpt import build_parser, plan_adapter, run


def deepspeed_stage_state(ctx):
    """The DeepSpeed context's state under global names: PipelineModule entry i is the embedding (0), layer i-1, or
    the head (L+1); the optimizer must be the torch one the engine steps directly (ZeRO 0, fp32)."""
    from tangram_launch.checkpoint import StageState

    engine = ctx.engine
    optimizer = getattr(engine, "optimizer", None)
    basic = getattr(engine, "basic_optimizer", None)
    if optimizer is None or optimizer is not basic:
        raise SpecError(f"checkpoints of this example need DeepSpeed to step the torch optimizer itself; the engine "
                        f"wraps it in {type(optimizer).__name__} (ZeRO stage {ctx.place.stage.zero_stage}, "
                        f"{ctx.plan.training.get('dtype')})", field="deepspeed optimizer",
                        value=type(optimizer).__name__, valid="ZeRO 0 with fp32 (the plan's zero_stage and dtype)")
    last = ctx.num_layers + 1

    def to_global(local: str) -> str:
        idx, _, rest = local.partition(".")
        if not idx.isdigit() or not rest:
            raise SpecError("not a PipelineModule entry name", field="state key", value=local,
                            valid="<entry index>.<param>")
        i = int(idx)
        return f"embedding.{rest}" if i == 0 else f"head.{rest}" if i == last else f"layers.{i - 1}.{rest}"

    return StageState.from_module(engine.module, to_global, optimizer)


def main(argv=None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--ds-config", help="a DeepSpeed config (JSON or YAML) merged with the plan's")
    args = parser.parse_args(argv)

    def setup(plan, place):
        return plan_adapter(plan).setup(plan, place, user_config=args.ds_config, seed=args.seed,
                                        timeout_s=args.timeout_s,
                                        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr, foreach=False))

    try:
        return run(args, setup, "deepspeed", stage_state=deepspeed_stage_state)
    except TangramError as exc:  # one line; bad input ends tangram-launch with exit 2
        from tangram_launch.launch.worker_exit import exit_status_for

        return exit_status_for(exc, prog="train_gpt_deepspeed")


if __name__ == "__main__":
    sys.exit(main())
