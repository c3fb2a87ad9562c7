"""NormalizeByDomain: per-domain statistics and per-group advantages, normalized advantages.

Statistics are count/mean/M2 triples (Welford), merged with Chan et al.'s
parallel formula (https://en.wikipedia.org/wiki/Algorithms_for_calculating_variance#Parallel_algorithm)::

    n = n_a + n_b,  d = mean_b - mean_a
    mean = mean_a + d * n_b / n
    M2 = M2_a + M2_b + d^2 * n_a * n_b / n,   std = sqrt(M2 / n)  (population)

Only **trainable** episodes (judged, :attr:`pipelines.types.Episode.trainable`)
enter any statistics; the others get 0 for every normalized value.

Two families are persisted across micro-batches in
``<out>/_state/norm-<recipe hash>.json`` (merged and saved at commit):

* ``advantage/<domain>``: the per-step advantages ``A_t`` of the domain;
  ``normalization: domain`` gives ``adv_norm_t = (A_t - mean_d) / (std_d + eps)``.
* ``return/<domain>``: episode returns ``G_0``; ``normalized_return``.

Group statistics are per GRPO group and never persisted nor merged across
groups (:mod:`pipelines.groups`): over the trainable members of the
episode's whole group, ``group_advantage`` is GRPO's
``(G_0 - mean_g) / (std_g + eps)`` (arXiv:2402.03300 §4.1.2;
:func:`pipelines.recipes.grpo_advantage`), or Dr. GRPO's ``G_0 - mean_g``
with ``normalization: group_mean`` (arXiv:2503.20783 §3.2;
:func:`pipelines.recipes.dr_grpo_advantage`); both group modes use it as
every step's ``adv_norm_t``.

In the trajectory job the writer computes the run's statistics from its
staged rows (:func:`pipelines.groups.group_stats_of_tables`, per group; the
domain families are the merge over the groups released,
:func:`pipelines.groups.domain_stats`), merges them with the persisted ones,
so every episode of one run is normalized with the same numbers, and
applies them to the dataset rows in its shard writer
(:func:`normalize_tables`, vectorized), which spares a pass that would
re-encode every episode; over a single run from empty state the
domain-normalized advantages of trainable steps have mean 0 and std
``std/(std+eps)`` ≈ 1. :class:`NormalizeByDomain` applies the same formulas
to episodes (a side input; every group taken as whole).

Examples:
    >>> a, b = RunningStats.of([1.0, 2.0]), RunningStats.of([3.0, 4.0, 5.0])
    >>> m = a.merge(b); (m.n, m.mean, round(m.m2, 9))  # values 1..5: mean 3, M2 = 4+1+0+1+4 = 10
    (5, 3.0, 10.0)
    >>> round(m.std, 6)  # sqrt(10 / 5)
    1.414214
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.metrics import Metrics

from pipelines.recipes import Recipe, dr_grpo_advantage, grpo_advantage
from pipelines.types import METRICS_NAMESPACE, Episode

__all__ = [
    "RunningStats",
    "NormState",
    "StatsCombineFn",
    "NormalizeByDomain",
    "normalize_episode",
    "stats_of_episodes",
    "merge_stats",
    "normalize_tables",
    "ComputeNormStats",
    "load_norm_state",
    "STATS_TAG",
]

STATS_TAG = "stats"


class RunningStats(msgspec.Struct, frozen=True, array_like=True):
    """Count, mean and sum of squared deviations (M2) of a stream of numbers.

    Attributes:
        n: number of values.
        mean: their mean.
        m2: sum of squared deviations from the mean.
    """

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray) -> "RunningStats":
        """Statistics of a batch of values (two-pass, exact)."""
        x = np.asarray(values, dtype=np.float64)
        if not len(x):
            return cls()
        if len(x) <= 16:  # one episode's values: numpy's call overhead dominates
            xs = x.tolist()
            mean = math.fsum(xs) / len(xs)
            return cls(n=len(xs), mean=mean, m2=math.fsum((v - mean) ** 2 for v in xs))
        mean = float(x.mean())
        return cls(n=len(x), mean=mean, m2=float(((x - mean) ** 2).sum()))

    def merge(self, other: "RunningStats") -> "RunningStats":
        """Chan's parallel merge (see the module docstring)."""
        if other.n == 0:
            return self
        if self.n == 0:
            return other
        n = self.n + other.n
        d = other.mean - self.mean
        return RunningStats(n=n, mean=self.mean + d * other.n / n, m2=self.m2 + other.m2 + d * d * self.n * other.n / n)

    @property
    def std(self) -> float:
        """Population standard deviation (0 for fewer than 2 values)."""
        return math.sqrt(self.m2 / self.n) if self.n > 1 else 0.0


