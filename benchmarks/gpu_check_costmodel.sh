#!/usr/bin/env bash
# GPU check for the cost model on ONE GPU (≤ 8 min): measured layer costs and predicted-against-measured.
#   1. `tangram-launch profile --model` on a Llama-style model (Llama 3 8B's layer: GQA, SwiGLU, RMSNorm, rotary;
#      4 layers: about 1.9 B parameters, which with AdamW state fit an 80 GB GPU), bf16, at the sizes the plan will use;
#   2. a 1-GPU training run with the torch runtime, planned from that profile (`--cluster`), writing
#      RUN_DIR/run-report.json;
#   3. the plan's predicted forward/backward per micro-batch beside the run report's measured medians, per stage,
#      and the same plan priced by the analytic model alone (the profile's layer times removed).
#
#   benchmarks/gpu_check_costmodel.sh [OUT_DIR]        # PYTHON=..., STEPS=30, SEQ_LEN=2048, MBS=1,2,4
#   ON_CPU=1 benchmarks/gpu_check_costmodel.sh OUT     # a dry run of the same steps on CPU with a tiny Llama-style
#                                                      # model (checks the script, not the GPU's figures)
#
# Exit status: 0 when every step ran (the printed errors say how well the model did), 1 when a step failed,
# 2 when no CUDA GPU is visible.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$REPO/out/gpu_check_costmodel}" && cd "${1:-$REPO/out/gpu_check_costmodel}" && pwd)
PY=${PYTHON:-python3}
STEPS=${STEPS:-30}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "${ON_CPU:-0}" = 1 ]; then
    SEQ_LEN=${SEQ_LEN:-64}; MBS=${MBS:-2,4}; DTYPE=fp32; GLOBAL_BATCH=${GLOBAL_BATCH:-8}; BUDGET=${BUDGET:-10}
    SHAPE='{"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 172,
            "vocab_size": 256, "max_seq_len": 64}'
elif "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    SEQ_LEN=${SEQ_LEN:-2048}; MBS=${MBS:-1,2,4}; DTYPE=bf16; GLOBAL_BATCH=${GLOBAL_BATCH:-16}; BUDGET=${BUDGET:-60}
    SHAPE='{"num_layers": 4, "max_seq_len": 2048}'
    "$PY" -c 'import torch; print("torch", torch.__version__, "|", torch.cuda.get_device_name(0))'
else
    echo "gpu_check_costmodel: no CUDA GPU visible; this check needs one (ON_CPU=1 runs the same steps on CPU)" >&2
    exit 2
fi

# 0. the model: Llama 3 8B's layer, fewer layers (and, on CPU, smaller)
"$PY" - "$OUT/model.yaml" "$SHAPE" <<'PYEOF'
import json, sys, yaml
from tangram_launch.specs.model import load_model
spec = load_model("llama3-8b").to_dict() | {"name": "gpu-check-llama"} | json.loads(sys.argv[2])
spec.pop("citation", None)
with open(sys.argv[1], "w") as f:
    yaml.safe_dump(spec, f, sort_keys=False)
PYEOF

echo "=== 1. tangram-launch profile --model (layer budget ${BUDGET} s)"
"$PY" -m tangram_launch.cli profile --standalone --nproc-per-node 1 --model "$OUT/model.yaml" --seq-len "$SEQ_LEN" \
    --micro-batch "$MBS" --layer-dtype "$DTYPE" --layer-budget-s "$BUDGET" --timeout-s 420 -o "$OUT/cluster.yaml" \
    > "$OUT/log_profile.txt" 2>&1 || { tail -n 20 "$OUT/log_profile.txt"; echo "profile: FAIL"; exit 1; }
tail -n 12 "$OUT/log_profile.txt"

echo "=== 2. one GPU, torch runtime, planned from the profile; run report in $OUT/run"
PLAN_ARGS=(--cluster "$OUT/cluster.yaml" --model "$OUT/model.yaml" --global-batch "$GLOBAL_BATCH" --seq-len "$SEQ_LEN"
           --dtype "$DTYPE" --runtime torch)
