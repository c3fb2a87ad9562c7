"""Step verifiers: pure functions of (domain, task spec, recorded step) -> verdicts.

They need no sandbox, no network and no history: everything they judge is in
the task spec (from ``EpisodeStarted.task_spec``) and the step's recorded
fields (``action_text``, ``tool_name``, ``tool_args``, ``tool_result``,
``exit_status`` of a ``Step`` event). Environments call the same functions at
rollout time, so the Beam pipeline re-running them over the log gets the same
verdicts the worker emitted as ``StepVerified`` events.

``tool_args`` and ``tool_result`` are JSON documents (strings, as recorded) or
already-decoded dicts. A command's result has the keys of
:meth:`rollout.sandbox.CommandResult.to_dict`.

Add a domain with :func:`register_verifier`::

    @register_verifier("sql")
    def verify_sql(task_spec: dict, step: dict) -> list[Verdict]: ...

Examples:
    >>> spec = {"steps": [{"name": "subtotal", "value": 12.0}], "answer": 15.0, "tolerance": 0.01}
    >>> step = {"tool_name": "state", "tool_args": '{"name": "subtotal", "value": "12"}'}
    >>> [(v.verifier, v.passed) for v in verify_step("math", spec, step)]
    [('format.valid', True), ('math.intermediate_correct', True)]
"""

from __future__ import annotations

import ast
import math
from typing import Any, Callable

import msgspec

__all__ = [
    "Verdict",
    "StepVerifier",
    "VerifierNotFound",
    "register_verifier",
    "registered_domains",
    "verify_step",
    "parse_number",
    "numbers_match",
    "parse_test_summary",
]

#: Longest ``details`` string a verdict carries.
MAX_DETAILS = 500


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """One verifier's judgement of one step (becomes a ``StepVerified`` event).

    Attributes:
        verifier: dotted name, ``<domain>.<check>`` (``format.valid`` for the shared check).
        passed: whether the step passed this check.
        score: graded score in [0, 1] (1.0/0.0 for binary checks).
        details: short human-readable reason (bounded to ``MAX_DETAILS`` chars).
    """

    verifier: str
    passed: bool
    score: float
    details: str = ""


StepVerifier = Callable[[dict, dict], list[Verdict]]

_REGISTRY: dict[str, StepVerifier] = {}


class VerifierNotFound(KeyError):
    """No verifier is registered for the domain."""


def register_verifier(domain: str, fn: StepVerifier | None = None, *, replace: bool = False):
    """Register ``fn(task_spec, step) -> list[Verdict]`` for ``domain`` (usable as a decorator).

    Raises:
        ValueError: ``domain`` already has a verifier and ``replace`` is False.
    """

    def _register(func: StepVerifier) -> StepVerifier:
        if domain in _REGISTRY and not replace:
            raise ValueError(f"domain {domain!r} already has a verifier; pass replace=True to override it")
        _REGISTRY[domain] = func
        return func

    return _register(fn) if fn is not None else _register


def registered_domains() -> list[str]:
    """Domains with a registered step verifier, sorted."""
    return sorted(_REGISTRY)


def verify_step(domain: str, task_spec: dict, step: dict) -> list[Verdict]:
    """Judge one recorded step.

    Args:
        domain: the episode's domain.
        task_spec: the task spec (decoded JSON of ``EpisodeStarted.task_spec``).
        step: the step's recorded fields (``tool_name``, ``tool_args``, ``tool_result``,
            ``exit_status``, ``action_text``); missing keys count as None.

    Returns:
        Verdicts in a fixed order; ``format.valid`` first.

    Raises:
        VerifierNotFound: no verifier is registered for ``domain``.
    """
    try:
        func = _REGISTRY[domain]
    except KeyError:
        raise VerifierNotFound(
            f"no step verifier for domain {domain!r}; registered: {registered_domains()}"
        ) from None
    tool = step.get("tool_name")
    fmt = _verdict("format.valid", tool not in (None, "invalid"),
                   "action parsed" if tool not in (None, "invalid") else "action did not match the domain's format")
    if tool in (None, "invalid"):
        return [fmt]
    return [fmt, *func(task_spec, step)]


