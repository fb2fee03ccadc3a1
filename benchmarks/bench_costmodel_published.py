"""The cost model held against published training measurements (issue 13, item 4): predicted vs published
iteration time and per-GPU peak memory, row by row, then the median absolute errors.

    PYTHONPATH=. python benchmarks/bench_costmodel_published.py [--data benchmarks/data/published_runs.yaml]
        [--only TEXT] [--split all|dev|validation] [--json] [--fit] [--unseal [COHORT ...]]

Each row of the data file (see its header) is costed through the project's public API, as
`tangram-launch estimate` does for one configuration: a ModelSpec (preset or the file's `models:`), one island
of `num_gpus` catalog GPUs (`gpus_per_node` per node, the row's node-to-node bandwidth), a TrainingSpec, a
SliceQuery over all layers and a ParallelConfig; SliceCoster.plan + iteration_time_s give the 1F1B iteration
time, the largest StageCost.memory_bytes over the stages the peak memory per GPU.

Both sides are compared as seconds per iteration: a published tokens/s per GPU becomes global_batch x seq_len /
(tokens/s x GPUs); a published TFLOP/s per GPU (or aggregate PFLOP/s) becomes the FLOPs of one iteration counted
*with the source's own convention* (flop_conventions in the data file: Narayanan's hardware count incl. recompute,
6N + 12lhs, ...) divided by that rate. Error = (predicted - published) / published: positive = the model predicts
slower (time) or more memory than measured. Memory is compared the way the source measured it (memory_conventions
in the data file): torch's reserved peak leaves out the CUDA context and NCCL's buffers, nvidia-smi counts them.

Rows today's cost model cannot express (FP8, interleaved 1F1B, per-layer selective checkpointing, ...) are listed
as `not expressible: <reason>` and left out of the medians; where only the schedule or the FP8 GEMMs are missing,
the row is also costed as plain 1F1B / bf16 and that error is shown in brackets, to size what the missing feature is
worth. Medians are given for the development and the validation split side by side (the rule that draws them is
the data file's `validation_split`; validation is also shown by cohort: rows in the file when the split was drawn and
rows added afterwards; rows of a sealed cohort, gathered blind, are costed only with --unseal), then overall, for
the rows the constants were fitted on (subset: fit) and for the held-out rest, and per GPU type, framework family,
dense/MoE and technique. A ceiling analysis says how much of the error one constant per GPU type, framework family
or source could remove at best (each group scaled by its own median ratio, chosen on the rows it is judged on: an
oracle, not a model). `--fit` re-fits each constant of the file's `fitted_constants:` on its named rows and prints
the fitted next to the shipped value.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
from typing import Any, Collection

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tangram_launch.capabilities import RuntimeCapabilities  # noqa: E402
from tangram_launch.costmodel.allocator import ALLOCATOR_KINDS, reserved_bytes  # noqa: E402
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster  # noqa: E402
from tangram_launch.costmodel.pipeline import iteration_time_s, stage_memory_bytes  # noqa: E402
from tangram_launch.costmodel.compute import RECOMPUTE_MODES  # noqa: E402
from tangram_launch.costmodel.efficiency import GIB  # noqa: E402
from tangram_launch.errors import SpecError  # noqa: E402
from tangram_launch.islands import Island  # noqa: E402
from tangram_launch.parallelizers.base import SliceQuery, capacity_bytes  # noqa: E402
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, LinkSpec  # noqa: E402
from tangram_launch.specs.model import ModelSpec, load_model  # noqa: E402
from tangram_launch.specs.training import DTYPE_BYTES, TrainingSpec  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published_runs.yaml")
# memory_only: the source publishes per-GPU memory and no time (value null): the row counts in the memory medians only
PUBLISHED_METRICS = ("iteration_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "pflops_total", "memory_only")
FLOP_FORMULAS = ("megatron-hw", "megatron-model", "6n-12lhs", "model-causal", "model-noncausal")
SCHEDULES = ("1F1B", "interleaved-1F1B")
KERNELS = ("fused", "eager")  # element-wise kernels: fused (Megatron/TE, torch.compile) or eager PyTorch
# What the source's runtime did that the planner's defaults do not assume (SliceCoster's keywords of the same names):
# TP without sequence parallelism, torchtitan's op-level selective checkpointing, 16-bit .grad tensors kept all step,
# the loss's implementation, FP8 GEMM inputs kept in 16 bit (torchao's Float8Linear; default in FP8: Transformer
# Engine), what the runtime stores per parameter (memory.MODEL_STATE_KINDS), column-parallel GEMM inputs saved whole
# (DTensor TP), the MoE runtime's keys, the attention kernel, the allocator, and which DP / TP collectives the
# runtime overlaps with compute (overlap.DP_OVERLAP_KINDS, overlap.TP_OVERLAP_KINDS), and whether its layers run under
# autocast (what a composed activation keeps: memory.composed_activation_saved_bytes).
RUNTIME_KEYS = ("sequence_parallel", "selective_policy", "keeps_param_dtype_grads", "cross_entropy", "fp8_gemm_inputs",
                "model_states", "whole_column_inputs", "expert_tensor_parallel", "moe_dispatcher",
                "moe_permute_fusion", "moe_probs_on_output", "attention_kernel", "allocator", "dp_overlap",
                "tp_overlap", "autocast")
INTER_NODE_LATENCY_US = 2.0


# ------------------------------------------------------------------------------------------------ data file
def load_data(path: str = DATA) -> dict:
    """The data file, parsed by libyaml where PyYAML has it (the same safe constructor, several times faster on a
    file of this size: the unit tests read it in several places)."""
    with open(path, encoding="utf-8") as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def resolve_model(name: str, data: dict) -> ModelSpec:
    """A key of the file's `models:` (ModelSpec keys) or a packaged preset name."""
    spec = (data.get("models") or {}).get(name)
    if spec is not None:
        return ModelSpec.from_dict({"name": name, **spec}, source=f"published_runs.yaml models.{name}")
    return load_model(name)


