"""verify → process rewards → clip: the chain every assembled episode goes through, in both jobs."""

from __future__ import annotations

import apache_beam as beam

from pipelines.clip import ClipTrajectories
from pipelines.counts import COUNTS_TAG
from pipelines.recipes import Recipe
from pipelines.rewards import ComputeProcessRewards
from pipelines.verify import VerifySteps

__all__ = ["ProcessEpisodes"]


class ProcessEpisodes(beam.PTransform):
    """verify → process rewards → clip: what happens to every assembled episode, in both modes.

    With ``with_counts``, returns ``{"episodes": ..., "counts": ...}`` (the rewards step's count dicts,
    pipelines/counts.py) instead of the episodes alone.
    """

    def __init__(self, recipe: Recipe, *, use_domain_verifiers: bool = True, with_counts: bool = False) -> None:
        super().__init__()
        self._recipe, self._use_domain, self._with_counts = recipe, use_domain_verifiers, with_counts

    def expand(self, episodes):
        recipe = self._recipe
        rewarded = (
            episodes
            | "VerifySteps" >> VerifySteps(use_domain_verifiers=self._use_domain)
            | "ComputeProcessRewards" >> ComputeProcessRewards(recipe, with_counts=True)
        )
        clipped = (
            rewarded.episodes
            | "ClipTrajectories" >> ClipTrajectories(
                max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens, gamma=recipe.gamma,
                lam=recipe.lam, reward_min=recipe.reward_min, reward_max=recipe.reward_max)
        )
        return {"episodes": clipped, COUNTS_TAG: rewarded[COUNTS_TAG]} if self._with_counts else clipped