# --------------------------------------------------------------------------- helpers


def _verdict(name: str, passed: bool, details: str = "", score: float | None = None) -> Verdict:
    s = (1.0 if passed else 0.0) if score is None else float(min(1.0, max(0.0, score)))
    return Verdict(verifier=name, passed=bool(passed), score=s, details=details[:MAX_DETAILS])


def _doc(value: Any) -> dict:
    """A recorded JSON field as a dict ({} if absent or undecodable)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    try:
        out = msgspec.json.decode(value)
    except (TypeError, ValueError, msgspec.DecodeError):
        return {}
    return out if isinstance(out, dict) else {}


def parse_number(text: Any) -> float | None:
    """Parse ``1,234.5``, ``$12``, ``-3.25%`` or ``7/4`` to a float; None if not a number.

    Examples:
        >>> parse_number("$1,234.50"), parse_number("12%"), parse_number("7/4"), parse_number("x")
        (1234.5, 12.0, 1.75, None)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str):
        return None
    s = text.strip().replace(",", "").replace("$", "").replace("%", "").strip()
    if not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(num) / float(den)
        value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def numbers_match(got: float | None, expected: float, tolerance: float) -> bool:
    """``|got - expected| <= tolerance`` (plus a 1e-9 relative slack for float noise)."""
    return got is not None and abs(got - expected) <= tolerance + 1e-9 * abs(expected)


def _command_ok(result: dict, exit_status: int | None) -> tuple[bool, str]:
    status = result.get("exit_status", exit_status)
    killed = result.get("killed_reason")
    if killed:
        return False, f"stopped by sandbox: {killed}"
    return status == 0, f"exit status {status}"


