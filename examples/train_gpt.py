"""Train a small GPT with the torch runtime adapter, laid out by a Tangram plan; save and resume under any layout.

    tangram-launch --standalone --nproc-per-node 2 --plan examples/data/plan-tiny-2cpu.json \\
        examples/train_gpt.py --steps 20
    tangram-launch --standalone --nproc-per-node 2 --profile --model tiny --global-batch 8 --seq-len 64 \\
        examples/train_gpt.py --steps 20 --save-dir ckpt --save-every 10
    tangram-launch --standalone --nproc-per-node 3 --cluster cluster.yaml --resume ckpt \\
        examples/train_gpt.py --steps 40 --save-dir ckpt --save-every 10          # another layout, same run
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --plan examples/data/plan-tiny-2cpu.json

The plan decides every parallel choice (stages and their layer ranges, dp/tp per stage, ZeRO via DDP-style all-reduce
or FSDP2, recompute, micro-batches); this script only feeds data, reports and checkpoints. Data: ``--data FILE``
(default examples/data/corpus.txt) read as bytes, one token per byte, random windows of seq_len + 1 bytes; or
``--data synthetic``: sequences counting up modulo the vocabulary from a random start. Sample i of the stream is a
pure function of (seed, i), and a step takes the next global_batch samples, so every rank builds the same global
batch without communication, each replica takes its own rows, and a resumed run continues the stream at the
checkpoint's consumed-sample count: the next batch is the one an uninterrupted run would draw, even under another
global batch. ``--steps`` is the step to train up to (a resumed run continues from the checkpoint's step).

Checkpoints (``tangram_launch.checkpoint``: layout-agnostic, atomic, verified): ``--save-dir DIR --save-every N``
saves every N steps (keeping ``--keep-last`` of them); a run resumes from ``--resume DIR`` or from the directory
``tangram-launch --resume DIR`` hands its workers (TANGRAM_RESUME_DIR). The last stage prints loss, tokens/s and
iteration time per step: the slowest rank's, as ``run-report.json``'s ``step_s``.
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


class _Parser(argparse.ArgumentParser):
    def exit(self, status: int = 0, message: str | None = None):
        from tangram_launch.launch.worker_exit import usage_status

        super().exit(usage_status(status), message)  # a usage error ends tangram-launch with exit 2 too


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--plan", help="plan file; default: the plan tangram-launch started this worker with")
    p.add_argument("--steps", type=int, default=20, help="train up to this step (a resumed run continues to it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234, help="model init and data seed (the same on every rank)")
    p.add_argument("--data", default=DEFAULT_DATA, help="a text file read as bytes, or 'synthetic'")
    p.add_argument("--out", help="JSON file for losses and iteration times (written by the reporting rank)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout")
    p.add_argument("--quiet", action="store_true", help="no per-step lines (the summary still prints)")
    p.add_argument("--save-dir", metavar="DIR", help="save checkpoints here (every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="save every N steps (0: never)")
    p.add_argument("--keep-last", type=int, default=3, metavar="K", help="checkpoints to keep (default 3)")
    p.add_argument("--resume", metavar="DIR", help="resume from the newest complete checkpoint in DIR, or from "
                                                    "DIR/step_N (default: what tangram-launch --resume hands over)")
    return p


def check_args(args: argparse.Namespace) -> None:
    from tangram_launch.launch.numbers import MAX_LEARNING_RATE, check_hyperparameter

    check_hyperparameter(args.lr, flag="--lr", high=MAX_LEARNING_RATE)  # 1e30, nan, -1: refused before any step
    check_hyperparameter(args.timeout_s, flag="--timeout-s")
    for name in ("steps", "save_every"):
        if getattr(args, name) < 0:
            raise SpecError("must be >= 0", field="--" + name.replace("_", "-"), value=getattr(args, name))
    if args.keep_last < 1:
        raise SpecError("must be >= 1", field="--keep-last", value=args.keep_last)
    if args.save_every and not args.save_dir:
        raise SpecError("--save-every needs --save-dir", field="--save-dir")


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


def plan_adapter(plan: Any) -> Any:
    """The plan's runtime adapter: the launch's (``current_plan().adapter()``), else the one registered for the
    runtime of the plan file given with --plan."""
    from tangram_launch.worker import current_plan, in_tangram_launch

    if in_tangram_launch():
        return current_plan().adapter()
    from tangram_launch.capabilities import runtime

    return runtime(plan.runtime).adapter()


class TokenBatches:
    """A stream of samples (seq_len + 1 int64 tokens each); sample i is a pure function of (seed, i).

    A step takes the next ``global_batch`` samples: ``batch(consumed)`` is samples [consumed, consumed + global
    batch), shape (global_batch, seq_len + 1). The data position is therefore one number (samples consumed) that
    does not depend on the layout or the batch size.
    """

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

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` of the stream: (seq_len + 1,) tokens."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        if self.tokens is None:  # counting sequences: token[t+1] = token[t] + 1 (mod V), learnable in a few steps
            start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
            return (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        start = int(torch.randint(0, self.tokens.numel() - self.seq_len - 1, (1,), generator=g))
        return self.tokens[start:start + self.seq_len + 1].clone()

    def batch(self, consumed: int) -> torch.Tensor:
        """The global batch after ``consumed`` samples: (global_batch, seq_len + 1)."""
        return torch.stack([self.sample(consumed + i) for i in range(self.global_batch)])


def torch_stage_state(ctx: Any):
    """The torch adapter's state under global names, under any layout (model chunks, offloaded optimizer)."""
    return ctx.checkpoint_state()


