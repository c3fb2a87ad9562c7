"""Sandbox start-up benchmark: time from ``Sandbox.create()`` to the first command's exit.

Run it with ``python -m rollout.bench_sandbox [N] [--worker-rss-mib M]``; it prints one JSON object.
``--worker-rss-mib`` makes the measuring process hold M MiB of touched memory first, as a
rollout worker holding a policy model does (a spawn that forks the worker pays for its size).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from rollout.sandbox import Sandbox, SandboxLimits

__all__ = ["measure_start"]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    rank = max(1, int(round(q / 100.0 * len(sorted_values) + 0.5 - 1e-9)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def measure_start(n: int = 50, *, workdir_root: str | None = None, worker_rss_mib: int = 0) -> dict[str, float]:
    """Create ``n`` sandboxes one after another and run ``/bin/true`` in each.

    Each sample covers directory and uid set-up, the bwrap/prlimit spawn, the
    namespaces, the command and the before/after manifests; i.e. what a rollout
    worker waits for before the policy's first command has its result.

    Args:
        n: number of sandboxes to start (>= 1).
        workdir_root: where to make them (default: a fresh temp directory).
        worker_rss_mib: hold this much touched memory while measuring (a worker with a model).

    Returns:
        ``{"sandbox_start_p50_ms": .., "sandbox_start_p95_ms": .., "sandbox_start_n": n}``.
    """
    if n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}")
    if worker_rss_mib < 0:
        raise ValueError(f"`worker_rss_mib` must be >= 0, got {worker_rss_mib}")
    ballast = bytearray(worker_rss_mib << 20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page
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
    del ballast
    samples.sort()
    return {
        "sandbox_start_p50_ms": round(_percentile(samples, 50), 2),
        "sandbox_start_p95_ms": round(_percentile(samples, 95), 2),
        "sandbox_start_n": n,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.bench_sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=50, help="sandboxes to start (default 50)")
    parser.add_argument("--worker-rss-mib", type=int, default=0, help="memory the measuring process holds")
    args = parser.parse_args(argv)
    if args.n < 1 or args.worker_rss_mib < 0:
        parser.error("N must be >= 1 and --worker-rss-mib >= 0")
    print(json.dumps(measure_start(args.n, worker_rss_mib=args.worker_rss_mib)))


if __name__ == "__main__":
    main()
