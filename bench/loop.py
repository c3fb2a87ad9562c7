"""The online loop's freshness and the async loop against a synchronous alternation (``make bench`` runs it small).

Two runs of the same model and settings (``trajpipe/configs/loop-tiny.yaml``: tiny model, transformers
rollouts in GRPO groups, the Beam job in 2-second micro-batches, online GRPO publishing every 2 steps), each
on its own embedded broker, each for the same wall-clock budget counted from the broker being up:

* **async**: ``trajpipe loop`` (every part its own process, all at once, wired through Kafka and the datasets);
* **sync**: the alternation a user without the loop would script, repeated until the budget is spent:
  ``trajpipe rollout`` of one round of episodes (the newest policy) → ``trajpipe pipeline run`` (one
  micro-batch) → ``trajpipe train --resume`` on what is new (the same online recipe, ending when no new commit
  comes for a few seconds; it publishes at its end). Every command starts afresh each round, as in such a script.

Figures:

* ``loop_freshness_p95_s``: p95 over the async run's steps of (the commit that made the step readable to the
  trainer: its manifest's ``created_at``) − (the step's ``event_time``). Goal ≤ 10 s.
* ``loop_async_speedup``: trained samples per second (episode windows in the trainer's optimizer steps,
  ``data/windows`` of its non-skipped steps) of async over sync. Goal ≥ 2×.
* ``loop_async_samples_per_s``, ``loop_sync_samples_per_s``, ``loop_freshness_p50_s``, ``loop_async_versions``,
  ``loop_sync_versions``, ``loop_sync_rounds``, ``loop_budget_s``.

Usage::

    .venv/bin/python -m bench.loop --budget-s 240          # one JSON line
    .venv/bin/python -m bench.run loop                    # as part of make bench (budget 240 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

from schemas.manifests import list_dataset_versions, read_dataset_records

__all__ = ["bench_loop", "freshness", "trained_samples"]

REPO = Path(__file__).resolve().parents[1]


def _trajpipe(*args: str, env: dict[str, str], timeout: float, log: Path) -> str:
    with open(log, "ab") as err:
        proc = subprocess.run([sys.executable, "-m", "trajpipe", *args], env=env, stdout=subprocess.PIPE,
                              stderr=err, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trajpipe {args[0]} exited with {proc.returncode}; see {log}")
    return proc.stdout.decode()


def trained_samples(metrics: Path) -> int:
    """Episode windows trained on (``data/windows`` of the non-skipped steps; a resumed run's steps once)."""
    by_step: dict[int, int] = {}
    if not metrics.is_file():
        return 0
    for line in metrics.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("step"), int) and not doc.get("train/skipped"):
            by_step[doc["step"]] = int(doc.get("data/windows", 0))
    return sum(by_step.values())


def freshness(data: Path) -> list[float]:
    """Seconds from each step's event time to the dataset commit that made it readable, over every commit."""
    import duckdb

    rows: list[tuple[str, float]] = []
    for record in (r for v in list_dataset_versions(data) for r in read_dataset_records(data, v)):
        doc = json.loads(record)
        created = datetime.fromisoformat(str(doc["created_at"]).replace("Z", "+00:00")).timestamp()
        for f in doc.get("files", []):
            path = f["path"] if isinstance(f, dict) else f
            if "/steps/" in f"/{path}" and path.endswith(".parquet"):
                rows.append((str(data / path), created))
    if not rows:
        return []
    con = duckdb.connect()
    con.execute("create table commits(path varchar, created double)")
    con.executemany("insert into commits values (?, ?)", rows)
    files = [r[0] for r in rows]
    return [r[0] for r in con.execute(
        "select c.created - epoch(s.event_time) from read_parquet(?, filename=true, hive_partitioning=true) s "
        "join commits c on c.path = s.filename", [files]).fetchall()]


def _broker(workdir: Path, env: dict[str, str]) -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _trajpipe("broker", "start", "--port", str(port), "--data-dir", str(workdir / "broker"), env=env,
                    timeout=180, log=workdir / "broker.log")
    return out.strip().splitlines()[-1]


def _stop_broker(workdir: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "trajpipe", "broker", "stop", "--data-dir", str(workdir / "broker")],
                   env=env, capture_output=True, timeout=120, check=False)


def _config(run_dir: Path, model: Path, budget_s: float, bootstrap: str) -> dict:
    doc = yaml.safe_load((REPO / "trajpipe/configs/loop-tiny.yaml").read_text())
    doc.update(run_dir=str(run_dir), model=str(model), bootstrap=bootstrap,
               budget={"seconds": budget_s}, eval={"enabled": False})
    return doc


def _run_async(workdir: Path, model: Path, budget_s: float, env: dict[str, str]) -> dict:
    workdir.mkdir(parents=True)
    bootstrap = _broker(workdir, env)
    try:
        cfg = workdir / "loop.yaml"
        cfg.write_text(yaml.safe_dump(_config(workdir / "run", model, budget_s, bootstrap)))
        t0 = time.monotonic()
        summary = json.loads(_trajpipe("loop", "--config", str(cfg), env=env, timeout=budget_s + 600,
                                       log=workdir / "loop.log").strip().splitlines()[-1])
        wall = time.monotonic() - t0
    finally:
        _stop_broker(workdir, env)
    run = workdir / "run"
    return {"samples": trained_samples(run / "train" / "metrics.jsonl"), "versions": len(summary["policy_versions"]),
            "wall_s": wall, "freshness": freshness(run / "data")}


