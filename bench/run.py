"""`make bench`: every benchmark in one run, on one broker, side by side.

Writes ``bench/results/latest.json`` — one flat JSON object of named figures —
and prints a readable table. Ratios compare two implementations measured in
the same run on the same data, so the shared machine's noise mostly cancels.
A full run replaces the file; a subset run replaces only its benchmarks' keys
and keeps the others (each ratio is still measured within one benchmark).

Usage::

    make bench                        # all benchmarks
    .venv/bin/python -m bench.run codec producer   # a subset, by name
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

__all__ = ["BenchContext", "BENCHMARKS", "main"]

RESULTS = Path(__file__).with_name("results")


class BenchContext:
    """Shared resources: one broker and one scratch directory for the whole run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._broker = None

    @property
    def bootstrap(self) -> str:
        if self._broker is None:
            from streams.broker import free_port, start_broker

            self._broker = start_broker(engine="kafka", port=free_port(), data_dir=self.workdir / "broker")
        return self._broker.bootstrap

    def close(self) -> None:
        if self._broker is not None:
            from streams.broker import stop_broker

            stop_broker(self._broker.data_dir)


def _codec(ctx: BenchContext) -> dict:
    from bench.codec import bench_codec

    return bench_codec()


def _producer(ctx: BenchContext) -> dict:
    from bench.producer import bench_producer

    return bench_producer(ctx.bootstrap, ctx.workdir / "producer")


def _pipeline(ctx: BenchContext) -> dict:
    from bench.pipeline import bench_pipeline

    return bench_pipeline(ctx.bootstrap, ctx.workdir / "pipeline")


def _flink_cluster(ctx: BenchContext) -> dict:
    from bench.flink_cluster import bench_flink_cluster

    return bench_flink_cluster(ctx.bootstrap, ctx.workdir / "flink_cluster")


def _scale(ctx: BenchContext) -> dict:
    from bench.scale import bench_scale_in_child

    # 10k, 100k and 1M events through the batch job (~4 min here); TRAJPIPE_BENCH_SCALE_MAX_EVENTS caps it.
    return bench_scale_in_child(ctx.bootstrap, ctx.workdir / "scale")


def _sandbox(ctx: BenchContext) -> dict:
    from rollout.bench_sandbox import measure_start

    return measure_start(n=50)


def _rollout(ctx: BenchContext) -> dict:
    from bench.rollout import bench_rollout

    return bench_rollout(ctx.bootstrap, ctx.workdir / "rollout")


def _round_trip(ctx: BenchContext) -> dict:
    from bench.round_trip import bench_round_trip

    return bench_round_trip(ctx.bootstrap, ctx.workdir / "round_trip")


def _trainer(ctx: BenchContext) -> dict:
    from bench.trainer import bench_loader

    return bench_loader(ctx.workdir / "trainer")


def _faults(ctx: BenchContext) -> dict:
    from bench.faults import run_faults

    # Its own broker (it kills and restarts it); fewer faults than `make faults`.
    f = run_faults(ctx.workdir / "faults", min_faults=15, min_duration_s=60)
    return {"faults_survived": f["faults"] if f["ok"] else 0, "events_lost": f["events_lost"],
            "faults_events_acknowledged": f["events_acknowledged"], "faults_duration_s": f["duration_s"]}


def _learning(ctx: BenchContext) -> dict:
    import os

    from bench.learning import LearningSetup, bench_learning

    # `make bench`: a short online loop (240 s); the 15-minute figure: TRAJPIPE_BENCH_LOOP_BUDGET_S=900.
    budget = float(os.environ.get("TRAJPIPE_BENCH_LOOP_BUDGET_S", 240))
    figures = bench_learning(ctx.bootstrap, ctx.workdir / "learning", LearningSetup(budget_s=budget))
    RESULTS.mkdir(exist_ok=True)  # the curve (per version, domain and level) beside latest.json
    (RESULTS / "learning_curve.json").write_bytes((ctx.workdir / "learning" / "curve.json").read_bytes())
    return figures


def _analytics(ctx: BenchContext) -> dict:
    from bench.analytics import bench_analytics

    return bench_analytics(ctx.workdir / "analytics")


def _loop(ctx: BenchContext) -> dict:
    from bench.loop import bench_loop

    # Its own brokers (one per run); a small budget here, `python -m bench.loop --budget-s 600` for a longer run.
    return bench_loop(ctx.workdir / "loop", budget_s=240.0)


BENCHMARKS: dict[str, Callable[[BenchContext], dict]] = {
    "codec": _codec,
    "producer": _producer,
    "pipeline": _pipeline,
    "flink_cluster": _flink_cluster,
    "scale": _scale,
    "sandbox": _sandbox,
    "rollout": _rollout,
    "round_trip": _round_trip,
    "trainer": _trainer,
    "faults": _faults,
    "learning": _learning,
    "analytics": _analytics,
    "loop": _loop,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    logging.basicConfig(level=logging.WARNING)
    names = args.names or list(BENCHMARKS)
    results: dict[str, float] = {}
    failed: list[str] = []
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="trajpipe-bench-") as tmp:
        ctx = BenchContext(Path(tmp))
        try:
            for name in names:
                console.print(f"[bold]bench {name}[/bold] ...")
                t0 = time.perf_counter()
                try:
                    figures = BENCHMARKS[name](ctx)
                except Exception:  # a broken benchmark must not hide the others' figures
                    console.print(f"[red]bench {name} failed[/red]\n{traceback.format_exc()}")
                    failed.append(name)
                    continue
                results.update(figures)
                console.print(f"  done in {time.perf_counter() - t0:.0f} s")
        finally:
            ctx.close()
    RESULTS.mkdir(exist_ok=True)
    latest = RESULTS / "latest.json"
    if args.names and latest.exists():  # a subset: the other benchmarks' figures stay
        results = {**json.loads(latest.read_text()), **results}
    latest.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    table = Table("figure", "value", title="trajpipe bench (bench/results/latest.json)")
    for key, value in sorted(results.items()):
        table.add_row(key, f"{value:,}" if isinstance(value, (int, float)) else str(value))
    Console().print(table)
    if failed:
        console.print(f"[red]failed benchmarks: {', '.join(failed)}[/red]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
