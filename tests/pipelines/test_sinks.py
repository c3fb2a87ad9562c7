"""Dataset rows (the column-wise builder equals the row-per-object definition) and the staged-shard writer."""

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from apache_beam.pvalue import TaggedOutput
from hypothesis import given, settings
from hypothesis import strategies as st
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.assemble import assemble_episode, dedupe_events
from pipelines.clip import clip_episode
from pipelines.groups import HeldGroup, add_group_stats, decide_commit
from pipelines.recipes import Recipe
from pipelines.rewards import annotate_rewards, step_passed, verification_score
from pipelines.sinks import (
    STAGED_SUFFIX,
    RowsBuffer,
    _FinalizeShardFn,
    _StageRowsFn,
    episode_rows,
    episodes_to_tables,
    finalize_shard,
    row_group_starts,
    rows_to_table,
    step_figures,
    write_parquet,
)
from pipelines.verify import _VerifyFn, step_disagreements
from schemas.datasets import Verification, step_file_schema, trajectory_file_schema
from schemas.events import SamplingParams, TokenIds
from tests.pipelines.helpers import as_group, edit, episodes, finished_as


def _variety(eps):
    """Synthetic episodes (groups of 4 declared) with every other v2 field set somewhere: sampling, context cuts,
    lineage, terminations."""
    eps = list(eps)
    eps[4] = edit(eps[4], started={"sampling": SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
                                   "policy_lineage": "run-a"},
                  steps={"context_cut_start": 12, "context_cut_tokens": 30})
    eps[5] = finished_as(eps[5], "timeout")
    eps[6] = finished_as(eps[6], "max_steps")
    return eps


def _prepared(recipe: Recipe):
    verify = _VerifyFn(use_domain_verifiers=True)
    verify.setup()
    out = []
    for i, evs in enumerate(_variety(episodes(12, seed=13))):
        unique, _, _ = dedupe_events(evs)
        if i == 3:  # one unfinished episode: a trajectory row, no step rows
            out.append(assemble_episode(evs[0].episode_id, unique[:-1], complete=False, reason="unfinished"))
            continue
        ep = next(verify.process(assemble_episode(evs[0].episode_id, unique, complete=True, reason=None)))
        ep = annotate_rewards(ep, recipe)
        out.append(clip_episode(ep, max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens,
                                gamma=recipe.gamma))
    return out


def test_episode_rows_read_back_the_rows_buffer_columns():
    # RowsBuffer defines the columns; episode_rows reads its rows back as objects: the round trip loses nothing
    recipe = Recipe(name="clipped", reward="verification_shaped", gamma=0.9, max_steps=2, max_action_tokens=40)
    eps = _prepared(recipe)
    assert any(e.clipped for e in eps) and any(not e.complete for e in eps)
    rows = RowsBuffer(recipe)
    for e in eps:
        rows.add(e)
    trajs, steps = rows.tables()
    want = [episode_rows(e, recipe) for e in eps]
    assert trajs.equals(rows_to_table([t for t, _ in want], trajectory_file_schema()))
    assert steps.equals(rows_to_table([s for _, ss in want for s in ss], step_file_schema()))
    assert len(rows) == len(eps) and steps.num_rows == rows.steps > 0
    _, first = want[0]  # the objects carry the partition keys and the events' token arrays
    assert {(s.domain, s.recipe) for s in first} == {(eps[0].domain, recipe.version)}
    assert [s.action_token_ids.tolist() for s in first] == [s.action_token_ids.tolist() for s in eps[0].steps]
    assert all(isinstance(s.observation_token_ids, TokenIds) for s in first) and want[3][1] == []
    # the v2 columns are filled from the events
    t, st = trajs.to_pylist(), steps.to_pylist()
    assert {r["group_size"] for r in t} == {4} and [r["group_member"] for r in t] == [i % 4 for i in range(12)]
    assert (t[5]["termination"], t[5]["trainable"], t[5]["excluded_reason"]) == ("timeout", False, "timeout")
    assert (t[6]["termination"], t[6]["trainable"]) == ("max_steps", True)
    assert t[4]["policy_lineage"] == "run-a" and not t[3]["complete"] and t[3]["termination"] == ""
    cut = [r for r in st if r["episode_id"] == eps[4].episode_id]
    assert {(r["temperature"], r["top_p"], r["top_k"], r["context_cut_start"], r["context_cut_tokens"],
             r["policy_lineage"]) for r in cut} == {(0.7, 0.9, 50, 12, 30, "run-a")}
    assert {(r["temperature"], r["top_p"], r["top_k"]) for r in st if r["episode_id"] == eps[0].episode_id} == {
        (1.0, 1.0, -1)}  # the synthetic episodes' sampling
    assert {r["trainable"] for r in st if r["episode_id"] == eps[5].episode_id} == {False}


