"""Token-in, token-out episode context: the exact ids a model is fed, each turn tokenized once.

Multi-turn RL breaks quietly when a rollout re-renders and re-tokenizes the
whole conversation before every action: the ids of an earlier action are not
the ids the model generated (BPE merges across the turn boundary, a template
strips or rewrites past turns), so the log-probs the trainer recomputes are of
another sequence (TRL #5224, verl #6719). Here an episode keeps its context as
a growing list of token ids, the *stream*:

* step 0: the chat template applied once to the task prompt, with the
  assistant's generation marker (:meth:`ChatEncoder.prompt_ids`);
* after each action: exactly the ids the model generated, end-of-sequence
  token included when it stopped on one;
* after each observation: the template's closing marker of the assistant turn
  (only if the model did not emit it itself), the observation turn and the next
  assistant marker, tokenized on their own (:meth:`ChatEncoder.observation_ids`).

Past turns are never tokenized again. Each ``step`` event records the ids
appended before its action as ``observation_token_ids``, so concatenating the
recorded observation and action ids of steps ``0..k`` reproduces the stream the
model was fed at step ``k`` (:func:`model_input_of`).

**Context cut.** When the stream no longer fits ``max_prompt_tokens`` (the
model's context minus the generation budget), :meth:`TokenContext.model_input`
cuts a block out of it: it keeps the head of the stream (the start of the task
prompt, at most half the budget) and the newest tokens, and drops the oldest
turns after the head, preferring to cut at a turn boundary. The cut is recorded
on the step as ``context_cut_start`` / ``context_cut_tokens``: the model's input
was ``stream[:start] + stream[start + tokens:]``, which the trainer rebuilds.

Examples:
    >>> enc = ChatEncoder.plain(lambda text: [ord(c) for c in text], eos_id=0)
    >>> ctx = TokenContext(enc, max_prompt_tokens=1000)
    >>> step0 = ctx.begin("2+2?")
    >>> ctx.add_action([ord("4"), 0])  # the model answered "4" and stopped (EOS id 0)
    >>> step1 = ctx.add_observation("ok")
    >>> "".join(map(chr, step0)), "".join(map(chr, step1))
    ('user: 2+2?\\nassistant: ', '\\ntool: ok\\nassistant: ')
    >>> ctx.model_input().ids == step0 + [ord("4"), 0] + step1
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

__all__ = ["ChatEncoder", "ContextWindow", "TokenContext", "ChatTemplateError", "model_input_of", "prompt_ids_of"]

# A string no template or tokenizer will produce on its own: marks where the assistant's
# content sits in a rendered conversation, so the text around it is the template's.
_SENTINEL = "\u2063TRAJPIPE_ACTION\u2063"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered turn by turn (it rewrites past turns)."""


class ContextWindow(msgspec.Struct, frozen=True):
    """What the model is fed for the next action.

    Attributes:
        ids: the input token ids.
        cut_start: position in the stream where tokens were cut out (0 if none).
        cut_tokens: how many tokens were cut there (0: the whole stream).
    """

    ids: list[int]
    cut_start: int = 0
    cut_tokens: int = 0


