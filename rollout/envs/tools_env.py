"""``tools`` domain: transform files through several shell commands in a sandbox.

The work dir starts with input files; the task asks for output files that take
several commands to produce (``mkdir``, ``tr``, ``awk``, ``sort``, ``uniq``,
...). A hidden verification script (its expected contents travel on stdin)
checks the outputs.

**Rollback.** The environment snapshots the work dir after every step that
succeeds; when a command fails (non-zero exit or a sandbox limit), the work dir
is restored to the last good snapshot, so half-written outputs of a broken
pipeline never linger. The policy can also roll back explicitly.

Action format (one per turn; the verb is case-insensitive)::

    RUN <shell command>     run it in the sandbox (/bin/sh -c)
    WRITE <path>            write the lines after this one to <path>
    <content ...>
    ROLLBACK                restore the work dir to the last good snapshot
    CHECK                   run the verification script (does not end the episode)
    DONE                    finish; the verification script decides the reward

Difficulty levels: 0 = one transformation of one file, 1 = merge CSV files
and aggregate per key, 2 = extract, count and rank codes from log files
(three outputs).
"""

from __future__ import annotations

import random
from collections import Counter
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
from rollout.sandbox import Sandbox, SandboxError, SnapshotId, sandbox_python
from rollout.verifiers import parse_test_summary, verify_step

__all__ = ["ToolsEnv", "generate_task", "reference_commands", "MAX_DIFFICULTY"]

DOMAIN = "tools"
MAX_DIFFICULTY = 2

_CHECK_SCRIPT = RUNNER_PRELUDE + r"""
import marshal, sys
expected = marshal.loads(sys.stdin.buffer.read())
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
_result(passed=passed, total=len(expected))
sys.exit(0 if passed == len(expected) else 1)
"""

_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
_REGIONS = ["north", "south", "east", "west", "central"]


def _upper(rng: random.Random) -> dict:
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(4, 9))]
    text = "\n".join(lines) + "\n"
    return {
        "kind": "uppercase",
        "goal": "Create out/notes_upper.txt: input/notes.txt with every letter upper-cased.",
        "files": {"input/notes.txt": text},
        "expected": {"out/notes_upper.txt": text.upper()},
        "artifacts": ["out", "out/notes_upper.txt"],
        "commands": ["mkdir -p out", "tr a-z A-Z < input/notes.txt > out/notes_upper.txt"],
    }


def _region_totals(rng: random.Random) -> dict:
    files, totals = {}, Counter()
    for n in range(1, rng.randint(2, 4) + 1):
        rows = []
        for _ in range(rng.randint(3, 8)):
            region, amount = rng.choice(_REGIONS), rng.randint(1, 500)
            totals[region] += amount
            rows.append(f"{region},{amount}")
        files[f"data/sales_{n}.csv"] = "region,amount\n" + "\n".join(rows) + "\n"
    merged = "".join(files[p].split("\n", 1)[1] for p in sorted(files))
    return {
        "kind": "region_totals",
        "goal": ("Create out/merged.csv: the data rows (no header lines) of data/sales_*.csv in file-name order; "
                 "then out/totals.csv: one line 'region,total' per region, sorted by region name."),
        "files": files,
        "expected": {"out/merged.csv": merged,
                     "out/totals.csv": "\n".join(f"{r},{totals[r]}" for r in sorted(totals)) + "\n"},
        "artifacts": ["out", "out/merged.csv", "out/totals.csv"],
        "commands": ["mkdir -p out",
                     "for f in data/sales_*.csv; do tail -n +2 \"$f\"; done > out/merged.csv",
                     "awk -F, '{t[$1]+=$2} END {for (r in t) print r \",\" t[r]}' out/merged.csv | sort > out/totals.csv"],
    }


