"""Training objectives on packed batches: filtered BC, AWR, PPO-clip / GRPO, KL to a reference.

Every function takes per-token tensors of shape ``[B, L]`` aligned with
``PackedBatch.input_ids`` (entry ``t`` is about token ``t``) and a boolean
``mask`` of the tokens that count, and returns a :class:`LossOutput`.

Aggregation (how per-token losses become one number), ``aggregation=``:

* ``"token"``: mean over every masked token of the batch,
  ``sum_t l_t / sum_t m_t``. Long responses weigh more (each token counts
  once); what DAPO (arXiv:2503.14476, sec. 3.3) recommends for long chains.
* ``"sequence"``: mean over each sample's masked tokens, then mean over
  samples, ``1/S sum_s (1/|o_s|) sum_{t in s} l_t``: the original GRPO
  objective (DeepSeekMath, arXiv:2402.03300, eq. 3). Every sample weighs the
  same whatever its length.

With gradient accumulation each micro-batch is aggregated on its own (the
engine averages micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "LossOutput",
    "Aggregation",
    "token_logprobs",
    "aggregate",
    "kl_k3",
    "staleness_weights",
    "filtered_bc_loss",
    "awr_loss",
    "ppo_clip_loss",
    "Objective",
    "FilteredBC",
    "AdvantageWeightedRegression",
    "PolicyGradient",
    "build_objective",
    "OBJECTIVES",
]

Aggregation = Literal["token", "sequence"]


@dataclass
class LossOutput:
    """A loss to backpropagate and the metrics to log.

    Attributes:
        loss: scalar tensor with grad.
        metrics: detached scalar tensors, keyed without prefix (``loss``,
            ``clip_fraction``, ...); the recipe adds ``train/``.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``log pi(x_t | x_<t)`` for every token: ``[B, L]`` (column 0, which has no context, is 0).

    Computed as a cross-entropy in float32, which never materialises the full
    ``[B, L, V]`` log-softmax a second time.
    """
    B, L, V = logits.shape
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), input_ids[:, 1:].reshape(-1), reduction="none"
    ).view(B, L - 1)
    return F.pad(-nll, (1, 0), value=0.0)


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor, aggregation: Aggregation = "token"
) -> torch.Tensor:
    """Reduce per-token ``values`` over ``mask`` to a scalar (see the module docstring).

    Args:
        values: ``[B, L]`` per-token values.
        mask: ``[B, L]`` bool, tokens that count.
        segment_ids: ``[B, L]`` sample index of each token (``-1`` on padding).
        aggregation: ``token`` or ``sequence``.

    Returns:
        A scalar; 0 (with grad) when no token is masked in.
    """
    m = mask.to(values.dtype)
    if aggregation == "token":
        return (values * m).sum() / m.sum().clamp(min=1.0)
    if aggregation != "sequence":
        raise ValueError(f"`aggregation` must be 'token' or 'sequence', got {aggregation!r}")
    seg = segment_ids.clamp(min=0).reshape(-1)
    n_seg = int(seg.max().item()) + 1 if seg.numel() else 1
    per_seg_sum = torch.zeros(n_seg, dtype=values.dtype, device=values.device).index_add(0, seg, (values * m).reshape(-1))
    per_seg_n = torch.zeros(n_seg, dtype=values.dtype, device=values.device).index_add(0, seg, m.reshape(-1))
    has = per_seg_n > 0
    per_seq = per_seg_sum[has] / per_seg_n[has]
    return per_seq.mean() if per_seq.numel() else (values * 0).sum()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    ``k3 = exp(log r) - log r - 1`` with ``log r = log pi_ref - log pi``:
    unbiased and always >= 0 (Schulman, "Approximating KL divergence",
    http://joschu.net/blog/kl-approx.html; the GRPO KL term, DeepSeekMath
    arXiv:2402.03300 eq. 4).
    """
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1.0


