"""A plain polars implementation of the trajectory transforms over an archive (reference + benchmark).

Same recipe → same per-step ``reward``, ``return_to_go``, ``advantage``,
``normalized_advantage``, ``group_advantage``, ``trainable`` and
``group_size``, and the same per-episode ``episode_return``,
``normalized_return``, ``group_advantage``, ``termination``, ``trainable``,
``excluded_reason``, ``group_members``, ``group_timed_out`` and
``steps_passed``, as the Beam job for complete episodes written by one run on
a fresh dataset root (no prior statistics, no held state); like the job it
writes a ``steps`` and a ``trajectories`` table, without the evaluation
episodes (``purpose = "eval"``). The semantics it implements:

* only judged episodes (``termination`` ``done``/``max_steps``, >= 1 step)
  are trainable; the others get zero credit and enter no statistics;
* ``s_t`` is the weighted mean of the step's rollout verdicts (the counted
  ones: the token-consistency check never counts), shaping is potential-based
  or additive as the recipe says (pipelines.recipes);
* a GRPO group ``(domain, task_group, policy_version)`` is written when all
  its declared members are complete (or it declares <= 1), or — with
  ``group_timeout_s=0`` — at once as timed out; otherwise it is held (not in
  the output, as the job holds it after one run); group statistics are over
  its trainable members, domain statistics over the trainable episodes written.

Differences, by design of a reference: it does not re-run the domain
verifiers (as the Beam job with ``use_domain_verifiers=False``), it has no
pending or held state across runs, no PRM, and no clipping (recipes with
``max_steps``/``max_action_tokens`` are refused).

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

from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
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
    """Steps of the written episodes with reward, return, advantage and normalized advantage."""
    return compute_polars(files, recipe)[0]


def _first(struct: str, field: str) -> pl.Expr:
    return pl.col(struct).struct.field(field).filter(pl.col("event_type") == struct).first()


def compute_polars(files: Sequence[str | Path], recipe: Recipe, *,
                   group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``(steps, trajectories)`` of the complete episodes in ``files`` that one run of the job writes.

    Raises:
        RecipeError: a recipe feature the reference does not implement.
    """
    if recipe.reward == "prm" or recipe.max_steps or recipe.max_action_tokens:
        raise RecipeError("the polars reference implements neither `prm` nor clipping caps")
    ev = (pl.read_parquet([str(f) for f in files]).unique(subset=["event_id"], keep="first", maintain_order=True)
          .sort("episode_id", "seq"))
    status = _first("episode_finished", "status")
    # Evaluation episodes (purpose eval) are in neither table; archives before schema 3 have no purpose.
    has_purpose = "purpose" in {f.name for f in ev.schema["episode_started"].fields}
    purpose = _first("episode_started", "purpose") if has_purpose else pl.lit("train")
    per_ep = ev.group_by("episode_id").agg(
        n=pl.len(), max_seq=pl.col("seq").max(),
        first_event_time=pl.col("event_time").min(), last_event_time=pl.col("event_time").max(),
        domain=pl.col("domain").first(), task_id=pl.col("task_id").first(),
        policy_version=pl.col("policy_version").first(),
        difficulty=_first("episode_started", "difficulty"), status=status,
        verifier_summary=_first("episode_finished", "verifier_summary"),
        started=(pl.col("event_type") == "episode_started").any(),
        finished=(pl.col("event_type") == "episode_finished").any(),
        task_group=_first("episode_started", "task_group"),
        group_size=_first("episode_started", "group_size"),
        group_member=_first("episode_started", "group_member"),
        outcome=_first("episode_finished", "outcome_reward"),
        termination=pl.coalesce(_first("episode_finished", "termination").replace("", None),
                                status.replace_strict({"timeout": "timeout", "error": "error", "aborted": "aborted"},
                                                      default="done")),
        n_steps=(pl.col("event_type") == "step").sum(),
        purpose=purpose,
    ).filter(
        pl.col("started") & pl.col("finished") & (pl.col("max_seq") == pl.col("n") - 1)
        & (pl.col("purpose").fill_null("train") != "eval")
    ).with_columns(
        task_group=pl.coalesce(pl.col("task_group").replace("", None), pl.col("task_id")),
        judged=pl.col("termination").is_in(["done", "max_steps"]),
    ).with_columns(
        trainable=pl.col("judged") & (pl.col("n_steps") > 0),
        excluded_reason=pl.when(~pl.col("judged")).then(pl.col("termination"))
        .when(pl.col("n_steps") == 0).then(pl.lit("no_steps")).otherwise(None),
    )
    steps = ev.filter(pl.col("event_type") == "step").select(
        "episode_id",
        t=pl.col("step").struct.field("step_index"),
        lp=pl.col("step").struct.field("behaviour_logprobs"),
        n_tok=pl.col("step").struct.field("action_token_ids").list.len(),
        action_token_ids=pl.col("step").struct.field("action_token_ids"),
        observation_token_ids=pl.col("step").struct.field("observation_token_ids"),
    )
    # The rollout verdicts are the counted ones (the generic token check never counts).
    verdicts = ev.filter(pl.col("event_type") == "step_verified").select(
        "episode_id", t=pl.col("step_verified").struct.field("step_index"),
        verifier=pl.col("step_verified").struct.field("verifier"),
        score=pl.col("step_verified").struct.field("score"),
        passed=pl.col("step_verified").struct.field("passed"),
    )
    weights = recipe.verifier_weights
    verdicts = verdicts.with_columns(
        w=pl.col("verifier").replace_strict(weights, default=1.0, return_dtype=pl.Float64)
        if weights else pl.lit(1.0)
    )
    s = verdicts.group_by("episode_id", "t").agg(
        s=pl.when(pl.col("w").sum() > 0).then(
            (pl.col("w") * pl.col("score")).sum() / pl.col("w").sum()).otherwise(0.0),
        passed=pl.col("passed").all(),
    )
    df = (
        steps.join(per_ep.select("episode_id", "domain", "task_id", "task_group", "policy_version", "outcome",
                                 "trainable"), on="episode_id")
        .join(s, on=["episode_id", "t"], how="left")
        .with_columns(pl.col("s").fill_null(0.0), pl.col("passed").fill_null(False), T=pl.len().over("episode_id"))
        .sort("episode_id", "t")
        .with_columns(observation_tokens=pl.col("observation_token_ids").list.len(), action_tokens=pl.col("n_tok"))
        .with_columns(  # the stream before this step's action: every observation so far and the earlier actions
            context_tokens=(pl.col("observation_tokens") + pl.col("action_tokens")).cum_sum().over("episode_id")
            - pl.col("action_tokens"))
    )
    last = pl.col("t") == pl.col("T") - 1
    r = pl.when(last).then(recipe.outcome_weight * pl.col("outcome")).otherwise(0.0)
    if recipe.reward == "verification_shaped":
        w = recipe.verification_weight
        if recipe.shaping == "potential":  # F_t = gamma Phi_{t+1} - Phi_t, Phi_{t+1} = w s_t, terminal 0
            phi_next = pl.when(last).then(0.0).otherwise(w * pl.col("s"))
            phi = phi_next.shift(1, fill_value=0.0).over("episode_id", order_by="t")
            r = r + recipe.gamma * phi_next - phi - recipe.step_penalty
        else:
            r = r + w * pl.col("s") - recipe.step_penalty
    if recipe.reward_min is not None or recipe.reward_max is not None:
        r = r.clip(recipe.reward_min, recipe.reward_max)
    df = df.with_columns(reward=pl.when(pl.col("trainable")).then(r).otherwise(0.0)).with_columns(
        return_to_go=_discounted_rtg("reward", "t", "episode_id", gamma=recipe.gamma),
        advantage=_discounted_rtg("reward", "t", "episode_id", gamma=recipe.gamma * recipe.lam),
    )
    G0 = df.group_by("episode_id").agg(G0=pl.col("return_to_go").sort_by("t").first())
    ep = per_ep.join(G0, on="episode_id", how="left").with_columns(pl.col("G0").fill_null(0.0))
    key = ["domain", "task_group", "policy_version"]
    trained = pl.col("G0").filter(pl.col("trainable"))
    grp = ep.group_by(key).agg(
        whole=(pl.col("group_size").max() <= 1) | (pl.col("group_member").n_unique() >= pl.col("group_size").max()),
        g_mean=trained.mean().fill_null(0.0), g_std=trained.std(ddof=0).fill_null(0.0),
        g_n=pl.col("trainable").sum(),
    ).with_columns(
        released=pl.col("whole") | pl.lit(group_timeout_s <= 0), group_timed_out=~pl.col("whole"),
    ).filter(pl.col("released"))
    ep = ep.join(grp, on=key)  # held groups are not written
    df = df.join(ep.select("episode_id", "G0", "g_mean", "g_std", "g_n"), on="episode_id")
    if recipe.normalization == "group_mean":
        group_adv = pl.col("G0") - pl.col("g_mean")
    else:
        group_adv = (pl.col("G0") - pl.col("g_mean")) / (pl.col("g_std") + recipe.eps)
    ep = ep.with_columns(group_advantage=pl.when(pl.col("trainable")).then(group_adv).otherwise(0.0))
    df = df.join(ep.select("episode_id", "group_advantage"), on="episode_id")
    dom = df.filter(pl.col("trainable")).group_by("domain").agg(
        a_mean=pl.col("advantage").mean(), a_std=pl.col("advantage").std(ddof=0).fill_null(0.0))
    ret = ep.filter(pl.col("trainable")).group_by("domain").agg(
        r_mean=pl.col("G0").mean(), r_std=pl.col("G0").std(ddof=0).fill_null(0.0))
    df = df.join(dom, on="domain", how="left")
    if recipe.normalization == "domain":
        norm = (pl.col("advantage") - pl.col("a_mean")) / (pl.col("a_std") + recipe.eps)
    elif recipe.normalization in ("group", "group_mean"):
        norm = pl.col("group_advantage")
    else:
        norm = pl.col("advantage")
    df = df.with_columns(normalized_advantage=pl.when(pl.col("trainable")).then(norm).otherwise(0.0))
    steps_out = df.select(
        "episode_id", "domain", "task_id", "task_group", pl.col("t").alias("step_index"),
        "observation_token_ids", "action_token_ids", "observation_tokens", "action_tokens", "context_tokens",
        pl.col("lp").alias("behaviour_logprobs"),
        "trainable", "reward", "return_to_go", "advantage", "normalized_advantage", "group_advantage",
        pl.col("g_n").alias("group_size"),
    ).sort("episode_id", "step_index")
    by_ep = df.group_by("episode_id").agg(action_tokens=pl.col("n_tok").sum(), steps_passed=pl.col("passed").sum())
    trajectories = (
        ep.join(by_ep, on="episode_id", how="left").join(ret, on="domain", how="left")
        .select(
            "episode_id", "domain", "task_id", "task_group", "policy_version", "difficulty", "status",
            "termination", "trainable", "excluded_reason", complete=pl.lit(True), num_events="n",
            num_steps="n_steps", action_tokens=pl.col("action_tokens").fill_null(0),
            outcome_reward="outcome", episode_return="G0",
            normalized_return=pl.when(pl.col("trainable")).then(
                (pl.col("G0") - pl.col("r_mean")) / (pl.col("r_std") + recipe.eps)).otherwise(0.0),
            group_advantage="group_advantage", group_size="group_size", group_member="group_member",
            group_members="g_n", group_timed_out="group_timed_out", verifier_summary="verifier_summary",
            steps_passed=pl.col("steps_passed").fill_null(0), first_event_time="first_event_time",
            last_event_time="last_event_time",
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
