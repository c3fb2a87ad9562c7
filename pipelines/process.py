"""verify → process rewards → clip: the chain every assembled episode goes through, in both jobs."""

from __future__ import annotations

import apache_beam as beam

from pipelines.clip import ClipTrajectories
from pipelines.counts import COUNTS_TAG
from pipelines.forked import ChainStage
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

    def _transforms(self) -> tuple[VerifySteps, ComputeProcessRewards, ClipTrajectories]:
        recipe = self._recipe
        return (VerifySteps(use_domain_verifiers=self._use_domain), ComputeProcessRewards(recipe, with_counts=True),
                ClipTrajectories(max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens,
                                 gamma=recipe.gamma, lam=recipe.lam, reward_min=recipe.reward_min,
                                 reward_max=recipe.reward_max))

    def stages(self) -> list[ChainStage]:
        """verify → rewards → clip as stages of a :class:`pipelines.forked.ForkedChain` (``rewards`` has ``counts``)."""
        return [t.stage() for t in self._transforms()]

    def expand(self, episodes):
        verify, rewards, clip = self._transforms()
        rewarded = episodes | "VerifySteps" >> verify | "ComputeProcessRewards" >> rewards
        clipped = rewarded.episodes | "ClipTrajectories" >> clip
        return {"episodes": clipped, COUNTS_TAG: rewarded[COUNTS_TAG]} if self._with_counts else clipped
