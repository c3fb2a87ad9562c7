"""End-to-end: archive / raw records → committed datasets on FnApiRunner."""

import os
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from deltalake import DeltaTable

from pipelines.commit import CommitError
from pipelines.delta_tables import app_id, delta_batches, table_versions_at
from pipelines.inputs import ArchiveInput
from pipelines.polars_ref import compute_polars
from pipelines.recipes import Recipe, load_recipe
from pipelines import testhooks
from pipelines.testhooks import run_batch_on_records
from pipelines.trajectory_job import JobError, run, run_batch
from pipelines.types import RawRecords
from schemas.codec import encode_event
from schemas.commit_log import CommitLogError
from schemas.manifests import commit_log_of, list_dataset_versions, read_dataset_manifests, read_dataset_records
from tests.pipelines.helpers import episodes, finished_as, flat, write_archive

N = 100


def _reconciles(c: dict) -> bool:
    return (c["events_in"] + c["events_pending_in"]
            == c["events_used"] + c["events_incomplete"] + c["events_pending_out"] + c["dead_letters"] + c["duplicates"]
            + c["late_events"])


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.parquet"))}


def _sql(q: str):
    return duckdb.connect().sql(q).fetchall()


def _delta_rows(out: Path, table: str, recipe: str):
    """The rows of one recipe in a table's latest Delta snapshot, in key order."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    rows = DeltaTable(str(out / table)).to_pyarrow_dataset().to_table(
        filter=pc.starts_with(pads.field("recipe"), f"{recipe}-"))
    keys = [("episode_id", "ascending")] + ([("step_index", "ascending")] if table == "steps" else [])
    return rows.sort_by(keys).select(sorted(rows.column_names))


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> tuple[Path, list]:
    eps = episodes(N, seed=21)
    events = flat(eps)
    # 5 re-delivered events (at-least-once transport) inside the second commit
    root = write_archive(tmp_path_factory.mktemp("a") / "archive", [flat(eps[:50]), flat(eps[50:]) + events[:5]])
    return root, eps


@pytest.fixture(scope="module")
def first_run(archive, tmp_path_factory):
    root, eps = archive
    out = tmp_path_factory.mktemp("o") / "datasets"
    counts = run(["--source", "archive", "--archive", str(root), "--out", str(out)])
    return out, counts


def test_counts_and_rows(archive, first_run):
    _, eps = archive
    out, c = first_run
    n_events, n_steps = len(flat(eps)), sum(e.event_type == "step" for e in flat(eps))
    assert c["episodes"] == N and c["steps"] == n_steps and c["dead_letters"] == 0
    assert c["events_in"] == n_events + 5 and c["duplicates"] == 5 and _reconciles(c)
    [(trajs, distinct)] = _sql(f"select count(*), count(distinct episode_id) from "
                               f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)")
    assert trajs == distinct == N
    [(steps, recipes)] = _sql(f"select count(*), count(distinct recipe) from "
                              f"read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true)")
    assert steps == n_steps and recipes == 1


def test_each_commit_is_one_delta_transaction_per_table_with_its_batch_id(first_run):
    out, c = first_run
    [version] = list_dataset_versions(out)
    for table in ("steps", "trajectories"):
        dt = DeltaTable(str(out / table))
        assert dt.transaction_version(app_id(version)) == 1
        [batch] = delta_batches(out / table)
        assert batch["batch_id"] == f"{version}/00000001" and batch["source"] == "archive"
        assert batch["archive_commits"] == "[1, 2]" and '"steps": %d' % c["steps"] in batch["counts"]
        glob = _sql(f"select count(*) from read_parquet('{out}/{table}/**/*.parquet', hive_partitioning=true)")
        assert dt.to_pyarrow_dataset().count_rows() == glob[0][0] == (c["steps"] if table == "steps" else N)
    assert table_versions_at(out, version, 1) == {"steps": 0, "trajectories": 0}
    # the same rows through polars' Delta reader
    assert pl.scan_delta(str(out / "trajectories")).select(pl.len()).collect().item() == N


def test_domain_normalized_advantage_is_standardized(first_run):
    out, _ = first_run
    rows = _sql(f"select domain, avg(normalized_advantage), stddev_pop(normalized_advantage) "
                f"from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true) group by domain")
    assert len(rows) == 4
    for domain, mean, std in rows:
        # one run from empty state: mean 0 exactly (float error), std = s / (s + eps) with eps = 1e-6
        assert abs(mean) < 1e-9 and abs(std - 1) < 1e-4, (domain, mean, std)


def test_rerun_adds_nothing(archive, first_run):
    root, _ = archive
    out, _ = first_run
    before = _files(out)
    again = run(["--source", "archive", "--archive", str(root), "--out", str(out)])
    assert set(again.values()) == {0} and _files(out) == before


def test_new_recipe_writes_a_second_version(archive, first_run, tmp_path):
    root, _ = archive
    out, _ = first_run
    recipe = tmp_path / "shaped.yaml"
    recipe.write_text("# trajpipe pipeline run --source archive --archive A --out O --recipe shaped.yaml\n"
                      "reward: verification_shaped\ngamma: 0.9\nverification_weight: 0.5\n")
    c = run(["--source", "archive", "--archive", str(root), "--out", str(out), "--recipe", str(recipe)])
    assert c["episodes"] == N
    versions = _sql(f"select recipe, count(*) from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true) "
                    f"group by recipe order by recipe")
    assert [v[0].split("-")[0] for v in versions] == ["outcome", "shaped"] and versions[0][1] == versions[1][1]
    assert len(list_dataset_versions(out)) == 2 and not (out / "_manifests").exists()
    # both versions append to the same Delta tables, each under its own application transaction
    dt = DeltaTable(str(out / "steps"))
    assert sorted(dt.transaction_version(app_id(v)) for v in list_dataset_versions(out)) == [1, 1]
    assert [b["version"].split("-")[0] for b in delta_batches(out / "steps")] == ["outcome", "shaped"]


@pytest.mark.parametrize("crash_at", ["before_manifest", "after_manifest", "before_delta"])
def test_crash_mid_commit_then_rerun_gives_the_same_dataset(archive, first_run, tmp_path, crash_at):
    root, _ = archive
    clean, _ = first_run
    out = tmp_path / "crashed"
    with testhooks.crash_at(crash_at), pytest.raises(CommitError, match="simulated crash"):
        run_batch(out=out, recipe=load_recipe("outcome"), input=ArchiveInput(root))
    run(["--source", "archive", "--archive", str(root), "--out", str(out)])
    ours = {k: v for k, v in _files(out).items() if "outcome-" in k}
    theirs = {k: v for k, v in _files(clean).items() if "outcome-" in k}
    assert ours.keys() == theirs.keys()
    for k in ours:
        if k.startswith(("steps/", "trajectories/")):
            assert pq.read_table(out / k).equals(pq.read_table(clean / k)), k
    assert not list(out.rglob("*.tmp"))
    for table in ("steps", "trajectories"):  # one Delta transaction per table, rolled forward if it was missing
        assert len(delta_batches(out / table)) == 1
        assert _delta_rows(out, table, "outcome").equals(_delta_rows(clean, table, "outcome")), table


def test_micro_batches_carry_unfinished_episodes(tmp_path):
    eps = episodes(6, seed=5)
    late = eps[-1]
    root = write_archive(tmp_path / "archive", [flat(eps[:-1]) + late[:3]])
    out = tmp_path / "out"
    args = ["--source", "archive", "--archive", str(root), "--out", str(out), "--incomplete-after", "600"]
    c1 = run(args)
    assert (c1["episodes"], c1["pending_episodes"], c1["events_pending_out"]) == (5, 1, 3) and _reconciles(c1)
    write_archive(root, [flat(eps[:-1]) + late[:3], late[3:]])  # commit 2 brings the rest
    c2 = run(args)
    assert (c2["episodes"], c2["events_pending_in"], c2["events_in"]) == (1, 3, len(late) - 3) and _reconciles(c2)
    [(n,)] = _sql(f"select count(*) from read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)")
    assert n == 6


def test_idle_unfinished_episode_becomes_incomplete(tmp_path):
    eps = episodes(6, seed=6)
    root = write_archive(tmp_path / "archive", [flat(eps[1:]) + eps[0][:3]])  # eps[0] never finishes
    out = tmp_path / "out"
    c = run(["--source", "archive", "--archive", str(root), "--out", str(out), "--incomplete-after", "2"])
    assert (c["episodes"], c["incomplete_episodes"], c["events_incomplete"]) == (5, 1, 3) and _reconciles(c)
    rows = _sql(f"select episode_id, status, complete, incomplete_reason from "
                f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true) where not complete")
    assert rows == [(eps[0][0].episode_id, "incomplete", False, "unfinished")]


def test_bad_raw_records_go_to_dead_letters(tmp_path):
    eps = episodes(8, seed=7)
    values = [encode_event(e) for e in flat(eps)]
    keys = [e.episode_id.encode() for e in flat(eps)]
    future = bytearray(values[1]); future[4:6] = (7).to_bytes(2, "big")
    bad = [b"\x00garbage", values[1][:20], bytes(future)]
    batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(values) + 3)),
                       keys=keys + [b"x"] * 3, values=values + bad, timestamps_ms=[0] * (len(values) + 3))
    out = tmp_path / "out"
    c = run_batch_on_records([batch], out=out, recipe=load_recipe("outcome"))
    assert (c["episodes"], c["dead_letters"], c["events_in"]) == (8, 3, len(values) + 3) and _reconciles(c)
    reasons = _sql(f"select reason, source_offset from read_parquet('{out}/dead_letters/**/*.parquet') order by 2")
    assert [r[0] for r in reasons] == ["bad_magic", "truncated", "future_version"]


def _varied_archive(root: Path) -> tuple[Path, list]:
    """Synthetic groups of 4 with unjudged members (timeout, error), a max_steps one, a group missing a member
    (held) and one whose member never finishes (held, and pending)."""
    eps = episodes(40, seed=23)
    eps[5] = finished_as(eps[5], "timeout")
    eps[6] = finished_as(eps[6], "error")
    eps[9] = finished_as(eps[9], "max_steps")
    eps[21] = eps[21][:-1]  # never finishes
    del eps[15]  # member 3 of group 3 never comes
    return write_archive(root, [flat(eps[:20]), flat(eps[20:])]), eps


@pytest.mark.parametrize("recipe", [
    load_recipe("outcome"), load_recipe("verification_shaped"),
    Recipe(name="drgrpo", reward="verification_shaped", gamma=0.9, lam=0.9, verification_weight=0.5,
           step_penalty=0.01, normalization="group_mean"),
    Recipe(name="additive", reward="verification_shaped", shaping="additive", verification_weight=0.25,
           step_penalty=0.25, normalization="group", verifier_weights={"math.step_check": 2.0}),
], ids=lambda r: r.name)
@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "forked"])
def test_polars_reference_agrees(recipe, workers, tmp_path):
    """The job's rows equal the polars reference's, episodes processed in the runner or in 2 forked workers."""
    root, eps = _varied_archive(tmp_path / "archive")
    out = tmp_path / "out"
    c = run_batch(out=out, recipe=recipe, input=ArchiveInput(root), use_domain_verifiers=False, workers=workers)
    assert (c["groups_held"], c["episodes_held"], c["episodes_excluded"], c["pending_episodes"]) == (2, 6, 2, 1)
    from pipelines.archive_source import list_archive_files

    files = [f.path for f in list_archive_files(root)]
    ref_steps, ref_trajs = compute_polars(files, recipe)
    cols = ["episode_id", "step_index", "trainable", "group_size", "observation_tokens", "action_tokens",
            "context_tokens", "reward", "return_to_go", "advantage", "normalized_advantage", "group_advantage"]
    ours = pl.read_parquet(f"{out}/steps/recipe={recipe.version}/**/*.parquet", hive_partitioning=True)
    ours, ref = ours.select(cols).sort("episode_id", "step_index"), ref_steps.select(cols).sort("episode_id",
                                                                                              "step_index")
    assert ours.height == ref.height == c["steps"]
    assert ours.select(cols[:7]).equals(ref.select(cols[:7]).cast(ours.select(cols[:7]).schema))
    for col in cols[7:]:
        assert (ours[col] - ref[col]).abs().max() < 1e-9, (recipe.name, col)
    traj_cols = ["episode_id", "num_steps", "action_tokens", "num_events", "termination", "trainable",
                 "excluded_reason", "group_size", "group_member", "group_members", "group_timed_out", "steps_passed",
                 "outcome_reward", "episode_return", "normalized_return", "group_advantage"]
    beam_trajs = pl.read_parquet(f"{out}/trajectories/recipe={recipe.version}/**/*-s*.parquet",
                                 hive_partitioning=True).select(traj_cols).sort("episode_id")
    ref_trajs = ref_trajs.select(traj_cols).sort("episode_id")
    assert beam_trajs.height == ref_trajs.height == len(eps) - 6 - 1  # held: 6 (two groups of 3), pending: 1
    assert beam_trajs.select(traj_cols[:12]).equals(ref_trajs.select(traj_cols[:12]).cast(beam_trajs.select(
        traj_cols[:12]).schema))
    for col in traj_cols[12:]:
        assert (beam_trajs[col] - ref_trajs[col]).abs().max() < 1e-9, (recipe.name, col)


def test_option_errors_name_the_option(tmp_path):
    with pytest.raises(JobError, match="`--runner` FnApiRunner cannot run --mode stream"):
        run(["--source", "archive", "--archive", "a", "--out", str(tmp_path), "--mode", "stream",
             "--runner", "FnApiRunner"])
    with pytest.raises(JobError, match="`--archive`"):
        run(["--source", "archive", "--out", str(tmp_path)])
    with pytest.raises(JobError, match="`--mode stream` reads Kafka"):
        run(["--source", "archive", "--archive", "a", "--out", str(tmp_path), "--mode", "stream"])
    with pytest.raises(JobError, match="`--stop-after-s`"):
        run(["--source", "kafka", "--bootstrap", "b:1", "--out", str(tmp_path), "--mode", "stream",
             "--stop-after-s", "0"])
    with pytest.raises(JobError, match="`--stop-at-end` and `--stop-file` stop a --mode stream job"):
        run(["--source", "kafka", "--bootstrap", "b:1", "--out", str(tmp_path), "--stop-at-end"])


def test_cli_bad_recipe_and_options_are_one_line_each(tmp_path):
    from typer.testing import CliRunner

    from trajpipe.cli import app

    def run_cli(*args):
        return CliRunner().invoke(app, ["pipeline", "run", "--source", "archive", "--archive", str(tmp_path),
                                        "--out", str(tmp_path / "out"), *args])

    res = run_cli("--recipe", "nosuch")
    assert res.exit_code == 2 and "error: `--recipe` 'nosuch' is neither a builtin" in res.output
    (tmp_path / "pays.yaml").write_text("# trajpipe pipeline run ... --recipe pays.yaml\nname: pays\n"
                                        "reward: verification_shaped\nshaping: additive\nverification_weight: 0.5\n")
    res = run_cli("--recipe", str(tmp_path / "pays.yaml"))  # additive shaping that would pay for length
    assert res.exit_code == 2 and res.output.startswith("error: ") and "step_penalty" in res.output
    res = run_cli("--group-timeout", "-1")
    assert res.exit_code == 2 and "`--group-timeout` must be >= 0" in res.output
    assert "Traceback" not in res.output


def test_covered_offsets_is_the_largest_end_per_partition():
    from pipelines.commit import DatasetManifest, covered_offsets

    def m(n, offsets):
        return DatasetManifest(commit=n, version="v", recipe_hash="h", source="kafka", offsets={"t": offsets})

    # stream panes interleave in offsets (a late pane of partition 1 after a later window's pane)
    assert covered_offsets([m(1, {0: [0, 49]}), m(2, {0: [49, 68], 1: [71, 146]}), m(3, {1: [0, 71]})], "t") \
        == {0: 68, 1: 146}
    assert covered_offsets([m(1, {0: [0, 5]})], "other") == {}


def test_unkeyed_records_are_assembled_by_their_episode_id(tmp_path):
    """Records without a Kafka key are decoded early to find their episode (or dead-lettered)."""
    eps = episodes(4, seed=9)
    values = [encode_event(e) for e in flat(eps)]
    keys = [None if i % 3 == 0 else e.episode_id.encode() for i, e in enumerate(flat(eps))]
    batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(values) + 1)),
                       keys=keys + [None], values=values + [b"\x00garbage frame"],
                       timestamps_ms=[0] * (len(values) + 1))
    out = tmp_path / "out"
    c = run_batch_on_records([batch], out=out, recipe=load_recipe("outcome"))
    assert (c["episodes"], c["dead_letters"], c["events_used"]) == (4, 1, len(values)) and _reconciles(c)
    assert _sql(f"select reason, source_offset from read_parquet('{out}/dead_letters/**/*.parquet')") == [
        ("bad_magic", len(values))]


@pytest.mark.slow
def test_concurrent_runs_commit_disjoint_work_once(archive, tmp_path):
    """Three `trajpipe pipeline run` processes at once on one --out: two of one version, one of another.

    The two of one version serialize on the version's commit lock (the second then finds the
    input covered and commits nothing); the other version's Delta transactions land on the same
    tables concurrently. Every episode is committed exactly once per version.
    """
    import os
    import subprocess
    import sys

    root, _ = archive
    out = tmp_path / "datasets"
    shaped = tmp_path / "shaped.yaml"
    shaped.write_text("# trajpipe pipeline run --source archive --archive A --out O --recipe shaped.yaml\n"
                      "reward: verification_shaped\ngamma: 0.9\nverification_weight: 0.5\n")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    base = [sys.executable, "-m", "trajpipe", "pipeline", "run", "--source", "archive", "--archive", str(root),
            "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in (base, base, [*base, "--recipe", str(shaped)])]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    import json
    counts = [json.loads(o.strip().splitlines()[-1]) for _, o, _ in results]
    assert sorted(c["episodes"] for c in counts[:2]) == [0, N] and counts[2]["episodes"] == N
    waited = [e for _, _, e in results[:2] if "waiting for its commit lock" in e]
    versions = list_dataset_versions(out)
    assert [commit_log_of(out, v).head() for v in versions] == [1, 1], waited  # one commit each, in the log
    assert [[m.commit for m in read_dataset_manifests(out, v)] for v in versions] == [[1], [1]]
    rows = _sql(f"select recipe, count(*), count(distinct episode_id) from "
                f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true) group by recipe order by 1")
    assert [r[1:] for r in rows] == [(N, N), (N, N)]
    dt = DeltaTable(str(out / "trajectories"))
    assert [dt.transaction_version(app_id(v)) for v in versions] == [1, 1]
    assert dt.to_pyarrow_dataset().count_rows() == 2 * N and len(delta_batches(out / "trajectories")) == 2


def test_a_table_delta_refuses_is_one_error_line_and_the_commit_catches_up_later(archive, tmp_path):
    """Another tool's Delta table with another schema at <out>/steps: one error line, nothing lost.

    The manifest and the files are in place when the Delta transaction is refused, so once the
    table is moved away the next run's recovery adds the commit to every table, and reads nothing new.
    """
    import os
    import shutil
    import subprocess
    import sys

    import pyarrow as pa
    from deltalake import write_deltalake

    root, _ = archive
    out = tmp_path / "datasets"
    write_deltalake(str(out / "steps"), pa.table({"something_else": [1, 2]}))
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "trajpipe", "pipeline", "run", "--source", "archive", "--archive", str(root),
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    bad = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"Delta table {out / 'steps'} has columns (something_else: long)" in last, last
    foreign = DeltaTable(str(out / "steps"))  # left as it was
    assert foreign.version() == 0 and foreign.to_pyarrow_dataset().count_rows() == 2
    shutil.rmtree(out / "steps" / "_delta_log")
    again = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    [version] = list_dataset_versions(out)
    for table in ("steps", "trajectories"):
        assert DeltaTable(str(out / table)).transaction_version(app_id(version)) == 1, table
    assert DeltaTable(str(out / "trajectories")).to_pyarrow_dataset().count_rows() == N


def test_test_hooks_are_armed_only_inside_their_block(tmp_path):
    # in-memory records are a test hook: without it, the `raw` source is refused with one clear line
    with pytest.raises(JobError, match="in-memory records, which only tests give"):
        run_batch(out=tmp_path / "out", recipe=load_recipe("outcome"), input=testhooks.InMemoryInput())
    assert not (tmp_path / "out" / "_commit_log").exists() and not (tmp_path / "out" / "_manifests").exists()
    with pytest.raises(ValueError, match="unknown crash point 'after_delta'"):
        with testhooks.crash_at("after_delta"):
            pass
    with testhooks.crash_at("after_manifest"):
        assert testhooks.crashes_at("after_manifest")
    assert not any(testhooks.crashes_at(p) for p in testhooks.CRASH_POINTS)
    assert testhooks.injected_records() is None


def _to_legacy_layout(out: Path) -> dict[str, list[bytes]]:
    """Turn a dataset back into the layout before the commit log: commit n's record as ``_manifests/V/<n>.json``."""
    import shutil

    legacy = {}
    for v in list_dataset_versions(out):
        legacy[v] = read_dataset_records(out, v)
        (out / "_manifests" / v).mkdir(parents=True)
        for n, record in enumerate(legacy[v], start=1):
            (out / "_manifests" / v / f"{n:08d}.json").write_bytes(record)
    shutil.rmtree(out / "_commit_log")
    return legacy


