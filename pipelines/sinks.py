"""WriteDatasets: episodes → staged Parquet files of one commit (the driver commits them).

Everything a commit writes goes to ``<out>/_staging/<version>/<commit>/``
under names that do not end in ``.parquet`` (``*.parquet.tmp``), mirroring the
final layout; :mod:`pipelines.commit` makes it visible with a manifest and
renames. File names are deterministic (``c<commit>-s<shard>``) and rows are
sorted by ``(episode_id, step_index)``, so a rerun of the same input writes
the same bytes to the same names.

Examples:
    >>> final_path("steps", version="outcome-1a2b3c4d", domain="math", commit=3, shard=0)
    'steps/recipe=outcome-1a2b3c4d/domain=math/c00000003-s000.parquet'
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, List, Tuple

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics

from pipelines.normalize import NormState, RunningStats, normalize_rows
from pipelines.recipes import Recipe
from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.arrow import arrow_schema_for, events_to_table
from schemas.datasets import StepRow, TrajectoryRow, step_file_schema, trajectory_file_schema
from schemas.deadletter import DeadLetter

__all__ = [
    "WriteDatasets",
    "episode_rows",
    "rows_to_table",
    "final_path",
    "incomplete_path",
    "stage_files",
    "STAGED_SUFFIX",
    "PENDING_FILE",
    "RUN_STATS_FILE",
]

#: Suffix of staged files (so no ``*.parquet`` glob ever matches them).
STAGED_SUFFIX = ".tmp"
#: Staged pending-state file (events of unfinished episodes, archive schema, Arrow IPC).
PENDING_FILE = "pending.arrow"
#: Staged statistics of this run (``key -> [n, mean, m2]``).
RUN_STATS_FILE = "run-stats.json"

_DEAD_LETTER_SCHEMA = arrow_schema_for(DeadLetter)


def final_path(table: str, *, version: str, domain: str, commit: int, shard: int) -> str:
    """Path of a dataset file relative to ``<out>`` (hive keys ``recipe`` and ``domain``)."""
    return f"{table}/recipe={version}/domain={domain}/c{commit:08d}-s{shard:03d}.parquet"


def incomplete_path(*, version: str, domain: str, commit: int) -> str:
    """Path (relative to ``<out>``) of a commit's incomplete trajectories of one domain."""
    return f"trajectories/recipe={version}/domain={domain}/c{commit:08d}-incomplete.parquet"


def _verified(verdicts) -> bool:
    return all(v.passed for v in verdicts)


def episode_rows(episode: Episode, recipe: Recipe) -> tuple[TrajectoryRow, list[StepRow]]:
    """The dataset rows of an episode (no step rows for an incomplete one).

    An episode not normalized yet gets ``normalized_advantage``/``group_advantage``
    0 (:func:`pipelines.normalize.normalize_rows` fills them in).
    """
    version, h = recipe.version, recipe.content_hash
    norm = episode.normalized_advantages
    fin, started = episode.finished, episode.started
    status = fin.status.value if fin is not None and episode.complete else "incomplete"
    steps: list[StepRow] = []
    if episode.complete:
        last = len(episode.steps) - 1
        for t, (s, vs) in enumerate(zip(episode.steps, episode.verdicts)):
            steps.append(StepRow(
                episode_id=episode.episode_id, step_index=s.step_index, event_id=s.event_id,
                domain=episode.domain, recipe=version, recipe_hash=h, task_id=episode.task_id,
                task_group=episode.task_group, policy_version=s.policy_version, status=status,
                num_steps=len(episode.steps), observation_token_ids=s.observation_token_ids,
                action_token_ids=s.action_token_ids, behaviour_logprobs=s.behaviour_logprobs,
                loss_mask=episode.loss_masks[t], reward=float(episode.rewards[t]),
                return_to_go=float(episode.returns[t]), advantage=float(episode.advantages[t]),
                normalized_advantage=float(norm[t]) if norm is not None else 0.0,
                group_advantage=float(episode.group_advantage or 0.0), verifications=vs,
                verification_score=float(np.mean([v.score for v in vs])) if vs else 0.0,
                clipped=episode.clipped and t == last, event_time=s.event_time,
            ))
    traj = TrajectoryRow(
        episode_id=episode.episode_id, domain=episode.domain, recipe=version, recipe_hash=h,
        task_id=episode.task_id, task_group=episode.task_group, policy_version=episode.policy_version,
        difficulty=started.difficulty if started is not None else 0, status=status, complete=episode.complete,
        incomplete_reason=episode.incomplete_reason, num_events=episode.num_events,
        num_steps=len(steps), steps_dropped=episode.steps_dropped,
        action_tokens=sum(len(s.action_token_ids) for s in episode.steps) if episode.complete else 0,
        tokens_masked=episode.tokens_masked, clipped=episode.clipped,
        outcome_reward=fin.outcome_reward if fin is not None and episode.complete else 0.0,
        episode_return=episode.episode_return if episode.complete else 0.0,
        normalized_return=episode.normalized_return if episode.normalized_return is not None else 0.0,
        group_advantage=episode.group_advantage if episode.group_advantage is not None else 0.0,
        verifier_summary=fin.verifier_summary if fin is not None else "",
        steps_passed=sum(_verified(vs) for vs in episode.verdicts) if episode.complete else 0,
        first_event_time=episode.first_event_time, last_event_time=episode.last_event_time,
    )
    return traj, steps


