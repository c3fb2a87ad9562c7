"""DeepSpeed engine wrapper: model loading, ZeRO config, forward to token log-probs, checkpoints.

On a GPU the engine trains in bf16 with NCCL; on CPU (DeepSpeed's CPU
accelerator) in fp32 with gloo. A single process needs no launcher:
:func:`init_distributed` fills in the usual ``RANK``/``WORLD_SIZE``/...
variables when they are missing.

The reference model for a KL penalty is the frozen base: with LoRA it is the
same module with the adapter switched off (no second copy); otherwise a second
copy loaded from the base directory, never partitioned or optimized.

Log-probs, of the policy and of the reference alike, are on each token's
sampling distribution (temperature, top-k, top-p of the step that produced
it; :func:`trainer.losses.token_logprobs`), the distribution the behaviour
log-probs were recorded on; the module docstring of :mod:`trainer.losses`
says why the reference uses the same one. They are computed only on the
batch's loss tokens (``PackedBatch.loss_mask``); elsewhere they are 0.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["init_distributed", "resolve_device", "build_deepspeed_config", "load_model", "TrainEngine"]

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device() -> torch.device:
    """The device this rank trains on: its GPU (``LOCAL_RANK``) when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed() -> tuple[int, int]:
    """Join (or, alone, create) the process group; returns ``(rank, world_size)``.

    Under a launcher (``deepspeed``, ``torchrun``) the environment is already
    set; a plain single process gets ``RANK=0 WORLD_SIZE=1`` and a free port.
    """
    import deepspeed

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            # Alone, rendezvous through a file, not the port above: a port found free can be taken by another
            # process before the store binds it (seen as EADDRINUSE when trainers start side by side).
            store = Path(tempfile.mkdtemp(prefix="trajpipe-pg-")) / "store"
            deepspeed.init_distributed(dist_backend=backend, init_method=f"file://{store}", rank=0, world_size=1)
        else:
            deepspeed.init_distributed(dist_backend=backend)
        # Without it, gloo's C++ worker threads can still hold work (tensors with Python references) when the
        # interpreter finalizes, and the process aborts after its last line: "terminate called without an
        # active exception", exit -6 (seen ~1 run in 6; pytorch/pytorch#190489, the atexit handler of #179291).
        atexit.register(_destroy_process_group)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _destroy_process_group() -> None:
    """Destroy the default process group while the interpreter is still whole (an ``atexit`` handler)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        with contextlib.suppress(Exception):  # at exit: never turn a clean exit into a traceback
            torch.distributed.destroy_process_group()


def build_deepspeed_config(
    *,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    zero_stage: int,
    bf16: bool,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    grad_clip: float,
    warmup_steps: int,
    schedule: str,
    total_steps: int,
    override: dict[str, Any] | None = None,
    optimizer: str = "adamw",
    eps: float = 1e-8,
    momentum: float = 0.0,
) -> dict[str, Any]:
    """The DeepSpeed config for a run: AdamW (torch implementation) or SGD, warm-up + constant/cosine LR.

    ``optimizer="sgd"`` is ``torch.optim.SGD`` (DeepSpeed takes a ``torch.optim`` class by name): its step is
    ``lr * g`` (plus momentum), where AdamW's first steps are ``lr * g / |g|`` on every weight with a gradient.

    ``override`` (a user ``--deepspeed-config`` file) is merged on top, key by key.
    """
    if schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, warmup_steps + 1), "warmup_num_steps": warmup_steps,
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}}
    else:
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0 if warmup_steps else lr, "warmup_max_lr": lr,
            "warmup_num_steps": max(warmup_steps, 1), "warmup_type": "linear"}}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}}
        if optimizer == "sgd" else {"type": "AdamW", "params": {
            "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay, "torch_adam": True}},
        "scheduler": scheduler,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": zero_stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if override:
        def merge(a: dict, b: dict) -> dict:
            return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                            for k, v in b.items()}}
        cfg = merge(cfg, override)
    return cfg


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    lora: dict[str, Any] | None = None,
    adapter_name: str = "default",
    gradient_checkpointing: bool = False,
) -> torch.nn.Module:
    """A causal LM from a local HF directory, optionally wrapped with a LoRA adapter.

    Args:
        model_dir: HF model directory (config.json + weights).
        dtype: parameter dtype.
        lora: ``peft.LoraConfig`` keyword arguments (``r``, ``lora_alpha``,
            ``lora_dropout``, ``target_modules``); None for full fine-tuning.
        adapter_name: name of the adapter (the domain group).
        gradient_checkpointing: trade compute for activation memory.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """
    from transformers import AutoModelForCausalLM

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"`--model` {model_dir} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora), adapter_name=adapter_name)
    return model


class TrainEngine:
    """A DeepSpeed engine around a causal LM, speaking :class:`trainer.data.PackedBatch`.

    Args:
        model: the policy (optionally a peft model).
        ds_config: DeepSpeed config (:func:`build_deepspeed_config`).
        reference_dir: base model directory for a frozen reference copy, or None
            (no reference, or LoRA where the base is the adapter-less module).
    """

    def __init__(self, model: torch.nn.Module, *, ds_config: dict[str, Any], reference_dir: str | Path | None = None,
                 needs_reference: bool = False) -> None:
        import deepspeed

        self.device = resolve_device()
        self.is_lora = hasattr(model, "disable_adapter")
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
        self.bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
        self.zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        self.reference: torch.nn.Module | None = None
        if needs_reference and not self.is_lora:
            if reference_dir is None:
                raise ValueError("a KL penalty needs `reference_dir` (the base model) unless training LoRA")
            self.reference = load_model(reference_dir, dtype=torch.bfloat16 if self.bf16 else torch.float32)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.needs_reference = needs_reference

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def grad_accum(self) -> int:
        return self.engine.gradient_accumulation_steps()

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def _forward(self, module: torch.nn.Module, batch) -> torch.Tensor:
        from trainer.losses import token_logprobs

        # no attention_mask: transformers derives the block-causal mask of the packed segments from position_ids
        logits = module(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        return token_logprobs(logits, batch.input_ids, temperature=batch.temperature, top_k=batch.top_k,
                              top_p=batch.top_p, mask=batch.loss_mask)

    def logprobs(self, batch) -> torch.Tensor:
        """Per-token log-probs of the policy on the sampling distribution, ``[B, L]`` float32, with grad."""
        return self._forward(self.engine, batch)

    @torch.no_grad()
    def reference_logprobs(self, batch) -> torch.Tensor | None:
        """Per-token log-probs of the frozen base model on the same distribution (None when no reference is needed)."""
        if not self.needs_reference:
            return None
        if self.reference is not None:
            return self._forward(self.reference, batch)
        with self.module.disable_adapter():
            return self._forward(self.engine, batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        """Optimizer step at the accumulation boundary (DeepSpeed counts micro-batches)."""
        self.engine.step()

    def is_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def save_checkpoint(self, ckpt_dir: str | Path, *, tag: str, client_state: dict[str, Any]) -> None:
        """Model, optimizer, scheduler and ``client_state`` (collective: every rank calls it)."""
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any] | None:
        """Load the latest checkpoint; returns its ``client_state`` (None if there is none)."""
        if not (Path(ckpt_dir) / "latest").is_file():
            return None
        path, client_state = self.engine.load_checkpoint(str(ckpt_dir), load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        if path is None:
            return None
        log.info("resumed from %s", path)
        return client_state

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None on other ranks); collective under ZeRO-3."""
        if self.zero_stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            sd = self.module.state_dict() if torch.distributed.get_rank() == 0 else None
        return None if sd is None else {k: v.detach().cpu() for k, v in sd.items()}

    def close(self) -> None:
        with contextlib.suppress(AttributeError):
            self.engine.destroy()
        self.reference = None


def read_deepspeed_override(path: str | Path | None) -> dict[str, Any] | None:
    """A user DeepSpeed config file (JSON or YAML) to merge over the generated one."""
    if path is None:
        return None
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(text) or {}
    return json.loads(text)
