"""Scheduler: weights, curriculum, bounded retries with back-off, breakers, restart, 200+ domains."""

from __future__ import annotations

import collections
import time

import pytest

from rollout.envs.base import Task
from rollout.scheduler import SchedulerConfig, TaskScheduler


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def synthetic(domain, difficulty, index):
    return Task(domain=domain, difficulty=difficulty, task_id=f"{domain}-{difficulty}-{index}", spec={}, prompt="p")


def make(weights, clock=None, **kw):
    cfg = SchedulerConfig(domain_weights=weights, **kw)
    return TaskScheduler(cfg, task_factory=synthetic, clock=clock or Clock(), autosave_every=0)


def test_static_weights_are_respected():
    s = make({"a": 1.0, "b": 2.0, "c": 7.0}, adaptive=False)
    counts = collections.Counter()
    n = 20_000
    for _ in range(n):
        item = s.next_task()
        counts[item.task.domain] += 1
        s.report(item, status="success")
    # expected 10% / 20% / 70%; binomial sd at n=20000 is <= 0.35 percentage points
    for d, share in {"a": 0.1, "b": 0.2, "c": 0.7}.items():
        assert abs(counts[d] / n - share) < 0.015


def test_adaptive_weights_favour_uncertain_domains():
    s = make({"solved": 1.0, "hard": 1.0, "mixed": 1.0}, min_attempts=10_000)
    outcomes = {"solved": lambda i: True, "hard": lambda i: False, "mixed": lambda i: i % 2 == 0}
    for i in range(3000):
        item = s.next_task()
        s.report(item, status="success" if outcomes[item.task.domain](i) else "failure")
    w = s.weights()
    # p -> 1, 0, 0.5: weights ∝ eps, eps, 0.25 + eps = 0.05, 0.05, 0.30
    assert w["mixed"] > 4 * w["solved"] and w["mixed"] > 4 * w["hard"]
    assert w["solved"] > 0 and w["hard"] > 0


def test_curriculum_moves_up_and_down():
    s = make({"a": 1.0}, min_attempts=10, review_fraction=0.0, default_max_difficulty=2)
    for _ in range(200):
        item = s.next_task()
        s.report(item, status="success")
    assert s.domains["a"].level == 2  # promoted to the top as the pass rate rose
    assert s.next_task().task.difficulty == 2
    s2 = make({"a": 1.0}, min_attempts=10, review_fraction=0.0)
    s2.domains["a"].level = 2
    for _ in range(100):
        s2.report(s2.next_task(), status="failure")
    assert s2.domains["a"].level == 0


def test_retries_are_bounded_with_exponential_backoff():
    clock = Clock()
    s = make({"a": 1.0}, clock=clock, max_retries=3, backoff_base_s=10, backoff_max_s=1000)
    item = s.next_task()
    first_id = item.task.task_id
    attempts, gaps = [item.attempt], []
    for _ in range(3):
        s.report(item, status="timeout")
        t0 = clock.t
        while True:  # wait for the back-off; fresh draws in between are not the retry
            clock.t += 1
            nxt = s.next_task()
            if nxt.task.task_id == first_id:
                break
            s.report(nxt, status="success")
        gaps.append(clock.t - t0)
        attempts.append(nxt.attempt)
        item = nxt
    s.report(item, status="timeout")
    assert attempts == [0, 1, 2, 3]
    # delays 10, 20, 40 s times jitter in [0.8, 1.0]
    for gap, base in zip(gaps, (10, 20, 40)):
        assert 0.8 * base <= gap <= base + 1
    assert s.domains["a"].gave_up == 1 and s.pending_retries == 0


def test_unreported_ticket_times_out_and_is_retried():
    clock = Clock()
    s = make({"a": 1.0}, clock=clock, task_timeout_s=60, backoff_base_s=1)
    lost = s.next_task()
    clock.t += 61
    s.next_task()  # reaps the expired ticket
    with pytest.raises(KeyError):
        s.report(lost, status="success")
    clock.t += 5
    assert s.next_task().task.task_id == lost.task.task_id


