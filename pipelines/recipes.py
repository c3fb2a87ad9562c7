"""Reward recipes: how an episode's outcome and verifications become per-step credit.

A :class:`Recipe` is a typed config, loaded by name (:data:`BUILTIN_RECIPES`)
or from a YAML file whose first line is the command that uses it::

    # trajpipe pipeline run --source archive --archive data/archive --out data/datasets --recipe shaped.yaml
    name: shaped
    reward: verification_shaped
    gamma: 0.95
    verification_weight: 0.5

Its :attr:`Recipe.content_hash` (sha256 of the canonical JSON of every field)
names the dataset version ``<name>-<hash8>``: the same recipe always writes
into the same version, any change to it writes a new version beside the old.

Only *judged* episodes get credit (``termination`` ``done`` or ``max_steps``,
>= 1 step; :attr:`pipelines.types.Episode.trainable`): the rewards, returns
and advantages of the others are 0 and they enter no statistics — their
outcome of 0 is no verdict, so nothing is bootstrapped from it.

Per step ``t`` of a judged episode with ``T`` steps and outcome reward ``R``
(``episode_finished.outcome_reward``):

* rewards ``r_t`` by :attr:`Recipe.reward`:

  - ``outcome``: ``r_t = w_o * R * [t == T-1]`` (credit at the last step only; ``gamma`` defaults to 1).
  - ``discounted``: the same rewards with ``gamma < 1`` (default 0.95), so
    the return of step ``t`` is ``gamma^(T-1-t) * w_o * R``.
  - ``verification_shaped`` and ``prm``: the outcome plus a shaping term of
    the per-step score ``sigma_t`` (``verification_shaped``: the weighted mean
    score of the step's *counted* verdicts, weights ``verifier_weights[name]``,
    default 1; ``prm``: the score in [0, 1] of a learned process-reward model,
    an import path ``module:function`` returning one score per step), weight
    ``w`` (``verification_weight`` / ``prm_weight``):

    ``shaping: potential`` (default) — potential-based shaping (Ng, Harada &
    Russell 1999, "Policy invariance under reward transformations: theory and
    application to reward shaping", ICML, Thm. 1): the potential of the state
    after step ``t`` is ``Phi_{t+1} = w * sigma_t``, ``Phi_0 = 0`` and the
    terminal state's potential is 0, ``F_t = gamma * Phi_{t+1} - Phi_t`` and
    ``r_t = F_t + w_o * R * [t == T-1] - step_penalty``. The shaping
    telescopes: ``sum_t gamma^t F_t = gamma^T Phi_T - Phi_0 = 0``, so
    ``G_0 = gamma^(T-1) w_o R - sum_t gamma^t step_penalty`` whatever the
    step scores: steps are credited early, but neither length nor
    high-scoring invalid steps can make an episode pay.

    ``shaping: additive`` — ``r_t = w * sigma_t + w_o * R * [t == T-1] - step_penalty``,
    accepted only with ``step_penalty >= w`` (no step then nets a positive
    reward, so a longer episode never earns more).

  then clipped to ``[reward_min, reward_max]`` (bounds that would cut the
  shaping terms are refused: clipped, they no longer telescope).
* return-to-go ``G_t = r_t + gamma * G_{t+1}``, ``G_T = 0``.
* advantage: GAE(gamma, lambda) (Schulman et al. 2016, arXiv:1506.02438)
  with a **zero value baseline** (the dataset has no critic):
  ``delta_t = r_t + gamma*V(t+1) - V(t) = r_t`` and
  ``A_t = sum_l (gamma*lambda)^l * delta_{t+l}``; with ``lambda = 1``,
  ``A_t = G_t``. The baseline is subtracted when normalizing
  (:mod:`pipelines.normalize`) by :attr:`Recipe.normalization`:

  - ``domain``: ``(A_t - mean_d) / (std_d + eps)`` over the domain's trainable steps;
  - ``group`` (GRPO, Shao et al. 2024, arXiv:2402.03300 §4.1.2):
    ``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)`` (:func:`grpo_advantage`);
  - ``group_mean`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783 §3.2):
    ``A_i = R_i - mean(R_group)``, no division by the std (:func:`dr_grpo_advantage`);
  - ``none``: ``A_t`` as is.

  ``R_i`` is the episode return ``G_0`` and the group is the episode's
  complete GRPO group (:mod:`pipelines.groups`), trainable members only.

Feedback (``trajpipe feedback --score``; :mod:`pipelines.feedback`, docs/feedback.md).
With ``F`` the mean rating of the episode-level feedback the episode carries
(``target_step`` None) and ``f_t`` the mean rating of the feedback on step
``t`` (0 if none), by :attr:`Recipe.feedback`:

  - ``ignore`` (default): ratings change nothing; they are only data.
  - ``override``: the outcome ``R`` in the formulas above is replaced by ``F``
    when the episode has an episode-level rating (a person's verdict takes
    precedence over the verifier's), and ``r_t += w_f * f_t``.
  - ``add``: ``R`` becomes ``R + w_f * F`` (``F = 0`` without an episode rating)
    and ``r_t += w_f * f_t``.

  The step term is a reward, not a potential-based shaping: it changes the
  episode's return (Ng et al. 1999 shaping, above, does not). It is added
  before the clip to ``[reward_min, reward_max]``. Whether an episode is
  trainable does not change: an episode cut off by the infrastructure stays
  excluded whatever its rating. Feedback counts only where the episode is
  assembled with it (docs/feedback.md, "When feedback counts").

Examples:
    >>> import numpy as np
    >>> r = step_rewards(load_recipe("outcome"), outcome=1.0, step_scores=np.array([0.0, 0.0, 0.0]))
    >>> r.tolist(), discounted_returns(r, gamma=0.5).tolist()
    ([0.0, 0.0, 1.0], [0.25, 0.5, 1.0])
    >>> load_recipe("outcome").version.startswith("outcome-")
    True
    >>> F = potential_shaping(np.array([1.0, 0.0, 1.0]), weight=0.5, gamma=0.5)
    >>> F.tolist(), float(discounted_returns(F, gamma=0.5)[0])  # Phi = [0, 0.5, 0, 0]: telescopes to 0
    ([0.25, -0.5, 0.0], 0.0)
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

__all__ = [
    "Recipe",
    "RecipeError",
    "BUILTIN_RECIPES",
    "load_recipe",
    "step_rewards",
    "discounted_returns",
    "gae_advantages",
    "potential_shaping",
    "grpo_advantage",
    "dr_grpo_advantage",
    "load_prm",
]


class RecipeError(ValueError):
    """A recipe name, file or field that is not valid."""


class Recipe(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A reward recipe (see the module docstring for the formulas).

    Attributes:
        name: recipe name; the dataset version is ``<name>-<hash8>``.
        reward: ``outcome``, ``discounted``, ``verification_shaped`` or ``prm``.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1] (YAML key ``lambda``).
        outcome_weight: ``w_o``, weight of the outcome reward.
        verification_weight: ``w_v``, weight of the per-step verification score (>= 0).
        verifier_weights: weight per verifier name in ``s_t`` (default 1.0 each;
            0 ignores a verifier).
        step_penalty: subtracted from every step's reward (``verification_shaped``
            and ``prm``; >= 0).
        shaping: ``potential`` (default; Ng et al. 1999) or ``additive``
            (needs ``step_penalty >= weight``); see the module docstring.
        prm: ``module:function`` of the process-reward model (``prm`` recipes);
            called as ``fn(episode) -> sequence of per-step scores in [0, 1]``.
        prm_weight: ``w_p``, weight of the PRM score (>= 0).
        reward_min: lower clip of ``r_t`` (None: no clip).
        reward_max: upper clip of ``r_t`` (None: no clip).
        normalization: ``domain`` (per-domain advantage statistics),
            ``group`` (GRPO), ``group_mean`` (Dr. GRPO: no std) or ``none``.
        eps: added to the standard deviation when normalizing.
        max_steps: ClipTrajectories step cap per trajectory (0: none).
        max_action_tokens: ClipTrajectories cap on action tokens per trajectory (0: none).
        feedback: how ratings of ``feedback`` events (``trajpipe feedback --score``) enter the rewards:
            ``ignore`` (default), ``override`` (an episode rating replaces the verifier outcome) or
            ``add`` (it is added to it, weighted); see "Feedback" in the module docstring.
        feedback_weight: ``w_f``, weight of what feedback adds (``add``'s episode rating, and
            step ratings under ``override`` and ``add``).
    """

    name: str
    reward: Literal["outcome", "discounted", "verification_shaped", "prm"] = "outcome"
    gamma: float = 1.0
    lam: float = msgspec.field(default=1.0, name="lambda")
    outcome_weight: float = 1.0
    verification_weight: float = 0.0
    verifier_weights: dict[str, float] = {}
    step_penalty: float = 0.0
    shaping: Literal["potential", "additive"] = "potential"
    prm: str | None = None
    prm_weight: float = 1.0
    reward_min: float | None = None
    reward_max: float | None = None
    normalization: Literal["domain", "group", "group_mean", "none"] = "domain"
    eps: float = 1e-6
    max_steps: int = 0
    max_action_tokens: int = 0
    feedback: Literal["ignore", "override", "add"] = "ignore"
    feedback_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or "=" in self.name:
            raise RecipeError(f"recipe `name` must be non-empty without '/' or '=', got {self.name!r}")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise RecipeError(f"`gamma` and `lambda` must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.reward == "prm" and not self.prm:
            raise RecipeError("a `prm` recipe needs `prm: module:function` naming the process-reward model")
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise RecipeError(f"`reward_min` {self.reward_min} > `reward_max` {self.reward_max}")
        if self.max_steps < 0 or self.max_action_tokens < 0:
            raise RecipeError("`max_steps` and `max_action_tokens` must be >= 0 (0 disables the cap)")
        if self.eps <= 0:
            raise RecipeError(f"`eps` must be > 0, got {self.eps}")
        if not self.feedback_weight >= 0 or self.feedback_weight == float("inf"):
            raise RecipeError(f"`feedback_weight` must be finite and >= 0, got {self.feedback_weight}")
        if self.reward in ("verification_shaped", "prm"):
            self._check_shaping()

    @property
    def shaping_weight(self) -> float:
        """``w``: the weight of the shaped per-step score (``verification_weight`` or ``prm_weight``)."""
        return self.prm_weight if self.reward == "prm" else self.verification_weight

    def _check_shaping(self) -> None:
        name = "prm_weight" if self.reward == "prm" else "verification_weight"
        w, p = self.shaping_weight, self.step_penalty
        if w < 0 or p < 0:
            raise RecipeError(f"`{name}` and `step_penalty` must be >= 0 (a negative penalty pays for length), "
                              f"got {w} and {p}")
        if self.shaping == "additive" and p < w:
            raise RecipeError(
                f"`shaping: additive` with `step_penalty` {p} < `{name}` {w} lets a step net a positive reward, so "
                f"a longer or invalid episode can out-earn a short correct one; set `step_penalty: {w}` (or more), "
                "or use `shaping: potential` (the default)")
        # Largest and smallest reward a step can get from shaping and penalty alone (sigma in [0, 1]).
        lo, hi = (-w - p, self.gamma * w - p) if self.shaping == "potential" else (-p, w - p)
        if (self.reward_min is not None and self.reward_min > lo) or (self.reward_max is not None
                                                                      and self.reward_max < hi):
            raise RecipeError(
                f"`reward_min`/`reward_max` [{self.reward_min}, {self.reward_max}] would clip the shaping terms "
                f"(they range over [{lo:g}, {hi:g}]), and clipped shaping no longer telescopes to 0; "
                f"set `reward_min` <= {lo:g} and `reward_max` >= {hi:g}, or remove them")

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of all fields (sorted keys).

        The feedback fields enter only when they are not at their defaults, so
        recipes written before they existed keep their dataset versions.
        """
        fields = msgspec.to_builtins(self)
        if self.feedback == "ignore" and self.feedback_weight == 1.0:
            fields.pop("feedback")
            fields.pop("feedback_weight")
        return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()

    @property
    def version(self) -> str:
        """Dataset version name: ``<name>-<first 8 hex of content_hash>``."""
        return f"{self.name}-{self.content_hash[:8]}"


#: Recipes available by name.
BUILTIN_RECIPES: dict[str, Recipe] = {
    "outcome": Recipe(name="outcome", reward="outcome"),
    "discounted": Recipe(name="discounted", reward="discounted", gamma=0.95),
    "verification_shaped": Recipe(
        name="verification_shaped", reward="verification_shaped", gamma=0.95, lam=0.95, verification_weight=0.5,
        step_penalty=0.0, reward_min=-1.0, reward_max=2.0,
    ),
}


def load_recipe(spec: str | Path, **overrides: Any) -> Recipe:
    """A recipe by builtin name or YAML file path, with optional field overrides.

    Raises:
        RecipeError: unknown name, unreadable file, or invalid fields.
    """
    import yaml

    spec_s = str(spec)
    if spec_s in BUILTIN_RECIPES and not Path(spec_s).is_file():
        data = msgspec.structs.asdict(BUILTIN_RECIPES[spec_s])
        data["lambda"] = data.pop("lam")
    else:
        path = Path(spec_s)
        if not path.is_file():
            raise RecipeError(
                f"`--recipe` {spec_s!r} is neither a builtin ({', '.join(BUILTIN_RECIPES)}) nor a YAML file"
            )
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe file {path}: {err}") from err
        if not isinstance(data, dict):
            raise RecipeError(f"recipe file {path} must hold a mapping of fields")
        data.setdefault("name", path.stem)
    data.update(overrides)
    try:
        return msgspec.convert(data, Recipe)
    except msgspec.ValidationError as err:
        raise RecipeError(f"recipe {spec_s!r}: {err}") from err


def step_rewards(
    recipe: Recipe,
    *,
    outcome: float,
    step_scores: np.ndarray,
    prm_scores: np.ndarray | None = None,
    step_feedback: np.ndarray | None = None,
) -> np.ndarray:
    """Per-step rewards ``r_t`` (float64, shape ``[T]``) of one judged episode (module docstring).

    Args:
        recipe: the recipe.
        outcome: the outcome reward ``R`` (after feedback: :func:`pipelines.feedback.feedback_outcome`).
        step_scores: ``s_t``, the weighted verification score of each step.
        prm_scores: the PRM's score of each step (``prm`` recipes), in [0, 1].
        step_feedback: ``w_f * f_t``, the feedback term of each step (added before the clip; None: none).

    Raises:
        RecipeError: the PRM returned the wrong number of scores, or scores outside [0, 1].
    """
    T = len(step_scores)
    r = np.zeros(T, dtype=np.float64)
    if T == 0:
        return r
    if recipe.reward in ("verification_shaped", "prm"):
        sigma = np.asarray(step_scores, dtype=np.float64)
        if recipe.reward == "prm":
            if prm_scores is None or len(prm_scores) != T:
                n = None if prm_scores is None else len(prm_scores)
                raise RecipeError(f"the PRM {recipe.prm!r} returned {n} scores for {T} steps; it must return one per step")
            sigma = np.asarray(prm_scores, dtype=np.float64)
            if not np.all((sigma >= 0.0) & (sigma <= 1.0)):
                raise RecipeError(f"the PRM {recipe.prm!r} returned scores outside [0, 1] ({sigma.tolist()}); "
                                  "rescale them (e.g. a sigmoid) in the PRM function")
        w = recipe.shaping_weight
        if recipe.shaping == "potential":
            r += potential_shaping(sigma, weight=w, gamma=recipe.gamma)
        else:
            r += w * sigma
        r -= recipe.step_penalty
    r[-1] += recipe.outcome_weight * outcome
    if step_feedback is not None:
        r += np.asarray(step_feedback, dtype=np.float64)
    if recipe.reward_min is not None or recipe.reward_max is not None:
        r = np.clip(r, recipe.reward_min, recipe.reward_max)
    return r


def potential_shaping(sigma: np.ndarray, *, weight: float, gamma: float) -> np.ndarray:
    """Potential-based shaping terms ``F_t = gamma * Phi_{t+1} - Phi_t`` of one episode.

    Ng, Harada & Russell (1999), "Policy invariance under reward
    transformations: theory and application to reward shaping", ICML, Thm. 1:
    ``F(s, s') = gamma * Phi(s') - Phi(s)`` leaves the optimal policies
    unchanged. Here ``Phi_0 = 0`` (the prompt), ``Phi_{t+1} = weight * sigma_t``
    (the state after step ``t``) and the terminal state's potential is 0, so
    ``sum_t gamma^t F_t = 0``: the shaping moves credit between steps and adds
    none to the episode.

    Args:
        sigma: per-step score ``sigma_t`` (verification or PRM score), shape ``[T]``.
        weight: ``w``.
        gamma: the discount.

    Returns:
        ``F``, float64, shape ``[T]``.
    """
    T = len(sigma)
    phi_next = weight * np.asarray(sigma, dtype=np.float64)  # Phi_{t+1}
    phi_next[T - 1:] = 0.0  # the state after the last step is terminal
    phi = np.concatenate([[0.0], phi_next[:-1]])  # Phi_t
    return gamma * phi_next - phi


def discounted_returns(rewards: np.ndarray, *, gamma: float) -> np.ndarray:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` (``G_T = 0``)."""
    G = np.zeros(len(rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        G[t] = running
    return G


def gae_advantages(rewards: np.ndarray, *, gamma: float, lam: float) -> np.ndarray:
    """GAE with a zero value baseline: ``A_t = sum_l (gamma*lam)^l r_{t+l}``."""
    return discounted_returns(rewards, gamma=gamma * lam)


def grpo_advantage(R: np.ndarray | float, *, mean: np.ndarray | float, std: np.ndarray | float,
                   eps: float) -> np.ndarray | float:
    """GRPO's outcome advantage ``A_i = (R_i - mean(R_group)) / (std(R_group) + eps)``.

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300 §4.1.2 (outcome
    supervision); ``std`` is the population std of the group's returns.
    """
    return (R - mean) / (std + eps)


def dr_grpo_advantage(R: np.ndarray | float, *, mean: np.ndarray | float) -> np.ndarray | float:
    """Dr. GRPO's outcome advantage ``A_i = R_i - mean(R_group)`` (no std normalization).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective", arXiv:2503.20783 §3.2: dividing by the group's std weights
    questions by their difficulty (too easy or too hard ones get larger
    updates); the mean alone removes the baseline without that bias.
    """
    return R - mean


def load_prm(path: str) -> Callable[..., Any]:
    """Import the process-reward model named ``module:function``.

    Raises:
        RecipeError: the path is malformed or does not import.
    """
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise RecipeError(f"`prm` must be 'module:function', got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"cannot import process-reward model {path!r}: {err}") from err
