"""The batch job at 10k, 100k and 1M events from Kafka: events/s per size, counts reconciled.

One topic (4 partitions) grows to each size in turn (10,000 events, then
100,000, then 1,000,000); at each size the job (FnApiRunner, the ``outcome``
recipe, domain verifiers on, as ``trajpipe pipeline run`` runs it) reads the
whole topic into a fresh dataset root and commits it. Figures:
``pipeline_events_s_10k``, ``pipeline_events_s_100k``,
``pipeline_events_s_1m`` (events/s of the whole micro-batch: planning,
reading, the Beam job, the commit) and ``pipeline_1m_events_s`` /
``pipeline_1m_wall_s`` (the 1M run), ``pipeline_1m_peak_rss_mb`` (the driver) and
``pipeline_1m_worker_peak_rss_mb`` (the largest of the job's forked workers,
pipelines/forked.py, kept or ended, and of ended child processes, such as a tool the
broker's start ran); and, since wall time on a shared machine says as much about the neighbours, the job's CPU
time (this process, all threads, and its forked workers): ``pipeline_events_per_cpu_s_<size>``
and ``pipeline_1m_cpu_s``. Each run's
counts must reconcile (``events_in + events_pending_in == events_used +
events_incomplete + events_pending_out + dead_letters + duplicates +
late_events + feedback_events``) and ``events_in`` must be what the topic
holds, else the benchmark fails (a :class:`RuntimeError`, which ``make
bench`` reports as a failed benchmark).

The events: 10,000 synthetic episodes (:func:`streams.synth.generate_episodes`,
~100k events, ~2 KB each), sent again and again under new episode, event and
task-group ids until the size is reached (generating 1M events afresh takes
minutes on this machine; the job cannot tell: every copy is a distinct,
complete episode). A smaller largest size for a quick run:
``TRAJPIPE_BENCH_SCALE_MAX_EVENTS=100000`` (only the sizes reached get keys).

``make bench`` runs it in a process of its own (:func:`bench_scale_in_child`): the peaks are
lifetime maxima of a process and of its ended children, so in the benchmarks' shared process
they were the largest of everything that ran before it there, not the 1M run's.

Run alone::

    .venv/bin/python -m bench.run scale
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
from kafka import KafkaProducer

from pipelines.forked import worker_pids
from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from schemas.codec import encode_event
from schemas.events import EpisodeStarted, Event, make_event_id
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.consumer import end_offsets
from streams.synth import generate_episodes

__all__ = ["bench_scale", "bench_scale_in_child", "SIZES"]

REPO = Path(__file__).resolve().parents[1]

#: (events, key suffix) of the curve.
SIZES = ((10_000, "10k"), (100_000, "100k"), (1_000_000, "1m"))
_OUTCOMES = ("events_used", "events_incomplete", "events_pending_out", "dead_letters", "duplicates", "late_events",
             "feedback_events")


def _copies(pool: list[list[Event]]) -> Iterator[list[Event]]:
    """The pool's episodes, then copy 1 of each under new ids, copy 2, ... (never ends)."""
    copy = 0
    while True:
        for episode in pool:
            if copy == 0:
                yield episode
                continue
            episode_id = f"{episode[0].episode_id}-c{copy}"
            out = []
            for ev in episode:
                changes = {"episode_id": episode_id, "event_id": make_event_id(episode_id, ev.seq)}
                if isinstance(ev, EpisodeStarted):
                    changes["task_group"] = f"{ev.task_group}-c{copy}"
                out.append(msgspec.structs.replace(ev, **changes))
            yield out
        copy += 1


def job_cpu_s() -> float:
    """CPU seconds of this process (all threads; FnApiRunner runs the job in it) and of the job's forked workers.

    The workers (pipelines/forked.py) outlive a run: the kept ones are read from ``/proc``, the
    ended ones from this process's ended children (a broker, a child still running, is neither).
    """
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    live = sum(_proc_stat(pid)[0] for pid in worker_pids())
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + live