class NormState(msgspec.Struct, kw_only=True):
    """Persisted statistics of one dataset version (``_state/norm-<hash>.json``).

    Attributes:
        recipe_hash: the recipe's content hash.
        stats: ``<family>/<domain>`` → statistics, families ``advantage`` and
            ``return`` (earlier versions also kept a ``group`` family: ignored).
    """

    recipe_hash: str
    stats: dict[str, RunningStats] = {}

    def merged(self, run: Mapping[str, RunningStats]) -> "NormState":
        """A new state with ``run``'s statistics merged in."""
        out = dict(self.stats)
        for k, s in run.items():
            out[k] = out.get(k, RunningStats()).merge(s)
        return NormState(recipe_hash=self.recipe_hash, stats=out)


def load_norm_state(path: str | Path, recipe_hash: str) -> NormState:
    """The persisted state at ``path`` (a location: :mod:`schemas.locations`), or an empty one."""
    from schemas import locations as loc

    if not loc.exists(path):
        return NormState(recipe_hash=recipe_hash)
    return msgspec.json.decode(loc.read_bytes(path), type=NormState)


class StatsCombineFn(beam.CombineFn):
    """Combine batches of values (numpy arrays) into one :class:`RunningStats`."""

    def create_accumulator(self) -> RunningStats:
        return RunningStats()

    def add_input(self, acc: RunningStats, values: np.ndarray) -> RunningStats:
        return acc.merge(RunningStats.of(values))

    def merge_accumulators(self, accs: Iterable[RunningStats]) -> RunningStats:
        out = RunningStats()
        for a in accs:
            out = out.merge(a)
        return out

    def extract_output(self, acc: RunningStats) -> RunningStats:
        return acc


def _stat_inputs(episode: Episode) -> Iterator[tuple[str, np.ndarray]]:
    if not episode.trainable:
        return
    yield f"advantage/{episode.domain}", episode.advantages
    yield f"return/{episode.domain}", np.array([episode.episode_return])


def _group_advantage(R, mean, std, *, mode: str, eps: float):
    """The recipe's group advantage: Dr. GRPO's for ``group_mean``, GRPO's otherwise."""
    if mode == "group_mean":
        return dr_grpo_advantage(R, mean=mean)
    return grpo_advantage(R, mean=mean, std=std, eps=eps)


