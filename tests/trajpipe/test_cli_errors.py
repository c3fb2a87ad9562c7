"""Every `trajpipe` command, given a wrong flag value, path or config file: one `error:` line, exit 2.

No case needs a broker, a model or a GPU: every check runs before a command connects or loads anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import trajpipe.cli as cli
from trajpipe.cli import app

NO_BROKER = ["--bootstrap", "127.0.0.1:1"]


@pytest.fixture()
def paths(tmp_path: Path) -> dict[str, Path]:
    """A file where a directory is expected, an empty directory, and bad config files."""
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.yaml").write_text("kafka: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- model: m\n")
    (tmp_path / "partitions.yaml").write_text("topics:\n  partitions: many\n")
    return {k: tmp_path / v for k, v in {"file": "a-file", "empty": "empty", "broken": "broken.yaml",
                                         "list": "list.yaml", "partitions": "partitions.yaml",
                                         "missing": "missing"}.items()}


# (command line, text the one error line must hold: the flag or setting it names)
CASES = {
    "broker start: --data-dir is a file": (["broker", "start", "--data-dir", "{file}"], "`--data-dir`"),
    "broker stop: --data-dir is a file": (["broker", "stop", "--data-dir", "{file}"], "`--data-dir`"),
    "broker status: --config does not exist": (["broker", "status", "--config", "{missing}"], "--config"),
    "topics: --config is not YAML": (["topics", "--config", "{broken}", *NO_BROKER], "--config"),
    "topics: a config value of the wrong type": (["topics", "--config", "{partitions}", *NO_BROKER],
                                                 "`topics.partitions`"),
    "topics: --partitions not a number": (["topics", "--partitions", "many"], "'--partitions'"),
    "synth: --episodes < 0": (["synth", "--episodes", "-1", *NO_BROKER], "`--episodes`"),
    "synth: --spool-dir is a file": (["synth", "--spool-dir", "{file}", *NO_BROKER], "`--spool-dir`"),
    "archive: --out missing": (["archive", *NO_BROKER], "'--out'"),
    "archive: --commit-every 0": (["archive", "--out", "{empty}", "--commit-every", "0", *NO_BROKER],
                                  "`--commit-every`"),
    "pipeline run: --source unknown": (["pipeline", "run", "--source", "hdfs", "--out", "{empty}"], "--source"),
    "pipeline run: --archive not an archive": (["pipeline", "run", "--source", "archive", "--archive", "{empty}",
                                                "--out", "{missing}"], "`--archive`"),
    "query: --format unknown": (["query", "select 1", "--data", "{empty}", "--format", "xml"], "`--format`"),
    "query: --archive does not exist": (["query", "select 1", "--archive", "{missing}"], "`--archive`"),
    "query: --data holds no dataset": (["query", "select 1", "--data", "{empty}"], "holds no dataset"),
    "query: --as-of 0": (["query", "select 1", "--data", "{empty}", "--as-of", "0"], "`--as-of`"),
    "catalog: --db missing": (["catalog", "--data", "{empty}"], "'--db'"),
    "catalog: --db is a directory": (["catalog", "--data", "{empty}", "--db", "{empty}"], "`--db`"),
    "report: unknown report": (["report", "nope", "--data", "{empty}"], "reports: pass_rate"),
    "report html: no --out": (["report", "html", "--data", "{empty}"], "`--out report.html`"),
    "report: --runs does not exist": (["report", "pass_rate", "--data", "{empty}", "--runs", "{missing}"], "`--runs`"),
    "train: --model without config.json": (["train", "--model", "{empty}", "--data", "{empty}", "--out",
                                            "{missing}"], "`--model`"),
    "train: --config not a mapping": (["train", "--config", "{list}"], "`--config`"),
    "train: --objective unknown": (["train", "--objective", "dpo", "--model", "{empty}", "--data", "{empty}",
                                    "--out", "{missing}"], "`--objective`"),
    "model init-tiny: --out is a file": (["model", "init-tiny", "--out", "{file}"], "`--out`"),
    "rollout: --domains unknown": (["rollout", "--domains", "math,chess", *NO_BROKER], "`--domains`"),
    "rollout: --config is not YAML": (["rollout", "--config", "{broken}", *NO_BROKER], "--config"),
    "eval: --group without --follow": (["eval", "--policy-version", "latest", "--group", "g", *NO_BROKER],
                                       "`--group`"),
    "eval: --group empty": (["eval", "--policy-version", "latest", "--follow", "--group", " ", *NO_BROKER],
                            "`--group`"),
    "audit logprobs: --model does not exist": (["audit", "logprobs", "--data", "{empty}", "--model", "{missing}"],
                                               "`--model`"),
    "demo: --group-size 0": (["demo", "--group-size", "0", "--workdir", "{missing}"], "`--group-size`"),
    "demo: --workdir holds other files": (["demo", "--workdir", "{empty}/.."], "`--workdir`"),
}


def _invoke(args: list[str], paths: dict[str, Path]):
    argv = [a.format(**paths) for a in args]
    return CliRunner().invoke(app, argv)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("args,names", CASES.values(), ids=CASES.keys())
def test_a_wrong_input_is_one_error_line_naming_it_and_exit_2(args, names, paths, monkeypatch):
    monkeypatch.delenv("TRAJPIPE_DEBUG", raising=False)
    monkeypatch.delenv("TRAJPIPE_CONFIG", raising=False)
    res = _invoke(args, paths)
    assert res.exit_code == 2, res.output
    lines = _error_lines(res.stderr)
    assert len(lines) == 1 and names in lines[0], res.stderr
    assert "Traceback" not in res.output
    assert not (paths["missing"] / "broker").exists()  # nothing was started or written

    res = _invoke(["--debug", *args], paths)  # the same error, with the traceback first
    assert res.exit_code == 2
    assert "Traceback (most recent call last)" in res.stderr and _error_lines(res.stderr) == lines


def test_trajpipe_debug_env_also_prints_the_traceback(paths, monkeypatch):
    monkeypatch.setenv("TRAJPIPE_DEBUG", "1")
    res = _invoke(["synth", "--episodes", "-1", *NO_BROKER], paths)
    assert res.exit_code == 2 and "Traceback" in res.stderr
    assert _error_lines(res.stderr) == ["error: `--episodes` must be >= 0, got -1"]


def test_an_unexpected_exception_is_one_line_with_its_type_and_exit_1(paths, monkeypatch):
    monkeypatch.delenv("TRAJPIPE_DEBUG", raising=False)

    def broken_settings(*_args, **_kwargs):
        raise RuntimeError("settings store\nis down")

    monkeypatch.setattr(cli, "load_settings", broken_settings)
    res = _invoke(["topics", *NO_BROKER], paths)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert _error_lines(res.stderr) == [
        "error: RuntimeError: settings store is down (run with --debug for the traceback)"]
    res = _invoke(["--debug", "topics", *NO_BROKER], paths)
    assert res.exit_code == 1 and "Traceback" in res.stderr and "raise RuntimeError" in res.stderr
    assert _error_lines(res.stderr) == ["error: RuntimeError: settings store is down"]


def test_model_dir_checks_name_what_is_missing(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    with pytest.raises(cli.ModelDirError, match="config.json is not JSON"):
        cli._check_model_dir(model)
    (model / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(cli.ModelDirError, match="no `model_type`"):
        cli._check_model_dir(model)
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(cli.ModelDirError, match="has no weights"):
        cli._check_model_dir(model)


def test_train_with_a_wrong_model_is_one_line_from_the_console_script(tmp_path):
    # The user's report: `trajpipe train` with a wrong --model printed a `[rank0]` traceback.
    (tmp_path / "data").mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("TRAJPIPE_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "train", "--model", str(tmp_path / "no-model"), "--data",
         str(tmp_path / "data"), "--out", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert _error_lines(proc.stderr) == [
        f"error: `--model` {tmp_path / 'no-model'} does not exist; give a local Hugging Face model directory "
        f"(make one with `trajpipe model init-tiny --out {tmp_path / 'no-model'}`)"]
    assert "Traceback" not in proc.stderr and "[rank0]" not in proc.stderr and proc.stdout == ""


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on(tmp_path):
    """``kill -USR1 <pid>`` of a command that hangs: its stacks on stderr (a hang's diagnosis), the command alive."""
    import signal
    import time

    script = tmp_path / "waits.py"
    script.write_text(
        "import sys, threading, time\n"
        "import trajpipe.cli as cli\n"
        "def waits_here():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "threading.Thread(target=time.sleep, args=(60,), name='helper', daemon=True).start()\n"
        "cli.app = waits_here\n"
        "cli.main()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout.readline() == "ready\n"
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            assert proc.poll() is None  # still running
        finally:
            proc.kill()
        err = proc.stderr.read()
    assert "most recent call first" in err and 'in waits_here' in err
    assert err.count("Thread 0x") + err.count("Current thread 0x") >= 2  # every thread, the helper too


@pytest.mark.parametrize("debug", [False, True])
def test_a_traceback_logged_by_kafka_python_or_beam_is_one_line_unless_debug(tmp_path, debug):
    """kafka-python logs a traceback for a socket closed under its reader (it reconnects), Beam for a DoFn setup
    that raised (the command retries or ends with its own error line): one line each, the traceback with --debug."""
    script = tmp_path / "logs.py"
    script.write_text(
        "import logging\n"
        "import trajpipe.cli as cli\n"
        "def logs():\n"
        "    for name, msg in (('kafka.net.transport', 'Error receiving network data closing socket'),\n"
        "                      ('apache_beam.runners.common', 'cannot reach Kafka at x')):\n"
        "        try:\n"
        "            raise AttributeError(\"'NoneType' object has no attribute 'recv'\") if name[0] == 'k' \\\n"
        "                else RuntimeError('cannot reach Kafka at x')\n"
        "        except Exception:\n"
        "            logging.getLogger(name).exception(msg)\n"
        "    try:\n"
        "        raise ValueError('ours')\n"
        "    except ValueError:\n"
        "        logging.getLogger('trajpipe.x').exception('our own')\n"
        "cli.app = logs\n"
        "cli.main()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("TRAJPIPE_DEBUG", None)
    if debug:
        env["TRAJPIPE_DEBUG"] = "1"
    err = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120).stderr
    lines = [line for line in err.splitlines() if " ERROR " in line]
    if debug:
        assert err.count("Traceback (most recent call last)") == 3
    else:
        assert err.count("Traceback (most recent call last)") == 1  # our own logger's stays
        assert lines[0].endswith("kafka.net.transport: Error receiving network data closing socket "
                                 "(AttributeError: 'NoneType' object has no attribute 'recv')")
        assert lines[1].endswith("apache_beam.runners.common: cannot reach Kafka at x")  # its error already said
