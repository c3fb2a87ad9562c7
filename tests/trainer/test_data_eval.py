"""The trainer's data path never yields an evaluation episode, even from a file that holds one."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tests.trainer.test_data import _episode
from trainer.data import TrajectoryLoader, TrajectoryStream
from trainer.synthetic import write_steps_commit


def test_rows_marked_purpose_eval_are_dropped(tmp_path):
    train = _episode([([5], [6, 7], [True, True], 1.0), ([8], [9], [True], 1.0)], episode_id="a-train")
    held_out = _episode([([5], [6, 7], [True, True], 1.0)], episode_id="b-eval")
    legacy = _episode([([5], [6], [True], 1.0)], episode_id="c-no-purpose")
    manifest = write_steps_commit(tmp_path, train + held_out + legacy, commit=1)
    [rel] = manifest["files"] if isinstance(manifest["files"][0], str) else [f["path"] for f in manifest["files"]]
    path = tmp_path / rel
    table = pq.read_table(path)
    purpose = ["eval" if e == "b-eval" else (None if e == "c-no-purpose" else "train")
               for e in table.column("episode_id").to_pylist()]
    pq.write_table(table.append_column("purpose", pa.array(purpose, pa.string())), path)
    stream = TrajectoryStream(tmp_path, seq_len=16, batch_size=4, shuffle=False)
    assert [e for b in TrajectoryLoader(stream) for e in b.episode_ids] == ["a-train", "c-no-purpose"]
