"""The policy protocol: what a rollout worker needs from a model.

A policy sees the conversation so far (:class:`PolicyContext`) and returns one
:class:`Action`: the text plus what the trainer needs to learn from it (token
ids, the behaviour policy's per-token log-probs, the prompt size, the sampling
parameters).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from rollout.envs.base import Task
from schemas.events import SamplingParams

__all__ = ["Message", "PolicyContext", "Action", "Policy"]


class Message(msgspec.Struct, frozen=True):
    """One turn of the conversation.

    Attributes:
        role: ``user`` (the task prompt), ``assistant`` (the policy's actions)
            or ``tool`` (environment observations).
        content: the text.
    """

    role: str
    content: str


class PolicyContext(msgspec.Struct, kw_only=True):
    """Everything a policy may look at to choose its next action.

    Attributes:
        task: the task being solved. Model policies use only ``messages``;
            the scripted reference solver also reads ``task.spec``.
        messages: the conversation so far: prompt, then alternating actions and observations.
        step_index: index of the step about to be taken (0-based).
    """

    task: Task
    messages: list[Message]
    step_index: int


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """One policy output.

    Attributes:
        text: the action text given to the environment.
        token_ids: token ids of ``text``, shape ``[action_tokens]``.
        logprobs: behaviour log-prob of each token (natural log, <= 0), same shape.
        prompt_tokens: number of prompt tokens consumed to produce it.
        sampling: sampling parameters used.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"`token_ids` has {len(self.token_ids)} entries but `logprobs` has {len(self.logprobs)}"
            )


@runtime_checkable
class Policy(Protocol):
    """A policy: ``act(context) -> Action``; ``policy_version`` names the weights that acted."""

    policy_version: int
    sampling: SamplingParams

    def act(self, context: PolicyContext) -> Action: ...
