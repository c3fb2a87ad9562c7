"""The scripts the code and tools environments run in their sandboxes: what they print, what they import.

Both read their document with ``marshal`` and print their ``RESULT`` line themselves (``RUNNER_PRELUDE``)
instead of importing ``json`` (and, for the test runner, ``traceback``), which pull in ``re`` and ``enum``:
~12 ms of CPU a sandboxed run on top of the interpreter's ~7. Their output must not change with that: each
case below runs the scripts as they were (json and traceback, kept here) and as they are, in real sandboxes,
and compares stdout, stderr and exit status.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.envs.base import RUNNER_PRELUDE, runner_input
from rollout.envs.code_env import _TEST_RUNNER
from rollout.envs.tools_env import _CHECK_SCRIPT
from rollout.sandbox import sandbox_python

# The two scripts before the change (json on stdin and in the RESULT line, traceback.format_exc).
_OLD_TEST_RUNNER = r"""
import json, sys, traceback
spec = json.loads(sys.stdin.read())
sys.path.insert(0, "/work")
failures, passed = [], 0
try:
    # compiled from source every time: a stale __pycache__ must never answer for new code
    import types
    solution = types.ModuleType("solution")
    solution.__file__ = "/work/solution.py"
    sys.modules["solution"] = solution
    with open("/work/solution.py", encoding="utf-8") as fh:
        exec(compile(fh.read(), "/work/solution.py", "exec"), solution.__dict__)
    fn = getattr(solution, spec["func"])
except BaseException as err:
    tb = traceback.format_exc(limit=2)
    print(tb[-1500:])
    print("RESULT " + json.dumps({"passed": 0, "total": len(spec["cases"]), "error": type(err).__name__}))
    sys.exit(1)
for args, expected in spec["cases"]:
    try:
        got = fn(*args)
    except BaseException as err:
        got = f"<raised {type(err).__name__}: {err}>"
    if got == expected or (isinstance(got, tuple) and list(got) == expected):
        passed += 1
    else:
        failures.append(f"FAIL {spec['func']}{tuple(args)!r}: expected {expected!r}, got {got!r}")
print("\n".join(failures[:10]))
print("RESULT " + json.dumps({"passed": passed, "total": len(spec["cases"])}))
sys.exit(0 if passed == len(spec["cases"]) else 1)
"""

_OLD_CHECK_SCRIPT = r"""
import json, sys
expected = json.loads(sys.stdin.read())
passed, lines = 0, []
for path, want in sorted(expected.items()):
    try:
        with open("/work/" + path, encoding="utf-8") as fh:
            got = fh.read()
    except OSError as err:
        lines.append(f"MISSING {path}: {err.strerror}")
        continue
    if got.strip("\n") == want.strip("\n"):
        passed += 1
        lines.append(f"OK {path}")
    else:
        lines.append(f"WRONG {path}: first lines {got.splitlines()[:3]!r}")
