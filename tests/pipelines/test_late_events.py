"""Late events (pipelines/late.py) and future event times, end to end on FnApiRunner.

Synthetic episode ``i`` of a seed starts at 2026-01-01 + i seconds, its events
50 ms apart; episodes come in GRPO groups of 4 (``group_size`` 4).
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import duckdb
import msgspec
import pyarrow.feather as feather
import pytest

from pipelines.commit import CommitError, DatasetLayout, read_manifests
from pipelines.inputs import ArchiveInput
from pipelines.query import register_views
from pipelines.recipes import load_recipe
from pipelines import testhooks
from pipelines.testhooks import run_batch_on_records
from pipelines.trajectory_job import run, run_batch
from pipelines.types import RawRecords
from schemas.codec import encode_event
from tests.pipelines.helpers import episodes, flat, write_archive

RECIPE = load_recipe("outcome")


def _reconciles(c: dict) -> bool:
    """The counts identity of docs/pipelines.md: every event read is counted once."""
    return (c["events_in"] + c["events_pending_in"]
            == c["events_used"] + c["events_incomplete"] + c["events_pending_out"] + c["dead_letters"]
            + c["duplicates"] + c["late_events"])


def _sql(q: str):
    return duckdb.connect().sql(q).fetchall()


def _layout(out: Path) -> DatasetLayout:
    return DatasetLayout(out=str(out), version=RECIPE.version, recipe_hash=RECIPE.content_hash)


def _trajectories(out: Path, episode_id: str):
    return _sql(f"select complete, completed_late, incomplete_reason, num_steps from "
                f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true) "
                f"where episode_id = '{episode_id}' order by complete")


def _steps(out: Path, episode_id: str) -> int:
    [(n,)] = _sql(f"select count(*) from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true) "
                  f"where episode_id = '{episode_id}'")
    return n


def _shifted(episode: list, delta: timedelta) -> list:
    return [msgspec.structs.replace(e, event_time=e.event_time + delta) for e in episode]


def _job(root: Path, out: Path, *extra: str) -> dict:
    c = run(["--source", "archive", "--archive", str(root), "--out", str(out), "--incomplete-after", "2", *extra])
    assert _reconciles(c), c
    return c


def test_missing_tail_arrives_later_and_completes_the_episode(tmp_path):
    """Commit 1 writes episode 0 incomplete (its tail is late) and holds its group's other three members;
    its tail then arrives with a re-delivered copy of a kept event and a repeated tail event: the tail is late
    (not duplicates), the episode is written complete with completed_late=True, its group is released whole."""
    eps = episodes(8, seed=31)
    target, n_steps = eps[0], eps[0][-1].num_steps
    root = write_archive(tmp_path / "archive", [flat(eps[1:]) + target[:-3]])
    out = tmp_path / "out"
    c1 = _job(root, out)
    assert (c1["episodes"], c1["incomplete_episodes"], c1["events_incomplete"], c1["groups_held"]) == (7, 1, 11, 1)
    [m1] = read_manifests(_layout(out))
    assert list(m1.late_state) == [f"_state/{RECIPE.version}/late-00000001.arrow"]
    kept = feather.read_table(out / next(iter(m1.late_state)))
    assert kept.column("episode_id").unique().to_pylist() == [target[0].episode_id] and kept.num_rows == 11

    write_archive(root, [flat(eps[1:]) + target[:-3], target[-3:] + target[:1] + target[-1:]])
    c2 = _job(root, out)
    assert (c2["events_in"], c2["late_events"], c2["duplicates"], c2["episodes_completed_late"]) == (5, 3, 2, 1)
    assert (c2["episodes"], c2["events_used"], c2["incomplete_episodes"], c2["groups_released"]) == (0, 0, 0, 1)
    # an `incomplete` row from commit 1, a complete one from commit 2; training data is the complete row's steps
    assert _trajectories(out, target[0].episode_id) == [(False, False, "unfinished", 0), (True, True, None, n_steps)]
    assert _steps(out, target[0].episode_id) == n_steps == c2["steps"] - sum(ep[-1].num_steps for ep in eps[1:4])
    con = duckdb.connect()
    assert "late_events" in register_views(con, data=out)
    rows = con.sql("select episode_id, seq, late_reason, event_type from late_events order by seq").fetchall()
    assert rows == [(target[0].episode_id, e.seq, "completed", e.event_type) for e in target[-3:]]

    # the tail once more: the episode is complete now, so its events are plain duplicates
    write_archive(root, [flat(eps[1:]) + target[:-3], target[-3:] + target[:1] + target[-1:], target[-2:]])
    c3 = _job(root, out)
    assert (c3["duplicates"], c3["late_events"], c3["episodes_completed_late"]) == (2, 0, 0)
    assert read_manifests(_layout(out))[-1].late_state == m1.late_state  # within the retention: still carried


def test_late_events_that_do_not_complete_are_kept_with_the_episode(tmp_path):
    """Late events that still leave a gap are `stored` (kept with the episode's events); the rest completes it."""
    eps = episodes(4, seed=32)
    target = eps[0]
    parts = [flat(eps[1:]) + target[:-5], target[-3:-1]]  # commit 2: two events after a gap
    root = write_archive(tmp_path / "archive", parts)
    out = tmp_path / "out"
    c1 = _job(root, out)  # both archive commits in one run: the gap makes it incomplete
    assert (c1["incomplete_episodes"], c1["events_incomplete"]) == (1, len(target) - 3)
    write_archive(root, [*parts, target[-5:-3]])  # the two events of the gap: still no episode_finished
    c2 = _job(root, out)
    assert (c2["late_events"], c2["episodes_completed_late"]) == (2, 0)
    m2 = read_manifests(_layout(out))[-1]
    assert len(m2.late_state) == 2  # commit 1's file, and commit 2's with all the events kept so far
    newest = feather.read_table(out / list(m2.late_state)[-1])
    assert newest.column("seq").to_pylist() == list(range(len(target) - 1))
    write_archive(root, [*parts, target[-5:-3], target[-1:]])
    c3 = _job(root, out)
    assert (c3["late_events"], c3["episodes_completed_late"]) == (1, 1)
    reasons = _sql(f"select late_reason, count(*) from read_parquet('{out}/late_events/**/*.parquet') "
                   f"group by 1 order by 1")
    assert reasons == [("completed", 1), ("stored", 2)]
    assert _trajectories(out, target[0].episode_id)[-1][:2] == (True, True)


def test_retention_drops_kept_events_and_later_tails_are_expired(tmp_path):
    """After --late-retention seconds of event time the kept events are dropped (and their file): a tail that
    comes after that is late with reason `expired` and completes nothing."""
    eps = episodes(8, seed=33)
    target = eps[0]
    hour_later = [_shifted(ep, timedelta(hours=1)) for ep in episodes(4, seed=34)]
    parts = [flat(eps[1:]) + target[:-3]]
    root = write_archive(tmp_path / "archive", parts)
    out = tmp_path / "out"
    args = ("--late-retention", "600")
    _job(root, out, *args)
    [kept_file] = read_manifests(_layout(out))[-1].late_state
    write_archive(root, [*parts, flat(hour_later)])  # moves the clock an hour on
    _job(root, out, *args)
    assert read_manifests(_layout(out))[-1].late_state == {} and not (out / kept_file).exists()
    write_archive(root, [*parts, flat(hour_later), target[-3:]])
    c3 = _job(root, out, *args)
    assert (c3["late_events"], c3["episodes_completed_late"], c3["duplicates"]) == (3, 0, 0)
    assert _sql(f"select distinct late_reason from read_parquet('{out}/late_events/**/*.parquet')") == [("expired",)]
    assert [r[0] for r in _trajectories(out, target[0].episode_id)] == [False]


@pytest.mark.parametrize("crash_at", ["before_manifest", "after_manifest"])
def test_crash_in_the_completing_commit_keeps_the_late_state(tmp_path, crash_at):
    eps = episodes(4, seed=35)
    target = eps[0]
    root = write_archive(tmp_path / "archive", [flat(eps[1:]) + target[:-3]])
    out = tmp_path / "out"
    _job(root, out)
    [kept_file] = read_manifests(_layout(out))[-1].late_state
    write_archive(root, [flat(eps[1:]) + target[:-3], target[-3:]])
    with testhooks.crash_at(crash_at), pytest.raises(CommitError, match="simulated crash"):
        run_batch(out=out, recipe=RECIPE, input=ArchiveInput(root), incomplete_after_s=2)
    assert (out / kept_file).exists()
    c = _job(root, out)  # recovers (rolls commit 2 back, or forward), then runs what is not committed yet
    assert c["episodes_completed_late"] == (1 if crash_at == "before_manifest" else 0)
    assert _trajectories(out, target[0].episode_id)[-1][:2] == (True, True)
    assert _steps(out, target[0].episode_id) == target[-1].num_steps
    assert not list(out.rglob("*.tmp"))


def _raw(eps: list[list], *, true_times: dict[str, timedelta] | None = None) -> list[RawRecords]:
    """One Kafka batch of the episodes' events; record timestamps are the events' true times (broker time),
    shifted back by ``true_times[episode_id]`` for events of a producer whose clock runs fast."""
    evs = flat(eps)
    fast = true_times or {}
    ts = [int((e.event_time - fast.get(e.episode_id, timedelta())).timestamp() * 1000) for e in evs]
    return [RawRecords(topic="t", partition=0, offsets=list(range(len(evs))), keys=[e.episode_id.encode() for e in evs],
                       values=[encode_event(e) for e in evs], timestamps_ms=ts)]


def test_a_producer_six_hours_fast_does_not_flip_pending_episodes(tmp_path):
    """Two unfinished episodes stay pending although one producer's events claim to be 6 hours later; its events
    are counted as future and still used (its episode is complete). Without the tolerance they would flip."""
    eps = episodes(8, seed=36)
    open_a, open_b = eps[6][:-1], eps[7][:-1]
    six_hours = timedelta(hours=6)
    fast = _shifted(eps[5], six_hours)
    batches = _raw([*eps[:5], fast, open_a, open_b], true_times={fast[0].episode_id: six_hours})
    c = run_batch_on_records(batches, out=tmp_path / "out", recipe=RECIPE, incomplete_after_s=600)
    assert (c["pending_episodes"], c["incomplete_episodes"], c["future_events"], c["episodes"]) == (2, 0, len(fast), 6)
    assert _reconciles(c)
    [m] = read_manifests(_layout(tmp_path / "out"))
    assert abs(m.clock_s - max(e.event_time for e in open_b).timestamp()) < 2e-3  # fast events: not on the clock

    flipped = run_batch_on_records(batches, out=tmp_path / "no-tolerance", recipe=RECIPE,
                                   incomplete_after_s=600, max_future_s=math.inf)
    assert (flipped["pending_episodes"], flipped["incomplete_episodes"], flipped["future_events"]) == (0, 2, 0)
    assert _reconciles(flipped)


def test_no_late_state_when_retention_is_zero(tmp_path):
    eps = episodes(4, seed=37)
    target = eps[0]
    root = write_archive(tmp_path / "archive", [flat(eps[1:]) + target[:-3]])
    out = tmp_path / "out"
    _job(root, out, "--late-retention", "0")
    assert read_manifests(_layout(out))[-1].late_state == {}
    write_archive(root, [flat(eps[1:]) + target[:-3], target[-3:]])
    c = _job(root, out, "--late-retention", "0")
    assert (c["late_events"], c["duplicates"], c["episodes_completed_late"]) == (3, 0, 0)  # expired, never dropped


def test_many_late_state_files_are_merged_into_the_commits_own(tmp_path):
    """More than LATE_STATE_MAX_FILES live files: the commit merges the live episodes (newest copy, within the
    retention, not emitted since) into its own staged file and carries none; fewer are carried as they are."""
    from pipelines.commit import LATE_STATE_MAX_FILES, DatasetManifest, carry_late_state
    from pipelines.late import LATE_STATE_FILE, late_state_newest_s
    from pipelines.sinks import STAGED_SUFFIX
    from schemas.arrow import events_to_table

    layout = _layout(tmp_path)
    n_files = LATE_STATE_MAX_FILES + 2
    eps = episodes(n_files + 1, seed=38)
    files = {}
    for n, ep in enumerate(eps[:n_files], start=1):
        rel = layout.late_state_file(n)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        feather.write_feather(events_to_table(ep[:-1]), tmp_path / rel, compression="uncompressed")
        files[rel] = late_state_newest_s(tmp_path / rel)
    last = DatasetManifest(commit=n_files, version=layout.version, recipe_hash="h", source="raw",
                           late_state=files)
    staging = tmp_path / "staging"
    clock_s = max(files.values())
    retention_s = clock_s - files[layout.late_state_file(3)]  # files 1 and 2 are past it
    kept = {k: v for k, v in files.items() if k not in (layout.late_state_file(1), layout.late_state_file(2))}
    assert carry_late_state(layout, last, staging, clock_s=clock_s, retention_s=retention_s) == kept  # 16 live
    staged = staging / "state" / (LATE_STATE_FILE + STAGED_SUFFIX)
    staged.parent.mkdir(parents=True)
    # this commit keeps a new episode and a newer copy of episode 1 (one more event)
    feather.write_feather(events_to_table(eps[-1][:-1] + eps[1]), staged, compression="uncompressed")
    assert carry_late_state(layout, last, staging, clock_s=clock_s, retention_s=retention_s,  # 16 + its own
                            drop={eps[5][0].episode_id}) == {}
    merged = feather.read_table(staged)
    rows = {}
    for e, s in zip(merged.column("episode_id").to_pylist(), merged.column("seq").to_pylist()):
        rows.setdefault(e, []).append(s)
    want = {ep[0].episode_id: list(range(len(ep) - 1)) for k, ep in enumerate(eps[:n_files]) if k not in (0, 5)}
    want[eps[1][0].episode_id] = list(range(len(eps[1])))  # the staged (newer) copy
    want[eps[-1][0].episode_id] = list(range(len(eps[-1]) - 1))
    assert rows == want and merged.column("episode_id").to_pylist() == sorted(merged.column("episode_id").to_pylist())
