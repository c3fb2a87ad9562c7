"""Run one episode of a policy in an environment and emit its events.

Event order for one episode (``seq`` gap-free from 0, ``event_id =
make_event_id(episode_id, seq)``)::

    0      EpisodeStarted   task spec, env config, prompt, sampling
    1      Step             step 0: action, tokens, logprobs, tool call + result
    2..k   StepVerified     one per verdict on step 0
    ...    Step / StepVerified for each further step
    last   EpisodeFinished  status, outcome reward, number of steps

A ``Step``'s ``observation`` is what the policy saw new before acting (the
environment's answer to the previous action; empty for step 0, whose input is
``EpisodeStarted.prompt``). Sandboxed commands are recorded in the tool fields:
``tool_args`` holds the command (JSON), ``tool_result`` the bounded
stdout/stderr, exit status, limit flags and ``files_changed`` (JSON).

Token-in, token-out: for a policy with a tokenizer (``policy.chat``), the
episode keeps its context as token ids (:class:`rollout.context.TokenContext`):
the policy is fed exactly those ids, and each ``Step`` records the ids appended
since the previous action as ``observation_token_ids`` (step 0: the rendered
prompt) plus any context cut, so the recorded steps rebuild, id for id, what
the model was fed (:func:`rollout.context.model_input_of`).

Environment failures (sandbox down, internal errors) and policy failures end
the episode with status ``error``; passing ``episode_timeout_s`` ends it with
status ``timeout``. Either way the episode is closed by an ``EpisodeFinished``
event, so downstream never sees a dangling episode from a worker that lived.
``EpisodeFinished.termination`` says why it stopped: ``done`` (the environment
ended it), ``max_steps`` (the step budget ran out; the environment still judges
the work), ``timeout`` or ``error`` (no verdict).

``emit`` is typically :meth:`streams.producer.EventProducer.emit`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec

from rollout.context import TokenContext
from rollout.envs.base import Environment, EnvironmentFailure, Task, dump_json
from rollout.policies.base import Message, Policy, PolicyContext
from rollout.sandbox import SandboxError
from schemas.events import (
    EpisodeFinished,
    EpisodeStarted,
    PURPOSE_TRAIN,
    EpisodeStatus,
    Event,
    Step,
    StepVerified,
    Termination,
    make_event_id,
)

__all__ = ["EpisodeSummary", "run_episode", "MAX_OBSERVATION_CHARS"]

log = logging.getLogger(__name__)

#: Longest observation recorded in a Step event (characters).
MAX_OBSERVATION_CHARS = 16_384


class EpisodeSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`run_episode` did.

    Attributes:
        episode_id: the episode.
        task_id: the task.
        domain: the task's domain.
        status: how it ended.
        reward: outcome reward in [0, 1] (0 for error/timeout).
        num_steps: Step events emitted.
        num_events: all events emitted (``seq`` of the last one + 1).
        duration_ms: wall time of the episode, milliseconds.
        env_error: True if an environment failure ended it (counts toward the
            scheduler's circuit breaker; task failures and policy errors do not).
        error: the failure message, if status is ``error``.
    """

    episode_id: str
    task_id: str
    domain: str
    status: EpisodeStatus
    reward: float
    num_steps: int
    num_events: int
    duration_ms: float
    env_error: bool = False
    error: str | None = None