def test_breaker_opens_half_opens_and_closes_while_others_continue():
    clock = Clock()
    s = make({"bad": 1.0, "good": 1.0}, clock=clock, adaptive=False, breaker_threshold=3,
             breaker_cooldown_s=30, max_retries=0)
    env_errors = 0
    while env_errors < 3:
        item = s.next_task()
        if item.task.domain == "bad":
            s.report(item, status="error", env_error=True)
            env_errors += 1
        else:
            s.report(item, status="failure")  # task failures never trip the breaker
    assert s.domains["bad"].breaker == "open"
    for _ in range(200):
        item = s.next_task()
        assert item.task.domain == "good"
        s.report(item, status="success")
    clock.t += 31
    seen_trial = None
    for _ in range(200):
        item = s.next_task()
        if item.task.domain == "bad":
            seen_trial = item
            break
        s.report(item, status="success")
    assert seen_trial is not None and seen_trial.trial and s.domains["bad"].breaker == "half_open"
    assert s.weights()["bad"] == 0.0  # one trial at a time
    s.report(seen_trial, status="error", env_error=True)
    assert s.domains["bad"].breaker == "open"  # failed trial re-opens
    clock.t += 31
    while True:
        item = s.next_task()
        if item.task.domain == "bad":
            s.report(item, status="failure")  # a clean result (even a task failure) closes it
            break
        s.report(item, status="success")
    assert s.domains["bad"].breaker == "closed"


def test_state_survives_restart(tmp_path):
    clock = Clock()
    path = tmp_path / "sched.json"
    cfg = SchedulerConfig(domain_weights={"a": 1.0, "b": 3.0}, min_attempts=5, review_fraction=0.0,
                          breaker_threshold=2, breaker_cooldown_s=100, backoff_base_s=50)
    s = TaskScheduler(cfg, task_factory=synthetic, state_path=path, clock=clock)
    for _ in range(40):
        item = s.next_task()
        if item.task.domain == "a":
            s.report(item, status="error", env_error=True)
        else:
            s.report(item, status="success")
    in_flight = s.next_task()
    s.save()
    before = s.state_dict()
    s2 = TaskScheduler(cfg, task_factory=synthetic, state_path=path, clock=clock)
    assert s2.domains == s.domains
    assert s2.domains["b"].level > 0 and s2.domains["a"].breaker == "open"
    assert s2.pending_retries == before["retries"].__len__() + 1  # the lost in-flight ticket is re-queued
    # it resumes: the next draws continue the task index sequence, nothing is repeated
    nxt = s2.next_task()
    assert nxt.task.task_id == in_flight.task.task_id  # the in-flight one runs again first
    fresh = s2.next_task()
    assert fresh.task.task_id not in {in_flight.task.task_id} and fresh.task.domain == "b"
    assert int(fresh.task.task_id.rsplit("-", 1)[1]) == s.domains["b"].next_index
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files


def test_scales_to_hundreds_of_domains():
    n = 300
    weights = {f"d{i:03d}": 1.0 + (i % 7) for i in range(n)}
    s = make(weights, adaptive=True, breaker_threshold=1, breaker_cooldown_s=1e9, max_retries=0)
    broken = {f"d{i:03d}" for i in range(0, n, 10)}
    counts = collections.Counter()
    t0 = time.perf_counter()
    draws = 30_000
    for i in range(draws):
        item = s.next_task()
        counts[item.task.domain] += 1
        d = item.task.domain
        s.report(item, status="error" if d in broken else ("success" if i % 3 else "failure"), env_error=d in broken)
    per_draw_us = (time.perf_counter() - t0) / draws * 1e6
    assert all(s.domains[d].breaker == "open" for d in broken)
    assert all(counts[d] == 1 for d in broken)  # one env error each, then no more traffic
    assert len(counts) == n  # every domain got traffic
    assert per_draw_us < 500, per_draw_us


