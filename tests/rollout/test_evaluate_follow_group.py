"""A resumable evaluator: ``follow_evaluations`` with a consumer group evaluates every version it has not yet.

Real broker, real held-out episodes (sandboxed environments, the tiny model through transformers, greedy),
real Beam job over the topic. The scenario of ``trajpipe loop --resume`` after the loop was killed: versions
published while no evaluator ran, and an evaluation cut short by a stop, are evaluated by the next follower of
the group, and each version ends with a finished evaluation in the ``evaluations`` table; another lineage's
versions on the same control topic are left alone. A follower stopped between flushing an evaluation and
committing it leaves a finished evaluation that the next follower finds and does not repeat: one evaluation per
version in the table.
"""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from pipelines.query import register_views
from pipelines.trajectory_job import run as run_job
from rollout.evaluate import (
    ControlReader, EvalConfig, EvalResult, eval_tasks, find_finished_evaluation, follow_evaluations,
)
from rollout.reload import make_policy_published
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from trajpipe.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CFG = EvalConfig(domains=("math",), levels=(0,), tasks_per_level=2, max_steps=1, max_tokens=8, concurrency=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("tiny") / "model"
    made = CliRunner().invoke(app, ["model", "init-tiny", "--out", str(model)])
    assert made.exit_code == 0, made.output
    return model


def _publish(conn: KafkaConnection, topics: Topics, spool: Path, *versions: tuple[int, str, Path]) -> None:
    with EventProducer(conn, topics.control, spool_dir=spool) as producer:
        for version, lineage, location in versions:
            producer.emit(make_policy_published(version=version, location=str(location), producer_id="test",
                                                lineage=lineage, parent_version=version - 1))
        assert producer.flush().spooled == 0


def _follow(conn: KafkaConnection, topics: Topics, spool: Path, *, until: set[int],
            stop_during: int | None = None, die_before_commit: bool = False) -> list[EvalResult]:
    """One follower of group ``g`` (lineage ``run``) until it has finished the versions ``until``; with
    ``stop_during`` it is stopped after the first episode of that version's evaluation instead; with
    ``die_before_commit`` it ends after its first evaluation is flushed, before the commit (its commit does
    nothing: the process "died")."""
    stop = threading.Event()
    watchdog = threading.Timer(300, stop.set)  # a hung follower fails the test below instead of hanging it
    watchdog.start()
    results: list[EvalResult] = []

    def on_result(result: EvalResult) -> None:
        results.append(result)
        if until <= {r.policy_version for r in results if r.complete} or die_before_commit:
            stop.set()

    def progress_for(version: int):
        return (lambda *_: stop.set()) if version == stop_during else None

    def already_evaluated(event, published_ms: int) -> str | None:
        return find_finished_evaluation(conn, topics.events, event, tasks=eval_tasks(CFG), since_ms=published_ms)

    try:
        with ControlReader(conn, topics.control, group_id="g", lineage="run") as reader, \
                EventProducer(conn, topics.events, spool_dir=spool) as producer:
            if die_before_commit:
                reader.commit = lambda event: None
            follow_evaluations(reader, kind="hf", config=CFG, emit=producer.emit, flush=producer.flush, stop=stop,
                               on_result=on_result, progress_for=progress_for, poll_ms=200,
                               already_evaluated=already_evaluated)
    finally:
        watchdog.cancel()
    return results


def _evaluations(bootstrap: str, topics: Topics, out: Path) -> list[tuple]:
    """(policy_version, policy_lineage, eval_run, finished episodes) of the ``evaluations`` table, by the Beam job."""
    counts = run_job(["--source", "kafka", "--bootstrap", bootstrap, "--topic", topics.events, "--out", str(out)])
    assert counts["dead_letters"] == 0, counts
    con = duckdb.connect()
    register_views(con, data=out)
    return con.execute("select policy_version, policy_lineage, eval_run, count(*) filter (where status != 'aborted') "
                       "from evaluations group by all order by 1, 4").fetchall()


def _ensure(kafka_broker, topic_name: str, *, client_id: str) -> tuple[KafkaConnection, Topics]:
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id=client_id)
    topics = Topics(events=topic_name, control=f"{topic_name}.control", dead_letters=f"{topic_name}.dl",
                    partitions=2)
    ensure_topics(conn, topics)
    return conn, topics


