"""Trainer data path: can the loader keep the trainer fed?

One run, same batches: the loader's rate (Parquet → packed ``PackedBatch``,
tokens/s, in the training process and with one DataLoader worker) against the
trainer's own consumption rate (DeepSpeed ZeRO-1 train steps of the tiny Llama
on CPU, batches already in memory, so no data wait is included). The goal is
``loader_vs_trainer_consumption >= 20``: the loader then costs the trainer
under 5% even if it ran in the training process. On a GPU the trainer is far
faster; see ``bench/gpu_train.sh`` for the figure that matters there.

Run alone: ``.venv/bin/python -m bench.run trainer``.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

__all__ = ["bench_loader"]

SEQ_LEN = 512
BATCH = 8


def _tiny_model(out: Path, vocab_size: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _loader_rate(data: Path, *, num_workers: int) -> tuple[float, int]:
    from trainer.data import TrajectoryLoader, TrajectoryStream

    stream = TrajectoryStream(data, seq_len=SEQ_LEN, batch_size=BATCH, num_workers=num_workers, seed=0)
    t0 = time.perf_counter()
    tokens = sum(b.num_tokens for b in TrajectoryLoader(stream))
    return tokens / (time.perf_counter() - t0), tokens


def bench_loader(workdir: Path, *, rows: int = 12_000, train_steps: int = 6) -> dict:
    """Loader tokens/s vs trainer consumption tokens/s on the tiny model (CPU), ~1–2 minutes.

    Returns:
        ``loader_tokens_per_s`` (in-process), ``loader_tokens_per_s_1_worker``,
        ``trainer_tokens_per_s`` and ``loader_vs_trainer_consumption``.
    """
    from trainer.data import TrajectoryLoader, TrajectoryStream
    from trainer.engine import TrainEngine, build_deepspeed_config, init_distributed, load_model
    from trainer.losses import build_objective
    from trainer.synthetic import write_random_commit

    workdir = Path(workdir)
    vocab = 2048
    data = workdir / "data"
    write_random_commit(data, rows=rows, commit=1, vocab_size=vocab, obs_tokens=(16, 160), action_tokens=(8, 96))
    loader_rate, loader_tokens = _loader_rate(data, num_workers=0)
    loader_rate_1w, _ = _loader_rate(data, num_workers=1)

    _, world = init_distributed()
    model = load_model(_tiny_model(workdir / "model", vocab))
    engine = TrainEngine(model, ds_config=build_deepspeed_config(
        micro_batch_size=BATCH, grad_accum=1, world_size=world, zero_stage=1, bf16=False, lr=1e-5,
        weight_decay=0.0, betas=(0.9, 0.95), grad_clip=1.0, warmup_steps=0, schedule="constant",
        total_steps=train_steps + 1))
    objective = build_objective("ppo")
    batches = list(itertools.islice(TrajectoryLoader(TrajectoryStream(data, seq_len=SEQ_LEN, batch_size=BATCH)),
                                    train_steps + 1))
    tokens, elapsed = 0, 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out = objective(engine.logprobs(batch), batch)
        engine.backward(out.loss)
        engine.step()
        if i:  # the first step pays one-off costs (allocations, optimizer state)
            elapsed += time.perf_counter() - t0
            tokens += batch.num_tokens
    engine.close()
    trainer_rate = tokens / elapsed
    return {
        "loader_tokens_per_s": round(loader_rate),
        "loader_tokens_per_s_1_worker": round(loader_rate_1w),
        "loader_bench_tokens": loader_tokens,
        "trainer_tokens_per_s": round(trainer_rate),
        "loader_vs_trainer_consumption": round(loader_rate / trainer_rate, 1),
    }
