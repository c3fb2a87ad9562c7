"""CommittedView: what earlier commits hold, looked up by the workers at run time.

A micro-batch must know which episodes earlier commits of its dataset
version emitted (their events again are duplicates), which ones they wrote
only as incomplete (their new events are late) and the events kept for those
(the late state), and which feedback event ids they hold. Pickling those sets
into the job graph makes the graph grow with the dataset's history: every
micro-batch of a ``--loop`` ships every episode id ever committed to every
worker. Instead the driver ships a :class:`CommittedView` — the dataset root,
the version and the number of the last commit the run builds on, a few dozen
bytes whatever the history — and each worker reads the committed state from
the dataset's own files the first time a DoFn needs it (``DoFn.setup``):
the ``episode_id``/``complete`` columns of the committed trajectory and
evaluation files, the held groups' rows and the late-state files the
manifests name (:mod:`pipelines.commit`). Commits are immutable and numbered,
so "commits 1..n" is the same set on every worker and on the driver; a
worker process reads it once and keeps it for the DoFns that share it (the
newest two views are cached).

Examples:
    >>> view = CommittedView(out="/data", version="outcome-0a1b2c3d", recipe_hash="0a1b", through=0)
    >>> view.load().emitted, view.feedback_ids()
    (frozenset(), frozenset())
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgspec

from pipelines.late import LateState

__all__ = ["CommittedView", "CommittedState"]


class CommittedState(msgspec.Struct, frozen=True):
    """The committed state a run builds on (read by :meth:`CommittedView.load`).

    Attributes:
        emitted: episodes written complete, or held in a GRPO group (their events again are duplicates).
        late: the late state (:func:`pipelines.commit.load_late_state`): episodes written only as
            incomplete, and their kept events within the retention.
        incomplete: episodes written as incomplete and never as complete (the stream drops pending
            fragments of these and of ``emitted``).
    """

    emitted: frozenset[str] = frozenset()
    late: LateState = LateState()
    incomplete: frozenset[str] = frozenset()


class CommittedView(msgspec.Struct, frozen=True, kw_only=True):
    """Commits ``1..through`` of one dataset version, by reference (what the job graph carries).

    Attributes:
        out: the dataset root (a filesystem the workers share with the driver).
        version: the dataset version ``<recipe name>-<hash8>``.
        recipe_hash: the recipe's full hash.
        through: the last commit the run builds on (0: none).
        stamp: that commit's ``created_at`` (ISO 8601): a dataset directory deleted and rebuilt under
            the same path is not taken for the one a worker cached.
        late_retention_s: ``--late-retention``: kept events older than this before the last
            commit's clock are not read.
    """

    out: str
    version: str
    recipe_hash: str
    through: int
    stamp: str = ""
    late_retention_s: float = 0.0

    @classmethod
    def of(cls, layout, manifests, *, late_retention_s: float = 0.0) -> "CommittedView":
        """The view of ``manifests`` (all the committed manifests of ``layout``'s version)."""
        return cls(out=layout.out, version=layout.version, recipe_hash=layout.recipe_hash, through=len(manifests),
                   stamp=manifests[-1].created_at.isoformat() if manifests else "",
                   late_retention_s=late_retention_s)

    def _manifests(self):
        from pipelines.commit import DatasetLayout, read_manifests

        layout = DatasetLayout(out=self.out, version=self.version, recipe_hash=self.recipe_hash)
        manifests = read_manifests(layout)[: self.through] if self.through else []
        if len(manifests) < self.through or (self.stamp and manifests[-1].created_at.isoformat() != self.stamp):
            from pipelines.commit import CommitError

            raise CommitError(f"{layout.log.root} is not the dataset the job was planned on (commit {self.through} "
                              f"made at {self.stamp or '?'}): was the dataset directory replaced while the job ran?")
        return layout, manifests

    def load(self) -> CommittedState:
        """The committed state (read once per process and view; see the module docstring).

        Raises:
            pipelines.commit.CommitError: a manifest or a state file it names is missing or unreadable.
        """
        return _cached(("state", self), self._load)

    def _load(self) -> CommittedState:
        from pipelines.commit import committed_episodes, held_episode_ids, load_held_state, load_late_state

        if not self.through:
            return CommittedState()
        layout, manifests = self._manifests()
        committed = committed_episodes(layout, manifests)
        emitted = frozenset(committed.complete | held_episode_ids(load_held_state(layout, manifests)))
        late = load_late_state(layout, manifests, emitted=emitted, incomplete=committed.incomplete,
                               clock_s=manifests[-1].clock_s, retention_s=self.late_retention_s)
        return CommittedState(emitted=emitted, late=late, incomplete=committed.incomplete)

    def feedback_ids(self) -> frozenset[str]:
        """``event_id`` of every feedback row of commits ``1..through`` (:func:`pipelines.feedback.committed_feedback_ids`)."""
        from pipelines.feedback import committed_feedback_ids

        if not self.through:
            return frozenset()
        return _cached(("feedback", self), lambda: committed_feedback_ids(self.out, self._manifests()[1]))


_CACHE: OrderedDict = OrderedDict()
_LOCK = threading.Lock()
_KEEP = 4  # two views (a --loop's consecutive micro-batches) x (state, feedback)


def _cached(key, load):
    # One read per worker process: the DoFns of one job (and their bundles, on several threads) share it.
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        value = load()
        _CACHE[key] = value
        while len(_CACHE) > _KEEP:
            _CACHE.popitem(last=False)
        return value
