"""Objectives, log-probs on the sampling distribution and step aggregation against hand-computed values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import trainer.losses as losses
from trainer.losses import (
    aggregate, awr_loss, build_objective, filtered_bc_loss, kl_k3, policy_lag, ppo_clip_loss, staleness_weights,
    step_loss_weights, step_response_index, token_logprobs,
)

ALL = torch.ones(1, 3, dtype=torch.bool)
MEAN3 = torch.full((1, 3), 1 / 3)  # token aggregation over 3 loss tokens


def test_ppo_clip_ratios_clipping_and_metrics():
    # behaviour logp 0, current logp = ln r  ->  ratio r = [1.5, 0.5, 1.1]; A = [1, 1, -1]; eps = 0.2
    # t0: -A r = -1.5, -A clip(r) = -1.2           -> max = -1.2 (clipped, no gradient)
    # t1: -A r = -0.5, -A clip(r) = -A*0.8 = -0.8  -> max = -0.5 (unclipped; ratio still outside [0.8, 1.2])
    # t2: -A r = +1.1, -A clip(r) = +1.1           -> max = 1.1
    # token mean = (-1.2 - 0.5 + 1.1) / 3 = -0.2
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    out = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), ALL, MEAN3, clip_eps=0.2)
    assert out.loss.item() == pytest.approx(-0.2)
    # clip fraction: ratios 1.5 and 0.5 lie outside [0.8, 1.2] -> 2/3
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    assert out.metrics["mean_ratio"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # approx_kl = mean((r - 1) - ln r) = mean(0.5 - 0.405465, -0.5 + 0.693147, 0.1 - 0.095310)
    expected_kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + (0.1 - math.log(1.1))) / 3
    assert out.metrics["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    # d loss / d logp_t = d(-A r)/d logp / 3 = -A r / 3 where unclipped, 0 where the clip is active
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 3, 1.1 / 3], rel=1e-5)


def test_ppo_asymmetric_clip_high():
    # ratio 1.25, A = 1, eps = 0.2, eps_high = 0.28: 1.25 < 1.28 -> not clipped, loss = -1.25
    logp = torch.log(torch.tensor([[1.25]]))
    out = ppo_clip_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                        torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.metrics["clip_fraction"].item() == 0.0


def test_tokens_outside_the_support_get_no_loss_and_are_counted():
    # t1's recorded token lies outside the policy's nucleus: logp = -inf -> loss 0, gradient 0, counted
    # A = 1, behaviour 0: t0 ratio 1 -> -1; t2 ratio 1 -> -1; weights 1/3 each -> loss = -2/3
    logp = torch.tensor([[0.0, float("-inf"), 0.0]], requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(1, 3), torch.ones(1, 3), ALL, MEAN3, ref_logp=torch.zeros(1, 3), kl_coef=0.1)
    assert out.loss.item() == pytest.approx(-2 / 3)
    assert out.metrics["outside_support_fraction"].item() == pytest.approx(1 / 3)
    out.loss.backward()
    assert not torch.isnan(logp.grad).any() and logp.grad[0, 1].item() == 0.0
    # BC: -logp = inf would poison the loss; the token gives 0 instead: (0 + 0 + 0) with t0, t2 at logp 0
    bc = filtered_bc_loss(logp.detach(), torch.ones(1, 3), ALL, MEAN3)
    assert bc.loss.item() == 0.0 and bc.metrics["outside_support_fraction"].item() == pytest.approx(1 / 3)


def test_awr_weights_clipped():
    # beta 2, A = [0, 2 ln 2, 2 ln 100] -> exp(A / beta) = [1, 2, 100] -> clipped at 20 -> [1, 2, 20]
    # logp = -1 everywhere: loss = mean(w * 1) = 23 / 3; one of three weights clipped
    adv = torch.tensor([[0.0, 2 * math.log(2), 2 * math.log(100)]])
    out = awr_loss(torch.full((1, 3), -1.0), adv, ALL, MEAN3, beta=2.0, max_weight=20.0)
    assert out.loss.item() == pytest.approx(23 / 3, rel=1e-5)
    assert out.metrics["mean_weight"].item() == pytest.approx(23 / 3, rel=1e-5)
    assert out.metrics["weight_clip_fraction"].item() == pytest.approx(1 / 3)


def test_filtered_bc_keeps_only_positive_advantage():
    # A = [1, -1, 0.5, 0]: keep t0, t2 (A > 0); token weights over the kept tokens 1/2 each
    # loss = -(logp0 + logp2) / 2 = (1 + 3) / 2 = 2
    batch = SimpleNamespace(advantages=torch.tensor([[1.0, -1.0, 0.5, 0.0]]), loss_mask=torch.ones(1, 4, dtype=torch.bool),
                            episode_index=torch.tensor([[0, 0, 0, 0]]))
    out = build_objective("bc")(torch.tensor([[-1.0, -2.0, -3.0, -4.0]]), batch)
    assert out.loss.item() == pytest.approx(2.0)
    assert out.metrics["kept_fraction"].item() == pytest.approx(0.5)


def test_policy_lag_and_staleness_cap():
    # current 5, same lineage except the last two tokens:
    #   v5 -> 0, v4 -> 1, v1 -> 4, v0 (base) -> 5, v6 (ahead of the learner) -> inf, other lineage v5 -> inf,
    #   other lineage v0 (the base is the root of every lineage) -> 5
    versions = torch.tensor([[5, 4, 1, 0, 6, 5, 0]])
    same = torch.tensor([[True, True, True, True, True, False, False]])
    lag = policy_lag(versions, same, 5)
    assert lag.tolist() == [[0, 1, 4, 5, math.inf, math.inf, 5]]
    # K = 2: over the cap by [0, 0, 2, 3, inf, inf, 3]
    assert staleness_weights(lag, max_staleness=2, mode="drop").tolist() == [[1, 1, 0, 0, 0, 0, 0]]
    # decay 0.5 ** over = [1, 1, 0.25, 0.125, 0 (inf), 0 (inf), 0.125]; decay 1 still drops infinite lags
    assert staleness_weights(lag, max_staleness=2, mode="decay", decay=0.5).tolist() == \
        [[1, 1, 0.25, 0.125, 0, 0, 0.125]]
    assert staleness_weights(lag, max_staleness=2, mode="decay", decay=1.0).tolist() == [[1, 1, 1, 1, 0, 0, 1]]


def test_kl_k3():
    # pi = 0.5, pi_ref = 0.25: log r = ln(0.25/0.5) = -ln 2; k3 = 0.5 + ln 2 - 1 = 0.193147
    k3 = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert k3.item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


# ----------------------------------------------------------------------------- token log-probs


def test_token_logprobs_alignment():
    # uniform logits over V = 4: every predicted token has log-prob -ln 4; column 0 has no context -> 0
    logits = torch.zeros(1, 3, 4)
    lp = token_logprobs(logits, torch.tensor([[1, 2, 3]]))
    assert lp.tolist()[0] == pytest.approx([0.0, -math.log(4), -math.log(4)])
    # a peaked prediction at position 0 for token 2 shows up at column 1
    logits[0, 0, 2] = 10.0
    assert token_logprobs(logits, torch.tensor([[1, 2, 3]]))[0, 1].item() > -0.01


PROBS = [0.5, 0.25, 0.15, 0.10]


def _one(token: int, **sampling) -> float:
    """log-prob of ``token`` after a context whose next-token distribution is PROBS."""
    logits = torch.log(torch.tensor(PROBS)).view(1, 1, 4).expand(1, 2, 4).contiguous()
    params = {k: torch.tensor([[v, v]], dtype=torch.float64 if k == "top_p" else torch.float32 if k == "temperature"
                              else torch.long) for k, v in sampling.items()}
    return token_logprobs(logits, torch.tensor([[0, token]]), **params)[0, 1].item()


def test_token_logprobs_hand_computed_sampling():
    # temperature 0.5: p^2 renormalised = [0.25, 0.0625, 0.0225, 0.01] / 0.345 -> p(0) = 0.724638
    assert _one(0, temperature=0.5) == pytest.approx(math.log(0.25 / 0.345), rel=1e-5)
    # top_k 3 keeps {0.5, 0.25, 0.15} (sum 0.9): p(2) = 0.15 / 0.9 = 1/6; token 3 is out -> -inf
    assert _one(2, top_k=3) == pytest.approx(math.log(1 / 6), rel=1e-5)
    assert _one(3, top_k=3) == -math.inf
    # top_p 0.7: ascending [0.10, 0.15, 0.25, 0.5], cumulative [0.10, 0.25, 0.50, 1.0]; drop cum <= 0.3
    # -> keep {0.25, 0.5}: p(0) = 2/3, p(1) = 1/3, p(2) = 0
    assert _one(0, top_p=0.7) == pytest.approx(math.log(2 / 3), rel=1e-5)
    assert _one(1, top_p=0.7) == pytest.approx(math.log(1 / 3), rel=1e-5)
    assert _one(2, top_p=0.7) == -math.inf
    # top_p 0.05 keeps the largest token only (min_tokens_to_keep = 1): p(0) = 1
    assert _one(0, top_p=0.05) == pytest.approx(0.0, abs=1e-6)
    # top_k 3 then top_p 0.7: renormalised [5/9, 2.5/9, 1.5/9]; ascending cumulative [1/6, 4.5/9 = 0.5, 1]
    # -> drop the 1.5/9 token (cum 0.1667 <= 0.3): p(1) = 0.25 / 0.75 = 1/3
    assert _one(1, top_k=3, top_p=0.7) == pytest.approx(math.log(1 / 3), rel=1e-5)
    # greedy (temperature 0): the raw distribution whatever top_p / top_k say: p(2) = 0.15
    assert _one(2, temperature=0.0, top_p=0.7, top_k=1) == pytest.approx(math.log(0.15), rel=1e-5)
    # top_k -1, 0 and >= V are off
    assert _one(3, top_k=-1) == _one(3, top_k=4) == _one(3, top_k=0) == pytest.approx(math.log(0.10), rel=1e-5)


def test_token_logprobs_gradient_equals_the_masked_function():
    # the in-place -inf fill outside autograd must give the gradient of log_softmax(masked_fill(x / T))
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    temperature = torch.full((2, 5), 0.7)
    top_k = torch.tensor([[5] * 5, [0] * 5])
    top_p = torch.tensor([[1.0] * 5, [0.6] * 5], dtype=torch.float64)
    lp = token_logprobs(logits, ids, temperature=temperature, top_k=top_k, top_p=top_p)
    ok = torch.isfinite(lp)
    torch.where(ok, lp, torch.zeros_like(lp)).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    x = logits[:, :-1] / 0.7
    remove = torch.zeros_like(x, dtype=torch.bool)
    remove[0] = x[0] < x[0].topk(5, dim=-1).values[..., -1:]
    srt, order = x[1].sort(dim=-1)
    drop = srt.softmax(-1).cumsum(-1) <= 1 - 0.6
    drop[:, -1] = False
    remove[1] = torch.zeros_like(drop).scatter(1, order, drop)
    ref = torch.log_softmax(x.masked_fill(remove, float("-inf")), -1).gather(2, ids[:, 1:, None]).squeeze(2)
    assert torch.equal(torch.isfinite(ref), ok[:, 1:])
    torch.where(ok[:, 1:], ref, torch.zeros_like(ref)).sum().backward()
    assert torch.allclose(lp[:, 1:][ok[:, 1:]], ref[ok[:, 1:]].float(), atol=1e-6)
    assert torch.allclose(got, logits.grad, atol=1e-7)


def test_token_logprobs_sorts_nothing_without_top_k_or_top_p(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("sorted although no token filters")

    monkeypatch.setattr(losses, "_top_k_top_p_remove", boom)
    logits = torch.randn(2, 4, 6)
    ids = torch.randint(0, 6, (2, 4))
    # top_p 1 and top_k in {0, -1, >= V}, or greedy tokens: no filter anywhere
    kw = dict(temperature=torch.tensor([[0.7] * 4, [0.0] * 4]), top_p=torch.tensor([[1.0] * 4, [0.5] * 4],
              dtype=torch.float64), top_k=torch.tensor([[-1, 0, 6, 9], [3] * 4]))
    lp = token_logprobs(logits, ids, **kw)
    # greedy row: raw log_softmax
    raw = torch.log_softmax(logits[1, :-1], -1).gather(1, ids[1, 1:, None]).squeeze(1)
    assert torch.allclose(lp[1, 1:], raw, atol=1e-6)
    # masked-out tokens are 0 and not computed
    only = token_logprobs(logits, ids, mask=torch.tensor([[False, False, True, False], [False] * 4]))
    assert only[0, 2].item() == pytest.approx(token_logprobs(logits, ids)[0, 2].item(), abs=1e-6)
    assert (only[0, [0, 1, 3]] == 0).all() and (only[1] == 0).all()


def test_token_logprobs_match_transformers_warpers_on_the_tiny_model(tiny_model):
    """Same log-probs as ``rollout.policies.hf.score_tokens`` (transformers' warpers), per sampling setting."""
    from transformers import AutoModelForCausalLM

    from rollout.policies.hf import score_tokens
    from schemas.events import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, V, (7,), generator=g).tolist()
    with torch.no_grad():
        greedy_next = int(model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
    # the first action token is the argmax (inside every nucleus); the rest random (some outside top-p/top-k)
    action = [greedy_next] + torch.randint(4, V, (5,), generator=g).tolist()
    settings = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=20),
                SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=1.3, top_k=50, top_p=0.95),
                SamplingParams(temperature=0.7, top_p=0.999)]
    ids = torch.tensor([prompt + action] * len(settings))
    n, L = len(settings), ids.shape[1]
    temperature = torch.tensor([[s.temperature] * L for s in settings], dtype=torch.float32)
    top_p = torch.tensor([[s.top_p] * L for s in settings], dtype=torch.float64)
    top_k = torch.tensor([[s.top_k] * L for s in settings])
    mask = torch.zeros(n, L, dtype=torch.bool)
    mask[:, len(prompt):] = True
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    got = token_logprobs(logits, ids, temperature=temperature, top_k=top_k, top_p=top_p, mask=mask)
    n_inf = 0
    for row, s in enumerate(settings):
        want = score_tokens(model, prompt, action, s)
        have = got[row, len(prompt):].tolist()
        for h, w in zip(have, want):
            if math.isinf(w):
                n_inf += 1
                assert h == w
            else:
                assert h == pytest.approx(w, abs=2e-5)
        assert math.isfinite(have[0])
    assert n_inf > 0  # the settings do exclude some of the random tokens


