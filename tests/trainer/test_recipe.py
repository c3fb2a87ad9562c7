"""End-to-end training with DeepSpeed on CPU: the CLI, publishing, online mode, exact crash-and-resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainer.config import load_train_config
from trainer.publish import read_policy
from trainer.recipes.rl import RLRecipe, run

pytestmark = pytest.mark.slow

TINY = {"data": {"seq_len": 64, "batch_size": 2, "num_workers": 1}, "optim": {"lr": 1e-3}}


def _cfg(tiny_model: Path, data: Path, out: Path, **over):
    return load_train_config(None, model=str(tiny_model), out=str(out), **{"data.dir": str(data)},
                             **{"data.seq_len": 64, "data.batch_size": 2, "optim.lr": 1e-3, **over})


def _samples(out: Path) -> dict[int, list[str]]:
    return {d["step"]: d["sample_ids"] for d in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}


def _losses(out: Path) -> dict[int, float]:
    return {d["step"]: d["train/loss"] for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "step" in d}


def test_cli_grpo_20_steps_publishes_a_loadable_policy(tiny_model, vocab_size, make_dataset, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trajpipe.cli import app

    data = make_dataset((60, 40), vocab_size=vocab_size, policy_versions=(0, 1))
    (tmp_path / "r.yaml").write_text("# trajpipe train --config r.yaml ...\n" + yaml.safe_dump(
        {**TINY, "engine": {"zero_stage": 2}}))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--model", str(tiny_model), "--out", str(out),
                                   "--objective", "grpo", "--max-steps", "20", "--publish-every", "10",
                                   "--config", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["policy_version"] == 2 and summary["tokens"] > 20 * 64
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["config"]["engine"]["zero_stage"] == 2 and lines[0]["config"]["deepspeed"]["bf16"]["enabled"] is False
    steps = lines[1:]
    assert len(steps) == 20 and all(json.dumps(s["train/loss"]) != "null" for s in steps)
    assert {"train/clip_fraction", "train/kl", "train/reward", "perf/tokens_per_s", "perf/data_wait_fraction"} <= set(steps[-1])
    rec = read_policy(out / "policies" / "v2")
    assert (rec.version, rec.parent_version, rec.train_step) == (2, 1, 20) and rec.dataset_position
    model = AutoModelForCausalLM.from_pretrained(out / "policies" / "v2")
    tok = AutoTokenizer.from_pretrained(out / "policies" / "v2")
    assert model.config.vocab_size == vocab_size and tok("def add").input_ids


def test_crash_and_resume_sees_exactly_the_same_samples(tiny_model, vocab_size, make_dataset, tmp_path):
    data = make_dataset((30, 20), vocab_size=vocab_size, row_group_size=4)
    over = {"log_sample_ids": True, "objective.name": "ppo", "checkpoint.every": 2, "data.max_epochs": None}
    # uninterrupted: 6 steps
    run(_cfg(tiny_model, data, tmp_path / "a", **over), progress=False)
    # crashed after step 5 (last checkpoint at step 4), then resumed to step 6
    crashed = RLRecipe(_cfg(tiny_model, data, tmp_path / "b", **over, **{"checkpoint.at_end": False}), progress=False)
    crashed.setup()
    crashed.train(max_steps=5)
    crashed.cleanup()  # no final checkpoint: the process "died" after step 5
    summary = run(_cfg(tiny_model, data, tmp_path / "b", **over, resume=True, max_steps=6), progress=False)
    assert summary["steps"] == 6
    a = _samples(tmp_path / "a")
    b_lines = [json.loads(x) for x in (tmp_path / "b" / "samples.jsonl").read_text().splitlines()]
    b_steps = [d["step"] for d in b_lines]
    assert b_steps == [1, 2, 3, 4, 5, 5, 6]  # step 5 replayed from the step-4 checkpoint
    b_crashed, b_resumed = dict((d["step"], d["sample_ids"]) for d in b_lines[:5]), dict(
        (d["step"], d["sample_ids"]) for d in b_lines[5:])
    assert [b_crashed[s] for s in range(1, 5)] + [b_resumed[5], b_resumed[6]] == [a[s] for s in range(1, 7)]
    assert b_resumed[5] == b_crashed[5]
    # model + optimizer state came back too: the resumed losses match the uninterrupted run
    la, lb = _losses(tmp_path / "a"), [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    lb_resumed = {d["step"]: d["train/loss"] for d in lb if "step" in d and d["step"] >= 5}
    assert lb_resumed[6] == pytest.approx(la[6], rel=1e-4, abs=1e-6)


def test_online_zero3_tails_caps_staleness_and_announces(tiny_model, vocab_size, make_dataset, tmp_path):
    data = make_dataset((40,), vocab_size=vocab_size, policy_versions=(0, 3))
    events = []
    cfg = _cfg(tiny_model, data, tmp_path / "o", mode="online", max_steps=4, **{
        "engine.zero_stage": 3, "publish.every": 2, "objective.name": "grpo", "objective.max_staleness": 1,
        "publish.initial_version": 3, "data.idle_timeout_s": 5.0, "data.poll_interval_s": 0.1})
    assert cfg.data.mode == "tail"
    summary = run(cfg, emit_event=events.append, progress=False)
    assert summary["steps"] == 4 and summary["policy_version"] == 5
    assert [(e.version, e.parent_version, e.train_step) for e in events] == [(4, 3, 2), (5, 4, 4)]
    assert Path(events[-1].location).is_dir() and events[-1].event_type == "policy_published"
    steps = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()][1:]
    # half the steps were acted by version 0: 3 versions behind at start (> cap 1) -> dropped
    assert steps[0]["train/stale_fraction"] > 0.2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(events[-1].location)


def test_lora_group_adapter_is_merged_on_publish(tiny_model, vocab_size, make_dataset, tmp_path):
    from safetensors.torch import load_file

    data = make_dataset((30,), vocab_size=vocab_size, domains=("code", "math"))
    cfg = _cfg(tiny_model, data, tmp_path / "l", max_steps=3, **{
        "objective.name": "bc", "lora.enabled": True, "lora.group": "code", "lora.domains": ["code"], "lora.r": 4,
        "publish.every": 3, "log_sample_ids": True})
    assert cfg.data.domains == ["code"]
    run(cfg, progress=False)
    rec = read_policy(tmp_path / "l" / "policies" / "v1")
    assert rec.format == "merged" and rec.adapter == "code"
    base, merged = load_file(tiny_model / "model.safetensors"), load_file(Path(rec.location) / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert set(base) == set(merged) and not (base[q] == merged[q]).all()
    ids = [i for s in _samples(tmp_path / "l").values() for i in s]
    import pyarrow.dataset as ds

    code_ids = set(ds.dataset(data / "steps" / "recipe=synthetic-00000000" / "domain=code").to_table()["event_id"].to_pylist())
    assert ids and set(ids) <= code_ids


def test_token_ids_beyond_the_model_vocabulary_are_a_clear_error(tiny_model, vocab_size, make_dataset, tmp_path):
    from trajpipe.cli import app

    data = make_dataset((10,), vocab_size=vocab_size * 4)  # tokenized for a larger model
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--model", str(tiny_model), "--out",
                                   str(tmp_path / "out"), "--max-steps", "2"])
    assert res.exit_code == 2
    assert "vocabulary" in res.output and "tokenized for another model" in res.output