def staleness_weights(
    policy_versions: torch.Tensor,
    current_version: int,
    *,
    max_staleness: int,
    mode: Literal["drop", "decay"] = "drop",
    decay: float = 0.5,
) -> torch.Tensor:
    """Weight of each token given how many versions behind its behaviour policy is.

    ``lag = current_version - policy_version``; weight is 1 when
    ``lag <= max_staleness``, else 0 (``drop``) or ``decay ** (lag - max_staleness)``
    (``decay``). Off-policy data far behind the learner has importance ratios
    the clip no longer controls well (cf. IMPALA, arXiv:1802.01561, sec. 4;
    asynchronous RLHF, arXiv:2410.18252).
    """
    lag = (current_version - policy_versions).clamp(min=0).float()
    over = (lag - max_staleness).clamp(min=0)
    if mode == "drop":
        return (over == 0).float()
    if mode == "decay":
        return torch.pow(torch.full_like(over, decay), over)
    raise ValueError(f"staleness `mode` must be 'drop' or 'decay', got {mode!r}")


def filtered_bc_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    min_advantage: float = 0.0,
    aggregation: Aggregation = "token",
) -> LossOutput:
    """Filtered behaviour cloning: maximise ``log pi(a|s)`` on steps with ``A > min_advantage`` only.

    ``L = - mean_{t: m_t, A_t > A_min} log pi(a_t | s_t)`` (filtered BC /
    "%BC", Chen et al., Decision Transformer arXiv:2106.01345 sec. 5.1; RAFT
    arXiv:2304.06767).
    """
    keep = mask & (advantages > min_advantage)
    loss = aggregate(-logp, keep, segment_ids, aggregation)
    kept_fraction = keep.sum().float() / mask.sum().clamp(min=1).float()
    return LossOutput(loss, {"loss": loss.detach(), "kept_fraction": kept_fraction.detach()})


def awr_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    beta: float = 1.0,
    max_weight: float = 20.0,
    aggregation: Aggregation = "token",
) -> LossOutput:
    """Advantage-weighted regression: ``L = - mean_t min(exp(A_t / beta), w_max) log pi(a_t|s_t)``.

    Peng et al., "Advantage-Weighted Regression", arXiv:1910.00177, eq. 7 and
    sec. 5 (weights clipped at ``w_max`` for stability).
    """
    weights = torch.exp(advantages / beta).clamp(max=max_weight)
    loss = aggregate(-weights * logp, mask, segment_ids, aggregation)
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean_weight = (weights * m).sum() / n
    weight_clip_fraction = ((torch.exp(advantages / beta) > max_weight).float() * m).sum() / n
    return LossOutput(loss, {"loss": loss.detach(), "mean_weight": mean_weight.detach(),
                             "weight_clip_fraction": weight_clip_fraction.detach()})


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_weights: torch.Tensor | None = None,
    aggregation: Aggregation = "token",
) -> LossOutput:
    """PPO clipped surrogate with recorded behaviour log-probs, optional KL to a reference.

    Per token (Schulman et al., arXiv:1707.06347 eq. 7; CleanRL ``ppo.py``)::

        ratio    = exp(logp - logp_behaviour)
        pg_loss  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))
        loss_t   = w_t * pg_loss + kl_coef * k3(pi, pi_ref)

    ``eps_high`` defaults to ``eps`` (DAPO's "clip-higher" sets it larger).
    ``w_t`` are per-token weights (e.g. :func:`staleness_weights`).

    Metrics: ``loss``, ``pg_loss``, ``clip_fraction`` (tokens with the ratio
    outside the clip range), ``approx_kl`` (k3 estimate of
    ``KL(pi_behaviour || pi)``, ``mean((ratio - 1) - log ratio)``),
    ``mean_ratio``, and ``kl_ref`` when a reference is given.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if token_weights is not None:
        pg_loss = pg_loss * token_weights
    per_token = pg_loss
    metrics: dict[str, torch.Tensor] = {}
    if ref_logp is not None and kl_coef:
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, segment_ids, aggregation)
    with torch.no_grad():
        clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + eps_high)
        metrics.update(
            loss=loss.detach(),
            pg_loss=aggregate(pg_loss.detach(), mask, segment_ids, aggregation),
            clip_fraction=_masked_mean(clipped.float(), mask),
            approx_kl=_masked_mean((ratio - 1.0) - log_ratio, mask),
            mean_ratio=_masked_mean(ratio, mask),
        )
    return LossOutput(loss, metrics)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- objectives on batches


class Objective(Protocol):
    """A loss over a :class:`trainer.data.PackedBatch` given the policy's token log-probs."""

    #: whether :meth:`__call__` wants ``ref_logp`` (the engine then runs the reference model).
    needs_reference: bool

    def __call__(self, logp: torch.Tensor, batch, *, ref_logp: torch.Tensor | None = None,
                 current_version: int = 0) -> LossOutput: ...