# ----------------------------------------------------------------------------- aggregation

# Two micro-batches of one optimizer step; episode b continues from the first into the second.
#   micro-batch 1: episodes [a, b], tokens l = 1, 2 (a), 3 (b), 9 (padding)
#   micro-batch 2: episodes [b, c], tokens l = 4 (b), 5 (c), 6 and 9 masked out
# responses: a = {1, 2} (|o| = 2), b = {3, 4} (|o| = 2), c = {5} (|o| = 1); T = 5 tokens, G = 3 responses
VALUES = [torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[4.0, 5.0, 6.0, 9.0]])]
MASKS = [torch.tensor([[True, True, True, False]]), torch.tensor([[True, True, False, False]])]
EPISODES = ([torch.tensor([[0, 0, 1, -1]]), torch.tensor([[0, 1, 1, 1]])], [["a", "b"], ["b", "c"]])


@pytest.mark.parametrize("aggregation, expected", [
    ("token", 15 / 5),                                   # (1+2+3+4+5) / 5 = 3
    ("sequence", (1.5 + 3.5 + 5.0) / 3),                 # mean over responses of (1+2)/2, (3+4)/2, 5/1 = 10/3
    ("dr_grpo", (3 + 7 + 5) / (4 * 3)),                  # sum_i (sum_t l) / C / G, C = 4: 15 / 12 = 1.25
])
def test_step_aggregation_over_two_micro_batches(aggregation, expected):
    responses = step_response_index(*EPISODES)
    assert [r.tolist() for r in responses] == [[[0, 0, 1, -1]], [[1, 2, 2, 2]]]
    # scale 2 = grad_accum: DeepSpeed divides each micro-batch's loss by 2, so the sum / 2 is the step's loss
    weights, totals = step_loss_weights(MASKS, responses, aggregation=aggregation, norm_tokens=4, scale=2.0)
    assert (totals.tokens, totals.responses) == (5, 3)
    step_loss = sum(aggregate(v, w) for v, w in zip(VALUES, weights)) / 2
    assert step_loss.item() == pytest.approx(expected, rel=1e-6)


