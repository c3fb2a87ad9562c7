"""Synthetic ``steps/`` datasets in the real layout, for tests and benchmarks.

Real datasets come from the trajectory job (pipelines/); this writes
schema-valid :class:`schemas.datasets.StepRow` files plus commit manifests the
same way (data file under a temporary name, manifest written atomically — the
commit point — then the file renamed into place), so the trainer can be tested
and benchmarked without running the pipeline.

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> root = Path(tempfile.mkdtemp())
    >>> rows = make_step_rows(4, seed=0, vocab_size=100)
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import arrow_schema_for
from schemas.datasets import DATASET_SCHEMA_VERSION, PARTITION_KEYS, StepRow
from schemas.events import as_logprobs, as_token_ids, make_event_id
from schemas.storage import atomic_write

__all__ = ["make_step_rows", "write_steps_commit", "write_random_commit", "DEFAULT_RECIPE"]

#: Dataset version name used when none is given.
DEFAULT_RECIPE = "synthetic-00000000"


def make_step_rows(
    n: int,
    *,
    seed: int = 0,
    domains: Sequence[str] = ("code", "math"),
    vocab_size: int = 2048,
    obs_tokens: tuple[int, int] = (4, 24),
    action_tokens: tuple[int, int] = (2, 16),
    policy_versions: Sequence[int] = (0,),
    recipe: str = DEFAULT_RECIPE,
    id_prefix: str = "",
) -> list[StepRow]:
    """``n`` random but schema-valid steps (one-step episodes); same seed, same rows.

    Token ids avoid 0..3 (special tokens of the tiny tokenizer).
    """
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        episode_id = f"{id_prefix}ep-{seed}-{i}"
        n_obs = int(rng.integers(obs_tokens[0], obs_tokens[1] + 1))
        n_act = int(rng.integers(action_tokens[0], action_tokens[1] + 1))
        adv = float(rng.normal())
        rows.append(StepRow(
            episode_id=episode_id, step_index=0, event_id=make_event_id(episode_id, 1),
            domain=str(domains[i % len(domains)]), recipe=recipe, recipe_hash="0" * 64,
            task_id=f"t{i % 7}", task_group=f"g{i % 7}",
            policy_version=int(policy_versions[i % len(policy_versions)]),
            status="success" if adv > 0 else "failure", num_steps=1,
            observation_token_ids=as_token_ids(rng.integers(4, vocab_size, n_obs)),
            action_token_ids=as_token_ids(rng.integers(4, vocab_size, n_act)),
            behaviour_logprobs=as_logprobs(-rng.exponential(1.0, n_act)),
            loss_mask=[bool(b) for b in rng.random(n_act) < 0.9],
            reward=float(adv > 0), return_to_go=float(adv > 0), advantage=adv, normalized_advantage=adv,
            group_advantage=adv, verifications=[], verification_score=0.0, clipped=False,
            event_time=datetime(2025, 1, 1, tzinfo=timezone.utc),
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


def _manifest(commit: int, recipe: str, files: list[str], rows: list[int]) -> dict[str, Any]:
    """The subset of ``pipelines.commit.DatasetManifest`` readers use, in the same field names."""
    return {
        "commit": commit, "version": recipe, "recipe_hash": "0" * 64, "source": "synthetic",
        "files": [{"path": f, "staged": f + ".tmp", "rows": n} for f, n in zip(files, rows)],
        "schema_version": DATASET_SCHEMA_VERSION, "created_at": datetime.now(timezone.utc).isoformat(),
    }


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
    """Write one commit of ``rows`` (one file per domain) and its manifest.

    Args:
        root: dataset root.
        rows: the steps of this commit.
        commit: commit number (gap-free from 1 per recipe).
        recipe: dataset version.
        row_group_size: rows per Parquet row group.
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
        rel = f"steps/recipe={recipe}/domain={domain}/c{commit:08d}-s{shard:04d}.parquet"
        final = root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        pq.write_table(_table(drows), tmp, row_group_size=row_group_size)
        files.append(rel)
        tmps.append((tmp, final))
    manifest = _manifest(commit, recipe, files, [len(by_domain[d]) for d in sorted(by_domain)])
    if publish:
        mdir = root / "_manifests" / recipe
        mdir.mkdir(parents=True, exist_ok=True)
        atomic_write(mdir / f"{commit:08d}.json", json.dumps(manifest).encode())
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
    domains: Sequence[str] = ("code", "math", "docqa", "tools"),
    recipe: str = DEFAULT_RECIPE,
    row_group_size: int = 1024,
) -> dict[str, Any]:
    """A large commit of random steps, built column-wise (millions of tokens in seconds), for benchmarks.

    Same layout and commit protocol as :func:`write_steps_commit`; one file per domain.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    schema = arrow_schema_for(StepRow, exclude=PARTITION_KEYS)
    files, moves = [], []
    per_domain = np.array_split(np.arange(rows), len(domains))
    for d, idx in zip(domains, per_domain):
        n = len(idx)
        if n == 0:
            continue
        n_obs = rng.integers(obs_tokens[0], obs_tokens[1] + 1, n)
        n_act = rng.integers(action_tokens[0], action_tokens[1] + 1, n)
        adv = rng.normal(size=n)
        episode = [f"c{commit}-ep-{i}" for i in idx]
        cols = {
            "episode_id": pa.array(episode), "step_index": pa.array(np.zeros(n, np.int64)),
            "event_id": pa.array([make_event_id(e, 1) for e in episode]), "recipe_hash": pa.array(["0" * 64] * n),
            "task_id": pa.array([f"t{i % 97}" for i in idx]), "task_group": pa.array([f"g{i % 97}" for i in idx]),
            "policy_version": pa.array(np.zeros(n, np.int64)),
            "status": pa.array(np.where(adv > 0, "success", "failure")), "num_steps": pa.array(np.ones(n, np.int64)),
            "observation_token_ids": _list_array(n_obs, rng.integers(4, vocab_size, n_obs.sum()), pa.int32()),
            "action_token_ids": _list_array(n_act, rng.integers(4, vocab_size, n_act.sum()), pa.int32()),
            "behaviour_logprobs": _list_array(n_act, -rng.exponential(1.0, n_act.sum()).astype(np.float32), pa.float32()),
            "loss_mask": _list_array(n_act, np.ones(n_act.sum(), bool), pa.bool_()),
            "reward": pa.array((adv > 0).astype(np.float64)), "return_to_go": pa.array((adv > 0).astype(np.float64)),
            "advantage": pa.array(adv), "normalized_advantage": pa.array(adv), "group_advantage": pa.array(adv),
            "verifications": pa.array([[]] * n, schema.field("verifications").type),
            "verification_score": pa.array(np.zeros(n)), "clipped": pa.array(np.zeros(n, bool)),
            "event_time": pa.array([datetime(2025, 1, 1, tzinfo=timezone.utc)] * n, schema.field("event_time").type),
        }
        table = pa.table([cols[f.name].cast(f.type) for f in schema], schema=schema)
        rel = f"steps/recipe={recipe}/domain={d}/c{commit:08d}-s0000.parquet"
        final = root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        pq.write_table(table, tmp, row_group_size=row_group_size)
        files.append(rel)
        moves.append((tmp, final))
    manifest = _manifest(commit, recipe, files, [len(idx) for idx in per_domain if len(idx)])
    mdir = root / "_manifests" / recipe
    mdir.mkdir(parents=True, exist_ok=True)
    atomic_write(mdir / f"{commit:08d}.json", json.dumps(manifest).encode())
    for tmp, final in moves:
        os.replace(tmp, final)
    return manifest