def test_empty_rows_buffer_gives_empty_tables():
    trajs, steps = RowsBuffer(Recipe(name="o")).tables()
    assert trajs.num_rows == steps.num_rows == 0 and steps.schema == step_file_schema()


def _stage(staging, recipe, eps):
    """Run _StageRowsFn over ``eps`` in one bundle: ({(domain, shard): [part bases]}, run group stats)."""
    stage = _StageRowsFn(str(staging), recipe, shards=2)
    stage.start_bundle()
    outs = [o for e in eps for o in stage.process(e)] + [o.value if isinstance(o, WindowedValue) else o
                                                         for o in stage.finish_bundle()]
    parts, stats = defaultdict(list), {}
    for o in outs:
        if isinstance(o, TaggedOutput):
            add_group_stats(stats, o.value.value if isinstance(o.value, WindowedValue) else o.value)
        else:
            parts[o[0]].append(o[1])
    return dict(parts), stats


def _finalize(staging, recipe, parts, stats, *, threads, held=None, clock_s=0.0):
    fn = _FinalizeShardFn(str(staging), recipe.version, 1, mode=recipe.normalization, eps=recipe.eps,
                          threads=threads, held=held)
    fn.setup()
    try:
        fn.start_bundle()
        files = [f for key, bases in sorted(parts.items()) for f in fn.process((key, bases), stats, clock_s)]
        files += [wv.value for wv in fn.finish_bundle()]
    finally:
        fn.teardown()
    return files


def test_finalize_on_a_thread_pool_writes_the_bytes_one_thread_writes(tmp_path):
    recipe = Recipe(name="shaped", reward="verification_shaped", gamma=0.9)
    eps = [e for e in _prepared(recipe) if e.complete]
    written = {}
    for threads in (1, 3):
        staging = tmp_path / f"t{threads}"
        parts, stats = _stage(staging, recipe, eps)
        assert len(parts) > 3  # several shards in the bundle, so the pool has work to share
        files = _finalize(staging, recipe, parts, stats, threads=threads)
        written[threads] = {f: (staging / (f + STAGED_SUFFIX)).read_bytes() for f in files}
        assert not list((staging / "_parts").iterdir())  # merged parts are removed
    # every shard writes its two tables, or (the code domain's group misses a member) its held rows
    assert written[1] == written[3] and len(written[1]) == 2 * len(parts)
    assert {f.split("/")[0] for f in written[1]} == {"steps", "trajectories", "state"}


def test_a_held_group_is_staged_as_state_and_the_rest_normalized(tmp_path):
    recipe = Recipe(name="grpo", normalization="group")
    eps = [e for e in _prepared(recipe) if e.complete]
    key = eps[0].group_key  # 3 of the 4 members of a declared group of 4 (the 4th is the unfinished one)
    parts, stats = _stage(tmp_path, recipe, eps)
    assert stats[key].size == 4 and stats[key].members == (0, 1, 2)
    files = _finalize(tmp_path, recipe, parts, stats, threads=1)
    held = [f for f in files if f.startswith("state/held/") and f.endswith(".trajectories.arrow")]
    assert held == [f"state/held/domain={key[0]}/s{s:03d}.trajectories.arrow"
                    for s in sorted({s for d, s in parts if d == key[0]})]
    held_ids = set().union(*(feather.read_table(tmp_path / f"{h}{STAGED_SUFFIX}")["episode_id"].to_pylist()
                             for h in held))
    assert held_ids == {e.episode_id for e in eps[:3]}
    written = pa.concat_tables([pq.read_table(tmp_path / (f + STAGED_SUFFIX)) for f in files
                                if f.startswith("trajectories/")])
    assert held_ids.isdisjoint(written["episode_id"].to_pylist())
    assert len(written) == len(eps) - 3
    # held next commit too while its 4th member is missing and the timeout has not passed; then closed as it is
    held_group = HeldGroup(domain=key[0], task_group=key[1], policy_version=key[2], since_s=0.0, stats=stats[key])
    assert list(decide_commit({}, {key: held_group}, clock_s=599.0, timeout_s=600, prior={}).held) == [key]
    late = decide_commit({}, {key: held_group}, clock_s=600.0, timeout_s=600, prior={})
    assert not late.held and late.released[key].timed_out and late.counts()["groups_timed_out"] == 1