class ChatEncoder:
    """Turns of a chat template as token-id deltas, each tokenized on its own.

    Build one with :meth:`from_tokenizer` (a ``transformers`` tokenizer with a
    chat template, or plain ``role: content`` lines if it has none) or
    :meth:`plain` (any text -> ids function).

    Args:
        encode: text -> token ids, adding no special tokens of its own.
        prompt_text: renders the first user turn plus the assistant marker.
        close_text: text closing an assistant turn after its content.
        turn_text: renders an observation turn (its content) plus the next assistant marker.
        eos_id: the end-of-sequence id; an action ending with it already closed its turn.
        eos_text: the text of ``eos_id`` as the template writes it (stripped from
            ``close_text`` when the model emitted it itself).
    """

    def __init__(self, *, encode: Callable[[str], list[int]], prompt_text: Callable[[str], str], close_text: str,
                 turn_text: Callable[[str], str], eos_id: int | None, eos_text: str = "") -> None:
        self._encode = encode
        self._prompt_text = prompt_text
        self.close_text = close_text
        self._turn_text = turn_text
        self.eos_id = eos_id
        self.eos_text = eos_text

    @classmethod
    def plain(cls, encode: Callable[[str], list[int]], *, eos_id: int | None = None) -> ChatEncoder:
        """``role: content`` lines (the format of tokenizers without a chat template)."""
        return cls(encode=encode, prompt_text=lambda p: f"user: {p}\nassistant: ", close_text="\n",
                   turn_text=lambda c: f"tool: {c}\nassistant: ", eos_id=eos_id)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, observation_role: str = "tool") -> ChatEncoder:
        """The encoder of a ``transformers`` tokenizer and its chat template.

        The turn texts are cut out of full renderings of the template around a
        sentinel assistant message, so any template that renders past turns
        unchanged works; one that rewrites them is refused.

        Raises:
            ChatTemplateError: the template does not render turn by turn.
        """
        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

        eos_id = tokenizer.eos_token_id
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain(encode, eos_id=eos_id)

        def render(messages: list[dict], generation: bool) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        user = {"role": "user", "content": "U"}
        before = render([user, {"role": "assistant", "content": _SENTINEL}], False)
        after = render([user, {"role": "assistant", "content": _SENTINEL},
                        {"role": observation_role, "content": "O"}], True)
        at = before.find(_SENTINEL)
        if at < 0 or not after.startswith(before[:at + len(_SENTINEL)]):
            raise ChatTemplateError("the chat template re-renders earlier turns; token-in, token-out rollouts "
                                    "need a template that renders each turn after the previous ones unchanged")
        prompt_head = render([user], True)
        if not before.startswith(prompt_head):
            raise ChatTemplateError("the chat template's assistant turn does not continue its generation prompt")
        close = before[at + len(_SENTINEL):]
        if not after[at + len(_SENTINEL):].startswith(close):
            raise ChatTemplateError("the chat template closes an assistant turn differently when another follows")

        def prompt_text(prompt: str) -> str:
            return render([{"role": "user", "content": prompt}], True)

        # The observation turn around its content, e.g. "<|tool|>\n" + content + "<|eos|>\n<|assistant|>\n".
        probe = render([user, {"role": "assistant", "content": _SENTINEL},
                        {"role": observation_role, "content": _SENTINEL}], True)
        turn = probe[at + len(_SENTINEL) + len(close):]
        head, mark, tail = turn.partition(_SENTINEL)
        if not mark:
            raise ChatTemplateError("cannot find the observation's content in the chat template's rendering")

        def turn_text(content: str) -> str:
            return f"{head}{content}{tail}"

        eos_text = tokenizer.eos_token or ""
        return cls(encode=encode, prompt_text=prompt_text, close_text=close, turn_text=turn_text,
                   eos_id=eos_id, eos_text=eos_text)

    def prompt_ids(self, prompt: str) -> list[int]:
        """Ids of the first turn: the template applied to the task prompt, ending with the assistant marker."""
        return self._encode(self._prompt_text(prompt))

    def observation_ids(self, observation: str, *, closed: bool) -> list[int]:
        """Ids appended after an action and before the next one.

        Args:
            observation: the environment's answer (the template's ``tool`` turn).
            closed: the action ended with the end-of-sequence token (it closed its
                own turn; only the rest of the closing text is added).
        """
        close = self.close_text
        if closed and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        return self._encode(close + self._turn_text(observation))