def _worker_peak_rss_mb() -> float:
    """The largest peak RSS of the job's forked workers, kept (``/proc``) or ended (this process's children)."""
    ended = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return max([ended, *(_proc_stat(pid)[1] for pid in worker_pids())])


def _proc_stat(pid: int) -> tuple[float, float]:
    """``(CPU seconds, peak RSS MiB)`` of the live process ``pid``; zeros when it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            hwm = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0, 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), hwm / 1024


def reconcile(counts: dict[str, int], *, expected_in: int) -> None:
    """Raise when the counts do not reconcile or the job did not read ``expected_in`` events."""
    gap = counts["events_in"] + counts["events_pending_in"] - sum(counts[k] for k in _OUTCOMES)
    if gap or counts["events_in"] != expected_in:
        raise RuntimeError(f"the job's counts do not reconcile (gap {gap}; read {counts['events_in']} of "
                           f"{expected_in} events): {counts}")


def bench_scale(bootstrap: str, workdir: Path, *, max_events: int | None = None) -> dict[str, float]:
    """Events/s of the batch job at each size of :data:`SIZES` up to ``max_events`` (see the module docstring)."""
    max_events = max_events or int(os.environ.get("TRAJPIPE_BENCH_SCALE_MAX_EVENTS", SIZES[-1][0]))
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-scale")
    topic = f"bench.scale.{uuid.uuid4().hex[:8]}"
    ensure_topics(conn, Topics(events=topic, dead_letters=topic + ".dlq", control=topic + ".ctl", partitions=4))
    producer = KafkaProducer(**conn.client_kwargs(), acks="all", compression_type="lz4", linger_ms=10,
                             batch_size=256 * 1024)
    episodes = _copies(list(generate_episodes(10_000, seed=5)))
    sent = 0
    figures: dict[str, float] = {}
    recipe = load_recipe("outcome")
    try:
        for size, key in SIZES:
            if size > max_events:
                break
            while sent < size:  # whole episodes: the topic holds a little over `size` events
                for ev in next(episodes):
                    producer.send(topic, key=ev.episode_id.encode(), value=encode_event(ev))
                    sent += 1
            producer.flush()
            in_topic = sum(end_offsets(conn, topic).values())
            out = workdir / f"out-{key}"
            t0, cpu0 = time.perf_counter(), job_cpu_s()
            counts = run_batch(out=out, recipe=recipe, input=KafkaInput(conn=conn, topic=topic))
            wall_s, cpu_s = time.perf_counter() - t0, job_cpu_s() - cpu0
            shutil.rmtree(out)
            reconcile(counts, expected_in=in_topic)
            figures[f"pipeline_events_s_{key}"] = round(in_topic / wall_s)
            figures[f"pipeline_events_per_cpu_s_{key}"] = round(in_topic / cpu_s)
            if key == "1m":
                figures.update(pipeline_1m_events_s=round(in_topic / wall_s), pipeline_1m_wall_s=round(wall_s, 1),
                               pipeline_1m_cpu_s=round(cpu_s, 1),
                               pipeline_1m_events=in_topic, pipeline_1m_episodes=counts["episodes"],
                               pipeline_1m_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                             / 1024),
                               pipeline_1m_worker_peak_rss_mb=round(_worker_peak_rss_mb()))
    finally:
        producer.close()
    figures["pipeline_scale_max_events"] = sent
    return figures


def bench_scale_in_child(bootstrap: str, workdir: Path) -> dict[str, float]:
    """:func:`bench_scale` in a fresh Python process (its figures on its last stdout line), so that the peak
    RSS figures are the 1M run's; its log goes to this process's stderr.

    Raises:
        RuntimeError: the child failed (its exit status; its own error is in the log above).
    """
    proc = subprocess.run([sys.executable, "-m", "bench.scale", bootstrap, str(workdir)], stdout=subprocess.PIPE,
                          text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"the scale benchmark's process exited with status {proc.returncode} (its log is above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)  # as bench.run
    print(json.dumps(bench_scale(sys.argv[1], Path(sys.argv[2]))))
