"""The learning-signal round trip, measured: behaviour log-probs back from the trainer's data path (~3 minutes).

For each policy engine (``hf`` = transformers, ``vllm``): ``trajpipe rollout`` of the
tiny random-init model at v0 (16 episodes in GRPO groups of 4, 3 steps each in the
sandboxed ``code`` and the ``math`` domains, temperature 0.7, top-p 0.9, 16 tokens per
action) to a fresh topic of the bench broker → the trajectory job (FnApiRunner) →
:func:`trainer.audit.audit_behaviour_logprobs` with the same v0 weights: the trainer's
episode windows rebuilt from the recorded token stream, scored on each step's sampling
distribution, against the behaviour log-probs the rollout recorded.

Figures: ``behaviour_logprob_max_abs_err`` (hf; float32 transformers on both sides, the
only difference is ``generate``'s KV cache vs. one packed forward) and
``behaviour_logprob_max_abs_err_vllm`` (vLLM's CPU kernels against transformers), plus the
tokens compared (``..._tokens``) and the mean error (``..._mean_abs_err``).

Usage::

    .venv/bin/python -m bench.run round_trip
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from rollout.model import init_tiny_model
from streams.config import KafkaConnection
from trainer.audit import audit_behaviour_logprobs

__all__ = ["bench_round_trip"]

REPO = Path(__file__).resolve().parents[1]


def _rollout(bootstrap: str, topic: str, policy: str, model: Path, spool: Path) -> dict:
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "2"}
    cmd = [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", bootstrap, "--spool-dir", str(spool),
           "--policy", policy, "--model", str(model), "--episodes", "16", "--group-size", "4", "--concurrency", "8",
           "--max-steps", "3", "--max-tokens", "16", "--temperature", "0.7", "--top-p", "0.9",
           "--domains", "code,math", "--seed", "1", "--no-follow-policies"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trajpipe rollout --policy {policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_round_trip(bootstrap: str, workdir: Path) -> dict:
    """Both engines' round trips; returns the figures (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tiny = init_tiny_model(workdir / "tiny", seed=0)
    conn = KafkaConnection(bootstrap_servers=bootstrap)
    out: dict = {}
    for policy, suffix in (("hf", ""), ("vllm", "_vllm")):
        topic = f"bench.roundtrip.{policy}.{uuid.uuid4().hex[:8]}"
        counts = _rollout(bootstrap, topic, policy, tiny, workdir / f"spool-{policy}")
        data = workdir / f"datasets-{policy}"
        job = run_batch(out=data, recipe=load_recipe("outcome"), input=KafkaInput(conn=conn, topic=topic))
        audit = audit_behaviour_logprobs(data, tiny, policy_version=0, seq_len=2048)
        if audit.tokens == 0 or audit.inexact_windows or job["episodes"] != counts["episodes"]:
            raise RuntimeError(f"{policy} round trip incomplete: rollout {counts}, job {job}, audit {audit}")
        out[f"behaviour_logprob_max_abs_err{suffix}"] = round(audit.max_abs_err, 8)
        out[f"behaviour_logprob_mean_abs_err{suffix}"] = round(audit.mean_abs_err, 8)
        out[f"behaviour_logprob_tokens{suffix}"] = audit.tokens
    return out
