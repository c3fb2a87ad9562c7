"""Welford/Chan statistics and NormalizeByDomain against hand-computed values."""

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipelines.groups import GroupStats, ReleasedGroup
from pipelines.normalize import NormalizeByDomain, NormState, RunningStats, normalize_episode
from pipelines.recipes import Recipe
from schemas.events import EpisodeStatus
from pipelines.rewards import annotate_rewards
from tests.pipelines.helpers import make_pipeline
from tests.pipelines.test_verify_rewards_clip import make_episode


def test_chan_merge_equals_one_pass():
    x = np.array([0.5, 2.0, -1.0, 4.0, 3.5, 0.0])
    merged = RunningStats.of(x[:2]).merge(RunningStats.of(x[2:5])).merge(RunningStats.of(x[5:]))
    assert merged.n == 6 and merged.mean == pytest.approx(x.mean()) and merged.std == pytest.approx(x.std())
    assert RunningStats().merge(merged) == merged


def test_domain_normalization_by_hand():
    rec = Recipe(name="o", eps=1e-9)
    x = annotate_rewards(make_episode("x", outcome=1.0, n_steps=3), rec)  # A = [1, 1, 1]
    y = annotate_rewards(make_episode("y", outcome=0.0, n_steps=2), rec)  # A = [0, 0]
    # advantages of the domain: [1, 1, 1, 0, 0]: mean 0.6, var (3*0.16 + 2*0.36)/5 = 0.24, std 0.489898
    stats = {"advantage/math": RunningStats.of([1, 1, 1, 0, 0]), "return/math": RunningStats.of([1.0, 0.0])}
    group = ReleasedGroup(stats=GroupStats(size=2, members=(0, 1), episodes=2, returns=RunningStats.of([1.0, 0.0])))
    nx = normalize_episode(x, stats, group, mode="domain", eps=rec.eps)
    np.testing.assert_allclose(nx.normalized_advantages, [0.4 / 0.489898] * 3, rtol=1e-5)  # 0.816497
    # group returns [1, 0]: mean 0.5, std 0.5 -> (1 - 0.5) / 0.5 = 1
    assert nx.group_advantage == pytest.approx(1.0) and nx.normalized_return == pytest.approx(1.0)
    assert nx.group_members == 2
    ny = normalize_episode(y, stats, group, mode="group", eps=rec.eps)
    np.testing.assert_allclose(ny.normalized_advantages, [-1.0, -1.0])
    # Dr. GRPO: G_0 - mean = 0 - 0.5, no division by the std
    ny = normalize_episode(y, stats, group, mode="group_mean", eps=rec.eps)
    np.testing.assert_allclose(ny.normalized_advantages, [-0.5, -0.5])
    assert ny.group_advantage == -0.5


def test_untrainable_episodes_normalize_to_zero():
    rec = Recipe(name="o", eps=1e-9)
    z = annotate_rewards(make_episode("z", outcome=0.0, n_steps=2, status=EpisodeStatus.TIMEOUT), rec)
    stats = {"advantage/math": RunningStats.of([1.0, 0.0]), "return/math": RunningStats.of([1.0, 0.0])}
    group = ReleasedGroup(stats=GroupStats(size=2, members=(0, 1), episodes=2, returns=RunningStats.of([1.0])))
    for mode in ("domain", "group", "group_mean", "none"):
        out = normalize_episode(z, stats, group, mode=mode, eps=rec.eps)
        # with the domain mean 0.5 the step would get (0 - 0.5) / 0.5 = -1: a timeout is no verdict, so 0
        assert out.normalized_advantages.tolist() == [0.0, 0.0] and out.group_advantage == 0.0
        assert out.normalized_return == 0.0 and out.group_members == 1


def test_transform_merges_prior_statistics():
    rec = Recipe(name="o", eps=1e-9)
    eps = [annotate_rewards(make_episode("x", outcome=1.0, n_steps=2), rec),  # this run: A = [1, 1]
           annotate_rewards(make_episode("t", outcome=0.0, n_steps=2, status=EpisodeStatus.TIMEOUT), rec)]
    prior = NormState(recipe_hash="h", stats={"advantage/math": RunningStats.of([0.0, 0.0])})
    # prior [0, 0] + run [1, 1] (the timeout enters no statistics): mean 0.5, std 0.5 -> (1 - 0.5) / 0.5 = 1
    with make_pipeline() as p:
        out = p | beam.Create(eps) | NormalizeByDomain(rec, prior=prior.stats)
        assert_that(out["episodes"] | beam.Map(lambda e: (e.episode_id, [round(v, 6) for v in e.normalized_advantages],
                                                          e.group_members)),
                    equal_to([("x", [1.0, 1.0], 1), ("t", [0.0, 0.0], 1)]), label="norm")
        # no `group` family: group statistics are per group and never persisted
        assert_that(out["stats"] | beam.Map(lambda kv: (kv[0], kv[1].n, kv[1].mean)),
                    equal_to([("advantage/math", 2, 1.0), ("return/math", 1, 1.0)]), label="stats")


def test_normalize_tables_matches_normalize_episode():
    from pipelines.normalize import normalize_tables
    from pipelines.sinks import episode_rows, rows_to_table
    from schemas.datasets import step_file_schema, trajectory_file_schema

    rec = Recipe(name="o", eps=1e-6)
    x = annotate_rewards(make_episode("x", outcome=1.0, n_steps=3), rec)
    y = annotate_rewards(make_episode("y", outcome=0.0, n_steps=2), rec)
    z = annotate_rewards(make_episode("z", outcome=0.0, n_steps=2, status=EpisodeStatus.ERROR), rec)
    stats = {"advantage/math": RunningStats.of([1, 1, 1, 0, 0]), "return/math": RunningStats.of([1.0, 0.0])}
    group = ReleasedGroup(stats=GroupStats(size=3, members=(0, 1), episodes=3, returns=RunningStats.of([1.0, 0.0])),
                          timed_out=True)
    groups = {("math", "g", 0): group}
    for mode in ("domain", "group", "group_mean", "none"):
        want = [episode_rows(normalize_episode(e, stats, group, mode=mode, eps=rec.eps), rec) for e in (x, y, z)]
        rows = [episode_rows(e, rec) for e in (x, y, z)]
        trajs = rows_to_table([t for t, _ in rows], trajectory_file_schema())
        steps = rows_to_table([s for _, ss in rows for s in ss], step_file_schema())
        got_t, got_s = normalize_tables(trajs, steps, stats, groups, mode=mode, eps=rec.eps, domain="math")
        assert got_t.to_pylist() == rows_to_table([t for t, _ in want], trajectory_file_schema()).to_pylist()
        assert got_s.to_pylist() == rows_to_table([s for _, ss in want for s in ss], step_file_schema()).to_pylist()
        assert got_s["normalized_advantage"].to_pylist() != steps["normalized_advantage"].to_pylist()
        assert got_t["group_members"].to_pylist() == [2, 2, 2] and got_t["group_timed_out"].to_pylist() == [True] * 3
