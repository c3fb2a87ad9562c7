"""Streaming dataset: episode windows, loss mask, sharding, order, filters, tail mode, exact resume."""

from __future__ import annotations

import collections
import itertools
import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest

from rollout.context import model_input_of
from schemas.events import as_logprobs, as_token_ids
from schemas.manifests import commit_log_of
from trainer.data import DataError, StepFilter, TrajectoryLoader, TrajectoryStream, plan_windows, scan_commits
from trainer.synthetic import DEFAULT_RECIPE, make_step_rows, write_steps_commit


def _ids(stream: TrajectoryStream, limit: int | None = None) -> list[str]:
    return [i for b in itertools.islice(TrajectoryLoader(stream), limit) for i in b.sample_ids]


def _episodes(stream: TrajectoryStream) -> list[str]:
    """Episode ids in packing order, each once (its windows are consecutive)."""
    out: list[str] = []
    for i in _ids(stream):
        e = i.rsplit("#w", 1)[0]
        if not out or out[-1] != e:
            out.append(e)
    return out


def _counts(stream: TrajectoryStream) -> collections.Counter:
    total: collections.Counter = collections.Counter()
    for b in TrajectoryLoader(stream):
        total.update(b.counts.as_dict())
    return total


def _all_episodes(root: Path) -> set[str]:
    import pyarrow.dataset as ds

    t = ds.dataset(root / "steps", format="parquet").to_table(columns=["episode_id"])
    return set(t["episode_id"].to_pylist())


def _episode(steps, *, episode_id="ep-0", policy_version=0, trainable=True, **common):
    """Rows of one episode from ``(obs, act, loss_mask, advantage)`` (+ optional dict of overrides) per step."""
    (proto,) = make_step_rows(1, steps=(1, 1))
    rows = []
    for k, step in enumerate(steps):
        obs, act, mask, adv = step[:4]
        extra = step[4] if len(step) > 4 else {}
        rows.append(msgspec.structs.replace(
            proto, episode_id=episode_id, step_index=k, num_steps=len(steps), event_id=f"{episode_id}-{k}",
            observation_token_ids=as_token_ids(obs), action_token_ids=as_token_ids(act),
            behaviour_logprobs=as_logprobs([-0.5 - k] * len(act)), loss_mask=mask, normalized_advantage=adv,
            policy_version=policy_version, trainable=trainable, domain="math", **{**common, **extra}))
    return rows


# ----------------------------------------------------------------------------- windows


def test_plan_windows_exact_runs_and_context_cuts():
    # steps (obs, act): (4, 2), (2, 3), (2, 2); stream: obs0 0-3, act0 4-5, obs1 6-7, act1 8-10, obs2 11-12, act2 13-14
    # s = [0, 6, 11], a = [4, 8, 13], e = [6, 11, 15]
    obs, act = [4, 2, 2], [2, 3, 2]
    # no cut, seq_len 15: one exact window over the whole stream (head 1 + stream[1:15])
    (w,) = plan_windows(obs, act, cut_start=[0] * 3, cut_tokens=[0] * 3, trained=[True] * 3, seq_len=15)
    assert (w.first_step, w.last_step, w.head, w.start, w.end, w.exact, w.tokens) == (0, 2, 1, 1, 15, True, 15)
    # step 2 was fed with a cut of 5 tokens at 2 (input stream[:2] + stream[7:13], 8 tokens): two runs
    # run 1 = steps 0-1 uncut: stream[:11]; run 2 = step 2: stream[:2] + stream[7:15] = 10 tokens
    ws = plan_windows(obs, act, cut_start=[0, 0, 2], cut_tokens=[0, 0, 5], trained=[True] * 3, seq_len=11)
    assert [(w.first_step, w.last_step, w.head, w.start, w.end, w.exact) for w in ws] == \
        [(0, 1, 1, 1, 11, True), (2, 2, 2, 7, 15, True)]
    # steps 1 and 2 share the cut (2, 1): e - n = 10 and 14 -> with seq_len 10 only step 1 is exact;
    # step 2: head 2, start = max(2 + 1, 15 - (10 - 2)) = 7 (keeps its whole observation, s_2 = 11)
    ws = plan_windows(obs, act, cut_start=[0, 2, 2], cut_tokens=[0, 1, 1], trained=[True] * 3, seq_len=10)
    assert [(w.first_step, w.last_step, w.head, w.start, w.end, w.exact) for w in ws] == \
        [(0, 0, 1, 1, 6, True), (1, 1, 2, 3, 11, True), (2, 2, 2, 7, 15, False)]
    # untrained steps are context only: step 0 untrained -> the run's window starts at step 1, same stream
    ws = plan_windows(obs, act, cut_start=[0] * 3, cut_tokens=[0] * 3, trained=[False, True, False], seq_len=15)
    assert [(w.first_step, w.last_step, w.start, w.end) for w in ws] == [(1, 1, 1, 11)]


