"""``code`` domain: write or fix a Python function so hidden unit tests pass.

Terminal-style, multi-step: the policy writes files, runs commands, runs the
hidden tests, reads the failures, edits and reruns, all inside a sandbox.

Action format (one per turn; the verb is case-insensitive)::

    WRITE <path>          write the lines after this one to <path> (relative to /work)
    <file content ...>
    RUN <shell command>   run it in the sandbox (/bin/sh -c), see exit status and output
    TEST                  run the hidden tests against solution.py, see which cases fail
    SUBMIT                finish; the hidden tests decide the reward

Difficulty levels: 0 = one-line arithmetic functions, 1 = loops over
strings/lists, 2 = small algorithms (run-length encoding, bracket matching,
top-k counting). Each task is either ``write`` (empty work dir) or ``fix``
(``solution.py`` holds a buggy version).

The hidden tests travel on the test runner's stdin, never through the work
dir, so the policy cannot read them; failures it sees are the failing cases.
"""

from __future__ import annotations

import random
from typing import Callable

from rollout.envs.base import (
    RUNNER_PRELUDE,
    EnvironmentFailure,
    Outcome,
    StepOutcome,
    Task,
    command_observation,
    dump_json,
    make_task_id,
    record_command,
    runner_input,
    split_action,
)
from rollout.sandbox import Sandbox, SandboxError, sandbox_python
from rollout.verifiers import parse_test_summary, verify_step

__all__ = ["CodeEnv", "generate_task", "reference_solution", "buggy_solution", "MAX_DIFFICULTY", "SOLUTION_FILE"]

DOMAIN = "code"
MAX_DIFFICULTY = 2
SOLUTION_FILE = "solution.py"

# Runs inside the sandbox: reads {"func", "cases"} from stdin *before* importing
# the solution, prints one line per failing case and a final RESULT line.
_TEST_RUNNER = RUNNER_PRELUDE + r"""
import marshal, sys
spec = marshal.loads(sys.stdin.buffer.read())
sys.path.insert(0, "/work")
failures, passed = [], 0
try:
    # compiled from source every time: a stale __pycache__ must never answer for new code
    ModuleType = type(sys)  # types.ModuleType, without importing types
    solution = ModuleType("solution")
    solution.__file__ = "/work/solution.py"
    sys.modules["solution"] = solution
    with open("/work/solution.py", encoding="utf-8") as fh:
        exec(compile(fh.read(), "/work/solution.py", "exec"), solution.__dict__)
    fn = getattr(solution, spec["func"])
except BaseException as err:
    # traceback.format_exc(limit=2), written by the interpreter's own printer (no import): each
    # exception of the chain cut to its first two frames, as format_exc's limit does
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
            e.__traceback__.tb_next.tb_next = None
        todo += [e.__cause__, e.__context__]
    import io  # loaded with the interpreter's standard streams: no import cost
    shown, sys.stderr = sys.stderr, io.StringIO()
    try:
        sys.__excepthook__(type(err), err, err.__traceback__)
        tb = sys.stderr.getvalue()
    finally:
        sys.stderr = shown
    print(tb[-1500:])
    _result(passed=0, total=len(spec["cases"]), error=type(err).__name__)
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
_result(passed=passed, total=len(spec["cases"]))
sys.exit(0 if passed == len(spec["cases"]) else 1)
"""


# --------------------------------------------------------------------------- task bank
# Each template: (difficulty, make(rng) -> dict(func, signature, description, ref, bug, inputs))


def _scale_add(rng: random.Random) -> dict:
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    return {
        "func": "scale_add", "signature": "def scale_add(x: int) -> int",
        "description": f"Return x multiplied by {a}, plus {b}.",
        "ref": f"def scale_add(x):\n    return x * {a} + {b}\n",
        "bug": f"def scale_add(x):\n    return x * {a} - {b}\n",
        "inputs": [[rng.randint(-50, 50)] for _ in range(6)],
    }


