"""Task scheduler for many domains: weights, curriculum, retries, circuit breakers, resumable.

Which task a rollout worker runs next::

    1. a retry whose back-off has passed (long-tail tasks that timed out or hit an env error)
    2. an explicitly submitted task, highest priority first
    3. a fresh task: domain ~ weight, difficulty from that domain's curriculum level

**Weights.** Domain ``d`` is drawn with probability proportional to
``base_d * (p_d (1 - p_d) + eps)`` when adaptive (``base_d`` otherwise), where
``p_d`` is an exponential moving average of the pass rate at the domain's
current level. ``p (1 - p)`` is the variance of a Bernoulli pass: largest when
the policy passes half the time, vanishing for domains it always or never
solves, which teach little (the same argument as GRPO's zero-advantage groups;
cf. "prioritised level replay", Jiang et al. 2021). ``eps`` keeps every domain
alive. Draws use a Fenwick tree over domain weights: O(log D) per draw and per
weight update, so hundreds of domains cost nothing.

**Curriculum.** Each domain has a level ``0..max_difficulty``. After
``min_attempts`` results at the current level it moves up when ``p >=
promote_at`` and down when ``p <= demote_at`` (``p`` restarts at 0.5 on a move).
A share ``review_fraction`` of draws goes to easier levels.

**Retries.** A task that timed out or ended in error is re-queued with attempt
+ 1 after ``min(backoff_max_s, backoff_base_s * 2**attempt)`` seconds (with
deterministic jitter), at most ``max_retries`` times; then it counts as a
failure. Tickets not reported within ``task_timeout_s`` (a dead worker) are
treated as timeouts.

**Circuit breaker per domain.** ``breaker_threshold`` consecutive
*environment* failures (``env_error=True``: sandbox down, env crash; a policy
failing its task is not one) open the domain's breaker: weight 0, its retries
wait, the other domains go on. After ``breaker_cooldown_s`` it half-opens and
lets one trial task through; a result without env error closes it, another env
failure opens it again.

**Groups.** :meth:`TaskScheduler.next_group` hands out ``size`` tickets of
one task (GRPO groups: several samples of one prompt, so a group baseline has
something to compare): members ``0..size-1`` of round ``r`` (a counter of the
groups this scheduler formed). Each member is reported on its own. A retry
(after a timeout or error) runs alone: its group already closed without it.

**Held-out tasks.** Tasks of the evaluation namespace
(:mod:`rollout.heldout`) are never handed out: a fresh draw that generates
one (same content as a held-out task) is skipped for the next index,
:meth:`TaskScheduler.submit` refuses one, and negative seeds (the evaluation
namespace) are refused.

**State.** Everything dynamic (levels, pass rates, breakers, queues, in-flight
tickets, counters, RNG) is saved to ``state_path`` as JSON by write-to-temp +
fsync + rename; a restarted scheduler resumes, re-queueing tickets that were in
flight (at-least-once).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import msgspec

from rollout.envs.base import Task
from rollout.heldout import is_heldout

__all__ = [
    "SchedulerConfig",
    "ScheduledTask",
    "DomainState",
    "TaskScheduler",
    "ResultStatus",
]

ResultStatus = Literal["success", "failure", "timeout", "error"]
STATE_VERSION = 2
#: State files this code still reads (version 1 has no group rounds).
_READABLE_STATE_VERSIONS = (1, 2)
#: Consecutive held-out tasks a fresh draw skips before it gives up.
_MAX_HELDOUT_SKIPS = 1000


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings.

    Attributes:
        domain_weights: base sampling weight per domain (> 0); the domains scheduled.
        max_difficulty: highest level per domain (missing domains use ``default_max_difficulty``).
        default_max_difficulty: highest level for domains not in ``max_difficulty``.
        adaptive: weight toward domains whose pass rate is neither ~0 nor ~1.
        adaptive_eps: floor added to ``p(1-p)`` so no domain starves.
        ema_alpha: weight of the newest result in the pass-rate average.
        promote_at: move up a level when the pass rate reaches this.
        demote_at: move down a level when the pass rate falls to this.
        min_attempts: results needed at a level before it can move.
        review_fraction: share of draws from levels below the current one.
        task_timeout_s: a ticket not reported within this many seconds counts as timed out.
        max_retries: retries per task after a timeout or error.
        backoff_base_s: first retry delay, seconds; doubles per attempt.
        backoff_max_s: cap on the retry delay, seconds.
        breaker_threshold: consecutive env failures that open a domain's breaker.
        breaker_cooldown_s: seconds an open breaker waits before half-opening.
        seed: seed of draws, task indices and jitter; >= 0 (negative seeds are the
            held-out evaluation namespace, :data:`rollout.heldout.EVAL_SEED`).
    """

    domain_weights: dict[str, float]
    max_difficulty: dict[str, int] = field(default_factory=dict)
    default_max_difficulty: int = 2
    adaptive: bool = True
    adaptive_eps: float = 0.05
    ema_alpha: float = 0.1
    promote_at: float = 0.8
    demote_at: float = 0.2
    min_attempts: int = 20
    review_fraction: float = 0.2
    task_timeout_s: float = 600.0
    max_retries: int = 3
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 30.0
    seed: int = 0
    task_pool: int = 0

    def __post_init__(self) -> None:
        if not self.domain_weights:
            raise ValueError("`domain_weights` must name at least one domain")
        bad = {d: w for d, w in self.domain_weights.items() if not (w > 0 and math.isfinite(w))}
        if bad:
            raise ValueError(f"`domain_weights` must be finite and > 0; got {bad}")
        if not 0 <= self.demote_at < self.promote_at <= 1:
            raise ValueError(f"need 0 <= demote_at < promote_at <= 1, got {self.demote_at}, {self.promote_at}")
        if self.max_retries < 0 or self.breaker_threshold < 1 or self.min_attempts < 1:
            raise ValueError("`max_retries` must be >= 0, `breaker_threshold` and `min_attempts` >= 1")
        if self.seed < 0:
            raise ValueError(f"`seed` must be >= 0 (negative seeds are the held-out evaluation namespace), "
                             f"got {self.seed}")
        if self.task_pool < 0:
            raise ValueError(f"`task_pool` must be >= 0 (0: no pool), got {self.task_pool}")
        if not 0 < self.ema_alpha <= 1 or not 0 <= self.review_fraction < 1:
            raise ValueError("`ema_alpha` must be in (0, 1] and `review_fraction` in [0, 1)")