def rows_to_table(rows: Sequence[msgspec.Struct], schema: pa.Schema) -> pa.Table:
    """Columnar build of a table from row structs (numpy-array fields via one concatenation)."""
    arrays = []
    for field in schema:
        values = [getattr(r, field.name) for r in rows]
        if pa.types.is_list(field.type) and values and isinstance(values[0], np.ndarray):
            lengths = np.fromiter((len(v) for v in values), dtype=np.int32, count=len(values))
            offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
            flat = np.concatenate(values) if len(values) else np.array([])
            child = pa.array(flat, type=field.type.value_type)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), child, type=field.type))
        elif pa.types.is_list(field.type) and pa.types.is_struct(field.type.value_type):
            arrays.append(pa.array([msgspec.to_builtins(v) for v in values], type=field.type))
        else:
            arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd")


class _ToRowsFn(beam.DoFn):
    def __init__(self, recipe: Recipe, shards: int) -> None:
        self._recipe, self._shards = recipe, shards

    def process(self, episode: Episode) -> Iterator[tuple[tuple[str, int], tuple]]:
        shard = zlib.crc32(episode.episode_id.encode()) % self._shards
        yield (episode.domain, shard), episode_rows(episode, self._recipe)


class _WriteShardFn(beam.DoFn):
    """All rows of one (domain, shard) → one steps file and one trajectories file.

    With ``prior`` set, complete trajectories are normalized here with
    ``prior ⊕ run_stats`` (:func:`pipelines.normalize.normalize_rows`).
    """

    def __init__(self, staging: str, version: str, commit: int, *, mode: str = "none", eps: float = 1e-6,
                 prior: Mapping[str, RunningStats] | None = None) -> None:
        self._staging, self._version, self._commit = staging, version, commit
        self._mode, self._eps = mode, eps
        self._prior = dict(prior) if prior is not None else None
        self._steps = Metrics.counter(METRICS_NAMESPACE, "steps_written")
        self._trajs = Metrics.counter(METRICS_NAMESPACE, "trajectories_written")
        self._normalized = Metrics.counter(METRICS_NAMESPACE, "episodes_normalized")

    def process(self, element: tuple[tuple[str, int], Iterable[tuple]],
                run_stats: Mapping[str, RunningStats] | None = None) -> Iterator[str]:
        (domain, shard), per_episode = element
        per_episode = sorted(per_episode, key=lambda tr: tr[0].episode_id)
        if self._prior is not None:
            stats = NormState(recipe_hash="", stats=self._prior).merged(run_stats or {}).stats
            per_episode = [normalize_rows(tr, ss, stats, mode=self._mode, eps=self._eps) for tr, ss in per_episode]
            self._normalized.inc(sum(tr.complete for tr, _ in per_episode))
        trajs = [tr for tr, _ in per_episode]
        steps = [s for _, ss in per_episode for s in ss]
        for table, rows, schema in (("trajectories", trajs, trajectory_file_schema()),
                                    ("steps", steps, step_file_schema())):
            if not rows:
                continue
            rel = final_path(table, version=self._version, domain=domain, commit=self._commit, shard=shard)
            _write_parquet(rows_to_table(rows, schema), Path(self._staging) / (rel + STAGED_SUFFIX))
            yield rel
        self._steps.inc(len(steps))
        self._trajs.inc(len(trajs))