def _clamp(rng: random.Random) -> dict:
    lo, hi = rng.randint(-10, 0), rng.randint(1, 10)
    return {
        "func": "clamp", "signature": "def clamp(x: int) -> int",
        "description": f"Return x limited to the closed range [{lo}, {hi}].",
        "ref": f"def clamp(x):\n    return max({lo}, min(x, {hi}))\n",
        "bug": f"def clamp(x):\n    return min({lo}, max(x, {hi}))\n",
        "inputs": [[x] for x in (lo - 5, lo, 0, hi, hi + 3, rng.randint(lo, hi))],
    }


def _count_class(rng: random.Random) -> dict:
    chars = rng.choice(["aeiou", "0123456789", "xyz"])
    words = ["Apple", "queue", "x9y8z7", "Hello World", "", "AEIOU aeiou 42", "xylophone zoo"]
    return {
        "func": "count_chars", "signature": "def count_chars(s: str) -> int",
        "description": f"Return how many characters of s are in the set {chars!r}, ignoring case.",
        "ref": f"def count_chars(s):\n    return sum(1 for c in s.lower() if c in {chars!r})\n",
        "bug": f"def count_chars(s):\n    return sum(1 for c in s.lower()[:-1] if c in {chars!r})\n",
        "inputs": [[w] for w in rng.sample(words, 6)],
    }


def _running_sum(rng: random.Random) -> dict:
    start = rng.randint(0, 5)
    return {
        "func": "running_sum", "signature": "def running_sum(xs: list[int]) -> list[int]",
        "description": f"Return the running sums of xs, starting from an initial total of {start} "
                       f"(element i is {start} + xs[0] + ... + xs[i]).",
        "ref": f"def running_sum(xs):\n    out, total = [], {start}\n    for x in xs:\n"
               f"        total += x\n        out.append(total)\n    return out\n",
        "bug": f"def running_sum(xs):\n    out, total = [], {start}\n    for x in xs[1:]:\n"
               f"        total += x\n        out.append(total)\n    return out\n",
        "inputs": [[[rng.randint(-9, 9) for _ in range(rng.randint(0, 6))]] for _ in range(6)],
    }


def _rle(rng: random.Random) -> dict:
    alphabet = rng.choice(["ab", "abc", "xyz"])
    inputs = [["".join(rng.choice(alphabet) * rng.randint(1, 3) for _ in range(rng.randint(0, 5)))] for _ in range(6)]
    return {
        "func": "rle_encode", "signature": "def rle_encode(s: str) -> str",
        "description": "Run-length encode s: each maximal run of a character c of length n becomes "
                       "f'{c}{n}' (e.g. 'aaab' -> 'a3b1'; '' -> '').",
        "ref": "def rle_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
               "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
               "        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
        "bug": "def rle_encode(s):\n    out, run = [], 1\n    for i in range(1, len(s)):\n"
               "        if s[i] == s[i - 1]:\n            run += 1\n        else:\n"
               "            out.append(f'{s[i - 1]}{run}')\n            run = 1\n    return ''.join(out)\n",
        "inputs": inputs + [["aab"], ["z"]],
    }


def _balanced(rng: random.Random) -> dict:
    pairs = rng.choice(["()[]", "(){}", "()[]{}"])
    opens, closes = pairs[0::2], pairs[1::2]
    cases = ["", pairs[:2], pairs[0] * 2 + pairs[1] * 2, pairs[0], pairs[1] + pairs[0],
             pairs[0] + pairs[2] + pairs[3] + pairs[1], pairs[0] + pairs[2] + pairs[1] + pairs[3]]
    return {
        "func": "balanced", "signature": "def balanced(s: str) -> bool",
        "description": f"Return True if the brackets {pairs!r} in s are balanced and properly nested.",
        "ref": f"def balanced(s):\n    pairs = dict(zip({closes!r}, {opens!r}))\n    stack = []\n"
               f"    for c in s:\n        if c in {opens!r}:\n            stack.append(c)\n"
               f"        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
               f"                return False\n    return not stack\n",
        "bug": f"def balanced(s):\n    pairs = dict(zip({closes!r}, {opens!r}))\n    stack = []\n"
               f"    for c in s:\n        if c in {opens!r}:\n            stack.append(c)\n"
               f"        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
               f"                return False\n    return True\n",
        "inputs": [[c] for c in cases],
    }


