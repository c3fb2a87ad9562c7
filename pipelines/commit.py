"""The dataset commit protocol: staged files → commit ``n`` of the version's commit log (commit point) → renames.

Layout under ``<out>`` for dataset version ``V = <recipe name>-<hash8>``::

    steps/recipe=V/domain=D/c<n>-s<k>.parquet          data (visible once committed)
    trajectories/recipe=V/domain=D/c<n>-s<k>.parquet
    evaluations/recipe=V/domain=D/c<n>.parquet           evaluation episodes (pipelines.evaluations)
    dead_letters/recipe=V/c<n>.parquet
    _commit_log/V/_delta_log/<n>.json                   commit n (the commit point): its manifest
    _state/norm-<recipe hash>.json                      persisted normalization statistics
    _state/V/pending-<n>.arrow                          events of unfinished episodes after commit n
    _state/V/groups-<n>.json                            GRPO groups held after commit n (pipelines.groups)
    _state/V/held-<n>/domain=D/s<k>.{trajectories,steps}.arrow   their rows (un-normalized)
    _state/V/late-<n>.arrow                             events of episodes written incomplete (pipelines.late)
    late_events/recipe=V/c<n>.parquet                   late events (archive schema + late_reason)
    _staging/V/<n>/...                                  files of commit n before it is committed
    _manifests/V/<n>.json                               (legacy) commit n before the commit log

The commit log (:class:`schemas.commit_log.CommitLog`, ``schemas.manifests.commit_log_of``) is a
Delta table with no data files: its version ``n`` is commit ``n``, and its record is the commit's
:class:`DatasetManifest` (JSON). A run reads a snapshot of it (:func:`read_snapshot`), plans
commit ``n`` = head + 1 from its manifests, and commits against that snapshot.

Commit ``n`` (driver side, after the Beam job has written ``_staging/V/<n>/``):

1. merge this run's statistics into the persisted ones, stage the result;
2. make commit ``n`` of the log against the run's snapshot: the **commit point**; its
   manifest names every file (staged and final path, rows), the input it covers (archive
   commits or Kafka offsets), the counts, the event-time clock and the state files. If
   another writer committed since the snapshot, the log refuses it (``CommitTaken``): the
   run's staging is deleted and :class:`CommitConflict` raised;
3. rename every staged file into place (``os.replace``; on an object store a
   copy + delete, redone by :func:`recover` after a crash), then drop the
   staging directory, older pending files, late-state files the manifest
   no longer names (and older held-group state when the commit wrote its own);
4. add the commit's data files to the Delta tables, one transaction per table
   carrying the batch id (:mod:`pipelines.delta_tables`).

``<out>`` is a local directory or ``s3://BUCKET/PREFIX``: every file goes through
:mod:`schemas.locations`. Locally the runs of one version still take turns on a ``flock``
(:func:`commit_lock`), so a second run waits and commits what the first left uncovered. An object
store has no ``flock``: there each run stages under ``_staging/V/<n>-<run>/``, and of two runs
racing for commit ``n`` the log takes one; the other deletes its staging and raises
:class:`CommitConflict`.

:func:`recover` runs before every job: a version with legacy manifest files and no log has them
imported into the log first (same bytes, in order; then deleted); a staging directory whose commit
the log has is rolled forward (step 3 redone; idempotent), one without is rolled back (deleted), and
every Delta table is brought up to the last commit (:func:`pipelines.delta_tables.roll_forward`). A
crash anywhere plus a rerun therefore yields the same dataset, and a rerun of covered input adds
nothing.

The manifest types (:class:`DatasetManifest`, :class:`CommittedFile`) live in
:mod:`schemas.manifests`, where readers that must not import ``pipelines``
(the trainer) find them; they are re-exported here.

Examples:
    >>> m = DatasetManifest(commit=1, version="outcome-0a1b2c3d", recipe_hash="0a1b", source="archive")
    >>> msgspec.json.decode(msgspec.json.encode(m), type=DatasetManifest).commit
    1
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pipelines import delta_tables, testhooks
from pipelines.groups import GroupState, HeldPart, HeldState
from pipelines.late import LATE_STATE_FILE, LateState, late_state_index, late_state_newest_s
from pipelines.normalize import NormState, RunningStats, load_norm_state
from pipelines.sinks import GROUPS_FILE, HELD_DIR, PENDING_FILE, RUN_STATS_FILE, STAGED_SUFFIX
from schemas import locations as loc
from schemas.commit_log import CommitLog, CommitLogError, CommitTaken, ImportMismatch, Snapshot
from schemas.manifests import (
    MANIFEST_DIR,
    CommittedFile,
    DatasetManifest,
    commit_log_of,
    decode_manifests,
    read_dataset_manifests,
    read_legacy_records,
)
from schemas.storage import fsync_dir

__all__ = [
    "DatasetManifest",
    "CommittedFile",
    "DatasetLayout",
    "CommitError",
    "CommitConflict",
    "read_manifests",
    "read_snapshot",
    "recover",
    "commit_staged",
    "commit_lock",
    "covered_offsets",
    "CommittedEpisodes",
    "committed_episodes",
    "latest_pending_file",
    "load_late_state",
    "carry_late_state",
    "load_held_state",
    "held_episode_ids",
]

_LOG = logging.getLogger(__name__)


class CommitError(RuntimeError):
    """A dataset directory in a state the commit protocol cannot resolve (or a simulated crash)."""


class CommitConflict(CommitError):
    """Another run made this run's commit first (the commit log refused this run's commit: :class:`CommitTaken`).

    Nothing of this run is in the dataset (its staging is deleted); a rerun continues from the winner's commit.
    """

    @classmethod
    def of(cls, commit: int, version: str, out: str) -> "CommitConflict":
        return cls(f"another run committed {commit} of {version} at {out} first; this run's output is discarded "
                   "(nothing of it was committed): rerun to continue from that commit")


class DatasetLayout(msgspec.Struct, frozen=True):
    """Locations of one dataset version under ``out`` (strings: a local path or an ``s3://`` URI).

    Attributes:
        out: the dataset root, a local directory or ``s3://BUCKET/PREFIX`` (:mod:`schemas.locations`).
        version: ``<recipe name>-<hash8>``.
        recipe_hash: the recipe's full hash.
        run: names this run's staging directories ``<n>-<run>`` (object stores: two runs racing for
            commit ``n`` never share, nor delete, each other's staged files); empty: ``<n>``.
    """

    out: str
    version: str
    recipe_hash: str
    run: str = ""

    @property
    def root(self) -> str:
        return self.out if loc.is_remote(self.out) else str(Path(self.out))

    @property
    def remote(self) -> bool:
        """Whether ``out`` is on an object store (no ``flock``, no atomic rename)."""
        return loc.is_remote(self.out)

    def at(self, rel: str) -> str:
        """The location of ``rel`` (a path relative to ``out``)."""
        return loc.join(self.root, rel)

    @property
    def log(self) -> CommitLog:
        """The version's commit log (``_commit_log/<version>/``): commit ``n``'s record is its manifest."""
        return commit_log_of(self.root, self.version)

    @property
    def legacy_manifests(self) -> str:
        """The manifest files of a version written before the commit log (imported by :func:`recover`)."""
        return loc.join(self.root, MANIFEST_DIR, self.version)

    @property
    def staging_root(self) -> str:
        return loc.join(self.root, "_staging", self.version)

    def staging(self, commit: int) -> str:
        return loc.join(self.staging_root, f"{commit:08d}-{self.run}" if self.run else f"{commit:08d}")

    @property
    def norm_file(self) -> str:
        return f"_state/norm-{self.recipe_hash}.json"

    def pending_file(self, commit: int) -> str:
        return f"_state/{self.version}/pending-{commit:08d}.arrow"

    def groups_file(self, commit: int) -> str:
        return f"_state/{self.version}/groups-{commit:08d}.json"

    def held_dir(self, commit: int) -> str:
        return f"_state/{self.version}/held-{commit:08d}"

    def late_state_file(self, commit: int) -> str:
        return f"_state/{self.version}/late-{commit:08d}.arrow"


def read_manifests(layout: DatasetLayout) -> list[DatasetManifest]:
    """The committed manifests of a version, in commit order (a version not imported yet: its legacy files).

    Raises:
        CommitError: the log is unreadable, a record is not a manifest, or the commit numbers have a gap.
    """
    try:
        return read_dataset_manifests(layout.root, layout.version)
    except CommitLogError as err:
        raise CommitError(str(err)) from err


def read_snapshot(layout: DatasetLayout) -> tuple[Snapshot, list[DatasetManifest]]:
    """A writer's read of the commit log: the snapshot to make the next commit against, and its manifests.

    A commit made against the snapshot (:func:`commit_staged`) is refused if another writer committed since,
    so what a run plans from these manifests is what it commits on top of.

    Raises:
        CommitError: as :func:`read_manifests`.
    """
    try:
        snap = layout.log.snapshot()
        return snap, decode_manifests(snap.records(), where=f"{layout.version} at {layout.root}")
    except CommitLogError as err:
        raise CommitError(str(err)) from err


def _staging_of(manifest: DatasetManifest) -> str:
    """The staging directory (relative to ``<out>``) the manifest's files were staged in."""
    return "/".join(manifest.files[0].staged.split("/")[:3]) if manifest.files else ""


def _roll_forward(layout: DatasetLayout, manifest: DatasetManifest) -> int:
    moved = 0
    for f in manifest.files:
        src, dst = layout.at(f.staged), layout.at(f.path)
        if loc.exists(src):
            loc.move(src, dst)
            moved += 1
    if not layout.remote:
        for d in {os.path.dirname(layout.at(f.path)) for f in manifest.files}:
            if os.path.exists(d):
                fsync_dir(Path(d))
    if manifest.files:
        loc.delete_dir(layout.at(_staging_of(manifest)))
    if not layout.remote:  # (an object store has no directories to remove)
        for d in (layout.staging_root, os.path.dirname(layout.staging_root)):
            if os.path.exists(d) and not os.listdir(d):
                os.rmdir(d)
    state = layout.at(f"_state/{layout.version}")
    names = loc.list_dir(state)

    def rel(name: str) -> str:
        return f"_state/{layout.version}/{name}"

    # Held-group state of earlier commits is superseded by this one's, if it wrote one.
    if manifest.groups_file is not None:
        for name in names:
            if name.startswith("groups-") and name.endswith(".json") and rel(name) != manifest.groups_file:
                loc.delete_file(layout.at(rel(name)))
            if name.startswith("held-") and rel(name) != layout.held_dir(manifest.commit):
                loc.delete_dir(layout.at(rel(name)))
    for name in names:  # every commit names the live late-state files
        if name.startswith("late-") and name.endswith(".arrow") and rel(name) not in manifest.late_state:
            loc.delete_file(layout.at(rel(name)))
    # Pending state of earlier commits is superseded by this one's. A stream window commit
    # writes none and supersedes nothing: the stream's pending state is written when it stops.
    if manifest.mode == "stream" and manifest.pending_file is None:
        return moved
    keep = {manifest.pending_file}
    for name in names:
        if name.startswith("pending-") and name.endswith(".arrow") and rel(name) not in keep:
            loc.delete_file(layout.at(rel(name)))
    return moved


def recover(layout: DatasetLayout) -> dict[str, int]:
    """Finish or undo interrupted commits of a version (and import its legacy manifest files into the log).

    Returns:
        ``{"rolled_forward": .., "rolled_back": .., "delta_rolled_forward": ..}``: staging
        directories finished and deleted, and Delta table transactions made up; ``"imported"``
        when legacy manifests were imported.
    """
    fixed = {"rolled_forward": 0, "rolled_back": 0, "delta_rolled_forward": 0}
    imported = _import_legacy_manifests(layout)
    if imported:
        fixed["imported"] = imported
    manifests = {m.commit: m for m in read_manifests(layout)}
    _recover_staging(layout, manifests, fixed)
    fixed["delta_rolled_forward"] = delta_tables.roll_forward(layout.root, manifests.values())
    return fixed


def _import_legacy_manifests(layout: DatasetLayout) -> int:
    """Move a version's legacy manifest files (``_manifests/<V>/<n>.json``) into its commit log; returns how many.

    Each file's bytes become commit ``n``'s record, in order; once the log holds all of them (and the
    same bytes) the files are deleted. Idempotent and safe against a rival doing the same (an object
    store has no lock): a commit the rival made first is checked, not made again; a crash in between
    leaves the files, and the next run goes on where this one stopped.

    Raises:
        CommitError: the log holds a commit that differs from the legacy file of the same number.
    """
    legacy = read_legacy_records(layout.root, layout.version)
    if not legacy:
        return 0
    try:
        made = layout.log.import_records(legacy, sources=[MANIFEST_DIR] * len(legacy))
    except ImportMismatch as err:
        raise CommitError(f"{layout.version} at {layout.root} has a commit log and legacy manifests that differ "
                          f"at commit {err.commit} ({layout.legacy_manifests}); keep the one that matches the data "
                          "files and move the other away") from None
    except CommitLogError as err:
        raise CommitError(str(err)) from err
    _LOG.warning("imported %d legacy manifests of %s into its commit log (%d made by this run); deleting %s",
                 len(legacy), layout.version, made, layout.legacy_manifests)
    loc.delete_dir(layout.legacy_manifests)
    if not layout.remote:
        parent = os.path.dirname(layout.legacy_manifests)
        if os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)
    return len(legacy)


