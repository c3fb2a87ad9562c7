"""Verifiers are pure functions of (domain, spec, recorded step): hand-made good and bad steps."""

from __future__ import annotations

import json

import pytest

from rollout.verifiers import Verdict, VerifierNotFound, register_verifier, verify_step


def _by_name(verdicts):
    return {v.verifier: v for v in verdicts}


def test_code_parse_and_tests():
    spec = {"func": "f"}
    good = {"tool_name": "write_file", "tool_args": json.dumps({"path": "solution.py", "content": "def f():\n  return 1\n"})}
    bad = {"tool_name": "write_file", "tool_args": json.dumps({"path": "solution.py", "content": "def f(:\n"})}
    assert _by_name(verify_step("code", spec, good))["code.parses"].passed
    assert not _by_name(verify_step("code", spec, bad))["code.parses"].passed
    run = {"tool_name": "run_tests", "exit_status": 1,
           "tool_result": json.dumps({"exit_status": 1, "stdout": "FAIL f(1)\nRESULT {\"passed\": 3, \"total\": 4}"})}
    v = _by_name(verify_step("code", spec, run))["code.tests_pass"]
    assert not v.passed and v.score == 0.75  # 3 of 4 cases
    ok = {"tool_name": "submit", "tool_result": {"exit_status": 0, "stdout": "RESULT {\"passed\": 4, \"total\": 4}"}}
    assert _by_name(verify_step("code", spec, ok))["code.tests_pass"].passed


def test_math_intermediates_and_answer():
    spec = {"steps": [{"name": "subtotal", "value": 37.5}, {"name": "total", "value": 45.5}],
            "answer": 45.5, "tolerance": 0.01}
    assert _by_name(verify_step("math", spec, {"tool_name": "state", "tool_args": '{"name":"subtotal","value":"37.50"}'}))[
        "math.intermediate_correct"].passed
    assert not _by_name(verify_step("math", spec, {"tool_name": "state", "tool_args": '{"name":"subtotal","value":"38"}'}))[
        "math.intermediate_correct"].passed
    assert not _by_name(verify_step("math", spec, {"tool_name": "state", "tool_args": '{"name":"nope","value":"1"}'}))[
        "math.intermediate_correct"].passed
    assert _by_name(verify_step("math", spec, {"tool_name": "answer", "tool_args": '{"value":"$45.50"}'}))[
        "math.answer_correct"].passed
    assert not _by_name(verify_step("math", spec, {"tool_name": "calc", "tool_result": '{"value":null,"error":"bad"}'}))[
        "math.calc_ok"].passed


def test_docqa_citations_and_answer():
    spec = {"figures": {"Segment revenue | Cloud | FY2023": 1200.0, "Segment revenue | Cloud | FY2022": 1000.0},
            "required_figures": ["Segment revenue | Cloud | FY2022", "Segment revenue | Cloud | FY2023"],
            "answer": 20.0, "tolerance": 0.011}
    cite = lambda label, value: {"tool_name": "cite", "tool_args": json.dumps({"label": label, "value": value})}
    assert _by_name(verify_step("docqa", spec, cite("Segment revenue | Cloud | FY2023", "1,200.0")))[
        "docqa.citation_correct"].passed
    assert not _by_name(verify_step("docqa", spec, cite("Segment revenue | Cloud | FY2023", "1300")))[
        "docqa.citation_correct"].passed
    assert not _by_name(verify_step("docqa", spec, cite("Made up | x | y", "1")))["docqa.citation_correct"].passed
    # (1200 - 1000) / 1000 * 100 = 20.00; only one of two required figures cited correctly -> 0.5
    answer = {"tool_name": "answer", "tool_args": json.dumps(
        {"value": "20.00", "cited": [{"label": "Segment revenue | Cloud | FY2023", "correct": True}]})}
    v = _by_name(verify_step("docqa", spec, answer))
    assert v["docqa.answer_correct"].passed and not v["docqa.citations_complete"].passed
    assert v["docqa.citations_complete"].score == 0.5


def test_tools_command_and_artifacts():
    spec = {"artifacts": ["out", "out/totals.csv"]}
    good = {"tool_name": "run", "exit_status": 0,
            "tool_result": json.dumps({"exit_status": 0, "files_changed": {"out/totals.csv": "added"}})}
    v = _by_name(verify_step("tools", spec, good))
    assert v["tools.command_ok"].passed and v["tools.artifact_written"].passed
    bad = {"tool_name": "run", "exit_status": 0,
           "tool_result": json.dumps({"exit_status": 0, "killed_reason": "timeout", "files_changed": {}})}
    v = _by_name(verify_step("tools", spec, bad))
    assert not v["tools.command_ok"].passed and not v["tools.artifact_written"].passed
    check = {"tool_name": "check", "tool_result": json.dumps({"stdout": "RESULT {\"passed\": 1, \"total\": 2}"})}
    assert _by_name(verify_step("tools", spec, check))["tools.check_pass"].score == 0.5


def test_invalid_action_fails_format_and_unknown_domain_raises():
    assert verify_step("math", {}, {"tool_name": "invalid"}) == [
        Verdict(verifier="format.valid", passed=False, score=0.0, details="action did not match the domain's format")]
    with pytest.raises(VerifierNotFound):
        verify_step("no-such-domain", {}, {"tool_name": "x"})


def test_registry_accepts_new_domains():
    @register_verifier("test-echo", replace=True)
    def _echo(spec, step):
        return [Verdict(verifier="echo.same", passed=step.get("action_text") == spec["want"], score=1.0)]

    assert verify_step("test-echo", {"want": "hi"}, {"tool_name": "say", "action_text": "hi"})[1].passed
    with pytest.raises(ValueError):
        register_verifier("test-echo", _echo)


def test_verifiers_replay_identically_over_recorded_steps(sandbox_root):
    """What the env emitted at rollout time is what a re-run over the log computes."""
    from rollout.envs import generate_tasks, make_env
    from rollout.episode import run_episode
    from rollout.policies import ScriptedPolicy
    from rollout.sandbox import Sandbox
    from schemas.events import Step, StepVerified

    env = make_env("tools", sandbox_factory=lambda: Sandbox(sandbox_root))
    task = generate_tasks("tools", 1, seed=4, difficulty=2)[0]
    events = []
    try:
        run_episode(env, ScriptedPolicy(noise=0.3, seed=4), task, episode_id="ep-replay", producer_id="t",
                    max_steps=12, emit=events.append)
    finally:
        env.close()
    steps = {e.step_index: e for e in events if isinstance(e, Step)}
    emitted = {}
    for e in events:
        if isinstance(e, StepVerified):
            emitted.setdefault(e.step_index, []).append((e.verifier, e.passed, e.score))
    for idx, step in steps.items():
        recorded = {"action_text": step.action_text, "tool_name": step.tool_name, "tool_args": step.tool_args,
                    "tool_result": step.tool_result, "exit_status": step.exit_status}
        replay = [(v.verifier, v.passed, v.score) for v in verify_step("tools", task.spec, recorded)]
        assert replay == emitted[idx]
