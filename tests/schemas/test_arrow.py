"""Arrow schemas follow the event classes; archive rows round-trip to events."""

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.arrow import ENVELOPE_FIELDS, archive_schema, arrow_schema_for, events_to_table, table_to_events
from schemas.events import EVENT_TYPES, Step


def test_archive_schema_has_envelope_and_one_struct_per_type():
    sch = archive_schema()
    for name in ENVELOPE_FIELDS:
        assert name in sch.names
    for name, cls in EVENT_TYPES.items():
        struct = sch.field(name).type
        assert pa.types.is_struct(struct)
        own = [f for f in arrow_schema_for(cls).names if f not in ENVELOPE_FIELDS]
        assert [struct.field(i).name for i in range(struct.num_fields)] == own


def test_round_trip_through_parquet_and_duckdb(tmp_path, one_of_each):
    table = events_to_table(one_of_each, [(0, i) for i in range(len(one_of_each))])
    pq.write_table(table, tmp_path / "part.parquet")
    back = pq.read_table(tmp_path / "part.parquet")
    assert back.schema.equals(archive_schema())
    assert table_to_events(back) == one_of_each
    con = duckdb.connect()
    rows = con.sql(
        f"select event_type, step.action_token_ids[1], len(step.behaviour_logprobs), episode_finished.status "
        f"from read_parquet('{tmp_path}/*.parquet') order by kafka_offset"
    ).fetchall()
    step = one_of_each[1]
    assert rows[1] == ("step", int(step.action_token_ids[0]), 300, None)
    assert rows[4][3] == "success"


def test_step_token_columns_are_typed():
    sch = arrow_schema_for(Step)
    assert sch.field("action_token_ids").type == pa.list_(pa.int32())
    assert sch.field("behaviour_logprobs").type == pa.list_(pa.float32())
    assert sch.field("tool_name").nullable and not sch.field("step_index").nullable
