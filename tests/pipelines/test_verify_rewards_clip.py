"""VerifySteps, ComputeProcessRewards and ClipTrajectories."""

import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import apache_beam as beam
import msgspec
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipelines.clip import ClipTrajectories, clip_episode, plan_clip
from pipelines.recipes import Recipe
from pipelines.rewards import ComputeProcessRewards, annotate_rewards, step_passed, verification_score
from pipelines.sinks import episode_rows
from pipelines.types import Episode
from pipelines.verify import VerifiersUnavailable, VerifySteps, _VerifyFn, check_token_consistency, step_disagreements
from schemas.datasets import Verification
from schemas.events import EpisodeFinished, EpisodeStarted, EpisodeStatus, Step, as_logprobs, make_event_id
from tests.pipelines.helpers import make_pipeline

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_episode(eid: str, *, outcome: float, n_steps: int, tokens: int = 4, logprob: float = -0.5,
                 status: EpisodeStatus = EpisodeStatus.SUCCESS, termination: str = "", verdicts=None,
                 **started) -> Episode:
    """A complete math episode; ``started`` overrides ``EpisodeStarted`` fields (group_size, sampling, ...)."""
    env = lambda seq: dict(event_id=make_event_id(eid, seq), episode_id=eid, seq=seq, producer_id="t",  # noqa: E731
                           domain="math", task_id="t1", event_time=T0)
    steps = [Step(**env(1 + k), step_index=k, tool_name="state", action_token_ids=np.arange(tokens),
                  behaviour_logprobs=np.full(tokens, logprob)) for k in range(n_steps)]
    started = {"task_group": "g", **started}
    if verdicts is None:
        verdicts = [Verification(verifier="math.check", passed=True, score=1.0)]
    return Episode(
        episode_id=eid, domain="math", task_id="t1", task_group=started["task_group"], policy_version=0,
        started=EpisodeStarted(**env(0), task_spec='{"steps": [], "answer": 1.0}', **started),
        finished=EpisodeFinished(**env(n_steps + 1), status=status, outcome_reward=outcome,
                                 num_steps=n_steps, termination=termination),
        steps=steps, verdicts=[list(verdicts) for _ in steps],
        feedback=[], num_events=n_steps + 2, first_event_time=T0, last_event_time=T0, complete=True,
    )


def test_verify_keeps_rollout_verdicts_and_adds_pipeline_checks():
    good = make_episode("a", outcome=1.0, n_steps=1)
    bad = make_episode("b", outcome=1.0, n_steps=1, logprob=0.3)  # positive logprobs
    with make_pipeline() as p:
        out = p | beam.Create([good, bad]) | VerifySteps(use_domain_verifiers=False)
        assert_that(out | beam.Map(lambda e: (e.episode_id, [(v.verifier, v.passed, v.source, v.counted)
                                                             for v in e.verdicts[0]])),
                    equal_to([("a", [("math.check", True, "rollout", True),
                                     ("pipeline.token_consistency", True, "pipeline", False)]),
                              ("b", [("math.check", True, "rollout", True),
                                     ("pipeline.token_consistency", False, "pipeline", False)])]))


def test_verify_judges_every_step_of_an_episode_as_the_per_step_check_does():
    # The DoFn checks the float32 logprobs of all steps at once (their bits read as int32, one maximum per
    # step); each edge value below must come out as check_token_consistency says, step by step.
    values = [[-0.5, -1e-45], [-0.0, -3.4e38], [0.0, -1.0], [1e-45, -1.0], [-np.inf, -1.0], [np.nan, -1.0],
              [np.inf, -1.0], [-0.25, -0.75]]
    ep = make_episode("a", outcome=1.0, n_steps=len(values), tokens=2)
    steps = [msgspec.structs.replace(s, behaviour_logprobs=as_logprobs(v)) for s, v in zip(ep.steps, values)]
    steps.append(msgspec.structs.replace(steps[0], behaviour_logprobs=np.array([-0.5, -0.5])))  # float64
    steps.append(msgspec.structs.replace(steps[0], behaviour_logprobs=as_logprobs([-0.5, 1.0, -0.5, 1.0])[::2]))
    ep = msgspec.structs.replace(ep, steps=steps, verdicts=[[] for _ in steps])
    got = [vs[0] for vs in next(_VerifyFn(use_domain_verifiers=False).process(ep)).verdicts]
    assert got == [check_token_consistency(s) for s in steps]
    assert [v.passed for v in got] == [True, True, True, False, False, False, False, True, True, True]


def _verified(episode: Episode) -> Episode:
    fn = _VerifyFn(use_domain_verifiers=True)
    fn.setup()
    return next(fn.process(episode))


