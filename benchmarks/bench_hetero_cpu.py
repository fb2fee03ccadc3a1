"""An emulated heterogeneous cluster on one CPU host: a balanced pipeline split against a uniform one.

    sudo python benchmarks/bench_hetero_cpu.py [--quota 0.33] [--steps 12] [--layers 8]

Two CPU workers form a 2-stage pipeline (torch adapter, examples/train_gpt.py). Each is pinned to its own core; the
second one runs in a cgroup-v1 ``cpu`` group with a CFS quota (33 % of a core by default: a device about 3x slower;
period 10 ms so the slowdown is even at the scale of one micro-batch).

1. Profile: each worker's core (the slow one inside the cgroup) times forward+backward of the embedding, one
   transformer layer and the head for one micro-batch, and the optimizer step per layer.
2. Balanced plan: the layer split that minimises the predicted 1F1B iteration time
   T = (m - 1) * max_s t_s + sum_s t_s  (t_s: stage s's forward+backward per micro-batch, m micro-batches; the
   1F1B steady state runs at the bottleneck stage, warm-up and drain add one pass of every stage),
   plus the optimizer step. This is a hand-written stand-in for the Tangram planner on a 2-worker chain: the split
   that balances measured per-layer times, as the planner's composition would choose on this cluster.
3. Train the same model with the balanced plan and with the uniform split (same placement, same data); print both
   measured median iteration times, their ratio and the predicted times.

Needs root and a writable /sys/fs/cgroup/cpu (cgroup v1); without it, it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CGROUP_ROOT = "/sys/fs/cgroup/cpu"


def model_dict(layers: int, hidden: int, seq_len: int) -> dict:
    from tangram_launch.specs.model import ModelSpec

    return ModelSpec(name=f"bench-{layers}l-{hidden}h", num_layers=layers, hidden_size=hidden, num_heads=4,
                     num_kv_heads=4, ffn_hidden_size=4 * hidden, vocab_size=256, max_seq_len=seq_len).to_dict()


def make_plan(model: dict, split: tuple[int, int], *, global_batch: int, microbatches: int, seq_len: int):
    from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction

    bounds = [(0, split[0]), (split[0], split[0] + split[1])]
    stages = tuple(Stage(index=i, layers=b, island=("fast", "slow")[i], gpus=((("fast", "slow")[i], 0),),
                         micro_batch_size=global_batch // microbatches, has_embedding=i == 0, has_head=i == 1)
                   for i, b in enumerate(bounds))
    pred = Prediction(0.0, 0.0, 0.0, tuple(StagePrediction(0.0, 0.0, 0.0, 0.0) for _ in stages))
    return Plan(model=model, training={"global_batch": global_batch, "seq_len": seq_len, "dtype": "fp32",
                                       "optimizer": "adamw", "grad_dtype": "fp32"},
                stages=stages, num_microbatches=microbatches, predicted=pred,
                planner={"parallelizer": "bench_hetero_cpu: split balancing measured per-layer times"})


# ---------------------------------------------------------------- child side: the probe
def probe(model: dict, micro_batch: int, seq_len: int, min_s: float) -> dict:
    """Mean forward+backward seconds of embedding, one layer and head for one micro-batch; optimizer per layer.

    Each is timed over a loop of at least ``min_s`` seconds: a CFS quota throttles a process only once it has used
    its share of a period, so short single timings would miss the slowdown the quota imposes on a long run.
    """
    import torch

    from runtime_adapters.gpt import Embedding, Head, TransformerLayer, as_model_spec, lm_loss

    torch.set_num_threads(1)
    spec = as_model_spec(model)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq_len + 1))
    emb, layer, head = Embedding(spec), TransformerLayer(spec, 0), Head(spec)
    hidden = torch.randn(micro_batch, seq_len, spec.hidden_size)

    def timed(fn) -> float:
        fn()  # warm-up
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_s:
            fn()
            n += 1
        return elapsed / n

    def run_emb():
        emb(tokens[:, :-1]).sum().backward()

    def run_layer():
        x = hidden.clone().requires_grad_(True)
        layer(x).sum().backward()

    def run_head():
        x = hidden.clone().requires_grad_(True)
        lm_loss(head(x), tokens[:, 1:]).backward()

    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, foreach=False)
    return {"embedding_s": timed(run_emb), "layer_s": timed(run_layer), "head_s": timed(run_head),
            "optimizer_per_layer_s": timed(opt.step)}


# ---------------------------------------------------------------- parent side
def predict(prof: list[dict], split: tuple[int, int], microbatches: int) -> float:
    """1F1B: (m - 1) * bottleneck + sum of stages, per micro-batch times; plus the slower stage's optimizer step."""
    t0 = prof[0]["embedding_s"] + split[0] * prof[0]["layer_s"]
    t1 = split[1] * prof[1]["layer_s"] + prof[1]["head_s"]
    opt = max(split[0] * prof[0]["optimizer_per_layer_s"], split[1] * prof[1]["optimizer_per_layer_s"])
    return (microbatches - 1) * max(t0, t1) + t0 + t1 + opt


