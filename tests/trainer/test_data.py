"""Streaming dataset: packing, loss mask, sharding, order, filters, tail mode, exact resume."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import msgspec
import pytest

from schemas.events import as_logprobs, as_token_ids
from trainer.data import DataError, StepFilter, TrajectoryLoader, TrajectoryStream, scan_commits
from trainer.synthetic import DEFAULT_RECIPE, make_step_rows, write_steps_commit


def _ids(stream: TrajectoryStream, limit: int | None = None) -> list[str]:
    return [i for b in itertools.islice(TrajectoryLoader(stream), limit) for i in b.sample_ids]


def _all_ids(root: Path) -> set[str]:
    import pyarrow.dataset as ds

    return set(ds.dataset(root / "steps", format="parquet").to_table(columns=["event_id"])["event_id"].to_pylist())


def test_packing_and_loss_mask(tmp_path):
    rows = make_step_rows(3, domains=("math",))
    toks = [([10, 11], [12, 13], [True, True]), ([20], [21, 22, 23], [True, False, True]), ([30, 31, 32], [33, 34], [True, True])]
    rows = [msgspec.structs.replace(r, observation_token_ids=as_token_ids(o), action_token_ids=as_token_ids(a),
                                    behaviour_logprobs=as_logprobs([-0.5] * len(a)), loss_mask=m, normalized_advantage=float(i))
            for i, (r, (o, a, m)) in enumerate(zip(rows, toks))]
    write_steps_commit(tmp_path, rows, commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=8, batch_size=2, shuffle=False, pad_id=0)))
    # row 0: segment a (4 tokens) + segment b (4 tokens); row 1: segment c (5 tokens) + 3 padding
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 23], [30, 31, 32, 33, 34, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2]]
    # loss only on action tokens whose loss_mask is true: a -> 12, 13; b -> 21, 23 (22 masked); c -> 33, 34
    assert b.loss_mask.tolist() == [[False, False, True, True, False, True, False, True],
                                    [False, False, False, True, True, False, False, False]]
    assert b.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, -1, -1, -1]]
    assert b.sample_ids == [r.event_id for r in rows]
    assert b.advantages.tolist()[0] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert b.behaviour_logprobs.tolist()[1] == [0, 0, 0, -0.5, -0.5, 0, 0, 0]
    assert b.policy_versions.tolist()[1][-1] == -1 and b.num_tokens == 13


def test_long_step_keeps_action_and_latest_context(tmp_path):
    (r,) = make_step_rows(1)
    r = msgspec.structs.replace(r, observation_token_ids=as_token_ids(list(range(100, 110))),
                                action_token_ids=as_token_ids([7, 8, 9]), behaviour_logprobs=as_logprobs([-1.0] * 3),
                                loss_mask=[True] * 3)
    write_steps_commit(tmp_path, [r], commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=6, batch_size=1)))
    assert b.input_ids.tolist() == [[107, 108, 109, 7, 8, 9]]


def test_two_ranks_two_workers_cover_every_sample_once(make_dataset):
    root = make_dataset((50, 30), row_group_size=4)
    seen: list[str] = []
    for rank in range(2):
        stream = TrajectoryStream(root, seq_len=64, batch_size=2, num_workers=2, rank=rank, world_size=2, seed=3)
        seen += _ids(stream)
    assert len(seen) == 80 and set(seen) == _all_ids(root)


def test_order_is_deterministic_per_seed(make_dataset):
    root = make_dataset((40,), row_group_size=4)
    a = _ids(TrajectoryStream(root, seq_len=64, batch_size=2, seed=1))
    b = _ids(TrajectoryStream(root, seq_len=64, batch_size=2, seed=1))
    c = _ids(TrajectoryStream(root, seq_len=64, batch_size=2, seed=2))
    assert a == b and sorted(a) == sorted(c) and a != c
    # epochs reshuffle: epoch 1 is a permutation of epoch 0, not a repeat
    two = _ids(TrajectoryStream(root, seq_len=64, batch_size=2, seed=1, max_epochs=2))
    assert sorted(two[:40]) == sorted(two[40:]) and two[:40] != two[40:]


def test_filters_are_applied(make_dataset):
    root = make_dataset((60,), domains=("code", "math"), policy_versions=(0, 1, 2, 3))
    import pyarrow.dataset as ds

    t = ds.dataset(root / "steps", format="parquet", partitioning="hive").to_table().to_pylist()
    flt = StepFilter(domains=("math",), min_policy_version=1, max_policy_version=2, min_advantage=0.0,
                     statuses=("success",))
    want = {r["event_id"] for r in t if r["domain"] == "math" and 1 <= r["policy_version"] <= 2
            and r["normalized_advantage"] >= 0 and r["status"] == "success"}
    got = _ids(TrajectoryStream(root, seq_len=64, batch_size=2, filters=flt))
    assert want and sorted(got) == sorted(want)


def test_uncommitted_files_are_never_visible(make_dataset):
    root = make_dataset((10,))
    # commit 2: data written, no manifest (crashed writer) -> only *.tmp files
    write_steps_commit(root, make_step_rows(10, seed=2, id_prefix="x2-"), commit=2, publish=False)
    # a stray finished file no manifest names
    stray = next((root / "steps").rglob("c00000001-s0000.parquet"))
    shutil.copy(stray, stray.with_name("c00000099-s0000.parquet"))
    assert [c.commit for c in scan_commits(root, recipe=DEFAULT_RECIPE)] == [1]
    # commit 2's manifest lands before its files are renamed into place: still invisible
    m = write_steps_commit(root / "scratch", make_step_rows(1), commit=2)
    (root / "_manifests" / DEFAULT_RECIPE / "00000002.json").write_text(json.dumps(m))
    assert [c.commit for c in scan_commits(root, recipe=DEFAULT_RECIPE)] == [1]
    ids = _ids(TrajectoryStream(root, seq_len=64, batch_size=2))
    assert len(ids) == 10
    assert not any(i.startswith("x2") for i in ids) and len(set(ids)) == 10


def test_tail_mode_picks_up_new_commits_and_never_partial_ones(make_dataset, tmp_path):
    root = make_dataset((12,))
    stream = TrajectoryStream(root, seq_len=48, batch_size=1, mode="tail", poll_interval_s=0.05, idle_timeout_s=1.0)
    it = iter(TrajectoryLoader(stream))
    seen = list(next(it).sample_ids)
    # while iterating: commit 2 lands; commit 3 is written but not committed (no manifest)
    write_steps_commit(root, make_step_rows(9, seed=2, id_prefix="c2-"), commit=2)
    write_steps_commit(root, make_step_rows(7, seed=3, id_prefix="c3-"), commit=3, publish=False)
    for b in it:
        seen += b.sample_ids
    c2 = {r.event_id for r in make_step_rows(9, seed=2, id_prefix="c2-")}
    assert len(seen) == 21 and len(set(seen)) == 21 and c2 <= set(seen)
    assert not any(s.startswith("c3-") for s in seen) and not any(s.startswith("c3-") for s in _ids(
        TrajectoryStream(root, seq_len=48, batch_size=1, mode="tail", poll_interval_s=0.05, idle_timeout_s=0.2)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_exactly_the_next_batches(make_dataset, num_workers):
    root = make_dataset((23, 17), row_group_size=3)
    kw = dict(seq_len=40, batch_size=2, seed=5, num_workers=num_workers, max_epochs=None)  # several epochs
    full = [b.sample_ids for b in itertools.islice(TrajectoryLoader(TrajectoryStream(root, **kw)), 45)]
    first = TrajectoryLoader(TrajectoryStream(root, **kw))
    head = [b.sample_ids for b in itertools.islice(first, 17)]
    state = msgspec.json.decode(msgspec.json.encode(first.state_dict()))  # survives JSON
    del first
    resumed = TrajectoryLoader(TrajectoryStream(root, **kw))
    resumed.load_state_dict(state)
    tail = [b.sample_ids for b in itertools.islice(resumed, 45 - 17)]
    assert head + tail == full


def test_resume_rejects_other_settings(make_dataset):
    root = make_dataset((10,))
    s = TrajectoryStream(root, seq_len=40, batch_size=2, seed=1)
    with pytest.raises(DataError, match="seed"):
        TrajectoryStream(root, seq_len=40, batch_size=2, seed=2).load_state_dict(s.state_dict())


def test_several_recipes_need_a_choice(make_dataset, tmp_path):
    root = make_dataset((5,))
    write_steps_commit(root, make_step_rows(5, recipe="other-11111111"), commit=1, recipe="other-11111111")
    with pytest.raises(DataError, match="recipe"):
        _ids(TrajectoryStream(root, seq_len=40, batch_size=2))
    assert len(_ids(TrajectoryStream(root, seq_len=40, batch_size=2, recipe="other-11111111"))) == 5
