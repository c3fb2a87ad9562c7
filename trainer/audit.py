"""Audit a dataset's behaviour log-probs: re-score every recorded action on the trainer's data path.

The trainer's importance ratios, KL terms and behaviour cloning are only right
if the sequence it scores is the one the behaviour policy saw, on the
distribution the action was sampled from. This audit checks exactly that, end
to end: it reads a dataset through :class:`trainer.data.TrajectoryStream`
(episode windows rebuilt from the recorded token stream and context cuts),
runs the given weights over the packed batches as the training engine does
(``position_ids`` restarting per segment, no attention mask) and takes
:func:`trainer.losses.token_logprobs` on each step's recorded sampling
distribution (temperature, top-k, top-p). Under the *same* weights that acted
(``policy_version``), every recorded action token's log-prob must come back:
``|log pi(a|s) - behaviour_logprob| ~ 0`` up to floating point (float32 CPU
transformers vs. ``generate`` with a KV cache: ~1e-6; vLLM's CPU kernels:
~1e-3, see docs/trainer.md). Run it with ``trajpipe audit logprobs``.

Tokens in *inexact* windows (the trainer had to give an action less context
than the model saw, ``seq_len`` below the policy's context) are counted but
not compared: their log-probs are expected to differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import torch

from trainer.data import PackedBatch, StepFilter, TrajectoryLoader, TrajectoryStream
from trainer.engine import load_model
from trainer.losses import token_logprobs

__all__ = ["LogprobAudit", "AdvantageLogprobs", "audit_behaviour_logprobs", "advantage_logprobs"]


class LogprobAudit(msgspec.Struct, kw_only=True):
    """Result of :func:`audit_behaviour_logprobs` (the CLI's last-line JSON).

    Attributes:
        episodes: episodes whose windows were scored.
        windows: packed segments (episode windows) scored.
        tokens: action tokens compared (recorded behaviour log-prob, exact window).
        max_abs_err: largest ``|trainer log-prob - behaviour log-prob|`` over them.
        mean_abs_err: mean of the same.
        p99_abs_err: its 99th percentile.
        outside_support: compared tokens the trainer finds outside the sampling
            distribution's support (``-inf``: the nucleus/top-k excludes them).
        inexact_windows: windows with less context than the model saw (not compared).
        episodes_without_context: episodes skipped: no recorded context (step 0 has no ids).
    """

    episodes: int = 0
    windows: int = 0
    tokens: int = 0
    max_abs_err: float = 0.0
    mean_abs_err: float = 0.0
    p99_abs_err: float = 0.0
    outside_support: int = 0
    inexact_windows: int = 0
    episodes_without_context: int = 0


@torch.no_grad()
def audit_behaviour_logprobs(
    data_dir: str | Path,
    model_dir: str | Path,
    *,
    recipe: str | None = None,
    policy_version: int | None = None,
    seq_len: int = 4096,
    batch_size: int = 2,
    domains: tuple[str, ...] | None = None,
) -> LogprobAudit:
    """Re-score the recorded actions of a dataset with the weights at ``model_dir``.

    Args:
        data_dir: dataset root (``_commit_log/``, ``steps/``).
        model_dir: the weights to score with: those of the behaviour policy to
            check the round trip.
        recipe: dataset version (default: the only one).
        policy_version: compare only steps acted by this version (None: all).
        seq_len: packed sequence length; at least the policy's ``max_model_len``
            for every window to be exact.
        batch_size: packed sequences per forward.
        domains: only these domains.

    Returns:
        The :class:`LogprobAudit`.
    """
    stream = TrajectoryStream(
        data_dir, seq_len=seq_len, batch_size=batch_size, recipe=recipe, mode="offline", max_epochs=1,
        shuffle=False, filters=StepFilter(domains=domains, min_policy_version=policy_version,
                                          max_policy_version=policy_version, include_untrainable=True))
    errors: list[np.ndarray] = []
    out = LogprobAudit()
    seen: set[str] = set()
    compare_of = lambda b: b.loss_mask & b.has_behaviour_logprobs & _exact_tokens(b)  # noqa: E731
    for batch, compare, logp in _scored_batches(stream, model_dir, compare_of):
        c = batch.counts
        out.inexact_windows += c.inexact_windows
        out.episodes_without_context += c.episodes_without_context
        out.windows += len(batch.sample_ids)
        seen.update(batch.episode_ids)
        got, want = logp[compare], batch.behaviour_logprobs[compare]
        finite = torch.isfinite(got)
        out.outside_support += int((~finite).sum())
        errors.append((got[finite] - want[finite]).abs().double().numpy())
    err = np.concatenate(errors) if errors else np.zeros(0)
    out.episodes = len(seen)
    out.tokens = int(err.size)
    if err.size:
        out.max_abs_err = float(err.max())
        out.mean_abs_err = float(err.mean())
        out.p99_abs_err = float(np.quantile(err, 0.99))
    return out


def _scored_batches(stream: TrajectoryStream, model_dir: str | Path,
                    mask_of: Callable[[PackedBatch], torch.Tensor]) -> Iterator[tuple[PackedBatch, torch.Tensor,
                                                                                     torch.Tensor]]:
    """``(batch, mask, log-probs)`` of every batch: the weights at ``model_dir`` run as the engine runs them.

    Packed segments with ``position_ids`` restarting per segment and no attention mask (transformers
    builds the block-causal mask), log-probs on each token's sampling distribution, for ``mask_of(batch)``.
    """
    model = load_model(model_dir).eval()
    for batch in TrajectoryLoader(stream):
        mask = mask_of(batch)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        yield batch, mask, token_logprobs(logits, batch.input_ids, temperature=batch.temperature,
                                          top_k=batch.top_k, top_p=batch.top_p, mask=mask)


def _exact_tokens(batch) -> torch.Tensor:
    """Tokens of segments that give their actions the whole context the model saw."""
    exact = torch.tensor(batch.sample_exact + [False], dtype=torch.bool)  # index -1 (padding) -> False
    return exact[batch.segment_ids]


class AdvantageLogprobs(msgspec.Struct, kw_only=True):
    """Mean log-prob of a dataset's action tokens under some weights, by the sign of their advantage.

    Attributes:
        positive_tokens: action tokens of steps with advantage > 0.
        positive_mean_logprob: their mean log-prob (sampling distribution of each step).
        negative_tokens: action tokens of steps with advantage < 0.
        negative_mean_logprob: their mean log-prob.
    """

    positive_tokens: int = 0
    positive_mean_logprob: float = 0.0
    negative_tokens: int = 0
    negative_mean_logprob: float = 0.0


@torch.no_grad()
def advantage_logprobs(
    data_dir: str | Path,
    model_dir: str | Path,
    *,
    advantage_field: str = "group_advantage",
    recipe: str | None = None,
    seq_len: int = 4096,
    batch_size: int = 2,
) -> AdvantageLogprobs:
    """How likely the weights at ``model_dir`` find the dataset's good and bad actions (trainable steps only).

    A policy-gradient step on this data should raise the first mean and lower the second (what GRPO's
    objective ``sum_i A_i log pi(o_i)`` rewards, DeepSeekMath arXiv:2402.03300 eq. 3).
    """
    stream = TrajectoryStream(data_dir, seq_len=seq_len, batch_size=batch_size, recipe=recipe, mode="offline",
                              max_epochs=1, shuffle=False, advantage_field=advantage_field)
    pos: list[torch.Tensor] = []
    neg: list[torch.Tensor] = []
    for batch, mask, logp in _scored_batches(stream, model_dir, lambda b: b.loss_mask):
        pos.append(logp[mask & (batch.advantages > 0)])
        neg.append(logp[mask & (batch.advantages < 0)])
    p = torch.cat(pos) if pos else torch.zeros(0)
    n = torch.cat(neg) if neg else torch.zeros(0)
    return AdvantageLogprobs(positive_tokens=int(p.numel()), positive_mean_logprob=float(p.mean()) if p.numel() else 0.0,
                             negative_tokens=int(n.numel()), negative_mean_logprob=float(n.mean()) if n.numel() else 0.0)