class Checkpointing:
    """Resume at start-up and save every N steps through tangram_launch.checkpoint (collective calls)."""

    def __init__(self, args: argparse.Namespace, plan: Any, state: Any, data: TokenBatches,
                 extra: dict | None = None) -> None:
        from tangram_launch.launch.restart import resume_dir_for_script

        self.args, self.plan, self.state, self.data = args, plan, state, data
        self.extra = dict(extra or {})  # saved in position.json "extra" (train_hf.py: the HF config)
        # --resume, tangram-launch's --resume, or in a restart round the newest of the run's checkpoints (--save-dir
        # included: a restart without tangram-launch --checkpoint-dir continues instead of starting again)
        self.resume_dir = resume_dir_for_script(args.resume, args.save_dir)
        from tangram_launch.launch.adapt.handshake import SwitchWatch

        self.switch = SwitchWatch()  # tangram-launch --adapt: checkpoint at the step it names, then stop

    def resume(self) -> tuple[int, int, dict]:
        """(steps done, samples consumed, what was loaded) from the resume directory; (0, 0, {}) without one."""
        if not self.resume_dir:
            return 0, 0, {}
        from tangram_launch.checkpoint import load_checkpoint

        loaded = load_checkpoint(self.resume_dir, plan=self.plan, state=self.state)
        pos = loaded.position
        info = {"path": loaded.path, "step": loaded.step, "consumed_samples": pos.consumed_samples,
                "saved_global_batch": int(loaded.saved_plan.training["global_batch"]),
                "layout_changed": loaded.layout_changed, "skipped": [str(s) for s in loaded.skipped]}
        return pos.step, pos.consumed_samples, info

    def after_step(self, step: int, consumed: int) -> str | None:
        """Save when ``step`` (steps done) is a multiple of --save-every, or the launcher asked for a checkpoint
        at this step to switch plans (into its --checkpoint-dir); returns the checkpoint path."""
        from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR

        switching = self.stopping(step) and os.environ.get(ENV_CHECKPOINT_DIR)
        if not switching and (not (self.args.save_dir and self.args.save_every) or step % self.args.save_every):
            return None
        from tangram_launch.checkpoint import TrainingPosition, save_checkpoint

        position = TrainingPosition(step=step, consumed_samples=consumed,
                                    data={"seed": self.args.seed, "source": os.path.basename(self.args.data)},
                                    extra=self.extra)
        t0 = time.perf_counter()
        path = save_checkpoint(switching or self.args.save_dir, plan=self.plan, state=self.state, position=position,
                               keep_last=self.args.keep_last)
        self.switch.record_save(step, time.perf_counter() - t0)
        return path

    def stopping(self, step: int) -> bool:
        """Whether the launcher asked the run to stop after this step (saved) to restart under a new plan."""
        return self.switch.stop_at(step)


def train(ctx: Any, data: TokenBatches, *, steps: int, reporter: bool, quiet: bool, tokens_per_step: int,
          first_step: int = 0, consumed: int = 0, checkpointing: Checkpointing | None = None,
          stage: int | None = None) -> dict:
    """Run steps ``first_step+1 .. steps`` of ``ctx.train_step``; returns losses, per-step wall times, position.

    A non-finite loss stops the run before that step is saved (NonFiniteLossError naming the step and stage)."""
    from tangram_launch.launch.numbers import check_loss
    from tangram_launch.worker import slowest_rank_s

    losses, times, step_ids, saved = [], [], [], []
    moe_stats = getattr(ctx, "moe_stats", None)  # MoE routing figures (torch runtime), collective
    for step in range(first_step + 1, steps + 1):  # step k consumes samples [(k-1) * B, k * B) when B is fixed
        batch = data.batch(consumed)
        t0 = time.perf_counter()
        loss = ctx.train_step(batch)
        dt = slowest_rank_s(time.perf_counter() - t0)  # the step's time: the slowest rank's, as run-report.json's
        check_loss(loss, step=step, stage=stage)  # the same loss on every rank: all stop here, nothing saved
        consumed += batch.shape[0]
        losses.append(loss)
        times.append(dt)
        step_ids.append(step)
        if reporter and not quiet:
            print(f"step {step:4d}  loss {loss:.4f}  {tokens_per_step / dt:9.0f} tokens/s  {dt * 1e3:8.1f} ms "
                  "(slowest rank)", flush=True)
        if moe_stats is not None and step == first_step + 1 and steps > step:
            moe_stats()  # reset: the first step also counts the pipeline's shape-inference pass
        if checkpointing is not None:
            path = checkpointing.after_step(step, consumed)
            if path:
                saved.append(path)
                if reporter:
                    print(f"saved {path} (step {step}, {consumed} samples)", flush=True)
            if checkpointing.stopping(step):
                if reporter:
                    print(f"stopping after step {step}: tangram-launch switches plans", flush=True)
                break
    steady = times[1:] or times or [float("nan")]  # the first step includes shape inference and warm-up
    median = statistics.median(steady)
    moe = moe_stats() if moe_stats is not None and step_ids else None
    if moe and reporter:
        print(f"MoE routing, steps {step_ids[1] if len(step_ids) > 1 else step_ids[0]}-{step_ids[-1]}: "
              f"{moe['dropped_fraction']:.1%} of {moe['routed']:.0f} assignments dropped by capacity, busiest expert "
              f"{moe['expert_load_max_over_mean']:.2f}x the mean load", flush=True)
    return {"steps": step_ids, "losses": losses, "iteration_s": times, "median_iteration_s": median,
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / median,
            "consumed_samples": consumed, "saved": saved, "moe": moe}


