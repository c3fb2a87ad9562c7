"""Held-out evaluation of published policy versions: episodes with ``purpose = "eval"`` through the log.

One evaluation runs the first ``tasks_per_level`` held-out tasks
(:mod:`rollout.heldout`) of every requested domain and level once with one
policy version (greedy by default: temperature 0, so the pass rate is pass@1)
in the same sandboxed environments and through the same
:class:`rollout.worker.RolloutWorker` as training rollouts. Its episodes are
emitted to the ``events`` topic with ``EpisodeStarted.purpose = "eval"``: the
Beam job puts them in the ``evaluations`` table only (never in ``steps``,
``trajectories`` or their statistics), and the trainer drops any eval row.

Which version: :func:`resolve_version` reads the ``policy_published`` events of
the control topic (the trainer publishes each version there, see
:mod:`trainer.publish`) and returns the one asked for, or the newest.
:func:`follow_evaluations` evaluates the newest version at start and then
every version published after it, in order, until ``stop`` is set. Given a
consumer group (``ControlReader(group_id=...)``, ``trajpipe eval --follow
--group G``) it is resumable: after each finished evaluation (every task run,
its events flushed) it commits the offset after that version's
``policy_published`` record, and a follower started later evaluates every
version from the group's committed offset on (from the topic's start for a
new group), the ones published while no follower ran included. An evaluation
cut short by ``stop`` is not committed, so it is run again. Exactly once as
readers see it: a follower stopped between the flush and the commit left a
finished evaluation on the events topic whose version is still unhandled; the
next follower looks for it first (:func:`find_finished_evaluation`, the
``already_evaluated`` hook of :func:`follow_evaluations`), commits the version
and does not evaluate it again.

The result (:class:`EvalResult`) counts episodes and passes per
``<domain>/<level>``; ``pass_rate`` is ``passed / episodes`` over the episodes
that finished (``success``, ``failure``, ``error``, ``timeout``: an
infrastructure failure counts as not passed, it is still an attempt);
episodes aborted by a shutdown are reported in ``aborted`` and left out.

Run it::

    trajpipe eval --bootstrap localhost:9092 --policy-version latest --policy hf --domains math,code --levels 0

Examples:
    >>> src = HeldoutTaskSource(heldout_tasks("math", 0, 2))
    >>> [len(src.next_group(1)), len(src.next_group(1)), len(src.next_group(1))]
    [1, 1, 0]
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec
from kafka import KafkaConsumer, TopicPartition

from rollout.heldout import heldout_tasks
from rollout.policies.base import Policy
from rollout.reload import fetch_policy, reload_policy
from rollout.scheduler import ScheduledTask
from rollout.worker import EpisodeResult, RolloutConfig, RolloutCounts, RolloutWorker
from rollout.envs import Task
from schemas.codec import EventDecodeError, decode_event
from schemas.events import (
    PURPOSE_EVAL, EpisodeFinished, EpisodeStarted, EpisodeStatus, Event, PolicyPublished, SamplingParams,
)
from streams.config import KafkaConnection
from streams.consumer import commit_offsets
from streams.errors import check_kafka

__all__ = [
    "EvalConfig",
    "EvalError",
    "EvalResult",
    "LevelResult",
    "HeldoutTaskSource",
    "ControlReader",
    "eval_tasks",
    "load_policy",
    "resolve_version",
    "run_evaluation",
    "follow_evaluations",
    "find_finished_evaluation",
]

log = logging.getLogger(__name__)


class EvalError(ValueError):
    """The evaluation cannot run as asked (no published policy, unknown version, bad settings)."""


@dataclass(frozen=True)
class EvalConfig:
    """What one evaluation runs.

    Attributes:
        domains: domains evaluated.
        levels: difficulty levels evaluated in each domain (levels a domain lacks are an error).
        tasks_per_level: held-out tasks per domain and level (1..``rollout.heldout.EVAL_POOL``).
        max_steps: steps per episode before the environment judges it.
        max_tokens: new tokens per action.
        temperature: sampling temperature; 0 = greedy (pass@1).
        top_p: nucleus mass.
        seed: sampling seed (matters only when temperature > 0).
        concurrency: episodes in flight.
        episode_timeout_s: wall-clock budget per episode.
        producer_id: worker id on the events.
    """

    domains: tuple[str, ...] = ("math", "code")
    levels: tuple[int, ...] = (0,)
    tasks_per_level: int = 8
    max_steps: int = 8
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    concurrency: int = 4
    episode_timeout_s: float = 300.0
    producer_id: str = "eval"

    def __post_init__(self) -> None:
        if not self.domains:
            raise EvalError("`domains` is empty; name at least one, e.g. math,code")
        if not self.levels:
            raise EvalError("`levels` is empty; name at least one, e.g. 0,1")
        if self.max_steps < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise EvalError("`max_steps`, `max_tokens` and `concurrency` must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise EvalError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")

    @property
    def sampling(self) -> SamplingParams:
        """The policy's sampling parameters."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed)


