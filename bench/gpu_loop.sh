#!/usr/bin/env bash
# The learning loop on one GPU with a ~0.5B model: tokens/s, MFU and the held-out pass-rate curve.
#
#   bash bench/gpu_loop.sh MODEL_DIR [WORKDIR]    # e.g. a local copy of Qwen2.5-0.5B-Instruct (no network)
#   BUDGET_S=900 EVAL_TASKS=16 bash bench/gpu_loop.sh ...
#   DRY_RUN=1 bash bench/gpu_loop.sh MODEL_DIR    # check the set-up and print the plan; runs nothing
#
# The same loop shape as bench/learning.py (the CPU figures), with the model given instead of
# `trajpipe model init-tiny` and vLLM instead of transformers for rollouts and evaluation:
#   embedded broker -> scripted demonstrations in MODEL_DIR's tokens (code, tools; levels 0-1) -> Kafka ->
#   Beam job -> BC warm start (DeepSpeed bf16) -> v1 -> [vLLM rollouts in GRPO groups -> Beam job ->
#   GRPO steps (staleness 0) -> v(n+1) -> held-out evaluation (greedy, task seed 900001)] until BUDGET_S.
# Results in WORKDIR (default $OUT or a temp dir): gpu_loop.json (figures) and curve.json (per version,
# domain and level).
#
# MFU = 6 * N * train_tokens_per_s / PEAK over the GRPO steps (N = all parameters; attention score FLOPs
# not counted, so slightly understated), PEAK = 989e12 FLOP/s: H200 SXM dense BF16 (as bench/gpu_train.sh).
# Rollout tokens/s = generated action tokens of the training rollouts / their wall clock (from the
# steps dataset), engine start-up included (each iteration starts `trajpipe rollout --policy vllm`).
#
# Python: .venv/bin/python when it imports torch with CUDA and vllm, else python3; missing packages are
# installed from wheels carried in .whl/ (pip --no-index), never from the network. Kafka needs java and the
# jars in .cache/kafka-jars (`make kafka-jars`); without them the broker is Tansu (`--engine tansu`).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:?usage: bash bench/gpu_loop.sh MODEL_DIR [WORKDIR]}
[ -f "$MODEL/config.json" ] || { echo "error: $MODEL is not a model directory (no config.json)" >&2; exit 2; }
WORK=${2:-${OUT:-$(mktemp -d)}}
mkdir -p "$WORK"
MODEL=$(cd "$MODEL" && pwd)
WORK=$(cd "$WORK" && pwd)
PEAK=989e12
BUDGET_S=${BUDGET_S:-600}
EVAL_TASKS=${EVAL_TASKS:-16}
GROUPS_PER_ITER=${GROUPS_PER_ITER:-16}
GRPO_STEPS=${GRPO_STEPS:-4}
BC_STEPS=${BC_STEPS:-30}

PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
  PY=.venv/bin/python
fi
if ! $PY -c "import torch, vllm, deepspeed, transformers, apache_beam, kafka, pyarrow, duckdb, msgspec, typer, rich, pydantic, yaml" 2>/dev/null; then
  if [ -d .whl ] && [ -z "${DRY_RUN:-}" ]; then
    $PY -m pip install -q --no-index --find-links .whl torch vllm deepspeed transformers apache-beam kafka-python \
      pyarrow duckdb polars msgspec numpy typer rich pydantic pydantic-settings pyyaml
  else
    echo "missing Python packages and no .whl/ directory to install them from" >&2
    [ -n "${DRY_RUN:-}" ] || exit 2
  fi
fi
ENGINE=tansu
if command -v java >/dev/null && ls .cache/kafka-jars/kafka_2.13-*.jar >/dev/null 2>&1; then ENGINE=kafka; fi