def run(args: argparse.Namespace, setup: Callable[[Any, Any], Any], runtime: str,
        stage_state: Callable[[Any], Any] = torch_stage_state, checkpoint_extra: dict | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    check_args(args)
    torch.manual_seed(args.seed)
    plan, place = plan_and_place(args.plan)
    if plan.runtime != runtime:  # the adapter is the plan's (plan_adapter): this script drives only its own
        raise SpecError(f"the plan was made for runtime '{plan.runtime}'; this script runs '{runtime}' plans",
                        field="runtime", value=plan.runtime, valid=runtime)
    gb, seq_len = int(plan.training["global_batch"]), int(plan.training["seq_len"])
    data = TokenBatches(args.data, global_batch=gb, seq_len=seq_len, vocab_size=int(plan.model["vocab_size"]),
                        seed=args.seed)
    ctx = setup(plan, place)
    reporter = place.is_last_stage and place.coords["dp"] == 0 and place.coords["tp"] == 0
    ckpt = None
    if args.save_dir or args.resume or os.environ.get("TANGRAM_RESUME_DIR") \
            or os.environ.get("TANGRAM_CHECKPOINT_DIR"):  # tangram-launch --adapt saves there to switch plans
        ckpt = Checkpointing(args, plan, stage_state(ctx), data, extra=checkpoint_extra)
    first_step, consumed, loaded = ckpt.resume() if ckpt is not None else (0, 0, {})
    if reporter and ckpt is not None:
        ckpt.switch.announce_steps(args.steps)  # the launcher's horizon: the steps left
    if reporter:
        print(f"[{runtime}] plan: {plan.num_stages} stage(s) "
              + " | ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} tp{s.tp} dp{s.dp} zero{s.zero_stage} "
                           f"{s.recompute}" for s in plan.stages)
              + f"; global batch {gb} x {seq_len} tokens, {plan.num_microbatches} micro-batches", flush=True)
        if loaded:
            print(f"[{runtime}] resumed from {loaded['path']}: step {first_step}, {consumed} samples consumed"
                  + (f" (global batch {loaded['saved_global_batch']} -> {gb})"
                     if loaded["saved_global_batch"] != gb else "")
                  + ("; layout changed" if loaded["layout_changed"] else ""), flush=True)
    result = train(ctx, data, steps=args.steps, reporter=reporter, quiet=args.quiet, tokens_per_step=gb * seq_len,
                   first_step=first_step, consumed=consumed, checkpointing=ckpt, stage=place.stage.index)
    if reporter:
        if result["losses"]:
            print(f"[{runtime}] steps {first_step + 1}-{args.steps}: loss {result['losses'][0]:.4f} -> "
                  f"{result['losses'][-1]:.4f}, median iteration {result['median_iteration_s'] * 1e3:.1f} ms, "
                  f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
        else:
            print(f"[{runtime}] nothing to train: the run is at step {first_step} of {args.steps}", flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({"runtime": runtime, "plan_stages": [list(s.layers) for s in plan.stages],
                           "resumed": loaded or None, **result}, f, indent=1)
    ctx.close()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def setup(plan, place):
        return plan_adapter(plan).setup(plan, place, seed=args.seed, timeout_s=args.timeout_s,
                                        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr, foreach=False))

    try:
        return run(args, setup, "torch")
    except TangramError as exc:  # one line; bad input ends tangram-launch with exit 2
        from tangram_launch.launch.worker_exit import exit_status_for

        return exit_status_for(exc, prog="train_gpt")


if __name__ == "__main__":
    sys.exit(main())
