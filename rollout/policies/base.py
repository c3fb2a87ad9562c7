"""The policy protocol: what a rollout worker needs from a model.

A policy sees the conversation so far (:class:`PolicyContext`) and returns one
:class:`Action`: the text plus what the trainer needs to learn from it (token
ids, the behaviour policy's per-token log-probs, the prompt size, the sampling
parameters).

Token-in, token-out: a policy with a tokenizer exposes a ``chat``
(:class:`rollout.context.ChatEncoder`) and ``max_prompt_tokens``; the episode
runner then keeps the episode's context as token ids
(:class:`rollout.context.TokenContext`) and hands the policy the exact ids to
feed the model in ``PolicyContext.prompt_ids``, so past turns are never
re-tokenized and what the step records is what the model saw.
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
        prompt_ids: the exact token ids to feed the model (the episode's token
            context, cut to fit); None for policies without a tokenizer.
        sample: which sample of the task this episode is (group round, member
            index, attempt); model policies mix it into the sampling seed.
    """

    task: Task
    messages: list[Message]
    step_index: int
    prompt_ids: list[int] | None = None
    sample: str = ""


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
    """A policy: ``act(context) -> Action``; ``policy_version`` names the weights that acted.

    Optional attributes the episode runner reads: ``chat`` and
    ``max_prompt_tokens`` (token-in, token-out context, see the module
    docstring) and ``policy_lineage`` (the lineage of published versions the
    weights belong to; empty for a base model).
    """

    policy_version: int
    sampling: SamplingParams

    def act(self, context: PolicyContext) -> Action: ...
