"""Typed settings of a training run (the ``trajpipe train`` recipe).

A recipe is a YAML file whose first line is the command that runs it (see
``trainer/configs/``); command-line flags override it. Only entry points read
configuration: components take plain arguments.

Examples:
    >>> cfg = TrainConfig(model="m", out="o", data=DataConfig(dir="d"), mode="online")
    >>> cfg.data.mode, cfg.objective.max_staleness, cfg.publish.every
    ('tail', 4, 10)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "DataConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "EngineConfig",
    "LoraConfig",
    "PublishConfig",
    "CheckpointConfig",
    "TrainConfig",
    "load_train_config",
    "ConfigError",
]


class ConfigError(ValueError):
    """A training setting is missing, out of range or incompatible with another."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    """What to read and how to pack it (see :class:`trainer.data.TrajectoryStream`)."""

    dir: str | None = Field(None, description="dataset root (holds _commit_log/ and steps/)")
    recipe: str | None = Field(None, description="dataset version <name>-<hash8>; default: the only one")
    mode: Literal["offline", "tail"] = Field("offline", description="offline epochs, or tail new commits")
    domains: list[str] | None = Field(None, description="keep only these domains")
    min_policy_version: int | None = Field(None, description="train steps of policy version >= this (context is kept)")
    max_policy_version: int | None = Field(None, description="train steps of policy version <= this")
    min_advantage: float | None = Field(None, description="train steps with normalized_advantage >= this")
    max_advantage: float | None = Field(None, description="train steps with normalized_advantage <= this")
    statuses: list[str] | None = Field(None, description="train steps of episodes with these statuses")
    include_untrainable: bool = Field(False, description="also train steps of untrainable episodes (cut off by a "
                                      "timeout, error or shutdown: no verdict)")
    advantage_field: Literal["normalized_advantage", "group_advantage", "advantage"] | None = Field(
        None, description="advantage column; default group_advantage for grpo, else normalized_advantage")
    seq_len: int = Field(512, ge=2, description="tokens per packed sequence and longest episode window; "
                         ">= the policy's max_model_len makes every window exact")
    batch_size: int = Field(4, ge=1, description="packed sequences per micro-batch (per rank)")
    shuffle: bool = Field(True, description="shuffle row-group order and episodes inside row groups")
    max_epochs: int | None = Field(None, ge=1, description="offline: stop after this many epochs (None: repeat)")
    num_workers: int = Field(1, ge=0, description="DataLoader worker processes per rank")
    prefetch_factor: int = Field(4, ge=1, description="batches each worker prepares ahead")
    poll_interval_s: float = Field(1.0, gt=0, description="tail: seconds between manifest scans")
    idle_timeout_s: float | None = Field(None, description="tail: stop after this long without new data")
    corrections: Literal["exclude", "include", "only"] = Field(
        "exclude", description="feedback corrections (corrections/, docs/feedback.md) as supervised samples: "
        "exclude them, include them with the steps, or train only them; bc and awr only")


class ObjectiveConfig(_Strict):
    """Which loss and its hyper-parameters (see :mod:`trainer.losses`)."""

    name: Literal["bc", "awr", "ppo", "grpo"] = Field("grpo", description="objective")
    aggregation: Literal["token", "sequence", "dr_grpo"] | None = Field(
        None, description="token (DAPO token mean), sequence (GRPO per-response mean) or dr_grpo (per-response "
        "token sum / norm_tokens), all global over the optimizer step; default: grpo sequence, else token")
    norm_tokens: int | None = Field(None, ge=1, description="dr_grpo: the constant each response's token sum is "
                                    "divided by (default data.seq_len)")
    clip_eps: float = Field(0.2, gt=0, description="ppo/grpo: clip range below 1")
    clip_eps_high: float | None = Field(None, description="ppo/grpo: clip range above 1 (default clip_eps)")
    kl_coef: float | None = Field(None, ge=0, description="ppo/grpo: k3 KL-to-base coefficient (grpo default 0.04)")
    negative_weight: float = Field(1.0, ge=0, le=1, description="ppo/grpo: factor on negative advantages "
                                   "(1: the plain objective; 0: positive samples only)")
    max_staleness: int | None = Field(None, ge=0, description="versions behind (same lineage) before capping, "
                                      "any objective, offline too; None: no cap")
    staleness_mode: Literal["drop", "decay"] = Field("drop", description="drop stale tokens or decay their weight")
    staleness_decay: float = Field(0.5, gt=0, le=1, description="decay: weight factor per version over the cap")
    min_advantage: float = Field(0.0, description="bc: keep steps with advantage above this")
    beta: float = Field(1.0, gt=0, description="awr: temperature")
    max_weight: float = Field(20.0, gt=0, description="awr: weight clip")

    def options(self, *, seq_len: int) -> dict[str, Any]:
        """Keyword options for :func:`trainer.losses.build_objective` (``seq_len``: dr_grpo's default constant)."""
        opts: dict[str, Any] = {"norm_tokens": self.norm_tokens or seq_len}
        if self.aggregation is not None:
            opts["aggregation"] = self.aggregation
        if self.name == "bc":
            opts["min_advantage"] = self.min_advantage
        elif self.name == "awr":
            opts.update(beta=self.beta, max_weight=self.max_weight)
        else:
            opts.update(clip_eps=self.clip_eps, clip_eps_high=self.clip_eps_high, negative_weight=self.negative_weight)
            if self.kl_coef is not None:
                opts["kl_coef"] = self.kl_coef
        return opts


class OptimConfig(_Strict):
    """Optimizer (DeepSpeed's AdamW, or torch's SGD) and learning-rate schedule."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw (DeepSpeed's AdamW, torch implementation) or "
                                          "sgd (torch.optim.SGD: an update proportional to the gradient)")
    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="adamw's moment decay rates")
    eps: float = Field(1e-8, gt=0, description="adamw's denominator term")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd's momentum")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up optimizer steps")
    schedule: Literal["constant", "cosine"] = Field("constant", description="after warm-up")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")


class EngineConfig(_Strict):
    """DeepSpeed settings."""

    zero_stage: int = Field(1, ge=0, le=3, description="ZeRO stage")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    deepspeed_config: str | None = Field(None, description="JSON/YAML file merged over the generated config")
    gradient_checkpointing: bool = False


class LoraConfig(_Strict):
    """Optional LoRA adapter (peft), one per domain group: a run trains one group's adapter."""

    enabled: bool = False
    group: str | None = Field(None, description="adapter name, e.g. the domain group ('code')")
    domains: list[str] | None = Field(None, description="domains of the group (sets data.domains)")
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    merge_on_publish: bool = Field(True, description="publish merged weights (else the adapter dir)")


class PublishConfig(_Strict):
    """Where and how often policies are published."""

    every: int | None = Field(None, ge=1, description="publish every N steps (and at the end); None: only online")
    store: str | None = Field(None, description="policy store (default <out>/policies)")
    bootstrap: str | None = Field(None, description="Kafka bootstrap; when set, emit policy_published")
    domain: str = Field("*", description="domain group the policy is for (event envelope)")
    initial_version: int | None = Field(None, ge=0, description="version of the model we start from; default: "
                                        "its policy.json version when --model is a published policy, else 0 (base)")
    lineage: str | None = Field(None, description="lineage id of the versions this run publishes; default: the "
                                "lineage of --model when it is a published policy (training continues its chain), "
                                "else a new random id at the first start; kept in the checkpoint (--resume continues it)")
    at_end: bool = Field(True, description="also publish after the last step")


class CheckpointConfig(_Strict):
    """Trainer checkpoints (model, optimizer, scheduler, RNG, dataset position)."""

    every: int | None = Field(None, ge=1, description="checkpoint every N steps (and at the end)")
    dir: str | None = Field(None, description="default <out>/checkpoints")
    at_end: bool = True
    keep_last: int = Field(2, ge=1, description="checkpoints kept on disk")


class TrainConfig(_Strict):
    """One training run.

    ``mode="online"`` means: tail the dataset, cap staleness (``max_staleness``
    4 unless set) and publish (every 10 steps unless set).
    """

    model: str = Field(description="base model: a local HF directory")
    out: str = Field(description="run directory (metrics.jsonl, checkpoints/, policies/)")
    mode: Literal["offline", "online"] = "offline"
    max_steps: int = Field(100, ge=1, description="optimizer steps")
    resume: bool = Field(False, description="continue from the latest checkpoint in the run directory")
    seed: int = 0
    log_sample_ids: bool = Field(False, description="write every consumed sample id to samples.jsonl")
    data: DataConfig = DataConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    engine: EngineConfig = EngineConfig()
    lora: LoraConfig = LoraConfig()
    publish: PublishConfig = PublishConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    @model_validator(mode="after")
    def _derive(self) -> TrainConfig:
        if self.data.dir is None:
            raise ValueError("`data.dir` (--data) is required: the dataset root with _commit_log/ and steps/")
        if self.data.corrections != "exclude" and self.objective.name not in ("bc", "awr"):
            raise ValueError(f"`data.corrections: {self.data.corrections}` trains feedback corrections, which no "
                             f"policy sampled (no behaviour log-probs): use --objective bc or awr, not "
                             f"{self.objective.name!r}")
        if self.mode == "online":
            if self.objective.name not in ("ppo", "grpo"):
                raise ValueError(f"--mode online trains on-policy data; use --objective ppo|grpo, "
                                 f"not {self.objective.name!r}")
            if self.data.mode != "tail":
                self.data.mode = "tail"
            if self.objective.max_staleness is None:
                self.objective.max_staleness = 4
            if self.publish.every is None:
                self.publish.every = 10
        if self.data.advantage_field is None:
            self.data.advantage_field = "group_advantage" if self.objective.name == "grpo" else "normalized_advantage"
        if self.lora.enabled and self.lora.domains:
            if self.data.domains and set(self.data.domains) != set(self.lora.domains):
                raise ValueError(f"`lora.domains` {self.lora.domains} and `data.domains` {self.data.domains} differ; "
                                 "a LoRA group trains on its own domains, set one of them")
            self.data.domains = list(self.lora.domains)
        return self


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``, nested mappings key by key (a config and its overrides).

    >>> deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}})
    {'a': {'b': 1, 'c': 3}}
    """
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_train_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a YAML recipe plus overrides (dotted keys allowed, None ignored).

    Examples:
        >>> load_train_config(None, model="m", out="o", **{"data.dir": "d", "objective.name": "bc"}).objective.name
        'bc'

    Raises:
        ConfigError: the file is unreadable or a setting is invalid (the message names it).
    """
    doc: dict[str, Any] = {}
    if path is not None:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"`--config` {path}: {err}") from err
        if not isinstance(doc, dict):
            raise ConfigError(f"`--config` {path} holds a {type(doc).__name__}, not a mapping of settings; "
                              "see trainer/configs/*.yaml")
    for key, value in overrides.items():
        if value is None:
            continue
        node = {}
        cur = node
        parts = key.split(".")
        for p in parts[:-1]:
            cur[p] = {}
            cur = cur[p]
        cur[parts[-1]] = value
        doc = deep_merge(doc, node)
    try:
        return TrainConfig.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(f"invalid training config: {describe_validation_error(err, flags=_FLAGS)}") from err
    except ValueError as err:
        raise ConfigError(f"invalid training config: {err}") from err


