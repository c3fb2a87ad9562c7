"""ComputeProcessRewards: per-step reward, return-to-go and advantage under a recipe.

The formulas are in :mod:`pipelines.recipes`; this module applies them to
:class:`~pipelines.types.Episode` s.

Examples:
    >>> from schemas.datasets import Verification
    >>> v = [Verification(verifier="a", passed=True, score=1.0), Verification(verifier="b", passed=False, score=0.0)]
    >>> step_scores([v, []], {"b": 3.0}).tolist()  # (1*1 + 3*0) / (1 + 3) = 0.25; no verdicts -> 0
    [0.25, 0.0]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import apache_beam as beam
import msgspec
import numpy as np
from apache_beam.metrics import Metrics

from pipelines.recipes import Recipe, discounted_returns, gae_advantages, load_prm, step_rewards
from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.datasets import Verification

__all__ = ["ComputeProcessRewards", "step_scores", "annotate_rewards"]


def step_scores(verdicts: list[list[Verification]], weights: Mapping[str, float]) -> np.ndarray:
    """``s_t``: weighted mean score of each step's verdicts (weight 1 unless named; 0 if none)."""
    out = np.zeros(len(verdicts), dtype=np.float64)
    for t, vs in enumerate(verdicts):  # a handful of verdicts per step: plain Python beats numpy here
        w = [weights.get(v.verifier, 1.0) for v in vs] if weights else [1.0] * len(vs)
        total = sum(w)
        if total > 0:
            out[t] = sum(wi * v.score for wi, v in zip(w, vs)) / total
    return out


def annotate_rewards(episode: Episode, recipe: Recipe, prm=None) -> Episode:
    """A copy of ``episode`` with ``rewards``, ``returns`` and ``advantages`` set (see pipelines.recipes)."""
    outcome = episode.finished.outcome_reward if episode.finished is not None else 0.0
    scores = step_scores(episode.verdicts, recipe.verifier_weights)
    prm_scores = np.asarray(prm(episode), dtype=np.float64) if prm is not None else None
    r = step_rewards(recipe, outcome=outcome, step_scores=scores, prm_scores=prm_scores)
    G = discounted_returns(r, gamma=recipe.gamma)
    A = gae_advantages(r, gamma=recipe.gamma, lam=recipe.lam)
    masks = [np.ones(len(s.action_token_ids), dtype=bool) for s in episode.steps]
    return msgspec.structs.replace(episode, rewards=r, returns=G, advantages=A, loss_masks=masks)


class _RewardFn(beam.DoFn):
    def __init__(self, recipe: Recipe) -> None:
        self._recipe = recipe
        self._prm = None
        self._steps = Metrics.counter(METRICS_NAMESPACE, "steps_rewarded")

    def setup(self) -> None:
        if self._recipe.reward == "prm":
            self._prm = load_prm(self._recipe.prm)

    def process(self, episode: Episode) -> Iterator[Episode]:
        self._steps.inc(len(episode.steps))
        yield annotate_rewards(episode, self._recipe, self._prm)


class ComputeProcessRewards(beam.PTransform):
    """Annotate each complete episode with per-step ``r_t``, ``G_t`` and ``A_t`` of ``recipe``.

    ``r_t`` per the recipe's ``reward`` kind, ``G_t = r_t + gamma G_{t+1}``,
    ``A_t`` = GAE(gamma, lambda) with a zero value baseline (the baseline is
    removed by NormalizeByDomain). Formulas and sources: :mod:`pipelines.recipes`.
    A ``prm`` recipe imports its model once per worker (``DoFn.setup``).
    """

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self._recipe = recipe

    def expand(self, episodes):
        return episodes | "Rewards" >> beam.ParDo(_RewardFn(self._recipe)).with_output_types(Episode)