def parse_test_summary(stdout: str) -> dict | None:
    """The ``RESULT {...}`` line a test or check runner prints last, decoded; None if absent."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            doc = _doc(line[len("RESULT "):])
            if "passed" in doc and "total" in doc:
                return doc
    return None


# --------------------------------------------------------------------------- domains


@register_verifier("code")
def verify_code_step(task_spec: dict, step: dict) -> list[Verdict]:
    """``code``: written Python parses; test runs pass (fraction of cases); commands exit 0."""
    tool = step.get("tool_name")  # each branch decodes only the document it reads
    if tool == "write_file":
        args = _doc(step.get("tool_args"))
        path = str(args.get("path", ""))
        if not path.endswith(".py"):
            return []
        try:
            ast.parse(str(args.get("content", "")), filename=path)
        except SyntaxError as err:
            return [_verdict("code.parses", False, f"{path}:{err.lineno}: {err.msg}")]
        return [_verdict("code.parses", True, f"{path} parses")]
    if tool in ("run_tests", "submit"):
        result = _doc(step.get("tool_result"))
        summary = parse_test_summary(str(result.get("stdout", "")))
        if summary is None:
            ok, why = _command_ok(result, step.get("exit_status"))
            return [_verdict("code.tests_pass", False, f"no test summary ({why})")]
        passed, total = int(summary["passed"]), max(int(summary["total"]), 1)
        all_pass = passed == total and result.get("exit_status", step.get("exit_status")) == 0
        return [_verdict("code.tests_pass", all_pass, f"{passed}/{total} tests passed", passed / total)]
    if tool == "run":
        ok, why = _command_ok(_doc(step.get("tool_result")), step.get("exit_status"))
        return [_verdict("code.command_ok", ok, why)]
    return []


@register_verifier("math")
def verify_math_step(task_spec: dict, step: dict) -> list[Verdict]:
    """``math``: calculator calls evaluate; stated intermediates and the answer are correct."""
    tool = step.get("tool_name")
    tol = float(task_spec.get("tolerance", 0.01))
    if tool == "calc":
        result = _doc(step.get("tool_result"))
        ok = result.get("error") is None and result.get("value") is not None
        return [_verdict("math.calc_ok", ok, str(result.get("error") or f"= {result.get('value')}"))]
    if tool not in ("state", "answer"):
        return []
    args = _doc(step.get("tool_args"))
    if tool == "state":
        name = str(args.get("name", "")).strip()
        expected = {s["name"]: float(s["value"]) for s in task_spec.get("steps", [])}
        if name not in expected:
            return [_verdict("math.intermediate_correct", False, f"unknown intermediate {name!r}")]
        got = parse_number(args.get("value"))
        ok = numbers_match(got, expected[name], tol)
        return [_verdict("math.intermediate_correct", ok, f"{name}: stated {args.get('value')!r}"
                         + ("" if ok else " is wrong"))]
    if tool == "answer":
        got = parse_number(args.get("value"))
        ok = numbers_match(got, float(task_spec["answer"]), tol)
        return [_verdict("math.answer_correct", ok, f"answer {args.get('value')!r}" + ("" if ok else " is wrong"))]
    return []


@register_verifier("docqa")
def verify_docqa_step(task_spec: dict, step: dict) -> list[Verdict]:
    """``docqa``: cited figures exist in the report and are right; the answer is right and supported."""
    tool = step.get("tool_name")
    figures: dict[str, float] = task_spec.get("figures", {})
    required = list(task_spec.get("required_figures", []))
    if tool in ("search", "lookup"):
        hits = int(_doc(step.get("tool_result")).get("hits", 0))
        return [_verdict(f"docqa.{tool}_hit", hits > 0, f"{hits} matching lines")]
    if tool not in ("cite", "answer"):
        return []
    args = _doc(step.get("tool_args"))
    if tool == "cite":
        label = str(args.get("label", "")).strip()
        if label not in figures:
            return [_verdict("docqa.citation_correct", False, f"no figure {label!r} in the report"),
                    _verdict("docqa.citation_relevant", False, "not a figure of the report")]
        got = parse_number(args.get("value"))
        ok = numbers_match(got, float(figures[label]), float(task_spec.get("figure_tolerance", 0.05)))
        return [
            _verdict("docqa.citation_correct", ok, f"{label} = {args.get('value')!r}" + ("" if ok else " is wrong")),
            _verdict("docqa.citation_relevant", label in required,
                     "needed for the question" if label in required else "not needed for the question"),
        ]
    if tool == "answer":
        got = parse_number(args.get("value"))
        ok = numbers_match(got, float(task_spec["answer"]), float(task_spec.get("tolerance", 0.01)))
        cited = {str(c.get("label")) for c in args.get("cited", []) if isinstance(c, dict) and c.get("correct")}
        covered = sum(1 for r in required if r in cited)
        return [
            _verdict("docqa.answer_correct", ok, f"answer {args.get('value')!r}" + ("" if ok else " is wrong")),
            _verdict("docqa.citations_complete", covered == len(required),
                     f"{covered}/{len(required)} required figures cited correctly",
                     covered / max(len(required), 1)),
        ]
    return []


@register_verifier("tools")
def verify_tools_step(task_spec: dict, step: dict) -> list[Verdict]:
    """``tools``: commands exit 0 inside limits and produce expected artifacts; checks pass."""
    tool = step.get("tool_name")
    result = _doc(step.get("tool_result"))
    if tool in ("run", "write_file"):
        ok, why = _command_ok(result, step.get("exit_status"))
        artifacts = set(task_spec.get("artifacts", []))
        changed = result.get("files_changed") or {}
        touched = sorted(p for p, kind in changed.items() if p in artifacts and kind != "deleted")
        return [
            _verdict("tools.command_ok", ok, why),
            _verdict("tools.artifact_written", ok and bool(touched),
                     f"wrote {touched}" if touched else "no expected artifact changed"),
        ]
    if tool == "rollback":
        ok, why = _command_ok(result, step.get("exit_status"))
        return [_verdict("tools.rollback_ok", ok, why)]
    if tool in ("check", "done"):
        summary = parse_test_summary(str(result.get("stdout", "")))
        if summary is None:
            return [_verdict("tools.check_pass", False, "no check summary")]
        passed, total = int(summary["passed"]), max(int(summary["total"]), 1)
        return [_verdict("tools.check_pass", passed == total, f"{passed}/{total} outputs correct", passed / total)]
    return []
