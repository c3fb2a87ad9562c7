"""Test-only hooks into the archiver: a simulated crash between a commit's data files and its manifest.

Nothing outside ``tests/`` sets these; :func:`streams.archive.write_commit` and
:class:`streams.archive.Archiver` carry no test parameter (the pipelines' hooks,
``pipelines/testhooks.py``, work the same way; ``streams`` cannot import ``pipelines``).
A hook is armed for the duration of a ``with`` block, in the process that writes the
commits::

    with testhooks.crash_before_manifest(2), pytest.raises(ArchiveError, match="simulated crash"):
        archiver.run()   # commit 1 is written; commit 2's data files stay under temporary names

Examples:
    >>> with crash_before_manifest(2):
    ...     crashes_before_manifest(1), crashes_before_manifest(2)
    (False, True)
    >>> crashes_before_manifest(2)
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["crash_before_manifest", "crashes_before_manifest"]

_crash_before_manifest: int | None = None


@contextlib.contextmanager
def crash_before_manifest(commit: int) -> Iterator[None]:
    """Within the block, writing archive commit ``commit`` raises ``ArchiveError`` after its data files, before
    its manifest (the files stay under their temporary names, as after a crash)."""
    global _crash_before_manifest
    before, _crash_before_manifest = _crash_before_manifest, commit
    try:
        yield
    finally:
        _crash_before_manifest = before


def crashes_before_manifest(commit: int) -> bool:
    """Whether a simulated crash is armed before commit ``commit``'s manifest (asked by ``write_commit``)."""
    return _crash_before_manifest == commit
