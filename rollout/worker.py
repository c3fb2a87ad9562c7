"""The rollout worker: many episodes in flight, events to Kafka, clean shutdown, policy reload.

:class:`RolloutWorker` draws tasks from a :class:`rollout.scheduler.TaskScheduler`,
runs each as an episode (:func:`rollout.episode.run_episode`) in a thread pool
of ``concurrency`` threads, and emits every event through ``emit`` (usually
:meth:`streams.producer.EventProducer.emit` on the events topic).

Concurrency model: one thread per episode in flight. Environment steps
(sandboxed commands) and policy calls block their own thread only; the
scheduler is touched by the main thread alone. Model policies decide how to
share the model: :class:`rollout.policies.vllm.VLLMPolicy` feeds every
thread's request to one engine with continuous batching (a request joins the
running batch at the next engine step);
:class:`rollout.policies.hf.HFPolicy` serialises ``generate`` calls while
environment steps of other episodes go on.

Shutdown: when ``stop`` is set (the CLI sets it on SIGINT/SIGTERM) no new
episode starts, and each episode in flight ends at its next policy call: the
call raises :class:`EpisodeAborted` (a ``BaseException``, so
``run_episode``'s error handling lets it through) and the worker closes the
episode with an ``episode_finished`` event of status ``aborted`` whose ``seq``
follows the last event emitted, keeping ``seq`` gap-free. A step already
inside the environment completes and is recorded first. The caller then
flushes the producer.

Groups (``RolloutConfig.group_size`` G > 1): the worker takes G tickets of one
task at a time (:meth:`rollout.scheduler.TaskScheduler.next_group`) and starts
them together on the same policy object, so all members of a group act with
one policy version. They share ``task_group`` = ``<task_id>@v<version>#<run
id>.<round>`` (task, policy version, round), declare ``group_size`` and their
``group_member`` index, and draw distinct samples (the member index is part of
their sampling seed). The trajectory job computes group baselines over complete
groups only.

Policy versions: with a :class:`rollout.reload.PolicyFollower`, a newly
published version is applied between groups (see :mod:`rollout.reload`);
every event of an episode carries the version (and lineage) that started it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import msgspec

from rollout.envs import make_env
from rollout.episode import EpisodeSummary, run_episode
from rollout.policies.base import Action, Policy, PolicyContext
from rollout.reload import PolicyFollower, reload_policy
from rollout.scheduler import ScheduledTask, SchedulerConfig, TaskScheduler
from schemas.events import (
    PURPOSE_TRAIN,
    PURPOSES,
    EpisodeFinished,
    EpisodeStatus,
    Event,
    Step,
    Termination,
    make_event_id,
)

__all__ = [
    "DomainCounts",
    "EpisodeAborted",
    "EpisodeResult",
    "RolloutConfig",
    "RolloutCounts",
    "RolloutWorker",
    "TaskSource",
    "make_scheduler",
]

log = logging.getLogger(__name__)


class EpisodeAborted(BaseException):
    """Raised inside an episode's thread when the worker shuts down; ends the episode as ``aborted``.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that the episode runner's
    ``except Exception`` handlers, which turn failures into ``error`` episodes, let it through.
    """


@dataclass(frozen=True)
class RolloutConfig:
    """What one worker run does.

    Attributes:
        episodes: episodes to run (retries of timed-out tasks count as episodes).
        concurrency: episodes in flight at once.
        max_steps: steps per episode before the environment judges it.
        producer_id: worker id written on every event.
        run_id: prefix of this run's episode ids (``<run_id>-<n>``); random by default
            so a rerun never reuses event ids.
        episode_timeout_s: wall-clock budget per episode (None: the scheduler's ticket timeout).
        shutdown_timeout_s: on stop, how long episodes in flight may take to reach their
            next policy call before they are closed as ``aborted`` regardless.
        group_size: episodes per task run together as one GRPO group (the last group
            of a run is smaller when ``episodes`` is not a multiple).
        purpose: ``EpisodeStarted.purpose`` of every episode: ``train``, or ``eval`` for
            held-out evaluations (:mod:`rollout.evaluate`).
        samples_per_version: staleness-aware rollout control (0: off): the episodes the trainer consumes
            per published version (batch x grad accumulation x publish interval, this worker's share).
            The worker starts a new group only while ``judged + in_flight < (i - i0 + max_ahead + 1) x
            samples_per_version``, ``i`` being the version it acts with, ``i0`` the one it started with and
            ``judged`` its finished episodes with a verdict (success or failure; timeouts, errors and aborts
            are never trained on, so they do not use the budget). Otherwise it waits for the next version.
            This is AReaL's rule (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
            System for Language Reasoning", section 5.1: the rollout controller rejects new generation
            once the trajectories generated reach ``(i + eta + 1) x B``): rollouts run ahead of training by
            at most ``max_ahead`` versions, so what they produce is not too stale to train on.
        max_ahead: ``eta`` above: versions the rollouts may run ahead of the trainer (the trainer's
            ``max_staleness``).
        throttle_release_s: liveness valve of the control: a worker held this long without a new version
            starts one more group (the trainer may need more samples than the budget gave it, e.g. when
            the pipeline holds incomplete groups), logged.
    """

    episodes: int
    concurrency: int = 4
    max_steps: int = 16
    producer_id: str = "rollout"
    run_id: str = ""
    episode_timeout_s: float | None = None
    shutdown_timeout_s: float = 60.0
    group_size: int = 1
    purpose: str = PURPOSE_TRAIN
    samples_per_version: int = 0
    max_ahead: int = 0
    throttle_release_s: float = 30.0

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"`purpose` must be one of {', '.join(PURPOSES)}, got {self.purpose!r}")
        if self.episodes < 0:
            raise ValueError(f"`episodes` must be >= 0, got {self.episodes}")
        if self.group_size < 1:
            raise ValueError(f"`group_size` must be >= 1, got {self.group_size}")
        if self.concurrency < 1:
            raise ValueError(f"`concurrency` must be >= 1, got {self.concurrency}")
        if self.max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {self.max_steps}")
        if self.samples_per_version < 0 or self.max_ahead < 0:
            raise ValueError(f"`samples_per_version` and `max_ahead` must be >= 0, got {self.samples_per_version}, "
                             f"{self.max_ahead}")
        if self.throttle_release_s <= 0:
            raise ValueError(f"`throttle_release_s` must be > 0, got {self.throttle_release_s}")


class EpisodeResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one episode ended, from the worker's view.

    Attributes:
        episode_id: the episode.
        domain: its domain.
        task_id: its task.
        status: how it ended (``aborted`` if the worker stopped it).
        reward: outcome reward (0 unless judged).
        num_events: events emitted for it (``seq`` of its last event + 1).
        policy_version: the version that acted.
        env_error: an environment failure ended it.
    """

    episode_id: str
    domain: str
    task_id: str
    status: EpisodeStatus
    reward: float
    num_events: int
    policy_version: int
    env_error: bool = False


class DomainCounts(msgspec.Struct, kw_only=True):
    """Per-domain tallies: episodes finished, passed (status ``success``), events emitted."""

    episodes: int = 0
    passed: int = 0
    events: int = 0


class RolloutCounts(msgspec.Struct, kw_only=True):
    """Totals of a worker run.

    Attributes:
        episodes: episodes that emitted events (finished or aborted).
        events: events emitted.
        passed: episodes with status ``success``.
        aborted: episodes ended by shutdown.
        errors: episodes with status ``error`` or ``timeout``.
        domains: per-domain tallies.
        policy_versions: episodes per policy version.
        groups: groups of episodes started (a group of one per task when ``group_size`` is 1).
        reloads: policy versions applied.
        throttled_s: seconds the staleness control held new groups back (``RolloutConfig.samples_per_version``),
            a hold still in progress when the run ends included.
        throttle_releases: groups its liveness valve let through.
        stuck: episodes closed at shutdown while their thread was still busy (abandoned).
        elapsed_s: wall time of the run, seconds.
    """

    episodes: int = 0
    events: int = 0
    passed: int = 0
    aborted: int = 0
    errors: int = 0
    domains: dict[str, DomainCounts] = msgspec.field(default_factory=dict)
    policy_versions: dict[int, int] = msgspec.field(default_factory=dict)
    groups: int = 0
    reloads: int = 0
    throttled_s: float = 0.0
    throttle_releases: int = 0
    stuck: int = 0
    elapsed_s: float = 0.0

    @property
    def episodes_per_s(self) -> float:
        """Finished episodes per second of wall time."""
        return self.episodes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        """The CLI's last-line JSON object."""
        return {"episodes": self.episodes, "events": self.events, "passed": self.passed, "aborted": self.aborted,
                "errors": self.errors, "groups": self.groups, "episodes_per_s": round(self.episodes_per_s, 3),
                "domains": {d: msgspec.to_builtins(c) for d, c in sorted(self.domains.items())},
                "throttled_s": round(self.throttled_s, 3), "throttle_releases": self.throttle_releases}


def make_scheduler(domains: list[str], *, seed: int = 0, adaptive: bool = True, task_pool: int = 0,
                   levels: tuple[int, ...] = (), state_path: str | os.PathLike[str] | None = None) -> TaskScheduler:
    """A scheduler over ``domains`` with equal base weights (in memory, or persisted to ``state_path``).

    Args:
        domains: the domains to draw from.
        seed: seed of draws and task generation.
        adaptive: weight toward domains whose pass rate is neither ~0 nor ~1.
        task_pool: draw tasks from a fixed pool of this many per domain and level (0: always new ones).
        levels: pin the difficulty to these levels, drawn uniformly (empty: the curriculum decides).
        state_path: JSON file the scheduler saves its state to after every result and resumes from when it
            exists (levels, pass rates, RNG, group rounds; tickets in flight at a crash run again).

    Raises:
        ValueError: ``domains`` is empty, or a level is out of a domain's range.
    """
    if not domains:
        raise ValueError("`domains` is empty; name at least one, e.g. code,math")
    from rollout.envs import max_difficulty

    too_high = sorted({f"{d}/{lv}" for d in domains for lv in levels if lv > max_difficulty(d)})
    if too_high:
        raise ValueError(f"`levels` {', '.join(too_high)} above the domain's highest level")
    return TaskScheduler(SchedulerConfig(domain_weights={d: 1.0 for d in domains}, adaptive=adaptive, seed=seed,
                                         task_pool=task_pool, levels=tuple(levels)), state_path=state_path)


class TaskSource(Protocol):
    """Where a worker gets its tasks: :class:`rollout.scheduler.TaskScheduler`, or a fixed list
    (:class:`rollout.evaluate.HeldoutTaskSource`)."""

    def next_group(self, size: int) -> list[ScheduledTask]: ...

    def report(self, ticket: int | ScheduledTask, *, status: str, reward: float = 0.0,
               env_error: bool = False) -> None: ...


class _AbortablePolicy:
    """Wraps a policy for one episode: raises :class:`EpisodeAborted` once either event is set."""

    def __init__(self, policy: Policy, *events: threading.Event) -> None:
        self._policy = policy
        self._events = events
        self.policy_version = policy.policy_version
        self.policy_lineage = getattr(policy, "policy_lineage", "")
        self.sampling = policy.sampling
        self.chat = getattr(policy, "chat", None)
        self.max_prompt_tokens = getattr(policy, "max_prompt_tokens", 0)

    def act(self, context: PolicyContext) -> Action:
        if any(e.is_set() for e in self._events):
            raise EpisodeAborted()
        return self._policy.act(context)


class _EpisodeEmitter:
    """Forwards one episode's events to ``emit``, remembers where it stands, and closes it exactly once.

    :meth:`close` emits the closing ``episode_finished`` (``seq`` = next) unless
    the episode has no event yet; afterwards the emitter is sealed and a late
    event (from an episode thread the worker gave up waiting for) raises
    :class:`EpisodeAborted` instead of reaching the log, so ``seq`` stays gap-free
    and never repeats.
    """

    def __init__(self, emit: Callable[[Event], None], *, episode_id: str, producer_id: str, base: dict) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._sealed = False
        self.episode_id = episode_id
        self.producer_id = producer_id
        self.base = base
        self.next_seq = 0
        self.steps = 0

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._sealed:
                log.warning("dropping %s of %s: the episode was already closed", event.event_type, self.episode_id)
                raise EpisodeAborted()
            self._emit(event)
            self.next_seq = event.seq + 1
            if isinstance(event, Step):
                self.steps += 1
            if isinstance(event, EpisodeFinished):
                self._sealed = True

    def close(self, status: EpisodeStatus, why: str) -> int:
        """Emit the closing ``episode_finished`` if the episode is open; returns the events it now has."""
        with self._lock:
            if not self._sealed and self.next_seq > 0:
                seq = self.next_seq
                termination = Termination.ABORTED if status == EpisodeStatus.ABORTED else Termination.ERROR
                self._emit(EpisodeFinished(event_id=make_event_id(self.episode_id, seq), seq=seq,
                                           producer_id=self.producer_id, status=status, num_steps=self.steps,
                                           verifier_summary=why, termination=termination.value, **self.base))
                self.next_seq = seq + 1
            self._sealed = True
            return self.next_seq


class RolloutWorker:
    """Runs episodes concurrently and emits their events.

    Args:
        policy: the policy (any :class:`rollout.policies.base.Policy`).
        emit: called with every event, from episode threads (must be thread-safe).
        config: the run's settings.
        scheduler: task source, usually a :class:`TaskScheduler` (default: :func:`make_scheduler`
            needs ``domains``).
        domains: domains for the default scheduler.
        seed: seed of the default scheduler.
        follower: follows published policy versions (None: the version never changes).
        on_episode: called in the main thread after each episode with its result and the totals.
    """

    def __init__(self, policy: Policy, *, emit: Callable[[Event], None], config: RolloutConfig,
                 scheduler: TaskSource | None = None, domains: list[str] | None = None, seed: int = 0,
                 follower: PolicyFollower | None = None,
                 on_episode: Callable[[EpisodeResult, RolloutCounts], None] | None = None) -> None:
        if scheduler is None:
            scheduler = make_scheduler(list(domains or []), seed=seed)
        self.policy = policy
        self.config = config
        self.scheduler = scheduler
        self.follower = follower
        self.on_episode = on_episode
        self.counts = RolloutCounts()
        self.run_id = config.run_id or uuid.uuid4().hex[:10]
        self._emit = emit
        self._abort = threading.Event()
        self._stop = threading.Event()
        self._skip_version = -1  # a version whose reload failed is not retried
        self._first_version = policy.policy_version
        self._judged = 0  # finished episodes with a verdict (the staleness control's budget use)
        self._held_since: float | None = None
        self._released = 0  # episodes the liveness valve added to the budget

    @property
    def aborting(self) -> threading.Event:
        """Set once shutdown began: episodes in flight end at their next policy call."""
        return self._abort

    # ------------------------------------------------------------------ main loop

    def run(self, stop: threading.Event | None = None) -> RolloutCounts:
        """Run ``config.episodes`` episodes (fewer if ``stop`` is set); returns the totals.

        On stop, episodes in flight get ``config.shutdown_timeout_s`` to reach
        their next policy call; any still stuck then (a hung environment or
        engine) is closed as ``aborted`` from here and counted in
        ``counts.stuck``; its thread is abandoned and the caller should exit
        the process once the producer is flushed. The caller flushes/closes the
        producer afterwards.
        """
        stop = self._stop = stop or threading.Event()
        started = 0
        t0 = time.monotonic()
        in_flight: dict[Future, tuple[ScheduledTask, _EpisodeEmitter]] = {}
        pool = ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="episode")
        try:
            while not stop.is_set():
                draining = self._maybe_reload(busy=bool(in_flight))
                while (not draining and started < self.config.episodes and len(in_flight) < self.config.concurrency
                       and not self._ahead(len(in_flight))):
                    items = self.scheduler.next_group(min(self.config.group_size, self.config.episodes - started))
                    if not items:  # every domain blocked (breakers open, retries backing off)
                        break
                    # One policy object for the whole group: every member acts with the same version.
                    policy = self.policy
                    group = f"{items[0].task.task_id}@v{policy.policy_version}#{self.run_id}.{items[0].round}"
                    for item in items:
                        emitter = self._emitter(item, policy, f"{self.run_id}-{started:06d}")
                        in_flight[pool.submit(self._run_one, item, policy, emitter, group)] = (item, emitter)
                        started += 1
                    self.counts.groups += 1
                if not in_flight:
                    if started >= self.config.episodes:
                        break
                    stop.wait(0.1)
                    continue
                done, _ = wait(in_flight, timeout=0.2, return_when=FIRST_COMPLETED)
                for fut in done:
                    self._finish(in_flight.pop(fut)[0], fut.result(), t0)
            if in_flight:
                log.warning("stopping: waiting for %d episodes in flight; each ends at its next policy call (aborted)",
                            len(in_flight))
                self._abort.set()
                done, _ = wait(in_flight, timeout=self.config.shutdown_timeout_s)
                for fut in done:
                    self._finish(in_flight.pop(fut)[0], fut.result(), t0)
                for item, emitter in in_flight.values():
                    log.error("episode %s did not stop within %g s; closing it as aborted and abandoning its thread",
                              emitter.episode_id, self.config.shutdown_timeout_s)
                    n = emitter.close(EpisodeStatus.ABORTED, "aborted: stuck at worker shutdown")
                    self.counts.stuck += 1
                    self._finish(item, EpisodeResult(**emitter.base, status=EpisodeStatus.ABORTED, reward=0.0,
                                                     num_events=n), t0)
        finally:
            pool.shutdown(wait=not in_flight, cancel_futures=True)
            if self._held_since is not None:  # a hold still in progress when the run ends counts too
                self.counts.throttled_s += time.monotonic() - self._held_since
                self._held_since = None
        self.counts.elapsed_s = time.monotonic() - t0
        return self.counts

    def _ahead(self, in_flight: int) -> bool:
        """Whether the staleness control holds the next group back (see ``RolloutConfig.samples_per_version``)."""
        per_version = self.config.samples_per_version
        if per_version <= 0:
            return False
        budget = ((self.policy.policy_version - self._first_version + self.config.max_ahead + 1) * per_version
                  + self._released)
        now = time.monotonic()
        if self._judged + in_flight < budget:
            if self._held_since is not None:
                self.counts.throttled_s += now - self._held_since
                self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = now
            return True
        if now - self._held_since < self.config.throttle_release_s:
            return True
        log.warning("staleness control: no new policy version for %.0f s with %d judged episodes (budget %d at "
                    "version %d); starting one more group", now - self._held_since, self._judged, budget,
                    self.policy.policy_version)
        self.counts.throttled_s += now - self._held_since
        self.counts.throttle_releases += 1
        self._held_since = None
        self._released += self.config.group_size
        return False

    def _emitter(self, item: ScheduledTask, policy: Policy, episode_id: str) -> _EpisodeEmitter:
        base = {"episode_id": episode_id, "domain": item.task.domain, "task_id": item.task.task_id,
                "policy_version": policy.policy_version}
        return _EpisodeEmitter(self._emit, episode_id=episode_id, producer_id=self.config.producer_id, base=base)

    def _maybe_reload(self, *, busy: bool) -> bool:
        """Apply a newly published version if possible; True while draining episodes for it."""
        if self.follower is None:
            return False
        event = self.follower.take(newer_than=max(self.policy.policy_version, self._skip_version))
        if event is None:
            return False
        if getattr(self.policy, "reload_in_place", False) and busy:
            return True  # finish the episodes in flight on the old weights first
        old = self.policy.policy_version
        try:
            self.policy = reload_policy(self.policy, event)
        except (TypeError, OSError, ValueError) as err:
            log.error("cannot apply policy version %d from %s: %s; keeping version %d",
                      event.version, event.location, err, old)
            self._skip_version = event.version
            return False
        self.counts.reloads += 1
        log.info("policy version %d -> %d (%s)", old, event.version, event.location)
        return False

    def _finish(self, item: ScheduledTask, result: EpisodeResult, t0: float) -> None:
        c = self.counts
        if result.num_events == 0:  # failed before its first event (e.g. the env could not be built)
            if result.status != EpisodeStatus.ABORTED:
                self.scheduler.report(item, status="error", env_error=True)
            return
        c.episodes += 1
        c.events += result.num_events
        dom = c.domains.setdefault(result.domain, DomainCounts())
        dom.episodes += 1
        dom.events += result.num_events
        c.policy_versions[result.policy_version] = c.policy_versions.get(result.policy_version, 0) + 1
        if result.status in (EpisodeStatus.SUCCESS, EpisodeStatus.FAILURE):
            self._judged += 1
        if result.status == EpisodeStatus.SUCCESS:
            c.passed += 1
            dom.passed += 1
        elif result.status in (EpisodeStatus.ERROR, EpisodeStatus.TIMEOUT):
            c.errors += 1
        if result.status == EpisodeStatus.ABORTED:
            c.aborted += 1  # not reported: the ticket stays open, a persisted scheduler re-queues it
        else:
            self.scheduler.report(item, status=result.status.value, reward=result.reward,
                                  env_error=result.env_error)
        c.elapsed_s = time.monotonic() - t0
        if self.on_episode is not None:
            self.on_episode(result, c)

    # ------------------------------------------------------------------ one episode (pool thread)

    def _run_one(self, item: ScheduledTask, policy: Policy, emitter: _EpisodeEmitter, group: str) -> EpisodeResult:
        task = item.task
        episode_id, base = emitter.episode_id, emitter.base
        env = None
        try:
            env = make_env(task.domain)
            summary: EpisodeSummary = run_episode(
                # `stop` aborts at once (not when the main loop next looks), so a signal ends
                # every episode in flight at its next policy call.
                env, _AbortablePolicy(policy, self._abort, self._stop), task, episode_id=episode_id,
                producer_id=self.config.producer_id, max_steps=self.config.max_steps, emit=emitter,
                task_group=group, group_size=item.group_size, group_member=item.member, sample=item.sample,
                episode_timeout_s=self.config.episode_timeout_s or item.timeout_s, purpose=self.config.purpose,
            )
            return EpisodeResult(**base, status=summary.status, reward=summary.reward,
                                 num_events=summary.num_events, env_error=summary.env_error)
        except EpisodeAborted:
            status, why = EpisodeStatus.ABORTED, "aborted: the rollout worker shut down"
        except Exception as err:  # a bug in one episode must not kill the worker
            log.exception("episode %s crashed", episode_id)
            status, why = EpisodeStatus.ERROR, f"worker error: {type(err).__name__}: {err}"
        finally:
            if env is not None:
                env.close()
        # Nothing is emitted for an episode without events; one the main thread already
        # closed (stuck at shutdown) is not closed twice.
        return EpisodeResult(**base, status=status, reward=0.0, num_events=emitter.close(status, why))
