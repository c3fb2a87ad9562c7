"""GRPO groups: an episode's group advantage is computed over its whole group, never a part of it.

The rollout scheduler starts ``G`` episodes of a task together (``episode_started.task_group``
``<task_id>@v<version>#<round>``, ``group_size`` ``G``, ``group_member`` ``0..G-1``).
Their events arrive over minutes and may straddle micro-batches, so the writer
*holds* a group's rows until its group is whole:

* a group is identified by :data:`~pipelines.types.GroupKey`
  ``(domain, task_group, policy_version)``;
* its **members** are its complete episodes (trainable or not), counted by
  distinct ``group_member``;
* :func:`decide_groups` releases a group when ``members >= group_size``, at
  once when ``group_size <= 1`` (solo rollouts, and legacy events that
  declare no size: they are normalized over the members present in the run,
  as one group), and otherwise after ``timeout_s`` seconds of event time
  (the job's event-time clock, measured from the run that first held it)
  with the members it has (``group_timed_out``); until then it is *held*;
* the statistics of a released group (:class:`GroupStats`: mean/std of
  ``G_0`` over its **trainable** members) are its own: never merged with
  another run's or another policy version's;
* the domain statistics (``advantage/<domain>``, ``return/<domain>``, merged
  with the persisted ones at commit) count an episode when its group is
  released, trainable only (:func:`domain_stats`).

The decision is a pure function of the run's group statistics, the held
state of the last commit (:class:`GroupState`), the clock and the timeout, so
every writer that applies it (each shard's finalizer, the step that stages
the new held state, the streaming job's per-pane writer) takes the same one.

Examples:
    >>> from pipelines.normalize import RunningStats
    >>> two_of_three = GroupStats(size=3, members=(0, 2), episodes=2, returns=RunningStats.of([1.0, 0.0]))
    >>> key = ("math", "t1@v0#0", 0)
    >>> released, held = decide_groups({key: two_of_three}, {}, clock_s=100.0, timeout_s=600.0)
    >>> released, held[key].since_s
    ({}, 100.0)
    >>> last = GroupStats(size=3, members=(1,), episodes=1, returns=RunningStats.of([1.0]))
    >>> released, held = decide_groups({key: last}, held, clock_s=130.0, timeout_s=600.0)
    >>> g = released[key]; (len(g.stats.members), g.stats.returns.n, round(g.stats.returns.mean, 6), g.timed_out, held)
    (3, 3, 0.666667, False, {})
    >>> _, held = decide_groups({key: two_of_three}, {}, clock_s=100.0, timeout_s=600.0)
    >>> released, _ = decide_groups({}, held, clock_s=700.0, timeout_s=600.0)  # 600 s later: closed as it is
    >>> released[key].timed_out, released[key].stats.members
    (True, (0, 2))
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from apache_beam.runners.worker.statecache import CacheAware

from pipelines.normalize import RunningStats
from pipelines.types import Episode, GroupKey

__all__ = [
    "GroupStats",
    "HeldGroup",
    "ReleasedGroup",
    "GroupState",
    "HeldPart",
    "HeldState",
    "CommitGroups",
    "decide_groups",
    "decide_commit",
    "domain_stats",
    "merge_group_stats",
    "add_group_stats",
    "GroupStatsMap",
    "group_stats_of_tables",
    "group_stats_of_episode",
    "group_key_strings",
    "key_string",
    "DEFAULT_GROUP_TIMEOUT_S",
]

#: Event-time seconds a group waits for its missing members (``--group-timeout``).
DEFAULT_GROUP_TIMEOUT_S = 600.0

_SEP = "\x1f"


class GroupStats(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a set of a group's complete episodes contributes to its statistics (mergeable).

    Attributes:
        size: declared group size ``G`` (the largest any member states; 0: not declared).
        members: distinct ``group_member`` indices of the complete episodes, sorted.
        episodes: complete episodes (rows to write).
        returns: ``G_0`` of the trainable episodes (the group's statistics).
        advantages: per-step ``A_t`` of the trainable episodes (domain statistics).
    """

    size: int = 0
    members: tuple[int, ...] = ()
    episodes: int = 0
    returns: RunningStats = RunningStats()
    advantages: RunningStats = RunningStats()

    def merge(self, other: "GroupStats") -> "GroupStats":
        """Both sets together (Chan's merge for the statistics)."""
        return GroupStats(size=max(self.size, other.size), members=tuple(sorted({*self.members, *other.members})),
                          episodes=self.episodes + other.episodes, returns=self.returns.merge(other.returns),
                          advantages=self.advantages.merge(other.advantages))

    @property
    def whole(self) -> bool:
        """All declared members are in (always, for a group of size 0 or 1)."""
        return self.size <= 1 or len(self.members) >= self.size

    def __reduce__(self):
        # Beam pickles the part statistics on their way to the per-group combine (some 25,000 of them for
        # 10,000 episodes): positional fields pickle a third smaller, and faster both ways, than msgspec's
        # keyword form of a kw_only Struct.
        return _group_stats, (self.size, self.members, self.episodes, self.returns, self.advantages)


