"""Environments: deterministic generators, the reference policy solves them, noise breaks them."""

from __future__ import annotations

import pytest

from rollout.envs import domains, generate_tasks, make_env, max_difficulty
from rollout.envs.docqa_env import render_report
from rollout.episode import run_episode
from rollout.policies import ScriptedPolicy
from rollout.sandbox import Sandbox

DOMAINS = ["code", "math", "docqa", "tools"]


def _env(domain, sandbox_root):
    if domain in ("code", "tools"):
        return make_env(domain, sandbox_factory=lambda: Sandbox(sandbox_root))
    return make_env(domain)


def _run(env, policy, task, max_steps=16):
    events = []
    summary = run_episode(env, policy, task, episode_id=f"ep-{task.task_id}", producer_id="test",
                          max_steps=max_steps, emit=events.append)
    return summary, events


def test_builtin_domains_registered():
    assert set(DOMAINS) <= set(domains())


@pytest.mark.parametrize("domain", DOMAINS)
def test_generator_is_deterministic_by_seed(domain):
    for level in range(max_difficulty(domain) + 1):
        a = generate_tasks(domain, 4, seed=7, difficulty=level)
        b = generate_tasks(domain, 4, seed=7, difficulty=level)
        c = generate_tasks(domain, 4, seed=8, difficulty=level)
        assert a == b
        assert [t.task_id for t in a] != [t.task_id for t in c]
        assert len({t.task_id for t in a}) == 4
        assert all(t.domain == domain and t.difficulty == level and t.prompt for t in a)


def test_generator_rejects_bad_difficulty():
    with pytest.raises(ValueError, match="difficulty"):
        generate_tasks("math", 1, seed=0, difficulty=9)


def test_docqa_report_is_long_and_holds_the_figures():
    task = generate_tasks("docqa", 1, seed=3, difficulty=2)[0]
    report = render_report(task.spec)
    assert len(report.split()) > 1500  # thousands of tokens
    assert report.count("Table: ") >= 5
    for label in task.spec["required_figures"]:
        assert f"{task.spec['figures'][label]:,.1f}" in report


@pytest.mark.parametrize("domain", DOMAINS)
def test_reference_policy_solves_every_level(domain, sandbox_root):
    env = _env(domain, sandbox_root)
    policy = ScriptedPolicy(noise=0.0, seed=1)
    try:
        for level in range(max_difficulty(domain) + 1):
            for task in generate_tasks(domain, 2, seed=21, difficulty=level):
                summary, _ = _run(env, policy, task)
                assert summary.status.value == "success", (task.task_id, summary)
                assert summary.reward == 1.0
    finally:
        env.close()


@pytest.mark.parametrize("domain", DOMAINS)
def test_full_noise_policy_fails(domain, sandbox_root):
    env = _env(domain, sandbox_root)
    policy = ScriptedPolicy(noise=1.0, seed=1)
    try:
        results = [_run(env, policy, task, max_steps=10)[0] for task in generate_tasks(domain, 2, seed=22, difficulty=1)]
    finally:
        env.close()
    assert all(s.status.value == "failure" for s in results), results
    assert all(s.reward < 1.0 for s in results)


def test_tools_failed_step_is_rolled_back(sandbox_root):
    env = _env("tools", sandbox_root)
    task = generate_tasks("tools", 1, seed=5, difficulty=1)[0]
    try:
        env.reset(task)
        assert env.step("RUN mkdir -p out").exit_status == 0
        bad = env.step("RUN echo partial > out/totals.csv; exit 3")
        assert bad.exit_status == 3 and "rolled back" in bad.observation
        assert "out/totals.csv" not in env._sb.manifest()  # the half-written output is gone
        assert "out" in env._sb.manifest()  # the last good state is kept
        assert not any(v.passed for v in bad.verdicts if v.verifier == "tools.command_ok")
    finally:
        env.close()


@pytest.mark.parametrize("domain", ["code", "tools"])
def test_a_write_to_a_directory_is_a_failed_step_not_a_crash(domain, sandbox_root):
    """A make bench eval episode's policy wrote to a path its own RUN had made a directory: the env raised
    IsADirectoryError and the episode ended as "environment crashed" with a traceback. Now the step fails."""
    env = _env(domain, sandbox_root)
    task = generate_tasks(domain, 1, seed=5, difficulty=1)[0]
    try:
        env.reset(task)
        assert env.step("RUN mkdir 'solution.txt > out'").exit_status == 0
        out = env.step("WRITE solution.txt > out\nhello\n")
        assert out.exit_status == 1 and out.tool_name == "write_file"
        assert "write failed: cannot write 'solution.txt > out': Is a directory" in out.observation
        assert env.step("RUN echo still here").exit_status == 0
    finally:
        env.close()


def test_code_env_reports_syntax_errors_and_tests(sandbox_root):
    env = _env("code", sandbox_root)
    task = generate_tasks("code", 1, seed=2, difficulty=0)[0]
    try:
        env.reset(task)
        out = env.step("WRITE solution.py\ndef broken(:\n")
        assert {v.verifier: v.passed for v in out.verdicts}["code.parses"] is False
        out = env.step("TEST")
        assert {v.verifier: v.passed for v in out.verdicts}["code.tests_pass"] is False
        out = env.step(f"WRITE solution.py\n{task.spec['reference']}")
        out = env.step("SUBMIT")
        assert out.done and {v.verifier: v.passed for v in out.verdicts}["code.tests_pass"] is True
        assert env.outcome().reward == 1.0
        invalid = env.step("DANCE")
        assert invalid.tool_name == "invalid" and invalid.verdicts[0].passed is False
    finally:
        env.close()
