"""Episode runner: gap-free seq, stable ids, codec round-trip, errors and timeouts end episodes."""

from __future__ import annotations

import pytest

from rollout.envs import generate_tasks, make_env
from rollout.envs.base import EnvironmentFailure
from rollout.episode import run_episode
from rollout.policies import ScriptedPolicy
from rollout.sandbox import Sandbox
from schemas.codec import decode_event, encode_event
from schemas.events import EpisodeFinished, EpisodeStarted, EpisodeStatus, Step, StepVerified, make_event_id


def _check_stream(events, episode_id):
    assert [e.seq for e in events] == list(range(len(events)))
    assert all(e.event_id == make_event_id(episode_id, e.seq) for e in events)
    assert isinstance(events[0], EpisodeStarted) and isinstance(events[-1], EpisodeFinished)
    for e in events:
        assert decode_event(encode_event(e)) == e


@pytest.mark.parametrize("domain", ["math", "docqa", "code", "tools"])
def test_events_are_gap_free_and_round_trip(domain, sandbox_root):
    kwargs = {"sandbox_factory": lambda: Sandbox(sandbox_root)} if domain in ("code", "tools") else {}
    env = make_env(domain, **kwargs)
    task = generate_tasks(domain, 1, seed=9, difficulty=1)[0]
    events = []
    try:
        summary = run_episode(env, ScriptedPolicy(noise=0.2, seed=9, policy_version=3), task, episode_id="ep-1",
                              producer_id="w7", max_steps=12, emit=events.append, task_group="g1")
    finally:
        env.close()
    _check_stream(events, "ep-1")
    steps = [e for e in events if isinstance(e, Step)]
    assert summary.num_events == len(events) and summary.num_steps == len(steps) == events[-1].num_steps
    assert [s.step_index for s in steps] == list(range(len(steps)))
    assert all(e.policy_version == 3 and e.producer_id == "w7" and e.domain == domain for e in events)
    assert all(len(s.action_token_ids) == len(s.behaviour_logprobs) > 0 for s in steps)
    assert any(isinstance(e, StepVerified) for e in events)
    assert events[0].task_group == "g1" and events[0].prompt == task.prompt
    if domain in ("code", "tools"):
        sandboxed = [s for s in steps if s.exit_status is not None]
        assert sandboxed and all(s.tool_args and s.tool_result for s in sandboxed)


class _BrokenEnv:
    domain = "math"

    def __init__(self, fail_at):
        self.fail_at, self.n = fail_at, 0

    def config(self):
        return {}

    def reset(self, task):
        if self.fail_at == "reset":
            raise EnvironmentFailure("sandbox pool empty")
        return task.prompt

    def step(self, action):
        raise EnvironmentFailure("sandbox died")

    def outcome(self):
        raise AssertionError("not reached")

    def close(self):
        pass


@pytest.mark.parametrize("fail_at", ["reset", "step"])
def test_env_failure_ends_episode_with_error(fail_at):
    task = generate_tasks("math", 1, seed=1)[0]
    events = []
    summary = run_episode(_BrokenEnv(fail_at), ScriptedPolicy(), task, episode_id="ep-x", producer_id="w",
                          max_steps=5, emit=events.append)
    _check_stream(events, "ep-x")
    assert summary.status == EpisodeStatus.ERROR and summary.env_error
    assert events[-1].status == EpisodeStatus.ERROR and "sandbox" in events[-1].verifier_summary


def test_timeout_ends_episode_with_timeout():
    task = generate_tasks("math", 1, seed=1, difficulty=2)[0]
    events = []
    summary = run_episode(make_env("math"), ScriptedPolicy(), task, episode_id="ep-t", producer_id="w",
                          max_steps=50, emit=events.append, episode_timeout_s=1e-9)
    _check_stream(events, "ep-t")
    assert summary.status == EpisodeStatus.TIMEOUT and not summary.env_error


def test_rejects_mismatched_domain():
    with pytest.raises(ValueError, match="domain"):
        run_episode(make_env("math"), ScriptedPolicy(), generate_tasks("docqa", 1, seed=1)[0], episode_id="e",
                    producer_id="w", max_steps=3, emit=lambda e: None)