def _group_stats(size: int, members: tuple[int, ...], episodes: int, returns: RunningStats,
                 advantages: RunningStats) -> GroupStats:
    return GroupStats(size=size, members=members, episodes=episodes, returns=returns, advantages=advantages)


class HeldGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A group whose rows wait in the held state for its missing members.

    Attributes:
        domain: the group's domain.
        task_group: its ``task_group``.
        policy_version: the policy version of its members.
        since_s: the event-time clock (epoch seconds) of the run that first held it.
        stats: the statistics of its members so far.
    """

    domain: str
    task_group: str
    policy_version: int
    since_s: float
    stats: GroupStats

    @property
    def key(self) -> GroupKey:
        return self.domain, self.task_group, self.policy_version


class ReleasedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """A group written in this commit, and the statistics its rows are normalized with.

    Attributes:
        stats: the statistics over all its members (held ones included).
        timed_out: closed by the timeout before ``stats.size`` members arrived.
    """

    stats: GroupStats
    timed_out: bool = False


class GroupState(msgspec.Struct, kw_only=True):
    """The held groups after a commit (``_state/<V>/groups-<n>.json``); their rows are in held parts.

    Attributes:
        held: the held groups, sorted by key.
    """

    held: list[HeldGroup] = []

    def by_key(self) -> dict[GroupKey, HeldGroup]:
        return {g.key: g for g in self.held}

    @classmethod
    def of(cls, held: Mapping[GroupKey, HeldGroup]) -> "GroupState":
        return cls(held=[held[k] for k in sorted(held)])


class HeldPart(msgspec.Struct, frozen=True, kw_only=True):
    """The held rows of one (domain, shard): ``<base>.trajectories.arrow`` and ``<base>.steps.arrow``.

    Attributes:
        domain: their domain.
        shard: the shard that wrote them.
        base: absolute path without the ``.<table>.arrow`` suffix.
    """

    domain: str
    shard: int
    base: str


class HeldState(msgspec.Struct, kw_only=True):
    """What the last commit held: the groups (their statistics) and their rows (Arrow IPC parts).

    Attributes:
        groups: the held groups.
        parts: the files holding their rows.
    """

    groups: GroupState = msgspec.field(default_factory=GroupState)
    parts: list[HeldPart] = []


class CommitGroups(msgspec.Struct, frozen=True, kw_only=True):
    """One commit's decision (:func:`decide_commit`): what every writer of the commit applies.

    Attributes:
        released: groups written now, with their whole statistics.
        held: groups held for the next commit.
        norm: domain statistics to normalize with: the persisted ones ⊕ the released groups'.
        run: the released groups' domain statistics alone (merged into the persisted ones at commit).
    """

    released: dict[GroupKey, ReleasedGroup]
    held: dict[GroupKey, HeldGroup]
    norm: dict[str, RunningStats]
    run: dict[str, RunningStats]

    def held_keys(self, domain: str) -> list[str]:
        """:func:`key_string` of the domain's held groups."""
        return [key_string(tg, pv) for d, tg, pv in self.held if d == domain]

    def counts(self) -> dict[str, int]:
        """``groups_released``, ``groups_held``, ``groups_timed_out``, ``episodes_held``."""
        return {"groups_released": len(self.released), "groups_held": len(self.held),
                "groups_timed_out": sum(g.timed_out for g in self.released.values()),
                "episodes_held": sum(g.stats.episodes for g in self.held.values())}


def decide_commit(run: Mapping[GroupKey, GroupStats], held: Mapping[GroupKey, HeldGroup], *, clock_s: float,
                  timeout_s: float, prior: Mapping[str, RunningStats]) -> CommitGroups:
    """:func:`decide_groups`, plus the domain statistics it implies (:func:`domain_stats`)."""
    released, still = decide_groups(run, held, clock_s=clock_s, timeout_s=timeout_s)
    run_domain = domain_stats(released)
    norm = {k: v for k, v in prior.items() if not k.startswith("group/")}
    for k, v in run_domain.items():
        norm[k] = norm.get(k, RunningStats()).merge(v)
    return CommitGroups(released=released, held=still, norm=norm, run=run_domain)


