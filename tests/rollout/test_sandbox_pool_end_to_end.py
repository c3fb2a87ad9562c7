"""Pooled sandboxes end to end: sandboxed rollouts → Kafka → archive and Beam job; each episode had a sandbox of its own.

Tools episodes run through the ordinary ``RolloutWorker`` (four in flight, so
pooled slots are taken and refilled while others run), with the scripted
solver behind a probe: each episode's first action is ``RUN`` of a command
that prints what the sandbox holds before the policy did anything (``/work``,
``/tmp``), its uid and its cgroup. The events go through Kafka to the archiver
and the trajectory job; from the archived step events the test checks that no
two episodes shared a sandbox (cgroup name, which carries the sandbox id),
that episodes in flight together had different uids, that ``/tmp`` was empty
and ``/work`` held exactly the files of the episode's task (as recorded in its
``episode_started``; no other episode's leftovers); the Beam job's
trajectories count every episode.
"""

from __future__ import annotations

import json

import duckdb
import pytest
from typer.testing import CliRunner

from pipelines.trajectory_job import run as run_job
from rollout.policies.base import PolicyContext
from rollout.policies.scripted import ScriptedPolicy
from rollout.sandbox import detect_cgroups
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from trajpipe.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROBE = "RUN ls -A /work; echo ---; ls -A /tmp; echo ---; id -u; grep -E '^[0-9]+:pids:' /proc/self/cgroup"


class ProbeFirst:
    """The scripted solver, preceded by one probe command (which the solver never sees)."""

    def __init__(self, inner: ScriptedPolicy) -> None:
        self.inner = inner
        self.policy_version = inner.policy_version
        self.sampling = inner.sampling

    def act(self, context: PolicyContext):
        if context.step_index == 0:
            base = self.inner.act(context)
            return type(base)(text=PROBE, token_ids=list(PROBE.encode()), logprobs=[0.0] * len(PROBE.encode()),
                              prompt_tokens=base.prompt_tokens, sampling=base.sampling)
        hidden = PolicyContext(task=context.task, messages=[context.messages[0], *context.messages[3:]],
                               step_index=context.step_index - 1, prompt_ids=context.prompt_ids, sample=context.sample)
        return self.inner.act(hidden)


def test_each_pooled_episode_had_a_sandbox_of_its_own(kafka_broker, topic_name, tmp_path):
    if detect_cgroups().kind is None:
        pytest.skip("the probe names sandboxes by their cgroup; no delegated cgroup here")
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-pool-e2e")
    topics = Topics(events=topic_name, control=f"{topic_name}.control", dead_letters=f"{topic_name}.dl", partitions=2)
    ensure_topics(conn, topics)
    episodes = 12
    with EventProducer(conn, topics.events, spool_dir=tmp_path / "spool") as producer:
        counts = RolloutWorker(ProbeFirst(ScriptedPolicy(seed=1)), emit=producer.emit,
                               config=RolloutConfig(episodes=episodes, concurrency=4, max_steps=12, run_id="pool"),
                               scheduler=make_scheduler(["tools"], seed=0)).run()
        assert producer.flush().spooled == 0
    assert counts.episodes == episodes and counts.errors == 0

    archive = tmp_path / "archive"
    env = {"TRAJPIPE_TOPICS__EVENTS": topics.events, "TRAJPIPE_TOPICS__DEAD_LETTERS": topics.dead_letters,
           "TRAJPIPE_TOPICS__CONTROL": topics.control, "TRAJPIPE_TOPICS__PARTITIONS": "2",
           "TRAJPIPE_SPOOL_DIR": str(tmp_path / "spool-cli")}
    archived = CliRunner().invoke(app, ["archive", "--bootstrap", kafka_broker.bootstrap, "--out", str(archive),
                                        "--until-end"], env=env)
    assert archived.exit_code == 0, archived.output
    data = tmp_path / "data"
    job = run_job(["--source", "archive", "--archive", str(archive), "--out", str(data)])
    assert job["episodes"] == episodes and job["dead_letters"] == 0

    con = duckdb.connect()
    events = f"read_parquet('{archive}/**/*.parquet', hive_partitioning=true)"
    probes = con.execute(
        f"select episode_id, step.tool_result, task_id from {events} "
        f"where event_type = 'step' and step.step_index = 0 order by episode_id").fetchall()
    finished = dict(con.execute(f"select episode_id, event_time from {events} where event_type = 'episode_finished'").fetchall())
    started = dict(con.execute(f"select episode_id, event_time from {events} where event_type = 'episode_started'").fetchall())
    specs = dict(con.execute(f"select episode_id, episode_started.task_spec from {events} "
                             "where event_type = 'episode_started'").fetchall())
    assert len(probes) == episodes
    seen_cgroups, spans = set(), []
    for episode_id, tool_result, _ in probes:
        stdout = json.loads(tool_result)["stdout"]
        work, tmp, rest = stdout.split("---\n")
        uid, cgroup = rest.split()
        assert tmp == "", (episode_id, stdout)  # nothing in /tmp
        # /work holds exactly what the environment wrote for this episode's task
        task_files = json.loads(specs[episode_id])["files"]
        assert sorted(work.split()) == sorted({f.split("/")[0] for f in task_files}), (episode_id, work, task_files)
        assert "/trajpipe-sandboxes/sb-" in cgroup and uid.isdigit(), stdout
        assert cgroup not in seen_cgroups, f"two episodes shared sandbox {cgroup}"
        seen_cgroups.add(cgroup)
        spans.append((started[episode_id], finished[episode_id], int(uid), episode_id))
    for a in spans:  # episodes in flight together never shared a uid
        for b in spans:
            if a[3] < b[3] and a[0] < b[1] and b[0] < a[1]:
                assert a[2] != b[2], (a, b)
    rows = con.execute(f"select count(*) from read_parquet('{data}/trajectories/**/*.parquet', hive_partitioning=true)")
    assert rows.fetchone()[0] == episodes
