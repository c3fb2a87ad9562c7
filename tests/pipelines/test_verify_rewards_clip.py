"""VerifySteps, ComputeProcessRewards and ClipTrajectories."""

from datetime import datetime, timezone

import apache_beam as beam
import numpy as np
from apache_beam.testing.util import assert_that, equal_to

from pipelines.clip import ClipTrajectories, clip_episode, plan_clip
from pipelines.recipes import Recipe
from pipelines.rewards import ComputeProcessRewards, annotate_rewards
from pipelines.types import Episode
from pipelines.verify import VerifySteps
from schemas.datasets import Verification
from schemas.events import EpisodeFinished, EpisodeStarted, EpisodeStatus, Step, make_event_id
from tests.pipelines.helpers import make_pipeline

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_episode(eid: str, *, outcome: float, n_steps: int, tokens: int = 4, logprob: float = -0.5) -> Episode:
    env = lambda seq: dict(event_id=make_event_id(eid, seq), episode_id=eid, seq=seq, producer_id="t",  # noqa: E731
                           domain="math", task_id="t1", event_time=T0)
    steps = [Step(**env(1 + k), step_index=k, tool_name="state", action_token_ids=np.arange(tokens),
                  behaviour_logprobs=np.full(tokens, logprob)) for k in range(n_steps)]
    return Episode(
        episode_id=eid, domain="math", task_id="t1", task_group="g", policy_version=0,
        started=EpisodeStarted(**env(0), task_spec='{"steps": [], "answer": 1.0}', task_group="g"),
        finished=EpisodeFinished(**env(n_steps + 1), status=EpisodeStatus.SUCCESS, outcome_reward=outcome,
                                 num_steps=n_steps),
        steps=steps, verdicts=[[Verification(verifier="math.check", passed=True, score=1.0)] for _ in steps],
        feedback=[], num_events=n_steps + 2, first_event_time=T0, last_event_time=T0, complete=True,
    )


def test_verify_keeps_rollout_verdicts_and_adds_pipeline_checks():
    good = make_episode("a", outcome=1.0, n_steps=1)
    bad = make_episode("b", outcome=1.0, n_steps=1, logprob=0.3)  # positive logprobs
    with make_pipeline() as p:
        out = p | beam.Create([good, bad]) | VerifySteps(use_domain_verifiers=False)
        assert_that(out | beam.Map(lambda e: (e.episode_id, [(v.verifier, v.passed, v.source) for v in e.verdicts[0]])),
                    equal_to([("a", [("math.check", True, "rollout"), ("pipeline.token_consistency", True, "pipeline")]),
                              ("b", [("math.check", True, "rollout"), ("pipeline.token_consistency", False, "pipeline")])]))


def test_verify_runs_domain_verifiers_when_registered():
    ep = make_episode("a", outcome=1.0, n_steps=1)
    with make_pipeline() as p:
        out = p | beam.Create([ep]) | VerifySteps()
        assert_that(out | beam.Map(lambda e: "format.valid" in [v.verifier for v in e.verdicts[0]]), equal_to([True]))


def test_rewards_transform():
    rec = Recipe(name="d", reward="discounted", gamma=0.5)
    with make_pipeline() as p:
        out = p | beam.Create([make_episode("a", outcome=1.0, n_steps=3)]) | ComputeProcessRewards(rec)
        # r = [0, 0, 1]; G = [0.25, 0.5, 1]; A (lambda 1) = G
        assert_that(out | beam.Map(lambda e: (e.rewards.tolist(), e.returns.tolist(), e.advantages.tolist())),
                    equal_to([([0.0, 0.0, 1.0], [0.25, 0.5, 1.0], [0.25, 0.5, 1.0])]))


def test_step_cap_folds_the_tail_into_the_last_kept_step():
    ep = annotate_rewards(make_episode("a", outcome=1.0, n_steps=3), Recipe(name="d", gamma=0.5))
    out = clip_episode(ep, max_steps=2, max_action_tokens=0, gamma=0.5)
    # full: r = [0, 0, 1], G = [0.25, 0.5, 1]; keep 2: r'_1 = r_1 + 0.5 * G_2 = 0.5 = G_1 (credit kept)
    assert out.rewards.tolist() == [0.0, 0.5] and out.returns.tolist() == [0.25, 0.5]
    assert (out.clipped, out.steps_dropped, len(out.steps)) == (True, 1, 2)
    assert out.episode_return == ep.episode_return


def test_token_cap_masks_the_overflow():
    ep = annotate_rewards(make_episode("a", outcome=1.0, n_steps=3, tokens=4), Recipe(name="o"))
    # 4 + 4 + 4 tokens, cap 6: step 1 starts at 4 < 6 -> kept, its tokens 2..3 masked; step 2 dropped
    assert plan_clip(np.array([4, 4, 4]), max_steps=0, max_action_tokens=6) == (2, 2)
    out = clip_episode(ep, max_steps=0, max_action_tokens=6, gamma=1.0)
    assert [m.tolist() for m in out.loss_masks] == [[True] * 4, [True, True, False, False]]
    assert (out.tokens_masked, out.steps_dropped, out.rewards.tolist()) == (2, 1, [0.0, 1.0])
    with make_pipeline() as p:
        res = p | beam.Create([ep]) | ClipTrajectories(max_action_tokens=6)
        assert_that(res | beam.Map(lambda e: (len(e.steps), e.tokens_masked)), equal_to([(2, 2)]))


def test_no_cap_leaves_the_episode_alone():
    ep = annotate_rewards(make_episode("a", outcome=1.0, n_steps=2), Recipe(name="o"))
    assert clip_episode(ep, max_steps=5, max_action_tokens=100, gamma=1.0) is ep