def test_step_aggregation_is_global_over_ranks():
    # this rank holds the two micro-batches above; another rank holds 3 tokens of 1 response:
    # the all-reduce adds them -> T = 8, G = 4. token: this rank's share = 15 / 8; its loss with
    # scale = A * W = 2 * 2 is 4 * 15 / 8, and DeepSpeed's mean over 2 micro-batches and 2 ranks takes 1/4 of it
    def all_reduce(t):
        return t + torch.tensor([3.0, 1.0], dtype=t.dtype)

    responses = step_response_index(*EPISODES)
    weights, totals = step_loss_weights(MASKS, responses, aggregation="token", all_reduce=all_reduce, scale=4.0)
    assert (totals.tokens, totals.responses) == (8, 4)
    assert (sum(aggregate(v, w) for v, w in zip(VALUES, weights)) / 4).item() == pytest.approx(15 / 8)
    # sequence: this rank's responses a, b, c give (1.5 + 3.5 + 5) / G = 10 / 4
    weights, _ = step_loss_weights(MASKS, responses, aggregation="sequence", all_reduce=all_reduce, scale=4.0)
    assert (sum(aggregate(v, w) for v, w in zip(VALUES, weights)) / 4).item() == pytest.approx(10 / 4)


def test_step_without_loss_tokens_has_zero_weights():
    weights, totals = step_loss_weights([torch.zeros(1, 3, dtype=torch.bool)], [torch.tensor([[0, 0, -1]])],
                                        aggregation="sequence")
    assert totals.tokens == 0 and totals.responses == 0 and weights[0].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="norm_tokens"):
        step_loss_weights(MASKS, step_response_index(*EPISODES), aggregation="dr_grpo")
    with pytest.raises(ValueError, match="aggregation"):
        step_loss_weights(MASKS, step_response_index(*EPISODES), aggregation="mean")