def eval_tasks(config: EvalConfig) -> list[Task]:
    """The held-out tasks of ``config``, domain by domain, level by level.

    Raises:
        EvalError: unknown domain, a level the domain lacks, or too many tasks per level.
    """
    try:
        return [t for d in config.domains for lvl in config.levels for t in heldout_tasks(d, lvl, config.tasks_per_level)]
    except ValueError as err:
        raise EvalError(str(err)) from None


class LevelResult(msgspec.Struct, kw_only=True):
    """Counts of one ``<domain>/<level>``: finished episodes, passes (status ``success``), their ratio."""

    episodes: int = 0
    passed: int = 0
    pass_rate: float = 0.0


class EvalResult(msgspec.Struct, kw_only=True):
    """What one evaluation measured (the CLI's last-line JSON, see :meth:`summary`).

    Attributes:
        policy_version: the version evaluated.
        policy_lineage: its lineage.
        eval_run: id of this evaluation run (the ``eval_run`` column of the ``evaluations`` table).
        episodes: finished episodes (aborted ones excluded).
        passed: episodes with status ``success``.
        pass_rate: ``passed / episodes`` (0 when no episode finished).
        mean_reward: mean outcome reward of the finished episodes.
        errors: episodes that ended in ``error`` or ``timeout`` (counted as not passed).
        aborted: episodes stopped by a shutdown (not counted).
        events: events emitted.
        by_domain_level: per ``<domain>/<level>`` counts.
        elapsed_s: wall time, seconds.
        tasks: held-out tasks it was to run (one episode each); ``episodes < tasks`` once cut short.
    """

    policy_version: int
    policy_lineage: str = ""
    eval_run: str = ""
    tasks: int = 0
    episodes: int = 0
    passed: int = 0
    pass_rate: float = 0.0
    mean_reward: float = 0.0
    errors: int = 0
    aborted: int = 0
    events: int = 0
    by_domain_level: dict[str, LevelResult] = msgspec.field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def complete(self) -> bool:
        """Every task ran to a result (none aborted or left unstarted by a stop)."""
        return self.tasks > 0 and self.episodes == self.tasks

    def summary(self) -> dict:
        """The last-line JSON object of ``trajpipe eval``."""
        out = msgspec.to_builtins(self)
        out["pass_rate"] = round(self.pass_rate, 4)
        out["mean_reward"] = round(self.mean_reward, 4)
        out["elapsed_s"] = round(self.elapsed_s, 2)
        for v in out["by_domain_level"].values():
            v["pass_rate"] = round(v["pass_rate"], 4)
        return out


class HeldoutTaskSource:
    """A fixed list of tasks handed out once each, in order (the worker's task source for an evaluation).

    Unlike :class:`rollout.scheduler.TaskScheduler` it has no retries: an eval
    episode that times out or fails is one failed attempt of pass@1.
    """

    def __init__(self, tasks: Iterable[Task], *, timeout_s: float = 300.0) -> None:
        self._queue = deque(tasks)
        self._timeout_s = timeout_s
        self._next = 0

    def next_group(self, size: int) -> list[ScheduledTask]:
        """The next task alone (evaluation episodes are never grouped), or [] when all were handed out."""
        if not self._queue:
            return []
        self._next += 1
        return [ScheduledTask(ticket=self._next, task=self._queue.popleft(), timeout_s=self._timeout_s,
                              round=self._next - 1)]

    def report(self, ticket: int | ScheduledTask, *, status: str, reward: float = 0.0,
               env_error: bool = False) -> None:
        """Nothing to adapt: results are collected from the worker's episode callback."""


