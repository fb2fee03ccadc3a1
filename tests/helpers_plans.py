"""Hand-built Plan objects for tests (no planner involved).

    make_plan("tiny", stages=[(3, "n1"), (1, "n0")], global_batch=4, num_microbatches=2)
    make_plan(spec.to_dict(), stages=[(2, "n0", 1, 2), {"layers": 2, "gpus": "n1", "dp": 2, "zero_stage": 3}],
              global_batch=8, num_microbatches=2)

A stage is a tuple ``(layers, gpus, tp=1, dp=1, zero_stage=0, recompute="none")`` or a dict with those keys (a dict
may also give ``ep``, the expert-parallel size, and ``offload``).
``layers`` is a layer count (stages cover the model in order) or a ``(start, stop)`` pair; ``gpus`` is a node name
(the next tp*dp free GPUs of that node) or an explicit list of (node, local_gpu) pairs in rank order.
micro_batch_size is global_batch / (dp * num_microbatches).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction
from tangram_launch.specs.model import ModelSpec, load_model

_STAGE_KEYS = ("layers", "gpus", "tp", "dp", "zero_stage", "recompute")


def _model_dict(model: str | Mapping[str, Any] | ModelSpec) -> dict:
    if isinstance(model, ModelSpec):
        return model.to_dict()
    if isinstance(model, str):
        return load_model(model).to_dict()
    return dict(model)


def make_plan(model: str | Mapping[str, Any] | ModelSpec, stages: Sequence[Sequence | Mapping], *,
              global_batch: int, num_microbatches: int, seq_len: int | None = None, dtype: str = "fp32",
              runtime: str = "torch", schedule: str = "1F1B") -> Plan:
    model_d = _model_dict(model)
    free: dict[str, int] = {}
    built = []
    start = 0
    for i, raw in enumerate(stages):
        d = dict(raw) if isinstance(raw, Mapping) else dict(zip(_STAGE_KEYS, raw))
        layers = d["layers"]
        layers = (start, start + layers) if isinstance(layers, int) else tuple(layers)
        tp, dp = int(d.get("tp", 1)), int(d.get("dp", 1))
        gpus = d["gpus"]
        if isinstance(gpus, str):
            first = free.get(gpus, 0)
            gpus = [(gpus, first + k) for k in range(tp * dp)]
            free[gpus[0][0]] = first + tp * dp
        if global_batch % (dp * num_microbatches):
            raise ValueError(f"stage {i}: dp*num_microbatches must divide global_batch")
        built.append(Stage(index=i, layers=layers, island=f"island-{i}", gpus=tuple(tuple(g) for g in gpus),
                           tp=tp, dp=dp, ep=int(d.get("ep", 1)), zero_stage=int(d.get("zero_stage", 0)),
                           recompute=str(d.get("recompute", "none")), offload=bool(d.get("offload", False)),
                           micro_batch_size=global_batch // (dp * num_microbatches),
                           has_embedding=i == 0, has_head=i == len(stages) - 1))
        start = layers[1]
    training = {"global_batch": global_batch, "seq_len": seq_len or int(model_d.get("max_seq_len", 64)),
                "dtype": dtype, "optimizer": "adamw", "grad_dtype": "fp32"}
    predicted = Prediction(iteration_time_s=0.0, tokens_per_s=0.0, mfu=0.0,
                           stages=tuple(StagePrediction(0.0, 0.0, 0.0, 0.0) for _ in built))
    return Plan(model=model_d, training=training, stages=tuple(built), num_microbatches=num_microbatches,
                predicted=predicted, runtime=runtime, schedule=schedule,
                planner={"parallelizer": "hand-written (tests/helpers_plans.py)"})
