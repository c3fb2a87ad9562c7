"""Feedback in the trajectory job: the feedback table (exactly once), rewards with feedback, corrections."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import duckdb
import msgspec
import numpy as np
import pytest

from pipelines.feedback import feedback_outcome, step_feedback_terms
from pipelines.inputs import ArchiveInput
from pipelines.recipes import RecipeError, load_recipe, step_rewards
from pipelines.rewards import annotate_rewards
from pipelines.testhooks import run_batch_on_records
from pipelines.trajectory_job import run_batch
from pipelines.types import RawRecords
from rollout.context import model_input_of
from schemas.codec import encode_event
from schemas.events import EpisodeFinished, Event, Feedback, Step
from streams.feedback import EpisodeRef, make_feedback
from tests.pipelines.helpers import edit, episodes, flat, write_archive

ADD = load_recipe("outcome", name="fb-add", feedback="add", feedback_weight=0.5)
OVERRIDE = load_recipe("outcome", name="fb-override", feedback="override")


def _fb(ep: list[Event], *, after_s: float = 60.0, **kw) -> Feedback:
    """Feedback on episode ``ep`` given ``after_s`` after it finished."""
    first = ep[0]
    fb = make_feedback(EpisodeRef(first.episode_id, first.domain, first.task_id, first.policy_version),
                       source=kw.pop("source", "ann"), **kw)
    return msgspec.structs.replace(fb, event_time=ep[-1].event_time + timedelta(seconds=after_s))


def _judged(n: int, seed: int) -> list[list[Event]]:
    """Synthetic episodes that are judged (done) with >= 2 steps, outside GRPO groups (written, never held)."""
    out = [ep for ep in episodes(40, seed=seed)
           if isinstance(ep[-1], EpisodeFinished) and ep[-1].termination in ("done", "")
           and ep[-1].status.value in ("success", "failure") and sum(isinstance(e, Step) for e in ep) >= 2]
    assert len(out) >= n
    return [edit(ep, started={"group_size": 0}) for ep in out[:n]]


def _raw(events: list[Event], first_offset: int = 0) -> RawRecords:
    return RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(first_offset, first_offset + len(events))),
                      keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                      timestamps_ms=[0] * len(events))


def _table(out: Path, name: str) -> list[dict]:
    return duckdb.sql(f"select * from read_parquet('{out}/{name}/**/*.parquet', hive_partitioning=true) "
                      "order by all").to_arrow_table().to_pylist()


def _returns(out: Path) -> dict[str, float]:
    rows = duckdb.sql(f"select episode_id, episode_return, outcome_reward from "
                      f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)").fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def _reconciles(c: dict) -> bool:
    return c["events_in"] + c["events_pending_in"] == sum(
        c[k] for k in ("events_used", "events_incomplete", "events_pending_out", "dead_letters", "duplicates",
                       "late_events", "feedback_events"))


# ----------------------------------------------------------------------------- formulas


def test_step_rewards_with_feedback_hand_computed():
    # outcome recipe, gamma 1, T = 3, verifier outcome R = 1, w_o = 1, w_f = 0.5.
    # add: episode ratings 0.0 and 0.4 -> F = 0.2, R' = 1 + 0.5 * 0.2 = 1.1; step 1 rated -1 -> +0.5 * -1
    # r = [0, -0.5, 1.1], G_0 = 0.6.
    fb = [Feedback(event_id=i, episode_id="ep", seq=1, producer_id="p", domain="d", task_id="t", source="s",
                   rating=r, target_step=t) for i, r, t in (("a", 0.0, None), ("b", 0.4, None), ("c", -1.0, 1))]
    outcome = feedback_outcome(ADD, 1.0, fb)
    r = step_rewards(ADD, outcome=outcome, step_scores=np.zeros(3), step_feedback=step_feedback_terms(ADD, fb, [0, 1, 2]))
    assert r == pytest.approx([0.0, -0.5, 1.1])
    # override: R' = F = 0.2 (the verifier's 1 is replaced); the step term is w_f * f_t with w_f = 1: -1.
    r = step_rewards(OVERRIDE, outcome=feedback_outcome(OVERRIDE, 1.0, fb), step_scores=np.zeros(3),
                     step_feedback=step_feedback_terms(OVERRIDE, fb, [0, 1, 2]))
    assert r == pytest.approx([0.0, -1.0, 0.2])
    # override without an episode rating keeps the verifier outcome; ignore changes nothing.
    assert feedback_outcome(OVERRIDE, 1.0, fb[2:]) == 1.0
    assert feedback_outcome(load_recipe("outcome"), 1.0, fb) == 1.0
    assert step_feedback_terms(load_recipe("outcome"), fb, [0, 1, 2]) is None
    # clipped like any reward: reward_max 1 cuts 1.1 to 1
    clipped = load_recipe("outcome", feedback="add", feedback_weight=0.5, reward_max=1.0)
    assert step_rewards(clipped, outcome=outcome, step_scores=np.zeros(1)).tolist() == [1.0]


def test_feedback_fields_keep_old_versions_and_are_checked():
    assert load_recipe("outcome").version == "outcome-902f4169"  # the version before feedback existed
    assert ADD.version != load_recipe("outcome", name="fb-add").version
    with pytest.raises(RecipeError, match="feedback_weight"):
        load_recipe("outcome", feedback="add", feedback_weight=-1.0)
    with pytest.raises(RecipeError):
        load_recipe("outcome", feedback="sometimes")


def test_annotate_rewards_uses_attached_feedback():
    from pipelines.assemble import assemble_episode, dedupe_events

    ep = _judged(1, seed=5)[0]
    unique, _, _ = dedupe_events(ep)
    episode = assemble_episode(ep[0].episode_id, unique, complete=True, reason=None)
    R = episode.finished.outcome_reward
    rated = msgspec.structs.replace(episode, feedback=[_fb(ep, rating=0.25)])
    # outcome recipe, gamma 1: G_0 = w_o * R'.  override -> 0.25; add (w_f 0.5) -> R + 0.125; ignore -> R
    assert annotate_rewards(rated, OVERRIDE).episode_return == pytest.approx(0.25)
    assert annotate_rewards(rated, ADD).episode_return == pytest.approx(R + 0.125)
    assert annotate_rewards(rated, load_recipe("outcome")).episode_return == pytest.approx(R)


# ----------------------------------------------------------------------------- the job


@pytest.mark.parametrize("source", ["archive", "raw"])
def test_feedback_table_exactly_once_and_rewards(source, tmp_path):
    eps = _judged(4, seed=7)
    e0, e1 = eps[0], eps[1]
    f0 = _fb(e0, rating=0.0)  # a person says episode 0 failed, whatever its verifier said
    f1 = _fb(e1, target_step=1, rating=1.0, comment="good step")
    batch1 = flat(eps) + [f0, f0, f1]  # f0 twice: a re-sent copy
    f0_again = msgspec.structs.replace(f0, producer_id="retry")  # same id: the same feedback
    f_late = _fb(e0, after_s=3600, rating=1.0, source="second-annotator")  # after episode 0 was committed
    batch2 = [f0_again, f_late]
    out = tmp_path / "out"
    if source == "archive":
        archive = write_archive(tmp_path / "archive", [batch1, batch2])
        kw = dict(input=ArchiveInput(archive))
        c1 = run_batch(out=out, recipe=OVERRIDE, **kw)  # reads both archive commits at once
        assert c1["feedback_events"] == 3 and c1["duplicates"] == 2 and _reconciles(c1)
        runs = [c1]
    else:
        c1 = run_batch_on_records([_raw(batch1)], out=out, recipe=OVERRIDE)
        assert (c1["episodes"], c1["feedback_events"], c1["duplicates"]) == (4, 2, 1) and _reconciles(c1)
        assert c1["incomplete_episodes"] == 0 and c1["pending_episodes"] == 0  # feedback makes no gap
        c2 = run_batch_on_records([_raw(batch2, len(batch1))], out=out, recipe=OVERRIDE)
        # the re-sent copy is a duplicate of commit 1's row; the late one is new; no episode is touched
        assert (c2["episodes"], c2["feedback_events"], c2["duplicates"]) == (0, 1, 1) and _reconciles(c2)
        runs = [c1, c2]
    rows = _table(out, "feedback")
    assert sorted(r["event_id"] for r in rows) == sorted([f0.event_id, f1.event_id, f_late.event_id])
    by_id = {r["event_id"]: r for r in rows}
    assert by_id[f0.event_id]["applied"] and by_id[f1.event_id]["applied"]
    assert by_id[f1.event_id]["target_step"] == 1 and by_id[f1.event_id]["comment"] == "good step"
    assert by_id[f0.event_id]["domain"] == e0[0].domain and by_id[f0.event_id]["recipe"] == OVERRIDE.version
    # override: episode 0's return is its rating's (0); a step rating adds w_f * 1 to episode 1's return
    ret = _returns(out)
    if source == "archive":  # read together with the episode: the late rating counts too, F = mean(0, 1)
        assert by_id[f_late.event_id]["applied"]
        assert ret[e0[0].episode_id][0] == pytest.approx(0.5)
    else:  # committed after the episode: in the table, not in the committed rewards
        assert not by_id[f_late.event_id]["applied"]
        assert ret[e0[0].episode_id][0] == pytest.approx(0.0)
    assert ret[e0[0].episode_id][1] == e0[-1].outcome_reward  # outcome_reward stays the verifier's
    assert ret[e1[0].episode_id][0] == pytest.approx(e1[-1].outcome_reward + 1.0)
    for e in eps[2:]:
        assert ret[e[0].episode_id][0] == pytest.approx(e[-1].outcome_reward)
    # a rerun over covered input adds nothing
    again = (run_batch(out=out, recipe=OVERRIDE, **kw) if source == "archive"
             else run_batch_on_records([], out=out, recipe=OVERRIDE))
    assert set(again.values()) == {0} and len(_table(out, "feedback")) == 3
    assert sum(c["feedback_events"] for c in runs) == 3


def test_feedback_on_an_unknown_or_open_episode_is_kept_and_the_episode_waits(tmp_path):
    ep = _judged(1, seed=11)[0]
    open_part = ep[:-1]  # unfinished: pending
    fb = _fb(ep, rating=0.5)
    ghost = msgspec.structs.replace(_fb(ep, rating=0.1), episode_id="no-such-episode",
                                    event_id="f" * 32)
    out = tmp_path / "out"
    c1 = run_batch_on_records([_raw(open_part + [fb, ghost])], out=out, recipe=ADD)
    assert (c1["pending_episodes"], c1["feedback_events"], c1["incomplete_episodes"]) == (1, 2, 0) and _reconciles(c1)
    c2 = run_batch_on_records([_raw(ep[-1:], len(open_part) + 2)], out=out, recipe=ADD)
    assert c2["episodes"] == 1 and c2["feedback_events"] == 0 and _reconciles(c2)
    rows = {r["episode_id"]: r for r in _table(out, "feedback")}
    assert set(rows) == {ep[0].episode_id, "no-such-episode"} and not any(r["applied"] for r in rows.values())


@pytest.mark.slow  # builds the tiny model (its tokenizer)
def test_corrections_become_samples_with_the_recorded_context(tmp_path):
    from rollout.model import init_tiny_model
    from transformers import AutoTokenizer

    model = init_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    eps = _judged(3, seed=13)
    # step 1 of episode 0 had part of its context cut: the sample's prompt must be the cut input
    eps[0] = [msgspec.structs.replace(e, context_cut_start=2, context_cut_tokens=3)
              if isinstance(e, Step) and e.step_index == 1 else e for e in eps[0]]
    c0 = _fb(eps[0], target_step=1, correction="x = 4")
    c_missing = _fb(eps[1], target_step=1, correction="nope", source="other")
    out = tmp_path / "out"
    # episode 1 is not in this commit (only its correction): unresolved, kept in feedback/
    batch = flat([eps[0], eps[2]]) + [c0, c_missing]
    counts = run_batch_on_records([_raw(batch)], out=out, recipe=load_recipe("outcome"),
                                  tokenizer=str(model))
    assert (counts["corrections"], counts["corrections_unresolved"]) == (1, 1)
    rows = _table(out, "corrections")
    assert len(rows) == 1
    row = rows[0]
    steps = sorted((e for e in eps[0] if isinstance(e, Step)), key=lambda s: s.step_index)
    want_prompt = model_input_of([s.observation_token_ids for s in steps], [s.action_token_ids for s in steps],
                                 step=1, cut_start=2, cut_tokens=3)
    assert row["observation_token_ids"] == want_prompt
    assert row["action_token_ids"] == tok("x = 4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["original_action_token_ids"] == steps[1].action_token_ids.tolist()
    assert (row["target_episode_id"], row["target_step"], row["event_id"]) == (eps[0][0].episode_id, 1, c0.event_id)
    assert row["trainable"] and all(row["loss_mask"]) and row["status"] == "correction"
    assert row["domain"] == eps[0][0].domain
    # the analysts' views: feedback beside the verifier's outcome
    con = duckdb.connect()
    from pipelines.query import register_views

    assert {"feedback", "corrections"} <= set(register_views(con, data=out))
    joined = con.sql("select t.episode_id, t.outcome_reward, f.correction from trajectories t join feedback f "
                     "using (episode_id)").fetchall()
    assert joined == [(eps[0][0].episode_id, eps[0][-1].outcome_reward, "x = 4")]


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stream_writes_feedback_once_and_never_into_an_episode(kafka_broker, topic_name, tmp_path):
    """--mode stream: feedback is split before the stateful assembler: episodes stay complete, the pane
    commits write each feedback once (a copy in the same or a later run is a duplicate), rewards ignore it."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from pipelines.trajectory_job import run
    from streams.config import KafkaConnection
    from streams.producer import EventProducer

    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-stream-feedback")
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 2, 1)])
    finally:
        admin.close()

    def produce(events):
        with EventProducer(conn, topic_name, spool_dir=tmp_path / "spool") as producer:
            for ev in events:
                producer.emit(ev)
            assert producer.flush().spooled == 0

    eps = _judged(3, seed=17)
    fb = _fb(eps[0], rating=0.0)
    produce(flat(eps) + [fb, fb])
    out = tmp_path / "out"
    recipe = tmp_path / "ovr.yaml"
    recipe.write_text("# trajpipe pipeline run --mode stream --recipe ovr.yaml\nname: ovr\nfeedback: override\n")
    args = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name, "--out", str(out),
            "--mode", "stream", "--window-s", "2", "--incomplete-after", "600", "--idle-watermark-lag-s", "1",
            "--stop-at-end", "--recipe", str(recipe)]
    c1 = run(args)
    assert (c1["episodes"], c1["feedback_events"], c1["duplicates"], c1["incomplete_episodes"]) == (3, 1, 1, 0), c1
    assert _reconciles(c1) and c1["events_uncommitted"] == 0
    produce([msgspec.structs.replace(fb, producer_id="retry")])
    c2 = run(args)
    assert (c2["feedback_events"], c2["duplicates"]) == (0, 1) and _reconciles(c2), c2
    rows = _table(out, "feedback")
    assert [(r["event_id"], r["applied"]) for r in rows] == [(fb.event_id, False)]
    ret = _returns(out)
    assert ret[eps[0][0].episode_id][0] == pytest.approx(eps[0][-1].outcome_reward)  # not applied in a stream