def test_plan_windows_splits_a_long_run_and_truncates_a_long_action():
    # uncut 3 steps of (obs 3, act 4): s = [0, 7, 14], a = [3, 10, 17], e = [7, 14, 21]; seq_len 8
    # step 0: e - 0 = 7 <= 8 exact; step 1: 14 > 8 inexact, start = max(1, 14 - 7) = 7 = s_1, step 2 does not
    # fit with step 1's observation (1 + 21 - 7 = 15 > 8); step 2: start = 21 - 7 = 14
    ws = plan_windows([3, 3, 3], [4, 4, 4], cut_start=[0] * 3, cut_tokens=[0] * 3, trained=[True] * 3, seq_len=8)
    assert [(w.first_step, w.last_step, w.head, w.start, w.end, w.exact) for w in ws] == \
        [(0, 0, 1, 1, 7, True), (1, 1, 1, 7, 14, False), (2, 2, 1, 14, 21, False)]
    # an action of 10 tokens after a 3-token prompt, seq_len 6: head 1 + act[0:5]; 5 action tokens cut
    (w,) = plan_windows([3], [10], cut_start=[0], cut_tokens=[0], trained=[True], seq_len=6)
    assert (w.head, w.start, w.end, w.exact, w.tokens) == (1, 3, 8, False, 6)
    with pytest.raises(ValueError, match="context cut"):
        plan_windows([3, 2], [2, 2], cut_start=[0, 4], cut_tokens=[0, 4], trained=[True] * 2, seq_len=8)


def test_episode_stream_is_one_segment_with_loss_on_actions_only(tmp_path):
    # obs0 [10, 11] act0 [12, 13]; obs1 [14] act1 [15, 16, 17] (16 masked out); advantages 1 and 2
    rows = _episode([([10, 11], [12, 13], [True, True], 1.0), ([14], [15, 16, 17], [True, False, True], 2.0)],
                    temperature=0.7, top_p=0.9, top_k=20)
    write_steps_commit(tmp_path, rows, commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=10, batch_size=1, shuffle=False)))
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]]
    assert b.loss_mask.tolist() == [[False, False, True, True, False, True, False, True, False, False]]
    assert b.advantages.tolist() == [[0, 0, 1, 1, 0, 2, 2, 2, 0, 0]]
    # behaviour log-probs of step k are -0.5 - k, on action tokens only
    assert b.behaviour_logprobs.tolist() == [[0, 0, -0.5, -0.5, 0, -1.5, -1.5, -1.5, 0, 0]]
    assert b.has_behaviour_logprobs.tolist()[0] == [False, False, True, True, False, True, True, True, False, False]
    assert b.temperature.tolist()[0][:8] == pytest.approx([0.7] * 8) and b.temperature.tolist()[0][8:] == [1, 1]
    assert b.top_p.tolist()[0] == [0.9] * 8 + [1.0, 1.0] and b.top_k.tolist()[0] == [20] * 8 + [0, 0]
    assert b.segment_ids.tolist() == [[0] * 8 + [-1, -1]] and b.episode_index.tolist() == [[0] * 8 + [-1, -1]]
    assert b.sample_ids == ["ep-0#w0"] and b.episode_ids == ["ep-0"] and b.num_tokens == 8
    assert b.lineages == [""] and b.lineage_ids.tolist()[0] == [0] * 8 + [-1, -1]
    assert (b.counts.episodes, b.counts.windows, b.counts.inexact_windows) == (1, 1, 0)