def test_config_validation():
    with pytest.raises(ValueError, match="domain_weights"):
        SchedulerConfig(domain_weights={})
    with pytest.raises(ValueError, match="domain_weights"):
        SchedulerConfig(domain_weights={"a": 0.0})
    with pytest.raises(ValueError, match="promote_at"):
        SchedulerConfig(domain_weights={"a": 1.0}, promote_at=0.1, demote_at=0.5)


def test_groups_are_g_tickets_of_one_task_and_retries_run_alone(tmp_path):
    clock = Clock()
    s = TaskScheduler(SchedulerConfig(domain_weights={"a": 1.0}, max_retries=2, backoff_base_s=1.0),
                      task_factory=synthetic, clock=clock, state_path=tmp_path / "state.json", autosave_every=1)
    g0, g1 = s.next_group(4), s.next_group(4)
    assert [t.member for t in g0] == [0, 1, 2, 3] and {t.group_size for t in g0} == {4}
    assert len({t.ticket for t in g0 + g1}) == 8 and {t.task.task_id for t in g0} == {g0[0].task.task_id}
    assert g0[0].task.task_id != g1[0].task.task_id and (g0[0].round, g1[0].round) == (0, 1)
    assert len({t.sample for t in g0}) == 4  # distinct sampling keys per member
    for t in g0[:3] + g1:
        s.report(t, status="success")
    s.report(g0[3], status="timeout")  # a member timed out: retried later, alone
    clock.t += 10
    retry = s.next_group(4)
    assert len(retry) == 1 and retry[0].attempt == 1 and retry[0].group_size == 1
    assert retry[0].task.task_id == g0[0].task.task_id and retry[0].round == 2
    # Rounds survive a restart (state version 2); the retry in flight is handed out again.
    s.save()
    again = TaskScheduler(SchedulerConfig(domain_weights={"a": 1.0}), task_factory=synthetic, clock=clock,
                          state_path=tmp_path / "state.json")
    back = again.next_group(2)
    assert back[0].round == 3 and back[0].task.task_id == g0[0].task.task_id and len(back) == 1
    with pytest.raises(ValueError, match="group `size` must be >= 1"):
        s.next_group(0)


def test_task_pool_repeats_a_fixed_set_of_tasks():
    s = TaskScheduler(SchedulerConfig(domain_weights={"a": 1.0}, task_pool=2, min_attempts=10_000),
                      task_factory=synthetic, clock=Clock(), autosave_every=0)
    ids = [s.next_task().task.task_id for _ in range(6)]
    assert ids == ["a-0-0", "a-0-1"] * 3
    with pytest.raises(ValueError, match="task_pool"):
        SchedulerConfig(domain_weights={"a": 1.0}, task_pool=-1)


def test_pinned_levels_draw_only_those_levels_and_ignore_the_curriculum():
    s = TaskScheduler(SchedulerConfig(domain_weights={"a": 1.0}, levels=(0, 2), min_attempts=1, promote_at=0.5),
                      task_factory=synthetic, clock=Clock(), autosave_every=0)
    levels = []
    for _ in range(60):
        t = s.next_task()
        levels.append(t.task.difficulty)
        s.report(t, status="success")  # would promote an unpinned scheduler every time
    assert set(levels) == {0, 2} and 15 < levels.count(0) < 45
    with pytest.raises(ValueError, match="levels"):
        SchedulerConfig(domain_weights={"a": 1.0}, levels=(-1,))


def test_make_scheduler_refuses_a_level_above_the_domain_range():
    from rollout.worker import make_scheduler

    assert make_scheduler(["tools"], levels=(0, 1)).config.levels == (0, 1)
    with pytest.raises(ValueError, match="tools/7"):
        make_scheduler(["tools"], levels=(7,))
