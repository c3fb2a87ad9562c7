"""``trajpipe loop``: config errors, and the whole loop with real processes on a real (embedded) Kafka broker.

The slow test runs the loop from a tiny model (transformers rollouts, GRPO every 2 steps), kills each part
with SIGKILL in turn (the loop restarts it), then the loop itself (its processes end with it; ``--resume``
continues, evaluating first the versions without a finished evaluation), and checks: the version sequence
is contiguous in one lineage, every version is evaluated and ``trajpipe query`` shows the pass rate per
version from the ``evaluations`` view, and nothing acknowledged is lost: every event in the topic is in the
archive (by event_id) and every finished training episode in the topic is in the datasets or held in an
incomplete group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _trajpipe(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _write_config(path: Path, **changes) -> Path:
    doc = yaml.safe_load((REPO / "trajpipe/configs/loop-tiny.yaml").read_text())
    for key, value in changes.items():
        node = doc
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path.write_text("# trajpipe loop --config " + str(path) + "\n" + yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("change, expected", [
    ({"rollout.workerz": 2}, "`rollout.workerz` is not a setting"),
    ({"rollout.workers": "two"}, "`rollout.workers`"),
    ({"budget": {}}, "`budget` needs `seconds` and/or `policy_versions`"),
    ({"rollout.domains": ["chess"]}, "unknown domains chess"),
    ({"pipeline.mode": "micro"}, "`pipeline.mode`"),
    ({"rollout.levels": [0, 5]}, "`rollout.levels` [5] not levels of domain math (0..2)"),
    ({"rollout.levels": []}, "`rollout.levels`"),
    ({"eval.levels": [-1]}, "`eval.levels` [-1] not levels of domain math"),
])
def test_bad_config_is_one_error_line(tmp_path: Path, change: dict, expected: str) -> None:
    cfg = _write_config(tmp_path / "loop.yaml", run_dir=str(tmp_path / "run"), model=str(tmp_path / "m"), **change)
    proc = _trajpipe("loop", "--config", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "trajpipe/configs").glob("loop*.yaml")))
def test_shipped_loop_configs_are_valid(name: str) -> None:
    from trajpipe.loop import load_loop_config

    cfg = load_loop_config(REPO / "trajpipe/configs" / name)
    assert (REPO / "trajpipe/configs" / name).read_text().startswith("# trajpipe loop --config")
    assert cfg.budget.seconds or cfg.budget.policy_versions


def test_missing_config_model_and_resume_of_nothing(tmp_path: Path) -> None:
    proc = _trajpipe("loop", "--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: `--config`"), proc.stderr
    cfg = _write_config(tmp_path / "loop.yaml", run_dir=str(tmp_path / "run"), model=str(tmp_path / "m"))
    proc = _trajpipe("loop", "--config", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2 and "error: `model`" in proc.stderr and "init-tiny" in proc.stderr, proc.stderr
    (tmp_path / "run").mkdir()
    proc = _trajpipe("loop", "--config", str(cfg), "--resume", cwd=tmp_path)
    assert proc.returncode == 2 and "no loop run" in proc.stderr, proc.stderr


def test_rollout_levels_and_staleness_budget_reach_the_worker_command(tmp_path: Path) -> None:
    """``rollout.levels`` pins the workers' levels; the staleness budget comes from the trainer recipe."""
    from trajpipe.loop import Loop, load_loop_config

    tiny = tmp_path / "tiny"  # what prepare() checks of a model dir; nothing here loads it
    tiny.mkdir()
    (tiny / "config.json").write_text('{"model_type": "llama"}')
    (tiny / "model.safetensors").write_bytes(b"")
    cfg = _write_config(tmp_path / "loop.yaml", run_dir=str(tmp_path / "run"), model=str(tiny),
                        **{"rollout.levels": [0, 2], "rollout.workers": 2})
    loop = Loop(load_loop_config(cfg), resume=False, echo=lambda _: None)
    loop.prepare()
    loop.bootstrap = "127.0.0.1:1"
    loop.build_children()
    for i in range(2):
        argv = loop.children[f"rollout-{i}"].argv
        assert argv[argv.index("--levels") + 1] == "0,2"
        # batch 2 x grad_accum 1 x publish_every 2 = 4 episodes per version, shared by 2 workers
        assert argv[argv.index("--samples-per-version") + 1] == "2"
    unpinned = _write_config(tmp_path / "loop2.yaml", run_dir=str(tmp_path / "run2"), model=str(tiny))
    loop2 = Loop(load_loop_config(unpinned), resume=False, echo=lambda _: None)
    loop2.prepare()
    loop2.bootstrap = "127.0.0.1:1"
    loop2.build_children()
    assert "--levels" not in loop2.children["rollout-0"].argv


