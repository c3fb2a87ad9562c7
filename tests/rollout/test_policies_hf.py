"""HF policy: seeded sampling, logprob convention, EOS stop; end to end on a real broker; policy reload.

Logprob convention under test: the recorded log-prob of each sampled token is
``log_softmax(top_p(logits / temperature))`` at that token (the sampling
distribution), the same as vLLM's ``processed_logprobs``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.envs import generate_tasks
from rollout.model import init_tiny_model
from rollout.policies.base import Message, Policy, PolicyContext
from rollout.policies.hf import HFPolicy, score_tokens
from rollout.reload import PolicyFollower, make_policy_published
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from schemas.events import SamplingParams, Step
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from tests.rollout.test_worker import assert_complete_episodes, read_events

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny-hf") / "m", seed=0)


@pytest.fixture(scope="module")
def policy(tiny) -> HFPolicy:
    return HFPolicy.from_pretrained(tiny, sampling=SAMPLING)


def _context(domain: str = "math", index: int = 0, step: int = 0) -> PolicyContext:
    task = generate_tasks(domain, index + 1, seed=2)[index]
    return PolicyContext(task=task, messages=[Message("user", task.prompt)], step_index=step)


def test_act_records_tokens_and_sampling_logprobs(policy):
    assert isinstance(policy, Policy)
    ctx = _context()
    action = policy.act(ctx)
    assert 0 < len(action.token_ids) == len(action.logprobs) <= SAMPLING.max_tokens
    assert all(math.isfinite(lp) and lp <= 0 for lp in action.logprobs)
    assert action.prompt_tokens == len(policy.prompt_ids(ctx))
    assert action.sampling.temperature == 0.7 and action.sampling.seed != SAMPLING.seed  # per-step seed
    assert action.text == policy.tokenizer.decode(action.token_ids, skip_special_tokens=True)
    # Same context, same seed: the same action; another step index: another draw.
    assert policy.act(ctx).token_ids == action.token_ids
    assert policy.act(_context(step=1)).token_ids != action.token_ids
    # Recorded logprobs are the processed (tempered, nucleus-filtered) ones ...
    processed = score_tokens(policy.model, policy.prompt_ids(ctx), action.token_ids, action.sampling)
    np.testing.assert_allclose(action.logprobs, processed, atol=1e-4)
    # ... not the raw model distribution.
    raw = score_tokens(policy.model, policy.prompt_ids(ctx), action.token_ids, SamplingParams())
    assert np.abs(np.array(raw) - np.array(action.logprobs)).max() > 0.05


def test_greedy_records_raw_logprobs_and_stops_at_eos(tiny):
    greedy = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(temperature=0.0, max_tokens=8))
    ctx = _context("docqa")  # a long prompt: cut to the context, ends with the assistant marker
    action = greedy.act(ctx)
    prompt = greedy.prompt_ids(ctx)
    assert len(prompt) == greedy.max_prompt_tokens == 2048 - 8
    with torch.no_grad():
        logits = greedy.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert action.token_ids[0] == int(logits.argmax())
    assert action.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)
    # Make EOS the model's favourite token: generation stops right after it, EOS recorded.
    eos = greedy.tokenizer.eos_token_id
    boost = torch.zeros(len(greedy.tokenizer))
    boost[eos] = 100.0
    hook = greedy.model.lm_head.register_forward_hook(lambda module, args, out: out + boost)
    try:
        stopped = greedy.act(_context())
    finally:
        hook.remove()
    assert stopped.token_ids == [eos] and stopped.text == "" and stopped.logprobs[0] == pytest.approx(0, abs=1e-3)


def _topics(topic_name: str) -> Topics:
    return Topics(events=topic_name, control=f"{topic_name}.ctl", dead_letters=f"{topic_name}.dl", partitions=3)


@pytest.mark.slow
@pytest.mark.integration
def test_hf_rollout_end_to_end_on_broker(kafka_broker, topic_name, policy, tmp_path):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=10_000)
    topics = _topics(topic_name)
    ensure_topics(conn, topics)
    with EventProducer(conn, topics.events, spool_dir=tmp_path) as producer:
        worker = RolloutWorker(policy, emit=producer.emit, scheduler=make_scheduler(["math", "docqa", "code"], seed=1),
                               config=RolloutConfig(episodes=8, concurrency=4, max_steps=2, producer_id="hf-test"))
        counts = worker.run()
        stats = producer.flush()
    assert stats.spooled == 0 and counts.episodes == 8 and counts.aborted == 0
    events = read_events(conn, topics.events)
    assert len(events) == counts.events
    episodes = assert_complete_episodes(events)
    assert len(episodes) == 8
    steps = [e for e in events if isinstance(e, Step)]
    assert len(steps) == 16  # random weights never finish a task early: max_steps each
    for s in steps:
        assert 0 < len(s.action_token_ids) == len(s.behaviour_logprobs) <= SAMPLING.max_tokens
        assert np.isfinite(s.behaviour_logprobs).all() and (s.behaviour_logprobs <= 0).all()
        assert s.prompt_tokens > 0 and s.policy_version == 0


class _Publisher:
    """Publishes version 1 once, after the first finished episode, and waits until the follower saw it."""

    def __init__(self, producer: EventProducer, follower: PolicyFollower, location: Path) -> None:
        self.producer, self.follower, self.location = producer, follower, location
        self.published_after: int | None = None

    def __call__(self, result, counts) -> None:
        if self.published_after is not None:
            return
        self.producer.emit(make_policy_published(version=1, location=str(self.location), producer_id="trainer",
                                                 parent_version=0))
        self.producer.flush()
        deadline = time.monotonic() + 20
        while self.follower.latest is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.follower.latest is not None, "the follower never saw policy_published"
        self.published_after = counts.episodes


@pytest.mark.slow
@pytest.mark.integration
def test_policy_reload_between_episodes(kafka_broker, topic_name, tiny, tmp_path):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=10_000)
    topics = _topics(topic_name)
    ensure_topics(conn, topics)
    v1 = init_tiny_model(tmp_path / "policy-v1", seed=1)  # "trained" weights: same tokenizer, new weights
    base = HFPolicy.from_pretrained(tiny, sampling=SAMPLING)
    with EventProducer(conn, topics.events, spool_dir=tmp_path / "ev") as producer, \
            EventProducer(conn, topics.control, spool_dir=tmp_path / "ctl") as control, \
            PolicyFollower(conn, topics.control) as follower:
        publisher = _Publisher(control, follower, v1)
        worker = RolloutWorker(base, emit=producer.emit, scheduler=make_scheduler(["math"], seed=3),
                               follower=follower, on_episode=publisher,
                               config=RolloutConfig(episodes=6, concurrency=2, max_steps=2, producer_id="reload"))
        counts = worker.run()
        producer.flush()
    assert counts.reloads == 1 and worker.policy.policy_version == 1 and worker.policy.location == str(v1)
    events = read_events(conn, topics.events)
    episodes = assert_complete_episodes(events)
    version_of = {}
    for episode_id, evs in episodes.items():
        versions = {e.policy_version for e in evs}
        assert len(versions) == 1, f"{episode_id} mixes policy versions {versions}"  # switch only between episodes
        version_of[episode_id] = versions.pop()
    order = sorted(version_of)  # episode ids end in their start index
    seen = [version_of[e] for e in order]
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 1, seen
    assert counts.policy_versions == {0: seen.count(0), 1: seen.count(1)}
    # The new version's actions really come from the new weights.
    new_model = HFPolicy.from_pretrained(v1, sampling=SAMPLING)
    first_v1 = next(e for e in order if version_of[e] == 1)
    started, step0 = episodes[first_v1][0], next(e for e in episodes[first_v1] if isinstance(e, Step))
    prompt = new_model.prompt_ids(PolicyContext(task=generate_tasks("math", 1, seed=3)[0],
                                                messages=[Message("user", started.prompt)], step_index=0))
    np.testing.assert_allclose(step0.behaviour_logprobs, score_tokens(new_model.model, prompt,
                                                                      step0.action_token_ids.tolist(),
                                                                      started.sampling), atol=1e-4)


class _FedIds:
    """Records the input ids the model's first forward of each ``generate`` call receives (the prompt it was fed)."""

    def __init__(self, policy: HFPolicy) -> None:
        self.calls: list[list[int]] = []
        self._armed = False
        self._inner = policy
        self.policy_version, self.sampling = policy.policy_version, policy.sampling
        self.chat, self.max_prompt_tokens = policy.chat, policy.max_prompt_tokens
        self._hook = policy.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if self._armed:
            self.calls.append(kwargs["input_ids"][0].tolist())
            self._armed = False

    def act(self, context):
        self._armed = True
        return self._inner.act(context)

    def close(self) -> None:
        self._hook.remove()