def test_a_follower_of_a_group_evaluates_the_versions_published_while_none_ran(kafka_broker, topic_name,
                                                                                 tiny_model, tmp_path):
    conn, topics = _ensure(kafka_broker, topic_name, client_id="test-eval-group")
    spool = tmp_path / "spool"

    # Published before any evaluator ran: v1, v2 of the run (and another run's v1..v3 on the same topic).
    _publish(conn, topics, spool, (1, "other", tiny_model), (1, "run", tiny_model), (2, "run", tiny_model),
             (2, "other", tiny_model), (3, "other", tiny_model))
    first = _follow(conn, topics, spool, until={1, 2})
    assert [(r.policy_version, r.policy_lineage, r.complete) for r in first] == [(1, "run", True), (2, "run", True)]

    # v3, v4 published while no evaluator runs; the next follower starts on them and is stopped during v3.
    _publish(conn, topics, spool, (3, "run", tiny_model), (4, "run", tiny_model))
    second = _follow(conn, topics, spool, until={3, 4}, stop_during=3)
    assert [(r.policy_version, r.episodes, r.tasks, r.complete) for r in second] == [(3, 1, 2, False)]

    # The third evaluates v3 again (not committed), then v4, and nothing of v1, v2 again.
    third = _follow(conn, topics, spool, until={3, 4})
    assert [(r.policy_version, r.complete) for r in third] == [(3, True), (4, True)]
    with ControlReader(conn, topics.control, group_id="g", lineage="run") as reader:
        reader.read_to_end()
        assert reader.unhandled() == []

    # The analyst's view: every version of the run has a finished evaluation (2 of 2 episodes) in the table.
    runs = _evaluations(kafka_broker.bootstrap, topics, tmp_path / "datasets")
    finished = {v for v, lineage, _, n in runs if n == CFG.tasks_per_level and lineage == "run"}
    assert finished == {1, 2, 3, 4}, runs
    assert {lineage for _, lineage, _, _ in runs} == {"run"}
    by_run = {r.eval_run: r for r in first + second + third}
    assert {run for _, _, run, _ in runs} == set(by_run)


def test_a_follower_stopped_between_flush_and_commit_does_not_evaluate_the_version_again(kafka_broker, topic_name,
                                                                                       tiny_model, tmp_path):
    conn, topics = _ensure(kafka_broker, topic_name, client_id="test-eval-once")
    spool = tmp_path / "spool"
    _publish(conn, topics, spool, (1, "run", tiny_model), (2, "run", tiny_model))

    # v1 evaluated and flushed; the follower dies before its commit: v1 is still unhandled for the group
    first = _follow(conn, topics, spool, until={1, 2}, die_before_commit=True)
    assert [(r.policy_version, r.complete) for r in first] == [(1, True)]
    with ControlReader(conn, topics.control, group_id="g", lineage="run") as reader:
        reader.read_to_end()
        assert [e.version for e in reader.unhandled()] == [1, 2]

    # the next follower finds v1's finished evaluation on the events topic, commits it and evaluates v2 only
    second = _follow(conn, topics, spool, until={2})
    assert [(r.policy_version, r.complete) for r in second] == [(2, True)]
    with ControlReader(conn, topics.control, group_id="g", lineage="run") as reader:
        reader.read_to_end()
        assert reader.unhandled() == []

    # readers see one evaluation per version: v1's is the first follower's
    runs = _evaluations(kafka_broker.bootstrap, topics, tmp_path / "datasets")
    assert [(v, lineage, n) for v, lineage, _, n in runs] == [(1, "run", 2), (2, "run", 2)], runs
    assert [run for _, _, run, _ in runs] == [first[0].eval_run, second[0].eval_run]
