"""Canned analyst reports: SQL over the catalog's views (pipelines/catalog.py).

Each report is a named query that adapts to the views a catalog has (e.g.
``pass_rate`` reads ``evaluations`` when that table exists, else the
rollouts in ``trajectories``). Run them from the shell::

    trajpipe report list
    trajpipe report pass_rate --data data/datasets
    trajpipe report token_cost --data data/datasets --format json

Definitions (shared by every report):

* a **judged** episode is complete and ended with ``termination`` ``done`` or
  ``max_steps`` (timeouts, errors and aborts carry no verdict, see
  :class:`schemas.events.Termination`); it **passed** when ``status = 'success'``;
* an episode's **context** at step ``t`` is its token stream before the action
  (``StepRow.context_tokens``, stored per step):
  ``sum_{k<=t} |obs_k| + sum_{k<t} |act_k|``; a step is **long-context** when
  that reaches :data:`LONG_CONTEXT_TOKENS`;
* **policy lag** of a trained sample (a trainable step) is
  ``reference - policy_version``, the reference being the newest published
  policy (``policies`` view) or, without a policy store, the newest version in
  ``steps`` (the staleness measure of trainer.losses.policy_lag for one lineage);
* **event→dataset latency** of an episode is the time from its last event to
  the commit that made its row visible (``commit_files.created_at``).

Examples:
    >>> sorted(REPORTS)[:3]
    ['commits', 'dead_letters', 'failures']
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import duckdb
import pyarrow as pa

__all__ = ["Report", "REPORTS", "LONG_CONTEXT_TOKENS", "ReportError", "report_sql", "run_report"]

#: Context length (tokens) from which a step counts as long-context in ``token_cost``.
LONG_CONTEXT_TOKENS = 1024
#: Buckets the ``throughput`` report splits the data's time span into.
THROUGHPUT_BUCKETS = 20

_JUDGED = "complete and termination in ('done', 'max_steps')"


class ReportError(ValueError):
    """A report cannot run on this catalog (unknown name, or a view it needs is missing)."""


@dataclass(frozen=True)
class Report:
    """One canned report.

    Attributes:
        name: its name on the command line.
        title: one line saying what it shows.
        needs: views it cannot run without (any one of each tuple).
        sql: builds the query from the names of the views that exist.
    """

    name: str
    title: str
    needs: tuple[tuple[str, ...], ...]
    sql: Callable[[Collection[str]], str]


def _pass_rate(views: Collection[str]) -> str:
    if "evaluations" in views:
        return """
            select domain, policy_version, 'evaluations' as source, count(*) as episodes,
                   sum(passed::int) as passed, avg(passed::int) as pass_rate, avg(outcome_reward) as mean_reward
            from evaluations where status <> 'aborted'
            group by domain, policy_version order by domain, policy_version"""
    return f"""
        select domain, policy_version, 'rollouts' as source, count(*) as episodes,
               sum((status = 'success')::int) as passed, avg((status = 'success')::int) as pass_rate,
               avg(outcome_reward) as mean_reward
        from trajectories where {_JUDGED}
        group by domain, policy_version order by domain, policy_version"""


def _dist(metric: str, source: str, where: str) -> str:
    # one quantile aggregate with three points: one sort of the column, not three
    return f"""
        select domain, '{metric}' as metric, count(*) as n, avg({metric}) as mean, stddev_pop({metric}) as std,
               min({metric}) as min, quantile_cont({metric}, [0.25, 0.5, 0.75]) as q, max({metric}) as max
        from {source} where {where} group by domain"""


def _rewards(views: Collection[str]) -> str:
    parts = [_dist("outcome_reward", "trajectories", _JUDGED), _dist("episode_return", "trajectories", _JUDGED)]
    if "steps" in views:
        parts.append(_dist("normalized_advantage", "steps", "trainable"))
    return f"""
        select domain, metric, n, mean, std, min, q[1] as p25, q[2] as p50, q[3] as p75, max
        from ({" union all ".join(parts)}) order by metric, domain"""


def _policy_lag(views: Collection[str]) -> str:
    ref = "(select max(policy_version) from steps)"
    if "policies" in views:
        ref = f"coalesce((select max(version) from policies), {ref})"
    return f"""
        with lag as (select domain, {ref} - policy_version as lag from steps where trainable)
        select domain, count(*) as samples, avg(lag) as mean_lag, max(lag) as max_lag,
               avg((lag = 0)::int) as on_policy_share, {ref} as reference_version
        from lag group by domain order by domain"""


def _token_cost(views: Collection[str]) -> str:
    # One pass over integer columns: each step row carries its token counts and its context length
    # (StepRow.observation_tokens, action_tokens, context_tokens), so no token list is decoded and no running
    # sum is taken here. An episode's steps are 0..num_steps-1: its first step counts the episode.
    return f"""
        select domain, count(*) filter (where step_index = 0) as episodes, count(*) as steps,
               sum(observation_tokens) as prompt_tokens, sum(action_tokens) as generated_tokens,
               sum(context_tokens) as context_tokens,
               sum(action_tokens) / count(*) filter (where step_index = 0) as generated_per_episode,
               sum(context_tokens) / count(*) as mean_context, max(context_tokens) as max_context,
               sum(observation_tokens + action_tokens) filter (where step_index > 0)
                   / nullif(count(*) filter (where step_index > 0), 0) as context_growth_per_step,
               count(*) filter (where context_tokens >= {LONG_CONTEXT_TOKENS}) / count(*) as long_context_share,
               count(*) filter (where context_cut_tokens > 0) / count(*) as context_cut_share
        from steps group by domain order by domain"""


def _failures(views: Collection[str]) -> str:
    parts = [
        """select domain, 'infrastructure' as kind, termination as reason, count(*) as episodes
           from trajectories where complete and termination not in ('done', 'max_steps') group by all""",
        """select domain, 'incomplete' as kind, incomplete_reason as reason, count(*) as episodes
           from trajectories where not complete group by all""",
        f"""select domain, 'failed' as kind, status as reason, count(*) as episodes
            from trajectories where {_JUDGED} and status <> 'success' group by all""",
    ]
    if "events" in views:  # sandbox limit violations, as the environments record them: "[exit N, <reason>]"
        parts.append(r"""
            select domain, 'sandbox' as kind, regexp_extract(step.observation, '\[exit -?[0-9]+, ([a-z_:A-Z0-9]+)\]', 1)
                   as reason, count(distinct episode_id) as episodes
            from events where event_type = 'step'
                 and regexp_matches(step.observation, '\[exit -?[0-9]+, [a-z_:A-Z0-9]+\]') group by all""")
    return " union all ".join(parts) + " order by kind, domain, reason"


def _dead_letters(views: Collection[str]) -> str:
    parts = []
    if "dead_letters" in views:
        parts.append("select 'dead_letters' as source, reason, count(*) as messages from dead_letters group by all")
    if "late_events" in views:
        parts.append("select 'late_events' as source, late_reason as reason, count(*) as messages "
                     "from late_events group by all")
    if not parts:  # neither table has a row: an empty, typed result
        return "select ''::varchar as source, ''::varchar as reason, 0::bigint as messages where false"
    return " union all ".join(parts) + " order by source, reason"


def _throughput(views: Collection[str]) -> str:
    return f"""
        with span as (
            select min(last_event_time) as t0,
                   greatest(1, ceil(epoch(max(last_event_time)) - epoch(min(last_event_time))) / {THROUGHPUT_BUCKETS})
                   as bucket_s
            from trajectories),
        b as (
            select floor((epoch(last_event_time) - epoch(t0)) / bucket_s)::bigint as bucket, num_events
            from trajectories, span),
        agg as (select bucket, count(*) as episodes, sum(num_events) as events from b group by bucket),
        buckets as (select range as bucket from range(0, (select max(bucket) + 1 from b)))
        select bucket, t0 + to_microseconds((bucket * bucket_s * 1e6)::bigint) as bucket_start, bucket_s,
               coalesce(episodes, 0) as episodes, coalesce(events, 0)::bigint as events,
               coalesce(episodes, 0) / bucket_s as episodes_per_s, coalesce(events, 0) / bucket_s as events_per_s
        from buckets left join agg using (bucket), span order by bucket"""


def _latency(views: Collection[str]) -> str:
    return """
        with l as (
            select f.version, f.commit, f.created_at,
                   epoch(f.created_at) - epoch(t.last_event_time) as latency_s
            from trajectories t join commit_files f using (filename))
        select version, commit, any_value(created_at) as committed_at, count(*) as episodes,
               quantile_cont(latency_s, 0.5) as p50_s, quantile_cont(latency_s, 0.95) as p95_s, max(latency_s) as max_s
        from l group by version, commit order by version, commit"""


def _commits(views: Collection[str]) -> str:
    return """select source, version, commit, created_at, input, mode, files, rows, events_in, episodes, steps,
                     dead_letters from commits order by created_at, source, version, commit"""


#: Every canned report, by name.
REPORTS: dict[str, Report] = {r.name: r for r in (
    Report("pass_rate", "pass rate and mean reward by domain x policy version (evaluations, else judged rollouts)",
           (("evaluations", "trajectories"),), _pass_rate),
    Report("rewards", "outcome reward, return and normalized advantage distributions per domain",
           (("trajectories",),), _rewards),
    Report("policy_lag", "policy lag (staleness) of the trainable samples per domain", (("steps",),), _policy_lag),
    Report("token_cost", "tokens per domain: prompt vs generated, context growth per step, long-context share",
           (("steps",),), _token_cost),
    Report("failures", "timeouts/errors, incomplete episodes, failed verdicts and sandbox violations by domain "
           "and reason", (("trajectories",),), _failures),
    Report("dead_letters", "dead letters and late events by reason", (), _dead_letters),
    Report("throughput", "episodes/s and events/s over time (by the episodes' last event time)",
           (("trajectories",),), _throughput),
    Report("latency", "event->dataset latency per commit (last event to the commit that made the row visible)",
           (("trajectories",), ("commit_files",)), _latency),
    Report("commits", "the commit history: dataset and archive commits with their counts", (("commits",),),
           _commits),
)}


def report_sql(name: str, views: Collection[str]) -> str:
    """The SQL of report ``name`` over a catalog with ``views``.

    Raises:
        ReportError: no such report, or a view it needs is missing.
    """
    if name not in REPORTS:
        raise ReportError(f"no report {name!r}; reports: {', '.join(REPORTS)} (`trajpipe report list`)")
    report = REPORTS[name]
    for alternatives in report.needs:
        if not any(v in views for v in alternatives):
            raise ReportError(f"report {name!r} needs the view {' or '.join(alternatives)}, which this catalog lacks "
                              f"(views: {', '.join(sorted(views)) or 'none'})")
    return report.sql(views)


def run_report(con: duckdb.DuckDBPyConnection, name: str, views: Collection[str]) -> pa.Table:
    """Run report ``name`` on a connection whose views are ``views`` (see :meth:`Catalog.register`)."""
    return con.sql(report_sql(name, views)).to_arrow_table()
