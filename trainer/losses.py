"""Training objectives on packed batches: filtered BC, AWR, PPO-clip / GRPO, KL to a reference.

Every function takes per-token tensors of shape ``[B, L]`` aligned with
``PackedBatch.input_ids`` (entry ``t`` is about token ``t``) and returns a
:class:`LossOutput`.

Which distribution the log-probs are on
---------------------------------------
The behaviour log-probs a rollout records are log-probs of the distribution it
*sampled from*: ``log_softmax`` after temperature, top-k and top-p, evaluated at
the sampled token (raw ``log_softmax`` for greedy decoding, temperature 0;
see ``rollout/policies/hf.py``). :func:`token_logprobs` computes the trainer's
log-probs on that same processed distribution, token by token with each
token's own sampling parameters, exactly as ``transformers``'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
(``min_tokens_to_keep=1``) and vLLM's sampler (``apply_top_k_top_p``) do. The
same processed distribution is used **everywhere**: the policy's log-probs of
every objective (PPO ratio, BC and AWR likelihoods) and the reference model's
log-probs of the KL term. Why one distribution:

* the PPO ratio ``exp(logp - logp_behaviour)`` is a ratio of two probabilities
  of the same event only if both sides are on the sampling distribution; on
  the raw distribution a rollout at temperature 0.7 would read as far
  off-policy at step 0;
* the KL estimate ``k3(pi, pi_ref)`` must be 0 when ``pi == pi_ref``, so the
  reference must be warped the same way as the policy;
* BC and AWR then imitate the action under the distribution it came from, and
  ``logp`` means one thing in every metric (``mean_ratio`` is 1 on-policy
  whatever the objective).

A token the warpers exclude (the policy's or the reference's top-k/top-p
removes the recorded token) has log-prob ``-inf``. Its gradient through the
truncated distribution is 0 whatever the loss, so the objectives give such
tokens a loss of 0 (they still count in the normalizers below) and report
their share as ``outside_support_fraction``.

Aggregation (how per-token losses become one number), ``aggregation=``
------------------------------------------------------------------------
Aggregation is global over an optimizer step: all gradient-accumulation
micro-batches and all ranks. A *response* is an episode's trained action
tokens (all its windows; never a step or a packed segment). With ``T`` the
loss tokens of the step, ``G`` its responses and ``|o_i|`` the loss tokens of
response ``i``:

* ``"token"``: DAPO's token-level mean (Yu et al., arXiv:2503.14476, sec. 3.3),
  ``L = 1/T sum_i sum_t l_{i,t}``: every token weighs the same, so long
  responses weigh more.
* ``"sequence"``: GRPO's per-response mean, then mean over responses
  (DeepSeekMath, Shao et al., arXiv:2402.03300, eq. 3),
  ``L = 1/G sum_i 1/|o_i| sum_t l_{i,t}``: every response weighs the same.
* ``"dr_grpo"``: Dr. GRPO (Liu et al., arXiv:2503.20783, sec. 3.2; verl's
  ``seq-mean-token-sum-norm``), ``L = 1/G sum_i 1/C sum_t l_{i,t}`` with a
  constant ``C`` (default: the packed sequence length): no length bias.

All three are ``L = sum_t c_t l_t`` with per-token coefficients ``c_t``
(:func:`step_loss_weights`). DeepSpeed divides each micro-batch's loss by the
accumulation steps ``A`` and averages gradients over the ``W`` ranks, so the
recipe passes ``A * W * c_t`` as the weights and the averaged gradient is the
gradient of the global ``L``. An objective called without weights treats its
batch as the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

__all__ = [
    "LossOutput",
    "Aggregation",
    "AGGREGATIONS",
    "StepTotals",
    "token_logprobs",
    "step_response_index",
    "step_loss_weights",
    "aggregate",
    "kl_k3",
    "policy_lag",
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

Aggregation = Literal["token", "sequence", "dr_grpo"]
#: Aggregation modes (see the module docstring).
AGGREGATIONS: tuple[str, ...] = ("token", "sequence", "dr_grpo")

# Rows of the top-k/top-p keep-mask computed at once: bounds the sort's temporaries to ~200 MB per
# 2**24 elements (values + int64 indices + cumulative sums) whatever the batch size.
_FILTER_CHUNK_ELEMENTS = 1 << 24


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


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log pi(x_t | x_<t)`` of every token under its sampling distribution: ``[B, L]`` float32.

    The logits predicting token ``t`` (row ``t - 1``) are processed as the
    sampler processed them, in its order (``transformers`` ``generate`` and
    vLLM alike): divide by the temperature; keep the ``top_k`` largest
    (ties with the k-th kept); sort ascending, take the cumulative softmax and
    drop the tokens whose cumulative probability is ``<= 1 - top_p``, always
    keeping the largest; then ``log_softmax``. A token with temperature 0
    (greedy) gets the raw ``log_softmax``; ``top_k`` of 0, -1 or ``>= V``
    and ``top_p`` of 1 are off. A token the filters exclude gets ``-inf``.

    Memory: only the requested rows are gathered, into one float32 ``[N, V]``
    copy (``N`` = tokens in ``mask``); temperature and the filters modify it
    in place and the log-prob is ``x_target - logsumexp(x)``, so no second
    ``[N, V]`` tensor is kept for backward. The top-k/top-p keep-mask is
    computed without grad, in chunks, only on rows that filter; with no such
    row nothing is sorted. Writing ``-inf`` into the excluded entries outside
    autograd is exact: ``logsumexp``'s backward gives them weight
    ``softmax = 0``, which is also the gradient of the masked function.

    Args:
        logits: ``[B, L, V]`` model output (any float dtype).
        input_ids: ``[B, L]`` tokens.
        temperature: ``[B, L]`` temperature of each token's distribution
            (None: 1 everywhere).
        top_k: ``[B, L]`` top-k of each token (None: off).
        top_p: ``[B, L]`` top-p of each token (None: off). Float64 keeps the
            threshold ``1 - top_p`` rounded as ``transformers`` rounds it.
        mask: ``[B, L]`` tokens whose log-prob is needed (None: all); the
            others, and column 0 (nothing predicts it), are 0.

    Returns:
        ``[B, L]`` float32 log-probs, differentiable with respect to ``logits``.
    """
    B, L, V = logits.shape
    want = torch.ones(B, max(L - 1, 0), dtype=torch.bool, device=logits.device) if mask is None else mask[:, 1:]
    b, t = want.nonzero(as_tuple=True)
    if b.numel() == 0:
        # still part of the graph: a rank whose tokens are all masked out takes part in backward with zero grads
        return logits[:, :, 0].float() * 0.0
    rows = b * L + t  # logits row that predicts token (b, t + 1)
    x = logits.reshape(B * L, V).index_select(0, rows).float()  # [N, V], a fresh tensor: in-place is safe
    target = input_ids[:, 1:][want]
    greedy = torch.zeros_like(target, dtype=torch.bool)
    if temperature is not None:
        temp = temperature[:, 1:][want].to(torch.float32)
        greedy = temp <= 0
        scale = torch.where(greedy, torch.ones_like(temp), temp)
        if bool((scale != 1).any()):
            x.div_(scale.unsqueeze(1))
    if top_k is not None or top_p is not None:
        k = top_k[:, 1:][want].long() if top_k is not None else torch.zeros_like(target)
        p = top_p[:, 1:][want].double() if top_p is not None else torch.ones_like(target, dtype=torch.float64)
        k_on = (k > 0) & (k < V) & ~greedy
        p_on = (p < 1) & ~greedy
        filtered = (k_on | p_on).nonzero().squeeze(1)
        if filtered.numel():
            with torch.no_grad():
                for chunk in filtered.split(max(1, _FILTER_CHUNK_ELEMENTS // V)):
                    remove = _top_k_top_p_remove(x[chunk], k[chunk], p[chunk], k_on[chunk], p_on[chunk])
                    x[chunk] = x[chunk].masked_fill(remove, float("-inf"))
    logp = x.gather(1, target.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=-1)
    return torch.zeros(B * L, dtype=torch.float32, device=logits.device).index_copy(0, rows + 1, logp).view(B, L)


def _top_k_top_p_remove(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, k_on: torch.Tensor,
                        p_on: torch.Tensor) -> torch.Tensor:
    """Entries of ``x`` ``[n, V]`` that top-k then top-p remove (vLLM ``apply_top_k_top_p_pytorch``)."""
    V = x.shape[-1]
    x_sorted, order = x.sort(dim=-1, descending=False)
    drop = torch.zeros_like(x_sorted, dtype=torch.bool)
    if bool(k_on.any()):
        kth = x_sorted.gather(1, (V - k.clamp(1, V)).unsqueeze(1))  # the k-th largest value
        drop |= (x_sorted < kth) & k_on.unsqueeze(1)
        x_sorted = x_sorted.masked_fill(drop, float("-inf"))
    if bool(p_on.any()):
        cum = x_sorted.softmax(dim=-1).cumsum(dim=-1)
        threshold = (1.0 - p).to(torch.float32).unsqueeze(1)  # float32(1 - top_p) as transformers compares
        drop_p = (cum <= threshold) & p_on.unsqueeze(1)
        drop_p[:, -1] = False  # min_tokens_to_keep = 1
        drop |= drop_p
    return torch.zeros_like(drop).scatter(1, order, drop)


# ----------------------------------------------------------------------------- aggregation


@dataclass(frozen=True)
class StepTotals:
    """Global counts of one optimizer step (all micro-batches, all ranks).

    Attributes:
        tokens: loss tokens ``T``.
        responses: responses ``G`` with at least one loss token.
    """

    tokens: int
    responses: int


def step_response_index(episode_index: Sequence[torch.Tensor], episode_ids: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """One response id per token across a step's micro-batches: windows of one episode share it.

    Each micro-batch numbers its episodes locally (``PackedBatch.episode_index``
    into ``PackedBatch.episode_ids``); an episode can continue in the next
    micro-batch, so responses are identified by episode id across the step.
    (Responses never span ranks: an episode lives in one row group, read by
    one shard.)

    Args:
        episode_index: per micro-batch, ``[B, L]`` index into its ``episode_ids`` (-1: padding).
        episode_ids: per micro-batch, its episode ids.

    Returns:
        Per micro-batch, ``[B, L]`` int64 response ids ``0..R-1`` shared across the step (-1: padding).

    Examples:
        >>> a = step_response_index([torch.tensor([[0, 1, -1]]), torch.tensor([[0, 1]])], [["e1", "e2"], ["e2", "e3"]])
        >>> [x.tolist() for x in a]
        [[[0, 1, -1]], [[1, 2]]]
    """
    ids: dict[str, int] = {}
    out = []
    for index, names in zip(episode_index, episode_ids):
        remap = torch.tensor([ids.setdefault(n, len(ids)) for n in names] + [-1], dtype=torch.long,
                             device=index.device)
        out.append(remap[index])  # index -1 picks the trailing -1
    return out


def step_loss_weights(
    masks: Sequence[torch.Tensor],
    response_index: Sequence[torch.Tensor],
    *,
    aggregation: Aggregation,
    norm_tokens: float | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scale: float = 1.0,
) -> tuple[list[torch.Tensor], StepTotals]:
    """Per-token coefficients ``c_t`` of the step's loss ``L = sum_t c_t l_t`` (module docstring).

    Args:
        masks: per micro-batch, ``[B, L]`` bool loss tokens (after staleness and filters).
        response_index: per micro-batch, ``[B, L]`` response id of each token
            (:func:`step_response_index`; -1: padding).
        aggregation: ``token``, ``sequence`` or ``dr_grpo``.
        norm_tokens: ``dr_grpo``'s constant ``C`` (required there).
        all_reduce: sums a tensor over ranks in place and returns it (None: one rank).
        scale: multiplies every coefficient: ``grad_accum * world_size`` undoes
            DeepSpeed's averaging over micro-batches and ranks.

    Returns:
        The per micro-batch ``[B, L]`` float32 weights (0 off the masks) and the
        step's global :class:`StepTotals`.

    Raises:
        ValueError: unknown ``aggregation``, or ``dr_grpo`` without a positive ``norm_tokens``.

    Examples:
        >>> w, totals = step_loss_weights([torch.tensor([[True, True, True]])], [torch.tensor([[0, 0, 1]])],
        ...                               aggregation="sequence")
        >>> w[0].tolist(), totals
        ([[0.25, 0.25, 0.5]], StepTotals(tokens=3, responses=2))
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "dr_grpo" and not (norm_tokens and norm_tokens > 0):
        raise ValueError(f"`aggregation` dr_grpo needs a positive `norm_tokens` (the constant C), got {norm_tokens!r}")
    device = masks[0].device if masks else torch.device("cpu")
    n_resp = max((int(r.max()) + 1 for r in response_index if r.numel()), default=0)
    per_response = torch.zeros(n_resp + 1, dtype=torch.float64, device=device)  # slot n_resp: padding
    for m, r in zip(masks, response_index):
        per_response.index_add_(0, torch.where(r >= 0, r, n_resp).reshape(-1), m.reshape(-1).to(torch.float64))
    per_response[n_resp] = 0
    local = torch.stack([per_response.sum(), (per_response > 0).sum().to(torch.float64)])
    totals_t = all_reduce(local) if all_reduce is not None else local
    totals = StepTotals(tokens=int(round(float(totals_t[0]))), responses=int(round(float(totals_t[1]))))
    weights = []
    for m, r in zip(masks, response_index):
        mf = m.to(torch.float64)
        if totals.tokens == 0:
            c = torch.zeros_like(mf)
        elif aggregation == "token":
            c = mf / totals.tokens
        elif aggregation == "sequence":
            n_i = per_response[torch.where(r >= 0, r, n_resp)]
            c = torch.where(m, 1.0 / (n_i.clamp(min=1.0) * totals.responses), torch.zeros_like(mf))
        else:
            c = mf / (float(norm_tokens) * totals.responses)
        weights.append((c * scale).to(torch.float32))
    return weights, totals


def aggregate(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_t c_t l_t``: per-token ``values`` reduced with the coefficients of :func:`step_loss_weights`."""
    return (values * weights).sum()


def _own_weights(batch, mask: torch.Tensor, aggregation: Aggregation, norm_tokens: float | None) -> torch.Tensor:
    """Weights of a batch taken as the whole optimizer step (one micro-batch, one rank)."""
    (w,), _ = step_loss_weights([mask], [batch.episode_index], aggregation=aggregation,
                                norm_tokens=norm_tokens if norm_tokens is not None else mask.shape[-1])
    return w


# ----------------------------------------------------------------------------- per-token terms


def weigh_negatives(advantages: torch.Tensor, negative_weight: float) -> torch.Tensor:
    """Advantages with the negative ones scaled: ``A' = A`` if ``A >= 0`` else ``lambda_neg * A``.

    The weighted policy gradient of Zhu et al., "The Surprising Effectiveness of
    Negative Reinforcement in LLM Reasoning" (arXiv:2506.01347, sec. 4,
    W-REINFORCE): the objective splits into positive-sample reinforcement
    (PSR, ``A > 0``) and negative-sample reinforcement (NSR, ``A < 0``), and
    ``L = lambda_pos * L_PSR + lambda_neg * L_NSR``. They find PSR raises
    pass@1 (it sharpens the policy towards its successes) while NSR keeps the
    policy's entropy (it spreads the mass of a penalised token over the
    others). Here ``lambda_pos = 1`` and ``negative_weight = lambda_neg``:
    1 is the plain objective, 0 trains on successes only (RAFT-like
    rejection-sampling fine-tuning with GRPO's group baseline deciding what
    counts as a success; Xiong et al. arXiv:2504.11343).

    >>> weigh_negatives(torch.tensor([1.5, -2.0, 0.0]), 0.25).tolist()
    [1.5, -0.5, 0.0]
    """
    if negative_weight == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * negative_weight, advantages)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    ``k3 = exp(log r) - log r - 1`` with ``log r = log pi_ref - log pi``:
    unbiased and always >= 0 (Schulman, "Approximating KL divergence",
    http://joschu.net/blog/kl-approx.html; the GRPO KL term, DeepSeekMath
    arXiv:2402.03300 eq. 4).
    """
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1.0


def policy_lag(policy_versions: torch.Tensor, same_lineage: torch.Tensor, current_version: int) -> torch.Tensor:
    """How many versions behind the learner each token's behaviour policy is; ``inf``: not comparable.

    * version 0 is the base model, the root of every lineage: lag ``current_version``;
    * same lineage as the learner: lag ``current_version - policy_version``,
      ``inf`` when negative (a version the learner has not reached: another run's);
    * another lineage: ``inf``. Versions of two lineages share numbers, not
      weights, so a lag between them means nothing.

    Args:
        policy_versions: ``[B, L]`` behaviour version per token.
        same_lineage: ``[B, L]`` bool, the token's lineage is the learner's.
        current_version: the learner's version.

    Examples:
        >>> policy_lag(torch.tensor([0, 3, 5, 7, 3]), torch.tensor([False, True, True, True, False]), 5).tolist()
        [5.0, 2.0, 0.0, inf, inf]
    """
    lag = (current_version - policy_versions).to(torch.float32)
    inf = torch.full_like(lag, float("inf"))
    lag = torch.where(same_lineage & (lag >= 0), lag, inf)
    return torch.where(policy_versions == 0, torch.full_like(lag, float(current_version)), lag)


def staleness_weights(
    lag: torch.Tensor,
    *,
    max_staleness: int,
    mode: Literal["drop", "decay"] = "drop",
    decay: float = 0.5,
) -> torch.Tensor:
    """Weight of each token given its :func:`policy_lag`.

    Weight 1 when ``lag <= max_staleness``, else 0 (``drop``) or
    ``decay ** (lag - max_staleness)`` (``decay``); always 0 for ``lag = inf``.
    Off-policy data far behind the learner has importance ratios the clip no
    longer controls well (cf. IMPALA, arXiv:1802.01561, sec. 4; asynchronous
    RLHF, arXiv:2410.18252).
    """
    over = (lag - max_staleness).clamp(min=0)
    if mode == "drop":
        w = (over == 0).float()
    elif mode == "decay":
        w = torch.pow(torch.full_like(over, decay), over)
    else:
        raise ValueError(f"staleness `mode` must be 'drop' or 'decay', got {mode!r}")
    return torch.where(torch.isinf(lag), torch.zeros_like(w), w)


def _supported(logp: torch.Tensor, mask: torch.Tensor, *others: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of ``mask`` whose log-probs are finite, and ``logp`` with ``-inf`` replaced by 0 (no NaN in backward)."""
    ok = torch.isfinite(logp)
    for o in others:
        if o is not None:
            ok = ok & torch.isfinite(o)
    return mask & ok, torch.where(ok, logp, torch.zeros_like(logp))


# ----------------------------------------------------------------------------- losses


def filtered_bc_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    min_advantage: float = 0.0,
) -> LossOutput:
    """Filtered behaviour cloning: maximise ``log pi(a|s)`` on steps with ``A > min_advantage`` only.

    ``L = - sum_t c_t [A_t > A_min] log pi(a_t | s_t)`` (filtered BC /
    "%BC", Chen et al., Decision Transformer arXiv:2106.01345 sec. 5.1; RAFT
    arXiv:2304.06767), ``c_t`` the aggregation weights (:func:`step_loss_weights`,
    computed over the kept tokens).
    """
    keep = mask & (advantages > min_advantage)
    ok, logp = _supported(logp, keep)
    loss = aggregate(torch.where(ok, -logp, torch.zeros_like(logp)), weights * keep)
    kept_fraction = keep.sum().float() / mask.sum().clamp(min=1).float()
    return LossOutput(loss, {"loss": loss.detach(), "kept_fraction": kept_fraction.detach(),
                             "outside_support_fraction": _masked_mean((keep & ~ok).float(), keep).detach()})


def awr_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    beta: float = 1.0,
    max_weight: float = 20.0,
) -> LossOutput:
    """Advantage-weighted regression: ``L = - sum_t c_t min(exp(A_t / beta), w_max) log pi(a_t|s_t)``.

    Peng et al., "Advantage-Weighted Regression", arXiv:1910.00177, eq. 7 and
    sec. 5 (weights clipped at ``w_max`` for stability); ``c_t`` the
    aggregation weights.
    """
    ok, logp = _supported(logp, mask)
    adv_weight = torch.exp(advantages / beta).clamp(max=max_weight)
    loss = aggregate(torch.where(ok, -adv_weight * logp, torch.zeros_like(logp)), weights * mask)
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean_weight = (adv_weight * m).sum() / n
    weight_clip_fraction = ((torch.exp(advantages / beta) > max_weight).float() * m).sum() / n
    return LossOutput(loss, {"loss": loss.detach(), "mean_weight": mean_weight.detach(),
                             "weight_clip_fraction": weight_clip_fraction.detach(),
                             "outside_support_fraction": _masked_mean((mask & ~ok).float(), mask).detach()})


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """PPO clipped surrogate with recorded behaviour log-probs, optional KL to a reference.

    Per token (Schulman et al., arXiv:1707.06347 eq. 7; CleanRL ``ppo.py``)::

        ratio    = exp(logp - logp_behaviour)
        pg_loss  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))
        loss_t   = w_t * pg_loss + kl_coef * k3(pi, pi_ref)
        loss     = sum_t c_t loss_t

    ``eps_high`` defaults to ``eps`` (DAPO's "clip-higher" sets it larger).
    ``w_t`` are per-token weights (e.g. :func:`staleness_weights`), ``c_t`` the
    aggregation weights (:func:`step_loss_weights`).

    Metrics: ``loss``, ``pg_loss``, ``clip_fraction`` (tokens with the ratio
    outside the clip range), ``approx_kl`` (k3 estimate of
    ``KL(pi_behaviour || pi)``, ``mean((ratio - 1) - log ratio)``),
    ``mean_ratio``, ``outside_support_fraction``, and ``kl_ref`` when a
    reference is given.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    use_ref = ref_logp is not None and kl_coef != 0
    ok, logp = _supported(logp, mask, ref_logp if use_ref else None)
    log_ratio = logp - behaviour_logp
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if token_weights is not None:
        pg_loss = pg_loss * token_weights
    per_token = pg_loss
    metrics: dict[str, torch.Tensor] = {}
    if use_ref:
        ref_logp = torch.where(ok, ref_logp, torch.zeros_like(ref_logp))
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), ok)
    zero = torch.zeros_like(per_token)
    loss = aggregate(torch.where(ok, per_token, zero), weights * mask)
    with torch.no_grad():
        clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + eps_high)
        metrics.update(
            loss=loss.detach(),
            pg_loss=aggregate(torch.where(ok, pg_loss, zero).detach(), weights * mask),
            clip_fraction=_masked_mean(clipped.float(), ok),
            approx_kl=_masked_mean((ratio - 1.0) - log_ratio, ok),
            mean_ratio=_masked_mean(ratio, ok),
            outside_support_fraction=_masked_mean((mask & ~ok).float(), mask),
        )
    return LossOutput(loss, metrics)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (torch.where(mask, x, torch.zeros_like(x))).sum() / m.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- objectives on batches


class Objective(Protocol):
    """A loss over a :class:`trainer.data.PackedBatch` given the policy's token log-probs.

    ``logp`` (and ``ref_logp``) are on the behaviour's sampling distribution
    (module docstring).
    """

    #: whether :meth:`__call__` wants ``ref_logp`` (the engine then runs the reference model).
    needs_reference: bool
    #: how per-token losses are reduced (module docstring).
    aggregation: Aggregation

    def select(self, batch, mask: torch.Tensor) -> torch.Tensor:
        """The tokens the loss runs over, among ``mask``: what the aggregation counts."""
        ...

    def __call__(self, logp: torch.Tensor, batch, *, mask: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, token_weights: torch.Tensor | None = None,
                 ref_logp: torch.Tensor | None = None) -> LossOutput:
        """The loss.

        Args:
            logp: ``[B, L]`` policy log-probs (:func:`token_logprobs`).
            batch: the packed batch.
            mask: loss tokens, already through :meth:`select` (default:
                ``select(batch, batch.loss_mask)``).
            weights: aggregation weights ``c_t`` (default: this batch is the whole step).
            token_weights: per-token loss weights (staleness decay), or None.
            ref_logp: reference log-probs when :attr:`needs_reference`.
        """
        ...


@dataclass
class _BatchObjective:
    aggregation: Aggregation = "token"
    norm_tokens: float | None = None

    def select(self, batch, mask: torch.Tensor) -> torch.Tensor:
        return mask

    def _prepare(self, batch, mask, weights):
        mask = self.select(batch, batch.loss_mask) if mask is None else mask
        weights = _own_weights(batch, mask, self.aggregation, self.norm_tokens) if weights is None else weights
        return mask, weights


@dataclass
class FilteredBC(_BatchObjective):
    """Offline filtered BC on steps with positive advantage (:func:`filtered_bc_loss`)."""

    min_advantage: float = 0.0
    needs_reference: bool = False

    def select(self, batch, mask: torch.Tensor) -> torch.Tensor:
        return mask & (batch.advantages > self.min_advantage)

    def __call__(self, logp, batch, *, mask=None, weights=None, token_weights=None, ref_logp=None) -> LossOutput:
        mask, weights = self._prepare(batch, mask, weights)
        if token_weights is not None:
            weights = weights * token_weights
        out = filtered_bc_loss(logp, batch.advantages, mask, weights, min_advantage=self.min_advantage)
        out.metrics["kept_fraction"] = (mask.sum().float() / batch.loss_mask.sum().clamp(min=1).float()).detach()
        return out


@dataclass
class AdvantageWeightedRegression(_BatchObjective):
    """Offline AWR (:func:`awr_loss`)."""

    beta: float = 1.0
    max_weight: float = 20.0
    needs_reference: bool = False

    def __call__(self, logp, batch, *, mask=None, weights=None, token_weights=None, ref_logp=None) -> LossOutput:
        mask, weights = self._prepare(batch, mask, weights)
        if token_weights is not None:
            weights = weights * token_weights
        return awr_loss(logp, batch.advantages, mask, weights, beta=self.beta, max_weight=self.max_weight)


@dataclass
class PolicyGradient(_BatchObjective):
    """PPO-clip / GRPO policy gradient on recorded behaviour log-probs.

    Tokens whose step did not record behaviour log-probs use the current
    log-prob (detached) as behaviour: ratio 1, plain on-policy gradient.
    (The staleness cap is applied by the recipe, to every objective, through
    ``mask`` and ``token_weights``.)
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    negative_weight: float = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def __call__(self, logp, batch, *, mask=None, weights=None, token_weights=None, ref_logp=None) -> LossOutput:
        mask, weights = self._prepare(batch, mask, weights)
        behaviour_logp = torch.where(batch.has_behaviour_logprobs, batch.behaviour_logprobs, logp.detach())
        return ppo_clip_loss(logp, behaviour_logp, weigh_negatives(batch.advantages, self.negative_weight), mask, weights,
                             clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high, ref_logp=ref_logp,
                             kl_coef=self.kl_coef, token_weights=token_weights)


#: Objective names the command line accepts.
OBJECTIVES = ("bc", "awr", "ppo", "grpo")


def build_objective(name: str, **options) -> Objective:
    """An objective by name with its options.

    * ``bc``: :class:`FilteredBC` (options ``min_advantage``, ``aggregation``, ``norm_tokens``).
    * ``awr``: :class:`AdvantageWeightedRegression` (``beta``, ``max_weight``, ``aggregation``, ``norm_tokens``).
    * ``ppo``: :class:`PolicyGradient`, token aggregation, no KL by default.
    * ``grpo``: :class:`PolicyGradient`, sequence aggregation and ``kl_coef=0.04``
      by default (DeepSeekMath's setting); read it with ``advantage_field="group_advantage"``.

    ``norm_tokens`` is ``dr_grpo``'s constant ``C`` (default: the batch's sequence length).

    Raises:
        ValueError: unknown name, option or aggregation.
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
    merged = {**base, **options}
    if merged.get("aggregation", "token") not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {merged['aggregation']!r}")
    return cls(**merged)