def test_recorded_cut_is_rebuilt_token_for_token(tmp_path):
    # stream: 10 11 12 13 | 14 15 | 20 21 | 22 23 24 | 30 31 | 32 33 (positions 0..14)
    # step 2 saw stream[:2] + stream[7:13] (cut 5 at 2): its window is that input, then its action
    obs = [[10, 11, 12, 13], [20, 21], [30, 31]]
    act = [[14, 15], [22, 23, 24], [32, 33]]
    cut = [(0, 0), (0, 0), (2, 5)]
    rows = _episode([(o, a, [True] * len(a), 0.5, {"context_cut_start": c, "context_cut_tokens": n})
                     for o, a, (c, n) in zip(obs, act, cut)])
    write_steps_commit(tmp_path, rows, commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=11, batch_size=2, shuffle=False)))
    window2 = model_input_of(obs, act, step=2, cut_start=2, cut_tokens=5) + act[2]
    assert window2 == [10, 11, 21, 22, 23, 24, 30, 31, 32, 33]
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24], window2 + [0]]
    # row 0 trains steps 0 and 1 (14, 15, 22, 23, 24); row 1 only step 2 (act1's 22, 23, 24 are context there)
    assert b.loss_mask.tolist() == [[False] * 4 + [True, True, False, False, True, True, True],
                                    [False] * 8 + [True, True, False]]
    assert b.episode_index.tolist()[1][:8] == [0] * 8 and b.sample_ids == ["ep-0#w0", "ep-0#w1"]
    assert b.counts.inexact_windows == 0 and b.counts.episodes == 1 and b.counts.windows == 2


@pytest.mark.parametrize("max_model_len", [48, 80])
def test_windows_are_exact_when_seq_len_covers_the_model_context(tmp_path, max_model_len):
    # episodes of up to 6 steps with cuts recorded as a policy of this context length cuts them;
    # seq_len = max_model_len: every window exact and every trained action's context is the model's input
    rows = make_step_rows(40, seed=4, steps=(1, 6), obs_tokens=(3, 20), action_tokens=(2, 12),
                          max_model_len=max_model_len)
    assert sum(r.context_cut_tokens > 0 for r in rows) > 10
    write_steps_commit(tmp_path, rows, commit=1, row_group_size=16)
    by_episode = collections.defaultdict(list)
    for r in rows:
        by_episode[r.episode_id].append(r)
    checked = 0
    stream = TrajectoryStream(tmp_path, seq_len=max_model_len, batch_size=3, seed=1)
    for b in TrajectoryLoader(stream):
        assert b.counts.inexact_windows == 0 and b.counts.inexact_tokens == 0 and b.counts.truncated_tokens == 0
        for s, sample in enumerate(b.sample_ids):
            steps = by_episode[sample.rsplit("#w", 1)[0]]
            obs = [r.observation_token_ids.tolist() for r in steps]
            act = [r.action_token_ids.tolist() for r in steps]
            seg = (b.segment_ids == s).nonzero()
            row, cols = int(seg[0, 0]), seg[:, 1]
            ids = b.input_ids[row, cols].tolist()
            trained_at = set(cols[b.loss_mask[row, cols]].tolist())
            # every action in the segment whose tokens are trained follows exactly the model's input of its step
            for k, r in enumerate(steps):
                for start in range(len(ids) - len(act[k]) + 1):
                    if ids[start:start + len(act[k])] == act[k] and int(cols[start + len(act[k]) - 1]) in trained_at:
                        want = model_input_of(obs, act, step=k, cut_start=r.context_cut_start,
                                              cut_tokens=r.context_cut_tokens)
                        assert ids[:start] == want
                        checked += 1
                        break
    assert checked > 60
    # with a shorter seq_len some windows must cut more context: counted, exposed per batch
    c = _counts(TrajectoryStream(tmp_path, seq_len=max_model_len // 2, batch_size=3, seed=1))
    assert c["inexact_windows"] > 0 and c["inexact_tokens"] > 0


def test_long_action_is_truncated_and_counted(tmp_path):
    rows = _episode([(list(range(100, 110)), [7, 8, 9, 10, 11, 12], [True] * 6, 1.0)])
    write_steps_commit(tmp_path, rows, commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=5, batch_size=1)))
    # head (first prompt token) + the first 4 action tokens; 2 action tokens cut, never trained
    assert b.input_ids.tolist() == [[100, 7, 8, 9, 10]]
    assert b.loss_mask.tolist() == [[False, True, True, True, True]]
    assert (b.counts.inexact_windows, b.counts.inexact_tokens, b.counts.truncated_tokens) == (1, 4, 2)


