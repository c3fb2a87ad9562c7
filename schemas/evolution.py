"""Schema evolution: the recorded history of the event model and the compatibility rules.

Rules (docs/schema-evolution.md explains why):

1. Adding a field is compatible **only if it has a default** (old messages,
   without it, still decode). Bump ``SCHEMA_VERSION`` and record it.
2. Removing or renaming a field is **incompatible** (a rename is a removal
   plus an addition): old archives and in-flight messages would lose data.
3. Changing a field's type or making an optional field required is incompatible.
4. Adding an event type is compatible; removing one is not. Type codes are
   positional, so new types are appended to ``EVENT_TYPES``.

``schemas/schema_registry.json`` keeps one description of the model per
version. The test suite fails when the code's model differs from the recorded
description of ``SCHEMA_VERSION`` (you changed the model without bumping the
version) or when any recorded version is incompatible with the current one.

Record a new version with::

    python -m schemas.evolution --record

Examples:
    >>> old = {"step": {"seq": {"type": "int64", "required": True}}}
    >>> new = {"step": {"seq": {"type": "int64", "required": True},
    ...                 "note": {"type": "string", "required": False}}}
    >>> check_compatible(old, new)
    []
    >>> check_compatible(new, old)
    ['step.note: field removed or renamed']
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec

from schemas.arrow import _arrow_for_info
from schemas.events import EVENT_TYPES, SCHEMA_VERSION

__all__ = ["REGISTRY_PATH", "describe_model", "load_registry", "check_compatible", "record_current"]

REGISTRY_PATH = Path(__file__).with_name("schema_registry.json")

Description = dict[str, dict[str, dict[str, Any]]]


def describe_model() -> Description:
    """Describe every event type as ``{type: {field: {"type": arrow type, "required": bool}}}``."""
    out: Description = {}
    for name, cls in EVENT_TYPES.items():
        fields = {}
        for f in msgspec.inspect.type_info(cls).fields:
            fields[f.encode_name] = {"type": _type_str(f.type), "required": f.required}
        out[name] = fields
    return out


def _type_str(info: msgspec.inspect.Type) -> str:
    typ, nullable = _arrow_for_info(info)
    return f"{typ}{' | null' if nullable else ''}"


def load_registry(path: Path = REGISTRY_PATH) -> dict[int, Description]:
    """Recorded model descriptions, by schema version."""
    if not path.exists():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


def check_compatible(old: Description, new: Description) -> list[str]:
    """Problems that make ``new`` unable to read data written under ``old`` (empty if compatible)."""
    problems = []
    for etype, old_fields in old.items():
        if etype not in new:
            problems.append(f"{etype}: event type removed")
            continue
        new_fields = new[etype]
        for fname, spec in old_fields.items():
            if fname not in new_fields:
                problems.append(f"{etype}.{fname}: field removed or renamed")
            elif new_fields[fname]["type"] != spec["type"]:
                problems.append(f"{etype}.{fname}: type changed {spec['type']} -> {new_fields[fname]['type']}")
            elif new_fields[fname]["required"] and not spec["required"]:
                problems.append(f"{etype}.{fname}: optional field became required")
        for fname, spec in new_fields.items():
            if fname not in old_fields and spec["required"]:
                problems.append(f"{etype}.{fname}: new field is required; give it a default")
    return problems


def record_current(path: Path = REGISTRY_PATH) -> None:
    """Record the current model as ``SCHEMA_VERSION`` after checking it against history.

    Raises:
        ValueError: the model is incompatible with a recorded version, or a
            different description is already recorded under this version.
    """
    registry = load_registry(path)
    current = describe_model()
    if SCHEMA_VERSION in registry and registry[SCHEMA_VERSION] != current:
        raise ValueError(
            f"schema_version {SCHEMA_VERSION} is already recorded with a different model; "
            "bump SCHEMA_VERSION in schemas/events.py first"
        )
    for version, desc in registry.items():
        problems = check_compatible(desc, current)
        if problems:
            raise ValueError(f"incompatible with recorded version {version}: {problems}")
    registry[SCHEMA_VERSION] = current
    path.write_text(json.dumps({str(k): v for k, v in sorted(registry.items())}, indent=1, sort_keys=True) + "\n")


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="record the current model as SCHEMA_VERSION")
    args = parser.parse_args()
    if args.record:
        record_current()
        print(f"recorded schema_version {SCHEMA_VERSION} in {REGISTRY_PATH}")
    else:
        print(json.dumps(describe_model(), indent=1))


if __name__ == "__main__":
    _main()
