"""Objectives against hand-computed values (working in the comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainer.losses import (
    aggregate, awr_loss, build_objective, filtered_bc_loss, kl_k3, ppo_clip_loss, staleness_weights, token_logprobs,
)

ALL = torch.ones(1, 3, dtype=torch.bool)
SEG3 = torch.tensor([[0, 1, 2]])


def test_ppo_clip_ratios_clipping_and_metrics():
    # behaviour logp 0, current logp = ln r  ->  ratio r = [1.5, 0.5, 1.1]; A = [1, 1, -1]; eps = 0.2
    # t0: -A r = -1.5, -A clip(r) = -1.2           -> max = -1.2 (clipped, no gradient)
    # t1: -A r = -0.5, -A clip(r) = -A*0.8 = -0.8  -> max = -0.5 (unclipped; ratio still outside [0.8, 1.2])
    # t2: -A r = +1.1, -A clip(r) = +1.1           -> max = 1.1
    # token mean = (-1.2 - 0.5 + 1.1) / 3 = -0.2
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    out = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), ALL, SEG3, clip_eps=0.2)
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
                        torch.zeros(1, 1, dtype=torch.long), clip_eps=0.2, clip_eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.metrics["clip_fraction"].item() == 0.0


def test_aggregation_token_vs_sequence():
    # values 1..5, sample 0 = tokens {1, 2}, sample 1 = tokens {3, 4, 5}
    # token:    (1+2+3+4+5) / 5 = 3
    # sequence: mean(mean(1, 2), mean(3, 4, 5)) = (1.5 + 4) / 2 = 2.75
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 9.0]])
    mask = torch.tensor([[True] * 5 + [False]])
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    assert aggregate(v, mask, seg, "token").item() == pytest.approx(3.0)
    assert aggregate(v, mask, seg, "sequence").item() == pytest.approx(2.75)
    assert aggregate(v, torch.zeros_like(mask), seg, "sequence").item() == 0.0


def test_awr_weights_clipped():
    # beta 2, A = [0, 2 ln 2, 2 ln 100] -> exp(A / beta) = [1, 2, 100] -> clipped at 20 -> [1, 2, 20]
    # logp = -1 everywhere: loss = mean(w * 1) = 23 / 3; one of three weights clipped
    adv = torch.tensor([[0.0, 2 * math.log(2), 2 * math.log(100)]])
    out = awr_loss(torch.full((1, 3), -1.0), adv, ALL, SEG3, beta=2.0, max_weight=20.0)
    assert out.loss.item() == pytest.approx(23 / 3, rel=1e-5)
    assert out.metrics["mean_weight"].item() == pytest.approx(23 / 3, rel=1e-5)
    assert out.metrics["weight_clip_fraction"].item() == pytest.approx(1 / 3)


def test_filtered_bc_keeps_only_positive_advantage():
    # A = [1, -1, 0.5, 0]: keep t0, t2 (A > 0) -> loss = -(logp0 + logp2) / 2 = (1 + 3) / 2 = 2
    out = filtered_bc_loss(torch.tensor([[-1.0, -2.0, -3.0, -4.0]]), torch.tensor([[1.0, -1.0, 0.5, 0.0]]),
                           torch.ones(1, 4, dtype=torch.bool), torch.tensor([[0, 1, 2, 3]]))
    assert out.loss.item() == pytest.approx(2.0)
    assert out.metrics["kept_fraction"].item() == pytest.approx(0.5)


def test_staleness_cap():
    # current 5, K = 2: lags [0, 1, 4, 5, -] -> over the cap by [0, 0, 2, 3, 0]
    versions = torch.tensor([[5, 4, 1, 0, 6]])
    assert staleness_weights(versions, 5, max_staleness=2, mode="drop").tolist() == [[1, 1, 0, 0, 1]]
    # decay 0.5 ** over = [1, 1, 0.25, 0.125, 1]
    assert staleness_weights(versions, 5, max_staleness=2, mode="decay", decay=0.5).tolist() == \
        [[1, 1, 0.25, 0.125, 1]]


def test_kl_k3():
    # pi = 0.5, pi_ref = 0.25: log r = ln(0.25/0.5) = -ln 2; k3 = 0.5 + ln 2 - 1 = 0.193147
    k3 = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert k3.item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_token_logprobs_alignment():
    # uniform logits over V = 4: every predicted token has log-prob -ln 4; column 0 has no context -> 0
    logits = torch.zeros(1, 3, 4)
    lp = token_logprobs(logits, torch.tensor([[1, 2, 3]]))
    assert lp.tolist()[0] == pytest.approx([0.0, -math.log(4), -math.log(4)])
    # a peaked prediction at position 0 for token 2 shows up at column 1
    logits[0, 0, 2] = 10.0
    assert token_logprobs(logits, torch.tensor([[1, 2, 3]]))[0, 1].item() > -0.01


def test_policy_gradient_objective_staleness_and_missing_logprobs():
    # 3 tokens: t0 fresh (v=3), t1 stale (v=0, lag 3 > K=1) -> dropped, t2 fresh but no behaviour logprobs
    # -> its ratio is 1 (behaviour := current). A = 1: pg = [-clip(r0), -, -1]; r0 = e^0 = 1 -> loss = (-1 - 1) / 2
    batch = SimpleNamespace(
        behaviour_logprobs=torch.tensor([[-0.5, -0.5, 0.0]]), has_behaviour_logprobs=torch.tensor([[True, True, False]]),
        loss_mask=ALL, policy_versions=torch.tensor([[3, 0, 3]]), advantages=torch.ones(1, 3), segment_ids=SEG3,
    )
    obj = build_objective("ppo", max_staleness=1)
    out = obj(torch.tensor([[-0.5, -0.5, -0.7]]), batch, current_version=3)
    assert out.loss.item() == pytest.approx(-1.0)
    assert out.metrics["stale_fraction"].item() == pytest.approx(1 / 3)
    assert not obj.needs_reference and build_objective("grpo").needs_reference


def test_build_objective_rejects_unknown():
    with pytest.raises(ValueError, match="objective"):
        build_objective("dpo")
    with pytest.raises(ValueError, match="beta"):
        build_objective("bc", beta=1.0)
