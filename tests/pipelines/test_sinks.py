"""Dataset rows: the column-wise builder equals the row-per-object definition."""

from pipelines.assemble import assemble_episode, dedupe_events
from pipelines.clip import clip_episode
from pipelines.recipes import Recipe
from pipelines.rewards import annotate_rewards
from pipelines.sinks import RowsBuffer, episode_rows, rows_to_table
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