"$PY" -m tangram_launch.cli plan "${PLAN_ARGS[@]}" -o "$OUT/plan.json" > "$OUT/log_plan.txt" 2>&1 \
    || { cat "$OUT/log_plan.txt"; echo "plan: FAIL"; exit 1; }
cat "$OUT/log_plan.txt"
rm -rf "$OUT/run"
"$PY" -m tangram_launch.cli --standalone --nproc-per-node 1 --plan "$OUT/plan.json" --run-dir "$OUT/run" \
    "$REPO/examples/train_gpt.py" --steps "$STEPS" --data synthetic --quiet > "$OUT/log_train.txt" 2>&1 \
    || { tail -n 30 "$OUT/log_train.txt"; echo "training: FAIL"; exit 1; }
tail -n 12 "$OUT/log_train.txt"

echo "=== 3. the same plan priced by the analytic model alone (the profile's layer times removed)"
"$PY" - "$OUT" <<'PYEOF'
import json, sys, yaml
out = sys.argv[1]
data = yaml.safe_load(open(f"{out}/cluster.yaml"))
for node in data["nodes"]:
    for gpu in node["gpus"]:
        for key in ("layer_forward_s", "layer_forward_backward_s", "layer_activation_bytes"):
            (gpu.get("measured") or {}).pop(key, None)
yaml.safe_dump(data, open(f"{out}/cluster-analytic.yaml", "w"), sort_keys=False)
plan = json.load(open(f"{out}/plan.json"))  # the searched plan, written as a hand-written one
keys = ("island", "num_gpus", "tp", "dp", "cp", "ep", "zero_stage", "recompute")
stages = [{"layers": s["layers"]} | {k: s[k] for k in keys} for s in plan["stages"]]
yaml.safe_dump({"microbatch_sequences": plan["stages"][0]["micro_batch_size"], "stages": stages},
               open(f"{out}/plan-layout.yaml", "w"), sort_keys=False)
PYEOF
"$PY" -m tangram_launch.cli plan --cluster "$OUT/cluster-analytic.yaml" --model "$OUT/model.yaml" \
    --global-batch "$GLOBAL_BATCH" --seq-len "$SEQ_LEN" --dtype "$DTYPE" --runtime torch --plan "$OUT/plan-layout.yaml" \
    -o "$OUT/plan-analytic.json" > "$OUT/log_plan_analytic.txt" 2>&1 \
    || { cat "$OUT/log_plan_analytic.txt"; echo "analytic pricing: FAIL"; exit 1; }

echo "=== 4. predicted against measured, per stage (forward and backward per micro-batch)"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
report = json.load(open(f"{out}/run/run-report.json"))
analytic = json.load(open(f"{out}/plan-analytic.json"))["predicted"]
priced_by = json.load(open(f"{out}/plan.json"))["predicted"]["stages"]
print(f"{'stage':>5} {'priced':>24} {'pred. fwd+bwd ms':>16} {'analytic ms':>11} {'measured ms':>11} "
      f"{'err':>7} {'err analytic':>12}")
for st, an in zip(report["stages"], analytic["stages"]):
    pred = st["predicted"]["forward_s"] + st["predicted"]["backward_s"]
    got = st["measured"]["forward_s"] + st["measured"]["backward_s"]
    an_s = an["time_s"]
    priced = priced_by[st["stage"]].get("measured") or {}
    print(f"{st['stage']:>5} {str(priced.get('how', priced) or 'analytic')[:24]:>24} {pred * 1e3:16.2f} "
          f"{an_s * 1e3:11.2f} {got * 1e3:11.2f} {pred / got - 1:+7.1%} {an_s / got - 1:+12.1%}")
it = report["iteration"]
print(f"iteration: predicted {it['predicted_s'] * 1e3:.1f} ms (analytic {analytic['iteration_time_s'] * 1e3:.1f}), "
      f"measured median {it['measured_median_s'] * 1e3:.1f} ms over {report['steps_measured']} steps")
PYEOF
echo "gpu_check_costmodel: ran every step"
