"""Shared types of the rollout environments: tasks, step outcomes, outcomes, the protocol.

An environment is driven by text actions a language model could emit. Every
domain documents its action format in its module docstring and in the task
prompt; an action that does not parse is answered with an ``invalid`` step
(``tool_name="invalid"``) and a hint, never an exception.
"""

from __future__ import annotations

import hashlib
import json
import marshal
from typing import Any, Protocol, runtime_checkable

import msgspec

from rollout.verifiers import Verdict

__all__ = [
    "Task",
    "StepOutcome",
    "Outcome",
    "Environment",
    "EnvironmentFailure",
    "make_task_id",
    "record_command",
    "dump_json",
    "split_action",
    "RECORD_MAX_CHARS",
    "command_observation",
    "RUNNER_PRELUDE",
    "runner_input",
]

#: stdout/stderr characters kept per stream when a command is recorded in a Step.
RECORD_MAX_CHARS = 4096


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One task of one domain.

    Attributes:
        domain: environment domain (``code``, ``math``, ``docqa``, ``tools``, ...).
        difficulty: 0 = easiest; each domain documents its levels.
        task_id: stable id (same generator, seed and index -> same id).
        spec: JSON-serialisable task description; the verifiers' only task input.
        prompt: the instructions shown to the policy.
    """

    domain: str
    difficulty: int
    task_id: str
    spec: dict
    prompt: str


class StepOutcome(msgspec.Struct, kw_only=True):
    """What the environment answered to one action.

    Attributes:
        observation: text shown to the policy next.
        tool_name: tool the action invoked (``invalid`` if it did not parse).
        tool_args: the tool's arguments, JSON document.
        tool_result: the tool's result, JSON document (bounded).
        exit_status: exit status of a sandboxed command, if one ran.
        done: the episode is over.
        verdicts: step verifiers' verdicts (from :func:`rollout.verifiers.verify_step`).
    """

    observation: str
    tool_name: str | None = None
    tool_args: str | None = None
    tool_result: str | None = None
    exit_status: int | None = None
    done: bool = False
    verdicts: list[Verdict] = msgspec.field(default_factory=list)

    def recorded(self, action_text: str) -> dict:
        """The step fields the verifiers see, exactly as a Step event records them."""
        return {
            "action_text": action_text,
            "tool_name": self.tool_name,
            "tool_args": self.tool_args,
            "tool_result": self.tool_result,
            "exit_status": self.exit_status,
        }


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How an episode ended, from the environment's view.

    Attributes:
        status: ``success`` or ``failure`` (values of :class:`schemas.events.EpisodeStatus`).
        reward: outcome reward in [0, 1].
        summary: short human-readable summary of the final verification.
    """

    status: str
    reward: float
    summary: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"`reward` must be in [0, 1], got {self.reward}")


class EnvironmentFailure(RuntimeError):
    """The environment broke (sandbox down, internal error): not the policy's fault."""


@runtime_checkable
class Environment(Protocol):
    """A domain environment; one episode at a time.

    ``reset`` starts an episode and returns the first observation (the prompt),
    ``step`` applies one text action, ``outcome`` gives the final verdict
    (it may run a final check when the episode ended without a finishing action),
    ``close`` frees resources (sandboxes).
    """

    domain: str

    def reset(self, task: Task) -> str: ...

    def step(self, action: str) -> StepOutcome: ...

    def outcome(self) -> Outcome: ...

    def config(self) -> dict: ...

    def close(self) -> None: ...


def make_task_id(domain: str, difficulty: int, seed: int, index: int) -> str:
    """Stable task id: ``<domain>-d<difficulty>-<12 hex>``.

    Examples:
        >>> make_task_id("math", 1, 7, 0) == make_task_id("math", 1, 7, 0)
        True
    """
    digest = hashlib.blake2b(f"{domain}\x1f{difficulty}\x1f{seed}\x1f{index}".encode(), digest_size=6).hexdigest()
    return f"{domain}-d{difficulty}-{digest}"


def dump_json(doc: Any) -> str:
    """Compact, key-sorted JSON (stable bytes for the same document)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_RUNNER_HELPERS = r"""
