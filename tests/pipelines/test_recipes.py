"""Recipes: rewards, returns and advantages against hand-computed values; loading and hashing."""

import numpy as np
import pytest

from pipelines.recipes import (
    Recipe,
    RecipeError,
    discounted_returns,
    gae_advantages,
    load_recipe,
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


def test_verification_shaped_by_hand():
    rec = Recipe(name="s", reward="verification_shaped", gamma=0.9, lam=0.5, verification_weight=0.5,
                 step_penalty=0.1)
    r = step_rewards(rec, outcome=1.0, step_scores=np.array([1.0, 0.0, 1.0]))
    # r_0 = 0.5*1 - 0.1 = 0.4; r_1 = 0.5*0 - 0.1 = -0.1; r_2 = 0.5*1 + 1*1 - 0.1 = 1.4
    np.testing.assert_allclose(r, [0.4, -0.1, 1.4])
    # G_2 = 1.4; G_1 = -0.1 + 0.9*1.4 = 1.16; G_0 = 0.4 + 0.9*1.16 = 1.444
    np.testing.assert_allclose(discounted_returns(r, gamma=0.9), [1.444, 1.16, 1.4])
    # gamma*lambda = 0.45: A_2 = 1.4; A_1 = -0.1 + 0.45*1.4 = 0.53; A_0 = 0.4 + 0.45*0.53 = 0.6385
    np.testing.assert_allclose(gae_advantages(r, gamma=0.9, lam=0.5), [0.6385, 0.53, 1.4])


def test_reward_clip_limits():
    rec = Recipe(name="c", reward="verification_shaped", verification_weight=1.0, reward_max=1.0, reward_min=-0.5)
    # r = [1, 0, 1 + 1 = 2] -> clipped to [1, 0, 1]
    assert step_rewards(rec, outcome=1.0, step_scores=np.array([1.0, 0.0, 1.0])).tolist() == [1.0, 0.0, 1.0]


def test_prm_hook_scores_each_step():
    rec = Recipe(name="p", reward="prm", prm="builtins:len", prm_weight=0.5)
    # r_t = 0.5 * prm_t + [t == T-1] * R: [0.5*0.2, 0.5*0.4 + 1] = [0.1, 1.2]
    np.testing.assert_allclose(step_rewards(rec, outcome=1.0, step_scores=np.zeros(2),
                                            prm_scores=np.array([0.2, 0.4])), [0.1, 1.2])
    with pytest.raises(RecipeError, match="prm"):
        Recipe(name="p", reward="prm")


def test_yaml_recipe_and_stable_hash(tmp_path):
    path = tmp_path / "shaped.yaml"
    path.write_text("# trajpipe pipeline run --source archive --archive A --out O --recipe shaped.yaml\n"
                    "reward: verification_shaped\ngamma: 0.9\nlambda: 0.8\nverification_weight: 0.25\n")
    rec = load_recipe(path)
    assert (rec.name, rec.gamma, rec.lam) == ("shaped", 0.9, 0.8)
    assert load_recipe(path).content_hash == rec.content_hash
    assert load_recipe(path, gamma=0.95).content_hash != rec.content_hash
    assert rec.version == f"shaped-{rec.content_hash[:8]}"
    with pytest.raises(RecipeError, match="--recipe"):
        load_recipe("no-such-recipe")
    path.write_text("reward: outcome\nunknown_field: 1\n")
    with pytest.raises(RecipeError, match="unknown_field"):
        load_recipe(path)
