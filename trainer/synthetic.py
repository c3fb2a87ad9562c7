"""Synthetic ``steps/`` datasets in the real layout, for tests and benchmarks.

Real datasets come from the trajectory job (pipelines/); this writes
schema-valid :class:`schemas.datasets.StepRow` files plus commits the
same way (data file under a temporary name, the commit made in the version's
commit log with the manifest as its record — the commit point — then the file
renamed into place), so the trainer can be tested
and benchmarked without running the pipeline. As the job does, each file holds
its rows sorted by ``(episode_id, step_index)`` in row groups that never split
an episode.

Episodes have several steps whose ``observation_token_ids`` form the episode's
token stream (``obs_0 act_0 obs_1 act_1 ...``, step 0's observation is the
prompt); with ``max_model_len`` set, steps whose input would not fit record a
context cut the way ``rollout.context.TokenContext`` does (keep a head, drop the
oldest tokens after it).

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> root = Path(tempfile.mkdtemp())
    >>> rows = make_step_rows(4, seed=0, vocab_size=100, steps=(2, 2))
    >>> len(rows), [r.step_index for r in rows[:2]], rows[0].num_steps
    (8, [0, 1], 2)
    >>> write_steps_commit(root, rows, commit=1)["files"][0]["path"].startswith("steps/recipe=synthetic-00000000/domain=")
    True
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import arrow_schema_for
from schemas.datasets import PARTITION_KEYS, StepRow, context_tokens_of
from schemas.events import as_logprobs, as_token_ids, make_event_id
from schemas.manifests import CommittedFile, DatasetManifest, commit_log_of

__all__ = ["make_step_rows", "write_steps_commit", "write_random_commit", "DEFAULT_RECIPE"]

#: Dataset version name used when none is given.
DEFAULT_RECIPE = "synthetic-00000000"

_TIME = datetime(2025, 1, 1, tzinfo=timezone.utc)


def _cut(stream_len: int, *, prompt_len: int, budget: int | None) -> tuple[int, int]:
    """``(cut_start, cut_tokens)`` of an input of ``stream_len`` tokens, as TokenContext cuts without turn boundaries."""
    if budget is None or stream_len <= budget:
        return 0, 0
    head = max(1, min(prompt_len, budget // 2))
    return head, stream_len - budget


def make_step_rows(
    n: int,
    *,
    seed: int = 0,
    domains: Sequence[str] = ("code", "math"),
    vocab_size: int = 2048,
    obs_tokens: tuple[int, int] = (4, 24),
    action_tokens: tuple[int, int] = (2, 16),
    steps: tuple[int, int] = (1, 3),
    policy_versions: Sequence[int] = (0,),
    policy_lineage: str = "",
    max_model_len: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    untrainable_every: int = 0,
    recipe: str = DEFAULT_RECIPE,
    id_prefix: str = "",
) -> list[StepRow]:
    """The steps of ``n`` random but schema-valid episodes; same seed, same rows.

    Token ids avoid 0..3 (special tokens of the tiny tokenizer).

    Args:
        n: episodes.
        seed: seed of every draw.
        domains: episode ``i`` gets ``domains[i % len(domains)]``.
        vocab_size: token ids are below this.
        obs_tokens: range of observation lengths per step (inclusive; >= 1).
        action_tokens: range of action lengths per step (inclusive).
        steps: range of steps per episode (inclusive).
        policy_versions: episode ``i`` was acted by ``policy_versions[i % len]``.
        policy_lineage: lineage stamped on every row.
        max_model_len: context of the acting policy: inputs longer than
            ``max_model_len - action_tokens[1]`` record a cut (None: never cut).
        temperature: sampling temperature recorded on the rows.
        top_p: top-p recorded on the rows.
        top_k: top-k recorded on the rows.
        untrainable_every: every ``k``-th episode (``i % k == k - 1``) timed out:
            ``trainable=False``, status ``timeout`` (0: all trainable).
        recipe: dataset version.
        id_prefix: prefix of the episode ids.

    Returns:
        The rows, episode by episode, steps in order.

    Raises:
        ValueError: ``max_model_len`` leaves no room for an input.
    """
    budget = None
    if max_model_len is not None:
        budget = max_model_len - action_tokens[1]
        if budget < 2:
            raise ValueError(f"`max_model_len` {max_model_len} leaves no room for an input after "
                             f"{action_tokens[1]} action tokens; raise it")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        episode_id = f"{id_prefix}ep-{seed}-{i:05d}"
        n_steps = int(rng.integers(steps[0], steps[1] + 1))
        adv = float(rng.normal())
        trainable = not (untrainable_every and i % untrainable_every == untrainable_every - 1)
        status = ("success" if adv > 0 else "failure") if trainable else "timeout"
        outcome = float(adv > 0) if trainable else 0.0
        stream_len, prompt_len = 0, 0
        for k in range(n_steps):
            n_obs = int(rng.integers(max(obs_tokens[0], 1), obs_tokens[1] + 1))
            n_act = int(rng.integers(action_tokens[0], action_tokens[1] + 1))
            prompt_len = prompt_len or n_obs
            context = stream_len + n_obs
            stream_len += n_obs
            cut_start, cut_tokens = _cut(stream_len, prompt_len=prompt_len, budget=budget)
            stream_len += n_act
            rows.append(StepRow(
                episode_id=episode_id, step_index=k, event_id=make_event_id(episode_id, 1 + k),
                domain=str(domains[i % len(domains)]), recipe=recipe, recipe_hash="0" * 64,
                task_id=f"t{i % 7}", task_group=f"g{i % 7}",
                policy_version=int(policy_versions[i % len(policy_versions)]), status=status, num_steps=n_steps,
                observation_token_ids=as_token_ids(rng.integers(4, vocab_size, n_obs)),
                action_token_ids=as_token_ids(rng.integers(4, vocab_size, n_act)),
                observation_tokens=n_obs, action_tokens=n_act, context_tokens=context,
                behaviour_logprobs=as_logprobs(-rng.exponential(1.0, n_act)),
                temperature=temperature, top_p=top_p, top_k=top_k,
                context_cut_start=cut_start, context_cut_tokens=cut_tokens, policy_lineage=policy_lineage,
                trainable=trainable, loss_mask=[bool(b) for b in rng.random(n_act) < 0.9],
                reward=outcome if k == n_steps - 1 else 0.0, return_to_go=outcome, advantage=adv,
                normalized_advantage=adv, group_advantage=adv if trainable else 0.0, group_size=4,
                verifications=[], verification_score=0.0, verifier_disagreements=0, clipped=False, event_time=_TIME,
            ))
    return rows


def _table(rows: Sequence[StepRow]) -> pa.Table:
    schema = arrow_schema_for(StepRow, exclude=PARTITION_KEYS)
    cols: dict[str, list[Any]] = {name: [] for name in schema.names}
    for r in rows:
        for name in schema.names:
            v = getattr(r, name)
            cols[name].append(v.tolist() if isinstance(v, np.ndarray) else v)
    return pa.table(cols, schema=schema)


def _write_aligned(table: pa.Table, path: Path, *, row_group_size: int) -> None:
    """Write ``table`` (sorted by episode) in row groups of about ``row_group_size`` rows, never splitting an episode."""
    eid = table.column("episode_id").to_pylist()
    n = len(eid)
    with pq.ParquetWriter(path, table.schema) as writer:
        start = 0
        while start < n:
            end = min(start + row_group_size, n)
            while end < n and eid[end] == eid[end - 1]:
                end += 1
            writer.write_table(table.slice(start, end - start), row_group_size=end - start)
            start = end


def _manifest(commit: int, recipe: str, files: list[str], rows: list[int]) -> dict[str, Any]:
    """The :class:`schemas.manifests.DatasetManifest` of a synthetic commit, as JSON-ready builtins."""
    return msgspec.to_builtins(DatasetManifest(
        commit=commit, version=recipe, recipe_hash="0" * 64, source="synthetic",
        files=[CommittedFile(path=f, staged=f + ".tmp", rows=n) for f, n in zip(files, rows)],
    ))


def _commit(root: Path, recipe: str, commit: int, manifest: dict[str, Any]) -> None:
    """Make commit ``commit`` of ``recipe``'s commit log with ``manifest`` as its record (the commit point)."""
    snap = commit_log_of(root, recipe).snapshot()
    if snap.head + 1 != commit:
        raise ValueError(f"commit {commit} of {recipe} at {root}: the log is at commit {snap.head} "
                         "(commits are gap-free from 1)")
    snap.commit(json.dumps(manifest).encode())