def run_episode(
    env: Environment,
    policy: Policy,
    task: Task,
    *,
    episode_id: str,
    producer_id: str,
    max_steps: int,
    emit: Callable[[Event], None],
    task_group: str = "",
    group_size: int = 0,
    group_member: int = 0,
    sample: str = "",
    episode_timeout_s: float | None = None,
    purpose: str = PURPOSE_TRAIN,
) -> EpisodeSummary:
    """Run ``policy`` on ``task`` in ``env`` and emit the episode's events through ``emit``.

    Args:
        env: the domain's environment (reset here; the caller closes it).
        policy: acts on the conversation.
        task: the task; ``task.domain`` must equal ``env.domain``.
        episode_id: unique id of this episode (the Kafka key).
        producer_id: id of this worker process.
        max_steps: the episode ends after this many steps; ``env.outcome()`` judges it.
        emit: called with every event in ``seq`` order.
        task_group: group id shared by rollouts of the same task (GRPO baselines).
        group_size: episodes started in the group (0: not a declared group).
        group_member: this episode's index in its group.
        sample: the sample key mixed into the policy's sampling seed (group
            round, member, attempt), so group members draw different actions.
        episode_timeout_s: wall-clock budget; checked between steps (each step is
            bounded by the environment's own command timeouts).
        purpose: ``EpisodeStarted.purpose``: ``train`` or ``eval`` (a held-out evaluation).

    Returns:
        The :class:`EpisodeSummary`.

    Raises:
        ValueError: ``max_steps < 1`` or ``task.domain`` differs from ``env.domain``.
    """
    if max_steps < 1:
        raise ValueError(f"`max_steps` must be >= 1, got {max_steps}")
    if task.domain != env.domain:
        raise ValueError(f"task domain {task.domain!r} does not match env domain {env.domain!r}")
    started = time.monotonic()
    deadline = started + episode_timeout_s if episode_timeout_s else None
    seq = 0
    envelope = {"episode_id": episode_id, "producer_id": producer_id, "domain": task.domain,
                "task_id": task.task_id, "policy_version": policy.policy_version}

    def _emit(cls: type[Event], **fields) -> None:
        nonlocal seq
        emit(cls(event_id=make_event_id(episode_id, seq), seq=seq, **envelope, **fields))
        seq += 1

    status: EpisodeStatus | None = None
    termination: Termination | None = None
    error: str | None = None
    env_error = False
    try:
        prompt = env.reset(task)
    except (EnvironmentFailure, SandboxError) as err:
        prompt, status, error, env_error = task.prompt, EpisodeStatus.ERROR, f"reset failed: {err}", True
    _emit(EpisodeStarted, task_spec=dump_json(task.spec), env_config=dump_json(env.config()),
          difficulty=task.difficulty, prompt=prompt, sampling=policy.sampling, task_group=task_group,
          group_size=group_size, group_member=group_member, policy_lineage=getattr(policy, "policy_lineage", ""),
          purpose=purpose)

    chat = getattr(policy, "chat", None)
    tokens = TokenContext(chat, max_prompt_tokens=policy.max_prompt_tokens) if chat is not None else None
    observation_ids = tokens.begin(prompt) if tokens is not None else []
    messages = [Message("user", prompt)]
    observation = ""
    num_steps = 0
    while status is None and num_steps < max_steps:
        if deadline is not None and time.monotonic() > deadline:
            status, error = EpisodeStatus.TIMEOUT, f"episode exceeded {episode_timeout_s}s"
            break
        t0 = time.monotonic()
        window = tokens.model_input() if tokens is not None else None
        try:
            action = policy.act(PolicyContext(task=task, messages=list(messages), step_index=num_steps,
                                              prompt_ids=window.ids if window is not None else None, sample=sample))
        except Exception as err:  # noqa: BLE001 - any policy crash ends this episode, not the worker
            log.exception("policy failed in episode %s", episode_id)
            status, error = EpisodeStatus.ERROR, f"policy failed: {type(err).__name__}: {err}"
            break
        try:
            out = env.step(action.text)
        except (EnvironmentFailure, SandboxError) as err:
            status, error, env_error = EpisodeStatus.ERROR, f"environment failed: {err}", True
            break
        except Exception as err:  # noqa: BLE001 - an env bug is an env failure for this episode
            log.exception("environment crashed in episode %s", episode_id)
            status, error, env_error = EpisodeStatus.ERROR, f"environment crashed: {type(err).__name__}: {err}", True
            break
        latency_ms = (time.monotonic() - t0) * 1000.0
        _emit(Step, step_index=num_steps, observation=observation[:MAX_OBSERVATION_CHARS],
              observation_token_ids=observation_ids, action_text=action.text, action_token_ids=action.token_ids,
              behaviour_logprobs=action.logprobs, tool_name=out.tool_name, tool_args=out.tool_args,
              tool_result=out.tool_result, exit_status=out.exit_status, latency_ms=latency_ms,
              prompt_tokens=action.prompt_tokens,
              context_cut_start=window.cut_start if window is not None else 0,
              context_cut_tokens=window.cut_tokens if window is not None else 0)
        for verdict in out.verdicts:
            _emit(StepVerified, step_index=num_steps, verifier=verdict.verifier, passed=verdict.passed,
                  score=verdict.score, details=verdict.details)
        num_steps += 1
        messages += [Message("assistant", action.text), Message("tool", out.observation)]
        observation = out.observation
        if tokens is not None:
            tokens.add_action(action.token_ids)
            observation_ids = tokens.add_observation(out.observation)
        if out.done:
            termination = Termination.DONE
            break

    reward, summary = 0.0, error or ""
    if status is None:
        termination = termination or Termination.MAX_STEPS
        try:
            outcome = env.outcome()
            status, reward, summary = EpisodeStatus(outcome.status), outcome.reward, outcome.summary
        except (EnvironmentFailure, SandboxError) as err:
            status, error, env_error = EpisodeStatus.ERROR, f"final verification failed: {err}", True
            summary = error
    if status in (EpisodeStatus.ERROR, EpisodeStatus.TIMEOUT):
        termination = Termination(status.value)
    _emit(EpisodeFinished, status=status, outcome_reward=reward, num_steps=num_steps,
          verifier_summary=summary[:1000], termination=termination.value)
    return EpisodeSummary(episode_id=episode_id, task_id=task.task_id, domain=task.domain, status=status,
                          reward=reward, num_steps=num_steps, num_events=seq,
                          duration_ms=(time.monotonic() - started) * 1000.0, env_error=env_error, error=error)
