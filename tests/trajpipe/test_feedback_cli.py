"""`trajpipe feedback` given wrong input: one `error:` line naming the flag, exit 2, before any broker is needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.pipelines.helpers import episodes, write_archive
from trajpipe.cli import app

REPO = Path(__file__).resolve().parents[2]
NO_BROKER = ["--bootstrap", "127.0.0.1:1"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    eps = episodes(2, seed=1)
    root = write_archive(tmp_path_factory.mktemp("fb-cli") / "archive", [[e for ep in eps for e in ep]])
    return root, eps[0][0].episode_id


CASES = {
    "no look-up and no envelope": (["--episode", "e1", "--score", "1"], "`--data DIR`"),
    "--domain without --task-id": (["--episode", "e1", "--score", "1", "--domain", "math"], "`--domain` needs"),
    "--data does not exist": (["--episode", "e1", "--score", "1", "--data", "{missing}"], "`--data`"),
    "episode unknown": (["--episode", "nope", "--score", "1", "--archive", "{archive}"], "is in neither"),
    "neither score nor correction": (["--episode", "{episode}", "--archive", "{archive}"], "`--score S`"),
    "correction without step": (["--episode", "{episode}", "--archive", "{archive}", "--correction", "x"],
                                "`--step K`"),
    "step beyond the episode": (["--episode", "{episode}", "--archive", "{archive}", "--step", "99",
                                 "--score", "1"], "`--step` 99"),
    "score not finite": (["--episode", "{episode}", "--archive", "{archive}", "--score", "nan"], "finite"),
    "score not a number": (["--episode", "{episode}", "--archive", "{archive}", "--score", "high"], "--score"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_feedback_errors(case, archive, tmp_path, monkeypatch):
    monkeypatch.delenv("TRAJPIPE_DEBUG", raising=False)
    monkeypatch.delenv("TRAJPIPE_CONFIG", raising=False)
    root, episode = archive
    args, needle = CASES[case]
    args = [a.format(archive=root, episode=episode, missing=tmp_path / "missing") for a in args]
    res = CliRunner().invoke(app, ["feedback", *args, *NO_BROKER])
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert needle in lines[0], lines[0]
    assert res.stdout == ""


def test_feedback_from_the_console_script_is_one_line(archive):
    root, _ = archive
    proc = subprocess.run([sys.executable, "-m", "trajpipe", "feedback", "--episode", "nope", "--score", "1",
                           "--archive", str(root), *NO_BROKER], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: episode 'nope' is in neither - (--data) nor {root} (--archive); check the id, or give "
        "`--domain`, `--task-id` and `--policy-version`"], proc.stderr