class ScheduledTask(msgspec.Struct, kw_only=True):
    """A task handed to a worker.

    Attributes:
        ticket: id to pass back to :meth:`TaskScheduler.report`.
        task: the task.
        attempt: 0 for the first try, then 1.. for retries.
        priority: higher runs first among submitted tasks and retries.
        timeout_s: the worker should give the episode at most this long.
        issued_at: scheduler clock time it was handed out.
        trial: True if it is the half-open breaker's trial task.
        group_size: tickets of this task handed out together as one group (1: alone).
        member: this ticket's index in its group, ``0..group_size-1``.
        round: the group's number among the groups this scheduler formed.
    """

    ticket: int
    task: Task
    attempt: int = 0
    priority: int = 0
    timeout_s: float = 600.0
    issued_at: float = 0.0
    trial: bool = False
    group_size: int = 1
    member: int = 0
    round: int = 0

    @property
    def sample(self) -> str:
        """The sample key of this ticket: ``<round>.<member>.<attempt>`` (mixed into sampling seeds)."""
        return f"{self.round}.{self.member}.{self.attempt}"


class DomainState(msgspec.Struct, kw_only=True):
    """Per-domain dynamic state (persisted).

    Attributes:
        level: current curriculum level.
        pass_rate: EMA of passes at ``level`` (0.5 when unknown).
        attempts_at_level: results counted at ``level``.
        next_index: index of the next fresh task (task ids stay unique over restarts).
        consecutive_env_failures: env failures since the last clean result.
        breaker: ``closed``, ``open`` or ``half_open``.
        open_until: clock time an open breaker half-opens.
        trial_in_flight: a half-open trial task is out.
        issued: tasks handed out; ``passed``/``failed``/``env_failures``/``gave_up``: result counts.
    """

    level: int = 0
    pass_rate: float = 0.5
    attempts_at_level: int = 0
    next_index: int = 0
    consecutive_env_failures: int = 0
    breaker: str = "closed"
    open_until: float = 0.0
    trial_in_flight: bool = False
    issued: int = 0
    passed: int = 0
    failed: int = 0
    env_failures: int = 0
    gave_up: int = 0


