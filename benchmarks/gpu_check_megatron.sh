#!/usr/bin/env bash
# GPU check for the Megatron-core runtime: examples/train_gpt_megatron.py end to end on ONE GPU, started by
# tangram-launch with a plan, for three plans:
#   dense  - GPT, bf16, ZeRO-1 (Megatron's distributed optimizer), full recompute
#   fp16   - GPT, fp16 (dynamic loss scaling), selective recompute
#   moe    - Mixtral-style MoE, bf16: trains when Transformer Engine is installed; without it megatron-core 0.16.1
#            cannot run an MoE forward, and the example must refuse the plan with that reason (exit 3)
# A training run passes when its loss falls below half its first value.
#
#   benchmarks/gpu_check_megatron.sh [OUT_DIR]        # PYTHON=... to choose the interpreter (default python3)
#
# Needs: a CUDA GPU, torch with CUDA, megatron-core 0.16.1 (pip install "tangram-launch[megatron]").
# What it cannot check on one GPU: pipeline/tensor/data parallelism across ranks (NCCL refuses two ranks on one
# GPU); the groups and layer placement of those are tested on CPU (tests/test_adapter_megatron.py).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$REPO/out/gpu_check_megatron}
PY=${PYTHON:-python3}
STEPS=${STEPS:-80}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check_megatron: no CUDA GPU visible; this check needs one (CPU coverage: tests/test_adapter_megatron.py)" >&2
    exit 2
fi
"$PY" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "| megatron-core", m.__version__, "|", torch.cuda.get_device_name(0))'

# Plans for one GPU (one stage, node "gpu0"); global batch = micro_batch_size * dp * num_microbatches.
"$PY" - "$OUT" <<'PYEOF'
import sys
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

out = sys.argv[1]
def plan(model, *, zero, recompute, mbs=4, micro=4, seq_len=256, dtype="bf16"):
    stage = Stage(index=0, layers=(0, model["num_layers"]), island="gpu0", gpus=(("gpu0", 0),), zero_stage=zero,
                  recompute=recompute, micro_batch_size=mbs, has_embedding=True, has_head=True)
    pred = Prediction(iteration_time_s=0.0, tokens_per_s=0.0, mfu=0.0, stages=(StagePrediction(0, 0, 0, 141),))
    training = TrainingSpec(global_batch=mbs * micro, seq_len=seq_len, dtype=dtype).to_dict()
    return Plan(model=model, training=training, stages=(stage,), num_microbatches=micro, predicted=pred,
                runtime="megatron")

dense = load_model("tiny").to_dict() | {"name": "gpu-check-gpt", "hidden_size": 256, "num_heads": 8, "num_kv_heads": 8,
                                        "ffn_hidden_size": 1024, "head_dim": 32, "max_seq_len": 256,
                                        "num_position_embeddings": 256, "embedding_dim": 256}
moe = load_model("tiny-moe").to_dict() | {"name": "gpu-check-moe", "max_seq_len": 256}
plan(dense, zero=1, recompute="full").dump(f"{out}/plan_dense.json")
plan(dense, zero=0, recompute="selective", dtype="fp16").dump(f"{out}/plan_fp16.json")
plan(moe, zero=0, recompute="selective").dump(f"{out}/plan_moe.json")
PYEOF

TE=$("$PY" -c 'import transformer_engine' 2>/dev/null && echo yes || echo no)
echo "transformer_engine installed: $TE"
status=0
for name in dense fp16 moe; do
    echo "=== $name: tangram-launch --plan $OUT/plan_$name.json examples/train_gpt_megatron.py"
    start=$(date +%s.%N)
    rc=0
    "$PY" -m tangram_launch.cli --standalone --nproc-per-node 1 --runtime megatron --plan "$OUT/plan_$name.json" \
        --node-name gpu0 "$REPO/examples/train_gpt_megatron.py" --steps "$STEPS" --out "$OUT/result_$name.json" \
        > "$OUT/log_$name.txt" 2>&1 || rc=$?
    end=$(date +%s.%N)
    grep -E "loss|error|Error" "$OUT/log_$name.txt" | tail -n 8 || true
    if [ "$name" = moe ] && [ "$TE" = no ]; then
        if [ $rc -ne 0 ] && grep -q "need Transformer Engine" "$OUT/log_$name.txt" && ! grep -q Traceback "$OUT/log_$name.txt"; then
            echo "moe: refused without Transformer Engine, as expected: PASS"
        else
            echo "moe: expected a clear refusal without Transformer Engine (rc=$rc): FAIL"; status=1
        fi
        continue
    fi
    [ $rc -eq 0 ] || { echo "$name: example exited with $rc: FAIL"; status=1; continue; }
    "$PY" - "$OUT/result_$name.json" "$name" "$start" "$end" <<'PYEOF' || status=1
import json, sys
path, name, start, end = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
r = json.load(open(path))
first, last = r["losses"][0], r["losses"][-1]
ok = last < 0.5 * first
print(f"{name}: {len(r['losses'])} steps, loss {first:.3f} -> {last:.3f}, peak memory "
      f"{r['max_memory_allocated_gib']:.2f} GiB, wall {end - start:.1f} s (launch incl.): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PYEOF
done
echo "gpu_check_megatron: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
