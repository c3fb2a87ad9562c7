"""Recipes: rewards, returns and advantages against hand-computed values; loading and hashing."""

import numpy as np
import pytest

from pipelines.recipes import (
    BUILTIN_RECIPES,
    Recipe,
    RecipeError,
    discounted_returns,
    dr_grpo_advantage,
    gae_advantages,
    grpo_advantage,
    load_recipe,
    potential_shaping,
    step_rewards,
)


def test_outcome_gives_credit_at_the_last_step_only():
    rec = load_recipe("outcome")
    r = step_rewards(rec, outcome=1.0, step_scores=np.zeros(3))
    # r = [0, 0, R]; gamma = 1 -> G_t = R everywhere; lambda = 1 -> A_t = G_t
    assert r.tolist() == [0.0, 0.0, 1.0]
    assert discounted_returns(r, gamma=rec.gamma).tolist() == [1.0, 1.0, 1.0]
    assert gae_advantages(r, gamma=rec.gamma, lam=rec.lam).tolist() == [1.0, 1.0, 1.0]


def test_discounted_outcome():
    r = step_rewards(Recipe(name="d", reward="discounted", gamma=0.5), outcome=1.0, step_scores=np.zeros(3))
    # G_2 = 1, G_1 = 0 + 0.5 * 1 = 0.5, G_0 = 0 + 0.5 * 0.5 = 0.25
    assert discounted_returns(r, gamma=0.5).tolist() == [0.25, 0.5, 1.0]


def test_verification_shaped_is_potential_based_by_hand():
    rec = Recipe(name="s", reward="verification_shaped", gamma=0.9, lam=0.5, verification_weight=0.5,
                 step_penalty=0.1)
    assert rec.shaping == "potential"
    r = step_rewards(rec, outcome=1.0, step_scores=np.array([1.0, 0.0, 1.0]))
    # Phi_0 = 0, Phi_1 = 0.5*1 = 0.5, Phi_2 = 0.5*0 = 0, Phi_3 = 0 (terminal; s_2 never enters)
    # F_0 = 0.9*0.5 - 0 = 0.45; F_1 = 0.9*0 - 0.5 = -0.5; F_2 = 0.9*0 - 0 = 0
    # r = F - 0.1 + [0, 0, 1] = [0.35, -0.6, 0.9]
    np.testing.assert_allclose(r, [0.35, -0.6, 0.9])
    # G_2 = 0.9; G_1 = -0.6 + 0.9*0.9 = 0.21; G_0 = 0.35 + 0.9*0.21 = 0.539
    # = gamma^2 * R - (0.1 + 0.9*0.1 + 0.81*0.1) = 0.81 - 0.271: the shaping telescoped away
    np.testing.assert_allclose(discounted_returns(r, gamma=0.9), [0.539, 0.21, 0.9])
    # gamma*lambda = 0.45: A_2 = 0.9; A_1 = -0.6 + 0.45*0.9 = -0.195; A_0 = 0.35 + 0.45*(-0.195) = 0.26225
    np.testing.assert_allclose(gae_advantages(r, gamma=0.9, lam=0.5), [0.26225, -0.195, 0.9])


def test_potential_shaping_telescopes_to_zero():
    rng = np.random.default_rng(0)
    for T in range(1, 40):
        F = potential_shaping(rng.uniform(0, 1, T), weight=0.7, gamma=0.95)
        # sum_t gamma^t F_t = gamma^T Phi_T - Phi_0 = 0
        assert abs(discounted_returns(F, gamma=0.95)[0]) < 1e-12


def test_additive_shaping_by_hand_and_refused_unless_the_penalty_covers_the_weight():
    rec = Recipe(name="a", reward="verification_shaped", shaping="additive", gamma=0.9, verification_weight=0.5,
                 step_penalty=0.5)
    # r = 0.5*s - 0.5 + [0, 0, 1]: [0, -0.5, 1.0]; G_1 = -0.5 + 0.9*1 = 0.4; G_0 = 0 + 0.9*0.4 = 0.36
    r = step_rewards(rec, outcome=1.0, step_scores=np.array([1.0, 0.0, 1.0]))
    np.testing.assert_allclose(r, [0.0, -0.5, 1.0])
    np.testing.assert_allclose(discounted_returns(r, gamma=0.9), [0.36, 0.4, 1.0])
    with pytest.raises(RecipeError, match="`step_penalty: 0.5`"):
        Recipe(name="a", reward="verification_shaped", shaping="additive", verification_weight=0.5, step_penalty=0.1)
    with pytest.raises(RecipeError, match="`prm_weight`"):
        Recipe(name="a", reward="prm", prm="m:f", shaping="additive", prm_weight=1.0)
    with pytest.raises(RecipeError, match="negative penalty pays for length"):
        Recipe(name="a", reward="verification_shaped", verification_weight=0.5, step_penalty=-0.1)