def decide_groups(
    run: Mapping[GroupKey, GroupStats],
    held: Mapping[GroupKey, HeldGroup],
    *,
    clock_s: float,
    timeout_s: float,
) -> tuple[dict[GroupKey, ReleasedGroup], dict[GroupKey, HeldGroup]]:
    """Which groups this commit writes, and which it holds (the module docstring's rule).

    Args:
        run: statistics of this run's complete episodes, per group.
        held: the groups the last commit held.
        clock_s: the job's event-time clock after this run (epoch seconds).
        timeout_s: event-time seconds a group waits for missing members.

    Returns:
        ``(released, held)``: released groups with their whole statistics
        (held members merged in), and the groups held now (``since_s`` kept
        from when they were first held).
    """
    released: dict[GroupKey, ReleasedGroup] = {}
    still: dict[GroupKey, HeldGroup] = {}
    for key in sorted({*run, *held}):
        before, new = held.get(key), run.get(key)
        if before is None:
            stats, since = new, clock_s
        else:
            stats, since = (before.stats if new is None else before.stats.merge(new)), before.since_s
        if stats.whole:
            released[key] = ReleasedGroup(stats=stats)
        elif clock_s - since >= timeout_s:
            released[key] = ReleasedGroup(stats=stats, timed_out=True)
        else:
            still[key] = HeldGroup(domain=key[0], task_group=key[1], policy_version=key[2], since_s=since,
                                   stats=stats)
    return released, still


def domain_stats(released: Mapping[GroupKey, ReleasedGroup]) -> dict[str, RunningStats]:
    """``advantage/<domain>`` and ``return/<domain>`` of the released groups' trainable episodes.

    Merged in key order, so every writer gets the same numbers bit for bit.
    """
    out: dict[str, RunningStats] = {}
    for key in sorted(released):
        st, domain = released[key].stats, key[0]
        for name, s in ((f"advantage/{domain}", st.advantages), (f"return/{domain}", st.returns)):
            if s.n:
                out[name] = out.get(name, RunningStats()).merge(s)
    return dict(sorted(out.items()))


def merge_group_stats(stats: Iterable[GroupStats]) -> GroupStats:
    """Merge any number of group statistics (a ``CombinePerKey`` callable)."""
    out = GroupStats()
    for st in stats:
        out = out.merge(st)
    return out


class _CacheWeight(CacheAware):
    """What Beam's side-input cache measures for a :class:`GroupStatsMap`: its estimated size, no walk."""

    __slots__ = ("_bytes",)

    def __init__(self, n_bytes: int) -> None:
        self._bytes = n_bytes

    def __sizeof__(self) -> int:
        return self._bytes

    def get_referents_for_cache(self) -> list[Any]:
        return []


class GroupStatsMap(dict, CacheAware):
    """``{group key: GroupStats}`` that pickles as one MessagePack blob.

    The run's group statistics cross the runner's coders several times (each
    bundle's partial, the combined value, the side input): as a plain dict
    Beam's coder pickles each ``GroupStats`` on its own; this map is encoded
    and decoded in one msgspec call (floats exactly).

    As a side input it is weighed by Beam's state cache (``statecache.get_deep_size``), which walks
    every object it holds: ~10 ms for the 2,500 groups of 100k events, twice a run, on the driver
    between the read and the finalize. It is weighed by its entry count instead
    (:data:`_ENTRY_BYTES` each, the walk's figure for such a map: 203 bytes an entry).

    Examples:
        >>> import pickle
        >>> m = GroupStatsMap({("code", "t", 1): GroupStats(size=2, members=(0,), episodes=1,
        ...                                                 returns=RunningStats(n=1, mean=0.5, m2=0.0))})
        >>> back = pickle.loads(pickle.dumps(m))
        >>> type(back) is GroupStatsMap, back == m
        (True, True)
    """

    def get_referents_for_cache(self) -> list[Any]:
        return [_CacheWeight(sys.getsizeof(self) + _ENTRY_BYTES * len(self))]

    def __reduce__(self):
        rows = [(k, st.size, st.members, st.episodes, st.returns, st.advantages) for k, st in self.items()]
        return _group_stats_map, (_MAP_ENCODER.encode(rows),)


#: Bytes a :class:`GroupStatsMap` entry holds (key, GroupStats, its RunningStats and members), for Beam's cache.
_ENTRY_BYTES = 200


def _group_stats_map(data: bytes) -> GroupStatsMap:
    return GroupStatsMap(
        ((domain, task_group, version), GroupStats(size=size, members=members, episodes=episodes, returns=returns,
                                                   advantages=advantages))
        for (domain, task_group, version), size, members, episodes, returns, advantages in _MAP_DECODER.decode(data))


_MAP_ENCODER = msgspec.msgpack.Encoder()
_MAP_DECODER = msgspec.msgpack.Decoder(
    list[tuple[tuple[str, str, int], int, tuple[int, ...], int, RunningStats, RunningStats]])