def normalize_episode(episode: Episode, stats: Mapping[str, RunningStats], group: Any | None, *, mode: str,
                      eps: float) -> Episode:
    """A copy with ``normalized_advantages``, ``group_advantage``, ``normalized_return`` and group fields set.

    Args:
        episode: a complete, rewarded episode.
        stats: domain statistics (``advantage/<domain>``, ``return/<domain>``).
        group: the episode's released group (:class:`pipelines.groups.ReleasedGroup`), or None.
        mode: the recipe's ``normalization``.
        eps: added to the standard deviations.
    """
    g_stats = group.stats.returns if group is not None else RunningStats()
    members = {"group_members": g_stats.n, "group_timed_out": bool(group is not None and group.timed_out)}
    if not episode.trainable:
        return msgspec.structs.replace(episode, normalized_advantages=np.zeros(len(episode.steps)),
                                       group_advantage=0.0, normalized_return=0.0, **members)
    adv = stats.get(f"advantage/{episode.domain}", RunningStats())
    ret = stats.get(f"return/{episode.domain}", RunningStats())
    R = episode.episode_return
    group_adv = _group_advantage(R, g_stats.mean, g_stats.std, mode=mode, eps=eps)
    if mode == "domain":
        adv_norm = (episode.advantages - adv.mean) / (adv.std + eps)
    elif mode in ("group", "group_mean"):
        adv_norm = np.full(len(episode.advantages), group_adv)
    else:
        adv_norm = episode.advantages.copy()
    return msgspec.structs.replace(
        episode, normalized_advantages=adv_norm, group_advantage=float(group_adv),
        normalized_return=float((R - ret.mean) / (ret.std + eps)), **members,
    )


def stats_of_episodes(episodes: Iterable[Episode]) -> dict[str, RunningStats]:
    """The domain statistics of a set of episodes, trainable ones only (what ``ComputeNormStats`` computes)."""
    values: dict[str, list[np.ndarray]] = {}
    for episode in episodes:
        for key, v in _stat_inputs(episode):
            values.setdefault(key, []).append(np.asarray(v, dtype=np.float64))
    return {k: RunningStats.of(np.concatenate(vs)) for k, vs in sorted(values.items())}


def _lookup(table: Mapping[str, Any], keys: pa.ChunkedArray | pa.Array, default: Any,
            fields: tuple[str, ...]) -> list[np.ndarray]:
    """Per row, ``fields`` of ``table[key]`` (``default``'s where absent), one array per field."""
    uniq = pc.unique(keys)
    found = [table.get(k, default) for k in uniq.to_pylist()]
    idx = pc.index_in(keys, value_set=uniq).to_numpy(zero_copy_only=False)
    return [np.array([getattr(f, name) for f in found])[idx] if len(found) else np.array([]) for name in fields]


class _NoGroup(msgspec.Struct, frozen=True):
    mean: float = 0.0
    std: float = 0.0
    n: int = 0
    timed_out: bool = False


