"""The sandbox start benchmark's options: the CPU figure, a pause between starts, the side-by-side comparison."""

from __future__ import annotations

import pytest

from rollout.bench_sandbox import compare_start, measure_start


def test_measure_start_reports_cpu_per_sandbox_and_takes_a_gap(sandbox_root):
    out = measure_start(3, workdir_root=sandbox_root, gap_ms=5)
    assert out["sandbox_start_n"] == 3
    assert 0 < out["sandbox_start_p50_ms"] <= out["sandbox_start_p95_ms"]
    # bwrap, prlimit and the command are reaped children: every start costs some CPU
    assert out["sandbox_start_cpu_ms"] > 0


def test_compare_start_measures_both_kinds_alternately(sandbox_root):
    out = compare_start(2, workdir_root=sandbox_root)
    assert set(out) == {"prepared_netns", "bwrap_netns"}
    for figures in out.values():
        assert figures["sandbox_start_n"] == 2 and 0 < figures["sandbox_start_p50_ms"] <= figures["sandbox_start_p95_ms"]


@pytest.mark.parametrize("kwargs, name", [({"n": 0}, "`n`"), ({"n": 1, "gap_ms": -1}, "`gap_ms`"),
                                          ({"n": 1, "worker_rss_mib": -1}, "`worker_rss_mib`")])
def test_bad_arguments_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        measure_start(**kwargs)
    with pytest.raises(ValueError, match=name):
        compare_start(**kwargs)
