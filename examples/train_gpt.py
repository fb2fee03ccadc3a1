"""Train a small GPT with the torch runtime adapter, laid out by a Tangram plan.

    tangram-launch --standalone --nproc-per-node 2 --plan examples/data/plan-tiny-2cpu.json \\
        examples/train_gpt.py --steps 20
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --plan examples/data/plan-tiny-2cpu.json

The plan decides every parallel choice (stages and their layer ranges, dp/tp per stage, ZeRO via DDP-style all-reduce
or FSDP2, recompute, micro-batches); this script only feeds data and reports. Data: ``--data FILE`` (default
examples/data/corpus.txt) read as bytes, one token per byte, random windows of seq_len + 1 bytes; or ``--data
synthetic``: sequences counting up modulo the vocabulary from a random start. Batches are drawn from a generator
seeded by (seed, step), so every rank builds the same global batch without communication and each replica takes its
own rows. The last stage prints loss, tokens/s and iteration time per step.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a file: make the repository importable when tangram-launch is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from tangram_launch.errors import SpecError, TangramError

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--plan", help="plan file; default: the plan tangram-launch started this worker with")
    p.add_argument("--steps", type=int, default=20, help="training iterations")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234, help="model init and data seed (the same on every rank)")
    p.add_argument("--data", default=DEFAULT_DATA, help="a text file read as bytes, or 'synthetic'")
    p.add_argument("--out", help="JSON file for losses and iteration times (written by the reporting rank)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout")
    p.add_argument("--quiet", action="store_true", help="no per-step lines (the summary still prints)")
    return p


def plan_and_place(plan_path: str | None):
    """The Plan and this worker's Place: from tangram-launch (tangram_launch.worker), else --plan and RANK."""
    from tangram_launch.plan import Plan

    if plan_path is None:
        from tangram_launch.worker import current_plan, in_tangram_launch

        if not in_tangram_launch():
            raise SpecError("no plan: pass --plan FILE, or start this script with tangram-launch --plan FILE",
                            field="--plan")
        me = current_plan()
        return me.plan, me.place
    plan = Plan.load(plan_path)
    rank = int(os.environ.get("RANK", "0"))
    return plan, plan.place(rank)


class TokenBatches:
    """Global batches (global_batch, seq_len + 1) of int64 tokens, a pure function of (seed, step)."""

    def __init__(self, source: str, *, global_batch: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.global_batch, self.seq_len, self.vocab_size, self.seed = global_batch, seq_len, vocab_size, seed
        self.tokens: torch.Tensor | None = None
        if source != "synthetic":
            if vocab_size < 256:
                raise SpecError("byte-level text needs a vocabulary of >= 256 tokens", field="model.vocab_size",
                                value=vocab_size, valid=">= 256, or --data synthetic")
            with open(source, "rb") as f:
                data = f.read()
            if len(data) < seq_len + 2:
                raise SpecError(f"the text is shorter than one sequence ({seq_len + 1} bytes)", source=source)
            self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # (N,)

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.tokens is None:  # counting sequences: token[t+1] = token[t] + 1 (mod V), learnable in a few steps
            start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=g)
            return (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,), generator=g)
        return torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])  # (B, T+1)


def train(ctx: Any, data: TokenBatches, *, steps: int, reporter: bool, quiet: bool,
          tokens_per_step: int) -> dict:
    """Run ``steps`` iterations of ``ctx.train_step``; returns losses and per-step wall times."""
    losses, times = [], []
    for step in range(steps):
        batch = data.batch(step)
        t0 = time.perf_counter()
        loss = ctx.train_step(batch)  # ends with a collective: the time is the iteration's, on every rank
        dt = time.perf_counter() - t0
        losses.append(loss)
        times.append(dt)
        if reporter and not quiet:
            print(f"step {step:4d}  loss {loss:.4f}  {tokens_per_step / dt:9.0f} tokens/s  {dt * 1e3:8.1f} ms",
                  flush=True)
    steady = times[1:] or times  # the first step includes pipeline shape inference and allocator warm-up
    return {"losses": losses, "iteration_s": times, "median_iteration_s": statistics.median(steady),
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / statistics.median(steady)}


def run(args: argparse.Namespace, setup: Callable[[Any, Any], Any], runtime: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    plan, place = plan_and_place(args.plan)
    if plan.runtime != runtime:
        logging.getLogger("train_gpt").warning("the plan was made for runtime '%s'; running it on '%s'",
                                               plan.runtime, runtime)
    gb, seq_len = int(plan.training["global_batch"]), int(plan.training["seq_len"])
    data = TokenBatches(args.data, global_batch=gb, seq_len=seq_len, vocab_size=int(plan.model["vocab_size"]),
                        seed=args.seed)
    ctx = setup(plan, place)
    reporter = place.is_last_stage and place.coords["dp"] == 0 and place.coords["tp"] == 0
    if reporter:
        print(f"[{runtime}] plan: {plan.num_stages} stage(s) "
              + " | ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} tp{s.tp} dp{s.dp} zero{s.zero_stage} "
                           f"{s.recompute}" for s in plan.stages)
              + f"; global batch {gb} x {seq_len} tokens, {plan.num_microbatches} micro-batches", flush=True)
    result = train(ctx, data, steps=args.steps, reporter=reporter, quiet=args.quiet, tokens_per_step=gb * seq_len)
    if reporter:
        print(f"[{runtime}] {args.steps} steps: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
              f"median iteration {result['median_iteration_s'] * 1e3:.1f} ms, "
              f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"runtime": runtime, "plan_stages": [list(s.layers) for s in plan.stages], **result}, f,
                          indent=1)
    ctx.close()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from runtime_adapters.torch_native import TorchAdapter

    def setup(plan, place):
        return TorchAdapter().setup(plan, place, seed=args.seed, timeout_s=args.timeout_s,
                                    optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr, foreach=False))

    try:
        return run(args, setup, "torch")
    except TangramError as exc:
        print(f"train_gpt: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
