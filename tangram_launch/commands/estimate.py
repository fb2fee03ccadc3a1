"""Cost of one parallel configuration of a model (slice) on one island: where the time and the memory go.

    tangram-launch estimate --cluster examples/clusters/c3-full-het-ii.yaml --model gpt3-13b --island v100-32gb \\
        --tp 2 --pp 2 --dp 2 --zero 1 --recompute selective --mbs 1 --global-batch 64 --dtype fp16

Prints one column per pipeline stage: compute, recompute and each communication per micro-batch, the per-iteration
gradient sync and optimizer step, and memory per GPU (parameters, gradients, optimizer states, activations times the
micro-batches in flight under 1F1B) against the GPU's capacity, and what the GPU will show in use once the CUDA caching
allocator has reserved its blocks (``--allocator``); then the 1F1B iteration estimate and MFU. Unset
options default to: all layers, all of the island's GPUs as data parallelism, mbs 1, 4 x pp micro-batches, the
model's sequence length, bf16 (fp16 on GPUs without bf16). Exit status 3 when the configuration does not fit
(in GPU memory, or, with --offload, in the host memory of a node whose cluster entry gives ``host_memory_gib``;
or, with --runtime, when that runtime cannot run it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os

from tangram_launch.capabilities import RuntimeCapabilities, capabilities_for
from tangram_launch.costmodel.allocator import ALLOCATOR_KINDS, allocator_kind, reserved_bytes
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.eager_attention import attention_pricing
from tangram_launch.costmodel.host_memory import stage_host_problems
from tangram_launch.costmodel.overlap import DP_OVERLAP_KINDS, TP_OVERLAP_KINDS
from tangram_launch.costmodel.pipeline import iteration_time_s
from tangram_launch.costmodel.slice_plan import SlicePlan, SliceQuery, capacity_bytes
from tangram_launch.errors import SpecError
from tangram_launch.islands import build_islands
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.constants import ATTENTION_KERNEL_HELP, ATTENTION_KERNELS, DTYPES, GIB, RECOMPUTE_MODES
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec
from tangram_launch.text import devices, on_cpu, plural

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, help="ClusterSpec YAML file")
    parser.add_argument("--model", required=True, help="preset name, model YAML or Hugging Face config.json")
    parser.add_argument("--island", help="island name (see `tangram-launch islands`); optional with one island")
    parser.add_argument("--layers", help="slice of transformer layers START:STOP (default: all)")
    for name, helptext in (("tp", "tensor parallel size"), ("pp", "pipeline stages inside the slice"),
                           ("dp", "data parallel size per stage (default: fill the island)"),
                           ("cp", "context parallel size"), ("ep", "expert parallel size (MoE)")):
        parser.add_argument(f"--{name}", type=int, default=None if name == "dp" else 1, help=helptext)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES)
    parser.add_argument("--offload", action="store_true", help="offload the optimizer (state and update) to the host")
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences per DP replica)")
    parser.add_argument("--global-batch", type=int, help="sequences per iteration (default: 4 x pp micro-batches)")
    parser.add_argument("--seq-len", type=int, help="sequence length (default: the model's max_seq_len)")
    parser.add_argument("--memory-headroom", type=float, default=None, metavar="FRACTION",
                        help="fraction of each GPU's memory the estimate leaves free (default 0.05: the memory model is "
                             "an estimate and the allocator needs slack)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="training dtype (default: bf16, or fp16 on GPUs without bf16)")
    parser.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None, help=ATTENTION_KERNEL_HELP)
    parser.add_argument("--dp-overlap", choices=DP_OVERLAP_KINDS, default=None,
                        help="how much of the ZeRO-0/1 data-parallel sync the job's runtime hides under compute: "
                             "grads (PyTorch DDP's buckets, Megatron-core --overlap-grad-reduce), grads-params "
                             "(also --overlap-param-gather); default none, as this project's runtimes run it")
    parser.add_argument("--tp-overlap", choices=TP_OVERLAP_KINDS, default=None,
                        help="which tensor-parallel collectives the job's runtime runs beside a GEMM: backward "
                             "(Megatron's linear layers), pipelined (--tp-comm-overlap, torch AsyncTP); default: as "
                             "--runtime runs it launched here, which the planner prices (megatron: backward; the "
                             "others, or no --runtime: none)")
    parser.add_argument("--stages-after", type=int, default=0,
                        help="pipeline stages that follow this slice in the global plan (memory position)")
    parser.add_argument("--runtime", help="also check the configuration against a runtime's capabilities")
    parser.add_argument("--allocator", choices=ALLOCATOR_KINDS, default=None,
                        help="the CUDA caching allocator the run will use, for the memory nvidia-smi will show "
                             "(default: read from PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: 'expandable' with "
                             "expandable_segments:True, else 'caching')")
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _parse_layers(text: str | None, num_layers: int) -> tuple[int, int]:
    if not text:
        return 0, num_layers
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SpecError("expected START:STOP", field="--layers", value=text, valid=f"e.g. 0:{num_layers}") from None
    if not 0 <= a < b <= num_layers:
        raise SpecError("layer range out of bounds", field="--layers", value=text,
                        valid=f"0 <= START < STOP <= {num_layers}")
    return a, b


def _positive(value, name: str) -> None:
    if value is not None and value < 1:
        raise SpecError("must be a positive integer", field=f"--{name}", value=value)


def build(args: argparse.Namespace):
    """(coster, config, query) for the command line (shared with tests)."""
    cluster = ClusterSpec.load(args.cluster)
    model = load_model(args.model)
    iset = build_islands(cluster, dtype=args.dtype or "bf16")
    if args.island:
        island = iset.by_name(args.island)
    elif len(iset.islands) == 1:
        island = iset.islands[0]
    else:
        raise SpecError("the cluster has several islands: choose one", field="--island",
                        valid=", ".join(i.name for i in iset.islands))
    dtype = args.dtype or ("bf16" if island.gpu.tflops.get("bf16") else "fp16")
    for name in ("tp", "pp", "dp", "cp", "ep", "mbs", "global_batch", "seq_len"):
        _positive(getattr(args, name), name.replace("_", "-"))
    layers = _parse_layers(args.layers, model.num_layers)
    tp, pp, cp = args.tp, args.pp, args.cp
    dp = args.dp
    if dp is None:
        dp = max(1, island.num_gpus // (tp * pp * cp))
    b = args.mbs * dp
    global_batch = args.global_batch or b * 4 * pp
    seq_len = args.seq_len or model.max_seq_len
    from tangram_launch.launch.preflight import check_seq_len

    check_seq_len(model, seq_len, field="--seq-len")  # as plan and the launcher refuse it
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                            attention_kernel=args.attention_kernel or "auto",
                            **({} if args.memory_headroom is None else
                               {"memory_headroom_fraction": args.memory_headroom}))
    if global_batch % b:
        raise SpecError(f"global batch must be a multiple of mbs x dp = {b}", field="--global-batch",
                        value=global_batch)
    caps = capabilities_for(args.runtime) if args.runtime else RuntimeCapabilities(name="any")
    q = SliceQuery(model=model, training=training, layers=layers, island=island, microbatch_sequences=b,
                   capabilities=caps, pipelined=pp > 1 or args.stages_after > 0 or layers != (0, model.num_layers))
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=args.ep, zero_stage=args.zero, recompute=args.recompute,
                         offload=args.offload)
    coster = SliceCoster(q, dp_overlap=getattr(args, "dp_overlap", None), tp_overlap=getattr(args, "tp_overlap", None))
    if coster.device_error:
        raise SpecError(coster.device_error, field="--dtype", value=dtype)
    return coster, cfg, q


def run(args: argparse.Namespace) -> int:
    from tangram_launch.specs.limits import check_cli_args

    check_cli_args(args)  # bad numbers and output paths: exit 2 before any work
    coster, cfg, q = build(args)
    plan = coster.plan(cfg, parallelizer="estimate")
    m = q.num_microbatches
    cap = capacity_bytes(q.island, q.training)
    after = args.stages_after
    n = len(plan.stages)
    est = iteration_time_s(plan.stages, m)
    flops = sum(3.0 * s.breakdown["forward_flops"] * s.num_gpus for s in plan.stages) * m
    mfu = flops / (est["iteration_s"] * plan.num_gpus * coster.dev.peak_flops)
    fits = plan.fits(after, m, cap)
    allocator = args.allocator or allocator_kind(os.environ)
    shown = shown_bytes(plan, coster, stages_after=after, num_microbatches=m, allocator=allocator)
    host_problems = stage_host_problems(plan.stages, q.island.host_memory)  # offload beyond the node's host RAM
    problems: list[str] = []
    if args.runtime:  # every stage has the same shape: check one, then the cross-stage rules
        problems = q.capabilities.stage_problems(plan.stages[0].shape, pipelined=q.pipelined)
        problems += q.capabilities.pipeline_problems([s.shape for s in plan.stages])
        problems += q.capabilities.overlap_problems(dp_overlap=coster.dp_overlap, tp_overlap=coster.tp_overlap)
    dev = coster.dev
    attention = attention_pricing(dev.flash_attention, dev.mem_efficient_attention, dev.eager_attention)
    if args.format == "json":
        out = {
            "island": q.island.name, "model": q.model.name, "layers": list(q.layers), "config": cfg.describe(),
            "micro_batch_size": plan.stages[0].micro_batch_size, "num_microbatches": m,
            "global_batch": q.training.global_batch, "seq_len": q.training.seq_len, "dtype": q.training.dtype,
            "num_gpus": plan.num_gpus, "capacity_gib": cap / GIB, "fits": fits, "mfu": mfu,
            "allocator": allocator, "dp_overlap": coster.dp_overlap, "tp_overlap": coster.tp_overlap,
            "attention": attention,
            "runtime_problems": problems, "host_memory_problems": host_problems,
            **est,
            "stages": [{"layers": list(s.layers), "forward_s": s.forward_s, "backward_s": s.backward_s,
                        "dp_sync_s": s.dp_sync_s, "optimizer_s": s.optimizer_s,
                        "static_bytes": s.static_bytes, "activation_bytes": s.activation_bytes,
                        "peak_memory_gib": s.memory_bytes(after + n - 1 - j, m) / GIB,
                        "reserved_memory_gib": shown[j] / GIB,
                        "breakdown": s.breakdown} for j, s in enumerate(plan.stages)],
        }
        print(json.dumps(out, indent=2))
    else:
        isl = q.island
        print(f"{q.model.name} layers {q.layers[0]}:{q.layers[1]} on island {isl.name} "
              f"({isl.num_gpus} x {isl.gpu.type}, {isl.gpu.memory_gib:g} GiB; using "
              f"{devices(plan.num_gpus, cpu=on_cpu([isl.gpu.type]))})")
        print(f"{cfg.describe()}  mbs={plan.stages[0].micro_batch_size}")
        print(f"global batch {q.training.global_batch} = {plural(m, 'micro-batch')} x "
              f"{plural(q.microbatch_sequences, 'sequence')}; "
              f"seq {q.training.seq_len}; {q.training.dtype}; {after} stages after this slice")
        if coster.dp_overlap != "none" or coster.tp_overlap != "none":
            print(f"overlap: data-parallel sync {coster.dp_overlap}, tensor-parallel collectives {coster.tp_overlap}")
        print(f"attention: {attention}")
        print()
        print(format_breakdown(plan, num_microbatches=m, capacity_bytes=cap, stages_after=after,
                               shown_bytes=shown, allocator=allocator))
        print()
        print(f"iteration estimate (1F1B, this slice alone): {est['iteration_s']:.3f} s = pipeline "
              f"{est['pipeline_s']:.3f} s (bubble {est['bubble_s']:.3f} s) + sync/optimizer {est['sync_s']:.3f} s")
        print(f"tokens/s {q.training.tokens_per_iteration / est['iteration_s']:.0f}; MFU {100 * mfu:.1f} % "
              f"(model FLOPs, causal attention, no recompute, of {coster.dev.peak_flops / 1e12:g} TFLOP/s peak)")
        for p in problems:
            print(f"runtime '{args.runtime}' cannot run this: {p}")
        if not fits:
            print("does NOT fit: peak memory exceeds the GPU's capacity (see 'fits' above)")
        for p in host_problems:
            print(f"does NOT fit in host memory: {p}")
    return 0 if fits and not problems and not host_problems else 3


def shown_bytes(plan: SlicePlan, coster: SliceCoster, *, stages_after: int, num_microbatches: int,
                allocator: str) -> list[float]:
    """Per stage, the memory a GPU will show in use (costmodel/allocator.py): the allocator's reserve for the peak
    the stage needs, plus the runtime's overhead. A CPU "device" has no CUDA allocator: its need as is."""
    n = len(plan.stages)
    peaks = [s.memory_bytes(stages_after + n - 1 - j, num_microbatches) for j, s in enumerate(plan.stages)]
    if coster.dev.is_cpu:
        return peaks
    device = coster.q.island.gpu.physical_memory_gib * GIB
    return [reserved_bytes(x, overhead_bytes=coster.overhead_bytes, device_bytes=device, allocator=allocator)
            for x in peaks]


