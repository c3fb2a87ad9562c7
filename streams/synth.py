"""Synthetic, schema-valid trajectory traffic for benchmarks, demos and tests.

Episodes look like real rollouts in size and shape: an ``episode_started``,
2–6 ``step`` events of a few KB (observation text, action text, a few hundred
token ids with per-token behaviour logprobs), one ``step_verified`` per step,
and an ``episode_finished``. Tasks come in groups of ``group_size`` rollouts
(for GRPO-style group baselines), declared as the rollout scheduler declares
them (``task_group``, ``group_size``, ``group_member``; one policy version per
group). Everything is a pure function of the seed.

Examples:
    >>> eps = list(generate_episodes(3, seed=7))
    >>> [e.event_type for e in eps[0]][:2], eps[0][-1].event_type
    (['episode_started', 'step'], 'episode_finished')
    >>> [e.seq for e in eps[0]] == list(range(len(eps[0])))
    True
    >>> list(generate_episodes(3, seed=7))[2][1] == eps[2][1]
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone

import numpy as np

from schemas.events import (
    EpisodeFinished,
    EpisodeStarted,
    EpisodeStatus,
    Event,
    SamplingParams,
    Step,
    StepVerified,
    make_event_id,
)

__all__ = ["DEFAULT_DOMAINS", "generate_episodes"]

DEFAULT_DOMAINS: tuple[str, ...] = ("code", "math", "docqa", "tools")

_WORDS = (
    "the revenue grew operating margin segment quarter function returns test failed passed compute ratio "
    "file command output value step answer cite table total net income cash flow assert error fix edit run"
).split()
_BASE_TIME = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n_words))


def generate_episodes(
    n: int,
    *,
    domains: Sequence[str] = DEFAULT_DOMAINS,
    seed: int = 0,
    producer_id: str = "synth",
    group_size: int = 4,
    policy_versions: int = 3,
    vocab_size: int = 32000,
) -> Iterator[list[Event]]:
    """Yield ``n`` synthetic episodes, each as its list of events in ``seq`` order.

    Args:
        n: number of episodes.
        domains: domains to cycle through.
        seed: RNG seed; the same seed gives the same events (ids included).
        producer_id: envelope ``producer_id``.
        group_size: rollouts per task (episodes sharing ``task_id``/``task_group``).
        policy_versions: policy versions are drawn from ``0..policy_versions-1``.
        vocab_size: token ids are drawn below this.

    Raises:
        ValueError: on an empty domain list or non-positive sizes.
    """
    if not domains:
        raise ValueError("`domains` must name at least one domain")
    if n < 0 or group_size < 1 or policy_versions < 1:
        raise ValueError("`n` must be >= 0, `group_size` and `policy_versions` >= 1")
    rng = np.random.default_rng(seed)
    policy_version = 0
    for i in range(n):
        domain = domains[(i // group_size) % len(domains)]
        task_no, member = divmod(i, group_size)
        task_id = f"{domain}-{seed}-{task_no:06d}"
        episode_id = f"synth-{seed}-{i:08d}"
        if member == 0:  # one policy version per group, as the rollout worker starts a group
            policy_version = int(rng.integers(0, policy_versions))
        size = min(group_size, n - task_no * group_size)
        difficulty = int(rng.integers(0, 4))
        skill = 0.75 - 0.15 * difficulty
        t = _BASE_TIME + timedelta(seconds=float(i))
        seq = 0

        def env(seq: int) -> dict:
            return dict(
                event_id=make_event_id(episode_id, seq), episode_id=episode_id, seq=seq, producer_id=producer_id,
                domain=domain, task_id=task_id, policy_version=policy_version,
                event_time=t + timedelta(milliseconds=50 * seq),
            )

        events: list[Event] = [
            EpisodeStarted(
                **env(0),
                task_spec=json.dumps({"domain": domain, "task_no": task_no, "question": _text(rng, 30)}),
                env_config=json.dumps({"cpu_s": 10, "mem_mb": 512}),
                difficulty=difficulty,
                prompt=_text(rng, 60),
                sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=512, seed=int(rng.integers(1 << 31))),
                task_group=f"{task_id}@v{policy_version}#synth-{seed}.{task_no}", group_size=size,
                group_member=member,
            )
        ]
        n_steps = int(rng.integers(2, 7))
        passes = 0
        for k in range(n_steps):
            n_obs = int(rng.integers(40, 160))
            n_act = int(rng.integers(100, 400))
            seq += 1
            events.append(
                Step(
                    **env(seq),
                    step_index=k,
                    observation=_text(rng, n_obs),
                    observation_token_ids=rng.integers(0, vocab_size, n_obs, dtype=np.int32),
                    action_text=_text(rng, n_act // 2),
                    action_token_ids=rng.integers(0, vocab_size, n_act, dtype=np.int32),
                    behaviour_logprobs=np.log(rng.uniform(0.05, 1.0, n_act)).astype(np.float32),
                    tool_name="run" if k % 2 else "write_file",
                    tool_args=json.dumps({"cmd": "pytest -q"} if k % 2 else {"path": "solution.py"}),
                    tool_result=_text(rng, 20),
                    exit_status=int(rng.random() > skill),
                    latency_ms=float(rng.gamma(2.0, 150.0)),
                    prompt_tokens=n_obs,
                )
            )
            ok = bool(rng.random() < skill)
            passes += ok
            seq += 1
            events.append(
                StepVerified(
                    **env(seq), step_index=k, verifier=f"{domain}.step_check", passed=ok, score=float(ok),
                    details="synthetic",
                )
            )
        success = bool(rng.random() < skill)
        seq += 1
        events.append(
            EpisodeFinished(
                **env(seq),
                status=EpisodeStatus.SUCCESS if success else EpisodeStatus.FAILURE,
                outcome_reward=1.0 if success else 0.0,
                num_steps=n_steps,
                verifier_summary=f"{passes}/{n_steps} steps verified",
                termination="done",
            )
        )
        yield events