def run_evaluation(policy: Policy, *, emit: Callable[[Event], None], config: EvalConfig,
                   stop: threading.Event | None = None, eval_run: str | None = None,
                   on_episode: Callable[[EpisodeResult, RolloutCounts], None] | None = None) -> EvalResult:
    """Run the held-out tasks of ``config`` once with ``policy``; emit the episodes (purpose ``eval``).

    Args:
        policy: the policy evaluated (its ``policy_version`` and lineage stamp the episodes).
        emit: receives every event (usually ``EventProducer.emit`` on the events topic; the caller flushes).
        config: domains, levels, tasks and sampling limits.
        stop: set it to abort the episodes in flight (they are closed as ``aborted``).
        eval_run: id of this run (default ``eval-v<version>-<random>``); prefixes the episode ids.
        on_episode: progress callback, as for :class:`rollout.worker.RolloutWorker`.

    Returns:
        The :class:`EvalResult`.
    """
    tasks = eval_tasks(config)
    level_of = {t.task_id: f"{t.domain}/{t.difficulty}" for t in tasks}
    eval_run = eval_run or f"eval-v{policy.policy_version}-{uuid.uuid4().hex[:8]}"
    result = EvalResult(policy_version=policy.policy_version, policy_lineage=getattr(policy, "policy_lineage", ""),
                        eval_run=eval_run, tasks=len(tasks),
                        by_domain_level={f"{d}/{lvl}": LevelResult() for d in config.domains for lvl in config.levels})
    rewards: list[float] = []

    def collect(res: EpisodeResult, counts: RolloutCounts) -> None:
        if res.status == EpisodeStatus.ABORTED:
            return
        cell = result.by_domain_level[level_of[res.task_id]]
        cell.episodes += 1
        cell.passed += res.status == EpisodeStatus.SUCCESS
        cell.pass_rate = cell.passed / cell.episodes
        rewards.append(res.reward)
        if on_episode is not None:
            on_episode(res, counts)

    worker = RolloutWorker(
        policy, emit=emit, scheduler=HeldoutTaskSource(tasks, timeout_s=config.episode_timeout_s),
        config=RolloutConfig(episodes=len(tasks), concurrency=config.concurrency, max_steps=config.max_steps,
                             producer_id=config.producer_id, run_id=eval_run,
                             episode_timeout_s=config.episode_timeout_s, purpose=PURPOSE_EVAL),
        on_episode=collect)
    counts = worker.run(stop)
    result.episodes = sum(c.episodes for c in result.by_domain_level.values())
    result.passed = sum(c.passed for c in result.by_domain_level.values())
    result.pass_rate = result.passed / result.episodes if result.episodes else 0.0
    result.mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    result.errors, result.aborted, result.events = counts.errors, counts.aborted, counts.events
    result.elapsed_s = counts.elapsed_s
    return result


def load_policy(kind: str, location: str, *, version: int, lineage: str = "", config: EvalConfig) -> Policy:
    """A ``hf`` or ``vllm`` policy over the model directory ``location``, stamped with ``version``.

    Raises:
        EvalError: ``kind`` is not hf or vllm.
    """
    if kind == "hf":
        from rollout.policies.hf import HFPolicy

        return HFPolicy.from_pretrained(location, sampling=config.sampling, policy_version=version,
                                        policy_lineage=lineage)
    if kind == "vllm":
        from rollout.policies.vllm import VLLMPolicy

        return VLLMPolicy(location, sampling=config.sampling, policy_version=version,
                          max_batch=config.concurrency, policy_lineage=lineage)
    raise EvalError(f"`--policy` {kind!r} is not one of hf, vllm")