def test_episodes_without_context_or_trained_steps_are_skipped_and_counted(tmp_path):
    no_context = _episode([([], [5, 6], [True, True], 1.0)], episode_id="a-no-context")
    untrainable = _episode([([5], [6, 7], [True, True], 1.0)], episode_id="b-timeout", trainable=False)
    masked = _episode([([5], [6, 7], [False, False], 1.0)], episode_id="c-all-masked")
    ok = _episode([([5], [6, 7], [True, True], 1.0)], episode_id="d-ok")
    write_steps_commit(tmp_path, no_context + untrainable + masked + ok, commit=1)
    stream = TrajectoryStream(tmp_path, seq_len=8, batch_size=1, shuffle=False)
    (b,) = list(TrajectoryLoader(stream))
    assert b.episode_ids == ["d-ok"]
    assert (b.counts.episodes_without_context, b.counts.episodes_untrained) == (1, 2)
    # include_untrainable trains the timed-out episode too
    stream = TrajectoryStream(tmp_path, seq_len=8, batch_size=2, shuffle=False,
                              filters=StepFilter(include_untrainable=True))
    assert _episodes(stream) == ["b-timeout", "d-ok"]


def test_filters_choose_trained_steps_not_the_context(tmp_path):
    # step 0 has advantage -1 (filtered out), step 1 +1: the window still holds step 0's tokens as context
    rows = _episode([([10, 11], [12, 13], [True, True], -1.0), ([14], [15, 16], [True, True], 1.0)])
    write_steps_commit(tmp_path, rows, commit=1)
    (b,) = list(TrajectoryLoader(TrajectoryStream(tmp_path, seq_len=7, batch_size=1,
                                                  filters=StepFilter(min_advantage=0.0))))
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 16]]
    assert b.loss_mask.tolist() == [[False, False, False, False, False, True, True]]


def test_filters_over_many_episodes(make_dataset):
    root = make_dataset((60,), domains=("code", "math"), policy_versions=(0, 1, 2, 3), untrainable_every=5)
    import pyarrow.dataset as ds

    t = ds.dataset(root / "steps", format="parquet", partitioning="hive").to_table().to_pylist()
    flt = StepFilter(domains=("math",), min_policy_version=1, max_policy_version=2, min_advantage=0.0,
                     statuses=("success",))
    want = {r["episode_id"] for r in t if r["domain"] == "math" and 1 <= r["policy_version"] <= 2
            and r["normalized_advantage"] >= 0 and r["status"] == "success" and r["trainable"]}
    got = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, filters=flt))
    assert want and sorted(got) == sorted(want)


def test_row_groups_without_trained_steps_are_pruned(tmp_path):
    # row group 0: 2 trainable episodes; row group 1: 2 untrainable ones -> never read, so never counted
    rows = [r for i in range(2) for r in _episode([([5], [6, 7], [True, True], 1.0)], episode_id=f"a{i}")]
    rows += [r for i in range(2) for r in _episode([([5], [6, 7], [True, True], 1.0)], episode_id=f"b{i}",
                                                    trainable=False)]
    write_steps_commit(tmp_path, rows, commit=1, row_group_size=2)
    (f,) = (tmp_path / "steps").rglob("*.parquet")
    assert pq.ParquetFile(f).num_row_groups == 2
    c = _counts(TrajectoryStream(tmp_path, seq_len=16, batch_size=2))
    assert (c["episodes"], c["episodes_untrained"]) == (2, 0)
    c = _counts(TrajectoryStream(tmp_path, seq_len=16, batch_size=2, filters=StepFilter(min_advantage=5.0)))
    assert (c["episodes"], c["episodes_untrained"]) == (0, 0)


def test_an_episode_split_across_row_groups_is_an_error_naming_the_file(tmp_path):
    rows = make_step_rows(6, seed=0, steps=(3, 3), domains=("math",))
    write_steps_commit(tmp_path, rows, commit=1)
    (f,) = (tmp_path / "steps").rglob("*.parquet")
    pq.write_table(pq.read_table(f), f, row_group_size=4)  # 18 rows in groups of 4: episodes straddle groups
    with pytest.raises(DataError, match=r"c00000001-s0000.parquet \(row group \d\).*aligned to episodes"):
        _ids(TrajectoryStream(tmp_path, seq_len=256, batch_size=2))


def test_a_response_stays_in_one_batch_unless_larger_than_a_batch(make_dataset):
    root = make_dataset((30,), steps=(1, 5), max_model_len=40)
    seen: dict[str, int] = {}
    for n, b in enumerate(TrajectoryLoader(TrajectoryStream(root, seq_len=40, batch_size=4, seed=2))):
        for e in b.episode_ids:
            if e in seen:  # only an episode of more than a batch's windows may continue in the next batch
                assert seen[e] == n - 1 and b.episode_ids[0] == e
            seen[e] = n
    assert len(seen) == 30


# ----------------------------------------------------------------------------- sharding, order, commits