#: Dotted config key -> the ``trajpipe train`` flag that sets it (named in error messages).
_FLAGS = {
    "data.dir": "--data", "data.recipe": "--recipe", "model": "--model", "out": "--out",
    "objective.name": "--objective", "mode": "--mode", "max_steps": "--max-steps",
    "engine.deepspeed_config": "--deepspeed-config", "engine.zero_stage": "--zero-stage", "resume": "--resume",
    "publish.every": "--publish-every", "publish.bootstrap": "--bootstrap", "seed": "--seed",
}


def describe_validation_error(err: ValidationError, *, flags: dict[str, str] | None = None,
                              see: str = "see trainer/configs/*.yaml and docs/trainer.md",
                              sources: Callable[[str], str] | None = None) -> str:
    """Each problem of a config on one line: the setting (and its flag), what is wrong, the value given.

    Args:
        err: pydantic's error.
        flags: setting key -> the command-line flag that sets it (named beside the key).
        see: where the valid settings are documented (named for an unknown key).
        sources: setting key -> where else it can be set (e.g. its environment variable), named beside
            the key where ``flags`` has no flag for it.
    """
    flags = flags or {}
    parts = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not key:  # a model-level check: its message names the settings itself
            parts.append(msg)
            continue
        if key in flags:
            where = f"`{flags[key]}` ({key})"
        else:
            where = f"`{key}` ({sources(key)})" if sources is not None else f"`{key}`"
        if e["type"] == "missing":
            parts.append(f"{where} is required")
        elif e["type"] == "extra_forbidden":
            parts.append(f"{where} is not a setting; {see}")
        else:
            parts.append(f"{where}: {msg}, got {e.get('input')!r}")
    return "; ".join(parts)