def test_a_rerun_of_a_rollout_verifier_records_agreement_instead_of_a_second_vote():
    # The rollout judged format.valid (True) and math.intermediate_correct (True); the pipeline's re-run finds
    # format.valid True (agrees) and math.intermediate_correct False ("unknown intermediate ''": disagrees).
    rollout = [Verification(verifier="math.check", passed=True, score=1.0),
               Verification(verifier="format.valid", passed=True, score=1.0),
               Verification(verifier="math.intermediate_correct", passed=True, score=1.0)]
    ep = _verified(make_episode("a", outcome=1.0, n_steps=2, verdicts=rollout))
    got = [(v.verifier, v.source, v.counted, v.details.split(" ")[0]) for v in ep.verdicts[0][3:]]
    assert got == [("pipeline.token_consistency", "pipeline", False, "ok"),
                   ("format.valid", "pipeline", False, "agrees"),
                   ("math.intermediate_correct", "pipeline", False, "disagrees")]
    # counted: the three rollout verdicts, all 1.0 -> s_t = 1; one disagreement per step, two in the episode
    assert [verification_score(vs, {}) for vs in ep.verdicts] == [1.0, 1.0]
    assert [step_disagreements(vs) for vs in ep.verdicts] == [1, 1]
    traj, steps = episode_rows(annotate_rewards(ep, Recipe(name="o")), Recipe(name="o"))
    assert traj.verifier_disagreements == 2 and [s.verifier_disagreements for s in steps] == [1, 1]
    assert traj.steps_passed == 2 and [s.verification_score for s in steps] == [1.0, 1.0]


def test_disagreements_are_counted_in_the_pipeline_metrics():
    from apache_beam.metrics.metric import MetricsFilter

    rollout = [Verification(verifier="format.valid", passed=True, score=1.0),
               Verification(verifier="math.intermediate_correct", passed=True, score=1.0)]
    p = make_pipeline()
    _ = p | beam.Create([make_episode("a", outcome=1.0, n_steps=3, verdicts=rollout)]) | VerifySteps()
    result = p.run()
    result.wait_until_finish()
    got = {c.key.metric.name: c.committed for c in result.metrics().query(
        MetricsFilter().with_namespace("pipeline"))["counters"]}
    # per step: format.valid agrees, math.intermediate_correct disagrees; 3 steps
    assert (got["verifier_disagreements"], got["verifier_agreements"]) == (3, 3)


def test_a_pipeline_verdict_of_a_verifier_the_rollout_did_not_record_counts():
    ep = _verified(make_episode("a", outcome=1.0, n_steps=1))  # the rollout recorded math.check only
    vs = ep.verdicts[0]
    assert [(v.verifier, v.counted) for v in vs] == [
        ("math.check", True), ("pipeline.token_consistency", False), ("format.valid", True),
        ("math.intermediate_correct", True)]
    # counted: math.check 1, format.valid 1, math.intermediate_correct 0 -> s = 2/3; not every vote passed
    assert verification_score(vs, {}) == pytest.approx(2 / 3) and not step_passed(vs)
    # a weight of 0 silences a verifier: (1 + 1) / 2
    assert verification_score(vs, {"math.intermediate_correct": 0.0}) == 1.0
    assert step_disagreements(vs) == 0


def test_missing_rollout_verifiers_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "rollout.verifiers", None)  # `import rollout.verifiers` now fails
    with pytest.raises(VerifiersUnavailable, match="--no-domain-verifiers"):
        VerifySteps()
    with pytest.raises(VerifiersUnavailable, match="use_domain_verifiers=False"):
        _VerifyFn(use_domain_verifiers=True).setup()
    VerifySteps(use_domain_verifiers=False)  # the generic checks need nothing


def test_an_episode_whose_verifiers_cannot_run_is_recorded_as_skipped_not_silently_passed():
    from pipelines.verify import DOMAIN_VERIFIERS_SKIPPED

    fn = _VerifyFn(use_domain_verifiers=True)
    fn.setup()
    good = make_episode("a", outcome=1.0, n_steps=1)
    bad_spec = msgspec.structs.replace(good, started=msgspec.structs.replace(good.started, task_spec="not json"))
    no_start = msgspec.structs.replace(make_episode("b", outcome=1.0, n_steps=2), started=None)
    names = lambda ep: [[v.verifier for v in vs] for vs in next(fn.process(ep)).verdicts]  # noqa: E731
    assert DOMAIN_VERIFIERS_SKIPPED not in names(good)[0] and "format.valid" in names(good)[0]
    assert names(bad_spec) == [["math.check", "pipeline.token_consistency", DOMAIN_VERIFIERS_SKIPPED]]
    skipped = [v for vs in next(fn.process(no_start)).verdicts for v in vs if v.verifier == DOMAIN_VERIFIERS_SKIPPED]
    assert len(skipped) == 2 and all(not v.counted and not v.passed for v in skipped)
    assert skipped[0].details == "domain verifiers not run: no episode_started event"
    # a data-quality record: it never votes, so the rollout's verdict alone scores the step
    assert verification_score(next(fn.process(bad_spec)).verdicts[0], {}) == 1.0