def format_breakdown(plan: SlicePlan, *, num_microbatches: int, capacity_bytes: float, stages_after: int = 0,
                     shown_bytes: list[float] | None = None, allocator: str = "caching") -> str:
    """A table, one column per stage: where time (ms per micro-batch) and memory (GiB per GPU) go; with
    ``shown_bytes``, also what the GPU will show in use under ``allocator`` (the fit is judged on the peak)."""
    cols = [f"stage {j}" for j in range(len(plan.stages))]
    n = len(plan.stages)
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, values: list[str]) -> None:
        rows.append((label, values))

    def ms(x: float) -> str:
        return f"{x * 1e3:.2f}"

    def gib(x: float) -> str:
        return f"{x / GIB:.2f}"

    st = plan.stages
    add("layers", [f"{s.layers[0]}:{s.layers[1]}" + ("+emb" if s.breakdown.get("has_embedding") else "")
                   + ("+head" if s.breakdown.get("has_head") else "") for s in st])
    add("GPUs (tp x cp x dp)", [f"{s.num_gpus} ({s.shape.tp}x{s.shape.cp}x{s.shape.dp})" for s in st])
    add("micro-batch size", [str(s.micro_batch_size) for s in st])
    add("-- time per micro-batch (ms)", ["" for _ in st])
    for key, label in (("compute_forward_s", "compute forward"), ("compute_backward_s", "compute backward"),
                       ("recompute_s", "recompute"), ("tp_comm_s", "TP comm"), ("cp_comm_s", "CP comm (exposed)"),
                       ("ep_comm_s", "EP all-to-all"), ("zero_comm_s", "ZeRO comm (transfers)"),
                       ("zero_comm_exposed_s", "ZeRO comm (exposed)"),
                       ("zero_contention_s", "ZeRO comm (slows compute)"),
                       ("fsdp_host_s", "FSDP2 unit overhead"),
                       ("p2p_s", "pipeline p2p")):
        add("  " + label, [ms(s.breakdown.get(key, 0.0)) for s in st])
    add("  forward", [ms(s.forward_s) for s in st])
    add("  backward", [ms(s.backward_s) for s in st])
    add("  stage total", [ms(s.time_s) for s in st])
    add("-- per iteration (ms)", ["" for _ in st])
    add("  DP gradient sync", [ms(s.dp_sync_s) for s in st])
    add("  optimizer step", [ms(s.optimizer_s) for s in st])
    add("-- memory per GPU (GiB)", ["" for _ in st])
    for key, label in (("parameters_bytes", "parameters"), ("gradients_bytes", "gradients"),
                       ("optimizer_bytes", "optimizer states"), ("working_bytes", "working set"),
                       ("overhead_bytes", "runtime overhead")):
        add("  " + label, [gib(s.breakdown.get(key, 0.0)) for s in st])
    held = [s.breakdown.get("autocast_held_copies_bytes", 0.0) for s in st]
    if any(held):  # ZeRO-0 stages of the torch runtime: autocast's casts kept for the step
        add("  16-bit weight copies (kept all step)", [gib(x) for x in held])
    inflight = [min(stages_after + n - j, num_microbatches) for j in range(n)]
    add("  activations / micro-batch", [gib(s.activation_bytes) for s in st])
    copies = [s.breakdown.get("autocast_copies_bytes", 0.0) for s in st]
    if any(copies):  # ZeRO-0 stages of the torch runtime under autocast (RuntimeCapabilities.autocast_fp32_weights)
        add("    of which 16-bit weight copies", [gib(x) for x in copies])  # full recompute: the output layer's
    add("  micro-batches in flight", [str(k) for k in inflight])
    peaks = [s.memory_bytes(stages_after + n - 1 - j, num_microbatches) for j, s in enumerate(st)]
    add("  peak", [gib(x) for x in peaks])
    add("  capacity less headroom", [gib(capacity_bytes) for _ in st])
    add("  fits", ["yes" if x <= capacity_bytes else "NO" for x in peaks])
    if shown_bytes is not None:
        add(f"  shown in use ({allocator} allocator)", [gib(x) for x in shown_bytes])
    host = [s.breakdown.get("host_offload_bytes", 0.0) for s in st]
    if any(host):
        add("  offloaded to host", [gib(x) for x in host])
        add("  PCIe per iteration", [gib(s.breakdown.get("offload_pcie_bytes", 0.0)) for s in st])
    width0 = max(len(r[0]) for r in rows)
    widths = [max(len(cols[c]), *(len(r[1][c]) for r in rows)) for c in range(n)]
    lines = ["".ljust(width0) + "  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for label, values in rows:
        lines.append(label.ljust(width0) + "  " + "  ".join(v.rjust(w) for v, w in zip(values, widths)))
    return "\n".join(lines)
