"""Feedback end to end, through the real commands on a real broker, as a user runs them:

1. scripted rollouts (code tasks run in the sandbox, math) speaking the tiny model's tokenizer
   (``trajpipe rollout --policy scripted --model``) → Kafka; ``trajpipe archive`` → the event archive;
2. ``trajpipe feedback`` looks the episodes up in the archive and sends a score (twice: the copy is the
   same event), and a correction of one step;
3. ``trajpipe pipeline run --source kafka`` with a ``feedback: override`` recipe and ``--tokenizer``:
   the feedback table holds each feedback once, the scored episode's return is the score (the person's
   verdict over the verifier's), the others' are their verifier outcome, and the correction's sample has
   as prompt exactly the model input recorded for that step, as target the correction's tokens;
4. the trainer's data path (``data.corrections: only``) yields that sample; ``trajpipe query`` shows the
   feedback beside the verifier outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from rollout.context import model_input_of
from rollout.model import init_tiny_model
from trainer.data import TrajectoryLoader, TrajectoryStream

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
CORRECTION = "print(sum(map(int, input().split())))"


def _trajpipe(env: dict, *args: object) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_feedback_score_and_correction_end_to_end(kafka_broker, topic_name, tmp_path):
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic_name, "TRAJPIPE_TOPICS__CONTROL": f"{topic_name}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic_name}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "2",
           "TRAJPIPE_SPOOL_DIR": str(tmp_path / "spool")}
    bootstrap = kafka_broker.bootstrap
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)

    # 1. rollouts → Kafka → archive
    ran = _trajpipe(env, "rollout", "--bootstrap", bootstrap, "--policy", "scripted", "--model", tiny,
                    "--episodes", 4, "--domains", "code,math", "--group-size", 1, "--seed", 3)
    assert ran["episodes"] == 4 and ran["errors"] == 0
    archive = tmp_path / "archive"
    _trajpipe(env, "archive", "--bootstrap", bootstrap, "--out", archive, "--until-end")
    steps = duckdb.sql(f"""
        select episode_id, domain, step.step_index, step.observation_token_ids, step.action_token_ids,
               step.context_cut_start, step.context_cut_tokens
        from read_parquet('{archive}/**/*.parquet', hive_partitioning=true)
        where event_type = 'step' order by episode_id, step.step_index""").fetchall()
    outcome = dict(duckdb.sql(f"""select episode_id, episode_finished.outcome_reward
        from read_parquet('{archive}/**/*.parquet', hive_partitioning=true)
        where event_type = 'episode_finished'""").fetchall())
    assert len(outcome) == 4
    by_episode: dict[str, list] = {}
    for row in steps:
        by_episode.setdefault(row[0], []).append(row)
    scored = next(e for e in sorted(outcome) if outcome[e] == 1.0)  # a verifier pass the reviewer disagrees with
    corrected = next(e for e in sorted(by_episode, key=lambda e: -len(by_episode[e])) if e != scored)
    k = len(by_episode[corrected]) - 1  # its last step

    # 2. feedback, the episodes looked up in the archive
    sent = _trajpipe(env, "feedback", "--bootstrap", bootstrap, "--archive", archive, "--episode", scored,
                     "--score", "0.0", "--source", "reviewer-1", "--comment", "right output, wrong method")
    domain = duckdb.sql(f"select any_value(domain) from read_parquet('{archive}/**/*.parquet', "
                        f"hive_partitioning=true) where episode_id = '{scored}'").fetchall()[0][0]
    assert sent["sent"] == 1 and sent["domain"] == domain and sent["feedback"] == 1
    again = _trajpipe(env, "feedback", "--bootstrap", bootstrap, "--archive", archive, "--episode", scored,
                      "--score", "0.0", "--source", "reviewer-1", "--comment", "right output, wrong method")
    assert again["event_id"] == sent["event_id"]  # the same feedback: the same event id
    corr = _trajpipe(env, "feedback", "--bootstrap", bootstrap, "--archive", archive, "--episode", corrected,
                     "--step", k, "--correction", CORRECTION, "--source", "reviewer-2")

    # 3. the Beam job with the feedback recipe
    recipe = tmp_path / "fb.yaml"
    recipe.write_text("# trajpipe pipeline run --source kafka --out data --recipe fb.yaml --tokenizer tiny\n"
                      "name: fb\nreward: outcome\nfeedback: override\n")
    data = tmp_path / "data"
    job = _trajpipe(env, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap, "--out", data,
                    "--recipe", recipe, "--tokenizer", tiny)
    assert (job["episodes"], job["feedback_events"], job["duplicates"], job["corrections"],
            job["corrections_unresolved"], job["incomplete_episodes"], job["pending_episodes"]) == (4, 2, 1, 1, 0, 0, 0)
    fb = duckdb.sql(f"select event_id, episode_id, rating, correction, target_step, applied, source from "
                    f"read_parquet('{data}/feedback/**/*.parquet', hive_partitioning=true) order by source").fetchall()
    assert fb == [(sent["event_id"], scored, 0.0, None, None, True, "reviewer-1"),
                  (corr["event_id"], corrected, None, CORRECTION, k, True, "reviewer-2")]
    returns = dict(duckdb.sql(f"select episode_id, episode_return from read_parquet('{data}/trajectories/**/*.parquet', "
                              "hive_partitioning=true)").fetchall())
    assert returns[scored] == 0.0  # override: the reviewer's 0 over the verifier's 1
    assert all(returns[e] == pytest.approx(outcome[e]) for e in outcome if e != scored)
    sample = duckdb.sql(f"select observation_token_ids, action_token_ids, target_episode_id, target_step, episode_id "
                        f"from read_parquet('{data}/corrections/**/*.parquet', hive_partitioning=true)").fetchall()
    assert len(sample) == 1
    rec = by_episode[corrected]
    recorded_context = model_input_of([r[3] for r in rec], [r[4] for r in rec], step=k, cut_start=rec[k][5],
                                      cut_tokens=rec[k][6])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    prompt, target, target_episode, target_step, sample_id = sample[0]
    assert prompt == recorded_context and (target_episode, target_step) == (corrected, k)
    assert target == tok(CORRECTION, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    # 4. the trainer's data path yields the correction sample; the analysts' view joins feedback and outcomes
    got = []
    for b in TrajectoryLoader(TrajectoryStream(data, seq_len=4096, batch_size=2, tables=("corrections",))):
        for e, eid in enumerate(b.episode_ids):
            got.append((eid, b.input_ids[b.episode_index == e].tolist(), b.loss_mask[b.episode_index == e].tolist()))
    assert got == [(sample_id, prompt + target, [False] * len(prompt) + [True] * len(target))]
    proc = subprocess.run([sys.executable, "-m", "trajpipe", "query", "--data", str(data), "--format", "json",
                           "select t.episode_id, t.outcome_reward, t.episode_return, f.rating, f.source "
                           "from trajectories t join feedback f using (episode_id) where f.rating is not null"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert [json.loads(x) for x in proc.stdout.splitlines()] == [
        {"episode_id": scored, "outcome_reward": 1.0, "episode_return": 0.0, "rating": 0.0, "source": "reviewer-1"}]
