"""Where a training run's outputs go: a local directory, or an S3-compatible store through a local working dir.

DeepSpeed's ``save_checkpoint`` and Hugging Face's ``save_pretrained`` write local files, so a run whose
``out`` (or ``checkpoint.dir``, ``publish.store``) is ``s3://BUCKET/PREFIX`` writes them into a scratch
directory under the system temp (``$TMPDIR``; ``trajpipe-train-*``, removed at the end) and uploads them
through :mod:`schemas.locations`:

* a checkpoint ``step-<n>/`` is uploaded whole, every rank its own files, and only then does rank 0 write
  ``latest`` (one PUT, so it appears whole): a crash mid-upload leaves ``latest`` naming the previous
  checkpoint, the resume point. Older tags beyond ``keep_last`` are deleted after that;
* ``--resume`` reads ``latest`` on the store, downloads that tag into the scratch directory and lets
  DeepSpeed load it as a local checkpoint;
* ``metrics.jsonl`` (and ``samples.jsonl``) are written locally and uploaded whole at each checkpoint and at
  the end of the run (a resumed run downloads them first, so it appends as it does locally);
* a policy version is written locally, uploaded, and its ``policy.json`` put last (:func:`upload_policy`).

On a local ``out`` nothing changes: the files are written in place.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from schemas import locations as loc

__all__ = ["CheckpointDir", "RunFiles", "make_work_dir", "upload_policy"]

log = logging.getLogger(__name__)

#: The marker DeepSpeed reads: the tag of the newest complete checkpoint.
LATEST = "latest"


def make_work_dir() -> Path:
    """A fresh local scratch directory for a run with outputs on an object store (under ``$TMPDIR``)."""
    return Path(tempfile.mkdtemp(prefix="trajpipe-train-"))


def _tags(names: list[str]) -> list[str]:
    """``step-<n>`` names among ``names``, oldest first."""
    steps = [n for n in names if n.startswith("step-") and n[5:].isdigit()]
    return sorted(steps, key=lambda n: int(n[5:]))


class CheckpointDir:
    """A checkpoint directory at a location; DeepSpeed writes and reads ``local``.

    Args:
        location: local path or ``s3://`` URI of the checkpoint directory.
        work_dir: local scratch directory (used when ``location`` is remote).
    """

    def __init__(self, location: str, *, work_dir: Path | None) -> None:
        self.location = location.rstrip("/") if loc.is_remote(location) else location
        self.remote = loc.is_remote(location)
        if self.remote and work_dir is None:
            raise ValueError("a checkpoint directory on an object store needs a local work_dir")
        self.local = Path(work_dir) / "checkpoints" if self.remote else Path(location)

    def __str__(self) -> str:
        return self.location

    def fetch_latest(self) -> bool:
        """Make the newest complete checkpoint loadable from ``local``; False when there is none."""
        if not self.remote:
            return (self.local / LATEST).is_file()
        marker = loc.join(self.location, LATEST)
        if not loc.is_file(marker):
            return False
        tag = loc.read_bytes(marker).decode().strip()
        shutil.rmtree(self.local, ignore_errors=True)
        loc.download_dir(loc.join(self.location, tag), self.local / tag)
        (self.local / LATEST).write_text(tag)
        log.info("downloaded checkpoint %s from %s", tag, self.location)
        return True

    def commit(self, tag: str, *, keep_last: int, is_main: bool, barrier: Callable[[], object]) -> None:
        """After DeepSpeed saved ``tag`` into ``local`` (every rank calls it): make it the latest, drop old ones.

        Remote: every rank uploads the files it wrote, all wait, then rank 0 puts ``latest`` and deletes
        tags beyond ``keep_last``; the local copy is removed. Local: rank 0 deletes old tag directories.
        """
        if not self.remote:
            if is_main:
                tags = _tags([p.name for p in self.local.glob("step-*") if p.is_dir()])
                for old in tags[:-keep_last]:
                    shutil.rmtree(self.local / old, ignore_errors=True)
            return
        loc.upload_dir(self.local / tag, loc.join(self.location, tag))
        barrier()  # every rank's files are on the store before `latest` names the tag
        if is_main:
            loc.write_atomic(loc.join(self.location, LATEST), tag.encode())
            for old in _tags(loc.list_dir(self.location))[:-keep_last]:
                loc.delete_dir(loc.join(self.location, old))
        shutil.rmtree(self.local / tag, ignore_errors=True)


class RunFiles:
    """The run directory's own files (``metrics.jsonl``, ``samples.jsonl``): written in ``local``.

    Args:
        location: ``out``, a local path or ``s3://`` URI.
        work_dir: local scratch directory (used when ``location`` is remote).
    """

    NAMES = ("metrics.jsonl", "samples.jsonl")

    def __init__(self, location: str, *, work_dir: Path | None) -> None:
        self.location = location
        self.remote = loc.is_remote(location)
        self.local = Path(work_dir) / "out" if self.remote else Path(location)

    def fetch(self) -> None:
        """Remote: download the files a previous run uploaded, so a resumed run appends to them."""
        if not self.remote:
            return
        self.local.mkdir(parents=True, exist_ok=True)
        for name in self.NAMES:
            remote = loc.join(self.location, name)
            if loc.is_file(remote):
                (self.local / name).write_bytes(loc.read_bytes(remote))

    def upload(self) -> None:
        """Remote: put each file whole (one PUT each) over the previous upload."""
        if not self.remote:
            return
        for name in self.NAMES:
            path = self.local / name
            if path.is_file():
                loc.write_atomic(loc.join(self.location, name), path.read_bytes())


def upload_policy(local_version_dir: Path, location: str) -> None:
    """Upload a written policy version directory to ``location``; its ``policy.json`` last, in one PUT.

    ``policy.json`` marks a version complete (:func:`trainer.publish.read_policy` reads it; the recipe
    rewrites a version without it), so a crash mid-upload never leaves a version that looks whole.
    """
    record = local_version_dir / "policy.json"
    data = record.read_bytes()
    aside = local_version_dir.with_name(f".{local_version_dir.name}.policy.json")
    os.replace(record, aside)
    try:
        loc.upload_dir(local_version_dir, location)
        loc.write_atomic(loc.join(location, "policy.json"), data)
    finally:
        os.replace(aside, record)
