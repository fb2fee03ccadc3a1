"""Does the profile time what a training step computes? One process, process CPU time, so other jobs' load on a
shared host hardly moves the ratio (a wall-clock comparison needs a quiet host).

    OMP_NUM_THREADS=1 python benchmarks/bench_step_accounting_cpu.py [--model tiny-moe] [--seq-len 64]
        [--micro-batch 1] [--microbatches 4] [--reps 20]

Times, interleaved, ``--reps`` times each, the median printed:

- ``runtime step``: the torch runtime's whole model (runtime_adapters/gpt.py, every expert local, the MoE
  auxiliary losses on) through ``Schedule1F1B`` on one stage (gloo, world size 1) over ``--microbatches``
  micro-batches, then AdamW (``foreach=False``, as the runtime) and ``zero_grad``;
- ``runtime, no schedule``: the same forward + loss + backward per micro-batch called directly (what the
  pipelining schedule adds is the difference: ~3 ms a step on tiny-moe with 4 or 8 micro-batches alike, which the
  cost model does not charge);
- ``profiled stand-ins``: what the cost model sums per micro-batch from a profile: forward+backward of the
  profiler's layer of each layer's kind (profiler/layer.py), of the embedding and of the head + loss;
- ``AdamW``: the runtime step's optimizer, and what the profile's two optimizer figures predict for it
  (``optimizer_tensor_us`` x tensors + ``optimizer_param_ns`` x parameters, measured here the same way).

The expert-parallel all-to-alls and the data-parallel collectives are not here (one process): the cost model
charges them from the profile's measured wait per call (``collective_wait_us``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    for name in ("seq_len", "micro_batch", "microbatches", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from profiler.bench import BenchConfig, optimizer_param_ns, optimizer_tensor_us
    from profiler.layer import LayerShape, _edge_calls, build_layer
    from runtime_adapters.gpt import StageModule, as_model_spec, lm_loss
    from tangram_launch.specs.model import load_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    spec = as_model_spec(load_model(args.model), moe=True)
    n, b, s = args.microbatches, args.micro_batch, args.seq_len
    cpu = torch.device("cpu")

    module = StageModule(spec, (0, spec.num_layers), has_embedding=True, has_head=True)
    for m in module.moe_layers():  # the runtime's default coefficients (plan.training)
        m.aux_loss_coeff, m.z_loss_coeff = 0.01, 0.001
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    schedule = Schedule1F1B(PipelineStage(module, 0, 1, cpu), n_microbatches=n, loss_fn=lm_loss)
    tokens = torch.randint(0, spec.vocab_size, (n * b, s + 1))  # (n b, T + 1)

    def runtime_step() -> None:
        schedule.step(tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(), losses=[])

    def runtime_direct() -> None:
        for i in range(n):
            rows = tokens[i * b:(i + 1) * b]
            (lm_loss(module(rows[:, :-1]), rows[:, 1:]) / n).backward()

    def optimizer() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    shape = LayerShape(micro_batch=b, seq_len=s, dtype="fp32")
    kinds = [spec.layer_kind(i) for i in range(spec.num_layers)]
    stand = {k: build_layer(spec, k, cpu, "fp32") for k in set(kinds)}
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)  # (B, T, H)
    grad = torch.randn_like(x)
    edges = [_edge_calls(spec, k, shape, cpu)[1] for k in ("embedding", "head")]

    def stand_ins() -> None:
        for _ in range(n):
            for k in kinds:
                stand[k](x).backward(grad)
            for fb in edges:
                fb()

    cfg = BenchConfig("cpu", True, gemm_shape=(8, 8, 8), gemm_dtypes=("fp32",), copy_bytes=2**20,
                      allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=5, comm_reps=3, latency_reps=3,
                      min_rep_s=0.02)
    runtime_step()  # shape inference
    module.zero_grad(set_to_none=True)
    clock = time.process_time
    samples: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, fn in (("runtime step (schedule)", runtime_step), ("AdamW + zero_grad", optimizer),
                         ("runtime, no schedule", runtime_direct), ("profiled stand-ins", stand_ins)):
            t0 = clock()
            fn()
            samples.setdefault(name, []).append(clock() - t0)
        module.zero_grad(set_to_none=True)
    tensor_us = optimizer_tensor_us(cpu, cfg).value
    param_ns = optimizer_param_ns(cpu, cfg, tensor_us).value
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    numel = sum(q.numel() for q in params)
    print(f"{spec.name}: {n} micro-batches of {b} x {s} tokens, one process, CPU ms (median of {args.reps})")
    for k, v in med.items():
        print(f"  {k:26s} {v:8.2f}")
    stand_s, step_s = med["profiled stand-ins"], med["runtime step (schedule)"]
    print(f"  runtime step / stand-ins   {step_s / stand_s:8.3f}   (the schedule adds "
          f"{step_s - med['runtime, no schedule']:.2f} ms a step)")
    predicted_opt = (len(params) * tensor_us * 1e-3 + numel * param_ns * 1e-6)
    print(f"  AdamW predicted            {predicted_opt:8.2f}   ({len(params)} tensors x {tensor_us:.1f} us + "
          f"{numel} parameters x {param_ns:.2f} ns)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