def test_reward_clip_limits():
    rec = Recipe(name="c", reward="verification_shaped", verification_weight=1.0, outcome_weight=3.0,
                 reward_max=2.0, reward_min=-1.0)
    # Phi = [0, 1, 0, 0]: F = [1, -1, 0]; r = [1, -1, 0 + 3] -> the last clipped to 2
    assert step_rewards(rec, outcome=1.0, step_scores=np.array([1.0, 0.0, 1.0])).tolist() == [1.0, -1.0, 2.0]


def test_bounds_that_cut_the_shaping_are_refused():
    # w = 1, penalty 0: the shaping terms range over [-1, gamma*1]; reward_min -0.5 would cut them
    with pytest.raises(RecipeError, match="set `reward_min` <= -1"):
        Recipe(name="c", reward="verification_shaped", verification_weight=1.0, reward_min=-0.5)
    with pytest.raises(RecipeError, match="`reward_max` >= 0.95"):
        Recipe(name="c", reward="verification_shaped", gamma=0.95, verification_weight=1.0, reward_max=0.5)


def test_prm_hook_scores_each_step():
    rec = Recipe(name="p", reward="prm", prm="builtins:len", prm_weight=0.5)
    # Phi_1 = 0.5*0.2 = 0.1, Phi_2 = 0 (terminal); gamma 1: F = [0.1 - 0, 0 - 0.1]; r = F + [0, R]
    np.testing.assert_allclose(step_rewards(rec, outcome=1.0, step_scores=np.zeros(2),
                                            prm_scores=np.array([0.2, 0.4])), [0.1, 0.9])
    with pytest.raises(RecipeError, match="outside"):
        step_rewards(rec, outcome=1.0, step_scores=np.zeros(2), prm_scores=np.array([1.5, 0.4]))
    with pytest.raises(RecipeError, match="one per step"):
        step_rewards(rec, outcome=1.0, step_scores=np.zeros(2), prm_scores=np.array([0.5]))
    with pytest.raises(RecipeError, match="prm"):
        Recipe(name="p", reward="prm")


def test_group_advantages_by_hand():
    R = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    # mean 0.6; population std sqrt((3*0.16 + 2*0.36)/5) = sqrt(0.24) = 0.489898
    np.testing.assert_allclose(grpo_advantage(R, mean=0.6, std=0.24 ** 0.5, eps=0.0),
                               [0.4 / 0.489898, -0.6 / 0.489898, -0.6 / 0.489898, 0.4 / 0.489898, 0.4 / 0.489898],
                               rtol=1e-5)
    # Dr. GRPO: no division
    np.testing.assert_allclose(dr_grpo_advantage(R, mean=0.6), [0.4, -0.6, -0.6, 0.4, 0.4])


def _returns(recipe: Recipe, outcome: float, scores: np.ndarray) -> float:
    prm = scores if recipe.reward == "prm" else None
    return float(discounted_returns(step_rewards(recipe, outcome=outcome, step_scores=scores, prm_scores=prm),
                                    gamma=recipe.gamma)[0])


@pytest.mark.parametrize("recipe", [*BUILTIN_RECIPES.values(),
                                    Recipe(name="prm", reward="prm", prm="m:f", gamma=0.95, prm_weight=1.0),
                                    Recipe(name="pen", reward="verification_shaped", gamma=0.9,
                                           verification_weight=2.0, step_penalty=0.05, reward_min=-3.0)],
                         ids=lambda r: r.name)
def test_a_short_correct_solution_beats_every_invalid_episode(recipe):
    """Property, over many random episodes: neither length nor step scores make an invalid episode pay."""
    rng = np.random.default_rng(7)
    worst_correct = min(_returns(recipe, 1.0, rng.choice([0.0, 1.0, *rng.uniform(0, 1, 3)], T))
                        for T in (1, 2, 3) for _ in range(300))
    best_invalid = max(_returns(recipe, 0.0, rng.uniform(0, 1, T) if k % 2 else np.ones(T))
                       for T in range(1, 33) for k in range(100))
    assert worst_correct > best_invalid, (recipe.name, worst_correct, best_invalid)


def test_yaml_recipe_and_stable_hash(tmp_path):
    path = tmp_path / "shaped.yaml"
    path.write_text("# trajpipe pipeline run --source archive --archive A --out O --recipe shaped.yaml\n"
                    "reward: verification_shaped\ngamma: 0.9\nlambda: 0.8\nverification_weight: 0.25\n")
    rec = load_recipe(path)
    assert (rec.name, rec.gamma, rec.lam) == ("shaped", 0.9, 0.8)
    assert load_recipe(path).content_hash == rec.content_hash
    assert load_recipe(path, normalization="group_mean").normalization == "group_mean"
    assert load_recipe(path, gamma=0.95).content_hash != rec.content_hash
    assert rec.version == f"shaped-{rec.content_hash[:8]}"
    with pytest.raises(RecipeError, match="--recipe"):
        load_recipe("no-such-recipe")
    path.write_text("reward: outcome\nunknown_field: 1\n")
    with pytest.raises(RecipeError, match="unknown_field"):
        load_recipe(path)
