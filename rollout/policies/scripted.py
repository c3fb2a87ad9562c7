"""A deterministic reference solver for the built-in domains, with seeded noise.

:class:`ScriptedPolicy` really solves tasks through the environment: it runs
the commands, reads values off calculator and table observations, and reacts to
failures it sees (it retries a failed command, rewrites code after failing
tests). It reads ``task.spec`` only for what a reference solution needs (the
correct code, the pipeline commands, the formula); the numbers it cites or
states come from observations.

With probability ``noise`` each decision is replaced by a wrong one: buggy or
unparsable code, a wrong intermediate value, a wrong citation, a command that
fails half-way or writes wrong output. Noise draws are seeded by
(``seed``, task id, step index), so a rollout is reproducible regardless of
the order episodes run in.

Tokens: with a ``tokenizer`` (``trajpipe rollout --policy scripted --model
DIR``) the solver speaks the model's token language: each action is the
tokenizer's ids of its text followed by the end-of-sequence id, and the episode
runner records the token context exactly as for a model policy (chat template,
:mod:`rollout.context`), so scripted demonstrations are token-faithful samples
a behaviour-cloning run can train on (the offline warm start). Without one,
the action text's UTF-8 bytes are its token ids (0..255) and no context is
recorded (the trainer skips such episodes). Every log-prob is 0.0: the solver
is deterministic, so the behaviour probability of its action is 1.
"""

from __future__ import annotations

import random

from typing import Any

from rollout.context import ChatEncoder
from rollout.envs.docqa_env import compute_answer, parse_table
from rollout.envs.tools_env import reference_commands
from rollout.policies.base import Action, Message, PolicyContext
from schemas.events import SamplingParams

__all__ = ["ScriptedPolicy", "byte_tokenize"]


def byte_tokenize(text: str) -> list[int]:
    """Byte-level token ids: the UTF-8 bytes of ``text``.

    Examples:
        >>> byte_tokenize("hi!")
        [104, 105, 33]
    """
    return list(text.encode("utf-8"))


def _turns(messages: list[Message]) -> list[tuple[str, str]]:
    """(action, observation) pairs of the conversation so far."""
    pairs = []
    for i, msg in enumerate(messages):
        if msg.role == "assistant":
            obs = messages[i + 1].content if i + 1 < len(messages) else ""
            pairs.append((msg.content, obs))
    return pairs


def _ok(observation: str) -> bool:
    return observation.startswith("[exit 0]")


