"""Fuzz target ``fuzz_archive``: the event archive's readers (manifests, metadata, Parquet data files).

Inputs are mutations of a real archive written by :func:`streams.archive.write_commit`: commit manifests (as
records of the archive's commit log, and as the manifest files of the earlier layout, ``_commits/<n>.json``) and
``_archive.json`` with bytes flipped, cut, or fields replaced by other JSON values; data files with bytes flipped,
cut or spliced; and archive tables whose columns are dropped, nulled, retyped or filled with other values, so
the row converter of the Beam source (:func:`pipelines.archive_source.read_archive_file`) sees every kind of
file a crash, a foreign writer or an older trajpipe could leave. Property: every input is read (each row becomes
an event or a dead letter, none lost) or rejected with :class:`streams.archive.ArchiveError`; files named by a
manifest stay inside the archive; no allocation far beyond the input.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pipelines.archive_source import ArchiveFile, list_archive_files, read_archive_file, split_episode_ids
from schemas.deadletter import DeadLetter
from schemas.events import Event
from streams.archive import ArchiveError, PartitionRange, _init_archive, commit_log, read_commits, write_commit
from streams.synth import generate_episodes
from tests import fuzzing

pytestmark = pytest.mark.fuzz

_MEMORY_LIMIT = 64 << 20  # the archive files here are a few KB


@functools.cache
def _template() -> dict:
    """A real one-commit archive: its root, manifest and metadata bytes, one data file's bytes and table.

    Built once per session (not a fixture, so a failing example's report does not print it).
    """
    root = Path(tempfile.mkdtemp(prefix="archive-template-"))
    atexit.register(shutil.rmtree, root, True)
    events = [ev for episode in generate_episodes(6, seed=5, group_size=2) for ev in episode]
    _init_archive(root, topic="trajpipe.events", buckets=2)
    manifest = write_commit(root, commit=1, topic="trajpipe.events", buckets=2, events=events,
                            positions=[(0, i) for i in range(len(events))], offsets={0: PartitionRange(0, len(events))})
    data = (root / manifest.files[0]).read_bytes()
    return {"root": root, "manifest": commit_log(root).snapshot().records()[0],
            "meta": (root / "_archive.json").read_bytes(), "data": data, "files": manifest.files,
            "table": pq.read_table(io.BytesIO(data))}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("archive-fuzz")


def _fresh_copy(scratch: Path) -> Path:
    root = scratch / uuid.uuid4().hex
    shutil.copytree(_template()["root"], root)
    return root


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=30), st.sampled_from(["../../etc/passwd", "/etc/passwd", "bucket=00/../../x.parquet",
                                                     "bucket=00/c00000001.parquet", "", "2026-01-01T00:00:00Z"])),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _mutate_bytes(draw, buf: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "random"]))
    if kind == "flip":
        return fuzzing.flip_bits(draw, buf, max_flips=6)
    if kind == "truncate":
        return buf[: draw(st.integers(0, len(buf) - 1))]
    if kind == "insert":
        at = draw(st.integers(0, len(buf)))
        return buf[:at] + draw(st.binary(min_size=1, max_size=16)) + buf[at:]
    return draw(st.binary(max_size=200))


def _mutate_json(draw, buf: bytes) -> bytes:
    if draw(st.booleans()):
        return _mutate_bytes(draw, buf)
    doc = json.loads(buf)
    path = [draw(st.sampled_from(sorted(doc)))]
    if isinstance(doc[path[0]], (dict, list)) and doc[path[0]] and draw(st.booleans()):
        inner = doc[path[0]]
        path.append(draw(st.sampled_from(sorted(inner) if isinstance(inner, dict) else range(len(inner)))))
    target = doc
    for key in path[:-1]:
        target = target[key]
    if draw(st.booleans()):
        target[path[-1]] = draw(json_values)
    elif isinstance(target, dict):
        del target[path[-1]]
    return json.dumps(doc).encode()


def _check_listing(root: Path) -> None:
    try:
        files = list_archive_files(root)
    except ArchiveError:
        return
    for f in files:  # a manifest may only name data files of this archive
        assert Path(f.path).resolve().is_relative_to(root.resolve()), f.path


@given(data=st.data())
def test_manifests_and_metadata_are_read_or_rejected_with_archive_error(data, scratch):
    fuzzing.tried("fuzz_archive")
    root = _fresh_copy(scratch)
    template = _template()
    target = data.draw(st.sampled_from(["manifest", "meta", "second_manifest"]))
    legacy = data.draw(st.booleans())  # the manifests as files of the earlier layout, not in the commit log
    records = [template["manifest"]]
    if target == "manifest":
        records = [_mutate_json(data.draw, template["manifest"])]
    elif target == "second_manifest":  # a second commit whose manifest is damaged (or names other files)
        records.append(_mutate_json(data.draw, template["manifest"]))
    else:
        (root / "_archive.json").write_bytes(_mutate_json(data.draw, template["meta"]))
    shutil.rmtree(root / "_commit_log")
    if legacy:
        (root / "_commits").mkdir()
        names = ["00000001.json", data.draw(st.sampled_from(["00000002.json", "00000003.json", "x.json"]))]
        for name, record in zip(names, records):
            (root / "_commits" / name).write_bytes(record)
    else:
        snapshot = commit_log(root).snapshot()
        for record in records:  # the log holds text: bytes that are no UTF-8 cannot get into it
            snapshot.commit(record.decode("utf-8", "replace").encode())
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        try:
            commits = read_commits(root)
        except ArchiveError:
            commits = None
        if commits is not None:
            assert [c.commit for c in commits] == list(range(1, len(commits) + 1))
        _check_listing(root)
        try:  # what the archiver does with an existing archive directory
            meta = _init_archive(root, topic="trajpipe.events", buckets=16)
        except ArchiveError:
            pass
        else:
            assert isinstance(meta["buckets"], int) and meta["buckets"] >= 1
    shutil.rmtree(root)


def _check_read(path: Path, rows_expected: int | None) -> None:
    try:
        frags, dead, rows = read_archive_file(path, topic="trajpipe.events")
    except ArchiveError:
        return
    events = [ev for _, evs in frags for ev in evs]
    assert all(isinstance(ev, Event) for ev in events) and all(isinstance(d, DeadLetter) for d in dead)
    assert all(ev.episode_id == ep for ep, evs in frags for ev in evs)
    assert len(events) + len(dead) == rows  # every row is an event or a dead letter
    if rows_expected is not None:
        assert rows == rows_expected
    try:
        split_episode_ids([ArchiveFile(path=str(path), commit=1, topic="trajpipe.events")])
    except ArchiveError:
        pass


@given(data=st.data())
def test_damaged_data_files_are_read_or_rejected_with_archive_error(data, scratch):
    fuzzing.tried("fuzz_archive")
    buf = _template()["data"]
    kind = data.draw(st.sampled_from(["bytes", "splice", "footer"]))
    if kind == "bytes":
        buf = _mutate_bytes(data.draw, buf)
    elif kind == "splice":  # the head of one file with the tail (footer) of another
        other = pq.read_table(io.BytesIO(buf)).slice(0, data.draw(st.integers(1, 10)))
        sink = io.BytesIO()
        pq.write_table(other, sink)
        tail = sink.getvalue()
        buf = buf[: data.draw(st.integers(0, len(buf)))] + tail[data.draw(st.integers(0, len(tail))):]
    else:  # the footer: metadata length and the Thrift metadata itself
        at = len(buf) - data.draw(st.integers(5, min(len(buf), 400)))
        out = bytearray(buf)
        out[at] ^= 1 << data.draw(st.integers(0, 7))
        if data.draw(st.booleans()):  # the 4-byte metadata length before the trailing magic claims more
            out[-8:-4] = data.draw(st.sampled_from([b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff", b"\x00\x00\x10\x00"]))
        buf = bytes(out)
    path = scratch / f"{uuid.uuid4().hex}.parquet"
    path.write_bytes(buf)
    arrow = fuzzing.check_arrow_memory(_MEMORY_LIMIT)
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        _check_read(path, None)
    arrow.check()
    path.unlink()


def _column_mutation(draw, table: pa.Table) -> pa.Table:
    name = draw(st.sampled_from(table.column_names))
    col = table.column(name)
    kind = draw(st.sampled_from(["drop", "nulls", "retype", "values", "struct_child", "rows"]))
    if kind == "drop":
        return table.drop_columns([name])
    if kind == "nulls":
        mask = pa.array(draw(st.lists(st.booleans(), min_size=table.num_rows, max_size=table.num_rows)))
        return table.set_column(table.column_names.index(name), name,
                                pa.compute.if_else(mask, pa.nulls(table.num_rows, col.type), col))
    if kind == "retype":  # the column holds strings (or integers) instead
        new = pa.array([None if v is None else str(v) for v in col.to_pylist()], pa.string()) if draw(
            st.booleans()) else pa.array(range(table.num_rows), pa.int64())
        return table.set_column(table.column_names.index(name), name, new)
    if kind == "values" and pa.types.is_string(col.type):
        values = draw(st.lists(st.one_of(st.none(), st.text(max_size=12), st.sampled_from(
            ["step", "episode_finished", "policy_published", "feedback", "success", ""])),
            min_size=table.num_rows, max_size=table.num_rows))
        return table.set_column(table.column_names.index(name), name, pa.array(values, pa.string()))
    if kind == "values" and pa.types.is_integer(col.type):
        values = draw(st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                               min_size=table.num_rows, max_size=table.num_rows))
        return table.set_column(table.column_names.index(name), name, pa.array(values, pa.int64()))
    if kind == "struct_child" and pa.types.is_struct(col.type) and col.type.num_fields:
        struct = col.combine_chunks()
        i = draw(st.integers(0, col.type.num_fields - 1))
        children = [struct.field(j) for j in range(col.type.num_fields)]
        names = [col.type.field(j).name for j in range(col.type.num_fields)]
        if draw(st.booleans()):
            del children[i], names[i]
        else:
            children[i] = pa.nulls(len(struct), pa.string()) if draw(st.booleans()) else pa.array(
                [None if v is None else str(v)[:5] for v in children[i].to_pylist()], pa.string())
        if not children:
            return table.drop_columns([name])
        new = pa.StructArray.from_arrays(children, names=names, mask=struct.is_null())
        return table.set_column(table.column_names.index(name), name, new)
    if kind == "rows" and table.num_rows:
        idx = draw(st.lists(st.integers(0, table.num_rows - 1), max_size=table.num_rows * 2))
        return table.take(pa.array(idx, pa.int64()))
    return table


@given(data=st.data())
def test_archive_tables_of_any_shape_give_events_or_dead_letters(data, scratch):
    fuzzing.tried("fuzz_archive")
    table = _template()["table"]
    for _ in range(data.draw(st.integers(1, 3))):
        if not table.column_names:
            break
        table = _column_mutation(data.draw, table)
    path = scratch / f"{uuid.uuid4().hex}.parquet"
    try:
        pq.write_table(table, path)
    except pa.ArrowInvalid:  # e.g. nulls in a child declared non-nullable: no writer makes such a file
        assume(False)
    arrow = fuzzing.check_arrow_memory(_MEMORY_LIMIT)
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        _check_read(path, table.num_rows)
    arrow.check()
    path.unlink()


