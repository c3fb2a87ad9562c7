"""The fault-injection suite, short: a few real SIGKILLs, broker restarts and a full spool disk under load.

`make faults` runs the long version (>= 50 faults, bench/faults.py); this one injects a handful and
checks the same reconciliation: nothing acknowledged lost, every complete episode once in the dataset,
the counts balance and the trainer's samples continue exactly across its crashes.
"""

from __future__ import annotations

import pytest

from bench.faults import run_faults

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1800)]


def test_faults_lose_nothing_and_duplicate_nothing(tmp_path):
    weights = {"kill_synth": 1.0, "kill_rollout": 1.0, "kill_archiver": 1.5, "kill_pipeline": 1.5,
               "kill_trainer": 1.0, "kill_broker": 1.0, "spool_full": 0.01}  # spool_full: once, forced
    f = run_faults(tmp_path / "work", min_faults=6, min_duration_s=90, max_duration_s=600, seed=1, weights=weights)
    print(f)
    assert f["faults"] >= 6
    assert f["events_acknowledged"] > 0 and f["events_lost"] == 0, f
    assert f["archive_duplicate_records"] == 0 and f["archive_missing_records"] == 0, f
    assert (f["dataset_duplicates"], f["dataset_missing"], f["dataset_unexpected"], f["step_duplicates"]) == (0, 0, 0, 0), f
    assert f["episodes_complete"] > 0
    assert (f["offset_gaps_or_overlaps"], f["commits_unbalanced"], f["counts_balance"]) == (0, 0, 0), f
    assert f["trainer_redo_mismatches"] == 0 and f["trainer_sequence_mismatches"] in (0, None), f
    assert f["spool_full_hangs"] == 0, f
    assert f["ok"], f