def test_a_legacy_dataset_is_read_as_it_is_then_moved_into_the_commit_log_by_the_next_run(tmp_path):
    from trainer.data import scan_commits

    eps = episodes(9, seed=8)
    root = write_archive(tmp_path / "archive", [flat(eps[:4]), flat(eps[4:6])])
    out = tmp_path / "out"
    args = ["--source", "archive", "--archive", str(root), "--out", str(out)]
    assert run(args)["episodes"] == 6
    [version] = list_dataset_versions(out)
    # two commits (the archive's two commits in one; then a second dataset commit of a third archive commit)
    write_archive(root, [flat(eps[:4]), flat(eps[4:6]), flat(eps[6:8])])
    assert run(args)["episodes"] == 2
    files = _files(out)
    legacy = _to_legacy_layout(out)
    assert [len(r) for r in legacy.values()] == [2] and not (out / "_commit_log").exists()
    # readers read the legacy files while no writer has come
    assert [m.commit for m in read_dataset_manifests(out, version)] == [1, 2]
    assert [c.commit for c in scan_commits(out, recipe=version)] == [1, 2]
    assert [m.commit for m in read_dataset_manifests(out, version, as_of=1)] == [1]
    with pytest.raises(CommitLogError, match=r"has commits 1\.\.2, not 3"):
        read_dataset_manifests(out, version, as_of=3)
    # the next run imports them (same bytes, in order), deletes them, and adds nothing
    again = run(args)
    assert set(again.values()) == {0} and _files(out) == files
    assert not (out / "_manifests").exists()
    assert commit_log_of(out, version).head() == 2 and read_dataset_records(out, version) == legacy[version]
    assert [len(delta_batches(out / t)) for t in ("steps", "trajectories")] == [2, 2]
    # ... and the commit after it goes on from the log
    write_archive(root, [flat(eps[:4]), flat(eps[4:6]), flat(eps[6:8]), flat(eps[8:])])
    assert run(args)["episodes"] == 1
    assert [m.commit for m in read_dataset_manifests(out, version)] == [1, 2, 3]
    [(n, distinct)] = _sql(f"select count(*), count(distinct episode_id) from "
                           f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)")
    assert n == distinct == 9
    # a legacy file restored by hand that differs from the log: `trajpipe pipeline run` stops with one line, exit 2,
    # and changes nothing
    from typer.testing import CliRunner

    from trajpipe.cli import app

    files = _files(out)
    (out / "_manifests" / version).mkdir(parents=True)
    (out / "_manifests" / version / "00000001.json").write_bytes(legacy[version][1])  # commit 2's record as 1
    res = CliRunner().invoke(app, ["pipeline", "run", *args])
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "differ at commit 1" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and _files(out) == files and commit_log_of(out, version).head() == 3