GPU_OVERRIDE_KEYS = ("memory_gib", "memory_bandwidth_GBps")


def gpu_spec(gpu_type: str, overrides: dict | None = None):
    """The catalog's GPUSpec for a type name, through the ClusterSpec parser (as a cluster file would get it), with
    the row's `gpu_overrides` (a variant of the catalog part the source describes, e.g. a 96 GB H100) applied as a
    cluster file's node-level figures."""
    node = {"name": "n0", "gpu": gpu_type, "count": 1}
    node.update({k: v for k, v in (overrides or {}).items() if k in GPU_OVERRIDE_KEYS})
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}}, "nodes": [node]})
    return spec.nodes[0].gpus[0]


def make_island(row: dict) -> Island:
    """One homogeneous island of the row's GPUs (what build_islands gives for such a cluster), built directly so
    that 16k-GPU rows stay cheap."""
    n = int(row["num_gpus"])
    per_node = min(int(row.get("gpus_per_node", 8)), n)
    nodes = tuple(f"n{i}" for i in range(math.ceil(n / per_node)))
    gpus = tuple(GpuRef(node, k) for node in nodes for k in range(per_node))[:n]
    link = LinkSpec(float(row.get("inter_node_gbps", 25.0)), INTER_NODE_LATENCY_US) if len(nodes) > 1 else None
    return Island(name=row["gpu"], nodes=nodes, gpus=gpus, gpus_per_node=per_node,
                  gpu=gpu_spec(row["gpu"], row.get("gpu_overrides")), inter_node_link=link)


# ------------------------------------------------------------------------------------------------ dev / validation
SPLITS = ("dev", "validation")
# Blind validation batches, each gathered after the cohorts before it had been seen (a new batch is added here
# only; the tests read this list); each gets a median column of its own once costed.
BLIND_COHORTS = ("fresh", "blind2", "blind3", "blind4", "blind5", "blind6", "blind7", "blind8", "blind9", "blind10",
                 "blind11", "blind12")
# Cohorts added after the split was drawn that are always validation (the data file's rules 2 and 2c to 2n).
VALIDATION_COHORTS = ("unseen",) + BLIND_COHORTS
COHORTS = ("original", "unseen", "moe-dev") + BLIND_COHORTS
# Cohorts no one has seen the model predict (the data file's `sealed_cohorts:`): left out unless --unseal, so that
# they can still validate a change made while looking at every other row.


def sealed_cohorts(data: dict) -> tuple[str, ...]:
    return tuple(data.get("sealed_cohorts") or ())


def _id_digest(row_id: str) -> str:
    return hashlib.sha256(row_id.encode("utf-8")).hexdigest()


def original_ids_sha256(ids: list[str]) -> str:
    """The fingerprint of the original cohort (`validation_split.original_ids_sha256`): sorted ids, newline-joined."""
    return hashlib.sha256("\n".join(sorted(ids)).encode("utf-8")).hexdigest()


def draw_split(runs: list[dict], generation_of_gpu: dict, fit_when_drawn: Collection[str]) -> dict[str, str]:
    """Row id -> dev | validation by the data file's `validation_split` rule, which reads only a row's id, GPU and
    cohort: the rows a constant was fitted on when the split was drawn (`fit_rows_when_drawn`: a constant retired
    since does not move its rows) are dev, unseen and blind (BLIND_COHORTS) rows validation (the blind ones gathered
    from sources no other row cites, after the rows before them had been seen), moe-dev rows (MoE + EP runs gathered
    as development evidence, from sources no validation row cites) dev, and the other original rows of each GPU
    generation, ordered by the SHA-256 of their id, are validation at positions 0, 3, 6, ... (a third per
    generation)."""
    split: dict[str, str] = {}
    by_generation: dict[str, list[str]] = {}
    for r in runs:
        if r["id"] in fit_when_drawn:
            split[r["id"]] = "dev"
        elif r.get("cohort") in VALIDATION_COHORTS:
            split[r["id"]] = "validation"
        elif r.get("cohort") == "moe-dev":
            split[r["id"]] = "dev"
        else:
            by_generation.setdefault(generation_of_gpu[r["gpu"]], []).append(r["id"])
    for ids in by_generation.values():
        for i, rid in enumerate(sorted(ids, key=_id_digest)):
            split[rid] = "validation" if i % 3 == 0 else "dev"
    return split