def add_group_stats(into: dict[GroupKey, GroupStats], stats: Mapping[GroupKey, GroupStats]) -> dict[GroupKey, GroupStats]:
    """``into`` with every group of ``stats`` merged in (:meth:`GroupStats.merge`); ``into`` is updated and returned.

    Examples:
        >>> a = {("code", "t", 1): GroupStats(size=2, members=(0,), episodes=1)}
        >>> b = add_group_stats(a, {("code", "t", 1): GroupStats(size=2, members=(1,), episodes=1)})
        >>> b is a, b[("code", "t", 1)].members, b[("code", "t", 1)].episodes
        (True, (0, 1), 2)
    """
    for key, st in stats.items():
        mine = into.get(key)
        into[key] = st if mine is None else mine.merge(st)
    return into


def key_string(task_group: str, policy_version: int) -> str:
    """The per-domain part of a group key as one string (for vectorized lookups)."""
    return f"{task_group}{_SEP}{policy_version}"


def group_key_strings(table: pa.Table) -> pa.Array:
    """Per trajectory row, :func:`key_string` of its ``task_group`` and ``policy_version``."""
    return pc.binary_join_element_wise(table["task_group"], pc.cast(table["policy_version"], pa.string()), _SEP)


def _stats_by_key(keys: pa.Array | pa.ChunkedArray, values: pa.Array | pa.ChunkedArray) -> dict[str, RunningStats]:
    if len(keys) == 0:
        return {}
    agg = pa.table({"k": keys, "v": values}).group_by("k").aggregate(
        [("v", "count"), ("v", "mean"), ("v", "variance", pc.VarianceOptions(ddof=0))])
    return {k: RunningStats(n=n, mean=mean, m2=var * n) for k, n, mean, var in zip(
        *(agg[c].to_pylist() for c in ("k", "v_count", "v_mean", "v_variance")))}


def group_stats_of_tables(trajs: pa.Table, steps: pa.Table, *, domain: str) -> dict[GroupKey, GroupStats]:
    """Per-group statistics of complete trajectories given as dataset tables of one domain (vectorized).

    Examples:
        >>> t = pa.table({"episode_id": ["a", "b", "c"], "task_group": ["g", "g", "h"], "policy_version": [1, 1, 1],
        ...               "group_size": [2, 2, 0], "group_member": [0, 1, 0], "trainable": [True, False, True],
        ...               "episode_return": [1.0, 0.0, 2.0]})
        >>> s = pa.table({"episode_id": ["a", "a", "b", "c"], "advantage": [1.0, 0.5, 0.0, 2.0]})
        >>> st = group_stats_of_tables(t, s, domain="d")
        >>> g = st[("d", "g", 1)]; (g.size, g.members, g.episodes, g.returns.n, g.advantages.n)
        (2, (0, 1), 2, 1, 2)
    """
    if trajs.num_rows == 0:
        return {}
    keys = group_key_strings(trajs)
    trainable = trajs["trainable"]
    agg = pa.table({"k": keys, "size": trajs["group_size"], "member": trajs["group_member"]}).group_by("k").aggregate(
        [("size", "max"), ("member", "distinct"), ("member", "count")])
    returns = _stats_by_key(pc.filter(keys, trainable), pc.filter(trajs["episode_return"], trainable))
    advantages: dict[str, RunningStats] = {}
    if steps.num_rows:
        of_traj = pc.index_in(steps["episode_id"], value_set=trajs["episode_id"])
        step_keys = pc.take(keys, of_traj)
        step_trainable = pc.take(trainable, of_traj)
        advantages = _stats_by_key(pc.filter(step_keys, step_trainable), pc.filter(steps["advantage"], step_trainable))
    meta = {k: (tg, pv) for k, tg, pv in zip(keys.to_pylist(), trajs["task_group"].to_pylist(),
                                            trajs["policy_version"].to_pylist())}
    out = {}
    for k, size, members, n in zip(*(agg[c].to_pylist() for c in ("k", "size_max", "member_distinct",
                                                                     "member_count"))):
        tg, pv = meta[k]
        out[(domain, tg, pv)] = GroupStats(size=size, members=tuple(sorted(members)), episodes=n,
                                           returns=returns.get(k, RunningStats()),
                                           advantages=advantages.get(k, RunningStats()))
    return out


def group_stats_of_episode(episode: Episode) -> GroupStats:
    """What one complete, rewarded episode contributes to its group's statistics."""
    trainable = episode.trainable
    return GroupStats(
        size=episode.group_size, members=(episode.group_member,), episodes=1,
        returns=RunningStats.of([episode.episode_return]) if trainable else RunningStats(),
        advantages=RunningStats.of(episode.advantages) if trainable else RunningStats(),
    )