def _log_codes(rng: random.Random) -> dict:
    files, counts = {}, Counter()
    codes = [f"E{rng.randint(100, 999)}" for _ in range(4)]
    for n in range(1, rng.randint(2, 3) + 1):
        lines = []
        for i in range(rng.randint(6, 14)):
            if rng.random() < 0.6:
                code = rng.choice(codes)
                counts[code] += 1
                lines.append(f"2024-01-0{n} 10:{i:02d} ERROR svc={rng.choice(_WORDS)} code={code} retry")
            else:
                lines.append(f"2024-01-0{n} 10:{i:02d} INFO svc={rng.choice(_WORDS)} ok")
        files[f"logs/app{n}.log"] = "\n".join(lines) + "\n"
    if not counts:
        counts[codes[0]] += 1
        files["logs/app1.log"] += f"2024-01-01 11:00 ERROR svc=alpha code={codes[0]} retry\n"
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    raw = [ln.split("code=")[1].split()[0] for p in sorted(files) for ln in files[p].splitlines() if "code=" in ln]
    return {
        "kind": "log_codes",
        "goal": ("From logs/*.log (in file-name order) create out/codes_raw.txt: every error code (the value after "
                 "'code=') one per line in order of appearance; out/codes.txt: lines '<count> <code>' sorted by "
                 "count descending, then code ascending; out/top.txt: the most frequent code."),
        "files": files,
        "expected": {"out/codes_raw.txt": "\n".join(raw) + "\n",
                     "out/codes.txt": "\n".join(f"{n} {c}" for c, n in ranked) + "\n",
                     "out/top.txt": ranked[0][0] + "\n"},
        "artifacts": ["out", "out/codes_raw.txt", "out/codes.txt", "out/top.txt"],
        "commands": ["mkdir -p out",
                     "cat logs/*.log | grep -o 'code=E[0-9]*' | cut -d= -f2 > out/codes_raw.txt",
                     "sort out/codes_raw.txt | uniq -c | awk '{print $1\" \"$2}' | sort -k1,1nr -k2,2 > out/codes.txt",
                     "head -n 1 out/codes.txt | cut -d' ' -f2 > out/top.txt"],
    }


_GENERATORS = {0: [_upper], 1: [_region_totals], 2: [_log_codes]}


def generate_task(seed: int, index: int, difficulty: int) -> Task:
    """One ``tools`` task, deterministic in (seed, index, difficulty)."""
    if not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"`difficulty` for tools must be in 0..{MAX_DIFFICULTY}, got {difficulty}")
    rng = random.Random(f"tools:{seed}:{index}:{difficulty}")
    spec = rng.choice(_GENERATORS[difficulty])(rng)
    listing = "\n".join(f"  {p} ({len(c.splitlines())} lines)" for p, c in sorted(spec["files"].items()))
    prompt = (
        f"{spec['goal']}\nFiles in /work:\n{listing}\n\n"
        "Actions (one per turn):\n"
        "RUN <command>            -- shell command in the sandbox\n"
        "WRITE <path>\\n<content>  -- write a file\n"
        "ROLLBACK                 -- restore the last good state (automatic after a failed command)\n"
        "CHECK                    -- run the verification script\n"
        "DONE                     -- finish"
    )
    return Task(domain=DOMAIN, difficulty=difficulty, task_id=make_task_id(DOMAIN, difficulty, seed, index),
                spec=spec, prompt=prompt)


def reference_commands(spec: dict) -> list[str]:
    """The commands that solve a task (for the scripted reference policy)."""
    return list(spec["commands"])