def _json_str(s):
    out = []
    for c in s:
        o = ord(c)
        if c == '"' or c == '\\':
            out.append('\\' + c)
        elif 0x20 <= o < 0x7f:
            out.append(c)
        elif c in '\b\f\n\r\t':
            out.append('\\' + 'bfnrt'['\b\f\n\r\t'.index(c)])
        elif o < 0x10000:
            out.append('\\u%04x' % o)
        else:
            o -= 0x10000
            out.append('\\u%04x\\u%04x' % (0xd800 | (o >> 10), 0xdc00 | (o & 0x3ff)))
    return '"' + ''.join(out) + '"'
def _result(**fields):
    print("RESULT {" + ", ".join(_json_str(k) + ": " + (str(v) if type(v) is int else _json_str(v))
                               for k, v in fields.items()) + "}")
"""

#: The first line of the scripts the environments start inside their sandboxes (the code domain's test
#: runner, the tools domain's output check) with ``python -I -S``: it defines ``_result``, which prints the
#: ``RESULT {...}`` line :func:`rollout.verifiers.parse_test_summary` reads exactly as ``json.dumps`` would
#: (``_json_str`` is ``json.dumps`` of a string, with its default ``ensure_ascii``; tested against it).
#: Such a script reads its document from stdin with ``marshal`` (:func:`runner_input` writes it): neither
#: needs a module beyond those the interpreter starts with, where ``json`` pulls in ``re`` and ``enum``,
#: ~12 ms of CPU a sandboxed run on top of the interpreter's ~7 (docs/rollout.md, "Runner scripts").
#: One line (an ``exec`` of the helpers' source), so the lines of what follows, which a traceback the
#: test runner prints names, are those they had when the scripts imported ``json``.
RUNNER_PRELUDE = f"exec({_RUNNER_HELPERS!r})"


def runner_input(doc: Any) -> bytes:
    """The stdin of a sandboxed runner script: ``doc`` as ``json.loads(json.dumps(doc))`` gives it, marshalled.

    The round trip through JSON keeps what the script sees what it saw when it read JSON (tuples become
    lists, keys strings); marshal's format 4 is read by every Python 3 from 3.4 on, whatever interpreter
    :func:`rollout.sandbox.sandbox_python` picks.
    """
    return marshal.dumps(json.loads(json.dumps(doc)), 4)


def _clip(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit], True


def record_command(result: Any, *, max_chars: int = RECORD_MAX_CHARS) -> dict:
    """A :class:`rollout.sandbox.CommandResult` as a bounded dict for ``Step.tool_result``."""
    doc = result.to_dict()
    doc["stdout"], cut_out = _clip(doc["stdout"], max_chars)
    doc["stderr"], cut_err = _clip(doc["stderr"], max_chars)
    doc["truncated"] = bool(doc["truncated"] or cut_out or cut_err)
    changed = doc["files_changed"]
    if len(changed) > 200:
        doc["files_changed"] = dict(list(changed.items())[:200])
        doc["files_changed_total"] = len(changed)
    return doc


def split_action(action: str) -> tuple[str, str, str]:
    """Split an action into (VERB, rest of first line, body after the first line).

    Examples:
        >>> split_action("WRITE a.py\\nprint(1)\\n")
        ('WRITE', 'a.py', 'print(1)\\n')
        >>> split_action("  answer 42 ")
        ('ANSWER', '42', '')
    """
    text = action.lstrip()
    first, _, body = text.partition("\n")
    verb, _, rest = first.strip().partition(" ")
    return verb.upper(), rest.strip(), body


def command_observation(result: Any, *, max_chars: int = 2000) -> str:
    """Readable text of a command result for the policy's next observation."""
    parts = [f"[exit {result.exit_status}" + (f", {result.killed_reason}" if result.killed_reason else "") + "]"]
    if result.stdout:
        parts.append(result.stdout[-max_chars:])
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr[-max_chars:])
    if result.files_changed:
        parts.append("[files changed] " + ", ".join(f"{p} ({k})" for p, k in list(result.files_changed.items())[:20]))
    return "\n".join(parts)