def _top_k(rng: random.Random) -> dict:
    k = rng.randint(1, 3)
    vocab = ["red", "blue", "green", "gold", "grey"]
    inputs = [[[rng.choice(vocab) for _ in range(rng.randint(3, 9))]] for _ in range(6)]
    return {
        "func": "top_k", "signature": "def top_k(words: list[str]) -> list[str]",
        "description": f"Return the {k} most frequent words, most frequent first, ties broken "
                       f"alphabetically (fewer if there are fewer distinct words).",
        "ref": f"def top_k(words):\n    counts = {{}}\n    for w in words:\n        counts[w] = counts.get(w, 0) + 1\n"
               f"    return sorted(counts, key=lambda w: (-counts[w], w))[:{k}]\n",
        "bug": f"def top_k(words):\n    counts = {{}}\n    for w in words:\n        counts[w] = counts.get(w, 0) + 1\n"
               f"    return sorted(counts, key=lambda w: -counts[w])[:{k}]\n",
        "inputs": inputs,
    }


_TEMPLATES: dict[int, list[Callable[[random.Random], dict]]] = {
    0: [_scale_add, _clamp],
    1: [_count_class, _running_sum],
    2: [_rle, _balanced, _top_k],
}


def _expected(ref_src: str, func: str, inputs: list[list]) -> list[list]:
    """Run one of our own template solutions (trusted code) on the host to get outputs."""
    namespace: dict = {}
    exec(compile(ref_src, "<reference>", "exec"), namespace)  # noqa: S102 - our template, not model output
    return [[args, namespace[func](*args)] for args in inputs]


def generate_task(seed: int, index: int, difficulty: int) -> Task:
    """One ``code`` task, deterministic in (seed, index, difficulty)."""
    if not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"`difficulty` for code must be in 0..{MAX_DIFFICULTY}, got {difficulty}")
    rng = random.Random(f"code:{seed}:{index}:{difficulty}")
    for _ in range(50):  # the buggy version must fail at least one hidden test
        tpl = rng.choice(_TEMPLATES[difficulty])(rng)
        cases = _expected(tpl["ref"], tpl["func"], tpl["inputs"])
        if _expected(tpl["bug"], tpl["func"], tpl["inputs"]) != cases:
            break
    else:
        raise RuntimeError(f"no code task whose bug is caught for seed={seed} index={index}")
    kind = rng.choice(["write", "fix"])
    spec = {
        "kind": kind,
        "func": tpl["func"],
        "signature": tpl["signature"],
        "description": tpl["description"],
        "template": tpl["func"],
        "reference": tpl["ref"],
        "buggy": tpl["bug"],
        "cases": cases,
    }
    if kind == "write":
        intro = f"Write `{tpl['signature']}` in {SOLUTION_FILE}. {tpl['description']}"
    else:
        intro = (f"{SOLUTION_FILE} contains `{tpl['signature']}`, which should do this: "
                 f"{tpl['description']} It has a bug. Fix it.")
    prompt = (
        f"{intro}\nHidden unit tests decide the result.\n\n"
        "Actions (one per turn):\n"
        "WRITE <path>\\n<content>  -- write a file in the work dir\n"
        "RUN <command>            -- run a shell command in the sandbox\n"
        "TEST                     -- run the hidden tests and see failures\n"
        "SUBMIT                   -- finish"
    )
    return Task(domain=DOMAIN, difficulty=difficulty, task_id=make_task_id(DOMAIN, difficulty, seed, index),
                spec=spec, prompt=prompt)


def reference_solution(spec: dict) -> str:
    """Source of a correct solution (for the scripted reference policy)."""
    return spec["reference"]


def buggy_solution(spec: dict) -> str:
    """Source of a plausible wrong solution (for the scripted policy's noise)."""
    return spec["buggy"]