def test_grad_accum_two_equals_one_micro_batch_holding_both():
    """Token mode: the gradient DeepSpeed accumulates over 2 micro-batches (mean) is the one-batch gradient."""
    torch.manual_seed(0)
    V, D = 13, 8
    emb, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V)
    params = list(emb.parameters()) + list(head.parameters())
    ids = torch.randint(0, V, (2, 6))
    mask = torch.tensor([[False, True, True, True, False, False], [False, False, True, True, True, True]])
    batch = SimpleNamespace(
        input_ids=ids, loss_mask=mask, advantages=torch.randn(2, 6), behaviour_logprobs=-torch.rand(2, 6),
        has_behaviour_logprobs=torch.ones(2, 6, dtype=torch.bool), episode_index=torch.tensor([[0] * 6, [1] * 6]),
        episode_ids=["e0", "e1"], temperature=torch.full((2, 6), 0.8), top_k=torch.full((2, 6), 11),
        top_p=torch.full((2, 6), 0.97, dtype=torch.float64))
    obj = build_objective("ppo", aggregation="token")

    def rows(r):
        return SimpleNamespace(**{k: (v[r:r + 1] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})

    def loss_of(b, weights):
        logp = token_logprobs(head(emb(b.input_ids)), b.input_ids, temperature=b.temperature, top_k=b.top_k,
                              top_p=b.top_p, mask=b.loss_mask)
        return obj(logp, b, mask=b.loss_mask, weights=weights).loss

    whole = torch.autograd.grad(loss_of(batch, None), params)
    assert all(g.abs().sum() > 0 for g in whole)
    parts = [rows(0), rows(1)]
    weights, totals = step_loss_weights([p.loss_mask for p in parts], step_response_index(
        [p.episode_index for p in parts], [p.episode_ids for p in parts]), aggregation="token", scale=2.0)
    assert totals.tokens == 7
    accumulated = [torch.zeros_like(p) for p in params]
    for part, w in zip(parts, weights):
        for acc, g in zip(accumulated, torch.autograd.grad(loss_of(part, w) / 2, params)):  # DeepSpeed's 1/A
            acc += g
    for a, b in zip(accumulated, whole):
        assert torch.allclose(a, b, atol=1e-6)
    # without the global normaliser (each micro-batch its own token mean) they differ: 3 vs 4 tokens
    naive = [torch.zeros_like(p) for p in params]
    for part in parts:
        for acc, g in zip(naive, torch.autograd.grad(loss_of(part, None) / 2, params)):
            acc += g
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(naive, whole))


