"""The end of a command that runs episodes (``trajpipe rollout``, ``trajpipe eval``): close the policy,
flush the events, say on stderr what a stop or an unreachable broker left behind.

One implementation for both commands (they had two copies of this tail).
"""

from __future__ import annotations

import threading
from typing import Protocol

import typer

__all__ = ["close_policy", "flush_and_report"]


class _Flushable(Protocol):
    def flush(self) -> object: ...


def close_policy(policy: object) -> None:
    """Close ``policy`` if it holds resources (a vLLM engine has ``close``; HF and scripted policies need nothing)."""
    close = getattr(policy, "close", None)
    if close is not None:
        close()


def flush_and_report(producer: _Flushable, *, stop: threading.Event, aborted: int, prefix: str = ""):
    """Flush ``producer``; on stderr, a stop by signal and the events kept in the spool.

    Args:
        producer: the events' :class:`streams.producer.EventProducer`.
        stop: the command's stop flag (set by SIGINT/SIGTERM).
        aborted: episodes the stop closed as ``aborted``.
        prefix: the command's name and ``": "`` on its stderr lines, e.g. ``"eval: "``.

    Returns:
        The producer's :class:`streams.producer.ProducerStats` after the flush.
    """
    stats = producer.flush()
    if stop.is_set():
        typer.echo(f"{prefix}stopped by signal: {aborted} episodes aborted, events flushed", err=True)
    if stats.spooled:
        typer.echo(f"{prefix}Kafka unreachable: {stats.spooled} events kept in the spool; they replay on the next run",
                   err=True)
    return stats