class ToolsEnv:
    """The ``tools`` environment; a fresh sandbox per episode, snapshot after each good step.

    Args:
        sandbox_factory: makes the sandbox for an episode (default :meth:`Sandbox.create`).
        command_timeout_s: wall-clock limit of one command, seconds.
    """

    domain = DOMAIN

    def __init__(self, *, sandbox_factory: Callable[[], Sandbox] | None = None, command_timeout_s: float = 10.0) -> None:
        self._factory = sandbox_factory or Sandbox.create
        self.command_timeout_s = command_timeout_s
        self._sb: Sandbox | None = None
        self._task: Task | None = None
        self._good: SnapshotId | None = None
        self._last_check: dict | None = None
        self._done = False

    def config(self) -> dict:
        return {"sandbox": "bwrap", "command_timeout_s": self.command_timeout_s, "rollback": "auto-on-failure"}

    def reset(self, task: Task) -> str:
        self.close()
        self._task, self._last_check, self._done = task, None, False
        try:
            self._sb = self._factory()
            for path, content in task.spec["files"].items():
                self._sb.write_file(path, content)
            self._good = self._sb.snapshot()
        except SandboxError as err:
            raise EnvironmentFailure(f"tools sandbox failed to start: {err}") from err
        return task.prompt

    def close(self) -> None:
        if self._sb is not None:
            self._sb.close()
            self._sb = None

    def _check(self):
        return self._sb.run([sandbox_python(), "-I", "-S", "-c", _CHECK_SCRIPT],
                            stdin=runner_input(self._task.spec["expected"]), timeout_s=self.command_timeout_s,
                            track_files=False)

    def _after_command(self, ok: bool) -> str:
        """Snapshot on success, roll back on failure; returns a note for the observation."""
        if ok:
            self._good = self._sb.snapshot()
            return ""
        self._sb.restore(self._good)
        return f"\n[step failed: work dir rolled back to the last good state ({self._good})]"

    def step(self, action: str) -> StepOutcome:
        if self._sb is None or self._task is None:
            raise EnvironmentFailure("step() before reset()")
        verb, rest, body = split_action(action)
        try:
            if verb == "RUN" and rest:
                res = self._sb.run(rest, timeout_s=self.command_timeout_s)
                note = self._after_command(res.ok)
                out = StepOutcome(observation=command_observation(res) + note, tool_name="run",
                                  tool_args=dump_json({"cmd": rest}), tool_result=dump_json(record_command(res)),
                                  exit_status=res.exit_status)
            elif verb == "WRITE" and rest:
                try:
                    self._sb.write_file(rest, body)
                    status, err_text = 0, ""
                except SandboxError as err:
                    status, err_text = 1, str(err)
                note = self._after_command(status == 0)
                changed = {rest: "modified"} if status == 0 else {}
                result = {"exit_status": status, "stdout": "", "stderr": err_text, "files_changed": changed}
                out = StepOutcome(observation=(f"wrote {rest}" if status == 0 else f"write failed: {err_text}") + note,
                                  tool_name="write_file", tool_args=dump_json({"path": rest, "content": body[:4096]}),
                                  tool_result=dump_json(result), exit_status=status)
            elif verb == "ROLLBACK":
                self._sb.restore(self._good)
                out = StepOutcome(observation=f"restored {self._good}", tool_name="rollback",
                                  tool_args=dump_json({"snapshot": self._good}),
                                  tool_result=dump_json({"exit_status": 0}), exit_status=0)
            elif verb in ("CHECK", "DONE"):
                res = self._check()
                self._last_check = parse_test_summary(res.stdout)
                self._done = verb == "DONE"
                out = StepOutcome(observation=command_observation(res), tool_name=verb.lower(),
                                  tool_args=dump_json({}), tool_result=dump_json(record_command(res)),
                                  exit_status=res.exit_status, done=self._done)
            else:
                out = StepOutcome(observation="invalid action; use RUN, WRITE, ROLLBACK, CHECK or DONE",
                                  tool_name="invalid", tool_args=dump_json({"action": action[:200]}))
        except SandboxError as err:
            raise EnvironmentFailure(f"tools sandbox failed: {err}") from err
        out.verdicts = verify_step(DOMAIN, self._task.spec, out.recorded(action))
        return out

    def outcome(self) -> Outcome:
        if self._task is None:
            raise EnvironmentFailure("outcome() before reset()")
        if self._last_check is None or not self._done:
            if self._sb is None:
                raise EnvironmentFailure("sandbox already closed")
            try:
                self._last_check = parse_test_summary(self._check().stdout)
            except SandboxError as err:
                raise EnvironmentFailure(f"tools sandbox failed: {err}") from err
        summary = self._last_check or {"passed": 0, "total": len(self._task.spec["expected"])}
        passed, total = int(summary["passed"]), max(int(summary["total"]), 1)
        return Outcome(status="success" if passed == total else "failure", reward=passed / total,
                       summary=f"{passed}/{total} outputs correct")