def test_policy_gradient_objective_missing_logprobs_and_token_weights():
    # 3 tokens, A = 1, behaviour logp -0.5 on t0, t1; t2 has no behaviour log-probs -> ratio 1 (behaviour := current)
    # ratios: t0 e^0 = 1, t1 e^0 = 1, t2 1 -> pg = [-1, -1, -1]; staleness weights [1, 0.25, 1]
    # token aggregation over 3 tokens: (-1 - 0.25 - 1) / 3 = -0.75
    batch = SimpleNamespace(
        behaviour_logprobs=torch.tensor([[-0.5, -0.5, 0.0]]), has_behaviour_logprobs=torch.tensor([[True, True, False]]),
        loss_mask=ALL, advantages=torch.ones(1, 3), episode_index=torch.tensor([[0, 0, 0]]),
    )
    obj = build_objective("ppo")
    out = obj(torch.tensor([[-0.5, -0.5, -0.7]]), batch, token_weights=torch.tensor([[1.0, 0.25, 1.0]]))
    assert out.loss.item() == pytest.approx(-0.75)
    assert not obj.needs_reference and build_objective("grpo").needs_reference
    assert build_objective("grpo").aggregation == "sequence" and build_objective("ppo").aggregation == "token"


def test_build_objective_rejects_unknown():
    with pytest.raises(ValueError, match="objective"):
        build_objective("dpo")
    with pytest.raises(ValueError, match="beta"):
        build_objective("bc", beta=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        build_objective("ppo", aggregation="mean")


def test_negative_weight_scales_only_negative_advantages():
    # W-REINFORCE split (Zhu et al. 2025, sec. 4) with lambda_pos = 1, lambda_neg = 0.25, on-policy (ratio 1):
    # A = [2, -1, -3] -> A' = [2, -0.25, -0.75]; token mean of -A' r = (-2 + 0.25 + 0.75) / 3 = -1/3
    # d loss / d logp_t = -A'_t r_t / 3 = [-2/3, 0.25/3, 0.75/3]
    logp = torch.zeros(1, 3, requires_grad=True)
    objective = build_objective("grpo", aggregation="token", kl_coef=0.0, negative_weight=0.25)
    batch = SimpleNamespace(advantages=torch.tensor([[2.0, -1.0, -3.0]]), has_behaviour_logprobs=ALL,
                            behaviour_logprobs=torch.zeros(1, 3), loss_mask=ALL,
                            episode_index=torch.zeros(1, 3, dtype=torch.long))
    out = objective(logp, batch, mask=ALL, weights=MEAN3)
    assert out.loss.item() == pytest.approx(-1 / 3)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2 / 3, 0.25 / 3, 0.75 / 3])
    # 0: successes only (only the positive advantage's token gets a gradient); 1: the plain objective
    assert losses.weigh_negatives(torch.tensor([2.0, -1.0]), 0.0).tolist() == [2.0, 0.0]
    assert losses.weigh_negatives(torch.tensor([2.0, -1.0]), 1.0).tolist() == [2.0, -1.0]
