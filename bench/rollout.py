"""Rollout throughput per policy: episodes/s of the rollout worker on this machine (~5 minutes).

Every policy runs the same workload shape against the same broker: episodes of
all four domains, events to a fresh events topic through ``EventProducer``.

* ``scripted``: 40 episodes, 4 in flight (environment + Kafka cost only).
* ``hf`` and ``vllm``: the tiny random-init model (``trajpipe model init-tiny``),
  episodes of at most 4 steps, 32 new tokens per action (random weights
  rarely stop early). ``hf``: 16 episodes, 4 in flight, generate calls
  serialised. ``vllm``: 256 episodes, all in flight (``--concurrency 256``, so
  ``max_batch`` 256), their requests continuously batched on one engine; 256
  is the engine's own batch width (its scheduler's ``max_num_seqs``, vLLM's
  default for ``LLM`` on CPU; recorded as ``rollout_vllm_engine_max_num_seqs``):
  the rollout fills the engine as wide as it runs. The engine's batch is never
  wider than the episodes in flight, so with fewer (64 until 2026-12-06) the
  offline reference below ran 4x wider than the rollout could, and the ratio
  measured the episodes' step dependency, not how busy the rollout keeps the
  engine (docs/rollout.md, issue 16 item 4). It runs as ``trajpipe rollout`` in
  a subprocess (vLLM's process-wide settings stay out of this one) and engine
  start-up is reported separately, not counted in episodes/s.

vLLM against its own offline ``generate`` (``rollout_vllm_tokens_vs_generate``,
goal >= 0.7): the prompts the rollout actually sent are rebuilt from its step
events on the topic (``rollout.context.model_input_of``: id for id what the
engine was fed, tested in tests/rollout/test_policies_vllm.py), each with its
seed (``rollout.model.step_seed`` of the episode's seed, task, sample key and
step). ``bench.vllm_offline`` then runs them through one ``LLM.generate`` call
in a subprocess, same engine arguments and sampling parameters.

* rollout tokens/s = the tokens the engine generated for the rollout's policy
  calls / the wall time from the first request entering the engine to the last
  one finishing (``generated_tokens`` / ``generation_s`` on the rollout's
  last-line counts; engine start-up excluded, the environment steps that run in
  sandboxes between an episode's policy calls included: the ratio says how
  busy the engine stays);
* generate tokens/s = the tokens of the offline call / its wall time (engine
  start-up excluded).

Figures: ``rollout_{scripted,hf,vllm}_episodes_per_s``, ``rollout_vllm_load_s``,
``rollout_vllm_tokens_per_s``, ``rollout_vllm_generate_tokens_per_s``,
``rollout_vllm_tokens_vs_generate``, ``rollout_vllm_generate_by_step_tokens_per_s``
and ``rollout_vllm_tokens_vs_generate_by_step`` (the offline reference run once
per step index, see ``bench.vllm_offline``), ``rollout_vllm_engine_busy`` (share of
the rollout's generation time the engine spent in ``step``),
``rollout_vllm_same_actions`` (share of the offline actions equal, token for
token, to the recorded ones: 1.0 means the same work was measured twice),
``rollout_vllm_concurrency`` (episodes in flight),
``rollout_vllm_engine_max_num_seqs`` (the engine's batch width, read from the
offline engine, which has the same arguments), and the width each side ran:
``rollout_vllm_tokens_per_engine_step``,
``rollout_vllm_generate_tokens_per_engine_step`` and
``rollout_vllm_generate_by_step_tokens_per_engine_step`` (tokens generated per
``LLMEngine.step``: about the requests decoding in a step).

Each figure is the best of ``VLLM_REPEATS`` (2) pairs, a rollout and then the
offline reference over that rollout's prompts (the pipeline bench's rule: the
shared machine's noise only ever slows a run down);
``rollout_vllm_repeats`` says how many, and
``rollout_vllm_tokens_vs_generate_pair_min`` / ``_pair_max`` give the spread of
the pairs' own ratios.

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

import msgspec

from rollout.context import model_input_of
from rollout.model import init_tiny_model, step_seed
from rollout.policies.hf import HFPolicy
from rollout.policies.scripted import ScriptedPolicy
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from schemas.codec import decode_event
from schemas.events import EpisodeStarted, SamplingParams, Step
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.consumer import end_offsets, ranges_from, read_range
from streams.producer import EventProducer

__all__ = ["RecordedRequests", "bench_rollout", "bench_vllm_against_generate", "vllm_figures"]

DOMAINS = ["code", "math", "docqa", "tools"]
MODEL_EPISODES = 16  # hf
MAX_STEPS = 4
MAX_TOKENS = 32
VLLM_EPISODES = 256
VLLM_CONCURRENCY = 256  # every episode in flight, as many as the engine batches (its max_num_seqs on CPU)
VLLM_REPEATS = 2  # rollout + offline pairs; the best of each side counts
MAX_MODEL_LEN = 2048  # VLLMPolicy's default, which `trajpipe rollout` uses


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


def _run_vllm(bootstrap: str, model: Path, workdir: Path) -> tuple[dict, str]:
    """``trajpipe rollout --policy vllm`` in a subprocess: its last-line counts (plus engine load time), its topic."""
    topic = f"bench.rollout.{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl"}
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", bootstrap, "--policy", "vllm",
         "--model", str(model), "--episodes", str(VLLM_EPISODES), "--concurrency", str(VLLM_CONCURRENCY),
         "--max-steps", str(MAX_STEPS), "--max-tokens", str(MAX_TOKENS), "--domains", ",".join(DOMAINS),
         "--no-follow-policies", "--spool-dir", str(workdir / "spool-vllm")],
        cwd=Path(__file__).resolve().parents[1], env=env, check=False, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vllm rollout failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    load = re.search(r"vLLM engine loaded in ([0-9.]+) s", proc.stderr)
    counts["load_s"] = float(load.group(1)) if load else float("nan")
    return counts, topic


class RecordedRequests(msgspec.Struct, kw_only=True):
    """The policy calls of a rollout, rebuilt from its events; one entry per call in each list.

    Attributes:
        prompts: the token ids the engine was fed.
        seeds: the sampling seed of the call.
        step_indexes: the episode step the call acted for.
        actions: the token ids it generated (as recorded on the step).
        sampling: the episodes' sampling parameters (one rollout: the same for all).
    """

    prompts: list[list[int]]
    seeds: list[int]
    step_indexes: list[int]
    actions: list[list[int]]
    sampling: SamplingParams


def _recorded_requests(conn: KafkaConnection, topic: str) -> RecordedRequests:
    """Every policy call of the rollout on ``topic``, from its step events.

    The seed is the one :meth:`rollout.policies.vllm.VLLMPolicy.act` drew: ``step_seed`` of the episode's
    seed, task, sample key (``<round>.<member>.<attempt>``; the round ends ``task_group``, attempts are 0
    in a run without retries) and step index.
    """
    ranges = ranges_from(topic=topic, start={}, end=end_offsets(conn, topic))
    episodes: dict[str, list] = {}
    for batch in read_range(conn, ranges, stall_timeout_s=30):
        for record in batch:
            event = decode_event(record.value)
            episodes.setdefault(event.episode_id, []).append(event)
    out = RecordedRequests(prompts=[], seeds=[], step_indexes=[], actions=[], sampling=SamplingParams())
    for events in episodes.values():
        started = next(e for e in events if isinstance(e, EpisodeStarted))
        steps = sorted((e for e in events if isinstance(e, Step)), key=lambda e: e.step_index)
        out.sampling = started.sampling
        sample = f"{started.task_group.rsplit('.', 1)[1]}.{started.group_member}.0"
        obs, act = [s.observation_token_ids for s in steps], [s.action_token_ids for s in steps]
        for k, step in enumerate(steps):
            out.prompts.append(model_input_of(obs, act, step=k, cut_start=step.context_cut_start,
                                              cut_tokens=step.context_cut_tokens))
            out.seeds.append(step_seed(started.sampling.seed or 0, started.task_id, step.step_index, sample=sample))
            out.step_indexes.append(step.step_index)
            out.actions.append(step.action_token_ids.tolist())
    return out


def _run_offline_generate(model: Path, workdir: Path, recorded: RecordedRequests) -> dict:
    """``bench.vllm_offline`` in a subprocess over the recorded prompts; its answer."""
    request, answer = workdir / "offline-request.json", workdir / "offline-answer.json"
    request.write_text(json.dumps({"model": str(model), "prompts": recorded.prompts, "seeds": recorded.seeds,
                                   "step_indexes": recorded.step_indexes,
                                   "sampling": msgspec.to_builtins(recorded.sampling),
                                   "max_model_len": MAX_MODEL_LEN}))
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_offline", str(request), str(answer)],
                          cwd=Path(__file__).resolve().parents[1], check=False, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"offline vLLM generate failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(answer.read_text())


def bench_vllm_against_generate(bootstrap: str, model: Path, workdir: Path, *, repeats: int = VLLM_REPEATS) -> dict:
    """The vLLM rollout's episodes/s and generated tokens/s, against offline ``generate`` over its prompts.

    ``repeats`` pairs, each a rollout and then the offline reference over that rollout's prompts; the
    figures of the pairs: :func:`vllm_figures` (as in ``bench.pipeline``, the best of each side counts).

    Returns:
        The ``rollout_vllm_*`` figures of the module docstring.
    """
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-rollout-vllm")
    rollouts, offlines, same = [], [], []
    for _ in range(repeats):
        counts, topic = _run_vllm(bootstrap, model, workdir)
        recorded = _recorded_requests(conn, topic)
        if len(recorded.prompts) != counts["policy_requests"] or not recorded.prompts:
            raise RuntimeError(f"{len(recorded.prompts)} steps on {topic} but the engine ran "
                               f"{counts['policy_requests']} requests: the recorded prompts are not what the "
                               "rollout sent")
        offline = _run_offline_generate(model, workdir, recorded)
        rollouts.append(counts)
        offlines.append(offline)
        same.append(sum(a == b for a, b in zip(recorded.actions, offline["token_ids"])) / len(recorded.actions))
    return vllm_figures(rollouts, offlines, same)


def vllm_figures(rollouts: list[dict], offlines: list[dict], same: list[float]) -> dict:
    """The ``rollout_vllm_*`` figures of ``len(rollouts)`` pairs, each a rollout and the offline run after it.

    Args:
        rollouts: each rollout's last-line counts (``generated_tokens``, ``generation_s``, ``engine_busy_s``,
            ``engine_steps``, ``episodes_per_s``) plus ``load_s``.
        offlines: each offline reference's answer (``bench.vllm_offline``: ``generated_tokens``,
            ``generate_s``, ``generate_engine_steps``, the ``by_step_*`` figures, ``max_num_seqs``).
        same: each pair's share of offline actions equal to the recorded ones.

    The best figure of each side counts (the shared machine's noise only ever slows a run down): the
    rollout's rate, width and busy share are those of its fastest run, the one-call and by-step
    references each their fastest run's, ``rollout_vllm_same_actions`` the lowest pair's;
    ``_pair_min`` / ``_pair_max`` are the pairs' own ratios, each rollout against the reference run after it.
    """
    def rollout_rate(c: dict) -> float:
        return c["generated_tokens"] / c["generation_s"]

    def one_call_rate(o: dict) -> float:
        return o["generated_tokens"] / o["generate_s"]

    def by_step_rate(o: dict) -> float:
        return o["by_step_generated_tokens"] / o["by_step_generate_s"]

    counts = max(rollouts, key=rollout_rate)
    one_call = max(offlines, key=one_call_rate)
    by_step = max(offlines, key=by_step_rate)
    pairs = [rollout_rate(c) / one_call_rate(o) for c, o in zip(rollouts, offlines)]  # each with the reference after it
    rollout_tps, generate_tps, by_step_tps = rollout_rate(counts), one_call_rate(one_call), by_step_rate(by_step)
    return {
        "rollout_vllm_episodes_per_s": round(max(c["episodes_per_s"] for c in rollouts), 3),
        "rollout_vllm_load_s": round(min(c["load_s"] for c in rollouts), 1),
        "rollout_vllm_tokens_per_s": round(rollout_tps, 1),
        "rollout_vllm_generate_tokens_per_s": round(generate_tps, 1),
        "rollout_vllm_tokens_vs_generate": round(rollout_tps / generate_tps, 3),
        "rollout_vllm_generate_by_step_tokens_per_s": round(by_step_tps, 1),
        "rollout_vllm_tokens_vs_generate_by_step": round(rollout_tps / by_step_tps, 3),
        "rollout_vllm_engine_busy": round(counts["engine_busy_s"] / counts["generation_s"], 3),
        "rollout_vllm_tokens_per_engine_step": round(counts["generated_tokens"] / counts["engine_steps"], 1),
        "rollout_vllm_generate_tokens_per_engine_step": round(one_call["generated_tokens"]
                                                              / one_call["generate_engine_steps"], 1),
        "rollout_vllm_generate_by_step_tokens_per_engine_step": round(by_step["by_step_generated_tokens"]
                                                                      / by_step["by_step_engine_steps"], 1),
        "rollout_vllm_same_actions": round(min(same), 3),
        "rollout_vllm_concurrency": VLLM_CONCURRENCY,
        "rollout_vllm_engine_max_num_seqs": one_call["max_num_seqs"],
        "rollout_vllm_repeats": len(rollouts),
        "rollout_vllm_tokens_vs_generate_pair_min": round(min(pairs), 3),
        "rollout_vllm_tokens_vs_generate_pair_max": round(max(pairs), 3),
    }


def bench_rollout(bootstrap: str, workdir: Path) -> dict:
    """Episodes/s of the scripted, HF and vLLM policies (see the module docstring).

    Args:
        bootstrap: Kafka bootstrap servers.
        workdir: scratch directory (model, spools).

    Returns:
        ``rollout_scripted_episodes_per_s``, ``rollout_hf_episodes_per_s`` and the
        ``rollout_vllm_*`` figures of :func:`bench_vllm_against_generate`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-rollout")
    model = init_tiny_model(workdir / "tiny")
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    scripted = _run_in_process(ScriptedPolicy(seed=0), conn, workdir, episodes=40, concurrency=4, max_steps=16)
    hf = _run_in_process(HFPolicy.from_pretrained(model, sampling=sampling), conn, workdir,
                         episodes=MODEL_EPISODES, concurrency=4, max_steps=MAX_STEPS)
    return {
        "rollout_scripted_episodes_per_s": round(scripted, 3),
        "rollout_hf_episodes_per_s": round(hf, 3),
        **bench_vllm_against_generate(bootstrap, model, workdir),
    }