def write_steps_commit(
    root: Path,
    rows: Sequence[StepRow],
    *,
    commit: int,
    recipe: str = DEFAULT_RECIPE,
    row_group_size: int = 64,
    shard: int = 0,
    publish: bool = True,
) -> dict[str, Any]:
    """Write one commit of ``rows`` (one file per domain, sorted by ``(episode_id, step_index)``) and its manifest.

    Args:
        root: dataset root.
        rows: the steps of this commit.
        commit: commit number (gap-free from 1 per recipe).
        recipe: dataset version.
        row_group_size: rows per Parquet row group, rounded up to a whole episode.
        shard: shard number in the file names.
        publish: False leaves the data files as ``*.tmp`` and writes no manifest
            (an uncommitted commit, as a crashed writer leaves it).

    Returns:
        The manifest written.
    """
    root = Path(root)
    by_domain: dict[str, list[StepRow]] = defaultdict(list)
    for r in rows:
        by_domain[r.domain].append(r)
    files, tmps = [], []
    for domain, drows in sorted(by_domain.items()):
        drows = sorted(drows, key=lambda r: (r.episode_id, r.step_index))
        rel = f"steps/recipe={recipe}/domain={domain}/c{commit:08d}-s{shard:04d}.parquet"
        final = root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        _write_aligned(_table(drows), tmp, row_group_size=row_group_size)
        files.append(rel)
        tmps.append((tmp, final))
    manifest = _manifest(commit, recipe, files, [len(by_domain[d]) for d in sorted(by_domain)])
    if publish:
        _commit(root, recipe, commit, manifest)
        for tmp, final in tmps:
            os.replace(tmp, final)
    return manifest


