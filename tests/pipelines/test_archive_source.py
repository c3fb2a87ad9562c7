"""ReadArchiveEpisodes reads only committed files; local assembly equals the shuffle."""

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to

from pipelines.archive_source import ReadArchiveEpisodes, list_archive_files
from pipelines.inputs import ArchiveInput
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
    counts = run_batch(out=tmp_path / "data", recipe=load_recipe("outcome"), input=ArchiveInput(archive))
    assert counts["episodes"] == 8 and counts["dead_letters"] == 0 and counts["events_used"] == 90
    rows = duckdb.sql(f"""select termination, trainable, group_size, policy_lineage, count(*)
                          from read_parquet('{tmp_path}/data/trajectories/**/*.parquet', hive_partitioning=true)
                          group by all""").fetchall()
    assert rows == [("done", True, 0, "", 8)]  # termination derived from the status of v1 events


# Found by the fuzzer (tests/streams/test_archive_fuzz.py): files a crash, a foreign writer or bit rot can leave
# made the archive source raise KeyError/AttributeError/ValueError (a crashed job) or drop rows silently.


def _table_of(evs):
    from schemas.arrow import events_to_table

    return events_to_table(evs, [(0, i) for i in range(len(evs))])


def test_rows_of_unknown_types_or_without_their_struct_column_are_dead_letters_not_dropped():
    import pyarrow as pa

    from pipelines.archive_source import table_to_fragments
    from streams.synth import generate_episodes

    evs = next(generate_episodes(1, seed=2))  # episode_started, steps..., episode_finished
    table = _table_of(evs)
    types = table.column("event_type").to_pylist()
    types[0] = None  # a null type
    types[-1] = "episode_ended"  # a type this trajpipe does not know
    table = table.set_column(table.column_names.index("event_type"), "event_type", pa.array(types, pa.string()))
    table = table.drop_columns(["step_verified"])  # the verdict rows lose their payload
    frags, dead = table_to_fragments(table, topic="t")
    n_verdicts = sum(ev.event_type == "step_verified" for ev in evs)
    kept = [ev for _, e in frags for ev in e]
    # every row accounted for: 1 null type + 1 unknown type + the verdicts without a struct column are dead letters
    assert len(kept) + len(dead) == len(evs) and len(dead) == 2 + n_verdicts
    assert sorted({d.reason for d in dead}) == ["invalid_event", "unknown_type"]
    assert {d.source_offset for d in dead if d.reason == "unknown_type"} == {0, len(evs) - 1}
    assert all(d.key == evs[0].episode_id.encode() for d in dead)


def test_values_of_the_wrong_kind_become_dead_letters():
    import pyarrow as pa

    from pipelines.archive_source import table_to_fragments
    from streams.synth import generate_episodes

    evs = next(generate_episodes(1, seed=2))
    table = _table_of(evs)
    finished = table.column("episode_finished").combine_chunks()
    i = finished.type.get_field_index("status")
    children = [finished.field(j) for j in range(finished.type.num_fields)]
    children[i] = pa.array(["" if v is not None else None for v in children[i].to_pylist()], pa.string())
    table = table.set_column(table.column_names.index("episode_finished"), "episode_finished",
                             pa.StructArray.from_arrays(children, fields=list(finished.type),
                                                        mask=finished.is_null()))
    times = table.column("event_time").to_pylist()
    times[1] = None  # a null time used to crash the timestamp conversion
    table = table.set_column(table.column_names.index("event_time"), "event_time",
                             pa.array(times, table.schema.field("event_time").type))
    episode_ids = pa.array(range(len(evs)), pa.int64())  # an integer episode id
    table = table.set_column(table.column_names.index("episode_id"), "episode_id", episode_ids)
    frags, dead = table_to_fragments(table, topic="t")
    assert frags == [] and len(dead) == len(evs)  # no row has a string episode id
    assert {d.key for d in dead} == {b""}


def test_damaged_or_foreign_archive_files_are_an_archive_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from pipelines.archive_source import ArchiveFile, read_archive_file, split_episode_ids
    from streams.archive import ArchiveError

    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"event_type": ["step"], "episode_id": ["e"]}), damaged)
    damaged.write_bytes(damaged.read_bytes()[:-12])  # cut short: the footer is gone
    with pytest.raises(ArchiveError, match="is damaged"):
        read_archive_file(damaged)
    with pytest.raises(ArchiveError, match="is damaged"):
        split_episode_ids([ArchiveFile(path=str(damaged), commit=1, topic="t")])
    foreign = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(ArchiveError, match="no string `event_type` column"):
        read_archive_file(foreign)
    with pytest.raises(ArchiveError, match="has no `episode_id` column"):  # the driver's scan reads only that one
        split_episode_ids([ArchiveFile(path=str(foreign), commit=1, topic="t")])