def test_pipeline_run_fails_in_one_line_when_rollout_verifiers_do_not_import(tmp_path):
    # The reported bug: VerifySteps skipped the domain verifiers silently when `rollout.verifiers` could not be
    # imported, and the dataset version stayed the same. Now the job refuses to start, from the console script.
    import subprocess

    from tests.pipelines.helpers import episodes, flat, write_archive

    archive = tmp_path / "archive"
    write_archive(archive, [flat(episodes(2, seed=3))])
    code = ("import sys; sys.modules['rollout.verifiers'] = None  # `import rollout.verifiers` now fails\n"
            "from trajpipe.cli import main; sys.argv = ['trajpipe', *sys.argv[1:]]; main()")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code, "pipeline", "run", "--source", "archive", "--archive", str(archive), "--out",
         str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs `rollout.verifiers`, which does not import" in errors[0] and "--no-domain-verifiers" in errors[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))


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


@pytest.mark.parametrize("termination,status,reason", [
    ("timeout", EpisodeStatus.TIMEOUT, "timeout"), ("error", EpisodeStatus.ERROR, "error"),
    ("aborted", EpisodeStatus.ABORTED, "aborted"), ("", EpisodeStatus.TIMEOUT, "timeout"),  # legacy: from status
])
def test_unjudged_episodes_get_no_credit(termination, status, reason):
    ep = make_episode("a", outcome=0.0, n_steps=3, status=status, termination=termination)
    assert (ep.termination, ep.trainable, ep.excluded_reason) == (reason, False, reason)
    out = annotate_rewards(ep, Recipe(name="d", reward="discounted", gamma=0.5))
    # no verdict, no return: never r_T-1 = w_o * 0 bootstrapped back through gamma
    assert out.rewards.tolist() == out.returns.tolist() == out.advantages.tolist() == [0.0, 0.0, 0.0]
    traj, steps = episode_rows(out, Recipe(name="d"))
    assert (traj.trainable, traj.excluded_reason, traj.termination) == (False, reason, reason)
    assert [s.trainable for s in steps] == [False] * 3


def test_judged_terminations_and_step_less_episodes():
    capped = make_episode("a", outcome=0.0, n_steps=2, status=EpisodeStatus.FAILURE, termination="max_steps")
    assert (capped.trainable, capped.excluded_reason) == (True, None)
    # max_steps is judged: the outcome 0 is a verdict; a penalty makes the return negative
    r = annotate_rewards(capped, Recipe(name="s", reward="verification_shaped", step_penalty=0.25)).rewards
    # s = [1, 1], w_v = 0 -> F = 0; r = -0.25 each
    assert r.tolist() == [-0.25, -0.25]
    empty = make_episode("b", outcome=1.0, n_steps=0)
    assert (empty.trainable, empty.excluded_reason, empty.termination) == (False, "no_steps", "done")
    assert annotate_rewards(empty, Recipe(name="o")).rewards.tolist() == []


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


def test_a_folded_tail_stays_within_the_reward_bounds():
    rec = Recipe(name="pen", reward="verification_shaped", verification_weight=0.0, step_penalty=0.5,
                 reward_min=-1.0)
    ep = annotate_rewards(make_episode("a", outcome=0.0, n_steps=4), rec)
    # r = [-0.5] * 4 (gamma 1); G = [-2, -1.5, -1, -0.5]
    assert ep.rewards.tolist() == [-0.5] * 4 and ep.returns.tolist() == [-2.0, -1.5, -1.0, -0.5]
    out = clip_episode(ep, max_steps=2, max_action_tokens=0, gamma=1.0, reward_min=-1.0)
    # fold: r'_1 = -0.5 + G_2 = -1.5 -> clipped to -1; returns and advantages follow the written rewards:
    # G = [-0.5 + -1, -1] = [-1.5, -1], A = G (lambda 1); G_0 moved from -2 by exactly the cut 0.5
    assert out.rewards.tolist() == [-0.5, -1.0] and out.returns.tolist() == [-1.5, -1.0]
    assert out.advantages.tolist() == [-1.5, -1.0]
    inside = clip_episode(ep, max_steps=3, max_action_tokens=0, gamma=1.0, reward_min=-1.0)
    # fold r'_2 = -0.5 + G_3 = -1.0: inside the bounds, so G_0 = -2 is kept
    assert inside.rewards.tolist() == [-0.5, -0.5, -1.0] and inside.returns.tolist() == [-2.0, -1.5, -1.0]


def test_folded_advantages_follow_the_written_rewards():
    rec = Recipe(name="d", reward="discounted", gamma=0.5, lam=0.5)
    ep = annotate_rewards(make_episode("a", outcome=1.0, n_steps=3), rec)
    out = clip_episode(ep, max_steps=2, max_action_tokens=0, gamma=0.5, lam=0.5)
    # r = [0, 0, 1] -> r' = [0, 0 + 0.5*1] = [0, 0.5]; G' = [0.25, 0.5];
    # A' = GAE(gamma*lambda = 0.25) over r' = [0 + 0.25*0.5, 0.5] = [0.125, 0.5]
    assert out.rewards.tolist() == [0.0, 0.5] and out.returns.tolist() == [0.25, 0.5]
    assert out.advantages.tolist() == [0.125, 0.5]


def test_no_cap_leaves_the_episode_alone():
    ep = annotate_rewards(make_episode("a", outcome=1.0, n_steps=2), Recipe(name="o"))
    assert clip_episode(ep, max_steps=5, max_action_tokens=100, gamma=1.0) is ep