def _preexec(core: int | None, cgroup: str | None):
    def fn() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    return fn


def run_probe(args, model: dict, core: int | None, cgroup: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", json.dumps(model), "--micro-batch",
           str(args.global_batch // args.microbatches), "--seq-len", str(args.seq_len)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, preexec_fn=_preexec(core, cgroup),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_training(args, plan, cores: list[int | None], cgroup: str, workdir: str, name: str) -> dict:
    path = os.path.join(workdir, f"plan-{name}.json")
    plan.dump(path)
    out = os.path.join(workdir, f"result-{name}.json")
    port = 29500 + (os.getpid() % 1000) + (7 if name == "uniform" else 0)
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        cmd = [sys.executable, os.path.join(REPO, "examples", "train_gpt.py"), "--plan", path, "--steps",
               str(args.steps), "--data", "synthetic", "--quiet", "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_preexec(cores[rank], cgroup if rank == 1 else None),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout_s)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name} run failed:\n" + "\n".join(logs))
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quota", type=float, default=0.33, help="CPU share of the slow worker (of one core)")
    p.add_argument("--period-us", type=int, default=10_000,
                   help="CFS period; short, so the slow worker is slowed evenly rather than in 100 ms stalls")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(json.loads(args.probe), args.micro_batch, args.seq_len, min_s=1.0)))
        return 0

    if not os.access(os.path.join(CGROUP_ROOT, "cgroup.procs"), os.W_OK):
        print(f"bench_hetero_cpu: needs root and a writable cgroup-v1 cpu controller at {CGROUP_ROOT}",
              file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    pin = [cores[0], cores[1]] if len(cores) >= 2 else [None, None]
    cgroup = os.path.join(CGROUP_ROOT, f"tangram-bench-slow-{os.getpid()}")
    os.mkdir(cgroup)
    try:
        with open(os.path.join(cgroup, "cpu.cfs_period_us"), "w") as f:
            f.write(str(args.period_us))
        with open(os.path.join(cgroup, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(args.quota * args.period_us)))
        model = model_dict(args.layers, args.hidden, args.seq_len)
        t0 = time.perf_counter()
        prof = [run_probe(args, model, pin[0], None), run_probe(args, model, pin[1], cgroup)]
        profile_s = time.perf_counter() - t0
        splits = [(k, args.layers - k) for k in range(1, args.layers)]
        balanced = min(splits, key=lambda s: predict(prof, s, args.microbatches))
        uniform = (args.layers // 2, args.layers - args.layers // 2)
        kw = dict(global_batch=args.global_batch, microbatches=args.microbatches, seq_len=args.seq_len)
        with tempfile.TemporaryDirectory() as workdir:
            res_bal = run_training(args, make_plan(model, balanced, **kw), pin, cgroup, workdir, "balanced")
            res_uni = run_training(args, make_plan(model, uniform, **kw), pin, cgroup, workdir, "uniform")
    finally:
        os.rmdir(cgroup)  # the workers have exited; an empty cgroup can be removed

    speed = prof[1]["layer_s"] / prof[0]["layer_s"]
    figures = {
        "cores": pin, "quota": args.quota, "profile_s": profile_s, "profile": prof, "slow_over_fast_layer": speed,
        "balanced_split": balanced, "uniform_split": uniform,
        "balanced": {"predicted_s": predict(prof, balanced, args.microbatches),
                     "measured_s": res_bal["median_iteration_s"], "tokens_per_s": res_bal["tokens_per_s"],
                     "loss": [res_bal["losses"][0], res_bal["losses"][-1]]},
        "uniform": {"predicted_s": predict(prof, uniform, args.microbatches),
                    "measured_s": res_uni["median_iteration_s"], "tokens_per_s": res_uni["tokens_per_s"],
                    "loss": [res_uni["losses"][0], res_uni["losses"][-1]]},
    }
    figures["speedup"] = figures["uniform"]["measured_s"] / figures["balanced"]["measured_s"]
    print(f"model {model['name']}, 2 workers on cores {pin}, worker 1 at {args.quota:.0%} of a core "
          f"(measured layer time ratio slow/fast {speed:.2f}); profile {profile_s:.1f} s")
    for name, split in (("balanced", balanced), ("uniform", uniform)):
        f = figures[name]
        err = (f["predicted_s"] - f["measured_s"]) / f["measured_s"]
        print(f"{name:9s} split {split[0]}+{split[1]}: measured {f['measured_s'] * 1e3:7.1f} ms/iter "
              f"({f['tokens_per_s']:.0f} tokens/s), predicted {f['predicted_s'] * 1e3:7.1f} ms ({err:+.0%})")
    print(f"speed-up balanced over uniform: {figures['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