class TokenContext:
    """One episode's token stream and the model input it gives (see the module docstring).

    Args:
        encoder: renders turns as ids.
        max_prompt_tokens: the longest model input (context length minus the
            generation budget), >= 2.

    Raises:
        ValueError: ``max_prompt_tokens < 2``.
    """

    def __init__(self, encoder: ChatEncoder, *, max_prompt_tokens: int) -> None:
        if max_prompt_tokens < 2:
            raise ValueError(f"`max_prompt_tokens` must be >= 2, got {max_prompt_tokens}")
        self.encoder = encoder
        self.max_prompt_tokens = max_prompt_tokens
        self.stream: list[int] = []
        self._prompt_len = 0
        self._turn_starts: list[int] = []  # where each observation delta after step 0 starts
        self._closed = False

    def begin(self, prompt: str) -> list[int]:
        """Start the stream with the rendered prompt; returns its ids (step 0's ``observation_token_ids``).

        Raises:
            RuntimeError: the episode already began.
        """
        if self.stream:
            raise RuntimeError("TokenContext.begin() called twice")
        ids = self.encoder.prompt_ids(prompt)
        self.stream.extend(ids)
        self._prompt_len = len(ids)
        return list(ids)

    def add_action(self, token_ids: Sequence[int]) -> None:
        """Append the ids the model generated (as generated)."""
        self.stream.extend(int(t) for t in token_ids)
        self._closed = bool(token_ids) and self.encoder.eos_id is not None and token_ids[-1] == self.encoder.eos_id

    def add_observation(self, observation: str) -> list[int]:
        """Append the observation turn; returns the ids appended (the next step's ``observation_token_ids``)."""
        ids = self.encoder.observation_ids(observation, closed=self._closed)
        self._turn_starts.append(len(self.stream))
        self.stream.extend(ids)
        return ids

    def model_input(self) -> ContextWindow:
        """The input for the next action: the whole stream, or a cut of it that fits."""
        n, budget = len(self.stream), self.max_prompt_tokens
        if n <= budget:
            return ContextWindow(list(self.stream))
        head = max(1, min(self._prompt_len, budget // 2))
        need = n - budget  # tokens that must go
        # Prefer dropping whole turns: the first turn start at or past head + need (and not the last turn).
        boundary = next((b for b in self._turn_starts if b >= head + need and b < self._turn_starts[-1]), None)
        cut = boundary - head if boundary is not None else need
        return ContextWindow(self.stream[:head] + self.stream[head + cut:], cut_start=head, cut_tokens=cut)


def model_input_of(observation_ids: Sequence[Sequence[int]], action_ids: Sequence[Sequence[int]], *,
                   step: int, cut_start: int = 0, cut_tokens: int = 0) -> list[int]:
    """Rebuild the model input of ``step`` from recorded steps (what the trainer does).

    Args:
        observation_ids: each step's ``observation_token_ids``.
        action_ids: each step's ``action_token_ids``.
        step: the step whose input to rebuild.
        cut_start: that step's ``context_cut_start``.
        cut_tokens: that step's ``context_cut_tokens``.

    Examples:
        >>> model_input_of([[1, 2], [5]], [[3, 4], [6]], step=1)
        [1, 2, 3, 4, 5]
        >>> model_input_of([[1, 2], [5]], [[3, 4], [6]], step=1, cut_start=1, cut_tokens=2)
        [1, 4, 5]
    """
    stream: list[int] = []
    for k in range(step + 1):
        stream.extend(int(t) for t in observation_ids[k])
        if k < step:
            stream.extend(int(t) for t in action_ids[k])
    return stream[:cut_start] + stream[cut_start + cut_tokens:] if cut_tokens else stream


def prompt_ids_of(context: Any, encoder: ChatEncoder, *, max_prompt_tokens: int) -> list[int]:
    """The ids a model policy feeds for ``context`` (a :class:`rollout.policies.base.PolicyContext`).

    ``context.prompt_ids`` when the episode runner set them (the episode's token
    context); otherwise the conversation must be the first turn only (one user
    message), rendered here. A longer conversation without ids is refused:
    rendering past actions again would re-tokenize them, and the recorded ids
    would not be the ones the model produced.

    Raises:
        ValueError: a multi-turn conversation without ``prompt_ids``.
    """
    if context.prompt_ids is not None:
        return list(context.prompt_ids)
    messages = context.messages
    if len(messages) != 1 or messages[0].role != "user":
        raise ValueError("a multi-turn PolicyContext needs `prompt_ids` (the episode's token context, see "
                         "rollout.context.TokenContext); re-rendering past turns would re-tokenize them")
    ctx = TokenContext(encoder, max_prompt_tokens=max_prompt_tokens)
    ctx.begin(messages[0].content)
    return ctx.model_input().ids