def test_a_run_planned_on_a_stale_snapshot_is_refused_and_leaves_nothing(tmp_path):
    """The commit log refuses a commit made against a snapshot another writer committed after: CommitConflict,
    the loser's staging deleted, the winner's commit the only one (what a run without the lock would meet)."""
    from pipelines.commit import CommitConflict, DatasetLayout, DatasetManifest, commit_staged, read_snapshot
    from pipelines.normalize import NormState
    from pipelines.sinks import stage_files
    from schemas.deadletter import DeadLetter

    recipe = load_recipe("outcome")
    out = tmp_path / "out"

    def staged(run: str) -> tuple[DatasetLayout, DatasetManifest]:
        layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash, run=run)
        dead = DeadLetter(reason="bad_magic", message=run, source_topic=run, source_partition=0, source_offset=0,
                          key=None, value=b"x", detected_by="test")
        stage_files(layout.staging(1), recipe, commit=1, dead_letters=[dead])
        return layout, DatasetManifest(commit=1, version=recipe.version, recipe_hash=recipe.content_hash,
                                       source="raw", counts={"dead_letters": 1})

    (mine, m1), (rival, m2) = staged("mine"), staged("rival")
    (snap_mine, _), (snap_rival, _) = read_snapshot(mine), read_snapshot(rival)
    commit_staged(rival, m2, prior_norm=NormState(recipe_hash=recipe.content_hash), snapshot=snap_rival)
    with pytest.raises(CommitConflict, match=f"another run committed 1 of {recipe.version}"):
        commit_staged(mine, m1, prior_norm=NormState(recipe_hash=recipe.content_hash), snapshot=snap_mine)
    assert not os.path.exists(mine.staging(1))
    [m] = read_dataset_manifests(out, recipe.version)
    assert "-rival/" in m.files[0].staged and commit_log_of(out, recipe.version).head() == 1
    [(topic,)] = _sql(f"select distinct source_topic from read_parquet('{out}/dead_letters/**/*.parquet')")
    assert topic == "rival"
