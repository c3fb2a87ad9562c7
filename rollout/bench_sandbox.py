"""Sandbox start-up benchmark: time from ``Sandbox.create()`` to the first command's exit.

Run it with ``python -m rollout.bench_sandbox [N]``; it prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from rollout.sandbox import Sandbox, SandboxLimits

__all__ = ["measure_start"]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    rank = max(1, int(round(q / 100.0 * len(sorted_values) + 0.5 - 1e-9)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def measure_start(n: int = 50, *, workdir_root: str | None = None) -> dict[str, float]:
    """Create ``n`` sandboxes one after another and run ``/bin/true`` in each.

    Each sample covers directory and uid set-up, the bwrap/prlimit spawn, the
    namespaces, the command and the before/after manifests; i.e. what a rollout
    worker waits for before the policy's first command has its result.

    Args:
        n: number of sandboxes to start (>= 1).
        workdir_root: where to make them (default: a fresh temp directory).

    Returns:
        ``{"sandbox_start_p50_ms": .., "sandbox_start_p95_ms": .., "sandbox_start_n": n}``.
    """
    if n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}")
    samples: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sbbench-") as tmp:
        os.chmod(tmp, 0o711)  # the sandbox uid must be able to traverse it
        root = workdir_root or tmp
        Sandbox.create(root).close()  # warm the one-time host probe
        for _ in range(n):
            t0 = time.perf_counter()
            with Sandbox.create(root, SandboxLimits()) as sb:
                result = sb.run(["/bin/true"])
                samples.append((time.perf_counter() - t0) * 1000.0)
            if result.exit_status != 0:
                raise RuntimeError(f"/bin/true failed in the sandbox: {result}")
    samples.sort()
    return {
        "sandbox_start_p50_ms": round(_percentile(samples, 50), 2),
        "sandbox_start_p95_ms": round(_percentile(samples, 95), 2),
        "sandbox_start_n": n,
    }


if __name__ == "__main__":
    print(json.dumps(measure_start(int(sys.argv[1]) if len(sys.argv) > 1 else 50)))
