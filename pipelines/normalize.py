"""NormalizeByDomain: per-domain and per-task-group statistics, normalized advantages.

Statistics are count/mean/M2 triples (Welford), merged with Chan et al.'s
parallel formula (https://en.wikipedia.org/wiki/Algorithms_for_calculating_variance#Parallel_algorithm)::

    n = n_a + n_b,  d = mean_b - mean_a
    mean = mean_a + d * n_b / n
    M2 = M2_a + M2_b + d^2 * n_a * n_b / n,   std = sqrt(M2 / n)  (population)

Three families, all persisted across micro-batches in
``<out>/_state/norm-<recipe hash>.json`` (merged and saved at commit):

* ``advantage/<domain>``: the per-step advantages ``A_t`` of the domain;
  ``normalization: domain`` gives ``adv_norm_t = (A_t - mean_d) / (std_d + eps)``.
* ``return/<domain>``: episode returns ``G_0``; ``normalized_return``.
* ``group/<task_group>``: episode returns of a GRPO group;
  ``group_advantage = (G_0 - mean_g) / (std_g + eps)`` (arXiv:2402.03300 §4.1.2),
  and ``normalization: group`` uses it as every step's ``adv_norm_t``.

Within a run the statistics come from a ``CombinePerKey`` (of episodes,
:class:`ComputeNormStats`; in the trajectory job, of the partial statistics
of each staged row part, :func:`stats_of_tables`), merged with the persisted
ones of earlier runs, so every episode of one run is normalized with the same
numbers; over a single run from empty state the domain-normalized advantages
have mean 0 and std ``std/(std+eps)`` ≈ 1. :class:`NormalizeByDomain` applies
them to episodes (a side input); the trajectory job applies them to the
dataset rows in its shard writer instead (:func:`normalize_tables`, same
formulas, vectorized), which spares a pass that would re-encode every episode.

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

from pipelines.recipes import Recipe
from pipelines.types import METRICS_NAMESPACE, Episode

__all__ = [
    "RunningStats",
    "NormState",
    "StatsCombineFn",
    "NormalizeByDomain",
    "normalize_episode",
    "stats_of_episodes",
    "stats_of_tables",
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
        stats: ``<family>/<key>`` → statistics, families ``advantage``,
            ``return`` (per domain) and ``group`` (per task group).
    """

    recipe_hash: str
    stats: dict[str, RunningStats] = {}

    def merged(self, run: Mapping[str, RunningStats]) -> "NormState":
        """A new state with ``run``'s statistics merged in."""
        out = dict(self.stats)
        for k, s in run.items():
            out[k] = out.get(k, RunningStats()).merge(s)
        return NormState(recipe_hash=self.recipe_hash, stats=out)


def load_norm_state(path: Path, recipe_hash: str) -> NormState:
    """The persisted state at ``path``, or an empty one."""
    if not path.exists():
        return NormState(recipe_hash=recipe_hash)
    return msgspec.json.decode(path.read_bytes(), type=NormState)


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
    yield f"advantage/{episode.domain}", episode.advantages
    ret = np.array([episode.episode_return])
    yield f"return/{episode.domain}", ret
    yield f"group/{episode.task_group}", ret


def normalize_episode(episode: Episode, stats: Mapping[str, RunningStats], *, mode: str, eps: float) -> Episode:
    """A copy with ``normalized_advantages``, ``group_advantage`` and ``normalized_return`` set."""
    adv = stats.get(f"advantage/{episode.domain}", RunningStats())
    ret = stats.get(f"return/{episode.domain}", RunningStats())
    grp = stats.get(f"group/{episode.task_group}", RunningStats())
    R = episode.episode_return
    group_adv = (R - grp.mean) / (grp.std + eps)
    if mode == "domain":
        adv_norm = (episode.advantages - adv.mean) / (adv.std + eps)
    elif mode == "group":
        adv_norm = np.full(len(episode.advantages), group_adv)
    else:
        adv_norm = episode.advantages.copy()
    return msgspec.structs.replace(
        episode, normalized_advantages=adv_norm, group_advantage=float(group_adv),
        normalized_return=float((R - ret.mean) / (ret.std + eps)),
    )


def stats_of_episodes(episodes: Iterable[Episode]) -> dict[str, RunningStats]:
    """The statistics of a set of episodes (what ``NormalizeByDomain``'s ``CombinePerKey`` computes)."""
    values: dict[str, list[np.ndarray]] = {}
    for episode in episodes:
        for key, v in _stat_inputs(episode):
            values.setdefault(key, []).append(np.asarray(v, dtype=np.float64))
    return {k: RunningStats.of(np.concatenate(vs)) for k, vs in sorted(values.items())}


def stats_of_tables(trajs: pa.Table, steps: pa.Table, *, domain: str) -> dict[str, RunningStats]:
    """:func:`stats_of_episodes` of complete trajectories given as dataset tables of one domain (vectorized).

    Examples:
        >>> t = pa.table({"task_group": ["g", "g", "h"], "episode_return": [1.0, 0.0, 2.0]})
        >>> s = pa.table({"advantage": [1.0, 0.0, 1.0, 2.0]})
        >>> st = stats_of_tables(t, s, domain="d")
        >>> sorted(st), st["group/g"], st["return/d"].n
        (['advantage/d', 'group/g', 'group/h', 'return/d'], RunningStats(n=2, mean=0.5, m2=0.5), 3)
    """
    out = {f"advantage/{domain}": RunningStats.of(steps["advantage"].to_numpy()),
           f"return/{domain}": RunningStats.of(trajs["episode_return"].to_numpy())}
    groups = trajs.group_by("task_group").aggregate([
        ("episode_return", "count"), ("episode_return", "mean"),
        ("episode_return", "variance", pc.VarianceOptions(ddof=0)),
    ])
    for g, n, mean, var in zip(*(groups[c].to_pylist() for c in (
            "task_group", "episode_return_count", "episode_return_mean", "episode_return_variance"))):
        out[f"group/{g}"] = RunningStats(n=n, mean=mean, m2=var * n)
    return out


