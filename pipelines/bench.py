"""Benchmark: the Beam trajectory job vs the polars reference on the same archive files.

Run::

    python -m pipelines.bench --archive data/archive --out /tmp/bench-datasets

Figures: ``pipeline_archive_events_per_s`` (Beam, FnApiRunner, archive →
committed datasets), ``polars_archive_events_per_s`` (polars, same files →
steps Parquet) and their ratio ``pipeline_archive_vs_polars`` (goal >= 0.25).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.archive_source import list_archive_files
from pipelines.inputs import ArchiveInput
from pipelines.polars_ref import run_polars
from pipelines.recipes import load_recipe
from pipelines.batch_job import run_batch

__all__ = ["bench_archive"]


def bench_archive(archive_dir: str | Path, out_dir: str | Path, *, recipe: str = "outcome",
                  repeats: int = 3) -> dict[str, float]:
    """Run both implementations on the archive's committed files; events/s of each and the ratio.

    ``out_dir`` is emptied first (both write under it). Domain verifiers run
    in neither (the reference has none), so both do the same work. The two
    run interleaved ``repeats`` times each; the best time of each counts.
    """
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    rec = load_recipe(recipe)
    files = [f.path for f in list_archive_files(archive_dir)]
    events = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    beam_s, polars_s = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        counts = run_batch(out=out / f"beam-{i}", recipe=rec, input=ArchiveInput(archive_dir),
                           use_domain_verifiers=False)
        beam_s.append(time.perf_counter() - t0)
        if counts["events_in"] != events:
            raise RuntimeError(f"the Beam job read {counts['events_in']} events of {events}")
        t0 = time.perf_counter()
        run_polars(files, rec, out / f"polars-{i}")
        polars_s.append(time.perf_counter() - t0)
        shutil.rmtree(out)

    beam_eps, polars_eps = events / min(beam_s), events / min(polars_s)
    return {
        "pipeline_archive_events_per_s": round(beam_eps, 1),
        "polars_archive_events_per_s": round(polars_eps, 1),
        "pipeline_archive_vs_polars": round(beam_eps / polars_eps, 3),
    }


def run(argv: list[str] | None = None) -> dict[str, float]:
    """Command line: ``--archive DIR --out DIR [--recipe NAME]``."""
    parser = argparse.ArgumentParser(prog="pipelines.bench")
    parser.add_argument("--archive", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", default="outcome")
    args = parser.parse_args(argv)
    return bench_archive(args.archive, args.out, recipe=args.recipe)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(run()), flush=True)
