"""Rollout throughput per policy: episodes/s of the rollout worker on this machine (~2 minutes).

Every policy runs the same workload shape against the same broker: episodes of
all four domains, events to a fresh events topic through ``EventProducer``.

* ``scripted``: 40 episodes, 4 in flight (environment + Kafka cost only).
* ``hf`` and ``vllm``: the tiny random-init model (``trajpipe model init-tiny``),
  16 episodes of at most 4 steps, 32 new tokens per action (random weights
  never finish early, so every episode is 4 policy calls of 32 tokens).
  ``hf``: 4 in flight, generate calls serialised. ``vllm``: 8 in flight, their
  prompts batched into one ``generate`` per round; it runs as ``trajpipe
  rollout`` in a subprocess (vLLM's process-wide settings stay out of this
  one) and engine start-up is reported separately, not counted in episodes/s.

Figures: ``rollout_{scripted,hf,vllm}_episodes_per_s``, ``rollout_vllm_load_s``.

Usage::

    .venv/bin/python -m bench.run rollout
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from rollout.model import init_tiny_model
from rollout.policies.hf import HFPolicy
from rollout.policies.scripted import ScriptedPolicy
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from schemas.events import SamplingParams
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer

__all__ = ["bench_rollout"]

DOMAINS = ["code", "math", "docqa", "tools"]
MODEL_EPISODES = 16
MAX_STEPS = 4
MAX_TOKENS = 32


def _run_in_process(policy, conn: KafkaConnection, workdir: Path, *, episodes: int, concurrency: int,
                    max_steps: int) -> float:
    topics = Topics(events=f"bench.rollout.{uuid.uuid4().hex[:8]}", partitions=4)
    ensure_topics(conn, topics)
    with EventProducer(conn, topics.events, spool_dir=workdir / "spool") as producer:
        worker = RolloutWorker(policy, emit=producer.emit, scheduler=make_scheduler(DOMAINS, seed=0),
                               config=RolloutConfig(episodes=episodes, concurrency=concurrency, max_steps=max_steps,
                                                    producer_id="bench"))
        counts = worker.run()
        producer.flush()
    return counts.episodes_per_s


def _run_vllm(bootstrap: str, model: Path, workdir: Path) -> tuple[float, float]:
    topic = f"bench.rollout.{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl"}
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", bootstrap, "--policy", "vllm",
         "--model", str(model), "--episodes", str(MODEL_EPISODES), "--concurrency", "8",
         "--max-steps", str(MAX_STEPS), "--max-tokens", str(MAX_TOKENS), "--domains", ",".join(DOMAINS),
         "--no-follow-policies", "--spool-dir", str(workdir / "spool-vllm")],
        cwd=Path(__file__).resolve().parents[1], env=env, check=False, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vllm rollout failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    load = re.search(r"vLLM engine loaded in ([0-9.]+) s", proc.stderr)
    return counts["episodes_per_s"], float(load.group(1)) if load else float("nan")


def bench_rollout(bootstrap: str, workdir: Path) -> dict:
    """Episodes/s of the scripted, HF and vLLM policies (see the module docstring).

    Args:
        bootstrap: Kafka bootstrap servers.
        workdir: scratch directory (model, spools).

    Returns:
        ``{"rollout_scripted_episodes_per_s", "rollout_hf_episodes_per_s",
        "rollout_vllm_episodes_per_s", "rollout_vllm_load_s"}``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-rollout")
    model = init_tiny_model(workdir / "tiny")
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    scripted = _run_in_process(ScriptedPolicy(seed=0), conn, workdir, episodes=40, concurrency=4, max_steps=16)
    hf = _run_in_process(HFPolicy.from_pretrained(model, sampling=sampling), conn, workdir,
                         episodes=MODEL_EPISODES, concurrency=4, max_steps=MAX_STEPS)
    vllm_eps, vllm_load = _run_vllm(bootstrap, model, workdir)
    return {
        "rollout_scripted_episodes_per_s": round(scripted, 3),
        "rollout_hf_episodes_per_s": round(hf, 3),
        "rollout_vllm_episodes_per_s": round(vllm_eps, 3),
        "rollout_vllm_load_s": round(vllm_load, 1),
    }
