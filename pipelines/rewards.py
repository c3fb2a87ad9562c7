"""ComputeProcessRewards: per-step reward, return-to-go and advantage under a recipe.

The formulas are in :mod:`pipelines.recipes`; this module applies them to
:class:`~pipelines.types.Episode` s. Only trainable (judged) episodes get
credit: the rewards, returns and advantages of a ``timeout``/``error``/``aborted``
or step-less episode are 0 (its outcome of 0 is no verdict, so no return is
computed from it); it is counted in ``pipeline/episodes_excluded``.

Examples:
    >>> from schemas.datasets import Verification
    >>> v = [Verification(verifier="a", passed=True, score=1.0), Verification(verifier="b", passed=False, score=0.0),
    ...      Verification(verifier="pipeline.token_consistency", passed=True, score=1.0, counted=False)]
    >>> step_scores([v, []], {"b": 3.0}).tolist()  # counted only: (1*1 + 3*0) / (1 + 3) = 0.25; none -> 0
    [0.25, 0.0]
    >>> step_passed(v), step_passed(v[2:])  # b failed; no counted verdict is no pass
    (False, False)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import apache_beam as beam
import msgspec
import numpy as np

from pipelines.counts import COUNTS_TAG, BundleCounts
from pipelines.feedback import feedback_outcome, step_feedback_terms
from pipelines.forked import ChainStage
from pipelines.recipes import Recipe, discounted_returns, gae_advantages, load_prm, step_rewards
from pipelines.types import Episode
from schemas.datasets import Verification

__all__ = ["ComputeProcessRewards", "step_scores", "verification_score", "step_passed", "annotate_rewards"]


def verification_score(verdicts: list[Verification], weights: Mapping[str, float]) -> float:
    """``s_t`` of one step: weighted mean score of its *counted* verdicts (weight 1 unless named; 0 if none)."""
    total = num = 0.0
    for v in verdicts:  # a handful of verdicts per step: plain Python beats numpy here
        if v.counted:
            w = weights.get(v.verifier, 1.0) if weights else 1.0
            total += w
            num += w * v.score
    return num / total if total > 0 else 0.0


def step_scores(verdicts: list[list[Verification]], weights: Mapping[str, float]) -> np.ndarray:
    """``s_t`` of every step (:func:`verification_score`), float64, shape ``[T]``."""
    return np.array([verification_score(vs, weights) for vs in verdicts], dtype=np.float64)


def step_passed(verdicts: list[Verification]) -> bool:
    """A step passed: it has counted verdicts and all of them passed."""
    counted = [v.passed for v in verdicts if v.counted]
    return bool(counted) and all(counted)


#: A read-only row of True that step loss masks are copied from (a slice copy costs a quarter of ``np.ones``).
_TRUE = np.ones(1 << 16, dtype=bool)
_TRUE.flags.writeable = False


def _all_true(n: int) -> np.ndarray:
    """``np.ones(n, dtype=bool)``: a new, writeable array."""
    return _TRUE[:n].copy() if n <= len(_TRUE) else np.ones(n, dtype=bool)


def annotate_rewards(episode: Episode, recipe: Recipe, prm=None) -> Episode:
    """A copy of ``episode`` with ``rewards``, ``returns`` and ``advantages`` set (see pipelines.recipes).

    An episode that is not trainable gets zeros (no verdict, no credit). Ratings of the feedback attached
    to it enter per the recipe's ``feedback`` (:mod:`pipelines.recipes`, "Feedback").
    """
    T = len(episode.steps)
    masks = [_all_true(len(s.action_token_ids)) for s in episode.steps]
    if not episode.trainable:
        zeros = np.zeros(T, dtype=np.float64)
        return msgspec.structs.replace(episode, rewards=zeros, returns=zeros.copy(), advantages=zeros.copy(),
                                       loss_masks=masks)
    # Feedback attached to the episode (pipelines/feedback.py) per the recipe's `feedback` precedence.
    outcome = feedback_outcome(recipe, episode.finished.outcome_reward, episode.feedback)
    fb_terms = step_feedback_terms(recipe, episode.feedback, [s.step_index for s in episode.steps])
    scores = step_scores(episode.verdicts, recipe.verifier_weights)
    prm_scores = np.asarray(prm(episode), dtype=np.float64) if prm is not None else None
    r = step_rewards(recipe, outcome=outcome, step_scores=scores, prm_scores=prm_scores, step_feedback=fb_terms)
    G = discounted_returns(r, gamma=recipe.gamma)
    A = gae_advantages(r, gamma=recipe.gamma, lam=recipe.lam)
    return msgspec.structs.replace(episode, rewards=r, returns=G, advantages=A, loss_masks=masks)


class _RewardFn(beam.DoFn):
    def __init__(self, recipe: Recipe) -> None:
        self._recipe = recipe
        self._prm = None
        self._c = BundleCounts(("steps_rewarded", "episodes_excluded"))
        self._steps, self._excluded = self._c["steps_rewarded"], self._c["episodes_excluded"]

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._c.output()  # the counts as data (pipelines/counts.py)

    def setup(self) -> None:
        if self._recipe.reward == "prm":
            self._prm = load_prm(self._recipe.prm)

    def process(self, episode: Episode) -> Iterator[Episode]:
        self._steps.inc(len(episode.steps))
        if not episode.trainable:
            self._excluded.inc()
        yield annotate_rewards(episode, self._recipe, self._prm if episode.trainable else None)


class ComputeProcessRewards(beam.PTransform):
    """Annotate each complete episode with per-step ``r_t``, ``G_t`` and ``A_t`` of ``recipe``.

    ``r_t`` per the recipe's ``reward`` kind, ``G_t = r_t + gamma G_{t+1}``,
    ``A_t`` = GAE(gamma, lambda) with a zero value baseline (the baseline is
    removed by normalization). Formulas and sources: :mod:`pipelines.recipes`.
    Episodes that are not trainable get zeros and are counted in
    ``pipeline/episodes_excluded``. A ``prm`` recipe imports its model once
    per worker (``DoFn.setup``). With ``with_counts``, the result is a
    ``DoOutputsTuple`` (``episodes``, and ``counts``: :mod:`pipelines.counts`).
    """

    def __init__(self, recipe: Recipe, *, with_counts: bool = False) -> None:
        super().__init__()
        self._recipe, self._with_counts = recipe, with_counts

    def stage(self, name: str = "rewards") -> ChainStage:
        """This transform as a stage of a :class:`pipelines.forked.ForkedChain` (tagged output ``counts``)."""
        return ChainStage(name, _RewardFn(self._recipe), (COUNTS_TAG,))

    def expand(self, episodes):
        out = episodes | "Rewards" >> beam.ParDo(self.stage().fn).with_output_types(Episode).with_outputs(
            COUNTS_TAG, main="episodes")
        return out if self._with_counts else out.episodes