# The recipes: the CPU ones (trainer/configs/bc-warmstart-loop.yaml, grpo-loop.yaml) in bf16 on the GPU, with
# learning rates for a pretrained 0.5B model instead of a from-scratch 1M one.
cat > "$WORK/bc.yaml" <<EOF
# trajpipe train --config $WORK/bc.yaml --data $WORK/run/demos --model $MODEL --out $WORK/run/bc
mode: offline
max_steps: $BC_STEPS
objective: {name: bc, min_advantage: -1.0e9}
data: {domains: [code, tools], max_policy_version: 0, seq_len: 2048, batch_size: 8, max_epochs: 1000, num_workers: 2}
optim: {lr: 1.0e-5, warmup_steps: 3, schedule: cosine}
engine: {zero_stage: 1, precision: bf16}
EOF
cat > "$WORK/grpo.yaml" <<EOF
# trajpipe train --config $WORK/grpo.yaml --data $WORK/run/rl --model <current policy> --out $WORK/run/grpo-<i>
mode: offline
max_steps: $GRPO_STEPS
objective: {name: grpo, aggregation: sequence, clip_eps: 0.2, kl_coef: 0.0, max_staleness: 0}
data: {seq_len: 2048, batch_size: 16, max_epochs: 4, num_workers: 2}
optim: {lr: 1.0e-6, grad_clip: 1.0}
engine: {zero_stage: 1, precision: bf16}
EOF

ARGS=(--model "$MODEL" --policy vllm --workdir "$WORK/run" --budget-s "$BUDGET_S" --eval-tasks "$EVAL_TASKS"
      --groups-per-iter "$GROUPS_PER_ITER" --bc-config "$WORK/bc.yaml" --grpo-config "$WORK/grpo.yaml")
echo "model $MODEL, broker engine $ENGINE, budget ${BUDGET_S}s, python $PY"
if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: would run: $PY -m bench.learning ${ARGS[*]} (own $ENGINE broker)"
  CHECK_PY=$PY; [ -x .venv/bin/python ] && CHECK_PY=.venv/bin/python
  PYTHONPATH=. $CHECK_PY -c "import sys; from trainer.config import load_train_config
for f in sys.argv[2:]: load_train_config(f, model=sys.argv[1], out='o', **{'data.dir': 'd'}); print('recipe ok:', f)" \
    "$MODEL" "$WORK/bc.yaml" "$WORK/grpo.yaml"
  PYTHONPATH=. $CHECK_PY -m bench.learning --help >/dev/null && echo "bench.learning flags ok"
  exit 0
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

echo "== broker ($ENGINE)"
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
PYTHONPATH=. $PY -m trajpipe broker start --engine "$ENGINE" --port "$PORT" --data-dir "$WORK/broker" | tail -1
trap 'PYTHONPATH=. $PY -m trajpipe broker stop --data-dir "$WORK/broker" >/dev/null 2>&1 || true' EXIT

echo "== warm start + online GRPO (bench/learning.py), budget ${BUDGET_S}s"
PYTHONPATH=. $PY -m bench.learning "${ARGS[@]}" --bootstrap "127.0.0.1:$PORT" 2>&1 \
  | grep -v "Loading weights" | tee "$WORK/learning.log" | grep -E "^(v[0-9]+ @|iteration|warm start|\{)"

PYTHONPATH=. $PY - "$WORK" "$PEAK" <<'EOF'
import json, sys
from pathlib import Path
import duckdb
work, peak = Path(sys.argv[1]), float(sys.argv[2])
doc = json.loads((work / "run" / "curve.json").read_text())
n = doc["params"]
steps = []
for run in sorted((work / "run").glob("grpo-*")):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps += [r for r in rows if "perf/step_time_s" in r and r.get("step", 0) > 1]  # first step: warm-up
time_s = sum(s["perf/step_time_s"] for s in steps)
tps = sum(s["perf/tokens_per_s"] * s["perf/step_time_s"] for s in steps) / time_s if time_s else 0.0
action_tokens = duckdb.sql(f"select sum(len(action_token_ids)) from read_parquet('{work}/run/rl/steps/**/*.parquet', "
                           "hive_partitioning=true)").fetchone()[0] or 0
rollout_s = sum(i["rollout_s"] for i in doc["iterations"])
out = {"gpu_loop_params": n, "gpu_loop_train_tokens_per_s": round(tps), "gpu_loop_mfu": round(6 * n * tps / peak, 4),
       "gpu_loop_rollout_tokens_per_s": round(action_tokens / rollout_s) if rollout_s else 0,
       "gpu_loop_peak_flops": peak, **{f"gpu_{k}": v for k, v in doc["figures"].items()}}
(work / "gpu_loop.json").write_text(json.dumps(out, indent=1) + "\n")
(work / "curve.json").write_text(json.dumps(doc, indent=1) + "\n")
for p in doc["curve"]:
    print(f"v{p['policy_version']} @ {p['elapsed_s']}s", {k: c["pass_rate"] for k, c in p["by_domain_level"].items()})
print(json.dumps(out))
EOF