# ------------------------------------------------------------------------------------------------ conventions
def iteration_flops(formula: str, model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """FLOPs of one iteration as the source counts them (see flop_conventions in the data file)."""
    b, s = global_batch, seq_len
    l, h, v = model.num_layers, model.hidden_size, model.vocab_size
    if formula == "megatron-hw":  # Narayanan et al. 2021 eq. (3): incl. the recompute forward, non-causal
        return 96.0 * b * s * l * h * h * (1 + s / (6.0 * h) + v / (16.0 * l * h))
    if formula == "megatron-model":  # Korthikanti et al. 2022: model FLOPs, no recompute
        return 72.0 * b * s * l * h * h * (1 + s / (6.0 * h) + v / (12.0 * l * h))
    if formula == "6n-12lhs":  # PaLM / torchtitan / llm-foundry: 6N + 12 l h s per token (non-causal)
        n = model.active_params() if model.is_moe else model.total_params()
        return (6.0 * n + 12.0 * l * h * s) * b * s
    if formula in ("model-causal", "model-noncausal"):  # this project's matmul count (top-k experts), x3 for training
        return 3.0 * model.forward_flops_per_token(s, causal=formula == "model-causal") * b * s
    raise ValueError(f"unknown FLOP formula {formula!r} (known: {', '.join(FLOP_FORMULAS)})")


def published_iteration_s(row: dict, data: dict, model: ModelSpec) -> float | None:
    """The published figure as seconds per iteration (converted with the source's own FLOP convention); None where
    the source publishes memory only."""
    pub, par = row["published"], row["parallel"]
    if pub["metric"] == "memory_only":
        return None
    metric, value = pub["metric"], float(pub["value"])
    n, b, s = int(row["num_gpus"]), int(par["global_batch"]), int(par["seq_len"])
    if metric == "iteration_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return b * s / (value * n)
    formula = data["flop_conventions"][row["flop_convention"]].get("formula")
    if not formula:
        raise ValueError(f"{row['id']}: convention {row['flop_convention']!r} has no formula for {metric}")
    flops = iteration_flops(formula, model, b, s)
    if metric == "tflops_per_gpu":
        return flops / (value * 1e12 * n)
    if metric == "pflops_total":
        return flops / (value * 1e15)
    raise ValueError(f"{row['id']}: unknown metric {metric!r}")


# ------------------------------------------------------------------------------------------------ expressibility
def not_expressible(row: dict) -> str | None:
    """Why today's cost model cannot cost the row as it ran (None: it can)."""
    reasons = []
    if row.get("not_expressible"):
        reasons.append(str(row["not_expressible"]))
    par = row["parallel"]
    if par.get("dtype") not in DTYPE_BYTES and not row.get("not_expressible"):
        reasons.append(f"dtype {par.get('dtype')} (the cost model has {', '.join(DTYPE_BYTES)})")
    if par.get("schedule", "1F1B") not in SCHEDULES and not row.get("not_expressible"):
        reasons.append(f"schedule {par.get('schedule')}")
    if (par.get("schedule", "1F1B") == "interleaved-1F1B" and not par.get("virtual_stages")
            and not row.get("not_expressible")):
        reasons.append("interleaved 1F1B with an unpublished number of virtual stages")
    if par.get("recompute", "none") not in RECOMPUTE_MODES and not row.get("not_expressible"):
        reasons.append(f"recompute {par.get('recompute')}")
    return "; ".join(reasons) or None


def approximation(row: dict) -> dict | None:
    """The nearest expressible configuration when only the schedule or FP8 is missing (plain 1F1B, bf16), to size
    what the missing feature is worth; None when something else is missing too."""
    par = dict(row["parallel"])
    if par.get("recompute", "none") not in RECOMPUTE_MODES:
        return None
    changed = []
    if par.get("schedule", "1F1B") != "1F1B":
        par["schedule"] = "1F1B"
        par.pop("virtual_stages", None)
        changed.append("plain 1F1B")
    if par.get("dtype") not in DTYPE_BYTES:
        par["dtype"] = "bf16"
        changed.append("bf16")
    if not changed:
        return None
    return {**row, "parallel": par, "not_expressible": None, "_approx": " + ".join(changed)}


# ------------------------------------------------------------------------------------------------ prediction
def predict(row: dict, model: ModelSpec) -> dict:
    """Predicted iteration time (s) and peak memory per GPU (GiB) through the public cost-model API."""
    par = row["parallel"]
    tp, pp, dp = int(par.get("tp", 1)), int(par.get("pp", 1)), int(par.get("dp", 1))
    cp, ep = int(par.get("cp", 1)), int(par.get("ep", 1))
    mbs, n = int(par.get("mbs", 1)), int(row["num_gpus"])
    if tp * pp * dp * cp != n:
        raise SpecError(f"tp*pp*dp*cp = {tp * pp * dp * cp} != num_gpus {n}", field="parallel")
    training = TrainingSpec(global_batch=int(par["global_batch"]), seq_len=int(par["seq_len"]), dtype=par["dtype"])
    island = make_island(row)
    q = SliceQuery(model=model, training=training, layers=(0, model.num_layers), island=island,
                   microbatch_sequences=mbs * dp, capabilities=RuntimeCapabilities(name="any"), pipelined=pp > 1)
    if training.global_batch % (mbs * dp):
        raise SpecError(f"global batch {training.global_batch} is not a multiple of mbs x dp = {mbs * dp}",
                        field="parallel")
    kernels = row.get("kernels", "fused")
    if kernels not in KERNELS:
        raise SpecError(f"kernels {kernels!r} (known: {', '.join(KERNELS)})", field="kernels")
    runtime = row.get("runtime") or {}
    unknown = sorted(set(runtime) - set(RUNTIME_KEYS))
    if unknown:
        raise SpecError(f"unknown runtime keys {unknown} (known: {', '.join(RUNTIME_KEYS)})", field="runtime")
    coster = SliceCoster(q, flash_attention=row.get("flash_attention"), fused_elementwise=kernels == "fused",
                         sequence_parallel=bool(runtime.get("sequence_parallel", True)),
                         selective_policy=runtime.get("selective_policy", "megatron"),
                         keeps_param_dtype_grads=bool(runtime.get("keeps_param_dtype_grads", False)),
                         cross_entropy=runtime.get("cross_entropy", "fused"),
                         fp8_gemm_inputs=bool(runtime.get("fp8_gemm_inputs", True)),
                         model_states=runtime.get("model_states", "mixed"),
                         whole_column_inputs=bool(runtime.get("whole_column_inputs", False)),
                         expert_tensor_parallel=runtime.get("expert_tensor_parallel"),
                         moe_dispatcher=runtime.get("moe_dispatcher", "alltoall"),
                         moe_permute_fusion=bool(runtime.get("moe_permute_fusion", False)),
                         moe_probs_on_output=bool(runtime.get("moe_probs_on_output", True)),
                         attention_kernel=runtime.get("attention_kernel", "auto"),
                         dp_overlap=runtime.get("dp_overlap", "none"),
                         tp_overlap=runtime.get("tp_overlap", "none"),
                         autocast=bool(runtime.get("autocast", True)))
    if coster.device_error:
        raise SpecError(coster.device_error, field="dtype")
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=int(par.get("zero", 0)),
                         recompute=par.get("recompute", "none"))
    plan = coster.plan(cfg, parallelizer="published-bench")
    m = q.num_microbatches
    v = int(par.get("virtual_stages", 1)) if par.get("schedule", "1F1B") == "interleaved-1F1B" else 1
    if v > 1 and min(st.layers[1] - st.layers[0] for st in plan.stages) < v:
        raise SpecError(f"{v} virtual stages need at least {v} layers per stage", field="virtual_stages")
    est = iteration_time_s(plan.stages, m, v)
    k = len(plan.stages)
    mems = [stage_memory_bytes(st, k - 1 - j, k, m, v) for j, st in enumerate(plan.stages)]
    top = max(range(k), key=mems.__getitem__)
    peak = mems[top]
    flops = sum(3.0 * st.breakdown["forward_flops"] * st.num_gpus for st in plan.stages) * m
    return {"iteration_s": est["iteration_s"], "bubble_s": est["bubble_s"], "sync_s": est["sync_s"],
            "peak_gib": peak / GIB, "capacity_gib": capacity_bytes(island, reserve_fraction=0.0) / GIB,
            "overhead_gib": plan.stages[top].breakdown["overhead_bytes"] / GIB,
            "mfu": flops / (est["iteration_s"] * n * coster.dev.peak_flops)}


