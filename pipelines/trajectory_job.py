"""The trajectory job: event log → verified, reward-annotated, versioned Parquet datasets.

Reads the events of the Kafka ``events`` topic (a bounded offset range: from the
last commit's end offsets to the end offsets at job start) or of an event
archive (the archive commits no earlier dataset commit covers), plus the
pending events of unfinished episodes carried over from the last commit, and
writes one dataset commit (docs/pipelines.md)::

    decode/read → dedupe → assemble episodes → verify steps → process rewards
    → clip trajectories → normalize by domain → <out>/steps, <out>/trajectories
                       └→ evaluation episodes (purpose eval) → <out>/evaluations

Run locally (FnApiRunner, the default for batch)::

    python -m pipelines.trajectory_job --source archive --archive data/archive --out data/datasets
    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --recipe pipelines/recipes/shaped.yaml --loop 60
    trajpipe pipeline run --source archive --archive data/archive --out data/datasets

Streaming (``--mode stream``, Kafka only): follow the topic on a streaming
runner, one dataset commit per event-time window pane, until cancelled (or
``--stop-after-s``, ``--stop-at-end``, ``--stop-file``); semantics in docs/pipelines.md, "Streaming mode"::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --mode stream --runner PrismRunner --window-s 10 --incomplete-after 600

On a cluster, name the runner and pass its options through (every option this
module does not know goes to Beam's ``PipelineOptions``); ``--out`` must be a
filesystem the workers and the driver share::

    python -m pipelines.trajectory_job --source archive --archive /shared/archive --out /shared/datasets \\
        --runner FlinkRunner --flink_master flink:8081 --environment_type DOCKER

or an S3-compatible store, which the workers write to directly (the AWS variables of
docs/storage.md in the driver's and the workers' environment), in either mode::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out s3://bucket/datasets
    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out s3://bucket/datasets \\
        --mode stream --runner PrismRunner --window-s 10

GRPO groups whose members have not all arrived are held (not written) until
they have, or for ``--group-timeout`` seconds of event time (pipelines/groups.py)::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \
        --recipe grpo.yaml --group-timeout 600 --loop 60

Events of an episode a commit wrote as incomplete are *late*: kept events of
such episodes (``--late-retention`` seconds of event time, default 7 days) are
completed by them when they can (pipelines/late.py); event times more than
``--max-future-s`` (default 300) ahead of the processing time are *future*:
counted, used, never on the event-time clock::

    python -m pipelines.trajectory_job --source archive --archive data/archive --out data/datasets \
        --incomplete-after 600 --late-retention 86400 --max-future-s 120

The last line printed is one JSON object of counts (stream mode adds
``commits``), which reconcile as
``events_in + events_pending_in == events_used + events_incomplete
+ events_pending_out + dead_letters + duplicates + late_events + feedback_events``
(``feedback_events``: feedback rows written, pipelines/feedback.py; ``corrections`` and
``corrections_unresolved`` count what became of the corrections among them) (held groups are events
already used, held as rows: ``groups_held``/``episodes_held`` are what is held
after the run, ``groups_released`` what it wrote, ``episodes_excluded`` the
complete episodes it found untrainable; ``episodes_completed_late`` and
``future_events`` are outside the sum). ``evaluations`` counts the complete
evaluation episodes (``purpose = "eval"``) written to ``evaluations/``; they
are among ``episodes`` and their events among ``events_used``. A batch run's
counts come from what it staged (count files and the staged files' footers,
pipelines/counts.py), not from the runner's metrics; what earlier commits hold
(emitted episodes, the late state, feedback ids) is read by the workers from
the dataset (pipelines/committed.py), so the job graph does not grow with the
dataset's history.

Where the code is: this module is the entry point (``trajpipe pipeline run`` calls
:func:`run`, which dispatches on ``--mode``); the batch job is :mod:`pipelines.batch_job`
(:func:`~pipelines.batch_job.run_batch`), the streaming job :mod:`pipelines.stream_job`
(:func:`~pipelines.stream_job.run_stream`); both take the options of
:mod:`pipelines.job_args` and count with :mod:`pipelines.job_counts`. The names this module
exported before the split are re-exported from there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from pipelines import batch_job, stream_job
from pipelines.batch_job import processing_time_s, run_batch
from pipelines.job_args import DEFAULT_MAX_FUTURE_S, JobError, prepare
from pipelines.job_counts import COUNT_KEYS
from pipelines.stream_job import run_stream
from streams.config import KafkaConnection, Topics

__all__ = ["run", "run_batch", "run_stream", "processing_time_s", "JobError", "COUNT_KEYS", "DEFAULT_MAX_FUTURE_S"]


def run(argv: Sequence[str] | None = None, *, conn: KafkaConnection | None = None,
        default_topic: str = Topics().events) -> dict[str, int]:
    """Parse the command line, run the job its ``--mode`` names, return the counts.

    ``--mode batch`` (the default): one micro-batch, or one every ``--loop`` seconds
    (:func:`pipelines.batch_job.run_prepared`); ``--mode stream``: the streaming job until it
    stops (:func:`pipelines.stream_job.run_prepared`).

    Args:
        argv: command-line options (this job's and Beam's).
        conn: the full Kafka connection (security settings included) from the
            caller's settings; by default one built from ``--bootstrap``.
        default_topic: events topic when ``--topic`` is not given.

    Raises:
        JobError: missing or incompatible options.
        RecipeError: an unknown or invalid recipe.
    """
    job = prepare(argv, conn=conn, default_topic=default_topic)
    return (stream_job if job.args.mode == "stream" else batch_job).run_prepared(job)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run()), flush=True)