def _recover_staging(layout: DatasetLayout, manifests: dict[int, DatasetManifest], fixed: dict[str, int]) -> None:
    """Roll forward staging a manifest names; delete the rest, except (object stores) what may be in flight.

    Locally the commit lock makes the caller the only writer: staging without a manifest is a
    crashed run's. On an object store there is no lock: staging ``<n>-<run>`` for a commit not
    made yet may be another run's at work, and is left alone; once ``n`` is committed, staging
    of ``n`` the manifest does not name is a crashed run's (a run that loses the race deletes
    its own), deleted by the next recovery.
    """
    last = max(manifests, default=0)
    for name in loc.list_dir(layout.staging_root):
        prefix = name.split("-", 1)[0] if layout.remote else name
        n = int(prefix) if prefix.isdigit() else None
        d = loc.join(layout.staging_root, name)
        m = manifests.get(n) if n is not None else None
        if layout.remote and n is not None and n > len(manifests):
            _LOG.info("leaving staging directory %s: commit %s is not made yet (another run's, or a crashed one's "
                      "until it is)", d, n)
        elif layout.remote and not loc.list_files(d):
            # An object store may list a prefix whose objects are gone (SeaweedFS keeps the filer's empty
            # directories): nothing to finish; rolling an older commit forward again would delete the
            # state files of the newer ones.
            loc.delete_dir(d)
        elif m is not None and n == last and _staging_of(m) == f"_staging/{layout.version}/{name}":
            _LOG.warning("rolling forward interrupted dataset commit %s of %s", n, layout.version)
            _roll_forward(layout, m)
            fixed["rolled_forward"] += 1
        else:
            _LOG.warning("rolling back uncommitted staging directory %s", d)
            loc.delete_dir(d)
            fixed["rolled_back"] += 1