MEMORY_CONVENTIONS = ("device-used", "allocator-reserved", "allocator-allocated", "stated")


def row_allocator(row: dict, data: dict) -> str:
    """The allocator the row's runs used (costmodel/allocator.py): the row's runtime.allocator, else its source's
    entry in the data file's `allocators:`, else torch's default, the caching allocator without expandable
    segments."""
    runtime = row.get("runtime") or {}
    kind = runtime.get("allocator") or (data.get("allocators") or {}).get(row["source"]["ref"], "caching")
    if kind not in ALLOCATOR_KINDS:
        raise ValueError(f"{row['id']}: allocator {kind!r} (known: {', '.join(ALLOCATOR_KINDS)})")
    return kind


def comparable_memory_gib(p: dict, row: dict, data: dict) -> float:
    """The prediction counted the way the source measured (memory_conventions in the data file): what the caching
    allocator reserves for the bytes the plan needs (costmodel/allocator.py, by the row's allocator), with the CUDA
    context and NCCL's buffers, or without them where torch's max_memory_reserved was read (they live outside the
    caching allocator: the peak stage's overhead_bytes); where torch's max_memory_allocated was read, the bytes the
    plan needs without either."""
    conv = row["published"].get("memory_convention", "stated")
    if conv not in MEMORY_CONVENTIONS:
        raise ValueError(f"{row['id']}: memory_convention {conv!r} (known: {', '.join(MEMORY_CONVENTIONS)})")
    spec = data.get("memory_conventions", {}).get(conv, {})
    if spec.get("excludes_allocator_reserve"):  # max_memory_allocated: the live tensors, no cached blocks
        return p["peak_gib"] - p["overhead_gib"]
    shown = reserved_bytes(p["peak_gib"] * GIB, overhead_bytes=p["overhead_gib"] * GIB,
                           device_bytes=p["capacity_gib"] * GIB, allocator=row_allocator(row, data)) / GIB
    if spec.get("excludes_runtime_overhead"):
        return shown - p["overhead_gib"]
    return shown


def pct(pred: float, pub: float | None) -> float | None:
    return None if pub is None else 100.0 * (pred - pub) / pub


# per-source runtime defaults of the data file: (its map, the runtime key each entry sets)
SOURCE_DEFAULTS = (("attention_kernels", "attention_kernel"), ("dp_overlaps", "dp_overlap"),
                   ("tp_overlaps", "tp_overlap"))


def with_source_defaults(row: dict, data: dict) -> dict:
    """The row with its source's defaults (SOURCE_DEFAULTS: the data file's attention_kernels:, dp_overlaps: and
    tp_overlaps:), each unless the row names its own."""
    runtime = row.get("runtime") or {}
    added = {}
    for table, key in SOURCE_DEFAULTS:
        value = (data.get(table) or {}).get(row["source"]["ref"])
        if value is not None and key not in runtime:
            added[key] = value
    return {**row, "runtime": {**runtime, **added}} if added else row