@dataclass
class FilteredBC:
    """Offline filtered BC on steps with positive advantage (:func:`filtered_bc_loss`)."""

    min_advantage: float = 0.0
    aggregation: Aggregation = "token"
    needs_reference: bool = False

    def __call__(self, logp, batch, *, ref_logp=None, current_version=0) -> LossOutput:
        return filtered_bc_loss(logp, batch.advantages, batch.loss_mask, batch.segment_ids,
                                min_advantage=self.min_advantage, aggregation=self.aggregation)


@dataclass
class AdvantageWeightedRegression:
    """Offline AWR (:func:`awr_loss`)."""

    beta: float = 1.0
    max_weight: float = 20.0
    aggregation: Aggregation = "token"
    needs_reference: bool = False

    def __call__(self, logp, batch, *, ref_logp=None, current_version=0) -> LossOutput:
        return awr_loss(logp, batch.advantages, batch.loss_mask, batch.segment_ids,
                        beta=self.beta, max_weight=self.max_weight, aggregation=self.aggregation)


@dataclass
class PolicyGradient:
    """PPO-clip / GRPO policy gradient on recorded behaviour log-probs, with a staleness cap.

    Tokens whose step did not record behaviour log-probs use the current
    log-prob (detached) as behaviour: ratio 1, plain on-policy gradient.
    The staleness cap (``max_staleness`` versions behind ``current_version``)
    drops those tokens from the mask (``drop``) or down-weights them (``decay``).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    max_staleness: int | None = None
    staleness_mode: Literal["drop", "decay"] = "drop"
    staleness_decay: float = 0.5
    aggregation: Aggregation = "token"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def __call__(self, logp, batch, *, ref_logp=None, current_version=0) -> LossOutput:
        behaviour_logp = torch.where(batch.has_behaviour_logprobs, batch.behaviour_logprobs, logp.detach())
        mask, weights = batch.loss_mask, None
        stale_fraction = torch.zeros((), device=logp.device)
        if self.max_staleness is not None:
            weights = staleness_weights(batch.policy_versions, current_version, max_staleness=self.max_staleness,
                                        mode=self.staleness_mode, decay=self.staleness_decay)
            stale_fraction = _masked_mean((weights < 1).float(), mask)
            if self.staleness_mode == "drop":
                mask, weights = mask & (weights > 0), None
        out = ppo_clip_loss(logp, behaviour_logp, batch.advantages, mask, batch.segment_ids,
                            clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high, ref_logp=ref_logp,
                            kl_coef=self.kl_coef, token_weights=weights, aggregation=self.aggregation)
        out.metrics["stale_fraction"] = stale_fraction.detach()
        return out


#: Objective names the command line accepts.
OBJECTIVES = ("bc", "awr", "ppo", "grpo")


def build_objective(name: str, **options) -> Objective:
    """An objective by name with its options.

    * ``bc``: :class:`FilteredBC` (options ``min_advantage``, ``aggregation``).
    * ``awr``: :class:`AdvantageWeightedRegression` (``beta``, ``max_weight``, ``aggregation``).
    * ``ppo``: :class:`PolicyGradient`, token aggregation, no KL by default.
    * ``grpo``: :class:`PolicyGradient`, sequence aggregation and ``kl_coef=0.04``
      by default (DeepSeekMath's setting); read it with ``advantage_field="group_advantage"``.

    Raises:
        ValueError: unknown name or option.
    """
    defaults = {
        "bc": (FilteredBC, {}),
        "awr": (AdvantageWeightedRegression, {}),
        "ppo": (PolicyGradient, {"aggregation": "token"}),
        "grpo": (PolicyGradient, {"aggregation": "sequence", "kl_coef": 0.04}),
    }
    if name not in defaults:
        raise ValueError(f"`objective` must be one of {OBJECTIVES}, got {name!r}")
    cls, base = defaults[name]
    known = set(cls.__dataclass_fields__) - {"needs_reference"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"objective {name!r} takes no option(s) {sorted(unknown)}; it takes {sorted(known)}")
    return cls(**{**base, **options})