def commit_staged(
    layout: DatasetLayout,
    manifest: DatasetManifest,
    *,
    prior_norm: NormState,
    snapshot: Snapshot,
) -> DatasetManifest:
    """Commit the staged files of ``manifest.commit`` (see the module docstring).

    Args:
        layout: the version's paths.
        manifest: the manifest to write; ``files``, ``pending_file`` and
            ``norm_file`` are filled in here from the staging directory, and a
            staged late-state file is added to ``late_state`` (which holds the
            files carried over: :func:`carry_late_state`).
        prior_norm: persisted statistics before this run.
        snapshot: the read of the commit log the commit was planned on (:func:`read_snapshot`, head
            ``manifest.commit - 1``): the commit is made against it, so it is refused if another
            writer committed since.

    Tests simulate a crash at each commit point with :func:`pipelines.testhooks.crash_at`:
    ``before_manifest``, ``after_manifest`` (manifest written, one file renamed) or
    ``before_delta`` (files in place, no Delta transaction made).

    Returns:
        The manifest as written.

    Raises:
        CommitConflict: another run made a commit since ``snapshot``; this run's staging is deleted.
        CommitError: the log refused the commit for another reason, or a simulated crash (tests).
    """
    n = manifest.commit
    staging = layout.staging(n)
    staged_rel = lambda p: p[len(layout.root) + 1:]  # noqa: E731
    files: list[CommittedFile] = []
    run_stats: dict[str, RunningStats] = {}
    pending_file = groups_file = None
    late_state = dict(manifest.late_state)
    held_parts: set[str] = set()
    held_prefix = f"state/{HELD_DIR}/"
    for p in sorted(loc.list_files(staging, suffix=STAGED_SUFFIX), key=lambda p: p.split("/")):  # pathlib's order
        rel = p[len(staging) + 1: -len(STAGED_SUFFIX)]
        if rel.startswith("_counts/"):  # the job's count files (pipelines/counts.py): no part of the commit
            continue
        if rel == f"state/{RUN_STATS_FILE}":
            run_stats = msgspec.json.decode(loc.read_bytes(p), type=dict[str, RunningStats])
            continue
        if rel == f"state/{PENDING_FILE}":
            pending_file = layout.pending_file(n)
            files.append(CommittedFile(path=pending_file, staged=staged_rel(p)))
            continue
        if rel == f"state/{LATE_STATE_FILE}":
            path = layout.late_state_file(n)
            late_state[path] = late_state_newest_s(p)
            files.append(CommittedFile(path=path, staged=staged_rel(p)))
            continue
        if rel == f"state/{GROUPS_FILE}":
            groups_file = layout.groups_file(n)
            files.append(CommittedFile(path=groups_file, staged=staged_rel(p)))
            continue
        if rel.startswith(held_prefix):  # <domain dir>/s<k>.<table>.arrow
            path = f"{layout.held_dir(n)}/{rel[len(held_prefix):]}"
            held_parts.add(path.rsplit(".", 2)[0])
            files.append(CommittedFile(path=path, staged=staged_rel(p)))
            continue
        with loc.open_input(p) as f:
            rows = pq.ParquetFile(f).metadata.num_rows
        files.append(CommittedFile(path=rel, staged=staged_rel(p), rows=rows))
    # The `group` family of earlier versions is per run now (pipelines.groups): not carried on.
    prior_norm = NormState(recipe_hash=prior_norm.recipe_hash,
                           stats={k: v for k, v in prior_norm.stats.items() if not k.startswith("group/")})
    norm = prior_norm.merged(run_stats)
    norm_staged = loc.join(staging, "state", "norm.json" + STAGED_SUFFIX)
    with loc.open_output(norm_staged) as f:
        f.write(msgspec.json.encode(norm, order="sorted"))
    files.append(CommittedFile(path=layout.norm_file, staged=staged_rel(norm_staged)))
    manifest = msgspec.structs.replace(manifest, files=files, pending_file=pending_file, groups_file=groups_file,
                                       held_parts=sorted(held_parts), late_state=late_state,
                                       norm_file=layout.norm_file)
    if testhooks.crashes_at("before_manifest"):
        raise CommitError(f"simulated crash before the manifest of commit {n}")
    _write_manifest(layout, manifest, snapshot)
    if testhooks.crashes_at("after_manifest"):
        first = files[0]
        loc.move(layout.at(first.staged), layout.at(first.path))
        raise CommitError(f"simulated crash after the manifest of commit {n}")
    _roll_forward(layout, manifest)
    if testhooks.crashes_at("before_delta"):
        raise CommitError(f"simulated crash before the Delta transactions of commit {n}")
    delta_tables.publish_commit(layout.root, manifest)
    return manifest