def evaluate(row: dict, data: dict) -> dict:
    row = with_source_defaults(row, data)
    out: dict[str, Any] = {"id": row["id"], "subset": row.get("subset", "held-out"), "split": row.get("split", ""),
                           "cohort": row.get("cohort", "original"), "gpu": row["gpu"],
                           "num_gpus": row["num_gpus"], "framework": row.get("framework", ""),
                           "verified": row.get("verified"), "source": row["source"]["ref"]}
    model = resolve_model(row["model"], data)
    out["moe"] = model.is_moe
    out["parallel"] = dict(row["parallel"])
    par = row["parallel"]
    out["config"] = (f"{row['num_gpus']}x{row['gpu']} tp{par.get('tp', 1)} pp{par.get('pp', 1)} dp{par.get('dp', 1)}"
                     + (f" cp{par['cp']}" if par.get("cp", 1) > 1 else "")
                     + (f" ep{par['ep']}" if par.get("ep", 1) > 1 else "")
                     + f" z{par.get('zero', 0)} rc:{par.get('recompute', 'none')} mbs{par.get('mbs', 1)}"
                     f" gb{par['global_batch']} s{par['seq_len']} {par['dtype']}"
                     + (f" {par['schedule']}" if par.get("schedule", "1F1B") != "1F1B" else ""))
    pub_s = published_iteration_s(row, data, model)
    out["published_s"] = pub_s
    pub_mem = row["published"].get("memory_gib")
    out["published_gib"] = pub_mem
    reason = not_expressible(row)
    if reason:
        out["not_expressible"] = reason
        approx = approximation(row)
        if approx is not None:
            try:
                p = predict(approx, model)
                gib = comparable_memory_gib(p, row, data)
                out["approx"] = {"as": approx["_approx"], "predicted_s": p["iteration_s"],
                                 "time_err": pct(p["iteration_s"], pub_s), "predicted_gib": gib,
                                 "mem_err": pct(gib, pub_mem) if pub_mem else None}
            except (SpecError, ValueError) as exc:
                out["approx_error"] = str(exc)
        return out
    try:
        p = predict(row, model)
    except (SpecError, ValueError) as exc:
        out["not_expressible"] = f"cost model refused: {exc}"
        return out
    gib = comparable_memory_gib(p, row, data)
    out.update(predicted_s=p["iteration_s"], predicted_gib=gib, predicted_mfu=p["mfu"],
               capacity_gib=p["capacity_gib"], fits=p["peak_gib"] <= p["capacity_gib"],
               bubble_s=p["bubble_s"], time_err=pct(p["iteration_s"], pub_s),
               mem_err=pct(gib, pub_mem) if pub_mem else None)
    return out


# ------------------------------------------------------------------------------------------------ report
def median_abs(values: list[float]) -> str:
    vals = [abs(v) for v in values if v is not None]
    return f"{statistics.median(vals):5.1f} % (n={len(vals)})" if vals else "   -    (n=0)"


def median_signed(values: list[float]) -> str:
    vals = [v for v in values if v is not None]
    return f"{statistics.median(vals):+6.1f} %" if vals else "   -"


def median_by_source(rows: list[dict], key: str) -> str:
    """Median over sources of each source's median |error| (n = sources): a source of many rows counts once, so
    two tables cannot carry a cohort's figure."""
    per: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            per.setdefault(r["source"], []).append(abs(r[key]))
    if not per:
        return "   -    (n=0)"
    return f"{statistics.median(statistics.median(v) for v in per.values()):5.1f} % (n={len(per)})"


def family(r: dict) -> str:
    fw = r["framework"].lower()
    if "fsdp" in fw or "metaseq" in fw:
        return "FSDP/ZeRO-3"
    return "Megatron/DeepSpeed" if ("megatron" in fw or "deepspeed" in fw) else "other"


def coverage(rows: list[dict], results: list[dict]) -> str:
    """Rows by GPU, dense/MoE, parallelism feature and verification (a row counts in every feature it uses)."""
    moe = {r["id"]: r["moe"] for r in results}

    def count(pred) -> int:
        return sum(1 for r in rows if pred(r, r["parallel"]))

    gpus: dict[str, int] = {}
    for r in rows:
        gpus[r["gpu"]] = gpus.get(r["gpu"], 0) + 1
    feats = [("TP>1", lambda r, p: p.get("tp", 1) > 1), ("PP>1", lambda r, p: p.get("pp", 1) > 1),
             ("DP>1", lambda r, p: p.get("dp", 1) > 1), ("CP>1", lambda r, p: p.get("cp", 1) > 1),
             ("EP>1", lambda r, p: p.get("ep", 1) > 1), ("ZeRO-1", lambda r, p: p.get("zero", 0) == 1),
             ("ZeRO-3/FSDP", lambda r, p: p.get("zero", 0) == 3),
             ("recompute full", lambda r, p: p.get("recompute") == "full"),
             ("recompute selective", lambda r, p: p.get("recompute") == "selective"),
             ("interleaved", lambda r, p: p.get("schedule", "1F1B") != "1F1B"),
             ("fp8", lambda r, p: p.get("dtype") == "fp8"),
             ("memory published", lambda r, p: bool(r["published"].get("memory_gib")))]
    ver = {v: count(lambda r, p, v=v: r.get("verified") == v) for v in (True, "partial", False)}
    return ("coverage: " + ", ".join(f"{g} {c}" for g, c in sorted(gpus.items()))
            + f"; dense {sum(1 for v in moe.values() if not v)}, MoE {sum(1 for v in moe.values() if v)}\n  "
            + ", ".join(f"{name} {count(f)}" for name, f in feats)
            + f"\n  verified through search: {ver[True]}, partially (some configuration from memory): "
            f"{ver['partial']}, not verified (from memory): {ver[False]}")