class CodeEnv:
    """The ``code`` environment; a fresh sandbox per episode.

    Args:
        sandbox_factory: makes the sandbox for an episode (default :meth:`Sandbox.create`).
        test_timeout_s: wall-clock limit of one hidden-test run, seconds.
        command_timeout_s: wall-clock limit of one RUN command, seconds.
    """

    domain = DOMAIN

    def __init__(self, *, sandbox_factory: Callable[[], Sandbox] | None = None,
                 test_timeout_s: float = 10.0, command_timeout_s: float = 10.0) -> None:
        self._factory = sandbox_factory or Sandbox.create
        self.test_timeout_s = test_timeout_s
        self.command_timeout_s = command_timeout_s
        self._sb: Sandbox | None = None
        self._task: Task | None = None
        self._last_summary: dict | None = None
        self._done = False

    def config(self) -> dict:
        return {"sandbox": "bwrap", "test_timeout_s": self.test_timeout_s,
                "command_timeout_s": self.command_timeout_s, "python": sandbox_python()}

    def reset(self, task: Task) -> str:
        self.close()
        self._task, self._last_summary, self._done = task, None, False
        try:
            self._sb = self._factory()
            if task.spec["kind"] == "fix":
                self._sb.write_file(SOLUTION_FILE, task.spec["buggy"])
        except SandboxError as err:
            raise EnvironmentFailure(f"code sandbox failed to start: {err}") from err
        return task.prompt

    def close(self) -> None:
        if self._sb is not None:
            self._sb.close()
            self._sb = None

    def _run_tests(self):
        payload = runner_input({"func": self._task.spec["func"], "cases": self._task.spec["cases"]})
        return self._sb.run([sandbox_python(), "-I", "-S", "-B", "-c", _TEST_RUNNER],
                            stdin=payload, timeout_s=self.test_timeout_s)

    def step(self, action: str) -> StepOutcome:
        if self._sb is None or self._task is None:
            raise EnvironmentFailure("step() before reset()")
        verb, rest, body = split_action(action)
        try:
            if verb == "WRITE" and rest:
                path = rest
                try:
                    self._sb.write_file(path, body)
                    result = {"exit_status": 0, "bytes": len(body.encode())}
                    obs = f"wrote {len(body.encode())} bytes to {path}"
                except SandboxError as err:
                    result = {"exit_status": 1, "error": str(err)}
                    obs = f"write failed: {err}"
                out = StepOutcome(observation=obs, tool_name="write_file",
                                  tool_args=dump_json({"path": path, "content": body}),
                                  tool_result=dump_json(result), exit_status=result["exit_status"])
            elif verb == "RUN" and rest:
                res = self._sb.run(rest, timeout_s=self.command_timeout_s)
                out = StepOutcome(observation=command_observation(res), tool_name="run",
                                  tool_args=dump_json({"cmd": rest}), tool_result=dump_json(record_command(res)),
                                  exit_status=res.exit_status)
            elif verb in ("TEST", "SUBMIT"):
                res = self._run_tests()
                self._last_summary = parse_test_summary(res.stdout) or {"passed": 0, "total": len(self._task.spec["cases"])}
                done = verb == "SUBMIT"
                self._done = done
                obs = command_observation(res)
                out = StepOutcome(observation=obs, tool_name="submit" if done else "run_tests",
                                  tool_args=dump_json({"file": SOLUTION_FILE}),
                                  tool_result=dump_json(record_command(res)), exit_status=res.exit_status, done=done)
            else:
                out = StepOutcome(observation="invalid action; use WRITE <path>, RUN <cmd>, TEST or SUBMIT",
                                  tool_name="invalid", tool_args=dump_json({"action": action[:200]}))
        except SandboxError as err:
            raise EnvironmentFailure(f"code sandbox failed: {err}") from err
        out.verdicts = verify_step(DOMAIN, self._task.spec, out.recorded(action))
        return out

    def outcome(self) -> Outcome:
        if self._task is None:
            raise EnvironmentFailure("outcome() before reset()")
        if self._last_summary is None or not self._done:
            if self._sb is None:
                raise EnvironmentFailure("sandbox already closed")
            try:
                res = self._run_tests()
            except SandboxError as err:
                raise EnvironmentFailure(f"code sandbox failed: {err}") from err
            self._last_summary = parse_test_summary(res.stdout) or {"passed": 0, "total": len(self._task.spec["cases"])}
        passed, total = int(self._last_summary["passed"]), max(int(self._last_summary["total"]), 1)
        return Outcome(status="success" if passed == total else "failure", reward=passed / total,
                       summary=f"{passed}/{total} hidden tests passed")