def _list_array(lengths: np.ndarray, values: np.ndarray, typ: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ))


def write_random_commit(
    root: Path,
    *,
    rows: int,
    commit: int,
    seed: int = 0,
    vocab_size: int = 32000,
    obs_tokens: tuple[int, int] = (64, 512),
    action_tokens: tuple[int, int] = (32, 256),
    steps: tuple[int, int] = (1, 4),
    domains: Sequence[str] = ("code", "math", "docqa", "tools"),
    recipe: str = DEFAULT_RECIPE,
    row_group_size: int = 1024,
) -> dict[str, Any]:
    """A large commit of random episodes, built column-wise (millions of tokens in seconds), for benchmarks.

    Same layout and commit protocol as :func:`write_steps_commit`; one file per
    domain; episodes of ``steps`` steps (inclusive range, the last one shortened
    so the commit holds exactly ``rows`` step rows), never cut, temperature 1.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    schema = arrow_schema_for(StepRow, exclude=PARTITION_KEYS)
    lengths = []
    while sum(lengths) < rows:
        lengths.append(int(rng.integers(steps[0], steps[1] + 1)))
    if lengths:
        lengths[-1] -= sum(lengths) - rows
    files, moves, written = [], [], []
    per_domain = np.array_split(np.arange(len(lengths)), len(domains))
    for d, eps in zip(domains, per_domain):
        if len(eps) == 0:
            continue
        ep_steps = np.array([lengths[i] for i in eps], dtype=np.int64)
        n = int(ep_steps.sum())
        episode = np.repeat(np.array([f"c{commit}-ep-{i:08d}" for i in eps]), ep_steps)
        step_index = np.arange(n) - np.repeat(np.cumsum(ep_steps) - ep_steps, ep_steps)
        n_obs = rng.integers(max(obs_tokens[0], 1), obs_tokens[1] + 1, n)
        n_act = rng.integers(action_tokens[0], action_tokens[1] + 1, n)
        adv = np.repeat(rng.normal(size=len(eps)), ep_steps)
        outcome = (adv > 0).astype(np.float64)
        last = step_index == np.repeat(ep_steps, ep_steps) - 1
        cols = {
            "episode_id": pa.array(episode), "step_index": pa.array(step_index),
            "event_id": pa.array([make_event_id(e, 1 + int(k)) for e, k in zip(episode, step_index)]),
            "recipe_hash": pa.array(["0" * 64] * n),
            "task_id": pa.array([f"t{i % 97}" for i in np.repeat(eps, ep_steps)]),
            "task_group": pa.array([f"g{i % 97}" for i in np.repeat(eps, ep_steps)]),
            "policy_version": pa.array(np.zeros(n, np.int64)),
            "status": pa.array(np.where(adv > 0, "success", "failure")),
            "num_steps": pa.array(np.repeat(ep_steps, ep_steps)),
            "observation_token_ids": _list_array(n_obs, rng.integers(4, vocab_size, n_obs.sum()), pa.int32()),
            "action_token_ids": _list_array(n_act, rng.integers(4, vocab_size, n_act.sum()), pa.int32()),
            "observation_tokens": pa.array(n_obs.astype(np.int64)), "action_tokens": pa.array(n_act.astype(np.int64)),
            "context_tokens": pa.array(context_tokens_of(n_obs, n_act, ep_steps)),
            "behaviour_logprobs": _list_array(n_act, -rng.exponential(1.0, n_act.sum()).astype(np.float32), pa.float32()),
            "temperature": pa.array(np.ones(n)), "top_p": pa.array(np.ones(n)),
            "top_k": pa.array(np.full(n, -1, np.int64)),
            "context_cut_start": pa.array(np.zeros(n, np.int64)), "context_cut_tokens": pa.array(np.zeros(n, np.int64)),
            "policy_lineage": pa.array([""] * n), "trainable": pa.array(np.ones(n, bool)),
            "loss_mask": _list_array(n_act, np.ones(n_act.sum(), bool), pa.bool_()),
            "reward": pa.array(np.where(last, outcome, 0.0)), "return_to_go": pa.array(outcome),
            "advantage": pa.array(adv), "normalized_advantage": pa.array(adv), "group_advantage": pa.array(adv),
            "group_size": pa.array(np.full(n, 4, np.int64)),
            "verifications": pa.array([[]] * n, schema.field("verifications").type),
            "verification_score": pa.array(np.zeros(n)), "verifier_disagreements": pa.array(np.zeros(n, np.int64)),
            "clipped": pa.array(np.zeros(n, bool)),
            "event_time": pa.array([_TIME] * n, schema.field("event_time").type),
        }
        table = pa.table([cols[f.name].cast(f.type) for f in schema], schema=schema)
        rel = f"steps/recipe={recipe}/domain={d}/c{commit:08d}-s0000.parquet"
        final = root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        _write_aligned(table, tmp, row_group_size=row_group_size)
        files.append(rel)
        moves.append((tmp, final))
        written.append(n)
    manifest = _manifest(commit, recipe, files, written)
    _commit(root, recipe, commit, manifest)
    for tmp, final in moves:
        os.replace(tmp, final)
    return manifest
