"""Test helpers: synthetic archives and a FnApiRunner TestPipeline."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline

from schemas.events import EpisodeStatus, Event
from streams.archive import PartitionRange, read_commits, write_commit
from streams.synth import generate_episodes

TOPIC = "trajpipe.events"


def make_pipeline() -> TestPipeline:
    """A TestPipeline on FnApiRunner (the DirectRunner may try to download Prism)."""
    return TestPipeline(runner=FnApiRunner())


def write_archive(root: Path, commits: list[list[Event]], *, buckets: int = 4) -> Path:
    """Write an event archive (docs/archive.md) with one commit per list of events.

    Commits the archive holds already are kept (the commit log takes each number once): called again with
    more lists, it adds the new ones.
    """
    made = len(read_commits(root))
    offset = 0
    for n, events in enumerate(commits, start=1):
        positions = [(0, offset + i) for i in range(len(events))]
        if n <= made:
            offset += len(events)
            continue
        write_commit(root, commit=n, topic=TOPIC, buckets=buckets, events=events, positions=positions,
                     offsets={0: PartitionRange(offset, offset + len(events))})
        offset += len(events)
    return root


def episodes(n: int, seed: int = 0) -> list[list[Event]]:
    return list(generate_episodes(n, seed=seed))


def flat(eps: list[list[Event]]) -> list[Event]:
    return list(itertools.chain.from_iterable(eps))


def edit(episode: list[Event], *, started: dict | None = None, finished: dict | None = None,
         steps: dict | None = None, envelope: dict | None = None) -> list[Event]:
    """A copy of one episode's events with fields replaced (event ids stay: they derive from episode and seq)."""
    out = []
    for ev in episode:
        changes = dict(envelope or {})
        changes.update({"episode_started": started, "episode_finished": finished, "step": steps}.get(ev.event_type)
                       or {})
        out.append(msgspec.structs.replace(ev, **changes) if changes else ev)
    return out


def as_group(members: list[list[Event]], *, size: int | None = None, version: int = 0, round: int = 0,
             first_member: int = 0) -> list[list[Event]]:
    """Episodes of one task (synthetic episodes come in blocks of 4 per task) as members ``first_member..`` of
    the scheduler's group ``<task_id>@v<version>#<round>`` of ``size`` (default: as many as given)."""
    size = len(members) if size is None else size
    task_group = f"{members[0][0].task_id}@v{version}#{round}"
    return [edit(ep, started={"task_group": task_group, "group_size": size, "group_member": first_member + k},
                 envelope={"policy_version": version})
            for k, ep in enumerate(members)]


def finished_as(episode: list[Event], termination: str) -> list[Event]:
    """The episode ended by ``termination`` (``timeout``/``error``/``aborted`` carry outcome 0 and that status)."""
    status = {"timeout": EpisodeStatus.TIMEOUT, "error": EpisodeStatus.ERROR, "aborted": EpisodeStatus.ABORTED}
    changes: dict = {"termination": termination}
    if termination in status:
        changes.update(status=status[termination], outcome_reward=0.0)
    return edit(episode, finished=changes)
