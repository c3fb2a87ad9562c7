"""Policy store and ``policy_published`` events: how rollout workers learn about a new policy.

Store layout::

    <store>/v<version>/            loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained
        config.json, model.safetensors (merged weights) | adapter_config.json + adapter_model.safetensors
        tokenizer.json, tokenizer_config.json, ...   (copied from the base model)
        policy.json                {"version", "parent_version", "base_model", "train_step", "format",
                                    "lineage", "dataset_position", "created_at"}

A version directory appears atomically: it is written as ``.v<version>.tmp``
and renamed into place, so a worker never loads a half-written policy. The
event is emitted only after the rename. A store on ``s3://`` gets the version
written locally, then uploaded with ``policy.json`` last
(:func:`trainer.outputs.upload_policy`): ``policy.json`` marks a complete version.
"""

from __future__ import annotations

import os
import shutil
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from schemas import locations as loc
from schemas.events import PolicyPublished, make_event_id

__all__ = [
    "PolicyRecord", "next_policy_version", "write_policy", "save_merged_weights", "emit_policy_published", "read_policy",
]

#: Tokenizer (and generation) files copied from the base model next to the weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


class PolicyRecord(msgspec.Struct, kw_only=True):
    """``policy.json`` of a published policy.

    Attributes:
        version: policy version (the base model is 0).
        parent_version: the version training started from.
        base_model: base model directory.
        train_step: trainer optimizer step at which it was saved.
        location: absolute path of the version directory, or its ``s3://`` URI on an object store.
        format: ``merged`` (full HF weights) or ``adapter`` (a peft LoRA adapter on ``base_model``).
        adapter: LoRA adapter name (domain group), if any.
        lineage: id of the chain of versions this one belongs to (the training
            run and its resumptions); rollouts stamp it on their episodes so the
            trainer measures staleness within one lineage ("" in records
            written before lineages existed).
        dataset_position: the trainer's dataset position (one entry per rank).
        created_at: UTC time of publication.
    """

    version: int
    parent_version: int | None
    base_model: str
    train_step: int
    location: str
    format: str = "merged"
    adapter: str | None = None
    lineage: str = ""
    dataset_position: list[dict[str, Any]] = []
    created_at: datetime = msgspec.field(default_factory=lambda: datetime.now(timezone.utc))


def next_policy_version(store: str | Path, *, current: int) -> int:
    """One more than the newest version in ``store`` (a local path or ``s3://`` URI) or ``current``, whichever is larger."""
    existing = [int(name[1:]) for name in loc.list_dir(store) if name.startswith("v") and name[1:].isdigit()]
    return max([current, *existing]) + 1


def read_policy(path: str | Path) -> PolicyRecord:
    """The :class:`PolicyRecord` of a published version directory (a local path or ``s3://`` URI).

    Raises:
        FileNotFoundError: it has no ``policy.json`` (not a published version, or one not completely uploaded).
    """
    return msgspec.json.decode(loc.read_bytes(loc.join(os.fspath(path), "policy.json")), type=PolicyRecord)


def write_policy(
    store: Path,
    *,
    version: int,
    parent_version: int | None,
    base_model: Path,
    train_step: int,
    save_weights: Callable[[Path], str],
    adapter: str | None = None,
    lineage: str = "",
    dataset_position: list[dict[str, Any]] | None = None,
    location: str | None = None,
) -> PolicyRecord:
    """Write policy ``version`` into the store atomically (rank 0 only).

    Args:
        store: policy store root.
        version: the new version (:func:`next_policy_version`).
        parent_version: the version it was trained from.
        base_model: base model directory (tokenizer files are copied from it).
        train_step: trainer step.
        save_weights: writes the weights into the given directory and returns
            the format written (``merged`` or ``adapter``).
        adapter: LoRA adapter name, if any.
        lineage: the trainer's lineage id.
        dataset_position: trainer dataset position to record.
        location: where the version is published, when not here (an ``s3://`` URI it is uploaded to
            afterwards, :func:`trainer.outputs.upload_policy`); default the written directory.

    Raises:
        FileExistsError: ``v<version>`` already exists (versions are immutable).
    """
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    final = store / f"v{version}"
    if final.exists():
        raise FileExistsError(f"policy {final} already exists; versions are immutable, pick a new one")
    tmp = store / f".v{version}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    fmt = save_weights(tmp)
    for name in TOKENIZER_FILES:
        src = Path(base_model) / name
        if src.is_file() and not (tmp / name).exists():
            shutil.copy2(src, tmp / name)
    record = PolicyRecord(
        version=version, parent_version=parent_version, base_model=str(Path(base_model).resolve()),
        train_step=train_step, location=location or str(final.resolve()), format=fmt, adapter=adapter, lineage=lineage,
        dataset_position=dataset_position or [],
    )
    (tmp / "policy.json").write_bytes(msgspec.json.format(msgspec.json.encode(record), indent=1) + b"\n")
    os.replace(tmp, final)
    fd = os.open(store, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def save_merged_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, base_model: Path,
                        lora_merge: bool) -> Callable[[Path], str]:
    """A ``save_weights`` for :func:`write_policy`.

    Full fine-tuning writes ``state_dict`` with the model's own
    ``save_pretrained``. LoRA writes the adapter; with ``lora_merge`` it then
    loads the base on CPU, applies the adapter, merges and writes full weights.
    """

    def save(dest: Path) -> str:
        if not hasattr(model, "peft_config"):
            model.save_pretrained(dest, state_dict=state_dict, safe_serialization=True)
            return "merged"
        scratch = dest / "_adapter"
        model.save_pretrained(scratch, state_dict=state_dict, safe_serialization=True)
        adapter_dir = next(scratch.rglob("adapter_config.json")).parent  # peft nests named adapters
        if lora_merge:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
            PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().save_pretrained(
                dest, safe_serialization=True)
        else:
            for f in adapter_dir.iterdir():
                f.rename(dest / f.name)
        shutil.rmtree(scratch)
        return "merged" if lora_merge else "adapter"

    return save


def emit_policy_published(send: Callable[[PolicyPublished], None], record: PolicyRecord, *, domain: str = "*",
                          producer_id: str | None = None) -> PolicyPublished:
    """Build the ``policy_published`` event of ``record`` and hand it to ``send``.

    ``send`` is e.g. ``EventProducer.emit`` of a producer on the control topic
    (the caller flushes). The event id is derived from the version, so a
    re-emit after a crash is deduplicated downstream.

    Examples:
        >>> sent = []
        >>> rec = PolicyRecord(version=3, parent_version=2, base_model="/m", train_step=30, location="/s/v3",
        ...                    lineage="run-a")
        >>> ev = emit_policy_published(sent.append, rec, producer_id="trainer-0")
        >>> (ev.episode_id, ev.seq, ev.version, ev.policy_version, ev.lineage, len(sent))
        ('policy-3', 0, 3, 3, 'run-a', 1)
    """
    episode_id = f"policy-{record.version}"
    event = PolicyPublished(
        event_id=make_event_id(episode_id, 0), episode_id=episode_id, seq=0,
        producer_id=producer_id or f"trainer@{socket.gethostname()}", domain=domain, task_id="",
        policy_version=record.version, version=record.version, location=record.location,
        parent_version=record.parent_version, base_model=record.base_model, train_step=record.train_step,
        lineage=record.lineage,
    )
    send(event)
    return event