print("\n".join(lines))
print("RESULT " + json.dumps({"passed": passed, "total": len(expected)}))
sys.exit(0 if passed == len(expected) else 1)
"""

_CASES = [[[1, 2], 3], [[-4, 4], 0], [[10, 0.5], 10.5], [["a", "b"], "ab"], [[[1], [2]], [1, 2]]]
_SPEC = {"func": "add", "cases": _CASES}

#: solution.py sources: passes, fails some cases, missing, does not parse, raises at import (a deep chain
#: with a cause, cut to two frames by format_exc's limit), lacks the function, exits, an odd exception name.
_SOLUTIONS = {
    "passes": "def add(a, b):\n    return a + b\n",
    "fails": "def add(a, b):\n    if a == 1:\n        raise ValueError('no')\n    return (a, b) if a == 'a' else a - b\n",
    "missing": None,
    "syntax": "def add(a, b:\n    return a + b\n",
    "deep": ("def a():\n    return b()\ndef b():\n    try:\n        return {}['k']\n    except KeyError as e:\n"
             "        raise ValueError('bad') from e\nv = a()\n"),
    "deep_cause": ("def a():\n    return b()\ndef b():\n    return c()\ndef c():\n    return 1 / 0\n"
                   "def d():\n    try:\n        a()\n    except ZeroDivisionError:\n        return e()\n"
                   "def e():\n    raise RuntimeError('while handling')\nd()\n"),
    "no_function": "def other():\n    pass\n",
    "exits": "raise SystemExit(3)\n",
    "odd_name": "E = type('we\"ird\\\\ \u00e9', (Exception,), {})\nraise E('m\u00e9ss\\nage')\n",
}


def _run(sb, script: str, stdin: bytes | str):
    res = sb.run([sandbox_python(), "-I", "-S", "-B", "-c", script], stdin=stdin, timeout_s=10)
    assert not res.timed_out and res.killed_reason is None, res
    return res.exit_status, res.stdout, res.stderr


@pytest.mark.parametrize("name", sorted(_SOLUTIONS))
def test_test_runner_prints_what_the_json_and_traceback_one_did(sandbox, name):
    if _SOLUTIONS[name] is not None:
        sandbox.write_file("solution.py", _SOLUTIONS[name])
    new = _run(sandbox, _TEST_RUNNER, runner_input(_SPEC))
    old = _run(sandbox, _OLD_TEST_RUNNER, json.dumps(_SPEC))
    assert new == old
    assert "RESULT {" in new[1]


@pytest.mark.parametrize("files", [{}, {"out/a.txt": "x\n"}, {"out/a.txt": "x\n", "b.txt": "wrong\n"}])
def test_check_script_prints_what_the_json_one_did(sandbox, files):
    for path, content in files.items():
        sandbox.write_file(path, content)
    expected = {"out/a.txt": "x", "b.txt": "\u00e9 b\n", "c/d.txt": ""}
    new = _run(sandbox, _CHECK_SCRIPT, runner_input(expected))
    old = _run(sandbox, _OLD_CHECK_SCRIPT, json.dumps(expected))
    assert new == old
    assert new[1].splitlines()[-1].startswith("RESULT {")


def test_runners_import_nothing_beyond_the_interpreters_start(sandbox):
    """``-X importtime`` lists every module a run imports: none of json, re, enum, traceback, types (the test
    runner over a solution that loads and one that does not, which prints a traceback)."""
    runs = [("passes", _TEST_RUNNER, runner_input(_SPEC)), ("syntax", _TEST_RUNNER, runner_input(_SPEC)),
            ("syntax", _CHECK_SCRIPT, runner_input({"a": "b"}))]
    for solution, script, stdin in runs:
        sandbox.write_file("solution.py", _SOLUTIONS[solution])
        res = sandbox.run([sandbox_python(), "-I", "-S", "-B", "-X", "importtime", "-c", script], stdin=stdin,
                          timeout_s=10)
        imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
        assert "marshal" in imported or "io" in imported  # the listing is there
        assert not imported & {"json", "re", "enum", "traceback", "types", "linecache", "functools"}, imported


def test_runner_input_is_what_json_gave():
    doc = {"func": "f", "cases": [[(1, 2), {"k": (3,)}], [[None, True, 1.5, "s"], [1]]], "n": {1: "one"}}
    import marshal
    assert marshal.loads(runner_input(doc)) == json.loads(json.dumps(doc))


@settings(max_examples=300, deadline=None)
@given(st.text(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70))
def test_result_line_is_json_dumps(text, number):
    ns: dict = {}
    exec(RUNNER_PRELUDE, ns)  # defines _json_str and _result in ns
    assert ns["_json_str"](text) == json.dumps(text)
    lines: list[str] = []
    ns["print"] = lines.append
    ns["_result"](passed=number, total=3, error=text)
    assert lines == ["RESULT " + json.dumps({"passed": number, "total": 3, "error": text})]