class ControlReader:
    """Reads the ``policy_published`` events of the control topic from its beginning.

    Args:
        conn: the cluster.
        topic: the control topic.
        group_id: a consumer group whose committed offsets record the versions already handled
            (:meth:`commit`, :meth:`unhandled`); None: no group, nothing committed.
        lineage: only versions of this lineage (another run may publish its own v1, v2, ... on the same
            topic); None: every version (the first event of a version number wins).

    Use as a context manager. :meth:`read_to_end` returns every version published so far;
    :meth:`poll` the ones published since the last call.

    Raises:
        streams.errors.KafkaUnavailable: no broker answers (from the constructor).

    Wrap its use in :func:`streams.errors.kafka_access_errors` to turn a missing ACL into one clear error.
    """

    def __init__(self, conn: KafkaConnection, topic: str, *, group_id: str | None = None,
                 lineage: str | None = None) -> None:
        check_kafka(conn)
        self.topic = topic
        self.group_id = group_id
        self.lineage = lineage
        self._consumer = KafkaConsumer(**conn.client_kwargs(), group_id=group_id, enable_auto_commit=False,
                                       auto_offset_reset="earliest")
        self._tps: list[TopicPartition] = []
        self.versions: dict[int, PolicyPublished] = {}
        self._position: dict[int, tuple[int, int]] = {}  # version -> (partition, offset) of its record
        self.published_ms: dict[int, int] = {}  # version -> its record's timestamp (ms since the epoch)

    def __enter__(self) -> ControlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()

    def _assign(self) -> bool:
        if self._tps:
            return True
        parts = self._consumer.partitions_for_topic(self.topic)
        if not parts:
            return False
        self._tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(self._tps)
        self._consumer.seek_to_beginning(*self._tps)
        return True

    def _take(self, records: dict) -> list[PolicyPublished]:
        new = []
        for recs in records.values():
            for rec in recs:
                try:
                    event = decode_event(rec.value)
                except EventDecodeError as err:
                    log.warning("undecodable record on %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, err)
                    continue
                if not isinstance(event, PolicyPublished) or event.version in self.versions:
                    continue
                if self.lineage is not None and event.lineage != self.lineage:
                    continue
                self.versions[event.version] = event
                self._position[event.version] = (rec.partition, rec.offset)
                self.published_ms[event.version] = rec.timestamp
                new.append(event)
        return sorted(new, key=lambda e: e.version)

    def read_to_end(self, *, timeout_s: float = 30.0) -> dict[int, PolicyPublished]:
        """Every version published until now (the topic's end offsets at the call), by version."""
        if not self._assign():
            return dict(self.versions)
        end = self._consumer.end_offsets(self._tps)
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in self._tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"control topic {self.topic!r} not read to its end within {timeout_s:g} s")
            self._take(self._consumer.poll(timeout_ms=500))
        return dict(self.versions)

    def poll(self, *, timeout_ms: int = 500) -> list[PolicyPublished]:
        """Versions published since the last call (waits at most ``timeout_ms``), oldest first."""
        if not self._assign():
            time.sleep(timeout_ms / 1000)
            return []
        return self._take(self._consumer.poll(timeout_ms=timeout_ms))

    def _committed(self) -> dict[int, int]:
        if self.group_id is None or not self._assign():
            return {}
        return {tp.partition: self._consumer.committed(tp) or 0 for tp in self._tps}

    def unhandled(self) -> list[PolicyPublished]:
        """The versions read so far whose record is at or after the group's committed offset, oldest first.

        Raises:
            EvalError: the reader has no ``group_id``.
        """
        if self.group_id is None:
            raise EvalError("ControlReader.unhandled() needs a `group_id`")
        committed = self._committed()
        return sorted((e for v, e in self.versions.items()
                       if self._position[v][1] >= committed.get(self._position[v][0], 0)), key=lambda e: e.version)

    def commit(self, event: PolicyPublished) -> None:
        """Record ``event``'s version as handled: the group's offset moves past its record (never back).

        Call it only once the evaluation is durable (its events flushed). Without a ``group_id``: nothing.
        """
        if self.group_id is None or event.version not in self._position:
            return
        partition, offset = self._position[event.version]
        tp = TopicPartition(self.topic, partition)
        if (self._consumer.committed(tp) or 0) <= offset:
            commit_offsets(self._consumer, {tp: offset + 1})