class ScriptedPolicy:
    """Reference solver for ``code``, ``math``, ``docqa`` and ``tools``.

    Args:
        noise: probability in [0, 1] that a decision is replaced by a wrong one.
        seed: seed of the noise draws.
        policy_version: version recorded on the events (0 = base).
        max_code_attempts: how many times it rewrites code before submitting anyway.
        max_check_attempts: how many times it re-runs the tools pipeline after a failed check.
        tokenizer: a ``transformers`` tokenizer to speak (None: byte tokens, no context).
        max_prompt_tokens: with a tokenizer, the longest recorded model input
            (the episode's context is cut to it, as a model policy's would be).

    Raises:
        ValueError: ``noise`` outside [0, 1].
    """

    def __init__(self, *, noise: float = 0.0, seed: int = 0, policy_version: int = 0,
                 max_code_attempts: int = 3, max_check_attempts: int = 2, tokenizer: Any = None,
                 max_prompt_tokens: int = 1536) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"`noise` must be in [0, 1], got {noise}")
        self.tokenizer = tokenizer
        self.chat = ChatEncoder.from_tokenizer(tokenizer) if tokenizer is not None else None
        self.max_prompt_tokens = max_prompt_tokens
        self.noise = noise
        self.seed = seed
        self.policy_version = policy_version
        self.max_code_attempts = max_code_attempts
        self.max_check_attempts = max_check_attempts
        self.sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4096, seed=seed)

    def act(self, context: PolicyContext) -> Action:
        """Choose the next action for ``context.task`` from the conversation so far."""
        rng = random.Random(f"{self.seed}:{context.task.task_id}:{context.step_index}")
        wrong = rng.random() < self.noise
        domain = context.task.domain
        solver = getattr(self, f"_act_{domain}", None)
        if solver is None:
            raise ValueError(f"ScriptedPolicy has no solver for domain {domain!r}")
        text = solver(context.task.spec, _turns(context.messages), wrong, rng)
        if self.tokenizer is not None:
            tokens = list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            tokens.append(self.tokenizer.eos_token_id)
            prompt_tokens = len(context.prompt_ids or ())
        else:
            tokens = byte_tokenize(text)
            prompt_tokens = sum(len(m.content.encode("utf-8")) for m in context.messages)
        return Action(text=text, token_ids=tokens, logprobs=[0.0] * len(tokens),
                      prompt_tokens=prompt_tokens, sampling=self.sampling)

    # ------------------------------------------------------------------ code

    def _act_code(self, spec: dict, turns: list[tuple[str, str]], wrong: bool, rng: random.Random) -> str:
        writes = sum(1 for a, _ in turns if a.startswith("WRITE"))
        last_action, last_obs = turns[-1] if turns else ("", "")
        if not turns and spec["kind"] == "fix":
            return "TEST"  # read the failures first
        if last_action == "TEST" and _ok(last_obs):
            return "SUBMIT"
        if last_action.startswith("WRITE"):
            return "TEST"
        if writes >= self.max_code_attempts:
            return "SUBMIT"
        source = spec["reference"]
        if wrong:
            source = spec["buggy"] if rng.random() < 0.5 else source.replace("return ", "return (", 1)
        return f"WRITE solution.py\n{source}"

    # ------------------------------------------------------------------ math

    def _act_math(self, spec: dict, turns: list[tuple[str, str]], wrong: bool, rng: random.Random) -> str:
        steps = spec["steps"]
        stated: dict[str, str] = {}
        for action, _ in turns:
            if action.startswith("STATE"):
                name, _, value = action[len("STATE"):].partition("=")
                stated[name.strip()] = value.strip()
        i = len(turns)
        if i >= 2 * len(steps):
            final = float(stated.get(steps[-1]["name"], "0"))
            if wrong:
                final += rng.choice([-1, 1]) * rng.randint(1, 9)
            return f"ANSWER {final:.2f}"
        step = steps[i // 2]
        if i % 2 == 0:
            expr = step["expr"]
            for name in sorted(stated, key=len, reverse=True):
                expr = expr.replace(name, f"({stated[name]})")
            return f"CALC {expr}"
        try:
            value = round(float(turns[-1][1].rpartition("=")[2]), 2)
        except ValueError:  # the calculator answered with an error
            value = 0.0
        if wrong:
            value += rng.choice([-1, 1]) * rng.randint(1, 9)
        return f"STATE {step['name']} = {value:.2f}"

    # ------------------------------------------------------------------ docqa

    def _act_docqa(self, spec: dict, turns: list[tuple[str, str]], wrong: bool, rng: random.Random) -> str:
        labels = [tuple(p.strip() for p in label.split("|")) for label in spec["required_figures"]]
        tables = list(dict.fromkeys(t for t, _, _ in labels))
        seen = {a[len("LOOKUP "):]: parse_table(o) for a, o in turns if a.startswith("LOOKUP ")}
        i = len(turns)
        if i < len(tables):
            return f"LOOKUP {tables[i]}"
        j = i - len(tables)
        cited = [float(a.rpartition("=")[2]) for a, _ in turns if a.startswith("CITE ")]
        if j < len(labels):
            table, row, col = labels[j]
            value = seen.get(table, {}).get((row, col), 0.0)
            if wrong:
                value = round(value * rng.uniform(1.05, 1.3), 1)
            return f"CITE {table} | {row} | {col} = {value:.1f}"
        answer = compute_answer(spec["formula"], cited) if all(cited) else 0.0
        if wrong:
            answer += rng.choice([-1, 1]) * rng.uniform(1, 10)
        return f"ANSWER {answer:.2f}"

    # ------------------------------------------------------------------ tools

    def _act_tools(self, spec: dict, turns: list[tuple[str, str]], wrong: bool, rng: random.Random) -> str:
        commands = reference_commands(spec)
        done_cmds, checks = 0, 0
        for action, obs in turns:
            if action.startswith("RUN") and _ok(obs):
                done_cmds += 1
            elif action == "CHECK":
                checks += 1
                done_cmds = 0  # a failed check restarts the pipeline from the top
                if _ok(obs):
                    return "DONE"
        if checks >= self.max_check_attempts:
            return "DONE"
        if done_cmds >= len(commands):
            return "CHECK"
        cmd = commands[done_cmds]
        if wrong:
            target = cmd.rpartition("> ")[2].strip() if "> " in cmd else ""
            if target and rng.random() < 0.5:
                cmd = f"{cmd} && echo '#noise' >> {target}"  # succeeds, wrong content
            else:
                cmd = f"{cmd} ; exit 3"  # fails half-way; the env rolls the work dir back
        return f"RUN {cmd}"
