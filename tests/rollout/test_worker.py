"""Rollout worker and `trajpipe rollout`: acceptance run on a real broker, shutdown, abort semantics.

Also holds the helpers the policy tests share: :func:`read_events` (every event
of a topic, from a real broker) and :func:`assert_complete_episodes`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from rollout.policies.scripted import ScriptedPolicy
from rollout.reload import PolicyFollower, make_policy_published
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from schemas.codec import decode_event
from schemas.events import (
    AnyEvent,
    EpisodeFinished,
    EpisodeStarted,
    EpisodeStatus,
    Step,
    make_event_id,
)
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.consumer import (
    StreamTimeoutError,
    UnknownTopicError,
    end_offsets,
    ranges_from,
    read_range,
)
from streams.producer import EventProducer
from trajpipe.cli import app

REPO = Path(__file__).resolve().parents[2]
DOMAINS = ["code", "math", "docqa", "tools"]


def read_events(conn: KafkaConnection, topic: str) -> list[AnyEvent]:
    """Every event of ``topic`` up to its current end, decoded."""
    ranges = ranges_from(topic=topic, start={}, end=end_offsets(conn, topic))
    return [decode_event(r.value) for batch in read_range(conn, ranges, stall_timeout_s=20) for r in batch]


def assert_complete_episodes(events: list[AnyEvent]) -> dict[str, list[AnyEvent]]:
    """Group by episode; check each is started, finished once, ``seq`` gap-free, ids stable; return them."""
    episodes: dict[str, list[AnyEvent]] = {}
    for ev in events:
        episodes.setdefault(ev.episode_id, []).append(ev)
    for episode_id, evs in episodes.items():
        evs.sort(key=lambda e: e.seq)
        assert [e.seq for e in evs] == list(range(len(evs))), f"{episode_id}: seq not gap-free"
        assert all(e.event_id == make_event_id(episode_id, e.seq) for e in evs)
        assert isinstance(evs[0], EpisodeStarted), f"{episode_id} does not start with episode_started"
        assert isinstance(evs[-1], EpisodeFinished), f"{episode_id} is unfinished"
        assert sum(isinstance(e, EpisodeFinished) for e in evs) == 1
        assert evs[-1].num_steps == sum(isinstance(e, Step) for e in evs)
    return episodes


def _env(topic: str) -> dict[str, str]:
    return {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
            "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "3"}


def _rollout_cmd(bootstrap: str, spool: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", bootstrap, "--spool-dir", str(spool), *args]


class _GatedPolicy(ScriptedPolicy):
    """The first episode to reach step 1 runs through; the others wait there until ``gate`` opens.

    With ``waiters``, the one that runs through first waits (30 s at most) until that many others wait
    at step 1: on a loaded machine an episode's thread may not have reached step 1 yet when the runner
    finishes, and a shutdown would then catch it at step 0.
    """

    def __init__(self, gate: threading.Event, *, waiters: int = 0) -> None:
        super().__init__(seed=1)
        self.gate = gate
        self.runner: str | None = None
        self.waiters, self.waiting = waiters, 0
        self.cond = threading.Condition()

    def act(self, context):
        if context.step_index == 1:
            with self.cond:
                self.runner = self.runner or context.task.task_id
                runs = context.task.task_id == self.runner
                if runs:
                    self.cond.wait_for(lambda: self.waiting >= self.waiters, timeout=30)
                else:
                    self.waiting += 1
                    self.cond.notify_all()
            if not runs:
                self.gate.wait(30)
        return super().act(context)


def test_abort_closes_episodes_in_flight_gap_free():
    """Stop after the first finished episode: the others end `aborted`, seq continuing, nothing half-open."""
    events: list[AnyEvent] = []
    lock = threading.Lock()

    def emit(ev: AnyEvent) -> None:
        with lock:
            events.append(ev)

    stop = threading.Event()
    policy = _GatedPolicy(threading.Event(), waiters=3)  # the other three in flight are at step 1 first
    worker = RolloutWorker(policy, emit=emit, scheduler=make_scheduler(["math"], seed=1),
                           config=RolloutConfig(episodes=50, concurrency=4, max_steps=20, producer_id="t"),
                           on_episode=lambda result, counts: stop.set())
    policy.gate = worker.aborting  # the held episodes go on once the worker is shutting down
    counts = worker.run(stop)
    episodes = assert_complete_episodes(events)
    statuses = [evs[-1].status for evs in episodes.values()]
    assert counts.episodes == len(episodes) == 4 and counts.events == len(events)
    assert statuses.count(EpisodeStatus.SUCCESS) == 1 and counts.aborted == statuses.count(EpisodeStatus.ABORTED) == 3
    for evs in episodes.values():
        if evs[-1].status == EpisodeStatus.ABORTED:
            # The step in progress at shutdown completed and was recorded; the next policy call aborted.
            assert evs[-1].num_steps == 2 and evs[-1].producer_id == "t" and "shut down" in evs[-1].verifier_summary


class _HangingPolicy(ScriptedPolicy):
    """Hangs in its second policy call until released (a wedged engine)."""

    def __init__(self) -> None:
        super().__init__(seed=3)
        self.release = threading.Event()
        self.hanging = threading.Event()

    def act(self, context):
        if context.step_index == 1:
            self.hanging.set()
            self.release.wait(30)
        return super().act(context)


def test_stuck_episode_is_closed_at_shutdown_and_its_late_events_dropped():
    events: list[AnyEvent] = []
    policy = _HangingPolicy()
    stop = threading.Event()
    worker = RolloutWorker(policy, emit=events.append, scheduler=make_scheduler(["math"], seed=3),
                           config=RolloutConfig(episodes=1, concurrency=1, shutdown_timeout_s=0.5))
    threading.Thread(target=lambda: policy.hanging.wait(30) and stop.set(), daemon=True).start()
    counts = worker.run(stop)
    n = len(events)
    assert counts.stuck == 1 and counts.aborted == 1 and counts.events == n
    policy.release.set()  # the abandoned thread wakes up; its next event must not reach the log
    deadline = time.monotonic() + 60  # a failure bound only
    while any(t.name.startswith("episode") and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the abandoned episode thread did not end"
        time.sleep(0.05)
    assert len(events) == n
    (evs,) = assert_complete_episodes(events).values()
    assert evs[-1].status == EpisodeStatus.ABORTED and "stuck" in evs[-1].verifier_summary and evs[-1].num_steps == 1


class _InPlaceScripted(ScriptedPolicy):
    """A scripted policy that "loads weights" in place, like VLLMPolicy: the worker must drain first."""

    reload_in_place = True

    def __init__(self) -> None:
        super().__init__(seed=2)
        self.active = 0
        self.lock = threading.Lock()
        self.reloaded_while_active: list[int] = []

    def act(self, context):
        with self.lock:
            if context.step_index == 0:
                self.active += 1
        return super().act(context)

    def episode_done(self) -> None:
        with self.lock:
            self.active -= 1

    def reload(self, location: str, version: int, *, lineage: str = ""):
        self.reloaded_while_active.append(self.active)
        self.policy_version = version
        return self


def _sigterm_once(proc: subprocess.Popen, ready, *, poll_s: float, settle_s: float = 0.0,
                  timeout_s: float = 120) -> tuple[dict, str]:
    """SIGTERM ``proc`` once ``ready()`` (the topic may not exist yet: then it is not), ``settle_s`` later.

    Returns:
        The last stdout line (the command's counts) and its stderr; the exit status must be 0.
    """
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if ready():
                    break
            except (UnknownTopicError, StreamTimeoutError):
                pass
            time.sleep(poll_s)
        time.sleep(settle_s)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _topics_with_control(kafka_broker, topic_name: str) -> tuple[KafkaConnection, Topics]:
    """A connection to the test broker and the topics of one test, control topic included (created)."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=10_000)
    topics = Topics(events=topic_name, control=f"{topic_name}.ctl", dead_letters=f"{topic_name}.dl", partitions=3)
    ensure_topics(conn, topics)
    return conn, topics


@pytest.mark.integration
def test_in_place_reload_waits_for_episodes_in_flight(kafka_broker, topic_name, tmp_path):
    conn, topics = _topics_with_control(kafka_broker, topic_name)
    policy = _InPlaceScripted()
    events: list[AnyEvent] = []

    with EventProducer(conn, topics.control, spool_dir=tmp_path) as control, \
            PolicyFollower(conn, topics.control) as follower:
        def on_episode(result, counts) -> None:
            policy.episode_done()
            if counts.episodes == 1:
                control.emit(make_policy_published(version=4, location=str(tmp_path), producer_id="t"))
                control.flush()
                deadline = time.monotonic() + 20
                while follower.latest is None and time.monotonic() < deadline:
                    time.sleep(0.05)

        worker = RolloutWorker(policy, emit=events.append, follower=follower, on_episode=on_episode,
                               scheduler=make_scheduler(["math", "docqa"], seed=2),
                               config=RolloutConfig(episodes=12, concurrency=4, max_steps=20))
        counts = worker.run()
    episodes = assert_complete_episodes(events)
    assert counts.reloads == 1 and policy.reloaded_while_active == [0]  # drained before loading
    by_start = [episodes[e][0] for e in sorted(episodes)]
    versions = [ev.policy_version for ev in by_start]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 4
    last_v0_end = max(evs[-1].event_time for evs in episodes.values() if evs[0].policy_version == 0)
    assert all(ev.event_time >= last_v0_end for ev in by_start if ev.policy_version == 4)


@pytest.mark.integration
def test_rollout_cli_scripted_acceptance(kafka_broker, topic_name, tmp_path):
    """40 scripted episodes in four domains -> archive -> DuckDB: complete, gap-free, passing, counts match."""
    proc = subprocess.run(
        _rollout_cmd(kafka_broker.bootstrap, tmp_path / "spool", "--policy", "scripted", "--episodes", "40",
                     "--domains", ",".join(DOMAINS), "--concurrency", "4", "--seed", "7"),
        cwd=REPO, env=_env(topic_name), check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["episodes"] == 40 and counts["aborted"] == 0

    archive = tmp_path / "archive"
    runner = CliRunner(env={k: v for k, v in _env(topic_name).items() if k.startswith("TRAJPIPE_")})
    result = runner.invoke(app, ["archive", "--bootstrap", kafka_broker.bootstrap, "--out", str(archive),
                                 "--until-end", "--spool-dir", str(tmp_path / "dlq")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["events"] == counts["events"]

    con = duckdb.connect()
    con.execute(f"CREATE VIEW ev AS SELECT * FROM read_parquet('{archive}/**/*.parquet', hive_partitioning=true)")
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM ev").fetchone() == (counts["events"],) * 2
    per_episode = con.execute("""
        SELECT episode_id, any_value(domain), count(*), min(seq), max(seq),
               count(*) FILTER (WHERE event_type = 'episode_started'),
               count(*) FILTER (WHERE event_type = 'episode_finished')
        FROM ev GROUP BY episode_id""").fetchall()
    assert len(per_episode) == 40
    for episode_id, _domain, n, lo, hi, n_started, n_finished in per_episode:
        assert (lo, hi, n_started, n_finished) == (0, n - 1, 1, 1), episode_id  # gap-free seq, complete
    # Pass rate per domain from the Kafka events themselves (the status of each episode_finished).
    finished = [e for e in read_events(KafkaConnection(bootstrap_servers=kafka_broker.bootstrap), topic_name)
                if isinstance(e, EpisodeFinished)]
    by_domain: dict[str, list[bool]] = {}
    for e in finished:
        by_domain.setdefault(e.domain, []).append(e.status == EpisodeStatus.SUCCESS)
    assert sorted(by_domain) == sorted(DOMAINS)
    assert all(any(passed) for passed in by_domain.values()), by_domain
    assert sum(map(sum, by_domain.values())) == counts["passed"]
    assert {d: len(v) for d, v in by_domain.items()} == {d: c["episodes"] for d, c in counts["domains"].items()}


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_flushes_and_aborts_unfinished(kafka_broker, topic_name, tmp_path):
    """SIGTERM mid-run: exit 0, every episode on the topic is closed (some `aborted`), counts match the topic."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=5_000)
    proc = subprocess.Popen(
        _rollout_cmd(kafka_broker.bootstrap, tmp_path / "spool", "--policy", "scripted", "--episodes", "2000",
                     "--domains", "code,tools,math", "--concurrency", "8", "--max-steps", "30", "--noise", "0.3"),
        cwd=REPO, env=_env(topic_name), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    def acked_events() -> bool:  # the first acked events: the signal handlers are installed by then
        return sum(end_offsets(conn, topic_name, timeout_s=5).values()) > 100

    counts, err = _sigterm_once(proc, acked_events, poll_s=0.3)
    assert "stopped by signal" in err
    events = read_events(conn, topic_name)
    assert len(events) == counts["events"]  # nothing lost, nothing invented
    episodes = assert_complete_episodes(events)
    assert len(episodes) == counts["episodes"] < 2000
    aborted = [evs for evs in episodes.values() if evs[-1].status == EpisodeStatus.ABORTED]
    assert len(aborted) == counts["aborted"] >= 1


def test_rollout_cli_bad_group_pool_and_model_are_one_line_each(tmp_path):
    cases = [
        (["--group-size", "0"], "`--group-size` must be >= 1, got 0"),
        (["--task-pool", "-1"], "`--task-pool` must be >= 0"),
        (["--policy", "hf", "--model", str(tmp_path)], "is not a model directory (no config.json)"),
    ]
    for args, message in cases:
        res = CliRunner().invoke(app, ["rollout", "--bootstrap", "127.0.0.1:1", "--episodes", "1", *args])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "policy.json").write_text("{not json")
    res = CliRunner().invoke(app, ["rollout", "--bootstrap", "127.0.0.1:1", "--episodes", "1", "--policy", "hf",
                                   "--model", str(tmp_path)])
    assert res.exit_code == 2 and "is not a policy record" in res.output, res.output


class _ReloadingScripted(ScriptedPolicy):
    """A scripted policy that takes new versions (no weights to load)."""

    reload_in_place = False

    def reload(self, location: str, version: int, *, lineage: str = ""):
        self.policy_version = version
        return self


@pytest.mark.integration
def test_staleness_control_holds_rollouts_within_the_versions_budget(kafka_broker, topic_name, tmp_path):
    """AReaL's rule: judged + in flight < (i - i0 + max_ahead + 1) x samples_per_version, released by new versions."""
    conn, topics = _topics_with_control(kafka_broker, topic_name)
    events: list[AnyEvent] = []

    with EventProducer(conn, topics.control, spool_dir=tmp_path) as control, \
            PolicyFollower(conn, topics.control) as follower:
        def on_episode(result, counts) -> None:
            # budget 4 x (0 + 1 + 1) = 8 at v0: the worker holds after 8 judged episodes until v1 (12), then v2 (16)
            if counts.episodes in (8, 12):
                time.sleep(1.0)  # held meanwhile: nothing starts before the next version
                version = 1 if counts.episodes == 8 else 2
                control.emit(make_policy_published(version=version, location=str(tmp_path), producer_id="t"))
                control.flush()
                deadline = time.monotonic() + 20
                while (follower.latest is None or follower.latest.version < version) and time.monotonic() < deadline:
                    time.sleep(0.05)

        worker = RolloutWorker(_ReloadingScripted(seed=3), emit=events.append, follower=follower,
                               on_episode=on_episode, scheduler=make_scheduler(["math", "tools"], seed=3),
                               config=RolloutConfig(episodes=16, concurrency=4, max_steps=4, samples_per_version=4,
                                                    max_ahead=1))
        counts = worker.run()
    episodes = assert_complete_episodes(events)
    starts = [evs[0] for evs in episodes.values()]
    by_version = {v: sum(ev.policy_version == v for ev in starts) for v in (0, 1, 2)}
    assert all(evs[-1].status in (EpisodeStatus.SUCCESS, EpisodeStatus.FAILURE) for evs in episodes.values())
    assert by_version == {0: 8, 1: 4, 2: 4}, by_version
    assert counts.reloads == 2 and counts.throttled_s >= 1.5 and counts.throttle_releases == 0


def test_staleness_control_valve_releases_a_group_when_no_version_comes():
    events: list[AnyEvent] = []
    worker = RolloutWorker(ScriptedPolicy(seed=4), emit=events.append, scheduler=make_scheduler(["tools"], seed=4),
                           config=RolloutConfig(episodes=6, concurrency=2, max_steps=4, group_size=1,
                                                samples_per_version=4, max_ahead=0, throttle_release_s=0.3))
    counts = worker.run()
    assert counts.episodes == 6 and counts.throttle_releases == 2  # 4 in budget, then one group per held 0.3 s
    assert counts.throttled_s >= 0.5


def test_rollout_cli_refuses_staleness_control_without_following_policies(tmp_path):
    result = CliRunner().invoke(app, ["rollout", "--episodes", "1", "--samples-per-version", "4",
                                      "--no-follow-policies", "--spool-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "`--samples-per-version` waits for new policy versions; it needs `--follow-policies`" in result.output


def test_staleness_control_counts_a_hold_still_in_progress_when_the_run_ends():
    # budget 2 x (0 + 0 + 1) = 2 episodes at v0, no new version, the valve far away: held from the 2nd verdict
    # until the stop ~1.5 s later; that hold is in throttled_s although nothing ended it
    stop = threading.Event()
    events: list[AnyEvent] = []

    def on_episode(_result, counts) -> None:
        if counts.episodes == 2:
            threading.Timer(1.5, stop.set).start()

    worker = RolloutWorker(ScriptedPolicy(seed=4), emit=events.append, scheduler=make_scheduler(["tools"], seed=4),
                           on_episode=on_episode,
                           config=RolloutConfig(episodes=6, concurrency=2, max_steps=4, group_size=1,
                                                samples_per_version=2, max_ahead=0, throttle_release_s=600))
    counts = worker.run(stop)
    assert counts.episodes == 2 and counts.throttle_releases == 0
    assert 1.3 <= counts.throttled_s <= counts.elapsed_s
    assert counts.summary()["throttled_s"] == round(counts.throttled_s, 3)


@pytest.mark.integration
def test_rollout_cli_last_line_has_the_staleness_control_counts(kafka_broker, topic_name, tmp_path):
    """A rollout held by the staleness control when SIGTERM stops it: the hold is in the last line's counts."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=5_000)
    proc = subprocess.Popen(
        _rollout_cmd(kafka_broker.bootstrap, tmp_path / "spool", "--policy", "scripted", "--episodes", "6",
                     "--domains", "tools", "--concurrency", "1", "--max-steps", "4", "--samples-per-version", "2",
                     "--max-ahead", "0"),
        cwd=REPO, env=_env(topic_name), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    def budget_used() -> bool:  # the budget of 2 episodes is used: held from now
        return sum(isinstance(e, EpisodeFinished) for e in read_events(conn, topic_name)) >= 2

    counts, err = _sigterm_once(proc, budget_used, poll_s=0.5, settle_s=2.0)
    assert list(counts) == ["episodes", "events", "passed", "aborted", "errors", "groups", "episodes_per_s",
                            "domains", "throttled_s", "throttle_releases"]
    assert counts["episodes"] == 2 and counts["throttle_releases"] == 0
    assert counts["throttled_s"] >= 1.5, counts
    assert "staleness control: held new groups back" in err