def resolve_version(versions: dict[int, PolicyPublished], wanted: str | int, *, topic: str) -> PolicyPublished:
    """The published version ``wanted`` (an int, or ``latest``) among ``versions``.

    Raises:
        EvalError: nothing is published, or ``wanted`` was not.

    Examples:
        >>> from rollout.reload import make_policy_published
        >>> vs = {v: make_policy_published(version=v, location=f"/s/v{v}", producer_id="t") for v in (1, 2)}
        >>> resolve_version(vs, "latest", topic="control").location, resolve_version(vs, "1", topic="c").version
        ('/s/v2', 1)
    """
    if not versions:
        raise EvalError(f"no policy is published on the control topic {topic!r}; train and publish one "
                        "(`trajpipe train ...`) or evaluate a model directory with --model DIR")
    if str(wanted) == "latest":
        return versions[max(versions)]
    try:
        version = int(wanted)
    except ValueError:
        raise EvalError(f"`--policy-version` must be a number or `latest`, got {wanted!r}") from None
    if version not in versions:
        raise EvalError(f"policy version {version} is not published on {topic!r}; published: "
                        f"{', '.join(map(str, sorted(versions)))}")
    return versions[version]


def find_finished_evaluation(conn: KafkaConnection, topic: str, event: PolicyPublished, *, tasks: Iterable[Task],
                             since_ms: int, skew_ms: int = 60_000, timeout_s: float = 60.0) -> str | None:
    """The ``eval_run`` of an evaluation of ``event``'s version already finished on the events topic, or None.

    Finished: one eval run (episodes ``<eval_run>-<n>``, purpose ``eval``, ``event``'s version and lineage)
    closed an episode of every task in ``tasks`` with a status other than ``aborted``, the same test as
    :attr:`EvalResult.complete`. Reads ``topic`` from the records stamped ``since_ms - skew_ms`` on (an
    evaluation of a version starts after its publication; ``skew_ms`` allows for the clocks of the trainer's
    and the evaluator's hosts) to the end offsets at the call.

    Args:
        conn: the cluster.
        topic: the events topic.
        event: the version's ``policy_published``.
        tasks: the tasks an evaluation runs (:func:`eval_tasks`).
        since_ms: timestamp of the ``policy_published`` record (:attr:`ControlReader.published_ms`).
        skew_ms: how far before ``since_ms`` to start reading.
        timeout_s: longest time to read to the end.

    Raises:
        TimeoutError: the topic was not read to its end within ``timeout_s``.
    """
    wanted = {t.task_id for t in tasks}
    started: dict[str, str] = {}  # episode id -> task id, for the version's eval episodes
    finished: dict[str, str] = {}  # episode id -> status
    consumer = KafkaConsumer(**conn.client_kwargs(), group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return None
        consumer.assign(tps)
        end = consumer.end_offsets(tps)
        starts = consumer.offsets_for_times({tp: max(0, since_ms - skew_ms) for tp in tps})
        for tp in tps:
            consumer.seek(tp, starts[tp].offset if starts.get(tp) is not None else end[tp])
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"events topic {topic!r} not read to its end within {timeout_s:g} s")
            for recs in consumer.poll(timeout_ms=500).values():
                for rec in recs:
                    try:
                        ev = decode_event(rec.value)
                    except EventDecodeError:
                        continue  # the pipeline dead-letters it; it is no evaluation's
                    if (isinstance(ev, EpisodeStarted) and ev.purpose == PURPOSE_EVAL
                            and ev.policy_version == event.version and ev.policy_lineage == event.lineage):
                        started[ev.episode_id] = ev.task_id
                    elif isinstance(ev, EpisodeFinished):
                        finished[ev.episode_id] = ev.status
    finally:
        consumer.close()
    done: dict[str, set[str]] = {}
    for episode_id, task_id in started.items():
        if finished.get(episode_id, EpisodeStatus.ABORTED) != EpisodeStatus.ABORTED:
            done.setdefault(episode_id.rsplit("-", 1)[0], set()).add(task_id)
    return next((run for run, ts in sorted(done.items()) if wanted <= ts), None)