def normalize_tables(trajs: pa.Table, steps: pa.Table, stats: Mapping[str, RunningStats],
                     groups: Mapping[tuple[str, str, int], Any], *, mode: str, eps: float,
                     domain: str | None = None) -> tuple[pa.Table, pa.Table]:
    """:func:`normalize_episode` on dataset tables (trajectory and step files), vectorized.

    The same formulas in float64, so the same numbers: for writers that
    normalize after the rows are built (no Episode, texts and all, has to be
    kept for it). Sets ``group_advantage``/``normalized_return`` of trainable
    trajectories, ``group_members``/``group_timed_out`` of complete ones
    (from their released group, ``groups[(domain, task_group,
    policy_version)]``, a :class:`pipelines.groups.ReleasedGroup`), and
    ``normalized_advantage``/``group_advantage``/``group_size`` of their steps;
    untrainable episodes keep 0 and incomplete trajectories keep theirs.
    ``domain`` stands in for the ``domain`` column of files that have it as a
    hive partition key.

    Examples:
        >>> from pipelines.groups import GroupStats, ReleasedGroup
        >>> t = pa.table({"episode_id": ["a", "b"], "domain": ["d", "d"], "task_group": ["g", "g"],
        ...               "policy_version": [0, 0], "complete": [True, True], "trainable": [True, True],
        ...               "episode_return": [1.0, 0.0], "group_advantage": [0.0, 0.0],
        ...               "normalized_return": [0.0, 0.0], "group_members": [0, 0], "group_timed_out": [False, False]})
        >>> s = pa.table({"episode_id": ["a", "b"], "domain": ["d", "d"], "advantage": [1.0, 0.0],
        ...               "normalized_advantage": [0.0, 0.0], "group_advantage": [0.0, 0.0], "group_size": [0, 0]})
        >>> st = {"advantage/d": RunningStats.of([1.0, 0.0]), "return/d": RunningStats.of([1.0, 0.0])}
        >>> groups = {("d", "g", 0): ReleasedGroup(stats=GroupStats(size=2, members=(0, 1), episodes=2,
        ...                                                           returns=RunningStats.of([1.0, 0.0])))}
        >>> t2, s2 = normalize_tables(t, s, st, groups, mode="domain", eps=0.0)
        >>> s2["normalized_advantage"].to_pylist(), t2["group_advantage"].to_pylist(), s2["group_size"].to_pylist()
        ([1.0, -1.0], [1.0, -1.0], [2, 2])
    """
    from pipelines.groups import group_key_strings  # pipelines.groups builds on this module

    if trajs.num_rows == 0:
        return trajs, steps
    complete = trajs["complete"].to_numpy(zero_copy_only=False).astype(bool)
    trainable = complete & trajs["trainable"].to_numpy(zero_copy_only=False).astype(bool)
    R = trajs["episode_return"].to_numpy(zero_copy_only=False).astype(np.float64)
    domains = _column(trajs, "domain", domain)
    by_key = {f"{d}\x1f{tg}\x1f{pv}": _NoGroup(mean=g.stats.returns.mean, std=g.stats.returns.std,
                                                  n=g.stats.returns.n, timed_out=g.timed_out)
              for (d, tg, pv), g in groups.items()}
    keys = pc.binary_join_element_wise(domains, group_key_strings(trajs), "\x1f")
    g_mean, g_std, g_n, g_timed = _lookup(by_key, keys, _NoGroup(), ("mean", "std", "n", "timed_out"))
    returns = {k[len("return/"):]: s for k, s in stats.items() if k.startswith("return/")}
    r_mean, r_std = _lookup(returns, domains, RunningStats(), ("mean", "std"))
    group_adv = np.where(trainable, _group_advantage(R, g_mean, g_std, mode=mode, eps=eps),
                         trajs["group_advantage"].to_numpy(zero_copy_only=False))
    norm_ret = np.where(trainable, (R - r_mean) / (r_std + eps),
                        trajs["normalized_return"].to_numpy(zero_copy_only=False))
    trajs = _set(trajs, "group_advantage", group_adv)
    trajs = _set(trajs, "normalized_return", norm_ret)
    trajs = _set(trajs, "group_members", np.where(complete, g_n, trajs["group_members"].to_numpy()))
    trajs = _set(trajs, "group_timed_out", np.where(complete, g_timed, trajs["group_timed_out"].to_numpy(
        zero_copy_only=False)))
    if steps.num_rows == 0:
        return trajs, steps
    # Steps of incomplete trajectories are never written; every step has its (complete) trajectory.
    of_traj = pc.index_in(steps["episode_id"], value_set=trajs["episode_id"]).to_numpy(zero_copy_only=False)
    A = steps["advantage"].to_numpy(zero_copy_only=False).astype(np.float64)
    step_trainable = trainable[of_traj]
    step_group_adv = group_adv[of_traj]
    if mode == "domain":
        advantages = {k[len("advantage/"):]: s for k, s in stats.items() if k.startswith("advantage/")}
        a_mean, a_std = _lookup(advantages, _column(steps, "domain", domain), RunningStats(), ("mean", "std"))
        adv_norm = (A - a_mean) / (a_std + eps)
    elif mode in ("group", "group_mean"):
        adv_norm = step_group_adv
    else:
        adv_norm = A
    steps = _set(steps, "normalized_advantage", np.where(step_trainable, adv_norm, 0.0))
    steps = _set(steps, "group_advantage", step_group_adv)
    steps = _set(steps, "group_size", g_n[of_traj])
    return trajs, steps


