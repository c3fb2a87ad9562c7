"""Held-out evaluation tasks: fixed per domain and level, disjoint (by content) from what training draws."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rollout.envs import domains, generate_tasks, max_difficulty
from rollout.evaluate import EvalConfig, EvalError, HeldoutTaskSource, eval_tasks, resolve_version
from rollout.heldout import EVAL_POOL, EVAL_SEED, heldout_tasks, is_heldout, task_fingerprint
from rollout.reload import make_policy_published
from rollout.scheduler import SchedulerConfig, TaskScheduler
from trajpipe.cli import app


def test_the_namespace_is_fixed_distinct_and_per_domain_and_level():
    for d in domains():
        for level in range(max_difficulty(d) + 1):
            tasks = heldout_tasks(d, level, EVAL_POOL)
            assert len({task_fingerprint(t) for t in tasks}) == EVAL_POOL  # no problem twice
            assert {(t.domain, t.difficulty) for t in tasks} == {(d, level)}
            assert [t.task_id for t in heldout_tasks(d, level, 3)] == [t.task_id for t in tasks[:3]]
    assert EVAL_SEED < 0


@pytest.mark.parametrize("domain,level", [("code", 2), ("math", 1), ("code", 0)])
def test_training_draws_never_hand_out_a_held_out_problem(domain, level):
    # These levels have small task spaces: the training seed generates held-out problems too...
    raw = generate_tasks(domain, 1500, seed=0, difficulty=level)
    assert any(is_heldout(t) for t in raw), "the check below would prove nothing"
    # ...and the scheduler skips every one of them.
    sched = TaskScheduler(SchedulerConfig(domain_weights={domain: 1.0}, review_fraction=0.0, seed=0),
                          autosave_every=0)
    sched.domains[domain].level = level
    drawn = [sched.next_task().task for _ in range(1500)]
    assert {t.difficulty for t in drawn} == {level}
    assert not any(is_heldout(t) for t in drawn)
    assert len({t.task_id for t in drawn}) == 1500


def test_a_task_pool_skips_held_out_problems_too():
    sched = TaskScheduler(SchedulerConfig(domain_weights={"code": 1.0}, review_fraction=0.0, task_pool=200),
                          autosave_every=0)
    sched.domains["code"].level = 2
    assert not any(is_heldout(sched.next_task().task) for _ in range(600))


def test_the_scheduler_refuses_held_out_tasks_and_negative_seeds():
    sched = TaskScheduler(SchedulerConfig(domain_weights={"math": 1.0}), autosave_every=0)
    with pytest.raises(ValueError, match="held-out evaluation task"):
        sched.submit(heldout_tasks("math", 0, 1)[0])
    sched.submit(generate_tasks("docqa", 1, seed=0)[0].__class__(
        domain="math", difficulty=0, task_id="mine", spec={"custom": 1}, prompt="p"))  # any other task is fine
    with pytest.raises(ValueError, match="evaluation namespace"):
        SchedulerConfig(domain_weights={"math": 1.0}, seed=EVAL_SEED)


def test_eval_config_and_task_source():
    cfg = EvalConfig(domains=("math", "docqa"), levels=(0, 1), tasks_per_level=3)
    tasks = eval_tasks(cfg)
    assert [(t.domain, t.difficulty) for t in tasks[::3]] == [("math", 0), ("math", 1), ("docqa", 0), ("docqa", 1)]
    assert all(is_heldout(t) for t in tasks)
    src = HeldoutTaskSource(tasks)
    got = []
    while items := src.next_group(4):
        assert len(items) == 1 and items[0].group_size == 1
        got.append(items[0].task.task_id)
    assert got == [t.task_id for t in tasks]
    with pytest.raises(EvalError, match="0..2"):
        eval_tasks(EvalConfig(domains=("math",), levels=(3,)))
    with pytest.raises(EvalError, match=f"1..{EVAL_POOL}"):
        eval_tasks(EvalConfig(tasks_per_level=EVAL_POOL + 1))


def test_resolve_version():
    vs = {v: make_policy_published(version=v, location=f"/s/v{v}", producer_id="t") for v in (1, 2, 5)}
    assert resolve_version(vs, "latest", topic="c").version == 5
    assert resolve_version(vs, 2, topic="c").location == "/s/v2"
    with pytest.raises(EvalError, match="not published.*1, 2, 5"):
        resolve_version(vs, "3", topic="c")
    with pytest.raises(EvalError, match="no policy is published"):
        resolve_version({}, "latest", topic="c")


NO_BROKER = ["--bootstrap", "127.0.0.1:1"]


@pytest.mark.parametrize("args,names", [
    (["eval", *NO_BROKER], "--policy-version"),
    (["eval", "--policy-version", "latest", "--model", "{tmp}", *NO_BROKER], "exactly one"),
    (["eval", "--policy-version", "newest", *NO_BROKER], "`--policy-version`"),
    (["eval", "--model", "{tmp}", "--follow", *NO_BROKER], "`--follow`"),
    (["eval", "--policy-version", "1", "--policy", "scripted", *NO_BROKER], "`--policy`"),
    (["eval", "--policy-version", "1", "--domains", "chess", *NO_BROKER], "`--domains`"),
    (["eval", "--policy-version", "1", "--levels", "0,x", *NO_BROKER], "`--levels`"),
    (["eval", "--policy-version", "1", "--levels", "7", *NO_BROKER], "0..2"),
    (["eval", "--policy-version", "1", "--tasks-per-level", "0", *NO_BROKER], "`--tasks-per-level`"),
    (["eval", "--policy-version", "1", "--max-steps", "0", *NO_BROKER], "`--max-steps`"),
    (["eval", "--model", "{tmp}/missing", *NO_BROKER], "`--model`"),
    (["rollout", "--seed", "-1", *NO_BROKER], "`--seed`"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_wrong_flags_are_one_error_line_and_exit_2(args, names, tmp_path, monkeypatch):
    monkeypatch.delenv("TRAJPIPE_DEBUG", raising=False)
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and names in lines[0], res.output
    assert "Traceback" not in res.output


def test_an_unreachable_broker_is_one_error_line_and_exit_2(monkeypatch):
    monkeypatch.setenv("TRAJPIPE_KAFKA__CONNECT_TIMEOUT_S", "1")
    res = CliRunner().invoke(app, ["eval", "--policy-version", "latest", *NO_BROKER])
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "cannot reach Kafka" in lines[0], res.output
