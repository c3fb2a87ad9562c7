"""End-to-end training with DeepSpeed on CPU: the CLI, publishing, online mode, exact crash-and-resume,
lineage staleness and skipped steps, gradient accumulation against one large micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainer.config import load_train_config
from trainer.publish import read_policy
from trainer.recipes.rl import RLRecipe, run
from trainer.synthetic import make_step_rows, write_steps_commit

pytestmark = pytest.mark.slow

TINY = {"data": {"seq_len": 64, "batch_size": 2, "num_workers": 1}, "optim": {"lr": 1e-3}}


def _cfg(tiny_model: Path, data: Path, out: Path, **over):
    return load_train_config(None, model=str(tiny_model), out=str(out), **{"data.dir": str(data)},
                             **{"data.seq_len": 64, "data.batch_size": 2, "optim.lr": 1e-3, **over})


def _samples(out: Path) -> dict[int, list[str]]:
    """Sample ids of each step taken (skipped steps' lines have no "step")."""
    return {d["step"]: d["sample_ids"] for d in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
            if "step" in d}


def _steps(out: Path) -> list[dict]:
    """metrics.jsonl lines of steps taken (skipped steps log a line without train/loss)."""
    return [d for d in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in d]


def _losses(out: Path) -> dict[int, float]:
    return {d["step"]: d["train/loss"] for d in _steps(out)}


def _episode_of(sample_id: str) -> str:
    return sample_id.rsplit("#w", 1)[0]


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
    assert {"train/clip_fraction", "train/kl", "train/reward", "perf/tokens_per_s", "perf/data_wait_fraction",
            "train/skipped_steps", "train/loss_tokens", "data/windows", "data/inexact_windows"} <= set(steps[-1])
    assert sum(s["data/windows"] for s in steps) >= 20 and steps[-1]["train/skipped_steps"] == 0
    rec = read_policy(out / "policies" / "v2")
    assert (rec.version, rec.parent_version, rec.train_step) == (2, 1, 20) and rec.dataset_position
    # one lineage for the run, recorded on every version
    assert len(rec.lineage) == 16 and read_policy(out / "policies" / "v1").lineage == rec.lineage
    model = AutoModelForCausalLM.from_pretrained(out / "policies" / "v2")
    tok = AutoTokenizer.from_pretrained(out / "policies" / "v2")
    assert model.config.vocab_size == vocab_size and tok("def add").input_ids
    # Training from a published policy continues its chain: version 2 -> 3, same lineage.
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--model", str(out / "policies" / "v2"), "--out",
                                   str(tmp_path / "next"), "--objective", "grpo", "--max-steps", "1",
                                   "--config", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["policy_version"] == 3, res.output[-2000:]
    nxt = read_policy(tmp_path / "next" / "policies" / "v3")
    assert (nxt.parent_version, nxt.lineage) == (2, rec.lineage)


def test_crash_and_resume_sees_exactly_the_same_samples(tiny_model, vocab_size, make_dataset, tmp_path):
    data = make_dataset((30, 20), vocab_size=vocab_size, row_group_size=4)
    over = {"log_sample_ids": True, "objective.name": "ppo", "checkpoint.every": 2, "data.max_epochs": None}
    # uninterrupted: 6 steps
    run(_cfg(tiny_model, data, tmp_path / "a", **over), progress=False)
    # crashed after step 5 (last checkpoint at step 4, with v1 published there), then resumed to step 6
    crashed = RLRecipe(_cfg(tiny_model, data, tmp_path / "b", **over, **{
        "checkpoint.at_end": False, "publish.at_end": False, "publish.every": 4}), progress=False)
    crashed.setup()
    crashed.train(max_steps=5)
    crashed.cleanup()  # no final checkpoint or publication: the process "died" after step 5
    summary = run(_cfg(tiny_model, data, tmp_path / "b", **over, resume=True, max_steps=6, **{"publish.every": 4}),
                  progress=False)
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
    la, lb = _losses(tmp_path / "a"), _steps(tmp_path / "b")
    lb_resumed = {d["step"]: d["train/loss"] for d in lb if d["step"] >= 5}
    assert lb_resumed[6] == pytest.approx(la[6], rel=1e-4, abs=1e-6)
    # the resumed run kept the lineage of the first start (saved in the checkpoint): the crashed process
    # published v1 at step 4, the resumed one v2 at its end; another run has another lineage
    lineage = read_policy(tmp_path / "b" / "policies" / "v1").lineage
    assert lineage and read_policy(tmp_path / "b" / "policies" / "v2").lineage == lineage
    assert [read_policy(tmp_path / "b" / "policies" / f"v{v}").train_step for v in (1, 2)] == [4, 6]
    assert read_policy(tmp_path / "a" / "policies" / "v1").lineage not in ("", lineage)


def test_online_zero3_tails_caps_staleness_and_announces(tiny_model, vocab_size, tmp_path):
    # run-a's own versions 0 and 3; every 3rd episode is version 3 of another run (same number, other weights)
    import msgspec

    rows = make_step_rows(40, seed=1, vocab_size=vocab_size, policy_versions=(0, 3), policy_lineage="run-a")
    rows = [msgspec.structs.replace(r, policy_version=3, policy_lineage="run-b") if int(r.episode_id[-5:]) % 3 == 2
            else r for r in rows]
    data = tmp_path / "data"
    write_steps_commit(data, rows, commit=1, row_group_size=8)
    events = []
    cfg = _cfg(tiny_model, data, tmp_path / "o", mode="online", max_steps=4, **{
        "engine.zero_stage": 3, "publish.every": 2, "objective.name": "grpo", "objective.max_staleness": 1,
        "publish.initial_version": 3, "publish.lineage": "run-a", "data.idle_timeout_s": 5.0,
        "data.poll_interval_s": 0.1, "data.batch_size": 4})
    assert cfg.data.mode == "tail"
    summary = run(cfg, emit_event=events.append, progress=False)
    assert summary["steps"] == 4 and summary["policy_version"] == 5
    assert [(e.version, e.parent_version, e.train_step, e.lineage) for e in events] == \
        [(4, 3, 2, "run-a"), (5, 4, 4, "run-a")]
    assert Path(events[-1].location).is_dir() and events[-1].event_type == "policy_published"
    assert read_policy(Path(events[-1].location)).lineage == "run-a"
    lines = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()][1:]
    steps = [d for d in lines if "train/loss" in d]
    # half of run-a's episodes were acted by version 0: 3 versions behind at start (> cap 1) -> dropped;
    # run-b's version 3 is not run-a's version 3: infinitely stale, dropped and counted apart
    assert sum(d["train/stale_fraction"] for d in steps) / len(steps) > 0.2
    assert sum(d["train/foreign_fraction"] for d in lines) > 0
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
    ids = [_episode_of(i) for s in _samples(tmp_path / "l").values() for i in s]
    import pyarrow.dataset as ds

    code_ids = set(ds.dataset(data / "steps" / "recipe=synthetic-00000000" / "domain=code").to_table()["episode_id"].to_pylist())
    assert ids and set(ids) <= code_ids


