"""ClipTrajectories: cap steps and action tokens per trajectory without losing credit.

Rule (applied after rewards, before normalization), with ``K`` the step cap
and ``M`` the action-token cap (0 disables either):

1. Keep step ``k`` while ``k < K`` and the tokens of the steps before it
   are ``< M`` (the step *starts* inside the budget).
2. The kept step that crosses the budget keeps its tokens, but those past
   ``M`` get ``loss_mask = False``: the sequence stays exactly what the
   behaviour policy produced (so logprobs can be recomputed), the loss
   ignores the overflow.
3. The dropped tail's credit is folded into the last kept step ``j``,
   within the recipe's reward bounds:
   ``r'_j = clip(r_j + gamma * G_{j+1}, reward_min, reward_max)``.
4. Returns and advantages are recomputed from the rewards written
   (``G_t = r'_t + gamma G_{t+1}``, ``A_t`` = GAE(gamma, lambda) over ``r'``),
   so a reader can always recompute them from the ``reward`` column. While
   the fold stays inside the bounds, ``G_j = r_j + gamma G_{j+1}`` is the full
   episode's and so are all ``G_t`` of the kept steps: no credit is lost and
   ``G_0`` (the episode return) is unchanged. A fold the bounds cut loses
   the credit beyond them (``G_0`` moves by exactly the cut, discounted).

The episode is flagged ``clipped`` with ``steps_dropped`` / ``tokens_masked``.

Examples:
    >>> import numpy as np
    >>> keep, masked_from = plan_clip(np.array([100, 300, 50]), max_steps=0, max_action_tokens=250)
    >>> keep, masked_from  # step 1 starts at token 100 < 250: kept, its tokens from 150 on masked
    (2, 150)
"""

from __future__ import annotations

from collections.abc import Iterator

import apache_beam as beam
import msgspec
import numpy as np
from apache_beam.metrics import Metrics

from pipelines.forked import ChainStage
from pipelines.recipes import discounted_returns, gae_advantages
from pipelines.types import METRICS_NAMESPACE, Episode

__all__ = ["ClipTrajectories", "plan_clip", "clip_episode", "fold_tail"]


def plan_clip(action_tokens: np.ndarray, *, max_steps: int, max_action_tokens: int) -> tuple[int, int | None]:
    """``(steps kept, index in the last kept step from which tokens are masked or None)``."""
    T = len(action_tokens)
    keep = min(T, max_steps) if max_steps else T
    if not max_action_tokens:
        return keep, None
    before = np.concatenate([[0], np.cumsum(action_tokens)])  # tokens before step k
    keep = min(keep, int(np.sum(before[:T] < max_action_tokens))) or min(1, T)
    last = keep - 1
    over = before[last] + action_tokens[last] - max_action_tokens if keep else 0
    return keep, (int(max_action_tokens - before[last]) if over > 0 else None)


def fold_tail(rewards: np.ndarray, returns: np.ndarray, advantages: np.ndarray, *, keep: int, gamma: float,
              lam: float, reward_min: float | None, reward_max: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rules 3 and 4 for one episode: its first ``keep`` steps' ``(r', G, A)``, the dropped tail's credit folded in.

    New arrays; with nothing dropped (``keep`` = all steps) copies of the inputs. Shared by :func:`clip_episode`
    and the columnar path (:func:`pipelines.columnar.clip_segments`), so both compute the same floats.

    Examples:
        >>> r = np.array([0.0, 0.0, 1.0]); G = np.array([1.0, 1.0, 1.0])
        >>> [a.tolist() for a in fold_tail(r, G, G, keep=2, gamma=1.0, lam=1.0, reward_min=None, reward_max=None)]
        [[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    r = rewards[:keep].copy()
    G, A = returns[:keep].copy(), advantages[:keep].copy()
    if keep < len(rewards):
        r[keep - 1] += gamma * returns[keep]
        if reward_min is not None or reward_max is not None:
            r[keep - 1] = np.clip(r[keep - 1], reward_min, reward_max)
        G, A = discounted_returns(r, gamma=gamma), gae_advantages(r, gamma=gamma, lam=lam)
    return r, G, A


def clip_episode(episode: Episode, *, max_steps: int, max_action_tokens: int, gamma: float, lam: float = 1.0,
                 reward_min: float | None = None, reward_max: float | None = None) -> Episode:
    """Apply the module's rule to an episode with rewards (returns a copy; the episode itself if nothing is cut).

    Args:
        episode: an episode with ``rewards``, ``returns``, ``advantages`` and ``loss_masks``.
        max_steps: step cap (0: none).
        max_action_tokens: action-token cap (0: none).
        gamma: the recipe's discount.
        lam: the recipe's GAE lambda.
        reward_min: the recipe's lower reward bound (None: none).
        reward_max: the recipe's upper reward bound (None: none).
    """
    n_tok = np.array([len(s.action_token_ids) for s in episode.steps], dtype=np.int64)
    keep, masked_from = plan_clip(n_tok, max_steps=max_steps, max_action_tokens=max_action_tokens)
    T = len(episode.steps)
    if keep == T and masked_from is None:
        return episode
    r, G, A = fold_tail(episode.rewards, episode.returns, episode.advantages, keep=keep, gamma=gamma, lam=lam,
                        reward_min=reward_min, reward_max=reward_max)
    masks = [m.copy() for m in episode.loss_masks[:keep]]
    tokens_masked = 0
    if masked_from is not None:
        tokens_masked = int(masks[-1][masked_from:].sum())
        masks[-1][masked_from:] = False
    return msgspec.structs.replace(
        episode, steps=episode.steps[:keep], verdicts=episode.verdicts[:keep], rewards=r, returns=G, advantages=A,
        loss_masks=masks, clipped=True, steps_dropped=T - keep, tokens_masked=tokens_masked,
    )


class _ClipFn(beam.DoFn):
    def __init__(self, args: dict) -> None:
        self._args = args
        self._clipped = Metrics.counter(METRICS_NAMESPACE, "episodes_clipped")
        self._dropped = Metrics.counter(METRICS_NAMESPACE, "steps_dropped_by_clip")

    def process(self, episode: Episode) -> Iterator[Episode]:
        out = clip_episode(episode, **self._args)
        if out.clipped:
            self._clipped.inc()
            self._dropped.inc(out.steps_dropped)
        yield out


class ClipTrajectories(beam.PTransform):
    """Cap steps (``max_steps``) and action tokens (``max_action_tokens``) per trajectory.

    See the module docstring for the credit-preserving rule; 0 disables a cap.
    ``gamma``, ``lam``, ``reward_min`` and ``reward_max`` are the recipe's.
    """

    def __init__(self, *, max_steps: int = 0, max_action_tokens: int = 0, gamma: float = 1.0, lam: float = 1.0,
                 reward_min: float | None = None, reward_max: float | None = None) -> None:
        super().__init__()
        if max_steps < 0 or max_action_tokens < 0:
            raise ValueError("`max_steps` and `max_action_tokens` must be >= 0 (0 disables the cap)")
        self._args = dict(max_steps=max_steps, max_action_tokens=max_action_tokens, gamma=gamma, lam=lam,
                          reward_min=reward_min, reward_max=reward_max)

    def stage(self, name: str = "clip") -> ChainStage:
        """This transform as a stage of a :class:`pipelines.forked.ForkedChain`."""
        return ChainStage(name, _ClipFn(self._args))

    def expand(self, episodes):
        return episodes | "Clip" >> beam.ParDo(self.stage().fn).with_output_types(Episode)
