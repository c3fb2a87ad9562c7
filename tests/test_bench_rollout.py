"""The vLLM bench's figures from its pairs (``bench.rollout.vllm_figures``), against hand-computed values.

The runs themselves (a vLLM rollout and the offline reference, minutes each) are measured by
``make bench``, not here; what is tested is how their counts become the recorded figures.
"""

from __future__ import annotations

import pytest

from bench.rollout import VLLM_CONCURRENCY, vllm_figures


def _rollout(tokens: int, seconds: float, busy_s: float, steps: int, episodes_per_s: float, load_s: float) -> dict:
    return {"generated_tokens": tokens, "generation_s": seconds, "engine_busy_s": busy_s, "engine_steps": steps,
            "episodes_per_s": episodes_per_s, "load_s": load_s}


def _offline(tokens: int, seconds: float, steps: int, by_step_tokens: int, by_step_s: float,
             by_step_steps: int) -> dict:
    return {"generated_tokens": tokens, "generate_s": seconds, "generate_engine_steps": steps,
            "by_step_generated_tokens": by_step_tokens, "by_step_generate_s": by_step_s,
            "by_step_engine_steps": by_step_steps, "max_num_seqs": 256}


def test_each_side_counts_its_best_run_and_the_pairs_keep_their_spread():
    rollouts = [_rollout(1000, 0.5, 0.45, 5, 10.0, 6.0),  # 2,000 tokens/s
                _rollout(1200, 0.4, 0.36, 8, 12.5, 5.5)]  # 3,000 tokens/s: the best rollout
    offlines = [_offline(1000, 0.25, 4, 1000, 0.4, 8),  # one call 4,000 tokens/s (the best), by step 2,500
                _offline(1200, 0.4, 6, 1200, 0.4, 10)]  # one call 3,000, by step 3,000 (the best)
    figures = vllm_figures(rollouts, offlines, [1.0, 0.98])
    assert figures == {
        "rollout_vllm_episodes_per_s": 12.5,
        "rollout_vllm_load_s": 5.5,
        "rollout_vllm_tokens_per_s": 3000.0,
        "rollout_vllm_generate_tokens_per_s": 4000.0,
        "rollout_vllm_tokens_vs_generate": 0.75,  # 3,000 / 4,000: best against best, from different pairs
        "rollout_vllm_generate_by_step_tokens_per_s": 3000.0,
        "rollout_vllm_tokens_vs_generate_by_step": 1.0,
        "rollout_vllm_engine_busy": 0.9,  # 0.36 / 0.4, the best rollout's
        "rollout_vllm_tokens_per_engine_step": 150.0,  # 1,200 / 8
        "rollout_vllm_generate_tokens_per_engine_step": 250.0,  # 1,000 / 4, the best one call's
        "rollout_vllm_generate_by_step_tokens_per_engine_step": 120.0,  # 1,200 / 10, the best by-step run's
        "rollout_vllm_same_actions": 0.98,  # the lowest pair's
        "rollout_vllm_concurrency": VLLM_CONCURRENCY,
        "rollout_vllm_engine_max_num_seqs": 256,
        "rollout_vllm_repeats": 2,
        "rollout_vllm_tokens_vs_generate_pair_min": 0.5,  # 2,000 / 4,000
        "rollout_vllm_tokens_vs_generate_pair_max": 1.0,  # 3,000 / 3,000
    }


def test_one_pair_is_its_own_best_and_spread():
    figures = vllm_figures([_rollout(700, 0.5, 0.4, 7, 3.0, 4.0)], [_offline(900, 0.5, 3, 800, 0.5, 4)], [1.0])
    assert figures["rollout_vllm_tokens_vs_generate"] == pytest.approx(700 / 900, abs=5e-4)
    assert figures["rollout_vllm_tokens_vs_generate_pair_min"] == figures["rollout_vllm_tokens_vs_generate_pair_max"] \
        == figures["rollout_vllm_tokens_vs_generate"]
    assert figures["rollout_vllm_tokens_vs_generate_by_step"] == pytest.approx(700 / 800, abs=5e-4)
    assert figures["rollout_vllm_repeats"] == 1