def _write_manifest(layout: DatasetLayout, manifest: DatasetManifest, snapshot: Snapshot) -> None:
    """Make the commit point: commit ``n`` of the version's commit log, its record the manifest, against ``snapshot``.

    Raises:
        CommitConflict: another run made a commit since ``snapshot``; this run's staging is deleted.
        CommitError: the log refused the commit for another reason.
    """
    n = manifest.commit
    if snapshot.head + 1 != n:
        raise CommitError(f"commit {n} of {layout.version} planned on a snapshot at commit {snapshot.head}")
    try:
        snapshot.commit(msgspec.json.encode(manifest),
                        metadata={"trajpipe.batch_id": delta_tables.batch_id(layout.version, n)})
    except CommitTaken:
        loc.delete_dir(layout.staging(n))
        raise CommitConflict.of(n, layout.version, layout.out) from None
    except CommitLogError as err:
        raise CommitError(str(err)) from err


def load_prior_norm(layout: DatasetLayout) -> NormState:
    """The persisted normalization statistics of a version (empty if none)."""
    return load_norm_state(layout.at(layout.norm_file), layout.recipe_hash)


@contextlib.contextmanager
def commit_lock(layout: DatasetLayout, *, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the version's commit lock (``flock`` on ``_state/<V>/commit.lock``).

    Serializes writers of one version (batch runs, and the streaming job's per-window commits,
    which may run in parallel bundles); ``--out`` must support ``flock`` across the writing
    hosts (local disks do; NFS only with lock support). ``waiting`` is called once if the lock
    is held by another writer, before blocking on it.

    An object store has no lock: there this holds nothing, and two runs racing for one commit
    are resolved by the commit log (:class:`CommitConflict` for the loser). The log would catch
    a local writer without the lock the same way; the lock makes the second run wait instead.
    """
    if layout.remote:
        yield
        return
    path = Path(layout.root) / "_state" / layout.version / "commit.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def covered_offsets(manifests: list[DatasetManifest], topic: str) -> dict[int, int]:
    """``partition -> first offset no commit covers``: the largest end offset per partition.

    Batch commits cover ``[start, end)`` ranges that follow each other; stream
    commits cover the records of one window pane each (panes of different
    windows interleave in offsets), so the restart point is the maximum.
    """
    out: dict[int, int] = {}
    for m in manifests:
        for partition, (_, end) in m.offsets.get(topic, {}).items():
            out[int(partition)] = max(out.get(int(partition), 0), int(end))
    return out


class CommittedEpisodes(msgspec.Struct, frozen=True):
    """Episode ids in the committed trajectory and evaluation files.

    Attributes:
        complete: written as complete episodes.
        incomplete: written as incomplete and never (yet) as complete.
    """

    complete: frozenset[str] = frozenset()
    incomplete: frozenset[str] = frozenset()

    @property
    def all(self) -> frozenset[str]:
        return self.complete | self.incomplete


def committed_episodes(layout: DatasetLayout, manifests: list[DatasetManifest]) -> CommittedEpisodes:
    """Episode ids in the trajectory and evaluation files of ``manifests``, complete and incomplete-only.

    Evaluation episodes (``evaluations/``) count like training episodes: a replay of their events is a duplicate.
    """
    rels = [f.path for m in manifests for f in m.files if f.path.startswith(("trajectories/", "evaluations/"))]
    fs, root = loc.filesystem(layout.root)
    if layout.remote:  # one listing, not a request per file
        have = {p[len(layout.root) + 1:] for p in loc.list_files(layout.at("trajectories"), suffix=".parquet")
                + loc.list_files(layout.at("evaluations"), suffix=".parquet")}
        rels = [r for r in rels if r in have]
    else:
        rels = [r for r in rels if os.path.exists(layout.at(r))]
    if not rels:
        return CommittedEpisodes()
    paths = [f"{root}/{r}" for r in rels]
    schema = pa.schema([("episode_id", pa.string()), ("complete", pa.bool_())])  # the columns both tables share
    table = pads.dataset(paths, format="parquet", schema=schema, filesystem=fs).to_table(
        columns=["episode_id", "complete"])
    is_complete = table.column("complete")
    complete = frozenset(pc.filter(table.column("episode_id"), is_complete).to_pylist())
    seen = frozenset(pc.unique(table.column("episode_id")).to_pylist())
    return CommittedEpisodes(complete=complete, incomplete=seen - complete)


def latest_pending_file(layout: DatasetLayout, manifests: list[DatasetManifest]) -> str | None:
    """The location of the pending-state file of the newest commit that wrote one (None if there is none)."""
    for m in reversed(manifests):
        if m.pending_file:
            path = layout.at(m.pending_file)
            return path if loc.exists(path) else None
    return None


def load_held_state(layout: DatasetLayout, manifests: list[DatasetManifest]) -> HeldState:
    """The GRPO groups held by the newest commit that decided groups, and their rows' files (empty if none).

    Raises:
        CommitError: a held-state file the manifest names is missing.
    """
    for m in reversed(manifests):
        if m.groups_file is None:
            continue
        path = layout.at(m.groups_file)
        missing = [p for p in (path, *(layout.at(f"{b}.{t}.arrow") for b in m.held_parts
                                       for t in ("trajectories", "steps"))) if not loc.exists(p)]
        if missing:
            raise CommitError(f"commit {m.commit} of {layout.version} names held-group state that is missing: "
                              f"{missing[:3]}; restore it from a backup, or start a new dataset version")
        parts = []
        for base in m.held_parts:
            domain_dir, name = base.split("/")[-2:]  # domain=<D>/s<k>
            parts.append(HeldPart(domain=domain_dir[len("domain="):], shard=int(name[1:]),
                                  base=layout.at(base)))
        return HeldState(groups=msgspec.json.decode(loc.read_bytes(path), type=GroupState), parts=parts)
    return HeldState()


def held_episode_ids(held: HeldState) -> set[str]:
    """Ids of the episodes whose rows are held (they count as emitted: their events again are duplicates)."""
    return {i for part in held.parts
            for i in loc.read_feather(f"{part.base}.trajectories.arrow", columns=["episode_id"]).column(0).to_pylist()}


def load_late_state(layout: DatasetLayout, manifests: list[DatasetManifest], *, emitted: Iterable[str],
                    incomplete: Iterable[str], clock_s: float, retention_s: float) -> LateState:
    """The late state the newest commit left, for the assemblers (pipelines/late.py).

    Args:
        layout: the version's paths.
        manifests: the committed manifests.
        emitted: episodes emitted complete (or held) since: never late again.
        incomplete: episodes committed as incomplete (:attr:`CommittedEpisodes.incomplete`).
        clock_s: the event-time clock of the newest commit.
        retention_s: an episode's events are kept while ``last event time + retention_s >= clock_s``.

    Raises:
        CommitError: a late-state file the manifest names is missing.
    """
    emitted = frozenset(emitted)
    late = frozenset(incomplete) - emitted
    named = list(manifests[-1].late_state) if manifests else []
    paths = [layout.at(rel) for rel in named]
    missing = [p for p in paths if not loc.exists(p)]
    if missing:
        raise CommitError(f"commit {manifests[-1].commit} of {layout.version} names late state that is missing: "
                          f"{missing[:3]}; restore it from a backup (or its episodes' late events are `expired`)")
    index = late_state_index(paths, skip=emitted)
    stored = {e: ref for e, ref in index.items() if e in late and ref.last_s + retention_s >= clock_s}
    return LateState(incomplete=late, stored=stored, files=tuple(paths))


#: Late-state files a commit carries before it merges them into its own (one read of the live state).
LATE_STATE_MAX_FILES = 16


def carry_late_state(layout: DatasetLayout, last: DatasetManifest | None, staging: str | Path, *, clock_s: float,
                     retention_s: float, drop: Iterable[str] | Callable[[], Iterable[str]] = ()) -> dict[str, float]:
    """The late-state files of ``last`` that the next commit keeps (for its manifest's ``late_state``).

    A file is kept while its newest event time is within ``retention_s`` of
    ``clock_s``. When more than :data:`LATE_STATE_MAX_FILES` would be live,
    the kept files' episodes (their newest copy, within the retention, not in
    ``drop`` nor in the commit's own staged late state) are merged into the
    staged late-state file and nothing is carried: the live state is read
    once every few commits, never rewritten by every one.

    Args:
        layout: the version's paths.
        last: the newest committed manifest (None: none).
        staging: the commit's staging directory.
        clock_s: the event-time clock after the commit.
        retention_s: ``--late-retention`` seconds.
        drop: episodes emitted complete by now (their kept events are not needed), or a function that
            returns them (called only when the files are merged).
    """
    kept = {p: t for p, t in (last.late_state if last else {}).items() if t + retention_s >= clock_s}
    staging = os.fspath(staging)
    staged = loc.join(staging, "state", LATE_STATE_FILE + STAGED_SUFFIX)
    staged_exists = loc.exists(staged)
    if len(kept) + staged_exists <= LATE_STATE_MAX_FILES:
        return kept
    tables = [loc.read_feather(staged)] if staged_exists else []
    done = set(drop() if callable(drop) else drop)
    done |= set(tables[0].column("episode_id").to_pylist()) if tables else set()
    paths = [layout.at(p) for p in kept]
    index = late_state_index(paths, skip=done)
    by_file: dict[int, list[int]] = {}
    for ref in index.values():
        if ref.last_s + retention_s >= clock_s:
            by_file.setdefault(ref.file, []).extend(range(ref.start, ref.start + ref.rows))
    for i, rows in sorted(by_file.items()):
        tables.append(loc.read_feather(paths[i]).take(pa.array(sorted(rows), pa.int64())))
    merged = pa.concat_tables(tables).sort_by([("episode_id", "ascending"), ("seq", "ascending")])
    loc.write_feather(merged, staged)
    _LOG.info("late state: merged %d files (%d events) into commit %s's", len(kept), merged.num_rows,
              staging.rsplit("/", 1)[-1])
    return {}
