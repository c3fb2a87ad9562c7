"""Feedback corrections as supervised samples: the trainer's data path reads them, BC on them raises their log-prob."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import torch
import yaml
from typer.testing import CliRunner

from pipelines.recipes import load_recipe
from pipelines.testhooks import run_batch_on_records
from pipelines.types import RawRecords
from schemas.codec import encode_event
from schemas.events import Step
from streams.feedback import EpisodeRef, make_feedback
from streams.synth import generate_episodes
from trainer.config import ConfigError, load_train_config
from trainer.data import TrajectoryLoader, TrajectoryStream

CORRECTION = "the answer is 4"


@pytest.fixture(scope="module")
def corrections_data(tiny_model: Path, vocab_size: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A dataset version with 12 synthetic episodes and a correction of step 1 of the first two with 2+ steps."""
    tmp_path = tmp_path_factory.mktemp("corrections")
    eps = [[msgspec.structs.replace(e, group_size=0) if e.event_type == "episode_started" else e for e in ep]
           for ep in generate_episodes(12, seed=3, vocab_size=vocab_size)]
    targets = [ep for ep in eps if sum(isinstance(e, Step) for e in ep) >= 2][:2]
    fbs = [msgspec.structs.replace(
        make_feedback(EpisodeRef(ep[0].episode_id, ep[0].domain, ep[0].task_id, ep[0].policy_version),
                      source="reviewer", target_step=1, correction=CORRECTION),
        event_time=ep[-1].event_time + timedelta(minutes=5)) for ep in targets]
    events = [e for ep in eps for e in ep] + fbs
    batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(events))),
                       keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                       timestamps_ms=[0] * len(events))
    out = tmp_path / "data"
    counts = run_batch_on_records([batch], out=out, recipe=load_recipe("outcome"),
                                  tokenizer=str(tiny_model))
    assert counts["corrections"] == 2
    import duckdb

    rows = duckdb.sql(f"select * from read_parquet('{out}/corrections/**/*.parquet', hive_partitioning=true) "
                      "order by episode_id").to_arrow_table().to_pylist()
    return out, rows


def test_stream_reads_corrections_only_when_asked(corrections_data):
    data, rows = corrections_data
    want = {r["episode_id"]: r for r in rows}
    got = {}
    for b in TrajectoryLoader(TrajectoryStream(data, seq_len=2048, batch_size=4, tables=("corrections",))):
        for e, eid in enumerate(b.episode_ids):
            sel = b.episode_index == e  # one sample per correction: the prompt ids, then the target's
            got[eid] = (b.input_ids[sel].tolist(), b.loss_mask[sel].tolist(), b.advantages[sel].tolist())
    assert set(got) == set(want)
    for eid, (ids, loss, adv) in got.items():
        prompt, target = want[eid]["observation_token_ids"], want[eid]["action_token_ids"]
        assert ids == prompt + target
        assert loss == [False] * len(prompt) + [True] * len(target)  # the loss is on the correction only
        assert adv == [0.0] * len(prompt) + [1.0] * len(target)
    steps_only = [e for b in TrajectoryLoader(TrajectoryStream(data, seq_len=2048, batch_size=4)) for e in b.episode_ids]
    assert steps_only and not set(steps_only) & set(want)
    both = [e for b in TrajectoryLoader(TrajectoryStream(data, seq_len=2048, batch_size=4,
                                                         tables=("steps", "corrections"))) for e in b.episode_ids]
    assert set(both) == set(steps_only) | set(want)


def test_corrections_need_an_offline_objective(tmp_path):
    with pytest.raises(ConfigError, match="corrections"):
        load_train_config(None, model="m", out="o", **{"data.dir": "d", "objective.name": "grpo",
                                                         "data.corrections": "only"})


def _target_logprob(model_dir: Path, prompt: list[int], target: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + target])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(target) - 1)
    return float(logp[pos, ids[0, len(prompt):]].sum())


@pytest.mark.slow
def test_bc_on_corrections_raises_their_logprob(tiny_model, corrections_data, tmp_path):
    from trajpipe.cli import app

    data, rows = corrections_data
    cfg = tmp_path / "bc-corrections.yaml"
    cfg.write_text("# trajpipe train --config bc-corrections.yaml --data D --model M --out O\n" + yaml.safe_dump({
        "objective": {"name": "bc", "min_advantage": 0.0},
        "data": {"corrections": "only", "seq_len": 2048, "batch_size": 2, "num_workers": 0, "max_epochs": 100},
        "optim": {"lr": 3e-3}, "engine": {"zero_stage": 0}, "publish": {"every": 5}}))
    out = tmp_path / "bc"
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--model", str(tiny_model), "--out", str(out),
                                   "--max-steps", "5", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["steps"] == 5
    policy = max((out / "policies").iterdir(), key=lambda p: int(p.name[1:]))
    for r in rows:
        before = _target_logprob(tiny_model, r["observation_token_ids"], r["action_token_ids"])
        after = _target_logprob(policy, r["observation_token_ids"], r["action_token_ids"])
        assert after > before + 1.0, (before, after)
