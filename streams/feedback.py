"""Feedback events: build one for an episode (``trajpipe feedback``) and find the episode it is about.

A ``feedback`` event (:class:`schemas.events.Feedback`) goes to the events
topic keyed by its episode id, so it lands in the episode's partition. Its
envelope is the episode's (``domain``, ``task_id``, ``policy_version``): the
person giving feedback knows the episode id, so :func:`find_episode` looks the
rest up in the datasets (``trajectories/``) or the event archive.

``seq`` is not a position in the episode (the episode's ``seq`` run is over
when feedback comes): it is always :data:`FEEDBACK_SEQ`, and the trajectory
job takes feedback out of the episode before it checks the episode's ``seq``
(pipelines/feedback.py), so feedback never makes an episode look gapped,
late or incomplete.

``event_id`` is stable: a hash of the episode, the step, the source and the
content (rating, correction, comment), or of an id the caller gives
(``--feedback-id``). Sending the same feedback twice (a retry, a re-run of
the command) gives the same id, which the job writes once.

Examples:
    >>> a = make_feedback(EpisodeRef("ep-1", domain="math", task_id="t", policy_version=2), source="ann",
    ...                   rating=0.5, producer_id="cli")
    >>> b = make_feedback(EpisodeRef("ep-1", domain="math", task_id="t", policy_version=2), source="ann",
    ...                   rating=0.5, producer_id="other")
    >>> a.event_id == b.event_id, a.seq, a.policy_version
    (True, 1, 2)
    >>> make_feedback(EpisodeRef("ep-1", "math", "t"), source="ann", rating=0.4).event_id == a.event_id
    False
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import msgspec

from schemas import locations as loc
from schemas.events import Feedback

__all__ = ["FEEDBACK_SEQ", "EpisodeRef", "FeedbackError", "feedback_event_id", "make_feedback", "find_episode",
           "send_feedback"]

#: ``seq`` of every feedback event (not a position in the episode; ``0`` is reserved for ``episode_started``).
FEEDBACK_SEQ = 1


class FeedbackError(ValueError):
    """Feedback that cannot be given as asked; the message names the flag and the fix."""


class EpisodeRef(msgspec.Struct, frozen=True):
    """The episode a feedback event is about (its envelope).

    Attributes:
        episode_id: the episode.
        domain: its domain.
        task_id: its task.
        policy_version: the version of the policy that acted.
        num_steps: its steps, when known (to check ``--step``).
    """

    episode_id: str
    domain: str
    task_id: str
    policy_version: int = 0
    num_steps: int | None = None


def feedback_event_id(episode_id: str, *, target_step: int | None, source: str, rating: float | None,
                      correction: str | None, comment: str, feedback_id: str | None = None) -> str:
    """Stable id of a feedback event (32 hex): of ``feedback_id`` if given, else of the content."""
    parts = ["feedback", episode_id, *([f"id={feedback_id}"] if feedback_id else [
        f"step={target_step}", f"source={source}", f"rating={rating!r}", f"correction={correction}",
        f"comment={comment}"])]
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()


def make_feedback(episode: EpisodeRef, *, source: str, target_step: int | None = None, rating: float | None = None,
                  correction: str | None = None, comment: str = "", producer_id: str = "trajpipe-feedback",
                  feedback_id: str | None = None) -> Feedback:
    """The feedback event for ``episode``.

    Raises:
        FeedbackError: no rating and no correction, a rating that is not finite, a negative or out-of-range
            step, or a correction without a step.
    """
    if rating is None and correction is None:
        raise FeedbackError("give `--score S` or `--correction TEXT` (or both)")
    if rating is not None and not math.isfinite(rating):
        raise FeedbackError(f"`--score` must be a finite number, got {rating}")
    if target_step is not None and target_step < 0:
        raise FeedbackError(f"`--step` must be >= 0, got {target_step}")
    if target_step is not None and episode.num_steps is not None and target_step >= episode.num_steps:
        raise FeedbackError(f"`--step` {target_step}: episode {episode.episode_id} has {episode.num_steps} steps "
                            f"(0..{episode.num_steps - 1})")
    if correction is not None and target_step is None:
        raise FeedbackError("`--correction` replaces the action of one step: give `--step K`")
    if not source:
        raise FeedbackError("`--source` must not be empty (who gives the feedback)")
    event_id = feedback_event_id(episode.episode_id, target_step=target_step, source=source, rating=rating,
                                 correction=correction, comment=comment, feedback_id=feedback_id)
    return Feedback(event_id=event_id, episode_id=episode.episode_id, seq=FEEDBACK_SEQ, producer_id=producer_id,
                    domain=episode.domain, task_id=episode.task_id, policy_version=episode.policy_version,
                    source=source, target_step=target_step, rating=rating, correction=correction, comment=comment)


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _from_data(con: Any, data: Path | str, episode_id: str) -> EpisodeRef | None:
    if loc.is_remote(data):  # DuckDB has no httpfs here: the trajectory files as one hive-partitioned Arrow dataset
        files = loc.list_files(loc.join(str(data), "trajectories"), suffix=".parquet")
        if not files:
            return None
        con.register("_dataset_trajectories", loc.parquet_dataset(files))
        source = "_dataset_trajectories"
    else:
        root = Path(data) / "trajectories"
        if not any(root.glob("**/*.parquet")):
            return None
        source = f"read_parquet({_sql_str(str(root / '**' / '*.parquet'))}, hive_partitioning=true, union_by_name=true)"
    row = con.execute(
        f"select domain, task_id, policy_version, num_steps from {source} "
        f"where episode_id = ? order by complete desc limit 1", [episode_id]).fetchone()
    if row is None:
        return None
    return EpisodeRef(episode_id, domain=row[0], task_id=row[1], policy_version=int(row[2]), num_steps=int(row[3]))


def _from_archive(con: Any, archive: Path | str, episode_id: str) -> EpisodeRef | None:
    from streams.archive import committed_files

    files = committed_files(archive)
    if not files:
        return None
    if loc.is_remote(archive):  # DuckDB has no httpfs here: the committed files as one Arrow dataset
        con.register("_archive_files", loc.parquet_dataset([str(f) for f in files]))
        source = "_archive_files"
    else:
        source = (f"read_parquet([{', '.join(_sql_str(str(p)) for p in files)}], hive_partitioning=true, "
                  "union_by_name=true)")
    row = con.execute(
        f"select any_value(domain), any_value(task_id), any_value(policy_version), "
        f"max(case when event_type = 'episode_finished' then episode_finished.num_steps end), count(*) "
        f"from {source} "
        f"where episode_id = ? and event_type in ('episode_started', 'step', 'episode_finished')",
        [episode_id]).fetchone()
    if row is None or not row[4]:
        return None
    return EpisodeRef(episode_id, domain=row[0], task_id=row[1], policy_version=int(row[2]),
                      num_steps=None if row[3] is None else int(row[3]))


def find_episode(episode_id: str, *, data: Path | str | None = None, archive: Path | str | None = None
                 ) -> EpisodeRef | None:
    """The episode's envelope from the datasets (``trajectories/`` of any version), else the event archive.

    ``data`` and ``archive`` may be ``s3://`` URIs (:mod:`schemas.locations`) or local directories.

    Returns:
        The episode, or None when neither knows it.
    """
    import duckdb

    con = duckdb.connect()
    try:
        for source, lookup in ((data, _from_data), (archive, _from_archive)):
            if source is not None:
                found = lookup(con, source if loc.is_remote(source) else Path(source), episode_id)
                if found is not None:
                    return found
        return None
    finally:
        con.close()


def send_feedback(conn: Any, topic: str, event: Feedback, *, spool_dir: Path) -> bool:
    """Send ``event`` to ``topic`` (keyed by its episode) and flush; True if Kafka acknowledged it.

    False means Kafka was unreachable and the event waits in the spool (``spool_dir``); it is replayed by the
    next producer of the same spool (the next ``trajpipe feedback`` with the same ``--spool-dir``).
    """
    from streams.producer import EventProducer

    with EventProducer(conn, topic, spool_dir=spool_dir) as producer:
        producer.emit(event)
        stats = producer.flush()
    return stats.spooled == 0
