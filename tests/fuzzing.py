"""Shared pieces of the fuzz tests (``-m fuzz``): Hypothesis profiles, input counts, memory bounds.

``make test`` runs every fuzz test under the ``ci`` profile (a modest, derandomized
number of examples); ``make fuzz`` runs them under the ``fuzz`` profile
(``TRAJPIPE_FUZZ_EXAMPLES`` examples per test, random seeds) and prints, as its
last line, the inputs tried per target::

    {"fuzz_decoder": N, "fuzz_archive": N, "fuzz_settings": N, "fuzz_spool": N, "failures": 0}

Every target's property is the same: each input is accepted, or rejected with
the component's typed error (or routed to a dead letter); no other exception,
no hang (each example is bounded by the input size) and no allocation far
beyond the input's size (:func:`python_memory_bound`, :func:`check_arrow_memory`).
"""

from __future__ import annotations

from hypothesis import strategies as st

import os
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
from hypothesis import HealthCheck, settings

__all__ = ["COUNTS", "tried", "python_memory_bound", "check_arrow_memory", "register_profiles"]

#: Inputs tried per fuzz target in this session.
COUNTS: Counter[str] = Counter()
#: The targets, in report order.
TARGETS = ("fuzz_decoder", "fuzz_archive", "fuzz_settings", "fuzz_spool")


def register_profiles() -> None:
    """``ci`` (default: 60 derandomized examples per test) and ``fuzz`` (``TRAJPIPE_FUZZ_EXAMPLES``, default 1000)."""
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                        HealthCheck.data_too_large, HealthCheck.filter_too_much])
    settings.register_profile("ci", max_examples=60, derandomize=True, database=None, **common)
    settings.register_profile("fuzz", max_examples=int(os.environ.get("TRAJPIPE_FUZZ_EXAMPLES", "1000")), **common)
    settings.load_profile("ci")  # `--hypothesis-profile fuzz` (make fuzz) replaces it


def tried(target: str) -> None:
    """Count one input of ``target``."""
    assert target in TARGETS, target
    COUNTS[target] += 1


@contextmanager
def python_memory_bound(limit_bytes: int) -> Iterator[None]:
    """Assert the code in the block allocates (at its peak) less than ``limit_bytes`` of Python heap.

    Traced with tracemalloc only inside the block, so the fuzzer's own work is not slowed down. A reader that
    trusts a length prefix (``f.read(length)``, ``bytearray(length)``) shows up here: CPython allocates the whole
    claimed size before reading.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
    assert peak < limit_bytes, f"one input allocated {peak:,} bytes (limit {limit_bytes:,})"


class ArrowMemory:
    """Arrow's default pool must not reach a new high far above where it was at the start."""

    def __init__(self, limit_bytes: int) -> None:
        self._pool = pa.default_memory_pool()
        self._limit = max(self._pool.max_memory(), pa.total_allocated_bytes()) + limit_bytes

    def check(self) -> None:
        peak = self._pool.max_memory()
        assert peak < self._limit, f"Arrow's pool peaked at {peak:,} bytes (limit {self._limit:,})"


def check_arrow_memory(limit_bytes: int) -> ArrowMemory:
    """A checker of Arrow's pool high-water mark, ``limit_bytes`` above the current one."""
    return ArrowMemory(limit_bytes)


def flip_bits(draw, buf: bytes, *, max_flips: int) -> bytes:
    """``buf`` with 1..``max_flips`` bits flipped at positions Hypothesis draws (``draw`` of an ``st.composite``)."""
    out = bytearray(buf)
    for pos in draw(st.lists(st.integers(0, len(out) * 8 - 1), min_size=1, max_size=max_flips)):
        out[pos // 8] ^= 1 << (pos % 8)
    return bytes(out)
