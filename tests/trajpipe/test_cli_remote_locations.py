"""Every flag that names a dataset, archive or output location whose reader or writer is still local-only
refuses an object-store URI, before any work (the dataset readers of `query`, `report` and `train --data`
take ``s3://`` and refuse other schemes).

Until the sinks and readers move onto the storage layer (issue 14), pathlib turned ``gs://bucket/x``
into the local directory ``gs:/bucket/x``: on a remote worker the files stayed there while the
manifest claimed the Kafka offsets. Each such flag now ends the command with one ``error:`` line
naming the flag and exit status 2, with nothing read from Kafka and nothing written.
``pipeline run --out`` writes ``s3://`` in both modes (tests/storage/test_pipeline_s3.py,
tests/storage/test_stream_s3.py), the archiver and its readers (``archive --out``, batch ``pipeline run
--archive``, ``query --archive``) take it (tests/storage/test_archive_s3.py), so does ``train --out``
(tests/storage/test_trainer_s3.py), so do ``query --runs`` and ``query|report --out``
(tests/storage/test_trainer_s3.py), and no command takes ``gs://``
(the storage layer's scheme check).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trajpipe.cli import app

ROOT = Path(__file__).resolve().parents[2]
NO_BROKER = ["--bootstrap", "127.0.0.1:1"]


def _trajpipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# (command line with {dir}: an existing local directory, {uri}: the remote location, the flag the line must name)
CASES = {
    "archive --out": (["archive", *NO_BROKER, "--out", "{uri}"], "--out"),
    "pipeline run --archive": (["pipeline", "run", "--source", "archive", "--archive", "{uri}", "--out", "{dir}/d"],
                               "--archive"),
    "train --data": (["train", "--data", "{uri}", "--model", "{dir}", "--out", "{dir}/run"], "--data"),
    "train --out": (["train", "--data", "{dir}", "--model", "{dir}", "--out", "{uri}"], "--out"),
    "train data.dir in --config": (["train", "--config", "{dir}/train.yaml"], "--data (data.dir)"),
    "query --data": (["query", "select 1", "--data", "{uri}"], "--data"),
    "query --archive": (["query", "select 1", "--archive", "{uri}"], "--archive"),
    "query --runs": (["query", "select 1", "--data", "{dir}", "--runs", "{uri}"], "--runs"),
    "query --out": (["query", "select 1", "--data", "{dir}", "--format", "parquet", "--out", "{uri}"], "--out"),
    "catalog --db": (["catalog", "--data", "{dir}", "--db", "{uri}"], "--db"),
    "report --data": (["report", "pass_rate", "--data", "{uri}"], "--data"),
    "report html --out": (["report", "html", "--data", "{dir}", "--out", "{uri}"], "--out"),
    "feedback --data": (["feedback", "--episode", "e1", "--score", "1", "--data", "{uri}", *NO_BROKER], "--data"),
    "feedback --archive": (["feedback", "--episode", "e1", "--score", "1", "--archive", "{uri}", *NO_BROKER],
                           "--archive"),
    "audit logprobs --data": (["audit", "logprobs", "--data", "{uri}", "--model", "{dir}"], "--data"),
    "model init-tiny --out": (["model", "init-tiny", "--out", "{uri}"], "--out"),
    "loop run_dir in --config": (["loop", "--config", "{dir}/loop.yaml"], "run_dir"),
}


#: Flags whose readers (or writers) take ``s3://`` (tests/storage/test_readers_s3.py, test_trainer_s3.py): refused
#: for another scheme.
GS_ONLY = ("train --data", "train data.dir in --config", "train --out", "query --data", "report --data", "loop run_dir in --config",
           # and the archive's writer and readers (tests/storage/test_archive_s3.py)
           "archive --out", "pipeline run --archive", "query --archive", "feedback --archive", "feedback --data",
           # and the analyst's outputs and run directories (tests/storage/test_trainer_s3.py)
           "query --runs", "query --out", "report html --out")
#: Run as real processes (the console script's path); the rest in-process through the same error handling.
SUBPROCESS = ("archive --out", "train data.dir in --config")


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    work, local = tmp_path / "cwd", tmp_path / "local"
    work.mkdir()
    local.mkdir()
    return work, local


@pytest.mark.parametrize("case", CASES)
def test_a_remote_location_is_refused_with_one_line_naming_the_flag(case, tmp_path, monkeypatch):
    args, flag = CASES[case]
    work, local = _dirs(tmp_path)
    uri = "gs://bucket/datasets" if case in GS_ONLY else "s3://bucket/datasets"
    (local / "train.yaml").write_text(f"model: {local}\ndata: {{dir: {uri}}}\nout: {local}/run\n")
    (local / "loop.yaml").write_text(f"run_dir: {uri}\nmodel: {local}\nbudget: {{seconds: 10}}\n")
    argv = [a.format(dir=local, uri=uri) for a in args]
    if case in SUBPROCESS:
        proc = _trajpipe(argv, cwd=work)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        for name in [k for k in os.environ if k.startswith("TRAJPIPE_")]:
            monkeypatch.delenv(name)
        monkeypatch.chdir(work)
        res = CliRunner().invoke(app, argv)
        code, stdout, stderr = res.exit_code, res.stdout, res.stderr

    assert code == 2, stderr
    lines = _error_lines(stderr)
    assert len(lines) == 1, stderr
    assert flag in lines[0] and uri in lines[0] and "remote storage is not yet supported" in lines[0], lines
    assert "Traceback" not in stderr and stdout == ""
    # nothing was written: no `s3:` / `gs:` directory (what pathlib made of the URI), no manifest
    assert list(work.iterdir()) == [] and sorted(p.name for p in local.iterdir()) == ["loop.yaml", "train.yaml"]


def test_a_file_uri_is_a_local_path(tmp_path):
    """``file:///PATH`` is not refused: it is the local path PATH (named so in the next check)."""
    archive = tmp_path / "archive"
    res = CliRunner().invoke(app, ["query", "select 1", "--archive", f"file://{archive}"])
    assert res.exit_code == 2 and _error_lines(res.stderr)[0].startswith(f"error: `--archive` {archive} "), res.stderr


@pytest.mark.integration
def test_pipeline_and_archiver_refuse_before_reading_a_live_broker(kafka_broker, topic_name, tmp_path):
    """With a reachable broker holding events, the refusal still comes first: no read, no manifest, no files."""
    from tests.helpers import produce_messages

    produce_messages(kafka_broker.bootstrap, topic_name, [(b"k", b"not an event")] * 3)
    for args in (["pipeline", "run", "--source", "kafka", "--topic", topic_name, "--out", "gs://bucket/data"],
                 ["archive", "--until-end", "--out", "gs://bucket/archive"]):
        proc = _trajpipe([*args, "--bootstrap", kafka_broker.bootstrap], cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert len(_error_lines(proc.stderr)) == 1 and "gs://bucket/" in proc.stderr, proc.stderr
        assert proc.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_pipeline_run_refuses_an_unsupported_scheme_with_one_line(mode, tmp_path):
    """The job writes s3:// (both modes) but no other object store: `gs://` is one line naming the flag and the
    scheme."""
    proc = _trajpipe(["pipeline", "run", "--source", "kafka", *NO_BROKER, "--mode", mode,
                      "--out", "gs://bucket/datasets"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "`--out`" in lines[0] and "scheme gs:// is not supported" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and list(tmp_path.iterdir()) == []