def split_label(r: dict) -> str:
    if r["split"] == "validation" and r["cohort"] in VALIDATION_COHORTS:
        return f"val ({r['cohort']})"
    return "val" if r["split"] == "validation" else r["split"]


def print_split_medians(costed: list[dict]) -> None:
    """Development and validation medians side by side; validation also by cohort (rows in the file when the split
    was drawn, which the model's structure was tuned on before; rows added afterwards; and, once unsealed, each blind
    cohort's rows, each gathered blind after the rows before them had been seen)."""
    cols = [("dev", [r for r in costed if r["split"] == "dev"]),
            ("validation", [r for r in costed if r["split"] == "validation"]),
            ("val: original", [r for r in costed if r["split"] == "validation" and r["cohort"] == "original"]),
            ("val: unseen", [r for r in costed if r["split"] == "validation" and r["cohort"] == "unseen"])]
    for cohort in BLIND_COHORTS:
        rows = [r for r in costed if r["split"] == "validation" and r["cohort"] == cohort]
        if rows:  # unsealed
            cols.append((f"val: {cohort}", rows))
    print("development vs validation (costed rows; median |error|, signed median: + = predicted slower / more memory)")
    print(f"  {'':14}" + "".join(f"  {name:>17}" for name, _ in cols))
    for label, key, fmt in (("time |err|", "time_err", median_abs), ("time signed", "time_err", median_signed),
                            ("memory |err|", "mem_err", median_abs), ("memory signed", "mem_err", median_signed)):
        print(f"  {label:14}" + "".join(f"  {fmt([r[key] for r in rows if r.get(key) is not None]):>17}"
                                        for _, rows in cols))
    for label, key in (("time by source", "time_err"), ("memory by src", "mem_err")):
        print(f"  {label:14}" + "".join(f"  {median_by_source(rows, key):>17}" for _, rows in cols))
    print(f"  {'time calibrated':14}" + "".join(f"  {median_calibrated(rows, 'time_err'):>17}" for _, rows in cols))
    print("  (by source: the median over sources of each source's median |error|, n = sources; calibrated: each row\n"
          "   scaled by the other rows of its source on its GPU type, as `calibrate` would, n = rows that have others)")


def median_calibrated(rows: list[dict], key: str) -> str:
    """Median |error| once each row is scaled by the other rows of its source on its GPU type (left_out_errors):
    how well the model's structure carries from one configuration of a deployment to another, apart from the
    deployment's level (its stack, tuning, clocks), which `tangram-launch calibrate` measures."""
    return median_abs(left_out_errors(rows, key, lambda r: (r["source"], r["gpu"])))


# The groupings of the ceiling analysis (print_ceiling): what one constant per group could at best remove.
CEILING_GROUPS = (("one constant for all rows", lambda r: ""), ("one per GPU type", lambda r: r["gpu"]),
                  ("one per framework family", family),
                  ("one per GPU type and family", lambda r: (r["gpu"], family(r))),
                  ("one per source", lambda r: r["source"]))


