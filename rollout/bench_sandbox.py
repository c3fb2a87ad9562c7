"""Sandbox start-up benchmark: time from ``Sandbox.create()`` to the first command's exit.

Run it with ``python -m rollout.bench_sandbox [N] [--worker-rss-mib M] [--gap-ms G] [--compare]``;
it prints one JSON object. ``--worker-rss-mib`` makes the measuring process hold M MiB of
touched memory first, as a rollout worker holding a policy model does (a spawn that forks the
worker pays for its size). ``--gap-ms`` pauses between starts, as a worker does while the policy
thinks (the host's CPUs go idle and the cgroup attach's RCU grace period is no longer warm).
``--compare`` alternates starts with the network namespace made ahead (``prepared_netns=True``,
the default) and made by bwrap (``prepared_netns=False``) in one run, and prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

from rollout.sandbox import Sandbox, SandboxLimits

__all__ = ["measure_start", "compare_start"]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    rank = max(1, int(round(q / 100.0 * len(sorted_values) + 0.5 - 1e-9)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _figures(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "sandbox_start_p50_ms": round(_percentile(samples, 50), 2),
        "sandbox_start_p95_ms": round(_percentile(samples, 95), 2),
        "sandbox_start_n": len(samples),
    }


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and of the children it reaped."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _check_args(n: int, worker_rss_mib: int, gap_ms: float) -> None:
    if n < 1:
        raise ValueError(f"`n` must be >= 1, got {n}")
    if worker_rss_mib < 0:
        raise ValueError(f"`worker_rss_mib` must be >= 0, got {worker_rss_mib}")
    if gap_ms < 0:
        raise ValueError(f"`gap_ms` must be >= 0, got {gap_ms}")


def _time_starts(variants: dict[str, dict], n: int, *, workdir_root: str | None, worker_rss_mib: int,
                 gap_ms: float) -> tuple[dict[str, list[float]], float]:
    """``n`` starts of each variant (Sandbox keyword arguments), alternating.

    Returns:
        Milliseconds per start by variant, and the CPU milliseconds spent per sandbox over the loop
        (creates, runs, closes and the pools' background work, in the worker and every process it reaped).
    """
    ballast = bytearray(worker_rss_mib << 20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="sbbench-") as tmp:
        os.chmod(tmp, 0o711)  # the sandbox uid must be able to traverse it
        root = workdir_root or tmp
        for kwargs in variants.values():
            Sandbox.create(root, **kwargs).close()  # warm the one-time host probe (and the pools)
        cpu_before = _cpu_s()
        for _ in range(n):
            for name, kwargs in variants.items():
                if gap_ms:
                    time.sleep(gap_ms / 1000.0)
                t0 = time.perf_counter()
                with Sandbox.create(root, SandboxLimits(), **kwargs) as sb:
                    result = sb.run(["/bin/true"])
                    samples[name].append((time.perf_counter() - t0) * 1000.0)
                if result.exit_status != 0:
                    raise RuntimeError(f"/bin/true failed in the sandbox: {result}")
        cpu_ms = (_cpu_s() - cpu_before) * 1000.0 / (n * len(variants))
    del ballast
    return samples, cpu_ms


def measure_start(n: int = 50, *, workdir_root: str | None = None, worker_rss_mib: int = 0,
                  gap_ms: float = 0.0, prepared_netns: bool = True) -> dict[str, float]:
    """Create ``n`` sandboxes one after another and run ``/bin/true`` in each.

    Each sample covers directory and uid set-up, the bwrap/prlimit spawn, the
    namespaces, the command and the before/after manifests; i.e. what a rollout
    worker waits for before the policy's first command has its result.

    Args:
        n: number of sandboxes to start (>= 1).
        workdir_root: where to make them (default: a fresh temp directory).
        worker_rss_mib: hold this much touched memory while measuring (a worker with a model).
        gap_ms: pause this long before each start (>= 0).
        prepared_netns: passed to :class:`~rollout.sandbox.Sandbox`.

    Returns:
        ``{"sandbox_start_p50_ms": .., "sandbox_start_p95_ms": .., "sandbox_start_n": n,
        "sandbox_start_cpu_ms": ..}``; the last is the mean CPU time per sandbox (worker and the
        processes it reaped, create to close), which other tenants of a busy host change far less than
        the wall-clock figures.
    """
    _check_args(n, worker_rss_mib, gap_ms)
    samples, cpu_ms = _time_starts({"only": {"prepared_netns": prepared_netns}}, n, workdir_root=workdir_root,
                                   worker_rss_mib=worker_rss_mib, gap_ms=gap_ms)
    return {**_figures(samples["only"]), "sandbox_start_cpu_ms": round(cpu_ms, 2)}


def compare_start(n: int = 50, *, workdir_root: str | None = None, worker_rss_mib: int = 0,
                  gap_ms: float = 0.0) -> dict[str, dict[str, float]]:
    """:func:`measure_start` with and without ``prepared_netns``, alternating start by start (side by side).

    Returns:
        ``{"prepared_netns": {...figures}, "bwrap_netns": {...figures}}``.
    """
    _check_args(n, worker_rss_mib, gap_ms)
    samples, _ = _time_starts({"prepared_netns": {"prepared_netns": True}, "bwrap_netns": {"prepared_netns": False}},
                              n, workdir_root=workdir_root, worker_rss_mib=worker_rss_mib, gap_ms=gap_ms)
    return {name: _figures(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.bench_sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=50, help="sandboxes to start (default 50)")
    parser.add_argument("--worker-rss-mib", type=int, default=0, help="memory the measuring process holds")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="pause before each start (default 0)")
    parser.add_argument("--compare", action="store_true",
                        help="alternate prepared_netns=True/False starts and print both")
    args = parser.parse_args(argv)
    if args.n < 1 or args.worker_rss_mib < 0 or args.gap_ms < 0:
        parser.error("N must be >= 1, --worker-rss-mib >= 0 and --gap-ms >= 0")
    if args.compare:
        print(json.dumps(compare_start(args.n, worker_rss_mib=args.worker_rss_mib, gap_ms=args.gap_ms)))
    else:
        print(json.dumps(measure_start(args.n, worker_rss_mib=args.worker_rss_mib, gap_ms=args.gap_ms)))


if __name__ == "__main__":
    main()
