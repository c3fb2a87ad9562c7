"""GRPO groups: the decision rule by hand, and whole-group advantages through the job (micro-batches, timeout,
crash, dedupe, solo/legacy groups, unjudged members, the streaming writer)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from apache_beam.transforms.window import IntervalWindow
from apache_beam.utils.windowed_value import PaneInfo, PaneInfoTiming

from pipelines.commit import CommitError, DatasetLayout, load_held_state, read_manifests
from pipelines.groups import GroupStats, decide_groups, domain_stats
from pipelines.normalize import RunningStats
from pipelines.recipes import Recipe
from pipelines import testhooks
from pipelines.testhooks import run_batch_on_records
from pipelines.types import RawRecords
from schemas.codec import encode_event
from tests.pipelines.helpers import edit, episodes, finished_as

GRPO = Recipe(name="grpo", normalization="group", eps=1e-9)
KEY = ("math", "t@v1#0", 1)


def _reconciles(c: dict) -> bool:
    return (c["events_in"] + c["events_pending_in"]
            == c["events_used"] + c["events_incomplete"] + c["events_pending_out"] + c["dead_letters"] + c["duplicates"])


def _batch(eps: list[list]) -> RawRecords:
    evs = [e for ep in eps for e in ep]
    return RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(evs))),
                      keys=[e.episode_id.encode() for e in evs], values=[encode_event(e) for e in evs],
                      timestamps_ms=[0] * len(evs))


def _run(out: Path, eps: list[list], recipe: Recipe = GRPO, **kw) -> dict:
    c = run_batch_on_records([_batch(eps)], out=out, recipe=recipe, use_domain_verifiers=False, **kw)
    assert _reconciles(c), c
    return c


def _trajs(out: Path) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/trajectories/**/*.parquet", hive_partitioning=True).sort("episode_id")


def _ending_at(ep: list, t) -> list:
    """The episode moved in event time so that its last event is at ``t``."""
    shift = t - max(e.event_time for e in ep)
    return [edit([e], envelope={"event_time": e.event_time + shift})[0] for e in ep]


# --------------------------------------------------------------------------- the rule, by hand


def _stats(size: int, members: tuple[int, ...], returns: list[float]) -> GroupStats:
    return GroupStats(size=size, members=members, episodes=len(members), returns=RunningStats.of(returns),
                      advantages=RunningStats.of(returns))


def test_whole_groups_are_released_and_partial_ones_held_until_the_timeout():
    run = {KEY: _stats(4, (0, 1), [1.0, 0.0]), ("math", "solo", 1): _stats(1, (0,), [1.0]),
           ("math", "legacy", 0): _stats(0, (0, 0, 0), [1.0, 0.0, 0.5])}
    released, held = decide_groups(run, {}, clock_s=1000.0, timeout_s=600.0)
    # size 1 and undeclared (0) groups go at once, over the members present; 2 of 4 wait, since the clock now
    assert sorted(released) == [("math", "legacy", 0), ("math", "solo", 1)] and held[KEY].since_s == 1000.0
    # next run: member 3 arrives (not 2): 3 of 4, 599 s later -> still held, since unchanged
    released, held = decide_groups({KEY: _stats(4, (3,), [1.0])}, held, clock_s=1599.0, timeout_s=600.0)
    assert not released and held[KEY].since_s == 1000.0 and held[KEY].stats.members == (0, 1, 3)
    # 600 s after it was first held: closed with the 3 members it has
    released, held = decide_groups({}, held, clock_s=1600.0, timeout_s=600.0)
    g = released[KEY]
    # returns [1, 0] + [1]: mean 2/3, population std sqrt(((1/3)^2 * 2 + (2/3)^2) / 3) = sqrt(2/9) = 0.471405
    assert (g.timed_out, g.stats.members, g.stats.returns.n) == (True, (0, 1, 3), 3) and not held
    assert g.stats.returns.mean == pytest.approx(2 / 3) and g.stats.returns.std == pytest.approx(0.471405, abs=1e-6)


def test_members_are_counted_by_distinct_index_and_domain_stats_by_released_group():
    run = {KEY: _stats(2, (0,), [1.0]).merge(_stats(2, (0,), [0.0]))}  # the same member twice is one member
    released, held = decide_groups(run, {}, clock_s=0.0, timeout_s=600.0)
    assert not released and held[KEY].stats.episodes == 2
    other = ("math", "u@v1#0", 1)
    released, _ = decide_groups({KEY: _stats(2, (1,), [1.0]), other: _stats(1, (0,), [3.0])}, held,
                                clock_s=1.0, timeout_s=600.0)
    # domain statistics: the released groups' trainable returns [1, 0, 1] and [3]: n 4, mean 5/4
    st = domain_stats(released)
    assert st["return/math"].n == 4 and st["return/math"].mean == 1.25


# --------------------------------------------------------------------------- through the job


@pytest.fixture(scope="module")
def groups4() -> list[list]:
    """12 synthetic episodes: 3 tasks × a declared group of 4 (synth declares groups as the scheduler does)."""
    return episodes(12, seed=31)


def test_whole_group_advantages_have_mean_zero(groups4, tmp_path):
    c = _run(tmp_path / "out", groups4)
    assert (c["groups_released"], c["groups_held"], c["episodes_held"]) == (3, 0, 0)
    t = _trajs(tmp_path / "out")
    assert t.height == 12 and t["group_members"].to_list() == [4] * 12 and not t["group_timed_out"].any()
    for _, g in t.group_by("task_group"):
        G = g["episode_return"].to_numpy()
        # GRPO over the group of 4: (G - mean) / (std + eps), mean 0 by construction
        np.testing.assert_allclose(g["group_advantage"].to_numpy(), (G - G.mean()) / (G.std() + GRPO.eps))
        assert abs(g["group_advantage"].sum()) < 1e-9


def test_a_group_split_over_two_micro_batches_gets_the_advantages_of_one_run(groups4, tmp_path):
    whole = _run(tmp_path / "whole", groups4)
    first = [ep for i, ep in enumerate(groups4) if i % 4 < 2]  # members 0, 1 of every group
    second = [ep for i, ep in enumerate(groups4) if i % 4 >= 2]
    c1 = _run(tmp_path / "split", first)
    assert (c1["episodes"], c1["groups_released"], c1["groups_held"], c1["episodes_held"], c1["steps"]) == (
        6, 0, 3, 6, 0)
    assert not list((tmp_path / "split").glob("trajectories/**/*.parquet"))  # nothing written yet
    c2 = _run(tmp_path / "split", second)
    assert (c2["episodes"], c2["groups_released"], c2["groups_held"], c2["steps"]) == (6, 3, 0, whole["steps"])
    one, two = _trajs(tmp_path / "whole"), _trajs(tmp_path / "split")
    assert one["episode_id"].to_list() == two["episode_id"].to_list()
    for col in ("group_advantage", "normalized_return", "episode_return"):
        np.testing.assert_allclose(two[col].to_numpy(), one[col].to_numpy(), atol=1e-12, err_msg=col)
    steps = [pl.read_parquet(f"{tmp_path / d}/steps/**/*.parquet").sort("episode_id", "step_index")
             for d in ("whole", "split")]
    np.testing.assert_allclose(steps[1]["normalized_advantage"].to_numpy(), steps[0]["normalized_advantage"].to_numpy(),
                               atol=1e-12)
    # the held state is gone once released
    layout = DatasetLayout(out=str(tmp_path / "split"), version=GRPO.version, recipe_hash=GRPO.content_hash)
    assert load_held_state(layout, read_manifests(layout)).groups.held == []
    assert sorted(p.name for p in (tmp_path / "split" / "_state" / GRPO.version).iterdir()
                  if p.name.startswith(("groups-", "held-"))) == ["groups-00000002.json"]


def test_domain_normalization_counts_an_episode_when_its_group_is_released(groups4, tmp_path):
    recipe = Recipe(name="dom", normalization="domain", eps=1e-9)
    _run(tmp_path / "whole", groups4, recipe)
    _run(tmp_path / "split", [ep for i, ep in enumerate(groups4) if i % 4 < 2], recipe)
    _run(tmp_path / "split", [ep for i, ep in enumerate(groups4) if i % 4 >= 2], recipe)
    a, b = (pl.read_parquet(f"{tmp_path / d}/steps/**/*.parquet").sort("episode_id", "step_index")
            for d in ("whole", "split"))
    # held rows entered no statistics in run 1, so run 2 normalizes everything with the numbers of one run
    np.testing.assert_allclose(b["normalized_advantage"].to_numpy(), a["normalized_advantage"].to_numpy(), atol=1e-12)


def test_a_group_whose_last_member_never_comes_is_released_after_the_timeout(groups4, tmp_path):
    out = tmp_path / "out"
    run1 = groups4[:3] + groups4[4:8]  # member 3 of the first group never arrives
    clock1 = max(e.event_time for ep in run1 for e in ep)
    c1 = _run(out, run1)
    assert (c1["groups_released"], c1["groups_held"], c1["episodes_held"]) == (1, 1, 3)
    c2 = _run(out, [_ending_at(groups4[8], clock1 + timedelta(seconds=599.5))])  # the clock: 599.5 s later
    assert (c2["groups_held"], c2["groups_timed_out"]) == (2, 0)  # the new group waits for its members too
    # 1300 s after the first group was held, 700.5 s after the second: both close as they are
    c3 = _run(out, [_ending_at(groups4[9], clock1 + timedelta(seconds=1300))])
    assert (c3["groups_released"], c3["groups_timed_out"], c3["groups_held"]) == (2, 2, 0)
    t = _trajs(out)
    first = t.filter(pl.col("task_group") == groups4[0][0].task_group)
    assert first.height == 3 and first["group_timed_out"].all() and first["group_members"].to_list() == [3] * 3
    assert first["group_size"].to_list() == [4] * 3
    G = first["episode_return"].to_numpy()
    np.testing.assert_allclose(first["group_advantage"].to_numpy(), (G - G.mean()) / (G.std() + GRPO.eps))


def test_events_of_a_held_episode_seen_again_are_duplicates(groups4, tmp_path):
    out = tmp_path / "out"
    _run(out, groups4[:2])
    again = _run(out, [groups4[0], groups4[2], groups4[3]])  # a re-delivery of member 0 with the rest
    assert again["duplicates"] == len(groups4[0]) and again["episodes"] == 2 and again["groups_released"] == 1
    assert _trajs(out).height == 4


@pytest.mark.parametrize("crash_at", ["before_manifest", "after_manifest"])
def test_held_groups_survive_a_crash_between_runs(groups4, tmp_path, crash_at):
    first, second = groups4[:2] + groups4[4:6], groups4[2:4] + groups4[6:8]
    clean = tmp_path / "clean"
    _run(clean, first)
    _run(clean, second)
    out = tmp_path / "crashed"
    _run(out, first)
    with testhooks.crash_at(crash_at), pytest.raises(CommitError, match="simulated crash"):
        run_batch_on_records([_batch(second)], out=out, recipe=GRPO, use_domain_verifiers=False)
    if crash_at == "before_manifest":
        _run(out, second)  # rolled back: the held state of commit 1 is intact and used again
    else:
        assert run_batch_on_records([_batch(second)], out=out, recipe=GRPO,
                                    use_domain_verifiers=False)["duplicates"] == sum(map(len, second))  # rolled forward
    for table in ("steps", "trajectories"):
        got = {str(p.relative_to(out)): pq.read_table(p) for p in sorted(out.glob(f"{table}/**/*.parquet"))}
        want = {str(p.relative_to(clean)): pq.read_table(p) for p in sorted(clean.glob(f"{table}/**/*.parquet"))}
        assert got.keys() == want.keys() and all(got[k].equals(want[k]) for k in got), table
    assert not list(out.rglob("*.tmp"))


def test_solo_and_legacy_groups_are_released_at_once(groups4, tmp_path):
    solo = [edit(ep, started={"group_size": 1, "group_member": 0, "task_group": f"{ep[0].task_id}@v0#solo{k}"})
            for k, ep in enumerate(groups4[:2])]
    legacy = [edit(ep, started={"group_size": 0, "group_member": 0, "task_group": ""}) for ep in groups4[4:7]]
    c = _run(tmp_path / "out", solo + legacy)
    assert (c["groups_released"], c["groups_held"], c["episodes_held"]) == (3, 0, 0)
    t = _trajs(tmp_path / "out")
    assert t.height == 5
    legacy_rows = t.filter(pl.col("group_size") == 0)
    # undeclared: task_group falls back to the task id; one group per (task, policy version) in the run
    assert set(legacy_rows["task_group"]) == {groups4[4][0].task_id}
    assert legacy_rows["group_members"].to_list() == [3] * 3
    G = legacy_rows["episode_return"].to_numpy()
    np.testing.assert_allclose(legacy_rows["group_advantage"].to_numpy(), (G - G.mean()) / (G.std() + GRPO.eps))
    solo_rows = t.filter(pl.col("group_size") == 1)
    # a group of one: G - mean = 0
    assert solo_rows["group_members"].to_list() == [1, 1] and (solo_rows["group_advantage"] == 0.0).all()


def test_unjudged_members_are_written_but_enter_no_statistics(groups4, tmp_path):
    eps = list(groups4[:4])
    eps[1] = finished_as(eps[1], "timeout")
    eps[2] = finished_as(eps[2], "aborted")
    c = _run(tmp_path / "out", eps, Recipe(name="dom", normalization="domain", eps=1e-9))
    assert (c["episodes_excluded"], c["groups_released"], c["episodes"]) == (2, 1, 4)
    t = _trajs(tmp_path / "out")
    assert t["trainable"].to_list() == [True, False, False, True]
    assert t["excluded_reason"].to_list() == [None, "timeout", "aborted", None]
    assert t["group_members"].to_list() == [2] * 4  # 4 members arrived (the group is whole), 2 are trainable
    assert (t.filter(~pl.col("trainable"))[["episode_return", "group_advantage", "normalized_return"]]
            .to_numpy() == 0).all()
    s = pl.read_parquet(f"{tmp_path / 'out'}/steps/**/*.parquet")
    off = s.filter(~pl.col("trainable"))
    assert off.height > 0 and (off[["reward", "return_to_go", "advantage", "normalized_advantage"]].to_numpy() == 0).all()
    # the domain statistics are the two trainable episodes' steps: their normalized advantages have mean 0
    assert abs(s.filter(pl.col("trainable"))["normalized_advantage"].mean()) < 1e-9


def test_the_streaming_writer_holds_and_releases_groups_the_same_way(groups4, tmp_path):
    from pipelines.assemble import assemble_episode
    from pipelines.rewards import annotate_rewards
    from pipelines.stream_commit import _CommitPaneFn
    from pipelines.verify import _VerifyFn

    def prepared(eps):
        verify = _VerifyFn(use_domain_verifiers=False)
        return [annotate_rewards(next(verify.process(assemble_episode(ep[0].episode_id, ep, complete=True,
                                                                      reason=None))), GRPO) for ep in eps]

    fn = _CommitPaneFn(str(tmp_path / "stream"), GRPO, topic="t", shards=1)
    pane = PaneInfo(True, True, PaneInfoTiming.ON_TIME, 0, 0)
    parts = lambda eps, i: {"episodes": prepared(eps), "offsets": [(0, i, i + 1, 1)]}  # noqa: E731
    first = [ep for i, ep in enumerate(groups4) if i % 4 < 2]
    assert fn._commit(parts(first, 0), IntervalWindow(0, 10), pane) == 1
    assert fn._commit(parts(first, 1), IntervalWindow(0, 10), pane) is None  # a replay of held episodes: nothing
    assert fn._commit(parts([ep for i, ep in enumerate(groups4) if i % 4 >= 2], 2), IntervalWindow(10, 20),
                      pane) == 2
    layout = DatasetLayout(out=str(tmp_path / "stream"), version=GRPO.version, recipe_hash=GRPO.content_hash)
    m1, m2 = read_manifests(layout)
    assert (m1.counts["groups_held"], m1.counts["episodes_held"], m1.counts["steps"]) == (3, 6, 0)
    assert (m2.counts["groups_released"], m2.counts["groups_held"]) == (3, 0)
    batch = _run(tmp_path / "batch", groups4)
    s, b = _trajs(tmp_path / "stream"), _trajs(tmp_path / "batch")
    assert m2.counts["steps"] == batch["steps"] and s["episode_id"].to_list() == b["episode_id"].to_list()
    np.testing.assert_allclose(s["group_advantage"].to_numpy(), b["group_advantage"].to_numpy(), atol=1e-12)


def test_a_missing_held_state_file_is_an_error_naming_the_commit(groups4, tmp_path):
    out = tmp_path / "out"
    _run(out, groups4[:2])
    layout = DatasetLayout(out=str(out), version=GRPO.version, recipe_hash=GRPO.content_hash)
    [m] = read_manifests(layout)
    (out / f"{m.held_parts[0]}.steps.arrow").unlink()
    with pytest.raises(CommitError, match="commit 1 .* held-group state that is missing"):
        load_held_state(layout, [m])


def test_group_stats_map_is_weighed_by_its_entries_in_beams_side_input_cache(monkeypatch):
    """Beam's state cache weighs a side input by walking every object in it; the run's group statistics are
    weighed by their entry count instead, within a factor of two of the walk, and still pickle whole."""
    import pickle

    import objsize
    from apache_beam.runners.worker import statecache

    from pipelines.groups import GroupStatsMap

    stats = GroupStatsMap({
        ("code", f"task-group-{i:06d}", 3): GroupStats(size=4, members=(0, 1, 2, 3), episodes=4,
                                                       returns=RunningStats(n=4, mean=0.5, m2=0.1),
                                                       advantages=RunningStats(n=4, mean=0.0, m2=0.3))
        for i in range(2_500)})
    visited = []
    referents = statecache._get_referents_func
    monkeypatch.setattr(statecache, "_get_referents_func", lambda *objs: visited.extend(objs) or referents(*objs))
    weighed = statecache.get_deep_size([stats])
    assert len(visited) < 10, len(visited)  # the walk: every key, GroupStats and RunningStats (~25,000 objects)
    walked = objsize.get_deep_size([dict(stats)])
    assert walked / 2 <= weighed <= walked * 2, (weighed, walked)
    assert statecache.get_deep_size([GroupStatsMap()]) < 1_000
    back = pickle.loads(pickle.dumps(stats))
    assert type(back) is GroupStatsMap and back == stats