def test_finalize_shard_releases_a_group_with_its_held_members(tmp_path):
    recipe = Recipe(name="grpo", normalization="group", eps=1e-9)
    eps = [annotate_rewards(next(_VerifyFn(False).process(assemble_episode(
        evs[0].episode_id, evs, complete=True, reason=None))), recipe)
        for evs in as_group(episodes(4, seed=2), size=4)]
    from pipelines.groups import group_stats_of_tables

    first, second = episodes_to_tables(eps[:3], recipe), episodes_to_tables(eps[3:], recipe)
    domain = eps[0].domain
    st1 = group_stats_of_tables(*first, domain=domain)
    d1 = decide_commit(st1, {}, clock_s=10.0, timeout_s=600, prior={})
    assert list(d1.held) == [eps[0].group_key] and not d1.released
    finalize_shard(tmp_path / "c1", "v", 1, domain, 0, *first, d1, mode="group", eps=recipe.eps)
    base = tmp_path / "c1" / f"state/held/domain={domain}/s000"
    held_t, held_s = (feather.read_table(f"{base}.{t}.arrow{STAGED_SUFFIX}") for t in ("trajectories", "steps"))
    st2 = group_stats_of_tables(*second, domain=domain)
    d2 = decide_commit(st2, d1.held, clock_s=20.0, timeout_s=600, prior={})
    assert list(d2.released) == [eps[0].group_key] and not d2.released[eps[0].group_key].timed_out
    files, n_steps, n_trajs = finalize_shard(tmp_path / "c2", "v", 2, domain, 0,
                                             pa.concat_tables([second[0], held_t]),
                                             pa.concat_tables([second[1], held_s]), d2, mode="group", eps=recipe.eps)
    assert n_trajs == 4 and n_steps == sum(len(e.steps) for e in eps)
    trajs = pq.read_table(tmp_path / "c2" / (files[0] + STAGED_SUFFIX)).to_pylist()
    G = np.array([e.episode_return for e in eps])
    want = (G - G.mean()) / (G.std() + recipe.eps)  # GRPO over the whole group of 4
    np.testing.assert_allclose([r["group_advantage"] for r in trajs], want[np.argsort([e.episode_id for e in eps])])
    assert {r["group_members"] for r in trajs} == {4}


def test_parquet_row_groups_never_split_an_episode(tmp_path):
    recipe = Recipe(name="o")
    eps = [e for e in _prepared(recipe) if e.complete]
    _, steps = episodes_to_tables(eps, recipe)  # 2-6 steps an episode, sorted by episode
    write_parquet(steps, tmp_path / "s.parquet", row_group_rows=10)
    f = pq.ParquetFile(tmp_path / "s.parquet")
    assert f.metadata.num_row_groups > 2
    seen: dict[str, int] = {}
    for g in range(f.metadata.num_row_groups):
        ids = f.read_row_group(g, columns=["episode_id"])["episode_id"].to_pylist()
        assert len(ids) <= 10
        for i in set(ids):
            assert i not in seen, f"episode {i} in row groups {seen[i]} and {g}"
            seen[i] = g
    assert sum(len(e.steps) for e in eps) == f.metadata.num_rows and len(seen) == len(eps)
    assert pq.read_table(tmp_path / "s.parquet").equals(steps)
    # a long episode gets a row group of its own; the greedy cut never waits past the target
    assert row_group_starts(pa.array(list("aabbbbbbbcd")), target=3) == [0, 2, 9]


def test_a_failing_shard_fails_the_bundle(tmp_path):
    recipe = Recipe(name="o")
    eps = [e for e in _prepared(recipe) if e.complete]
    parts, stats = _stage(tmp_path, recipe, eps)
    key = sorted(parts)[0]
    Path(f"{parts[key][0]}.steps.arrow").unlink()  # a part lost under the worker
    with pytest.raises(FileNotFoundError):
        _finalize(tmp_path, recipe, parts, stats, threads=2)


_VERDICT = st.builds(
    Verification,
    verifier=st.sampled_from(["a", "b", "code.parses", "pipeline.token_consistency", "format.valid"]),
    passed=st.booleans(),
    score=st.sampled_from([0.0, 0.25, 1.0 / 3.0, 0.5, 1.0, 0.1 + 0.2]),
    source=st.sampled_from(["rollout", "pipeline"]),
    counted=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_VERDICT, max_size=7), st.sampled_from([{}, {"a": 2.0}, {"b": 0.5, "format.valid": 3.0}]))
def test_step_figures_are_the_three_definitions_in_one_pass(verdicts, weights):
    assert step_figures(verdicts, weights) == (verification_score(verdicts, weights), step_passed(verdicts),
                                               step_disagreements(verdicts))