def _run_sync(workdir: Path, model: Path, budget_s: float, env: dict[str, str]) -> dict:
    """rollout → pipeline → train, repeated until ``budget_s`` (each a fresh command, as a script would run)."""
    from trajpipe.loop import LoopConfig

    workdir.mkdir(parents=True)
    bootstrap = _broker(workdir, env)
    cfg = LoopConfig.model_validate(_config(workdir / "run", model, budget_s, bootstrap))
    r, run = cfg.rollout, workdir / "run"
    data, train_out = run / "data", run / "train"
    data.mkdir(parents=True)
    # The loop's own trainer recipe, ending a round once no new commit comes and publishing at that end.
    from trainer.config import deep_merge

    base = yaml.safe_load((REPO / cfg.trainer.config).read_text())
    train_cfg = deep_merge(deep_merge(base, cfg.trainer.overrides), {
        "mode": "online", "max_steps": 1_000_000_000, "data": {"idle_timeout_s": 5.0},
        "publish": {"every": cfg.trainer.publish_every, "at_end": True},
        "checkpoint": {"every": cfg.trainer.publish_every, "at_end": True}})
    (run / "train.yaml").write_text(yaml.safe_dump(train_cfg))
    from pipelines.recipes import load_recipe

    recipe = load_recipe(cfg.pipeline.recipe).version
    per_round = r.group_size * r.concurrency * 2
    rounds = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < budget_s:
            policies = sorted((train_out / "policies").glob("v*"), key=lambda p: int(p.name[1:])) \
                if (train_out / "policies").is_dir() else []
            acting = policies[-1] if policies else model
            _trajpipe("rollout", "--bootstrap", bootstrap, "--episodes", str(per_round), "--policy", r.policy,
                      "--model", str(acting), "--domains", ",".join(r.domains), "--group-size", str(r.group_size),
                      "--concurrency", str(r.concurrency), "--max-steps", str(r.max_steps), "--max-tokens",
                      str(r.max_tokens), "--temperature", str(r.temperature), "--seed", str(rounds),
                      "--no-follow-policies", "--spool-dir", str(run / "spool"), env=env, timeout=900,
                      log=workdir / "rollout.log")
            if time.monotonic() - t0 >= budget_s:
                break
            _trajpipe("pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap, "--out", str(data),
                      "--recipe", cfg.pipeline.recipe, "--group-timeout", str(cfg.pipeline.group_timeout_s),
                      env=env, timeout=900, log=workdir / "pipeline.log")
            if time.monotonic() - t0 >= budget_s:
                break
            resume = ["--resume"] if any((train_out / "checkpoints").glob("step-*")) else []
            _trajpipe("train", "--config", str(run / "train.yaml"), "--data", str(data), "--recipe", recipe,
                      "--model", str(model), "--out", str(train_out), "--bootstrap", bootstrap, *resume, env=env,
                      timeout=900, log=workdir / "train.log")
            rounds += 1
        wall = time.monotonic() - t0
    finally:
        _stop_broker(workdir, env)
    versions = len(list((train_out / "policies").glob("v*"))) if (train_out / "policies").is_dir() else 0
    return {"samples": trained_samples(train_out / "metrics.jsonl"), "versions": versions, "wall_s": wall,
            "rounds": rounds}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def bench_loop(workdir: Path, *, budget_s: float = 150.0) -> dict:
    """Both runs on ``budget_s`` seconds each (from their broker being up); the figures above."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    model = workdir / "tiny"
    if not (model / "config.json").is_file():
        _trajpipe("model", "init-tiny", "--out", str(model), env=env, timeout=300, log=workdir / "model.log")
    a = _run_async(workdir / "async", model, budget_s, env)
    s = _run_sync(workdir / "sync", model, budget_s, env)
    a_rate, s_rate = a["samples"] / a["wall_s"], s["samples"] / s["wall_s"]
    return {
        "loop_freshness_p95_s": round(_quantile(a["freshness"], 0.95), 2),
        "loop_freshness_p50_s": round(_quantile(a["freshness"], 0.5), 2),
        "loop_freshness_steps": len(a["freshness"]),
        "loop_async_speedup": round(a_rate / s_rate, 2) if s_rate else None,  # sync trained nothing: undefined
        "loop_async_samples_per_s": round(a_rate, 3), "loop_sync_samples_per_s": round(s_rate, 3),
        "loop_async_versions": a["versions"], "loop_sync_versions": s["versions"], "loop_sync_rounds": s["rounds"],
        "loop_budget_s": budget_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall clock of each run, seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trajpipe-bench-loop-") as tmp:
        print(json.dumps(bench_loop(args.workdir or Path(tmp), budget_s=args.budget_s)), flush=True)


if __name__ == "__main__":
    main()