def test_two_ranks_two_workers_cover_every_episode_once(make_dataset):
    root = make_dataset((50, 30), row_group_size=4)
    seen: list[str] = []
    for rank in range(2):
        stream = TrajectoryStream(root, seq_len=256, batch_size=2, num_workers=2, rank=rank, world_size=2, seed=3)
        seen += _episodes(stream)
    assert len(seen) == 80 and set(seen) == _all_episodes(root)


def test_order_is_deterministic_per_seed(make_dataset):
    root = make_dataset((40,), row_group_size=8)
    a = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, seed=1))
    b = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, seed=1))
    c = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, seed=2))
    assert a == b and sorted(a) == sorted(c) and a != c and len(a) == 40
    # epochs reshuffle: epoch 1 is a permutation of epoch 0, not a repeat
    two = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, seed=1, max_epochs=2))
    assert sorted(two[:40]) == sorted(two[40:]) and two[:40] != two[40:]


@pytest.mark.parametrize("text", ["{not json", '{"commit": 2, "version": "v", "recipe_hash": "h", "source": "x", '
                                  '"files": "steps/a.parquet"}', '{"files": []}'])
def test_a_bad_manifest_is_one_data_error(make_dataset, text):
    root = make_dataset((4,))
    commit_log_of(root, DEFAULT_RECIPE).snapshot().commit(text.encode())  # commit 2's record is no manifest
    with pytest.raises(DataError, match=rf"commit 2 of {DEFAULT_RECIPE} at .* is unreadable or has no `files` list"):
        scan_commits(root, recipe=DEFAULT_RECIPE)
    assert [c.commit for c in scan_commits(root, recipe=DEFAULT_RECIPE, upto=1)] == [1]


def test_uncommitted_files_are_never_visible(make_dataset):
    root = make_dataset((10,))
    # commit 2: data written, no manifest (crashed writer) -> only *.tmp files
    write_steps_commit(root, make_step_rows(10, seed=2, id_prefix="x2-"), commit=2, publish=False)
    # a stray finished file no manifest names
    stray = next((root / "steps").rglob("c00000001-s0000.parquet"))
    shutil.copy(stray, stray.with_name("c00000099-s0000.parquet"))
    assert [c.commit for c in scan_commits(root, recipe=DEFAULT_RECIPE)] == [1]
    # commit 2's manifest lands before its files are renamed into place: still invisible
    m = write_steps_commit(root / "scratch", make_step_rows(1), commit=2, publish=False)
    commit_log_of(root, DEFAULT_RECIPE).snapshot().commit(json.dumps(m).encode())
    assert [c.commit for c in scan_commits(root, recipe=DEFAULT_RECIPE)] == [1]
    eps = _episodes(TrajectoryStream(root, seq_len=256, batch_size=2))
    assert len(eps) == 10 and not any(e.startswith("x2") for e in eps) and len(set(eps)) == 10


def test_a_temporary_directory_too_long_for_the_workers_sockets_is_one_error(make_dataset, tmp_path, monkeypatch):
    """A worker's ``bind`` of ``<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX`` past 107 bytes used to hang the trainer."""
    import tempfile

    root = make_dataset((4,))
    long = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    assert len(str(long)) + 32 > 107
    with pytest.raises(DataError, match=r"too long for the data loader workers' sockets .* set TMPDIR"):
        TrajectoryLoader(TrajectoryStream(root, seq_len=256, batch_size=2, num_workers=1))
    # no workers, no sockets: the same directory is fine
    assert _episodes(TrajectoryStream(root, seq_len=256, batch_size=2, num_workers=0))
    # a short temporary directory: the worker delivers
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert list(TrajectoryLoader(TrajectoryStream(root, seq_len=256, batch_size=2, num_workers=1)))


