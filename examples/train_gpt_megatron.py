"""Train a GPT with Megatron-core's own 1F1B schedule, laid out by a Tangram plan.

    tangram-launch --standalone --nproc-per-node 1 --plan plan.json examples/train_gpt_megatron.py --steps 30
    tangram-launch --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29500 --runtime megatron \\
        --plan plan.json examples/train_gpt_megatron.py --steps 100 --out result.json

The plan decides everything parallel: Megatron's tp/cp/ep/dp/pp grid (plan rank r is Megatron rank r, so each
pipeline stage runs on its island), the layer split (``pipeline_model_parallel_layout``), recompute, the distributed
optimizer for ZeRO-1, micro-batch size and micro-batches per iteration. The data are synthetic: sequences that
count up modulo the vocabulary from a random start, which a working model learns within a few dozen steps.

Megatron-core's forward/backward needs CUDA (it calls ``torch.cuda`` throughout): on a machine without a GPU this
script stops with a message saying so, before touching Megatron.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from functools import partial

if __package__ in (None, ""):  # run as a file: make the repository importable when tangram-launch is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from runtime_adapters import megatron_adapter as MA  # the plan -> Megatron config translations
from runtime_adapters.registry import get_adapter
from tangram_launch.errors import SpecError, TangramError

logger = logging.getLogger("train_gpt_megatron")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", help="plan file; default: the plan tangram-launch started this worker with")
    p.add_argument("--steps", type=int, default=30, help="training iterations")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--out", help="JSON file for the losses (written by the last stage's first replica)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout")
    return p.parse_args(argv)


def plan_and_place(args: argparse.Namespace):
    """The Plan and this worker's Place: from tangram-launch (tangram_launch.worker), else --plan and RANK."""
    if args.plan is None:
        from tangram_launch.worker import current_plan, in_tangram_launch

        if in_tangram_launch():
            me = current_plan()
            return me.plan, me.place
    env = dict(os.environ)
    if args.plan is not None:
        env["TANGRAM_PLAN_FILE"] = args.plan
    return MA.plan_and_place_from_env(env)


def synthetic_batch(step: int, micro: int, dp_rank: int, *, mbs: int, seq_len: int, vocab: int, seed: int,
                    device) -> dict:
    """Counting sequences: token[t+1] = token[t] + 1 (mod vocab). Each DP replica draws its own micro-batches."""
    g = torch.Generator().manual_seed(hash((seed, step, micro, dp_rank)) % (2 ** 31))
    start = torch.randint(0, vocab, (mbs, 1), generator=g)
    seq = (start + torch.arange(seq_len + 1)) % vocab  # (B, S+1)
    tokens, labels = seq[:, :-1], seq[:, 1:]
    return {
        "tokens": tokens.to(device),  # (B, S)
        "labels": labels.to(device),  # (B, S)
        "loss_mask": torch.ones(mbs, seq_len, dtype=torch.float, device=device),
        "position_ids": torch.arange(seq_len, device=device).unsqueeze(0).expand(mbs, -1).contiguous(),
    }


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; Megatron divides by the number of micro-batches itself."""
    from megatron.core import parallel_state

    losses = output_tensor.float()  # (B, S) per-token cross entropy from GPTModel(labels=...)
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    reported = loss.detach().clone()
    torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    reported /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = get_batch_on_this_cp_rank(next(data_iterator))  # no-op without context parallelism
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train(args: argparse.Namespace) -> dict:
    plan, place = plan_and_place(args)
    if plan.runtime != "megatron":
        raise SpecError(f"the plan was made for runtime '{plan.runtime}'; this script runs 'megatron' plans",
                        field="runtime", value=plan.runtime, valid="megatron")
    adapter = get_adapter(plan.runtime)  # the plan's runtime, through the runtime registry
    adapter.check_plan(plan)  # refuse before any process group exists
    if not torch.cuda.is_available():
        raise TangramError("Megatron-core needs CUDA for forward/backward (its schedules, RNG tracker and "
                           "parallel layers call torch.cuda); no GPU is visible here. The plan itself is fine for "
                           "Megatron: run this on GPU machines, or use --runtime torch on CPU.")
    adapter.check_environment(plan)  # e.g. MoE or context parallelism without Transformer Engine

    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    device_index = place.local_gpu if place.local_gpu < torch.cuda.device_count() else int(
        os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(device_index)
    ctx = adapter.setup(plan, place, timeout_s=args.timeout_s)  # nccl default group + Megatron's parallel state
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    config = adapter.transformer_config(plan, place)
    model = adapter.build_gpt_model(plan, place, config=config).cuda()
    if config.fp16 or config.bf16:
        model = Float16Module(config, model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(**MA.ddp_config_kwargs(plan)), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(**MA.optimizer_config_kwargs(plan, lr=args.lr)), [model])
    config.no_sync_func = model.no_sync  # accumulate over micro-batches, reduce once per iteration
    config.finalize_model_grads_func = finalize_model_grads  # dp (and tied-embedding) gradient reduction
    if config.fp16:
        config.grad_scale_func = optimizer.scale_loss

    sched = MA.schedule_kwargs(plan)
    vocab = int(plan.model["vocab_size"])
    dp_rank = place.coords["dp"]
    forward_backward = get_forward_backward_func()
    losses: list[float] = []
    logger.info("|PP=%d|DP=%d|CP=%d|TP=%d| layers %s, layout %s, %d micro-batches of %d", place.coords["pp"],
                place.coords["dp"], place.coords["cp"], place.coords["tp"], place.layers, MA.pipeline_layout(plan),
                sched["num_microbatches"], sched["micro_batch_size"])
    for step in range(args.steps):
        data = iter([synthetic_batch(step, m, dp_rank, mbs=sched["micro_batch_size"], seq_len=sched["seq_length"],
                                     vocab=vocab, seed=args.seed, device="cuda")
                     for m in range(sched["num_microbatches"])])
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(forward_step_func=forward_step, data_iterator=data, model=[model],
                                   num_microbatches=sched["num_microbatches"], seq_length=sched["seq_length"],
                                   micro_batch_size=sched["micro_batch_size"], forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if place.is_last_stage:
            loss = sum(float(r["lm loss"]) for r in reports) / len(reports)
            losses.append(loss)
            if step % args.log_every == 0 or step == args.steps - 1:
                logger.info("step %d loss %.4f grad_norm %s update %s", step, loss,
                            f"{grad_norm:.3f}" if grad_norm is not None else "-", ok)
    writer = place.is_last_stage and place.coords["dp"] == place.coords["cp"] == place.coords["tp"] == 0
    result = {"rank": place.rank, "stage": place.stage.index, "writer": writer, "losses": losses,
              "layout": MA.pipeline_layout(plan), "steps": args.steps,
              "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
    dist.barrier()
    ctx.close()
    return result


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        result = train(args)
    except TangramError as exc:  # one line; bad input ends tangram-launch with exit 2
        from tangram_launch.launch.worker_exit import exit_status_for

        return exit_status_for(exc, prog="train_gpt_megatron")
    if args.out and result["writer"]:  # every last-stage rank holds the same (dp-averaged) losses: one writes
        with open(f"{args.out}.tmp.{os.getpid()}", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(f"{args.out}.tmp.{os.getpid()}", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