def _column(table: pa.Table, name: str, constant: str | None) -> pa.ChunkedArray | pa.Array:
    if name in table.column_names:
        return table[name]
    if constant is None:
        raise ValueError(f"table has no `{name}` column and no constant `{name}` was given")
    return pa.array([constant] * table.num_rows, type=pa.string())


def _set(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type))


class _NormalizeFn(beam.DoFn):
    def __init__(self, prior: Mapping[str, RunningStats], mode: str, eps: float) -> None:
        self._prior = dict(prior)
        self._mode, self._eps = mode, eps
        self._n = Metrics.counter(METRICS_NAMESPACE, "episodes_normalized")

    def process(self, episode: Episode, run_stats: Mapping[str, RunningStats],
                run_groups: Mapping[tuple[str, str, int], Any]) -> Iterator[Episode]:
        from pipelines.groups import ReleasedGroup

        # Merge only the two keys this episode needs (prior ⊕ this run).
        keys = (f"advantage/{episode.domain}", f"return/{episode.domain}")
        stats = {k: self._prior.get(k, RunningStats()).merge(run_stats.get(k, RunningStats())) for k in keys}
        group = run_groups.get(episode.group_key)
        self._n.inc()
        yield normalize_episode(episode, stats, ReleasedGroup(stats=group) if group is not None else None,
                                mode=self._mode, eps=self._eps)


def merge_stats(stats: Iterable[RunningStats]) -> RunningStats:
    """Merge any number of statistics (a ``CombinePerKey`` callable: associative, takes its own output)."""
    out = RunningStats()
    for st in stats:
        out = out.merge(st)
    return out


class ComputeNormStats(beam.PTransform):
    """Episodes → ``(key, RunningStats)`` of this run (families ``advantage``, ``return``; trainable episodes).

    Only the advantages and the return of each episode go into the combine (a
    slim projection), so the episodes themselves are never re-encoded for it.
    """

    def expand(self, episodes):
        return (
            episodes
            | "StatInputs" >> beam.FlatMap(_stat_inputs)
            | "Stats" >> beam.CombinePerKey(StatsCombineFn())
        )


class NormalizeByDomain(beam.PTransform):
    """Normalize advantages with per-domain (prior runs ⊕ this run) and per-group statistics.

    The episode-level twin of the trajectory job's writer for a set of
    complete episodes: every GRPO group is taken as whole (no holding; see
    :mod:`pipelines.groups` for the writer's rule).

    Args:
        recipe: gives ``normalization`` (``domain``, ``group``, ``group_mean``, ``none``) and ``eps``.
        prior: persisted statistics of earlier micro-batches (``NormState.stats``).

    Returns:
        ``{"episodes": normalized episodes, "stats": (key, RunningStats) of
        this run only}`` — the job persists ``prior ⊕ stats`` at commit.
    """

    def __init__(self, recipe: Recipe, *, prior: Mapping[str, RunningStats] | None = None) -> None:
        super().__init__()
        self._recipe = recipe
        self._prior = dict(prior or {})

    def expand(self, episodes) -> dict[str, Any]:
        from pipelines.groups import group_stats_of_episode, merge_group_stats

        run_stats = episodes | "ComputeNormStats" >> ComputeNormStats()
        run_groups = (episodes
                      | "GroupInputs" >> beam.Map(lambda e: (e.group_key, group_stats_of_episode(e)))
                      | "GroupStats" >> beam.CombinePerKey(merge_group_stats))
        normalized = episodes | "Normalize" >> beam.ParDo(
            _NormalizeFn(self._prior, self._recipe.normalization, self._recipe.eps),
            run_stats=beam.pvalue.AsDict(run_stats), run_groups=beam.pvalue.AsDict(run_groups),
        ).with_output_types(Episode)
        return {"episodes": normalized, STATS_TAG: run_stats}