def _lookup(stats: Mapping[str, RunningStats], family: str,
            keys: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the mean and std of ``stats[f"{family}/{key}"]`` (0, 0 where absent)."""
    uniq = pc.unique(keys)
    found = [stats.get(f"{family}/{k}", RunningStats()) for k in uniq.to_pylist()]
    means = np.array([s.mean for s in found], dtype=np.float64)
    stds = np.array([s.std for s in found], dtype=np.float64)
    idx = pc.index_in(keys, value_set=uniq).to_numpy(zero_copy_only=False)
    return means[idx], stds[idx]


def normalize_tables(trajs: pa.Table, steps: pa.Table, stats: Mapping[str, RunningStats], *, mode: str,
                     eps: float, domain: str | None = None) -> tuple[pa.Table, pa.Table]:
    """:func:`normalize_episode` on dataset tables (trajectory and step files), vectorized.

    The same formulas in float64, so the same numbers: for writers that
    normalize after the rows are built (no Episode, texts and all, has to be
    kept for it). Sets ``group_advantage``/``normalized_return`` of complete
    trajectories and ``normalized_advantage``/``group_advantage`` of their
    steps; incomplete trajectories keep theirs (0). ``domain`` stands in for
    the ``domain`` column of files that have it as a hive partition key.

    Examples:
        >>> t = pa.table({"episode_id": ["a", "b"], "domain": ["d", "d"], "task_group": ["g", "g"],
        ...               "complete": [True, True], "episode_return": [1.0, 0.0],
        ...               "group_advantage": [0.0, 0.0], "normalized_return": [0.0, 0.0]})
        >>> s = pa.table({"episode_id": ["a", "b"], "domain": ["d", "d"], "advantage": [1.0, 0.0],
        ...               "normalized_advantage": [0.0, 0.0], "group_advantage": [0.0, 0.0]})
        >>> st = {"advantage/d": RunningStats.of([1.0, 0.0]), "return/d": RunningStats.of([1.0, 0.0]),
        ...       "group/g": RunningStats.of([1.0, 0.0])}
        >>> t2, s2 = normalize_tables(t, s, st, mode="domain", eps=0.0)
        >>> s2["normalized_advantage"].to_pylist(), t2["group_advantage"].to_pylist()
        ([1.0, -1.0], [1.0, -1.0])
    """
    complete = trajs["complete"].to_numpy(zero_copy_only=False).astype(bool)
    R = trajs["episode_return"].to_numpy(zero_copy_only=False).astype(np.float64)
    g_mean, g_std = _lookup(stats, "group", trajs["task_group"])
    r_mean, r_std = _lookup(stats, "return", _column(trajs, "domain", domain))
    group_adv = np.where(complete, (R - g_mean) / (g_std + eps),
                         trajs["group_advantage"].to_numpy(zero_copy_only=False))
    norm_ret = np.where(complete, (R - r_mean) / (r_std + eps),
                        trajs["normalized_return"].to_numpy(zero_copy_only=False))
    trajs = _set(trajs, "group_advantage", group_adv)
    trajs = _set(trajs, "normalized_return", norm_ret)
    if steps.num_rows == 0:
        return trajs, steps
    # Steps of incomplete trajectories are never written; every step has its (complete) trajectory.
    of_traj = pc.index_in(steps["episode_id"], value_set=trajs["episode_id"]).to_numpy(zero_copy_only=False)
    A = steps["advantage"].to_numpy(zero_copy_only=False).astype(np.float64)
    step_group_adv = group_adv[of_traj]
    if mode == "domain":
        a_mean, a_std = _lookup(stats, "advantage", _column(steps, "domain", domain))
        adv_norm = (A - a_mean) / (a_std + eps)
    elif mode == "group":
        adv_norm = step_group_adv
    else:
        adv_norm = A
    steps = _set(steps, "normalized_advantage", adv_norm)
    steps = _set(steps, "group_advantage", step_group_adv)
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

    def process(self, episode: Episode, run_stats: Mapping[str, RunningStats]) -> Iterator[Episode]:
        # Merge only the three keys this episode needs (prior ⊕ this run).
        keys = (f"advantage/{episode.domain}", f"return/{episode.domain}", f"group/{episode.task_group}")
        stats = {k: self._prior.get(k, RunningStats()).merge(run_stats.get(k, RunningStats())) for k in keys}
        self._n.inc()
        yield normalize_episode(episode, stats, mode=self._mode, eps=self._eps)


def merge_stats(stats: Iterable[RunningStats]) -> RunningStats:
    """Merge any number of statistics (a ``CombinePerKey`` callable: associative, takes its own output)."""
    out = RunningStats()
    for st in stats:
        out = out.merge(st)
    return out


class ComputeNormStats(beam.PTransform):
    """Episodes → ``(key, RunningStats)`` of this run (families ``advantage``, ``return``, ``group``).

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
    """Normalize advantages with per-domain / per-group statistics (prior runs ⊕ this run).

    Args:
        recipe: gives ``normalization`` (``domain``, ``group``, ``none``) and ``eps``.
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
        run_stats = episodes | "ComputeNormStats" >> ComputeNormStats()
        normalized = episodes | "Normalize" >> beam.ParDo(
            _NormalizeFn(self._prior, self._recipe.normalization, self._recipe.eps),
            run_stats=beam.pvalue.AsDict(run_stats),
        ).with_output_types(Episode)
        return {"episodes": normalized, STATS_TAG: run_stats}

