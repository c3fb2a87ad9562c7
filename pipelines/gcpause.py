"""Pause Python's cyclic garbage collector over allocation-heavy, cycle-free sections.

Building an Arrow table from tens of thousands of row objects, or events from
an archive file, allocates so many containers that the collector runs its
young-generation pass every 700 allocations and, every so often, a full pass
over every live object of the worker (all the episodes of the bundle): in the
trajectory job that was more than half of the row-table build time. The
sections wrapped here create no reference cycles, so nothing is lost by
collecting after them instead of during them.

A whole in-process job run (FnApiRunner executes every bundle in the
driver's process) is wrapped in :func:`gc_frozen` instead: it still collects,
but each full pass no longer walks every object that was alive before the
run (modules, Beam, Arrow: most of the heap), which was three quarters of the
collector's time in a 100k-event batch.

Examples:
    >>> import gc
    >>> with gc_paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    >>> with gc_frozen():
    ...     gc.get_freeze_count() > 0
    True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused", "gc_frozen"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (re-enabled after, if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Leave every object alive now out of the collector's passes during the block (``gc.freeze``).

    The collector stays on for what the block allocates; afterwards the frozen
    objects go back to the oldest generation (``gc.unfreeze``), so garbage among
    them is collected later, never leaked.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
