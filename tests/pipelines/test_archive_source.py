"""ReadArchiveEpisodes reads only committed files; local assembly equals the shuffle."""

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to

from pipelines.archive_source import ReadArchiveEpisodes, list_archive_files
from tests.pipelines.helpers import episodes, flat, make_pipeline, write_archive


def test_reads_committed_files_only(tmp_path):
    eps = episodes(12, seed=2)
    root = write_archive(tmp_path / "arch", [flat(eps[:6]), flat(eps[6:])])
    (root / "bucket=00" / "c00000003.parquet.tmp").write_bytes(b"not parquet: an unfinished commit")
    files = list_archive_files(root)
    assert {f.commit for f in files} == {1, 2} and all(f.path.endswith(".parquet") for f in files)
    assert {f.commit for f in list_archive_files(root, skip_commits=[1])} == {2}
    with make_pipeline() as p:
        out = p | ReadArchiveEpisodes(root)
        assert_that(out.episodes | beam.Map(lambda e: (e.episode_id, e.num_events)),
                    equal_to([(ep[0].episode_id, len(ep)) for ep in eps]))


def test_fragments_equal_the_written_events(tmp_path):
    from pipelines.archive_source import read_archive_file

    eps = episodes(5, seed=4)
    root = write_archive(tmp_path / "arch", [flat(eps)], buckets=1)
    frags, dead, rows = read_archive_file(list_archive_files(root)[0].path)
    assert dead == [] and rows == len(flat(eps))
    assert sorted(frags, key=lambda f: f[0]) == [(ep[0].episode_id, ep) for ep in eps]


def test_split_episodes_are_those_in_several_files(tmp_path):
    from pipelines.archive_source import split_episode_ids

    eps = episodes(6, seed=5)
    # eps[0] starts in commit 1 and finishes in commit 2; all of eps[1] is re-delivered in commit 2
    root = write_archive(tmp_path / "arch", [flat(eps[:3]) + eps[3][:2], eps[3][2:] + flat(eps[4:]) + eps[1]],
                         buckets=1)
    files = list_archive_files(root)
    assert split_episode_ids(files) == {eps[1][0].episode_id, eps[3][0].episode_id}
    assert split_episode_ids(files, also=["p"]) == {eps[1][0].episode_id, eps[3][0].episode_id, "p"}


def test_local_assembly_equals_the_shuffle(tmp_path):
    """Episodes assembled where the file is read are the ones the GroupByKey path builds."""
    from pipelines.archive_source import split_episode_ids
    from pipelines.frames import CLOCK_TAG, UNDECIDED_TAG, AssembleEpisodesFromFrames

    eps = episodes(10, seed=6)
    root = write_archive(tmp_path / "arch", [flat(eps[:6]) + eps[6][:3], eps[6][3:] + flat(eps[7:]) + eps[0][:2]])
    files = list_archive_files(root)
    every = {ep[0].episode_id for ep in eps}

    def run(split):
        with make_pipeline() as p:
            read = p | ReadArchiveEpisodes(root, files=files, split=split)
            out = {"frames": read.frames, "clock": read[CLOCK_TAG], "undecided": read[UNDECIDED_TAG]} | \
                AssembleEpisodesFromFrames(incomplete_after_s=1e9)
            summary = lambda e: (e.episode_id, [s.step_index for s in e.steps], e.num_events)  # noqa: E731
            assert_that((out["episodes"], read.episodes) | beam.Flatten() | beam.Map(summary),
                        equal_to([(ep[0].episode_id, [e.step_index for e in ep if e.event_type == "step"], len(ep))
                                  for ep in eps]))

    run(split_episode_ids(files))  # eps[0] (re-delivered) and eps[6] (spans commits) go through the shuffle
    run(every)  # everything through the shuffle
    assert split_episode_ids(files) == {eps[0][0].episode_id, eps[6][0].episode_id}


def test_fast_conversion_equals_the_checked_one(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    import pipelines.archive_source as source

    eps = episodes(20, seed=8)
    root = write_archive(tmp_path / "arch", [flat(eps)], buckets=1)
    table = pq.read_table(list_archive_files(root)[0].path)
    fast, _ = source.table_to_fragments(table)
    monkeypatch.setattr(source, "_typed_as_archive", lambda schema: False)
    checked, _ = source.table_to_fragments(table)
    assert fast == checked and sorted(fast, key=lambda f: f[0]) == [(ep[0].episode_id, ep) for ep in eps]


def test_an_archive_written_by_schema_v1_still_builds_datasets(tmp_path):
    """Files of the first event model (no group, lineage, context-cut or termination fields) still read."""
    import shutil
    from pathlib import Path

    import duckdb
    import pyarrow.parquet as pq

    from pipelines.recipes import load_recipe
    from pipelines.trajectory_job import run_batch
    from schemas.arrow import table_to_events

    archive = tmp_path / "archive"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "archive-schema-v1", archive)
    events = [e for f in sorted(archive.glob("bucket=*/*.parquet")) for e in table_to_events(pq.read_table(f))]
    assert len(events) == 90 and {e.schema_version for e in events} == {1}
    assert {e.group_size for e in events if e.event_type == "episode_started"} == {0}  # defaults fill the gaps
    counts = run_batch(out=tmp_path / "data", recipe=load_recipe("outcome"), source="archive", archive=archive)
    assert counts["episodes"] == 8 and counts["dead_letters"] == 0 and counts["events_used"] == 90
    rows = duckdb.sql(f"""select termination, trainable, group_size, policy_lineage, count(*)
                          from read_parquet('{tmp_path}/data/trajectories/**/*.parquet', hive_partitioning=true)
                          group by all""").fetchall()
    assert rows == [("done", True, 0, "", 8)]  # termination derived from the status of v1 events