def test_a_row_its_event_type_refuses_is_a_dead_letter_on_the_fast_path_too():
    """The typed fast path builds a type's events in one pass; a row whose event refuses its values (here a
    negative context cut, raised by ``Step.__post_init__``) or fails validation (a step index past its seq)
    is a dead letter with its position, and every other row is the event it was."""
    import pyarrow as pa

    import pipelines.archive_source as source
    from streams.synth import generate_episodes

    evs = next(generate_episodes(1, seed=3))
    table = _table_of(evs)
    assert source._typed_as_archive(table.schema)
    steps = [i for i, ev in enumerate(evs) if ev.event_type == "step"]
    bad_init, bad_seq = steps[0], steps[1]
    step = table.column("step").combine_chunks()
    children = {f.name: step.field(j) for j, f in enumerate(step.type)}
    cuts = children["context_cut_start"].to_pylist()
    cuts[bad_init] = -1
    index = children["step_index"].to_pylist()
    index[bad_seq] = evs[bad_seq].seq + 5
    children["context_cut_start"] = pa.array(cuts, step.type.field("context_cut_start").type)
    children["step_index"] = pa.array(index, step.type.field("step_index").type)
    table = table.set_column(table.column_names.index("step"), "step", pa.StructArray.from_arrays(
        list(children.values()), fields=list(step.type), mask=step.is_null()))
    frags, dead = source.table_to_fragments(table, topic="t")
    assert sorted((d.source_offset, d.reason) for d in dead) == [(bad_init, "invalid_event"),
                                                                  (bad_seq, "invalid_event")]
    assert "context_cut_start" in next(d.message for d in dead if d.source_offset == bad_init)
    kept = [ev for _, e in frags for ev in e]
    assert kept == [ev for i, ev in enumerate(evs) if i not in (bad_init, bad_seq)]


def test_event_times_are_the_utc_datetimes_of_the_column():
    """``_times`` (msgspec-built datetimes) gives what epoch + timedelta gives: around and before 1970, at the
    first and last microsecond ``datetime`` can hold, always ``timezone.utc``; past them the same error."""
    from datetime import datetime, timedelta, timezone

    import pyarrow as pa
    import pytest

    from pipelines.archive_source import _times

    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
    micros = [0, 1, -1, 999_999, -999_999, -1_000_000, -1_000_001, 1_764_936_000_123_456,
              -62_135_596_800_000_000, 253_402_300_799_999_999]
    got = _times(pa.chunked_array([pa.array(micros[:4], pa.timestamp("us", tz="UTC")),
                                   pa.array(micros[4:], pa.timestamp("us", tz="UTC"))]))
    assert got == [epoch + timedelta(microseconds=u) for u in micros]
    assert all(t.tzinfo is timezone.utc for t in got)
    millis = pa.chunked_array([pa.array([1_764_936_000_123], pa.timestamp("ms", tz="UTC"))])
    assert _times(millis) == [epoch + timedelta(milliseconds=1_764_936_000_123)]
    assert _times(pa.chunked_array([pa.array([], pa.timestamp("us", tz="UTC"))])) == []
    with pytest.raises(OverflowError):
        _times(pa.chunked_array([pa.array([0, 253_402_300_800_000_000], pa.timestamp("us", tz="UTC"))]))


def test_a_null_in_a_column_is_the_default_of_its_field_or_a_dead_letter_where_it_has_none():
    """The typed fast path trusts Arrow's null counts: a null in an envelope column (``producer_id``) or in a
    payload field (``Step.observation``) sends the type's rows through the per-row check, where a null is
    the field's default ("" for the observation) and a row whose field has none is a dead letter."""
    import msgspec
    import pyarrow as pa

    import pipelines.archive_source as source
    from streams.synth import generate_episodes

    evs = next(generate_episodes(1, seed=4))
    table = _table_of(evs)
    steps = [i for i, ev in enumerate(evs) if ev.event_type == "step"]
    assert evs[steps[0]].observation
    producers = table.column("producer_id").to_pylist()
    producers[0] = None  # the episode_started row: producer_id has no default
    table = table.set_column(table.column_names.index("producer_id"), "producer_id",
                             pa.array(producers, table.schema.field("producer_id").type))
    step = table.column("step").combine_chunks()
    children = {f.name: step.field(j) for j, f in enumerate(step.type)}
    observations = children["observation"].to_pylist()
    observations[steps[0]] = None
    children["observation"] = pa.array(observations, step.type.field("observation").type)
    table = table.set_column(table.column_names.index("step"), "step", pa.StructArray.from_arrays(
        list(children.values()), fields=list(step.type), mask=step.is_null()))
    frags, dead = source.table_to_fragments(table, topic="t")
    assert [(d.source_offset, d.reason) for d in dead] == [(0, "invalid_event")]
    assert "producer_id" in dead[0].message
    want = list(evs[1:])
    want[steps[0] - 1] = msgspec.structs.replace(evs[steps[0]], observation="")
    assert [ev for _, e in frags for ev in e] == want
