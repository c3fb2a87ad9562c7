"""Arrow/Parquet schemas derived from the msgspec classes — never written by hand.

:func:`arrow_type_for` maps a msgspec type to an Arrow type, so every table
schema in trajpipe (the event archive, the datasets) follows the classes in
:mod:`schemas.events` and :mod:`schemas.datasets`.

The **event archive** (written by ``trajpipe archive``) has one row per event:
the envelope columns under their schema names, the Kafka source position, and
one struct column per event type holding that type's own fields (null for the
other types)::

    event_id, event_type, episode_id, seq, producer_id, domain, task_id,
    policy_version, event_time, schema_version, kafka_partition, kafka_offset,
    episode_started{...}, step{...}, step_verified{...}, episode_finished{...},
    feedback{...}, policy_published{...}

so an analyst writes ``SELECT step.action_text FROM read_parquet(...)``.

Examples:
    >>> arrow_type_for(TokenIds)
    ListType(list<item: int32>)
    >>> archive_schema().field("step").type.get_field_index("behaviour_logprobs") >= 0
    True
"""

from __future__ import annotations

import datetime as _dt
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from schemas.events import (
    EVENT_TYPES,
    AnyEvent,
    Event,
    LogProbs,
    Step,  # noqa: F401  (used by the doctests)
    TokenIds,
)

__all__ = [
    "arrow_type_for",
    "arrow_schema_for",
    "ENVELOPE_FIELDS",
    "POSITION_FIELDS",
    "archive_schema",
    "events_to_table",
    "table_to_events",
    "payload_fields",
]

_CUSTOM = {TokenIds: pa.list_(pa.int32()), LogProbs: pa.list_(pa.float32())}


def _arrow_for_info(info: msgspec.inspect.Type) -> tuple[pa.DataType, bool]:
    """(arrow type, nullable) for a msgspec type-info node."""
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        non_null = [t for t in info.types if not isinstance(t, mi.NoneType)]
        if len(non_null) != 1:
            raise TypeError(f"cannot map union {info} to Arrow; use one type or X | None")
        typ, _ = _arrow_for_info(non_null[0])
        return typ, True
    if isinstance(info, mi.StrType):
        return pa.string(), False
    if isinstance(info, mi.BoolType):
        return pa.bool_(), False
    if isinstance(info, mi.IntType):
        return pa.int64(), False
    if isinstance(info, mi.FloatType):
        return pa.float64(), False
    if isinstance(info, mi.BytesType):
        return pa.binary(), False
    if isinstance(info, mi.DateTimeType):
        return pa.timestamp("us", tz="UTC"), False
    if isinstance(info, (mi.EnumType, mi.LiteralType)):
        return pa.string(), False
    if isinstance(info, (mi.ListType, mi.VarTupleType)):
        inner, _ = _arrow_for_info(info.item_type)
        return pa.list_(inner), False
    if isinstance(info, mi.DictType):
        k, _ = _arrow_for_info(info.key_type)
        v, _ = _arrow_for_info(info.value_type)
        return pa.map_(k, v), False
    if isinstance(info, mi.StructType):
        return pa.struct(_fields_for(info.fields)), False
    if isinstance(info, mi.CustomType) and info.cls in _CUSTOM:
        return _CUSTOM[info.cls], False
    raise TypeError(f"no Arrow mapping for {info}")


def _fields_for(fields: Iterable[msgspec.inspect.Field]) -> list[pa.Field]:
    out = []
    for f in fields:
        typ, nullable = _arrow_for_info(f.type)
        out.append(pa.field(f.encode_name, typ, nullable=nullable or not f.required and f.default is None))
    return out


def arrow_type_for(tp: Any) -> pa.DataType:
    """The Arrow type for a Python/msgspec type annotation.

    Examples:
        >>> arrow_type_for(int | None), arrow_type_for(LogProbs)
        (DataType(int64), ListType(list<item: float>))
    """
    return _arrow_for_info(msgspec.inspect.type_info(tp))[0]


def arrow_schema_for(cls: type[msgspec.Struct], *, exclude: Sequence[str] = ()) -> pa.Schema:
    """Arrow schema with one column per field of a msgspec Struct class.

    Examples:
        >>> arrow_schema_for(Step).field("action_token_ids").type
        ListType(list<item: int32>)
    """
    info = msgspec.inspect.type_info(cls)
    return pa.schema([f for f in _fields_for(info.fields) if f.name not in exclude])


#: Envelope columns, in archive order (the names are the schema's field names).
ENVELOPE_FIELDS: tuple[str, ...] = (
    "event_id",
    "event_type",
    "episode_id",
    "seq",
    "producer_id",
    "domain",
    "task_id",
    "policy_version",
    "event_time",
    "schema_version",
)
#: Where the event was read from on the log.
POSITION_FIELDS: tuple[str, ...] = ("kafka_partition", "kafka_offset")

_ENVELOPE_SET = frozenset(ENVELOPE_FIELDS)


