"""ReadArchive reads only committed files, as per-episode fragments."""

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to

from pipelines.archive_source import ReadArchive, list_archive_files
from tests.pipelines.helpers import episodes, flat, make_pipeline, write_archive


def test_reads_committed_files_only(tmp_path):
    eps = episodes(12, seed=2)
    root = write_archive(tmp_path / "arch", [flat(eps[:6]), flat(eps[6:])])
    (root / "bucket=00" / "c00000003.parquet.tmp").write_bytes(b"not parquet: an unfinished commit")
    files = list_archive_files(root)
    assert {f.commit for f in files} == {1, 2} and all(f.path.endswith(".parquet") for f in files)
    assert {f.commit for f in list_archive_files(root, skip_commits=[1])} == {2}
    with make_pipeline() as p:
        out = p | ReadArchive(root)
        assert_that(out.fragments | beam.Map(lambda f: (f[0], [e.seq for e in f[1]])),
                    equal_to([(ep[0].episode_id, [e.seq for e in ep]) for ep in eps]))


def test_fragments_equal_the_written_events(tmp_path):
    from pipelines.archive_source import read_archive_file

    eps = episodes(5, seed=4)
    root = write_archive(tmp_path / "arch", [flat(eps)], buckets=1)
    frags, dead, rows = read_archive_file(list_archive_files(root)[0].path)
    assert dead == [] and rows == len(flat(eps))
    assert sorted(frags, key=lambda f: f[0]) == [(ep[0].episode_id, ep) for ep in eps]