def _write_incomplete(trajs: list[TrajectoryRow], staging: str, version: str, commit: int) -> Iterator[str]:
    by_domain: dict[str, list[TrajectoryRow]] = {}
    for tr in trajs:
        by_domain.setdefault(tr.domain, []).append(tr)
    for domain in sorted(by_domain):
        rows = sorted(by_domain[domain], key=lambda tr: tr.episode_id)
        rel = incomplete_path(version=version, domain=domain, commit=commit)
        _write_parquet(rows_to_table(rows, trajectory_file_schema()), Path(staging) / (rel + STAGED_SUFFIX))
        yield rel


def _write_dead_letters(letters: list[DeadLetter], staging: str, version: str, commit: int) -> Iterator[str]:
    if not letters:
        return
    letters = sorted(letters, key=lambda d: (d.source_topic, d.source_partition, d.source_offset, d.reason, d.message))
    rel = f"dead_letters/recipe={version}/c{commit:08d}.parquet"
    _write_parquet(rows_to_table(letters, _DEAD_LETTER_SCHEMA), Path(staging) / (rel + STAGED_SUFFIX))
    yield rel


def _write_pending(fragments: list[tuple[str, list]], staging: str) -> Iterator[str]:
    if not fragments:
        return
    events = [e for _, evs in sorted(fragments, key=lambda f: f[0]) for e in sorted(evs, key=lambda e: e.seq)]
    path = Path(staging) / "state" / (PENDING_FILE + STAGED_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    feather.write_feather(events_to_table(events), path, compression="uncompressed")
    yield "state/" + PENDING_FILE


def _write_stats(stats: dict[str, Any], staging: str) -> Iterator[str]:
    path = Path(staging) / "state" / (RUN_STATS_FILE + STAGED_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(dict(sorted(stats.items()))))
    yield "state/" + RUN_STATS_FILE


def stage_files(
    staging: str | Path,
    recipe: Recipe,
    *,
    commit: int,
    episodes: Sequence[Episode] = (),
    pending: Sequence[tuple[str, list]] = (),
    dead_letters: Sequence[DeadLetter] = (),
    stats: Mapping[str, RunningStats] | None = None,
    prior: Mapping[str, RunningStats] | None = None,
    shards: int = 1,
) -> list[str]:
    """Write one commit's staged files in this process: the same files :class:`WriteDatasets` writes.

    For a single writer that holds all of a commit's elements (the streaming
    job's per-window commit).

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe.
        commit: the commit number (names the files).
        episodes: complete (rewarded, clipped, not normalized) and incomplete episodes.
        pending: ``(episode_id, events)`` of open episodes.
        dead_letters: this commit's dead letters.
        stats: ``key -> RunningStats`` of this commit's complete episodes.
        prior: persisted statistics; complete episodes are normalized with ``prior ⊕ stats``.
        shards: files per (table, domain).

    Returns:
        The staged files' final relative paths.
    """
    by_shard: dict[tuple[str, int], list[tuple]] = {}
    incomplete = [episode_rows(e, recipe)[0] for e in episodes if not e.complete]
    for episode in (e for e in episodes if e.complete):
        shard = zlib.crc32(episode.episode_id.encode()) % shards
        by_shard.setdefault((episode.domain, shard), []).append(episode_rows(episode, recipe))
    writer = _WriteShardFn(str(staging), recipe.version, commit, mode=recipe.normalization, eps=recipe.eps,
                           prior=prior or {})
    files = [rel for key in sorted(by_shard) for rel in writer.process((key, by_shard[key]), dict(stats or {}))]
    files += _write_incomplete(incomplete, str(staging), recipe.version, commit)
    files += _write_dead_letters(list(dead_letters), str(staging), recipe.version, commit)
    files += _write_pending(list(pending), str(staging))
    files += _write_stats(dict(stats or {}), str(staging))
    return files


class WriteDatasets(beam.PTransform):
    """Write one commit's staged files under ``staging`` (see the module docstring).

    Input: a dict of PCollections — ``episodes`` (complete, rewarded and
    clipped), ``incomplete`` (Episodes with ``complete=False``), ``pending``
    (``(episode_id, events)``), ``dead_letters`` (DeadLetter) and ``stats``
    (``(key, RunningStats)`` of this run, :class:`pipelines.normalize.ComputeNormStats`).

    Complete episodes are normalized here, on their rows, with ``prior ⊕
    stats`` (a side input of the shard writer, which sits after a
    GroupByKey anyway): normalizing the episodes before would need the
    statistics of all of them first, i.e. one more pass that encodes and
    decodes every episode, texts and all.

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version, fills ``recipe_hash``).
        commit: the commit number (names the files).
        shards: files per (table, domain) per commit; episodes are spread by
            ``crc32(episode_id) % shards``.
        prior: persisted statistics of earlier commits (``NormState.stats``).

    Returns:
        PCollection of the staged files' final relative paths (informational).
    """

    def __init__(self, staging: str | Path, recipe: Recipe, *, commit: int, shards: int = 1,
                 prior: Mapping[str, RunningStats] | None = None) -> None:
        super().__init__()
        if shards < 1:
            raise ValueError(f"`shards` must be >= 1, got {shards}")
        self._staging, self._recipe, self._commit, self._shards = str(staging), recipe, commit, shards
        self._prior = dict(prior or {})

    def expand(self, pcolls: dict):
        staging, version, commit = self._staging, self._recipe.version, self._commit
        # Complete and incomplete episodes are written separately: a Flatten of the two would be one
        # more encode/decode pass of every row on FnApiRunner (it materializes multi-input Flattens).
        data_files = (
            pcolls["episodes"]
            | "ToRows" >> beam.ParDo(_ToRowsFn(self._recipe, self._shards)).with_output_types(
                Tuple[Tuple[str, int], Tuple[TrajectoryRow, List[StepRow]]])
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShards" >> beam.ParDo(
                _WriteShardFn(staging, version, commit, mode=self._recipe.normalization, eps=self._recipe.eps,
                              prior=self._prior),
                run_stats=beam.pvalue.AsDict(pcolls["stats"]))
        )
        recipe = self._recipe
        incomplete_files = (
            pcolls["incomplete"]
            | "IncompleteRows" >> beam.Map(lambda e: episode_rows(e, recipe)[0]).with_output_types(TrajectoryRow)
            | "CollectIncomplete" >> beam.combiners.ToList()
            | "WriteIncomplete" >> beam.FlatMap(_write_incomplete, staging, version, commit)
        )
        dead_files = (
            pcolls["dead_letters"]
            | "CollectDeadLetters" >> beam.combiners.ToList()
            | "WriteDeadLetters" >> beam.FlatMap(_write_dead_letters, staging, version, commit)
        )
        pending_files = (
            pcolls["pending"]
            | "CollectPending" >> beam.combiners.ToList()
            | "WritePending" >> beam.FlatMap(_write_pending, staging)
        )
        stats_files = (
            pcolls["stats"]
            | "CollectStats" >> beam.combiners.ToDict()
            | "WriteStats" >> beam.FlatMap(_write_stats, staging)
        )
        return (data_files, incomplete_files, dead_files, pending_files, stats_files) | "StagedFiles" >> beam.Flatten()
