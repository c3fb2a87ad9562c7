"""Tiny model: deterministic files, loads in transformers, tokenizer round-trips, prompts fit the context.

(Loading in vLLM is checked by tests/rollout/test_policies_vllm.py, which runs the engine.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from rollout.model import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    init_tiny_model,
    step_seed,
)
from trajpipe.cli import app


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_same_seed_same_bytes_other_seed_same_tokenizer(tiny, tmp_path):
    again = init_tiny_model(tmp_path / "again", seed=0)
    other = init_tiny_model(tmp_path / "other", seed=1)
    names = sorted(p.name for p in tiny.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tiny / name).read_bytes() == (again / name).read_bytes(), name
    # Another weight seed: same vocabulary (interchangeable policy versions), other weights.
    assert (tiny / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert (tiny / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_loads_with_transformers_as_llama(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (128, 2, 2, 64)
    assert cfg.vocab_size == len(tok) and cfg.max_position_embeddings == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                     tok.pad_token_id)
    info = json.loads((tiny / "trajpipe_model.json").read_text())
    assert info["params"] == sum(p.numel() for p in model.parameters())
    ids = tok("CALC 12 * (3 + 4)", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_tokenizer_is_byte_level_and_learned_the_domains(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    for text in ["def add(a, b):\n    return a + b\n", "RUN sort data.csv | uniq -c", "Umsatz: 12,5 € — ✓ 数据"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text  # byte-level: any text round-trips
    # Domain words are single tokens or nearly (BPE merges learned from the generated corpus).
    assert len(tok(" revenue", add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("ANSWER", add_special_tokens=False)["input_ids"]) == 1


def test_step_seed_depends_on_seed_task_step_and_sample():
    seeds = {step_seed(s, t, i, sample=k) for s in (0, 1) for t in ("a", "b") for i in (0, 1)
             for k in ("", "0.0.0", "0.1.0")}
    assert len(seeds) == 24 and all(0 <= s < 2**31 for s in seeds)
    # No sample key: the seed of schema-1 rollouts (reproducible across versions).
    assert step_seed(0, "a", 1) == step_seed(0, "a", 1, sample="")


def test_head_dim_vllm_cannot_run_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="head dim 16"):
        init_tiny_model(tmp_path / "bad", hidden_size=64, num_heads=4)


def test_cli_init_tiny_prints_path_and_counts(tmp_path):
    out = tmp_path / "cli-model"
    result = CliRunner().invoke(app, ["model", "init-tiny", "--out", str(out), "--seed", "3"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    counts = json.loads(lines[-1])
    assert lines[-2] == str(out) and (out / "model.safetensors").exists()
    assert counts["vocab_size"] == len(AutoTokenizer.from_pretrained(out)) and counts["params"] > 500_000