def test_tail_mode_picks_up_new_commits_and_never_partial_ones(make_dataset):
    root = make_dataset((12,))
    stream = TrajectoryStream(root, seq_len=256, batch_size=1, mode="tail", poll_interval_s=0.05, idle_timeout_s=1.0)
    it = iter(TrajectoryLoader(stream))
    seen = list(next(it).episode_ids)
    # while iterating: commit 2 lands; commit 3 is written but not committed (no manifest)
    write_steps_commit(root, make_step_rows(9, seed=2, id_prefix="c2-"), commit=2)
    write_steps_commit(root, make_step_rows(7, seed=3, id_prefix="c3-"), commit=3, publish=False)
    for b in it:
        seen += [e for e in b.episode_ids if not seen or e != seen[-1]]
    c2 = {r.episode_id for r in make_step_rows(9, seed=2, id_prefix="c2-")}
    assert len(seen) == 21 and len(set(seen)) == 21 and c2 <= set(seen)
    assert not any(s.startswith("c3-") for s in seen) and not any(s.startswith("c3-") for s in _ids(
        TrajectoryStream(root, seq_len=256, batch_size=1, mode="tail", poll_interval_s=0.05, idle_timeout_s=0.2)))


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_exactly_the_next_batches(make_dataset, num_workers):
    # long episodes in short windows: some batches end inside an episode (position window > 0)
    root = make_dataset((23, 17), row_group_size=6, steps=(1, 5), max_model_len=40)
    kw = dict(seq_len=40, batch_size=2, seed=5, num_workers=num_workers, max_epochs=None)  # several epochs
    full_batches = list(itertools.islice(TrajectoryLoader(TrajectoryStream(root, **kw)), 100))  # ~65 an epoch
    full = [b.sample_ids for b in full_batches]
    assert any(b.position.window > 0 for b in full_batches) and any(b.position.epoch > 0 for b in full_batches)
    for cut in (17, 72):
        first = TrajectoryLoader(TrajectoryStream(root, **kw))
        head = [b.sample_ids for b in itertools.islice(first, cut)]
        state = msgspec.json.decode(msgspec.json.encode(first.state_dict()))  # survives JSON
        del first
        resumed = TrajectoryLoader(TrajectoryStream(root, **kw))
        resumed.load_state_dict(state)
        tail = [b.sample_ids for b in itertools.islice(resumed, 100 - cut)]
        assert head + tail == full


def test_resume_rejects_other_settings_and_old_positions(make_dataset):
    root = make_dataset((10,))
    s = TrajectoryStream(root, seq_len=40, batch_size=2, seed=1)
    with pytest.raises(DataError, match="seed"):
        TrajectoryStream(root, seq_len=40, batch_size=2, seed=2).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="filters"):
        TrajectoryStream(root, seq_len=40, batch_size=2, seed=1,
                         filters=StepFilter(include_untrainable=True)).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="format 1"):
        TrajectoryStream(root, seq_len=40, batch_size=2, seed=1).load_state_dict({**s.state_dict(), "format": 1})


def test_several_recipes_need_a_choice(make_dataset):
    root = make_dataset((5,))
    write_steps_commit(root, make_step_rows(5, recipe="other-11111111"), commit=1, recipe="other-11111111")
    with pytest.raises(DataError, match="recipe"):
        _ids(TrajectoryStream(root, seq_len=256, batch_size=2))
    assert len(_episodes(TrajectoryStream(root, seq_len=256, batch_size=2, recipe="other-11111111"))) == 5


def test_synthetic_rows_form_a_stream(tmp_path):
    rows = make_step_rows(3, seed=9, steps=(3, 3), max_model_len=30, obs_tokens=(5, 9), action_tokens=(2, 6))
    assert [r.step_index for r in rows] == [0, 1, 2] * 3 and all(r.num_steps == 3 for r in rows)
    for k in range(3):
        ep = rows[3 * k:3 * k + 3]
        obs = [r.observation_token_ids.tolist() for r in ep]
        act = [r.action_token_ids.tolist() for r in ep]
        for i, r in enumerate(ep):
            # the recorded cut keeps every input within max_model_len - max action (30 - 6 = 24)
            n_input = len(model_input_of(obs, act, step=i, cut_start=r.context_cut_start,
                                         cut_tokens=r.context_cut_tokens))
            assert n_input <= 24 and n_input == min(24, sum(map(len, obs[:i + 1])) + sum(map(len, act[:i])))
    assert np.all([r.trainable for r in rows])


def test_a_worker_that_crashes_writes_its_stack_and_the_loader_says_it_died(make_dataset, monkeypatch, capfd):
    """A DataLoader worker killed by SIGSEGV: its Python stack (every thread) is on stderr, the loader raises."""
    import ctypes

    root = make_dataset((4,))

    def crash_in_the_worker(self, shard, start):
        ctypes.string_at(0)  # a read of address 0: SIGSEGV in the worker process
        yield from ()

    monkeypatch.setattr(TrajectoryStream, "_iter_offline", crash_in_the_worker)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
        list(TrajectoryLoader(TrajectoryStream(root, seq_len=256, batch_size=2, num_workers=1)))
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err
    assert "in crash_in_the_worker" in err and "in __iter__" in err
