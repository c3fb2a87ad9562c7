"""The canned reports and ``trajpipe query`` over a 10M-step dataset.

The dataset is generated directly in the project's row schema
(:func:`schemas.datasets.step_file_schema`, :func:`trajectory_file_schema`)
and committed with a real manifest (:class:`pipelines.commit.DatasetManifest`),
so the catalog reads it exactly as it reads a Beam job's output; 10M steps are
not pushed through Beam for this. Shape: 500,000 episodes x 20 steps, four
domains, ten policy versions, short token lists (observation ~6, action ~6
tokens a step, prompt 32) so the data fits this machine (~1 GB on disk).

Figures:

* ``report_queries_max_s`` — the slowest canned report (pipelines/reports.py),
  best of ``repeats`` runs each, over the catalog's views (goal < 1 s);
  ``report_<name>_s`` each.
* ``query_overhead_vs_duckdb`` — the path of ``trajpipe query`` (open the
  catalog: read the manifests, register the views; run the SQL; fetch the
  result) / plain DuckDB running the same SQL over ``read_parquet`` globs of
  the same files, summed over the report queries, best of ``repeats``,
  interleaved (goal <= 1.2). The command's process start (Python imports,
  ~1 s) is not in it: ``query_cli_process_s`` is one whole
  ``trajpipe query`` run, for scale.

Run it alone::

    .venv/bin/python -m bench.run analytics
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.catalog import open_catalog
from pipelines.commit import CommittedFile, DatasetManifest
from pipelines.reports import REPORTS, report_sql
from schemas.datasets import context_tokens_of, step_file_schema, trajectory_file_schema
from schemas.manifests import commit_log_of

__all__ = ["bench_analytics", "write_synthetic_dataset"]

DOMAINS = ("code", "math", "docqa", "tools")
VERSION = "outcome-bench000"


def _lists(rng: np.random.Generator, lengths: np.ndarray, values: pa.Array | None, kind: str) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    if values is None:
        if kind == "tokens":
            values = pa.array(rng.integers(0, 32_000, n, dtype=np.int32))
        elif kind == "logprobs":
            values = pa.array(-rng.exponential(1.0, n).astype(np.float32))
        else:
            values = pa.array(np.ones(n, dtype=bool))
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _steps_table(rng: np.random.Generator, episodes: np.ndarray, steps_per_episode: int, versions: np.ndarray,
                 t0: float) -> pa.Table:
    sch = step_file_schema()
    n = len(episodes) * steps_per_episode
    ep = np.repeat(episodes, steps_per_episode)
    idx = np.tile(np.arange(steps_per_episode), len(episodes))
    obs = np.where(idx == 0, 32, rng.integers(1, 12, n)).astype(np.int32)
    act = rng.integers(1, 12, n).astype(np.int32)
    ids = pa.array([f"ep-{e:08d}" for e in episodes])
    ep_ids = pa.DictionaryArray.from_arrays(pa.array(np.repeat(np.arange(len(episodes)), steps_per_episode)),
                                            ids).cast(pa.string())
    reward = np.where(idx == steps_per_episode - 1, rng.integers(0, 2, n), 0).astype(np.float64)
    ver = np.repeat(versions, steps_per_episode)
    verif_type = sch.field("verifications").type.value_type
    cols = {
        "episode_id": ep_ids,
        "step_index": pa.array(idx.astype(np.int64)),
        "event_id": pa.array(np.char.add(np.char.add(np.repeat(np.array([f"e{e}" for e in episodes]),
                                                               steps_per_episode), "-"), idx.astype(str))),
        "recipe_hash": pa.array(np.full(n, "0" * 64)),
        "task_id": ep_ids, "task_group": ep_ids,
        "policy_version": pa.array(ver.astype(np.int64)),
        "status": pa.array(np.full(n, "success")),
        "num_steps": pa.array(np.full(n, steps_per_episode, np.int64)),
        "observation_token_ids": _lists(rng, obs, None, "tokens"),
        "action_token_ids": _lists(rng, act, None, "tokens"),
        "observation_tokens": pa.array(obs.astype(np.int64)), "action_tokens": pa.array(act.astype(np.int64)),
        "context_tokens": pa.array(context_tokens_of(obs, act, np.full(len(episodes), steps_per_episode))),
        "behaviour_logprobs": _lists(rng, act, None, "logprobs"),
        "temperature": pa.array(np.ones(n)), "top_p": pa.array(np.ones(n)), "top_k": pa.array(np.full(n, -1)),
        "context_cut_start": pa.array(np.zeros(n, np.int64)), "context_cut_tokens": pa.array(np.zeros(n, np.int64)),
        "policy_lineage": pa.array(np.full(n, "bench")),
        "trainable": pa.array(np.ones(n, bool)),
        "loss_mask": _lists(rng, act, None, "mask"),
        "reward": pa.array(reward), "return_to_go": pa.array(reward), "advantage": pa.array(reward),
        "normalized_advantage": pa.array(rng.normal(0, 1, n)), "group_advantage": pa.array(np.zeros(n)),
        "group_size": pa.array(np.ones(n, np.int64)),
        "verifications": pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)),
                                                  pa.array([], type=verif_type)),
        "verification_score": pa.array(np.zeros(n)), "verifier_disagreements": pa.array(np.zeros(n, np.int64)),
        "clipped": pa.array(np.zeros(n, bool)),
        "event_time": pa.array(((t0 + ep * 0.01 + idx * 0.001) * 1e6).astype(np.int64), pa.timestamp("us", tz="UTC")),
    }
    return pa.Table.from_arrays([cols[f.name].cast(f.type) for f in sch], schema=sch)


def _trajectories_table(rng: np.random.Generator, episodes: np.ndarray, steps_per_episode: int,
                        versions: np.ndarray, t0: float) -> pa.Table:
    sch = trajectory_file_schema()
    n = len(episodes)
    ids = pa.array([f"ep-{e:08d}" for e in episodes])
    passed = rng.random(n) < 0.3 + 0.05 * versions
    term = rng.choice(np.array(["done", "done", "done", "max_steps", "timeout"]), n)
    first = t0 + episodes * 0.01
    cols = {
        "episode_id": ids, "recipe_hash": pa.array(np.full(n, "0" * 64)), "task_id": ids, "task_group": ids,
        "policy_version": pa.array(versions.astype(np.int64)), "difficulty": pa.array(np.zeros(n, np.int64)),
        "status": pa.array(np.where(term == "timeout", "timeout", np.where(passed, "success", "failure"))),
        "termination": pa.array(term), "trainable": pa.array(term != "timeout"),
        "excluded_reason": pa.array(np.where(term == "timeout", "timeout", None)),
        "complete": pa.array(np.ones(n, bool)), "incomplete_reason": pa.nulls(n, pa.string()),
        "num_events": pa.array(np.full(n, 2 * steps_per_episode + 2, np.int64)),
        "num_steps": pa.array(np.full(n, steps_per_episode, np.int64)),
        "steps_dropped": pa.array(np.zeros(n, np.int64)), "action_tokens": pa.array(np.full(n, 120, np.int64)),
        "tokens_masked": pa.array(np.zeros(n, np.int64)), "clipped": pa.array(np.zeros(n, bool)),
        "outcome_reward": pa.array(passed.astype(np.float64)), "episode_return": pa.array(passed.astype(np.float64)),
        "normalized_return": pa.array(rng.normal(0, 1, n)), "group_advantage": pa.array(np.zeros(n)),
        "group_size": pa.array(np.ones(n, np.int64)), "group_member": pa.array(np.zeros(n, np.int64)),
        "group_members": pa.array(np.ones(n, np.int64)), "group_timed_out": pa.array(np.zeros(n, bool)),
        "policy_lineage": pa.array(np.full(n, "bench")), "verifier_summary": pa.array(np.full(n, "")),
        "verifier_disagreements": pa.array(np.zeros(n, np.int64)), "completed_late": pa.array(np.zeros(n, bool)),
        "steps_passed": pa.array(np.zeros(n, np.int64)),
        "first_event_time": pa.array((first * 1e6).astype(np.int64), pa.timestamp("us", tz="UTC")),
        "last_event_time": pa.array(((first + steps_per_episode * 0.001) * 1e6).astype(np.int64),
                                    pa.timestamp("us", tz="UTC")),
    }
    return pa.Table.from_arrays([cols[f.name].cast(f.type) for f in sch], schema=sch)


def write_synthetic_dataset(out: Path, *, steps: int = 10_000_000, steps_per_episode: int = 20,
                            shard_episodes: int = 50_000, seed: int = 0) -> dict[str, int]:
    """Write ``steps`` steps (and their episodes) as one committed dataset version under ``out``.

    Returns:
        ``{"steps": .., "episodes": .., "files": .., "bytes": ..}``.
    """
    rng = np.random.default_rng(seed)
    n_episodes = steps // steps_per_episode
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()
    files: list[CommittedFile] = []
    for shard, start in enumerate(range(0, n_episodes, shard_episodes)):
        episodes = np.arange(start, min(start + shard_episodes, n_episodes))
        domain = DOMAINS[shard % len(DOMAINS)]
        versions = np.minimum(episodes * 10 // n_episodes, 9)
        for table, build in (("steps", _steps_table), ("trajectories", _trajectories_table)):
            rel = f"{table}/recipe={VERSION}/domain={domain}/c00000001-s{shard:03d}.parquet"
            rows = build(rng, episodes, steps_per_episode, versions, t0)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(rows, out / rel, row_group_size=250_000)
            files.append(CommittedFile(path=rel, staged=rel, rows=rows.num_rows))
    manifest = DatasetManifest(commit=1, version=VERSION, recipe_hash="0" * 64, source="raw", files=files,
                               clock_s=t0 + n_episodes * 0.01, counts={"steps": steps, "episodes": n_episodes})
    shutil.rmtree(out / "_commit_log", ignore_errors=True)  # a dataset of an earlier run: this one replaces it
    commit_log_of(out, VERSION).snapshot().commit(msgspec.json.encode(manifest))
    return {"steps": steps, "episodes": n_episodes, "files": len(files),
            "bytes": sum((out / f.path).stat().st_size for f in files)}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_analytics(workdir: Path, *, steps: int = 10_000_000, repeats: int = 3) -> dict[str, float]:
    """Generate the dataset under ``workdir`` and time the reports and the query path (see the module docstring)."""
    data = workdir / "data"
    t = time.perf_counter()
    size = write_synthetic_dataset(data, steps=steps)
    figures: dict[str, float] = {"analytics_steps": size["steps"], "analytics_dataset_mb": round(size["bytes"] / 2**20),
                                 "analytics_generate_s": round(time.perf_counter() - t, 1)}
    catalog = open_catalog(data=data)
    con = catalog.connect()
    con.execute("set threads to 2")
    views = catalog.views
    per_report = {}
    for name in REPORTS:
        sql = report_sql(name, views)
        per_report[name] = _best(lambda: con.sql(sql).fetch_arrow_table(), repeats)
        figures[f"report_{name}_s"] = round(per_report[name], 3)
    figures["report_queries_max_s"] = round(max(per_report.values()), 3)

    # The same SQL through the catalog (what `trajpipe query` does) and through plain DuckDB globs.
    sqls = [report_sql(name, views) for name in REPORTS if name not in ("latency", "commits")]

    def via_catalog() -> None:
        c = open_catalog(data=data).connect()
        c.execute("set threads to 2")
        for sql in sqls:
            c.sql(sql).fetch_arrow_table()
        c.close()

    def via_duckdb() -> None:
        c = duckdb.connect()
        c.execute("set threads to 2")
        for table in ("steps", "trajectories"):
            c.execute(f"create view {table} as select * from read_parquet('{data}/{table}/**/*.parquet', "
                      "hive_partitioning=true)")
        for sql in sqls:
            c.sql(sql).fetch_arrow_table()
        c.close()

    cat_times, duck_times = [], []
    for _ in range(repeats):
        cat_times.append(_best(via_catalog, 1))
        duck_times.append(_best(via_duckdb, 1))
    figures["query_catalog_s"] = round(min(cat_times), 3)
    figures["query_plain_duckdb_s"] = round(min(duck_times), 3)
    figures["query_overhead_vs_duckdb"] = round(min(cat_times) / min(duck_times), 3)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trajpipe", "query", "--data", str(data), "--format", "csv",
                    "select domain, count(*) from trajectories group by 1"], check=True, capture_output=True,
                   timeout=300)
    figures["query_cli_process_s"] = round(time.perf_counter() - t, 2)
    return figures