@functools.lru_cache(maxsize=None)
def payload_fields(event_type: str) -> tuple[str, ...]:
    """Names of the fields an event type adds to the envelope (cached: ``msgspec.structs.fields``
    resolves the type's annotations on every call, ~0.2 ms)."""
    cls = EVENT_TYPES[event_type]
    return tuple(f.name for f in msgspec.structs.fields(cls) if f.name not in _ENVELOPE_SET)


@functools.lru_cache(maxsize=1)
def archive_schema() -> pa.Schema:
    """The event-archive table schema (see the module docstring)."""
    env = arrow_schema_for(Event)
    fields = [pa.field("event_id", pa.string(), nullable=False), pa.field("event_type", pa.string(), nullable=False)]
    fields += [env.field(n) for n in ENVELOPE_FIELDS if n not in ("event_id", "event_type")]
    fields += [pa.field("kafka_partition", pa.int32()), pa.field("kafka_offset", pa.int64())]
    for name, cls in EVENT_TYPES.items():
        sch = arrow_schema_for(cls, exclude=ENVELOPE_FIELDS)
        fields.append(pa.field(name, pa.struct(list(sch)), nullable=True))
    return pa.schema(fields)


_ARCHIVE_SCHEMA = archive_schema()


def _payload_dict(event: Event, names: list[str]) -> dict[str, Any]:
    out = {}
    for n in names:
        v = getattr(event, n)
        if isinstance(v, np.ndarray):
            v = np.asarray(v)
        elif isinstance(v, msgspec.Struct):
            v = msgspec.structs.asdict(v)
        elif hasattr(v, "value") and not isinstance(v, (int, float, str)):  # enum
            v = v.value
        out[n] = v
    return out


def events_to_table(
    events: Sequence[Event],
    positions: Sequence[tuple[int, int]] | None = None,
) -> pa.Table:
    """Build an archive table from typed events.

    Args:
        events: events in the order they should appear.
        positions: ``(kafka_partition, kafka_offset)`` for each event, or None.

    Returns:
        A table with :func:`archive_schema`.

    Examples:
        >>> from schemas.events import StepVerified
        >>> ev = StepVerified(event_id="v", episode_id="ep", seq=2, producer_id="w", domain="math",
        ...                   task_id="t", step_index=0, verifier="math.value", passed=True, score=1.0)
        >>> t = events_to_table([ev], [(3, 41)])
        >>> t.num_rows, t.column("step_verified")[0]["verifier"].as_py(), t.column("step")[0].as_py()
        (1, 'math.value', None)
    """
    if positions is not None and len(positions) != len(events):
        raise ValueError("`positions` must have one entry per event")
    cols: dict[str, list[Any]] = {n: [] for n in _ARCHIVE_SCHEMA.names}
    payload_names = {name: payload_fields(name) for name in EVENT_TYPES}
    for i, ev in enumerate(events):
        for n in ENVELOPE_FIELDS:
            cols[n].append(ev.event_type if n == "event_type" else getattr(ev, n))
        part, off = positions[i] if positions is not None else (None, None)
        cols["kafka_partition"].append(part)
        cols["kafka_offset"].append(off)
        for name in EVENT_TYPES:
            cols[name].append(_payload_dict(ev, payload_names[name]) if name == ev.event_type else None)
    arrays = [pa.array(cols[f.name], type=f.type) for f in _ARCHIVE_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=_ARCHIVE_SCHEMA)


def table_to_events(table: pa.Table) -> list[AnyEvent]:
    """Rebuild typed events from archive rows (inverse of :func:`events_to_table`).

    Columns missing from an older archive file take the field defaults, so
    files written before an optional field was added still load.

    Examples:
        >>> from schemas.events import Step
        >>> ev = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="code", task_id="t",
        ...           step_index=0, action_text="RUN pytest", action_token_ids=[5, 6], behaviour_logprobs=[-1.0, -0.5])
        >>> table_to_events(events_to_table([ev]))[0] == ev
        True
    """
    from schemas.codec import _dec_hook  # same hook the JSON form uses for token arrays

    rows = table.to_pylist()
    out: list[AnyEvent] = []
    for row in rows:
        etype = row["event_type"]
        cls = EVENT_TYPES[etype]
        data = {n: row[n] for n in ENVELOPE_FIELDS if n != "event_type" and n in row}
        payload = row.get(etype) or {}
        data.update({k: v for k, v in payload.items() if v is not None or k in _nullable(cls)})
        if isinstance(data.get("event_time"), _dt.datetime) and data["event_time"].tzinfo is None:
            data["event_time"] = data["event_time"].replace(tzinfo=_dt.timezone.utc)
        out.append(msgspec.convert(data, cls, dec_hook=_dec_hook, from_attributes=False, strict=False))
    return out


def _nullable(cls: type[Event]) -> frozenset[str]:
    info = msgspec.inspect.type_info(cls)
    return frozenset(
        f.name for f in info.fields if isinstance(f.type, msgspec.inspect.UnionType) and not f.required
    )
