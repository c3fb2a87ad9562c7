"""The jobs' counts: their keys, the runner's metrics read as counts, and the reconciliation check.

Both jobs (:mod:`pipelines.batch_job`, :mod:`pipelines.stream_job`) print one JSON object of
counts (keys :data:`COUNT_KEYS`, in that order) as the command's last line; the counts
reconcile as ``events_in + events_pending_in == events_used + events_incomplete +
events_pending_out + dead_letters + duplicates + late_events + feedback_events``
(:func:`check_accounted` logs an error when they do not).
"""

from __future__ import annotations

import json
import logging

from apache_beam.metrics.metric import MetricsFilter

from pipelines.assemble import EVENT_TIME_METRIC
from pipelines.types import METRICS_NAMESPACE

__all__ = ["COUNT_KEYS", "METRIC_FOR", "check_accounted", "counts_from_metrics"]

_LOG = logging.getLogger(__name__)

#: Keys of the counts dict, in print order (the first five are the contract).
COUNT_KEYS = (
    "events_in", "episodes", "steps", "dead_letters", "duplicates",
    "events_used", "events_incomplete", "events_pending_in", "events_pending_out",
    "incomplete_episodes", "pending_episodes",
    "groups_released", "groups_held", "groups_timed_out", "episodes_held", "episodes_excluded",
    "late_events", "episodes_completed_late", "future_events", "evaluations",
    "feedback_events", "corrections", "corrections_unresolved",
)
#: The pipeline metric (namespace ``pipeline``) of each count key.
METRIC_FOR = {
    "events_in": "events_in", "episodes": "episodes_complete", "steps": "steps_written",
    "dead_letters": "dead_letters", "duplicates": "duplicates", "events_used": "events_used",
    "events_incomplete": "events_incomplete", "events_pending_in": "events_pending_in",
    "events_pending_out": "events_pending_out", "incomplete_episodes": "episodes_incomplete",
    "pending_episodes": "episodes_pending", "groups_released": "groups_released", "groups_held": "groups_held",
    "groups_timed_out": "groups_timed_out", "episodes_held": "episodes_held",
    "episodes_excluded": "episodes_excluded", "late_events": "late_events",
    "episodes_completed_late": "episodes_completed_late", "future_events": "future_events",
    "evaluations": "evaluations",
    "feedback_events": "feedback_events", "corrections": "corrections", "corrections_unresolved":
    "corrections_unresolved",
}


def check_accounted(counts: dict[str, int]) -> None:
    """Log an error when the counts do not reconcile (events read that no outcome counted, or counted twice)."""
    outcomes = ("events_used", "events_incomplete", "events_pending_out", "dead_letters", "duplicates", "late_events",
                "feedback_events")
    gap = counts["events_in"] + counts["events_pending_in"] - sum(counts[k] for k in outcomes)
    if gap:
        _LOG.error("the counts do not reconcile: %+d events read are in no outcome (lost, or counted twice if "
                   "negative) between the source and the assembler: %s", gap, json.dumps(counts))


def counts_from_metrics(result) -> tuple[dict[str, int], int]:
    """(counts, event-time clock in epoch ms) from the pipeline's metrics."""
    query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    totals: dict[str, int] = {}
    for c in query["counters"]:
        totals[c.key.metric.name] = totals.get(c.key.metric.name, 0) + int(c.committed or 0)
    clock_ms = max((d.committed.max for d in query["distributions"]
                    if d.key.metric.name == EVENT_TIME_METRIC and d.committed and d.committed.count), default=0)
    return {k: totals.get(METRIC_FOR[k], 0) for k in COUNT_KEYS}, int(clock_ms)