def test_token_ids_beyond_the_model_vocabulary_are_a_clear_error(tiny_model, vocab_size, make_dataset, tmp_path):
    from trajpipe.cli import app

    data = make_dataset((10,), vocab_size=vocab_size * 4)  # tokenized for a larger model
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--model", str(tiny_model), "--out",
                                   str(tmp_path / "out"), "--max-steps", "2"])
    assert res.exit_code == 2
    assert "vocabulary" in res.output and "tokenized for another model" in res.output


def test_steps_without_fresh_tokens_are_skipped_and_max_steps_counts_taken_steps(tiny_model, vocab_size, make_dataset,
                                                                                 tmp_path):
    # commit 1: this run's lineage, version 0 (fresh); commit 2: another lineage's version 2 (infinitely stale)
    data = make_dataset((20,), vocab_size=vocab_size, policy_lineage="run-a")
    write_steps_commit(data, make_step_rows(20, seed=5, vocab_size=vocab_size, policy_versions=(2,),
                                            policy_lineage="run-b", id_prefix="b-"), commit=2, row_group_size=8)
    cfg = _cfg(tiny_model, data, tmp_path / "s", max_steps=6, log_sample_ids=True, **{
        "objective.name": "ppo", "objective.max_staleness": 2, "publish.lineage": "run-a", "data.batch_size": 1,
        "data.max_epochs": None})
    summary = run(cfg, progress=False)
    assert summary["steps"] == 6
    lines = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()][1:]
    skipped = [d for d in lines if d.get("train/skipped")]
    assert skipped and len(lines) == 6 + len(skipped) and lines[-1]["train/skipped_steps"] == len(skipped)
    assert all(d["train/loss_tokens"] == 0 and d["train/foreign_fraction"] == 1.0 for d in skipped)
    trained = {_episode_of(i) for s in _samples(tmp_path / "s").values() for i in s}
    assert trained and not any(e.startswith("b-") for e in trained)