class _Fenwick:
    """Prefix sums over non-negative weights with O(log n) update and weighted search."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0.0] * (n + 1)
        self.values = [0.0] * n

    def set(self, i: int, value: float) -> None:
        delta = value - self.values[i]
        self.values[i] = value
        j = i + 1
        while j <= self.n:
            self.tree[j] += delta
            j += j & -j

    def total(self) -> float:
        return math.fsum(self.values) if self.n < 64 else self._prefix(self.n)

    def _prefix(self, j: int) -> float:
        s = 0.0
        while j > 0:
            s += self.tree[j]
            j -= j & -j
        return s

    def find(self, r: float) -> int:
        """Smallest i with prefix(i + 1) > r."""
        pos, step = 0, 1 << self.n.bit_length()
        while step:
            nxt = pos + step
            if nxt <= self.n and self.tree[nxt] <= r:
                pos = nxt
                r -= self.tree[nxt]
            step >>= 1
        return min(pos, self.n - 1)


def _default_factory(seed: int) -> Callable[[str, int, int], Task]:
    from rollout.envs import generate_tasks

    def make(domain: str, difficulty: int, index: int) -> Task:
        return generate_tasks(domain, 1, seed=seed, difficulty=difficulty, start=index)[0]

    return make


class TaskScheduler:
    """Hands out tasks across domains; see the module docstring for the policy.

    Args:
        config: the settings.
        task_factory: ``(domain, difficulty, index) -> Task``; default: the registered
            environments' generators with ``config.seed``.
        state_path: JSON file to persist state to (loaded if it exists).
        autosave_every: save after this many :meth:`report` calls (0 = only on :meth:`save`).
        clock: time source, seconds (wall clock by default so state survives restarts).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        task_factory: Callable[[str, int, int], Task] | None = None,
        state_path: str | os.PathLike[str] | None = None,
        autosave_every: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._factory = task_factory or _default_factory(config.seed)
        self.state_path = Path(state_path) if state_path is not None else None
        self.autosave_every = autosave_every
        self._clock = clock
        self._names = sorted(config.domain_weights)
        self._index = {d: i for i, d in enumerate(self._names)}
        self.domains: dict[str, DomainState] = {d: DomainState() for d in self._names}
        self._rng = random.Random(f"scheduler:{config.seed}")
        self._tree = _Fenwick(len(self._names))
        self._retries: list[tuple[float, int, int, ScheduledTask]] = []  # (ready_at, -priority, seq, item)
        self._submitted: list[tuple[int, int, ScheduledTask]] = []  # (-priority, seq, item)
        self._in_flight: dict[int, ScheduledTask] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._reopen: list[tuple[float, str]] = []
        self._seq = 0
        self._next_ticket = 1
        self._next_round = 0
        self._reports = 0
        self._updates = 0
        if self.state_path is not None and self.state_path.exists():
            self._load(self.state_path)
        for d in self._names:
            self._refresh(d)

    # ------------------------------------------------------------------ weights

    def _max_level(self, domain: str) -> int:
        return self.config.max_difficulty.get(domain, self.config.default_max_difficulty)

    def _weight(self, domain: str) -> float:
        st = self.domains[domain]
        if st.breaker == "open" or (st.breaker == "half_open" and st.trial_in_flight):
            return 0.0
        base = self.config.domain_weights[domain]
        if not self.config.adaptive:
            return base
        p = st.pass_rate
        return base * (p * (1.0 - p) + self.config.adaptive_eps)

    def _refresh(self, domain: str) -> None:
        self._tree.set(self._index[domain], self._weight(domain))
        self._updates += 1
        if self._updates % 100_000 == 0:  # wash out accumulated float error
            tree = _Fenwick(len(self._names))
            for i, v in enumerate(self._tree.values):
                tree.set(i, v)
            self._tree = tree

    def weights(self) -> dict[str, float]:
        """Current draw probability of each domain (0 for blocked domains)."""
        total = sum(self._tree.values)
        return {d: (self._tree.values[i] / total if total else 0.0) for d, i in self._index.items()}

    # ------------------------------------------------------------------ issuing

    def submit(self, task: Task, *, priority: int = 1) -> None:
        """Queue a specific task; submitted tasks run before fresh draws, highest priority first.

        Raises:
            ValueError: the task's domain is not scheduled, or it is a held-out evaluation task.
        """
        if task.domain not in self._index:
            raise ValueError(f"task domain {task.domain!r} is not in `domain_weights`")
        if is_heldout(task):
            raise ValueError(f"task {task.task_id} is a held-out evaluation task (rollout.heldout); "
                             "training never runs it: evaluate with `trajpipe eval`")
        item = ScheduledTask(ticket=0, task=task, priority=priority, timeout_s=self.config.task_timeout_s)
        self._seq += 1
        heapq.heappush(self._submitted, (-priority, self._seq, item))

    def _allowed(self, domain: str) -> bool:
        st = self.domains[domain]
        return st.breaker == "closed" or (st.breaker == "half_open" and not st.trial_in_flight)

    def _tick(self, now: float) -> None:
        while self._reopen and self._reopen[0][0] <= now:
            _, domain = heapq.heappop(self._reopen)
            st = self.domains.get(domain)
            if st is not None and st.breaker == "open" and st.open_until <= now:
                st.breaker, st.trial_in_flight = "half_open", False
                self._refresh(domain)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket = heapq.heappop(self._deadlines)
            if ticket in self._in_flight:
                self.report(ticket, status="timeout")

    def _issue(self, item: ScheduledTask, now: float) -> ScheduledTask:
        domain = item.task.domain
        st = self.domains[domain]
        item.ticket, item.issued_at = self._next_ticket, now
        self._next_ticket += 1
        item.trial = st.breaker == "half_open"
        if item.trial:
            st.trial_in_flight = True
            self._refresh(domain)
        st.issued += 1
        self._in_flight[item.ticket] = item
        heapq.heappush(self._deadlines, (now + item.timeout_s, item.ticket))
        return item

    def next_task(self) -> ScheduledTask | None:
        """The next task to run, or None if every domain is blocked and nothing is ready.

        Cost: O(log D) for a fresh draw (plus queued retries of blocked domains).
        """
        now = self._clock()
        self._tick(now)
        skipped = []
        chosen = None
        while self._retries and self._retries[0][0] <= now:
            entry = heapq.heappop(self._retries)
            if self._allowed(entry[3].task.domain):
                chosen = entry[3]
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._retries, entry)
        if chosen is not None:
            return self._issue(chosen, now)
        skipped_sub = []
        while self._submitted:
            entry = heapq.heappop(self._submitted)
            if self._allowed(entry[2].task.domain):
                chosen = entry[2]
                break
            skipped_sub.append(entry)
        for entry in skipped_sub:
            heapq.heappush(self._submitted, entry)
        if chosen is not None:
            return self._issue(chosen, now)
        total = self._tree.total()
        if total <= 0:
            return None
        domain = self._names[self._tree.find(self._rng.random() * total)]
        if not self._allowed(domain):  # float edge of the search; fall back to a linear pick
            candidates = [d for d in self._names if self._allowed(d)]
            if not candidates:
                return None
            domain = self._rng.choice(candidates)
        st = self.domains[domain]
        level = st.level
        if level > 0 and self._rng.random() < self.config.review_fraction:
            level = self._rng.randrange(level)
        pool = self.config.task_pool
        for _ in range(_MAX_HELDOUT_SKIPS):
            task = self._factory(domain, level, st.next_index % pool if pool else st.next_index)
            st.next_index += 1
            if not is_heldout(task):
                break
        else:
            raise RuntimeError(f"{domain} level {level}: {_MAX_HELDOUT_SKIPS} draws in a row were held-out "
                               "evaluation tasks; the task space is too small to train on apart from them")
        return self._issue(ScheduledTask(ticket=0, task=task, timeout_s=self.config.task_timeout_s), now)

    def next_group(self, size: int) -> list[ScheduledTask]:
        """``size`` tickets of the next task (see :meth:`next_task`), members of one group.

        A retry comes back alone (a list of one): the group it belonged to closed without it.

        Raises:
            ValueError: ``size < 1``.
        """
        if size < 1:
            raise ValueError(f"group `size` must be >= 1, got {size}")
        first = self.next_task()
        if first is None:
            return []
        first.round = self._next_round
        self._next_round += 1
        if size == 1 or first.attempt > 0:
            first.group_size, first.member = 1, 0
            return [first]
        first.group_size, first.member = size, 0
        group = [first]
        for member in range(1, size):
            group.append(self._issue(ScheduledTask(
                ticket=0, task=first.task, priority=first.priority, timeout_s=first.timeout_s,
                group_size=size, member=member, round=first.round), first.issued_at))
        return group

    # ------------------------------------------------------------------ results

    def report(self, ticket: int | ScheduledTask, *, status: ResultStatus, reward: float = 0.0,
               env_error: bool = False) -> None:
        """Record how a ticket ended.

        Args:
            ticket: the ticket (or the ScheduledTask) from :meth:`next_task`.
            status: ``success``/``failure`` (the task was judged) or ``timeout``/``error``.
            reward: the outcome reward (kept for the caller's metrics; pass rate uses ``status``).
            env_error: the environment failed (feeds the circuit breaker).

        Raises:
            KeyError: unknown or already-reported ticket.
            ValueError: unknown ``status``.
        """
        if status not in ("success", "failure", "timeout", "error"):
            raise ValueError(f"`status` must be success, failure, timeout or error, got {status!r}")
        tid = ticket.ticket if isinstance(ticket, ScheduledTask) else ticket
        try:
            item = self._in_flight.pop(tid)
        except KeyError:
            raise KeyError(f"ticket {tid} is not in flight (unknown or already reported)") from None
        now = self._clock()
        domain = item.task.domain
        st = self.domains[domain]
        if item.trial:
            st.trial_in_flight = False
        if env_error:
            st.env_failures += 1
            st.consecutive_env_failures += 1
            if st.breaker == "half_open" or st.consecutive_env_failures >= self.config.breaker_threshold:
                st.breaker, st.open_until = "open", now + self.config.breaker_cooldown_s
                heapq.heappush(self._reopen, (st.open_until, domain))
        else:
            st.consecutive_env_failures = 0
            if st.breaker == "half_open":
                st.breaker = "closed"
        if status in ("timeout", "error"):
            if item.attempt < self.config.max_retries:
                self._schedule_retry(item, now)
            else:
                st.gave_up += 1
                self._count_result(domain, item.task.difficulty, passed=False)
        else:
            self._count_result(domain, item.task.difficulty, passed=status == "success")
        self._refresh(domain)
        self._reports += 1
        if self.state_path is not None and self.autosave_every and self._reports % self.autosave_every == 0:
            self.save()

    def _schedule_retry(self, item: ScheduledTask, now: float) -> None:
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * (2 ** item.attempt))
        jitter = random.Random(f"{self.config.seed}:{item.task.task_id}:{item.attempt}").uniform(0.8, 1.0)
        retry = ScheduledTask(ticket=0, task=item.task, attempt=item.attempt + 1, priority=item.priority,
                              timeout_s=item.timeout_s)
        self._seq += 1
        heapq.heappush(self._retries, (now + delay * jitter, -retry.priority, self._seq, retry))

    def _count_result(self, domain: str, difficulty: int, *, passed: bool) -> None:
        st = self.domains[domain]
        if passed:
            st.passed += 1
        else:
            st.failed += 1
        if difficulty != st.level:
            return  # review draws and stale levels do not steer the curriculum
        a = self.config.ema_alpha
        st.pass_rate = (1 - a) * st.pass_rate + a * (1.0 if passed else 0.0)
        st.attempts_at_level += 1
        if st.attempts_at_level < self.config.min_attempts:
            return
        if st.pass_rate >= self.config.promote_at and st.level < self._max_level(domain):
            st.level, st.pass_rate, st.attempts_at_level = st.level + 1, 0.5, 0
        elif st.pass_rate <= self.config.demote_at and st.level > 0:
            st.level, st.pass_rate, st.attempts_at_level = st.level - 1, 0.5, 0

    # ------------------------------------------------------------------ inspection

    @property
    def in_flight(self) -> int:
        """Tickets handed out and not yet reported."""
        return len(self._in_flight)

    @property
    def pending_retries(self) -> int:
        """Retries waiting (for their back-off or an open breaker)."""
        return len(self._retries)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """The dynamic state as a JSON-serialisable dict."""
        rng_state = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "seq": self._seq,
            "next_ticket": self._next_ticket,
            "next_round": self._next_round,
            "rng": [rng_state[0], list(rng_state[1]), rng_state[2]],
            "domains": {d: msgspec.to_builtins(st) for d, st in self.domains.items()},
            "retries": [[r[0], msgspec.to_builtins(r[3])] for r in self._retries],
            "submitted": [msgspec.to_builtins(s[2]) for s in self._submitted],
            "in_flight": [msgspec.to_builtins(item) for item in self._in_flight.values()],
        }

    def save(self) -> None:
        """Write the state to ``state_path`` atomically (temp file, fsync, rename).

        Raises:
            ValueError: the scheduler has no ``state_path``.
        """
        if self.state_path is None:
            raise ValueError("this scheduler has no `state_path`; pass one to persist state")
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.state_dict(), separators=(",", ":")).encode()
        fd, tmp = tempfile.mkstemp(dir=self.state_path.parent, prefix=self.state_path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.state_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.state_path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _load(self, path: Path) -> None:
        doc = json.loads(path.read_text())
        if doc.get("version") not in _READABLE_STATE_VERSIONS:
            raise ValueError(f"scheduler state {path} has version {doc.get('version')}; this scheduler reads "
                             f"versions {_READABLE_STATE_VERSIONS}")
        self._seq, self._next_ticket = int(doc["seq"]), int(doc["next_ticket"])
        self._next_round = int(doc.get("next_round", 0))
        version, internal, gauss = doc["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        for d, raw in doc["domains"].items():
            if d in self.domains:
                st = msgspec.convert(raw, DomainState)
                st.trial_in_flight = False
                self.domains[d] = st
                if st.breaker == "open":
                    heapq.heappush(self._reopen, (st.open_until, d))
        now = self._clock()
        for ready_at, raw in doc["retries"]:
            item = msgspec.convert(raw, ScheduledTask)
            if item.task.domain in self.domains:
                heapq.heappush(self._retries, (ready_at, -item.priority, self._bump(), item))
        for raw in doc["submitted"]:
            item = msgspec.convert(raw, ScheduledTask)
            if item.task.domain in self.domains:
                heapq.heappush(self._submitted, (-item.priority, self._bump(), item))
        for raw in doc["in_flight"]:  # lost with the old process: run them again, same attempt
            item = msgspec.convert(raw, ScheduledTask)
            if item.task.domain in self.domains:
                item.trial = False
                heapq.heappush(self._retries, (now, -item.priority, self._bump(), item))

    def _bump(self) -> int:
        self._seq += 1
        return self._seq
