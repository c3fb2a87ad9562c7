"""Evaluation episodes (purpose eval) go to ``evaluations/`` only: batch (archive, raw records) and stage_files.

The end-to-end proof with real sandboxed rollouts through Kafka is
tests/rollout/test_evaluate_end_to_end.py; here synthetic episodes marked
``purpose = "eval"`` check the routing rules on FnApiRunner.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from pipelines.commit import DatasetLayout, committed_episodes, read_manifests
from pipelines.evaluations import eval_run_of
from pipelines.recipes import load_recipe
from pipelines.testhooks import run_batch_on_records
from pipelines.trajectory_job import run
from pipelines.types import RawRecords
from schemas.codec import encode_event
from schemas.events import EpisodeStatus
from tests.pipelines.helpers import edit, episodes, flat, write_archive


def _reconciles(c: dict) -> bool:
    return (c["events_in"] + c["events_pending_in"]
            == c["events_used"] + c["events_incomplete"] + c["events_pending_out"] + c["dead_letters"] + c["duplicates"]
            + c["late_events"])


def _sql(q: str):
    return duckdb.connect().sql(q).fetchall()


def _as_eval(ep: list, *, run: str = "eval-v3-abcd1234", n: int = 0, passed: bool | None = None) -> list:
    """The episode as an evaluation of policy version 3 (task_group as rollout.evaluate writes it)."""
    group = f"{ep[0].task_id}@v3#{run}.{n}"
    finished = None
    if passed is not None:
        finished = {"status": EpisodeStatus.SUCCESS if passed else EpisodeStatus.FAILURE,
                    "outcome_reward": 1.0 if passed else 0.0}
    return edit(ep, started={"purpose": "eval", "task_group": group, "group_size": 1, "group_member": 0},
                finished=finished, envelope={"policy_version": 3})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """24 training episodes and 8 evaluation episodes (5 passed), in two archive commits; and the train-only twin."""
    train = episodes(24, seed=31)
    evals = [_as_eval(ep, n=i, passed=i < 5) for i, ep in enumerate(episodes(8, seed=32))]
    root = tmp_path_factory.mktemp("mixed")
    both = write_archive(root / "archive", [flat(train[:12] + evals[:4]), flat(train[12:] + evals[4:])])
    only = write_archive(root / "train-only", [flat(train[:12]), flat(train[12:])])
    out, twin = root / "out", root / "twin"
    counts = [run(["--source", "archive", "--archive", str(both), "--out", str(out)])]
    run(["--source", "archive", "--archive", str(only), "--out", str(twin)])
    return out, twin, counts, train, evals, both


def test_eval_episodes_are_rows_of_evaluations_only(mixed):
    out, _, [c], train, evals, _ = mixed
    assert c["evaluations"] == 8 and c["episodes"] == 32 and _reconciles(c)
    assert c["steps"] == sum(e.event_type == "step" for e in flat(train))
    rows = _sql(f"select episode_id, passed, status, policy_version, eval_run, complete, num_steps, difficulty "
                f"from read_parquet('{out}/evaluations/**/*.parquet', hive_partitioning=true) order by 1")
    assert [r[0] for r in rows] == sorted(ep[0].episode_id for ep in evals)
    assert sum(r[1] for r in rows) == 5 and {r[2] for r in rows} == {"success", "failure"}
    assert {(r[3], r[4], r[5]) for r in rows} == {(3, "eval-v3-abcd1234", True)}
    by_id = {ep[0].episode_id: ep for ep in evals}
    assert all(r[6] == sum(e.event_type == "step" for e in by_id[r[0]]) for r in rows)
    eval_ids = {ep[0].episode_id for ep in evals}
    for table in ("steps", "trajectories"):
        ids = {r[0] for r in _sql(f"select distinct episode_id from "
                                  f"read_parquet('{out}/{table}/**/*.parquet', hive_partitioning=true)")}
        assert ids == {ep[0].episode_id for ep in train} and not ids & eval_ids, table


def test_training_tables_and_statistics_are_those_without_the_eval_episodes(mixed):
    out, twin, *_ = mixed
    for table in ("steps", "trajectories"):
        mine = sorted(p.relative_to(out) for p in (out / table).rglob("*.parquet"))
        assert mine == sorted(p.relative_to(twin) for p in (twin / table).rglob("*.parquet"))
        for rel in mine:
            assert pq.read_table(out / rel).equals(pq.read_table(twin / rel)), rel
    [norm] = (out / "_state").glob("norm-*.json")
    assert json.loads(norm.read_text()) == json.loads((twin / "_state" / norm.name).read_text())
    groups = sorted((out / "_state").rglob("groups-*.json"))
    assert [g.read_text() for g in groups] == [g.read_text() for g in sorted((twin / "_state").rglob("groups-*.json"))]


def test_rerun_and_replayed_eval_events_add_nothing(mixed, tmp_path):
    out, _, _, _, evals, both = mixed
    assert run(["--source", "archive", "--archive", str(both), "--out", str(out)])["evaluations"] == 0
    # The same eval events delivered again (at-least-once) in a new archive commit are duplicates.
    replay = write_archive(tmp_path / "replay", [flat(evals)])
    layout_out = tmp_path / "r-out"
    first = run(["--source", "archive", "--archive", str(replay), "--out", str(layout_out)])
    write_archive(replay, [flat(evals), flat(evals[:3])])
    again = run(["--source", "archive", "--archive", str(replay), "--out", str(layout_out)])
    assert (first["evaluations"], again["evaluations"], again["duplicates"]) == (8, 0, len(flat(evals[:3])))
    [(n, distinct)] = _sql(f"select count(*), count(distinct episode_id) from "
                           f"read_parquet('{layout_out}/evaluations/**/*.parquet', hive_partitioning=true)")
    assert n == distinct == 8
    recipe = load_recipe("outcome")
    layout = DatasetLayout(out=str(layout_out), version=recipe.version, recipe_hash=recipe.content_hash)
    assert committed_episodes(layout, read_manifests(layout)).complete == {ep[0].episode_id for ep in evals}


def test_raw_records_path_and_an_unfinished_eval_episode(tmp_path):
    train = episodes(6, seed=33)
    evals = [_as_eval(ep, n=i, passed=True) for i, ep in enumerate(episodes(3, seed=34))]
    evals[2] = evals[2][:3]  # the evaluator died: never finishes
    events = flat(train + evals)
    batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(events))),
                       keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                       timestamps_ms=[0] * len(events))
    out = tmp_path / "out"
    c = run_batch_on_records([batch], out=out, recipe=load_recipe("outcome"), incomplete_after_s=1)
    assert (c["episodes"], c["evaluations"], c["incomplete_episodes"]) == (8, 2, 1) and _reconciles(c)
    rows = _sql(f"select episode_id, complete, status, passed from "
                f"read_parquet('{out}/evaluations/**/*.parquet', hive_partitioning=true) order by complete, 1")
    assert rows[0] == (evals[2][0].episode_id, False, "incomplete", False)
    assert sorted(r[0] for r in rows[1:]) == sorted(ep[0].episode_id for ep in evals[:2])
    [(n,)] = _sql(f"select count(*) from read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true) "
                  f"where episode_id in ({', '.join(repr(ep[0].episode_id) for ep in evals)})")
    assert n == 0


def test_eval_run_is_read_from_the_task_group():
    assert eval_run_of("code-d1-ab@v12#eval-v12-0011aabb.3") == "eval-v12-0011aabb"
    assert eval_run_of("code-d1-ab@v12#run7.3") == "run7"
    assert eval_run_of("") == ""


def test_query_views_evaluations_and_pass_rates(mixed, tmp_path):
    import shutil

    from pipelines.query import register_views

    out, *_ = mixed
    con = duckdb.connect()
    assert {"evaluations", "evaluation_pass_rates"} <= set(register_views(con, data=out))
    assert con.execute("select count(*), sum(passed::int) from evaluations").fetchone() == (8, 5)
    [(version, episodes, passed, rate)] = con.execute(
        "select policy_version, sum(episodes), sum(passed), sum(passed) / sum(episodes) "
        "from evaluation_pass_rates group by policy_version").fetchall()
    assert (version, episodes, passed, rate) == (3, 8, 5, 5 / 8)
    # A second dataset version (another recipe) under the same root writes its own rows: still one per episode.
    twin = tmp_path / "two-recipes"
    shutil.copytree(out, twin)
    for p in (twin / "evaluations").glob("recipe=*"):
        shutil.copytree(p, p.with_name("recipe=other-00000000"))
    con2 = duckdb.connect()
    register_views(con2, data=twin)
    assert con2.execute("select count(*) from evaluations").fetchone() == (8,)


def test_the_polars_reference_leaves_eval_episodes_out_too(mixed):
    import polars as pl

    from pipelines.archive_source import list_archive_files
    from pipelines.polars_ref import compute_polars

    out, _, _, train, _, both = mixed
    recipe = load_recipe("outcome")
    ref_steps, ref_trajs = compute_polars([f.path for f in list_archive_files(both)], recipe)
    ours = pl.read_parquet(f"{out}/steps/**/*.parquet", hive_partitioning=True)
    cols = ["episode_id", "step_index", "normalized_advantage"]
    ours, ref = ours.select(cols).sort(cols[:2]), ref_steps.select(cols).sort(cols[:2])
    assert ours.select(cols[:2]).equals(ref.select(cols[:2]))
    assert (ours["normalized_advantage"] - ref["normalized_advantage"]).abs().max() < 1e-9
    assert set(ref_trajs["episode_id"]) == {ep[0].episode_id for ep in train}