@dataclass
class _Follow:
    """State of :func:`follow_evaluations`: the policy in use and the last version evaluated."""

    policy: Policy | None = None
    last: int = -1
    results: list[EvalResult] = field(default_factory=list)


def follow_evaluations(reader: ControlReader, *, kind: str, config: EvalConfig, emit: Callable[[Event], None],
                       flush: Callable[[], object], stop: threading.Event,
                       on_result: Callable[[EvalResult], None], poll_ms: int = 500,
                       progress_for: Callable[[int], Callable[[EpisodeResult, RolloutCounts], None]] | None = None,
                       already_evaluated: Callable[[PolicyPublished, int], str | None] | None = None,
                       ) -> list[EvalResult]:
    """Evaluate published versions in order until ``stop``: the backlog at start, then each new one.

    The backlog: with a consumer group (``reader.group_id``), every version the group has not handled yet
    (:meth:`ControlReader.unhandled`: all of them for a new group), so a follower restarted after a crash or a
    stop evaluates the versions published meanwhile; without one, the newest version only.

    Versions are evaluated in order, none skipped (a slow evaluation falls behind rather than leaving a
    version without its row in ``evaluations``). A version whose weights cannot be loaded is logged and
    skipped (and committed: it will not load next time either). With a group, a finished evaluation
    (:attr:`EvalResult.complete`) is committed after ``flush``; one cut short by ``stop`` is not.

    Args:
        reader: the control topic.
        kind: ``hf`` or ``vllm``.
        config: what each evaluation runs.
        emit: sends the episodes' events.
        flush: makes them durable (called after each evaluation, before the commit and ``on_result``).
        stop: ends the loop (an evaluation in flight aborts its episodes and is still reported).
        on_result: called with each evaluation's result (the CLI prints its line).
        poll_ms: longest wait for a publication between checks of ``stop``.
        progress_for: ``progress_for(version)`` gives the episode callback of that version's evaluation.
        already_evaluated: with a group, ``already_evaluated(event, published_ms)`` is asked about the first
            version of the backlog (the only one a follower can have stopped on between the flush and the
            commit: versions are committed in order) and returns the ``eval_run`` of its finished evaluation
            on the events topic, or None; found, the version is committed and not evaluated again
            (e.g. :func:`find_finished_evaluation`).

    Returns:
        The results, in order.
    """
    state = _Follow()
    published = reader.read_to_end()
    if reader.group_id is not None:
        pending = reader.unhandled()
    else:
        pending = sorted(published.values(), key=lambda e: e.version)[-1:]  # the newest at start
    if pending and reader.group_id is not None and already_evaluated is not None:
        first = pending[0]
        eval_run = already_evaluated(first, reader.published_ms[first.version])
        if eval_run is not None:
            log.info("v%d was evaluated already (%s) but not committed: committing it", first.version, eval_run)
            reader.commit(first)
            state.last = first.version
            pending.pop(0)
    if pending:
        log.info("evaluating %s, then each version published after", ", ".join(f"v{e.version}" for e in pending))
    while not stop.is_set():
        if not pending:
            pending = [e for e in reader.poll(timeout_ms=poll_ms) if e.version > state.last]
            continue
        event = pending.pop(0)
        try:
            state.policy = (load_policy(kind, fetch_policy(event.location), version=event.version, lineage=event.lineage,
                                        config=config) if state.policy is None else reload_policy(state.policy, event))
        except (OSError, ValueError, TypeError) as err:
            log.error("cannot load policy version %d from %s: %s; skipping it", event.version, event.location, err)
            reader.commit(event)
            state.last = event.version
            continue
        result = run_evaluation(state.policy, emit=emit, config=config, stop=stop,
                                on_episode=progress_for(event.version) if progress_for is not None else None)
        flush()
        if result.complete:
            reader.commit(event)
        state.last = event.version
        state.results.append(result)
        on_result(result)
        pending += [e for e in reader.poll(timeout_ms=0) if e.version > state.last]
    close = getattr(state.policy, "close", None)
    if close is not None:
        close()
    return state.results
