"""Dataset rows (the column-wise builder equals the row-per-object definition) and the staged-shard writer."""

from collections import defaultdict
from pathlib import Path

import pytest
from apache_beam.pvalue import TaggedOutput
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.assemble import assemble_episode, dedupe_events
from pipelines.clip import clip_episode
from pipelines.recipes import Recipe
from pipelines.rewards import annotate_rewards
from pipelines.normalize import merge_stats
from pipelines.sinks import (
    STAGED_SUFFIX,
    RowsBuffer,
    _FinalizeShardFn,
    _StageRowsFn,
    episode_rows,
    rows_to_table,
)
from pipelines.verify import _VerifyFn
from schemas.datasets import step_file_schema, trajectory_file_schema
from tests.pipelines.helpers import episodes


def _prepared(recipe: Recipe):
    verify = _VerifyFn(use_domain_verifiers=True)
    verify.setup()
    out = []
    for i, evs in enumerate(episodes(12, seed=13)):
        unique, _, _ = dedupe_events(evs)
        if i == 3:  # one unfinished episode: a trajectory row, no step rows
            out.append(assemble_episode(evs[0].episode_id, unique[:-1], complete=False, reason="unfinished"))
            continue
        ep = next(verify.process(assemble_episode(evs[0].episode_id, unique, complete=True, reason=None)))
        ep = annotate_rewards(ep, recipe)
        out.append(clip_episode(ep, max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens,
                                gamma=recipe.gamma))
    return out


def test_rows_buffer_equals_episode_rows():
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


def test_empty_rows_buffer_gives_empty_tables():
    trajs, steps = RowsBuffer(Recipe(name="o")).tables()
    assert trajs.num_rows == steps.num_rows == 0 and steps.schema == step_file_schema()


def _stage(staging, recipe, eps):
    """Run _StageRowsFn over ``eps`` in one bundle: ({(domain, shard): [part bases]}, run stats)."""
    stage = _StageRowsFn(str(staging), recipe, shards=2)
    stage.start_bundle()
    outs = [o for e in eps for o in stage.process(e)] + [o.value if isinstance(o, WindowedValue) else o
                                                         for o in stage.finish_bundle()]
    parts, stats = defaultdict(list), defaultdict(list)
    for o in outs:
        if isinstance(o, TaggedOutput):
            key, st = o.value.value if isinstance(o.value, WindowedValue) else o.value
            stats[key].append(st)
        else:
            parts[o[0]].append(o[1])
    return dict(parts), {k: merge_stats(v) for k, v in stats.items()}


def _finalize(staging, recipe, parts, stats, *, threads):
    fn = _FinalizeShardFn(str(staging), recipe.version, 1, mode=recipe.normalization, eps=recipe.eps,
                          threads=threads)
    fn.setup()
    try:
        fn.start_bundle()
        files = [f for key, bases in sorted(parts.items()) for f in fn.process((key, bases), stats)]
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
    assert written[1] == written[3] and len(written[1]) == 2 * len(parts)


def test_a_failing_shard_fails_the_bundle(tmp_path):
    recipe = Recipe(name="o")
    eps = [e for e in _prepared(recipe) if e.complete]
    parts, stats = _stage(tmp_path, recipe, eps)
    key = sorted(parts)[0]
    Path(f"{parts[key][0]}.steps.arrow").unlink()  # a part lost under the worker
    with pytest.raises(FileNotFoundError):
        _finalize(tmp_path, recipe, parts, stats, threads=2)