def _ratios_by_group(rows: list[dict], key: str, group) -> list[list[float]]:
    """The predicted / published ratios of ``rows`` that have ``key`` (an error in %), per group, groups in order
    of first appearance."""
    groups: dict[Any, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            groups.setdefault(group(r), []).append(1.0 + r[key] / 100.0)
    return list(groups.values())


def scaled_errors(rows: list[dict], key: str, group) -> list[float]:
    """The errors (``key``, %) of ``rows`` once each group's predictions are multiplied by the one factor that
    centres that group (the median of its published / predicted ratios): an oracle, chosen on the very rows it is
    judged on, so a floor under what any constant per group can reach, not a model."""
    out: list[float] = []
    for ratios in _ratios_by_group(rows, key, group):
        factor = statistics.median(1.0 / x for x in ratios)
        out.extend(100.0 * (x * factor - 1.0) for x in ratios)
    return out


def left_out_errors(rows: list[dict], key: str, group) -> list[float]:
    """The errors (``key``, %) of the rows whose group holds others, each once its prediction is multiplied by the
    factor that centres the *other* rows of its group (the median of their published / predicted ratios): what one
    scalar calibrated on a deployment's earlier runs would predict for another configuration on it. Not an oracle:
    a row never sets its own factor."""
    out: list[float] = []
    for ratios in _ratios_by_group(rows, key, group):
        for i, x in enumerate(ratios):
            others = ratios[:i] + ratios[i + 1:]
            if others:
                out.append(100.0 * (x * statistics.median(1.0 / y for y in others) - 1.0))
    return out


def print_ceiling(costed: list[dict]) -> None:
    """How much of the error a per-group constant could remove at best (scaled_errors), per split: where even one
    factor per GPU type chosen on the validation rows themselves leaves their median near the target, what remains
    is spread between the deployments of one GPU type (stack, tuning, measurement), which no constant per GPU type
    reaches and a measurement of the user's own runs (tangram-launch calibrate) does."""
    splits = [(name, [r for r in costed if r["split"] == name]) for name in ("dev", "validation")]
    print("ceiling: median |error| left after scaling each group by its own median ratio (an oracle fitted on the "
          "rows it is judged on)")
    print(f"  {'':32}" + "".join(f"  {f'{name} time':>17}  {f'{name} memory':>17}" for name, _ in splits))
    for label, group in CEILING_GROUPS:
        print(f"  {label:32}" + "".join(f"  {median_abs(scaled_errors(rows, 'time_err', group)):>17}"
                                        f"  {median_abs(scaled_errors(rows, 'mem_err', group)):>17}"
                                        for _, rows in splits))
    label = "one per source and GPU, left out"
    print(f"  {label:32}" + "".join(f"  {median_calibrated(rows, 'time_err'):>17}"
                                    f"  {median_calibrated(rows, 'mem_err'):>17}" for _, rows in splits))
    print("  (the last row is no oracle: each row scaled by the other rows of its source on its GPU type, as one "
          "scalar calibrated on a deployment's own runs would)")


# Per-technique groups of the report (a row counts in every group it matches).
TECHNIQUES = (
    ("TP>1", lambda p: p.get("tp", 1) > 1), ("PP>1", lambda p: p.get("pp", 1) > 1),
    ("CP>1", lambda p: p.get("cp", 1) > 1), ("EP>1", lambda p: p.get("ep", 1) > 1),
    ("ZeRO-0", lambda p: p.get("zero", 0) == 0), ("ZeRO-1", lambda p: p.get("zero", 0) == 1),
    ("ZeRO-3/FSDP", lambda p: p.get("zero", 0) == 3),
    ("recompute none", lambda p: p.get("recompute", "none") == "none"),
    ("recompute selective", lambda p: p.get("recompute") == "selective"),
    ("recompute full", lambda p: p.get("recompute") == "full"),
    ("interleaved 1F1B", lambda p: p.get("schedule", "1F1B") != "1F1B"),
    ("fp8", lambda p: p.get("dtype") == "fp8"),
)


def _s(seconds: float | None) -> str:
    return "memory only" if seconds is None else f"{seconds:.3f}"


def _pct(err: float | None) -> str:
    return "" if err is None else f"{err:+.0f} %"


def print_report(results: list[dict], rows: list[dict] | None = None) -> None:
    costed = [r for r in results if "time_err" in r]
    skipped = [r for r in results if "not_expressible" in r]
    print("| id | split | source | config | published s | predicted s | time err | published GiB | predicted GiB "
          "| mem err |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        pub_mem = f"{r['published_gib']:.1f}" if r.get("published_gib") else ""
        if "time_err" in r:
            flag = "" if r["fits"] else " (> capacity)"
            mem = (f"{r['predicted_gib']:.1f}{flag} | {r['mem_err']:+.0f} %" if r.get("mem_err") is not None
                   else f"{r['predicted_gib']:.1f}{flag} | ")
            print(f"| {r['id']} | {split_label(r)} | {r['source']} | {r['config']} | {_s(r['published_s'])} "
                  f"| {r['predicted_s']:.3f} "
                  f"| {_pct(r['time_err'])} | {pub_mem} | {mem} |")
        else:
            extra = ""
            if "approx" in r:
                a = r["approx"]
                extra = f" [as {a['as']}: {a['predicted_s']:.3f} s, {_pct(a['time_err'])}"
                if a.get("mem_err") is not None:
                    extra += f"; memory {a['predicted_gib']:.1f} GiB, {a['mem_err']:+.0f} %"
                extra += "]"
            print(f"| {r['id']} | {split_label(r)} | {r['source']} | {r['config']} | {_s(r['published_s'])} "
                  f"| not expressible: {r['not_expressible']}{extra} | | {pub_mem} | | |")
    print()
    print(f"rows: {len(results)}; costed: {len(costed)}; not expressible: {len(skipped)}")
    if rows is not None:
        print(coverage(rows, results))
    over = [r["id"] for r in costed if not r["fits"]]
    if over:
        print(f"  ran as published, but predicted peak memory exceeds the catalog GPU's capacity: {', '.join(over)}")
    by_reason: dict[str, int] = {}
    for r in skipped:
        key = r["not_expressible"]
        for tag, words in (("FP8", ("fp8", "float8")), ("interleaved 1F1B", ("interleaved",)),
                           ("per-layer/module recompute", ("per-layer", "module-level")),
                           ("cost model refused", ("refused",)),
                           ("settings not published", ("settings not published",))):
            if any(w in key.lower() for w in words):
                by_reason[tag] = by_reason.get(tag, 0) + 1
    print("  not expressible, by reason (a row may have several): "
          + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())))
    print()
    print_split_medians(costed)
    print()
    print_ceiling(costed)
    print()
    print("median |error| (signed median: + = predicted slower / more memory)")
    groups: list[tuple[str, list[dict]]] = [
        ("all costed", costed),
        ("fit (a time constant was fitted on these)", [r for r in costed if r["subset"] == "fit"]),
        ("held-out", [r for r in costed if r["subset"] != "fit"])]
    for g in sorted({r["gpu"] for r in costed}):
        groups.append((f"gpu {g}", [r for r in costed if r["gpu"] == g]))
    for f in ("Megatron/DeepSpeed", "FSDP/ZeRO-3", "other"):
        rows = [r for r in costed if family(r) == f]
        if rows:
            groups.append((f"framework {f}", rows))
    groups.append(("dense", [r for r in costed if not r["moe"]]))
    groups.append(("MoE", [r for r in costed if r["moe"]]))
    for label, pred in TECHNIQUES:
        rows = [r for r in costed if pred(r["parallel"])]
        if rows:
            groups.append((f"technique {label}", rows))
    groups.append(("verified rows only", [r for r in costed if r["verified"] is True]))
    w = max(len(g[0]) for g in groups)
    print(f"  {'subset'.ljust(w)}  {'time |err|':>17}  {'time signed':>11}  {'memory |err|':>17}  "
          f"{'memory signed':>13}")
    for label, rows in groups:
        t = [r["time_err"] for r in rows]
        # every fitted constant is a time constant: for memory, every row is held out
        mem_rows = {"fit": [], "held-out": costed}.get(label.split(" ")[0], rows)
        mm = [r["mem_err"] for r in mem_rows if r.get("mem_err") is not None]
        print(f"  {label.ljust(w)}  {median_abs(t):>17}  {median_signed(t):>11}  {median_abs(mm):>17}  "
              f"{median_signed(mm):>13}")
    approx = [r for r in skipped if "approx" in r]
    if approx:
        print()
        print("not-expressible rows costed as the nearest expressible configuration (not in the medians above):")
        for r in approx:
            a = r["approx"]
            mem = f", memory {a['mem_err']:+.0f} %" if a.get("mem_err") is not None else ""
            print(f"  {r['id']}: as {a['as']}: time {_pct(a['time_err'])}{mem}")


