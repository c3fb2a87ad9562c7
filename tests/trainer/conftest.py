"""Fixtures of the trainer tests: a tiny base model and small synthetic datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.synthetic import make_step_rows, write_steps_commit


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Llama (2 layers, hidden 128, head dim 64) with its tokenizer."""
    from rollout.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def vocab_size(tiny_model: Path) -> int:
    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]


@pytest.fixture
def make_dataset(tmp_path: Path):
    """``make_dataset(commits=[n_episodes, ...], **row_options) -> root``: committed synthetic commits."""

    def make(commits=(40,), *, root: Path | None = None, row_group_size: int = 8, vocab_size: int = 256,
             start_commit: int = 1, **row_kw) -> Path:
        root = root or tmp_path / "data"
        for i, n in enumerate(commits):
            c = start_commit + i
            rows = make_step_rows(n, seed=c, vocab_size=vocab_size, id_prefix=f"c{c}-", **row_kw)
            write_steps_commit(root, rows, commit=c, row_group_size=row_group_size)
        return root

    return make