# ------------------------------------------------------------------------------------------------ slow


def _state(run: Path) -> dict:
    try:
        return json.loads((run / "loop.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(what: str, cond, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the loop ended (status {proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's parent may be a PID 1 that does not reap)."""
    try:
        return "Z" not in Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1][:4]
    except (OSError, IndexError):
        return False


def _versions(run: Path) -> list[int]:
    store = run / "train" / "policies"
    return sorted(int(p.name[1:]) for p in store.glob("v*") if (p / "policy.json").is_file()) if store.is_dir() else []


def _start_loop(cfg: Path, tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trajpipe", "loop", "--config", str(cfg), *extra], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=open(tmp_path / "loop.stderr", "ab"), text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, (proc.returncode, out)
    return json.loads(out.strip().splitlines()[-1])


def _topic_events(bootstrap: str) -> list[dict]:
    """Every record of the events topic, decoded (what the producers got acknowledged)."""
    from schemas.codec import decode_event
    from streams.config import KafkaConnection
    from streams.consumer import OffsetRange, end_offsets, read_range

    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="test-loop")
    end = end_offsets(conn, "trajpipe.events")
    ranges = [OffsetRange(topic="trajpipe.events", partition=p, start=0, end=e) for p, e in end.items() if e]
    return [decode_event(rec.value) for batch in read_range(conn, ranges) for rec in batch]


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(2400)
def test_loop_kill9_each_part_then_resume_loses_nothing(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    assert _trajpipe("model", "init-tiny", "--out", str(tiny), cwd=tmp_path, timeout=900).returncode == 0
    run = tmp_path / "run"
    cfg = _write_config(tmp_path / "loop.yaml", run_dir=str(run), model=str(tiny), **{
        "budget.policy_versions": 4, "budget.seconds": 1800, "broker.keep_running": True,
        "restarts.max_per_child": 2})
    bootstrap = ""
    proc: subprocess.Popen | None = None
    try:
        # 1. SIGKILL each part in turn once training runs: the loop restarts it from its durable state.
        proc = _start_loop(cfg, tmp_path)
        _wait("the first trained step", lambda: (run / "train" / "metrics.jsonl").is_file()
              and '"step"' in (run / "train" / "metrics.jsonl").read_text(), 900, proc)
        bootstrap = _state(run)["bootstrap"]
        for name in ("rollout-0", "archiver", "pipeline", "trainer"):
            pid = _state(run)["pids"][name]
            os.kill(pid, signal.SIGKILL)
            _wait(f"{name} restarted", lambda: _state(run).get("pids", {}).get(name) not in (None, pid), 60, proc)
        log = (tmp_path / "loop.stderr").read_text()
        for name in ("rollout-0", "archiver", "pipeline", "trainer"):
            assert f"loop: {name} exited with status -9; restart 1/2" in log

        # 2. Then SIGKILL the loop itself once v2 is out: its processes end by themselves (the lifeline), the
        #    trainer at most after the publish in hand, so no version comes out that nothing would evaluate.
        _wait("v2", lambda: (_versions(run) or [0])[-1] >= 2, 900, proc)
        at_kill = _versions(run)
        orphans = dict(_state(run)["pids"])
        proc.kill()
        proc.wait()
        _wait("the loop's parts to end with it", lambda: not any(_alive(p) for p in orphans.values()), 120)
        assert len(_versions(run)) <= len(at_kill) + 1, (at_kill, _versions(run))

        # 3. --resume: the run goes on to v4 (budget over resumes), evaluating what was not, and stops cleanly.
        proc = _start_loop(cfg, tmp_path, "--resume")
        final = _finish(proc, 1200)
        assert final["stopped_by"].startswith("budget"), final

        versions = _versions(run)
        assert versions == list(range(1, versions[-1] + 1)) and versions[-1] >= 4
        records = [json.loads((run / "train" / "policies" / f"v{v}" / "policy.json").read_text()) for v in versions]
        assert len({r["lineage"] for r in records}) == 1
        assert [r["parent_version"] for r in records] == list(range(0, versions[-1]))
        assert "--resume" in " ".join(_state(run)["argv"]["trainer"])

        # nothing acknowledged lost: the topic (acknowledged events) against the archive and the datasets
        import duckdb

        from pipelines.commit import DatasetLayout, held_episode_ids, load_held_state, read_manifests
        from pipelines.query import register_views
        from schemas.events import EpisodeFinished, EpisodeStarted
        from schemas.manifests import list_dataset_versions

        events = _topic_events(bootstrap)
        con = duckdb.connect()
        register_views(con, archive=run / "archive", data=run / "data")
        archived = {r[0] for r in con.sql("select distinct event_id from events").fetchall()}
        assert {e.event_id for e in events} == archived
        purpose = {e.episode_id: getattr(e, "purpose", "train") for e in events if isinstance(e, EpisodeStarted)}
        finished = {e.episode_id for e in events if isinstance(e, EpisodeFinished) and purpose.get(e.episode_id) == "train"}
        in_data = {r[0] for r in con.sql("select distinct episode_id from trajectories").fetchall()}
        [version] = list_dataset_versions(run / "data")
        layout = DatasetLayout(out=str(run / "data"), version=version, recipe_hash="")
        held = held_episode_ids(load_held_state(layout, read_manifests(layout)))
        assert finished - in_data <= held, sorted(finished - in_data - held)[:5]
        assert len(finished) > 20
        # every version evaluated; the analyst's view of it
        assert set(map(str, versions)) <= set(final["pass_rate_by_version"]), final
        q = _trajpipe("query", "--data", str(run / "data"), "--format", "json",
                      "select policy_version, count(*) episodes, avg(passed::int) pass_rate from evaluations "
                      "group by policy_version order by policy_version", cwd=tmp_path)
        assert q.returncode == 0, q.stderr
        by_version = {r["policy_version"]: r for r in map(json.loads, q.stdout.splitlines())}
        assert set(versions) <= set(by_version), by_version

    finally:
        if proc is not None and proc.poll() is None:  # a failed wait: stop the loop (and its children) cleanly
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run([sys.executable, "-m", "trajpipe", "broker", "stop", "--data-dir", str(run / "broker")],
                       env=ENV, capture_output=True, timeout=120)


def test_rollout_scheduler_state_bad_path_is_one_error_line(tmp_path: Path) -> None:
    proc = _trajpipe("rollout", "--episodes", "1", "--scheduler-state", str(tmp_path), "--bootstrap", "127.0.0.1:1",
                     cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: `--scheduler-state` {tmp_path} is a directory; give a JSON file path"], proc.stderr


@pytest.mark.integration
def test_rollout_scheduler_state_resumes(tmp_path: Path, kafka_broker) -> None:
    """Two `trajpipe rollout` runs on one state file: the second continues the first's tickets and group rounds."""
    state = tmp_path / "scheduler.json"
    args = ("rollout", "--bootstrap", kafka_broker.bootstrap, "--episodes", "4", "--group-size", "2", "--domains",
            "math", "--policy", "scripted", "--scheduler-state", str(state), "--spool-dir", str(tmp_path / "spool"))
    first = _trajpipe(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    after_first = json.loads(state.read_text())
    assert (after_first["next_ticket"], after_first["next_round"], after_first["in_flight"]) == (5, 2, [])
    second = _trajpipe(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    after_second = json.loads(state.read_text())
    assert (after_second["next_ticket"], after_second["next_round"]) == (9, 4)
    assert after_second["rng"] != after_first["rng"]
