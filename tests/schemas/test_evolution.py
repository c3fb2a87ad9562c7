"""The schema-evolution rules, enforced against the recorded history."""

import msgspec

from schemas.evolution import check_compatible, describe_model, load_registry
from schemas.events import SCHEMA_VERSION, StepVerified


def test_model_matches_recorded_version():
    registry = load_registry()
    assert SCHEMA_VERSION in registry, "run `python -m schemas.evolution --record`"
    assert describe_model() == registry[SCHEMA_VERSION], (
        "the event model changed without a new schema_version: bump SCHEMA_VERSION in schemas/events.py "
        "and run `python -m schemas.evolution --record` (only optional fields may be added)"
    )


def test_every_recorded_version_is_readable_by_current():
    current = describe_model()
    for version, desc in load_registry().items():
        assert check_compatible(desc, current) == [], f"version {version}"


def _variant(**changes):
    desc = describe_model()
    fields = desc["step_verified"]
    for name, spec in changes.items():
        if spec is None:
            fields.pop(name)
        else:
            fields[name] = spec
    return desc


def test_rules():
    base = describe_model()
    assert check_compatible(base, _variant(note={"type": "string", "required": False})) == []
    assert check_compatible(base, _variant(verifier=None)) == ["step_verified.verifier: field removed or renamed"]
    renamed = _variant(verifier=None, verifier_name={"type": "string", "required": True})
    assert len(check_compatible(base, renamed)) == 2
    assert check_compatible(base, _variant(score={"type": "string", "required": False})) == [
        "step_verified.score: type changed double -> string"
    ]
    assert "required" in check_compatible(base, _variant(details={"type": "string", "required": True}))[0]
    assert check_compatible(base, {k: v for k, v in base.items() if k != "feedback"}) == ["feedback: event type removed"]


def test_adding_an_optional_field_really_reads_old_data():
    class StepVerifiedV2(StepVerified, tag="step_verified"):
        reviewer: str = "none"

    old = StepVerified(event_id="a", episode_id="e", seq=2, producer_id="p", domain="d", task_id="t",
                       step_index=0, verifier="v", passed=True)
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=StepVerifiedV2)
    assert new.reviewer == "none" and new.verifier == "v"
    # ...and an old reader ignores the new field rather than failing
    newer = StepVerifiedV2(**{f: getattr(old, f) for f in old.__struct_fields__}, reviewer="r1")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(newer), type=StepVerified) == old
