"""A plain polars implementation of the trajectory transforms over an archive (reference + benchmark).

Same recipe → same per-step ``reward``, ``return_to_go``, ``advantage`` and
``normalized_advantage``, and the same per-episode ``episode_return``,
``normalized_return`` and ``group_advantage``, as the Beam job for complete
episodes on a fresh dataset root (no prior statistics); like the job it writes
a ``steps`` and a ``trajectories`` table. Differences, by design of a reference:
it does not re-run the domain verifiers (``s_t`` uses the rollout-time
verdicts and the generic token-consistency check, as the Beam job does with
``use_domain_verifiers=False``), it has no pending state, no PRM, and no
clipping (recipes with ``max_steps``/``max_action_tokens`` are refused).

Examples:
    >>> import numpy as np, polars as pl
    >>> df = pl.DataFrame({"ep": ["a", "a", "a"], "t": [0, 1, 2], "r": [0.0, 0.0, 1.0]})
    >>> df.with_columns(G=_discounted_rtg("r", "t", "ep", gamma=0.5))["G"].to_list()
    [0.25, 0.5, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from pipelines.recipes import Recipe, RecipeError

__all__ = ["compute_polars", "compute_steps_polars", "run_polars"]


def _discounted_rtg(reward: str, t: str, ep: str, *, gamma: float) -> pl.Expr:
    """``G_t = sum_{k>=t} gamma^(k-t) r_k`` as ``gamma^-t * revcumsum(gamma^k r_k)`` (T is small)."""
    if gamma == 1.0:
        return pl.col(reward).cum_sum(reverse=True).over(ep, order_by=t)
    if gamma == 0.0:
        return pl.col(reward)
    scaled = pl.col(reward) * pl.lit(gamma) ** pl.col(t)
    return scaled.cum_sum(reverse=True).over(ep, order_by=t) / pl.lit(gamma) ** pl.col(t)


def compute_steps_polars(files: Sequence[str | Path], recipe: Recipe) -> pl.DataFrame:
    """Steps of complete episodes with reward, return, advantage and normalized advantage."""
    return compute_polars(files, recipe)[0]


def compute_polars(files: Sequence[str | Path], recipe: Recipe) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``(steps, trajectories)`` of the complete episodes in ``files``.

    Raises:
        RecipeError: a recipe feature the reference does not implement.
    """
    if recipe.reward == "prm" or recipe.max_steps or recipe.max_action_tokens:
        raise RecipeError("the polars reference implements neither `prm` nor clipping caps")
    ev = pl.read_parquet([str(f) for f in files]).unique(subset=["event_id"], keep="first", maintain_order=True)
    per_ep = ev.group_by("episode_id").agg(
        n=pl.len(), max_seq=pl.col("seq").max(),
        first_event_time=pl.col("event_time").min(), last_event_time=pl.col("event_time").max(),
        policy_version=pl.col("policy_version").first(),
        difficulty=pl.col("episode_started").struct.field("difficulty").filter(
            pl.col("event_type") == "episode_started").first(),
        status=pl.col("episode_finished").struct.field("status").filter(
            pl.col("event_type") == "episode_finished").first(),
        verifier_summary=pl.col("episode_finished").struct.field("verifier_summary").filter(
            pl.col("event_type") == "episode_finished").first(),
        started=(pl.col("event_type") == "episode_started").any(),
        finished=(pl.col("event_type") == "episode_finished").any(),
        task_group=pl.col("episode_started").struct.field("task_group").filter(
            pl.col("event_type") == "episode_started").first(),
        outcome=pl.col("episode_finished").struct.field("outcome_reward").filter(
            pl.col("event_type") == "episode_finished").first(),
    ).filter(pl.col("started") & pl.col("finished") & (pl.col("max_seq") == pl.col("n") - 1))
    steps = ev.filter(pl.col("event_type") == "step").select(
        "episode_id", "domain", "task_id",
        t=pl.col("step").struct.field("step_index"),
        lp=pl.col("step").struct.field("behaviour_logprobs"),
        n_tok=pl.col("step").struct.field("action_token_ids").list.len(),
        action_token_ids=pl.col("step").struct.field("action_token_ids"),
        observation_token_ids=pl.col("step").struct.field("observation_token_ids"),
    )
    verdicts = ev.filter(pl.col("event_type") == "step_verified").select(
        "episode_id", t=pl.col("step_verified").struct.field("step_index"),
        verifier=pl.col("step_verified").struct.field("verifier"),
        score=pl.col("step_verified").struct.field("score"),
        passed=pl.col("step_verified").struct.field("passed"),
    )
    token_score = pl.when(pl.col("lp").list.len() == 0).then(0.5).when(
        (pl.col("lp").list.len() == pl.col("n_tok")) & (pl.col("lp").list.max() <= 0)
        & pl.col("lp").list.eval(pl.element().is_finite()).list.all()
    ).then(1.0).otherwise(0.0)
    token_ok = steps.select(
        "episode_id", "t", verifier=pl.lit("pipeline.token_consistency"), score=token_score,
        passed=token_score > 0,
    )
    weights = recipe.verifier_weights
    all_v = pl.concat([verdicts, token_ok]).with_columns(
        w=pl.col("verifier").replace_strict(weights, default=1.0, return_dtype=pl.Float64)
        if weights else pl.lit(1.0)
    )
    s = all_v.group_by("episode_id", "t").agg(
        s=pl.when(pl.col("w").sum() > 0).then(
            (pl.col("w") * pl.col("score")).sum() / pl.col("w").sum()).otherwise(0.0),
        passed=pl.col("passed").all(),
    )
    df = (
        steps.join(per_ep.select("episode_id", "task_group", "outcome"), on="episode_id")
        .join(s, on=["episode_id", "t"], how="left")
        .with_columns(pl.col("s").fill_null(0.0), T=pl.len().over("episode_id"))
        .sort("episode_id", "t")
    )
    last = pl.col("t") == pl.col("T") - 1
    r = pl.when(last).then(recipe.outcome_weight * pl.col("outcome")).otherwise(0.0)
    if recipe.reward == "verification_shaped":
        r = r + recipe.verification_weight * pl.col("s") - recipe.step_penalty
    if recipe.reward_min is not None or recipe.reward_max is not None:
        r = r.clip(recipe.reward_min, recipe.reward_max)
    df = df.with_columns(reward=r).with_columns(
        return_to_go=_discounted_rtg("reward", "t", "episode_id", gamma=recipe.gamma),
        advantage=_discounted_rtg("reward", "t", "episode_id", gamma=recipe.gamma * recipe.lam),
    )
    G0 = pl.col("return_to_go").first().over("episode_id", order_by="t")
    df = df.with_columns(G0=G0, task_group=pl.coalesce(pl.col("task_group").replace("", None), pl.col("task_id")))
    ep = df.group_by("episode_id").agg(pl.col("task_group").first(), pl.col("G0").first())
    grp = ep.group_by("task_group").agg(g_mean=pl.col("G0").mean(), g_std=pl.col("G0").std(ddof=0).fill_null(0.0))
    dom = df.group_by("domain").agg(a_mean=pl.col("advantage").mean(), a_std=pl.col("advantage").std(ddof=0).fill_null(0.0))
    df = df.join(grp, on="task_group").join(dom, on="domain").with_columns(
        group_advantage=(pl.col("G0") - pl.col("g_mean")) / (pl.col("g_std") + recipe.eps),
    )
    if recipe.normalization == "domain":
        norm = (pl.col("advantage") - pl.col("a_mean")) / (pl.col("a_std") + recipe.eps)
    elif recipe.normalization == "group":
        norm = pl.col("group_advantage")
    else:
        norm = pl.col("advantage")
    df = df.with_columns(normalized_advantage=norm)
    steps_out = df.select(
        "episode_id", "domain", "task_id", "task_group", pl.col("t").alias("step_index"),
        "observation_token_ids", "action_token_ids", pl.col("lp").alias("behaviour_logprobs"),
        "reward", "return_to_go", "advantage", "normalized_advantage", "group_advantage",
    ).sort("episode_id", "step_index")
    ret = ep.join(df.group_by("episode_id").agg(pl.col("domain").first()), on="episode_id").group_by("domain").agg(
        r_mean=pl.col("G0").mean(), r_std=pl.col("G0").std(ddof=0).fill_null(0.0))
    trajectories = (
        df.group_by("episode_id").agg(
            pl.col("domain", "task_id", "task_group", "G0", "group_advantage").first(),
            num_steps=pl.len(), action_tokens=pl.col("n_tok").sum(), steps_passed=pl.col("passed").sum(),
        )
        .join(per_ep.select("episode_id", "n", "outcome", "policy_version", "difficulty", "status",
                            "verifier_summary", "first_event_time", "last_event_time"), on="episode_id")
        .join(ret, on="domain")
        .select(
            "episode_id", "domain", "task_id", "task_group", "policy_version", "difficulty", "status",
            complete=pl.lit(True), num_events="n", num_steps="num_steps", action_tokens="action_tokens",
            outcome_reward="outcome", episode_return="G0",
            normalized_return=(pl.col("G0") - pl.col("r_mean")) / (pl.col("r_std") + recipe.eps),
            group_advantage="group_advantage", verifier_summary="verifier_summary", steps_passed="steps_passed",
            first_event_time="first_event_time", last_event_time="last_event_time",
        )
        .sort("episode_id")
    )
    return steps_out, trajectories


def run_polars(files: Sequence[str | Path], recipe: Recipe, out_dir: str | Path) -> int:
    """Compute both tables and write them hive-partitioned by domain; returns the step rows."""
    steps, trajectories = compute_polars(files, recipe)
    for name, df in (("steps", steps), ("trajectories", trajectories)):
        (Path(out_dir) / name).mkdir(parents=True, exist_ok=True)
        df.write_parquet(Path(out_dir) / name, partition_by="domain")
    return steps.height