# ------------------------------------------------------------------------------------------------ fitting
def _set_constant(name: str, spec: dict, value: float) -> None:
    """Point the cost model's constant `name` (a key of fitted_constants) at `value` (benchmark-only re-fitting)."""
    from types import MappingProxyType

    from tangram_launch.costmodel import efficiency

    if name.startswith("gemm_efficiency."):
        table = dict(efficiency.GEMM_EFFICIENCY_BY_GPU)
        table.update({g: value for g in spec["gpu_types"]})
        efficiency.GEMM_EFFICIENCY_BY_GPU = MappingProxyType(table)
    else:
        raise ValueError(f"fitted_constants.{name}: no setter (known: gemm_efficiency.<gpu>)")


def _get_constant(name: str, spec: dict) -> float:
    from tangram_launch.costmodel import efficiency

    if not name.startswith("gemm_efficiency."):
        raise ValueError(f"fitted_constants.{name}: no getter (known: gemm_efficiency.<gpu>)")
    return efficiency.gemm_efficiency_for(spec["gpu_types"][0])


def fit_constants(data: dict) -> list[dict]:
    """Re-fit every constant of `fitted_constants` on its rows (golden-section search of the squared log error of
    the predicted iteration time), one at a time in file order, each restored afterwards."""
    rows = {r["id"]: r for r in data["runs"]}
    out = []
    for name, spec in data["fitted_constants"].items():
        shipped = _get_constant(name, spec)

        def loss(value: float, name=name, spec=spec) -> float:
            _set_constant(name, spec, value)
            total = 0.0
            for rid in spec["rows"]:
                r = evaluate(rows[rid], data)
                total += math.log(r["predicted_s"] / r["published_s"]) ** 2
            return total

        lo, hi, g = 0.2, 1.0, (math.sqrt(5) - 1) / 2
        for _ in range(30):
            c, d = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, d) if loss(c) < loss(d) else (c, hi)
        _set_constant(name, spec, shipped)
        out.append({"constant": name, "where": spec["constant"], "rows": spec["rows"], "fitted": (lo + hi) / 2,
                    "shipped": shipped})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DATA, help="published runs YAML (default: benchmarks/data/published_runs.yaml)")
    ap.add_argument("--only", default="", help="only rows whose id contains this text")
    ap.add_argument("--split", choices=("all",) + SPLITS, default="all",
                    help="only the rows of one split; while changing the cost model, look at --split dev only")
    ap.add_argument("--json", action="store_true", help="print the per-row results as JSON instead of the table")
    ap.add_argument("--fit", action="store_true",
                    help="re-fit each constant of `fitted_constants` on its rows and print fitted vs shipped")
    ap.add_argument("--unseal", nargs="*", metavar="COHORT", default=None,
                    help="also cost the data file's sealed cohorts (sealed_cohorts:), all of them or the ones named: "
                         "once, after a cost-model change is final, to validate it on rows no one has seen it predict")
    args = ap.parse_args(argv)
    data = load_data(args.data)
    if args.fit:
        for f in fit_constants(data):
            print(f"{f['constant']}: fitted {f['fitted']:.3f}, shipped {f['shipped']:.3f}  ({f['where']}; "
                  f"rows: {', '.join(f['rows'])})")
        return 0
    rows = [r for r in data["runs"] if args.only in r["id"] and args.split in ("all", r.get("split"))]
    seal = sealed_cohorts(data)
    unknown = sorted(set(args.unseal or ()) - set(seal))
    if unknown:
        ap.error(f"--unseal {' '.join(unknown)}: not a sealed cohort (sealed: {', '.join(seal) or 'none'})")
    if args.unseal is not None:  # --unseal alone: every sealed cohort
        seal = tuple(c for c in seal if args.unseal and c not in args.unseal)
    sealed = [r for r in rows if r.get("cohort") in seal]
    rows = [r for r in rows if r not in sealed]
    results = [evaluate(r, data) for r in rows]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_report(results, rows)
    if sealed:
        print(f"\nsealed: {len(sealed)} validation rows of cohort {', '.join(seal)} not costed (gathered "
              "blind; --unseal costs them, once, after the next cost-model change is final)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