@pytest.mark.parametrize("domain", ["math", "docqa"])
def test_recorded_steps_rebuild_exactly_what_the_model_was_fed(tiny, domain):
    from rollout.context import model_input_of
    from rollout.envs import make_env
    from rollout.episode import run_episode

    # docqa prompts are longer than the context budget here: every step's input is cut, and the cut is recorded.
    policy = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=11),
                                      max_model_len=512)
    fed = _FedIds(policy)
    events: list = []
    env = make_env(domain)
    try:
        task = generate_tasks(domain, 1, seed=4)[0]
        run_episode(env, fed, task, episode_id=f"tf-{domain}", producer_id="t", max_steps=4, emit=events.append)
    finally:
        env.close()
        fed.close()
    steps = [e for e in events if isinstance(e, Step)]
    assert len(steps) == 4 == len(fed.calls)
    obs = [s.observation_token_ids.tolist() for s in steps]
    act = [s.action_token_ids.tolist() for s in steps]
    for k, s in enumerate(steps):
        rebuilt = model_input_of(obs, act, step=k, cut_start=s.context_cut_start, cut_tokens=s.context_cut_tokens)
        assert rebuilt == fed.calls[k], f"step {k}: recorded ids differ from the model's input"
        assert s.prompt_tokens == len(fed.calls[k]) <= 512 - 24
    assert steps[0].observation_token_ids[0] == policy.tokenizer.bos_token_id
    if domain == "docqa":
        assert all(s.context_cut_tokens > 0 for s in steps)
    else:
        assert all(s.context_cut_tokens == 0 for s in steps)
        # Uncut: the step's input is literally the concatenated stream up to its observation.
        assert fed.calls[-1] == [t for k in range(3) for t in obs[k] + act[k]] + obs[3]


def test_group_members_share_a_group_and_draw_different_samples(tiny):
    policy = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=3))
    events: list = []
    worker = RolloutWorker(policy, emit=events.append, scheduler=make_scheduler(["math"], seed=5),
                           config=RolloutConfig(episodes=8, concurrency=4, max_steps=1, group_size=4, run_id="g"))
    counts = worker.run()
    assert counts.episodes == 8 and counts.groups == 2 and worker.counts.summary()["groups"] == 2
    episodes = assert_complete_episodes(events)
    groups: dict[str, list] = {}
    for evs in episodes.values():
        started = evs[0]
        groups.setdefault(started.task_group, []).append(evs)
    assert len(groups) == 2
    for group_id, members in groups.items():
        starts = [m[0] for m in members]
        assert {s.task_id for s in starts} == {starts[0].task_id} and group_id.startswith(starts[0].task_id + "@v0#g.")
        assert sorted(s.group_member for s in starts) == [0, 1, 2, 3] and {s.group_size for s in starts} == {4}
        actions = {tuple(next(e for e in m if isinstance(e, Step)).action_token_ids.tolist()) for m in members}
        assert len(actions) == 4, "group members sampled identical actions from one prompt"