def test_offline_run_of_only_stale_data_stops(tiny_model, vocab_size, tmp_path):
    data = tmp_path / "data"
    write_steps_commit(data, make_step_rows(6, seed=5, vocab_size=vocab_size, policy_versions=(2,),
                                            policy_lineage="run-b"), commit=1, row_group_size=4)
    cfg = _cfg(tiny_model, data, tmp_path / "x", max_steps=50, **{
        "objective.name": "bc", "objective.max_staleness": 4, "data.max_epochs": None, "data.batch_size": 1})
    summary = run(cfg, progress=False)  # repeats epochs forever, never a step: must stop after a whole epoch
    assert summary["steps"] == 0
    lines = [json.loads(x) for x in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()][1:]
    assert lines and all(d["train/skipped"] == 1.0 for d in lines)
    assert not (tmp_path / "x" / "policies").exists()


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_grad_accum_two_equals_one_micro_batch_with_deepspeed(tiny_model, vocab_size, make_dataset, aggregation):
    """DeepSpeed's accumulated gradient over 2 micro-batches of 1 row = the gradient of 1 micro-batch of 2 rows."""
    import itertools

    import torch

    from trainer.data import TrajectoryLoader, TrajectoryStream
    from trainer.engine import TrainEngine, build_deepspeed_config, init_distributed, load_model
    from trainer.losses import build_objective, step_loss_weights, step_response_index

    data = make_dataset((12,), vocab_size=vocab_size, steps=(2, 3), temperature=0.8, top_p=0.95, top_k=200)
    batch = next(b for b in itertools.islice(TrajectoryLoader(TrajectoryStream(data, seq_len=64, batch_size=2)), 8)
                 if b.loss_mask[0].sum() != b.loss_mask[1].sum() and b.loss_mask[1].any())
    rows = [batch._map(lambda t, r=r: t[r:r + 1]) for r in range(2)]  # episode ids stay valid: same lists
    _, world = init_distributed()
    objective = build_objective("ppo", aggregation=aggregation)

    def grads(micro_batches: list) -> list[torch.Tensor]:
        ds_config = build_deepspeed_config(
            micro_batch_size=micro_batches[0].input_ids.shape[0], grad_accum=len(micro_batches), world_size=world,
            zero_stage=0, bf16=False, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), grad_clip=1e9, warmup_steps=0,
            schedule="constant", total_steps=2)
        engine = TrainEngine(load_model(tiny_model), ds_config=ds_config)
        masks = [b.loss_mask for b in micro_batches]
        weights, _ = step_loss_weights(masks, step_response_index([b.episode_index for b in micro_batches],
                                                                  [b.episode_ids for b in micro_batches]),
                                       aggregation=aggregation, scale=len(micro_batches) * world)
        for i, (b, w) in enumerate(zip(micro_batches, weights)):
            engine.backward(objective(engine.logprobs(b), b, mask=b.loss_mask, weights=w).loss)
            if i + 1 < len(micro_batches):
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        out = [p.grad.detach().clone() for p in engine.module.parameters() if p.grad is not None]
        engine.close()
        return out

    whole, accumulated = grads([batch]), grads(rows)
    assert len(whole) == len(accumulated) > 0 and any(g.abs().sum() > 0 for g in whole)
    for a, b in zip(accumulated, whole):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_optimizer_step_sizes_sgd_and_adamw(tiny_model):
    """Hand-checkable first steps: SGD moves each weight by ``-lr * g``; AdamW's first step by ``lr`` in magnitude
    on every weight whose gradient is not ~0 (``m / sqrt(v) = g / |g|`` after bias correction), however small ``g``."""
    import torch

    from trainer.engine import TrainEngine, build_deepspeed_config, init_distributed, load_model

    _, world = init_distributed()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])

    def first_step(optimizer: str, lr: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ds_config = build_deepspeed_config(
            micro_batch_size=1, grad_accum=1, world_size=world, zero_stage=0, bf16=False, lr=lr, weight_decay=0.0,
            betas=(0.9, 0.95), grad_clip=1e9, warmup_steps=0, schedule="constant", total_steps=1,
            optimizer=optimizer)
        assert ds_config["optimizer"]["type"] == {"sgd": "SGD", "adamw": "AdamW"}[optimizer]
        engine = TrainEngine(load_model(tiny_model), ds_config=ds_config)
        params = [p for p in engine.module.parameters()]
        before = [p.detach().clone() for p in params]
        loss = engine.engine(input_ids=ids, labels=ids).loss * 1e-3  # a small loss: Adam's step does not care
        engine.backward(loss)
        grads = [p.grad.detach().clone() for p in params]
        engine.step()
        after = [p.detach().clone() for p in params]
        engine.close()
        return grads, before, after

    grads, before, after = first_step("sgd", 0.5)
    assert any(g.abs().max() > 0 for g in grads)
    for g, b, a in zip(grads, before, after):
        torch.testing.assert_close(a, b - 0.5 * g, rtol=1e-6, atol=0.0)
    grads, before, after = first_step("adamw", 1e-3)
    moves = [a - b for a, b in zip(after, before)]
    for g, m in zip(grads, moves):
        big = g.abs() > 1e-6  # eps = 1e-8 only matters for |g| near it
        torch.testing.assert_close(m[big].abs(), torch.full_like(m[big], 1e-3), rtol=1e-2, atol=1e-7)
        assert torch.equal(torch.sign(m[big]), -torch.sign(g[big]))
