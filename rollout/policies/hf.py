"""A ``transformers`` policy: ``model.generate`` with seeded sampling and per-token logprobs.

:class:`HFPolicy` feeds the model the episode's token context exactly as the
episode runner keeps it (``PolicyContext.prompt_ids``: the chat template applied
once to the prompt, then the generated ids and each observation's own
tokenization, see :mod:`rollout.context`), samples one action with
``generate(do_sample=True, output_scores=True, return_dict_in_generate=True)``
and records, for every generated token, its log-probability under the
**sampling distribution**.

Logprob convention (the same as vLLM with ``logprobs_mode="processed_logprobs"``,
which :class:`rollout.policies.vllm.VLLMPolicy` sets):

* the log-prob is taken **after** temperature, top-k and top-p, i.e.
  ``log_softmax(top_p(top_k(logits / temperature)))`` evaluated at the sampled
  token: exactly the distribution the token was drawn from, so
  ``exp(behaviour_logprob)`` is the behaviour policy's probability of the action
  and importance ratios need no correction. Tokens outside the nucleus have
  probability 0, so a sampled token's log-prob is always finite and ``<= 0``.
* greedy decoding (``temperature == 0``) records ``log_softmax(logits)`` (no
  warper applies); vLLM does the same for greedy requests.
* to get the **raw** model log-probs (before temperature/top-p) re-score the
  action with :func:`score_tokens` and ``temperature=1, top_p=1``.

The actions' token ids include the EOS token when the model stopped on it (its
log-prob is part of the action: stopping is a decision the trainer learns);
``Action.text`` is decoded without special tokens.

Sampling is seeded per call with :func:`rollout.model.step_seed` (policy
seed, task id, the episode's sample key — group round, member, attempt — and
step index); ``generate`` draws from torch's global RNG, so calls are
serialised by a lock and run under ``torch.random.fork_rng``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec

from rollout.context import ChatEncoder, prompt_ids_of
from rollout.model import step_seed
from rollout.policies.base import Action, PolicyContext
from schemas.events import SamplingParams

__all__ = ["HFPolicy", "sampling_warpers", "score_tokens"]


def sampling_warpers(sampling: SamplingParams) -> list[Any]:
    """The ``transformers`` logits warpers that turn raw logits into the sampling distribution.

    Order as in both ``generate`` and vLLM: temperature, then top-k, then top-p.
    Empty for greedy decoding (``temperature == 0``).
    """
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    if sampling.temperature <= 0:
        return []
    warpers: list[Any] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def score_tokens(model: Any, prompt_ids: list[int], action_ids: list[int], sampling: SamplingParams) -> list[float]:
    """Teacher-forced log-probs of ``action_ids`` after ``prompt_ids`` under the sampling distribution.

    The same convention as :class:`HFPolicy` and vLLM's ``processed_logprobs``
    (see the module docstring). Use it to check recorded behaviour log-probs or
    to compute a new policy's log-probs of old actions.

    Args:
        model: a causal LM (``transformers``).
        prompt_ids: the prompt's token ids.
        action_ids: the action's token ids.
        sampling: temperature / top-k / top-p of the distribution.

    Returns:
        One natural-log probability per action token (``-inf`` for a token the
        warpers exclude).
    """
    import torch

    if not action_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(action_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    warpers = sampling_warpers(sampling)
    out = []
    for t, token in enumerate(action_ids):
        scores = logits[t:t + 1]
        for warp in warpers:
            scores = warp(ids[:, :len(prompt_ids) + t], scores)
        out.append(float(torch.log_softmax(scores, dim=-1)[0, token]))
    return out


class HFPolicy:
    """A policy backed by a ``transformers`` causal LM on CPU (or any torch device).

    Args:
        model: the causal LM (put in eval mode here).
        tokenizer: its tokenizer (with a chat template, or plain ``role: content`` prompts).
        sampling: temperature, top-p, top-k, ``max_tokens`` (new tokens per action), base seed.
        policy_version: version recorded on the events (0 = base model).
        max_model_len: context length; the episode's context is cut to
            ``max_model_len - max_tokens`` (default: the model's ``max_position_embeddings``).
        location: where the weights came from (for logs and reloads).
        policy_lineage: lineage of published versions the weights belong to (empty: base).

    Raises:
        ValueError: the context cannot hold a prompt plus ``max_tokens``.
    """

    reload_in_place = False

    def __init__(self, model: Any, tokenizer: Any, *, sampling: SamplingParams, policy_version: int = 0,
                 max_model_len: int | None = None, location: str = "", policy_lineage: str = "") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.chat = ChatEncoder.from_tokenizer(tokenizer)
        self.sampling = sampling
        self.policy_version = policy_version
        self.policy_lineage = policy_lineage
        self.location = location
        self.max_model_len = max_model_len or int(model.config.max_position_embeddings)
        self.max_prompt_tokens = self.max_model_len - sampling.max_tokens
        if self.max_prompt_tokens < 2:
            raise ValueError(f"`max_tokens` {sampling.max_tokens} leaves no room for a prompt in a context of "
                             f"{self.max_model_len} tokens; lower `max_tokens`")
        self._eos = tokenizer.eos_token_id
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, sampling: SamplingParams, policy_version: int = 0,
                        max_model_len: int | None = None, policy_lineage: str = "") -> HFPolicy:
        """Load model and tokenizer from a directory (float32 on CPU).

        Raises:
            FileNotFoundError: ``path`` is not a directory.
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist; create one with "
                                    f"`trajpipe model init-tiny --out {path}`")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return cls(model, tokenizer, sampling=sampling, policy_version=policy_version,
                   max_model_len=max_model_len, location=str(path), policy_lineage=policy_lineage)

    def reload(self, location: str, version: int, *, lineage: str = "") -> HFPolicy:
        """A new policy with the weights at ``location``; this one stays usable.

        Episodes in flight keep the old object (and version) until they end.
        """
        import torch
        from transformers import AutoModelForCausalLM

        if not Path(location, "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {location}; PolicyPublished.location must be a model "
                                    "directory with merged weights")
        # The vocabulary never changes between versions: keep the tokenizer (a trainer
        # checkpoint need not carry one).
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32)
        return HFPolicy(model, self.tokenizer, sampling=self.sampling, policy_version=version,
                        max_model_len=self.max_model_len, location=str(location), policy_lineage=lineage)

    def prompt_ids(self, context: PolicyContext) -> list[int]:
        """Token ids this policy feeds the model for ``context`` (:func:`rollout.context.prompt_ids_of`)."""
        return prompt_ids_of(context, self.chat, max_prompt_tokens=self.max_prompt_tokens)

    def act(self, context: PolicyContext) -> Action:
        """Sample the next action for ``context`` (seeded by task id, sample key and step index)."""
        seed = step_seed(self.sampling.seed or 0, context.task.task_id, context.step_index, sample=context.sample)
        return self.generate(self.prompt_ids(context), seed=seed)

    def generate(self, prompt_ids: list[int], *, seed: int) -> Action:
        """Sample one action after ``prompt_ids`` with the policy's sampling parameters and ``seed``."""
        import torch

        s = self.sampling
        greedy = s.temperature <= 0
        kwargs: dict[str, Any] = {
            "max_new_tokens": s.max_tokens, "do_sample": not greedy, "eos_token_id": self._eos,
            "pad_token_id": self._pad, "output_scores": True, "return_dict_in_generate": True,
        }
        if not greedy:
            # top_k=0 disables the top-k warper (generate's default would be 50).
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0))
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with self._lock, torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out.sequences[0, len(prompt_ids):]
        token_ids: list[int] = []
        logprobs: list[float] = []
        for t, token in enumerate(new.tolist()):
            logprobs.append(float(torch.log_softmax(out.scores[t][0].float(), dim=-1)[token]))
            token_ids.append(token)
            if token == self._eos:
                break
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return Action(text=text, token_ids=token_ids, logprobs=logprobs, prompt_tokens=len(prompt_ids),
                      sampling=msgspec.structs.replace(s, seed=seed))
