#!/usr/bin/env bash
# GPU training throughput on one H200: tokens/s, MFU and data-wait % of `trajpipe train`.
#
#   bash bench/gpu_train.sh [WORKDIR]          # ~5 minutes; results in $OUT (or WORKDIR)/gpu_train.json
#
# Self-contained: a random-init Llama-shaped model of ~0.47B parameters (hidden 1024, 24 layers,
# 16 heads, MLP 4096, vocab 32000, untied embeddings), a synthetic dataset in the real datasets
# layout (trainer.synthetic.write_random_commit: steps/ Parquet + commit manifest), then
# DeepSpeed bf16 ZeRO-1 PPO-clip training through the normal CLI, then figures from metrics.jsonl.
#
# MFU = 6 * N * tokens_per_s / PEAK, N = all parameters (embeddings included), attention
# score FLOPs not counted (so MFU is slightly understated), PEAK = 989e12 FLOP/s: H200 SXM
# dense BF16 (same tensor cores as H100 SXM; the 1979e12 figure is with 2:4 sparsity).
# tokens = non-padding tokens of the packed batches; the first WARMUP steps are skipped.
#
# Python: .venv/bin/python when it imports torch with CUDA, else python3; missing packages are
# installed from wheels carried in .whl/ (pip --no-index), never from the network.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$WORK"
PEAK=989e12
STEPS=${STEPS:-40}
WARMUP=${WARMUP:-5}
SEQ_LEN=${SEQ_LEN:-4096}
BATCH=${BATCH:-4}

PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  PY=.venv/bin/python
fi
if ! $PY -c "import torch, deepspeed, transformers, pyarrow, msgspec, typer, rich, pydantic, yaml" 2>/dev/null; then
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --find-links .whl torch deepspeed transformers peft pyarrow msgspec \
      numpy typer rich pydantic pydantic-settings pyyaml
  else
    echo "missing Python packages and no .whl/ directory to install them from" >&2
    exit 2
  fi
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

echo "== model + data in $WORK"
PYTHONPATH=. $PY - "$WORK" <<'EOF'
import sys, time
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trainer.synthetic import write_random_commit

work = Path(sys.argv[1])
t0 = time.time()
cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=64, max_position_embeddings=8192,
                  tie_word_embeddings=False, pad_token_id=0)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(work / "model")
(work / "params").write_text(str(n))
print(f"model: {n / 1e9:.3f}B parameters, {time.time() - t0:.0f}s")
t0 = time.time()
for c in (1, 2):  # two commits: the reader follows manifests across commits
    write_random_commit(work / "data", rows=6000, commit=c, seed=c, vocab_size=32000,
                        obs_tokens=(128, 1536), action_tokens=(64, 1024), row_group_size=512)
print(f"data: 12000 steps, {time.time() - t0:.0f}s")
EOF

cat > "$WORK/gpu.yaml" <<EOF
# trajpipe train --config $WORK/gpu.yaml --data $WORK/data --model $WORK/model --out $WORK/run
objective: {name: ppo}
engine: {zero_stage: 1, precision: bf16}
data: {seq_len: $SEQ_LEN, batch_size: $BATCH, num_workers: 4, prefetch_factor: 4}
optim: {lr: 1.0e-5, grad_accum: 1, warmup_steps: 5}
checkpoint: {at_end: false}
EOF

echo "== train $STEPS steps (bf16, ZeRO-1, seq $SEQ_LEN x batch $BATCH)"
PYTHONPATH=. $PY -m trajpipe train --config "$WORK/gpu.yaml" --data "$WORK/data" --model "$WORK/model" \
  --out "$WORK/run" --max-steps "$STEPS" 2>&1 | grep -v "Loading weights" | tail -5

PYTHONPATH=. $PY - "$WORK" "$PEAK" "$WARMUP" <<'EOF'
import json, sys
from pathlib import Path
work, peak, warmup = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
n = int((work / "params").read_text())
steps = [json.loads(l) for l in (work / "run" / "metrics.jsonl").read_text().splitlines()]
steps = [s for s in steps if "step" in s and s["step"] > warmup]
time_s = sum(s["perf/step_time_s"] for s in steps)
tokens = sum(s["perf/tokens_per_s"] * s["perf/step_time_s"] for s in steps)
wait = sum(s["perf/data_wait_fraction"] * s["perf/step_time_s"] for s in steps)
tps = tokens / time_s
out = {"gpu_params": n, "gpu_tokens_per_s": round(tps), "gpu_mfu": round(6 * n * tps / peak, 4),
       "gpu_peak_flops": peak, "gpu_data_wait_pct": round(100 * wait / time_s, 2), "gpu_steps_measured": len(steps)}
(work / "gpu_train.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out))
EOF
