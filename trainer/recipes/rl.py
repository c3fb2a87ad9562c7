"""RL post-training recipe: datasets → DeepSpeed policy → objective → checkpoints → published policies.

``setup → train → save_checkpoint → cleanup``, wiring the components of
:mod:`trainer` (streaming dataset, objectives, engine, policy store). Run it
with ``trajpipe train`` (see ``trainer/configs/*.yaml`` and docs/trainer.md)::

    trajpipe train --data runs/data --model runs/tiny --out runs/train --objective grpo --max-steps 20

or, on several GPUs, ``deepspeed --num_gpus 8 -m trajpipe train ...``.

Offline mode trains epochs over the commits visible at start; online mode
tails new commits, caps staleness against the current policy version and
publishes a new version every ``publish.every`` steps, emitting
``policy_published`` on the control topic so rollout workers switch to it.

One optimizer step (:meth:`RLRecipe.train_step`):

1. prefetch its ``grad_accum`` micro-batches;
2. choose each micro-batch's loss tokens: the batch's ``loss_mask``, minus
   tokens over the staleness cap (:func:`trainer.losses.policy_lag` within the
   run's lineage; any objective, offline too, when ``max_staleness`` is set),
   through the objective's own selection (filtered BC's advantage filter);
3. compute the aggregation weights globally over the step: token and response
   counts are summed over micro-batches and all-reduced over ranks
   (:func:`trainer.losses.step_loss_weights`), scaled by ``grad_accum *
   world_size`` so that DeepSpeed's averaging yields exactly the global formula;
4. if no rank has a loss token left, take no step at all (no forward, backward
   or optimizer step on any rank) and count it in ``train/skipped_steps``;
   ``max_steps`` counts steps taken. In offline mode a run whose every shard
   went through a whole epoch without a loss token stops (nothing can change:
   only a step publishes a new version);
5. else forward, loss, backward and ``engine.step()`` per micro-batch.

**Lineage.** The run has a lineage id (``publish.lineage``; by default the
lineage of ``--model`` when it is a published policy — training continues its
chain, from its version — else a random id chosen at the first start; kept in
the checkpoint, so ``--resume`` continues the same lineage). Published policies carry it (``policy.json``,
``policy_published.lineage``); staleness compares versions only within it.

**Checkpoint, then publish.** A version is announced only after a checkpoint holds
its weights and its number (:meth:`RLRecipe._checkpoint_and_publish`); a resume from
that checkpoint finishes the publication with the same weights, so a SIGKILL at any
point never makes two policies of one version number (docs/trainer.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schemas import locations as loc
from schemas.events import Event
from trainer.config import TrainConfig
from trainer.data import DataError, PackedBatch, StepFilter, TrajectoryLoader, TrajectoryStream
from trainer.engine import (
    TrainEngine, build_deepspeed_config, init_distributed, load_model, read_deepspeed_override, resolve_device,
)
from trainer.losses import build_objective, policy_lag, staleness_weights, step_loss_weights, step_response_index
from trainer.metrics import MetricLogger
from trainer.outputs import CheckpointDir, RunFiles, make_work_dir, upload_policy
from trainer.publish import (
    emit_policy_published, next_policy_version, read_policy, save_merged_weights, write_policy,
)

__all__ = ["RLRecipe", "run"]

log = logging.getLogger(__name__)


class RLRecipe:
    """One training run.

    Args:
        cfg: the effective configuration.
        emit_event: sends a control event (``policy_published``) and makes it
            durable, e.g. ``EventProducer.emit`` + ``flush``; None: publish to
            the store only.
        progress: show a progress bar (rank 0).
    """

    def __init__(self, cfg: TrainConfig, *, emit_event: Callable[[Event], None] | None = None,
                 progress: bool = True) -> None:
        self.cfg = cfg
        self.emit_event = emit_event
        self.show_progress = progress
        # Outputs on an object store are written in a local scratch directory and uploaded (trainer.outputs).
        ckpt = cfg.checkpoint.dir or loc.join(cfg.out, "checkpoints")
        self.store = cfg.publish.store or loc.join(cfg.out, "policies")
        self.work_dir = make_work_dir() if any(map(loc.is_remote, (cfg.out, ckpt, self.store))) else None
        self.files = RunFiles(cfg.out, work_dir=self.work_dir)
        self.out = self.files.local
        self.ckpt = CheckpointDir(ckpt, work_dir=self.work_dir)
        self.ckpt_dir = self.ckpt.local
        self.step = 0
        self.tokens = 0
        self.skipped_steps = 0
        self.lineage = ""
        self._skip_epochs: dict[int, int] | None = None
        # Training from a published policy continues its chain: its version and lineage (policy.json).
        started_from = read_policy(Path(cfg.model)) if (Path(cfg.model) / "policy.json").is_file() else None
        self._started_lineage = started_from.lineage if started_from is not None else ""
        initial = cfg.publish.initial_version
        if initial is None:
            initial = started_from.version if started_from is not None else 0
        self.policy_version = initial
        self.parent_version = initial
        self._batches: Iterator[PackedBatch] | None = None
        self._last_published_step = -1
        self._last_checkpoint_step = -1

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Process group, seeds, model + DeepSpeed engine, objective, data stream; resume if asked."""
        cfg = self.cfg
        self.rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        self.device = resolve_device()
        _seed_everything(cfg.seed + self.rank)
        bf16 = cfg.engine.precision == "bf16" or (cfg.engine.precision == "auto" and self.device.type == "cuda")
        if bf16 and self.device.type != "cuda":
            raise ValueError("`engine.precision` bf16 needs a GPU; use fp32 (or auto) on CPU")

        self.objective = build_objective(cfg.objective.name, **cfg.objective.options(seq_len=cfg.data.seq_len))
        lora = cfg.lora
        model = load_model(
            cfg.model,
            lora=dict(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules)) if lora.enabled else None,
            adapter_name=lora.group or "default",
            gradient_checkpointing=cfg.engine.gradient_checkpointing,
        )
        ds_config = build_deepspeed_config(
            micro_batch_size=cfg.data.batch_size, grad_accum=cfg.optim.grad_accum, world_size=self.world_size,
            zero_stage=cfg.engine.zero_stage, bf16=bf16, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
            betas=cfg.optim.betas, grad_clip=cfg.optim.grad_clip, warmup_steps=cfg.optim.warmup_steps,
            schedule=cfg.optim.schedule, total_steps=cfg.max_steps, optimizer=cfg.optim.name, eps=cfg.optim.eps,
            momentum=cfg.optim.momentum,
            override=read_deepspeed_override(cfg.engine.deepspeed_config),
        )
        self.ds_config = ds_config
        self.engine = TrainEngine(model, ds_config=ds_config, reference_dir=cfg.model,
                                  needs_reference=self.objective.needs_reference)
        self.pad_id = int(getattr(self.engine.module.config, "pad_token_id", None) or 0)

        d = cfg.data
        self.stream = TrajectoryStream(
            d.dir, seq_len=d.seq_len, batch_size=d.batch_size, recipe=d.recipe,
            filters=StepFilter(
                domains=tuple(d.domains) if d.domains else None, min_policy_version=d.min_policy_version,
                max_policy_version=d.max_policy_version, min_advantage=d.min_advantage,
                max_advantage=d.max_advantage, statuses=tuple(d.statuses) if d.statuses else None,
                include_untrainable=d.include_untrainable),
            advantage_field=d.advantage_field, mode=d.mode, seed=cfg.seed, shuffle=d.shuffle,
            max_epochs=d.max_epochs, poll_interval_s=d.poll_interval_s, idle_timeout_s=d.idle_timeout_s,
            num_workers=d.num_workers, rank=self.rank, world_size=self.world_size, pad_id=self.pad_id,
            tables={"exclude": ("steps",), "include": ("steps", "corrections"), "only": ("corrections",)}[d.corrections],
        )
        self.loader = TrajectoryLoader(self.stream, pin_memory=self.device.type == "cuda",
                                       prefetch_factor=d.prefetch_factor)
        self.lineage = self._gather(cfg.publish.lineage or self._started_lineage
                                    or uuid.uuid4().hex[:16])[0]  # rank 0's
        if cfg.resume:
            if self.is_main:
                self.files.fetch()
            self._resume()

        self.metrics = MetricLogger(self.out / "metrics.jsonl", enabled=self.is_main)
        self.samples_log = (open(self.out / "samples.jsonl", "a", buffering=1)
                            if cfg.log_sample_ids and self.is_main else None)
        effective = cfg.model_dump(mode="json")
        effective["deepspeed"] = ds_config
        effective["world_size"] = self.world_size
        self.metrics.log_config(effective)
        if self.is_main:
            log.info("effective config: %s", effective)

    def _resume(self) -> None:
        state = self.engine.load_checkpoint(self.ckpt_dir) if self.ckpt.fetch_latest() else None
        if state is None:
            log.warning("--resume: no checkpoint in %s; starting from step 0", self.ckpt)
            return
        if len(state["data"]) != self.world_size:
            raise ValueError(f"checkpoint was written by {len(state['data'])} ranks, this run has "
                             f"{self.world_size}; resume with the same world size")
        self.step, self.tokens = state["step"], state["tokens"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.policy_version, self.parent_version = state["policy_version"], state["parent_version"]
        saved = state.get("lineage")
        if saved and self.cfg.publish.lineage is None:
            self.lineage = saved
        elif saved and saved != self.lineage:
            log.warning("`publish.lineage` %r replaces the checkpoint's lineage %r: samples of %r now count as "
                        "another lineage (infinitely stale)", self.lineage, saved, saved)
        self.loader.load_state_dict(state["data"][self.rank])
        _set_rng_state(state["rng"][self.rank])
        self._last_checkpoint_step = self.step
        # A checkpoint taken for a publication (see _checkpoint_and_publish) holds that version's weights: the
        # trainer may have died before the version was written or announced. Finish it: same number, same weights.
        if state.get("publish_version") is not None:
            self.publish()

    # ------------------------------------------------------------------ train

    def _next_batch(self) -> PackedBatch | None:
        if self._batches is None:
            self._batches = iter(self.loader)
        batch = next(self._batches, None)
        if self.world_size > 1:  # stop together: a rank out of data must not leave others in a collective
            flag = self._all_reduce(torch.tensor([0 if batch is None else 1], dtype=torch.int32),
                                    op=torch.distributed.ReduceOp.MIN)
            if int(flag) == 0:
                return None
        return batch

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """``t`` reduced over ranks (sum by default), on the device the backend needs (NCCL: this rank's GPU)."""
        if self.world_size == 1:
            return t
        dev = self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        x = t.to(dev)
        torch.distributed.all_reduce(x, op=op or torch.distributed.ReduceOp.SUM)
        return x.to(t.device)

    def _check_token_ids(self, batch) -> None:
        # Token ids from another tokenizer would crash deep inside the embedding; say so instead.
        vocab = int(self.engine.module.config.vocab_size)
        top = int(batch.input_ids.max()) if batch.input_ids.numel() else 0
        if top >= vocab:
            raise DataError(
                f"the dataset holds token id {top}, but the model {self.cfg.model} has a vocabulary of {vocab}: "
                "these trajectories were tokenized for another model; filter them out (--recipe / filters) "
                "or train the model they were generated with"
            )

    def _loss_tokens(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """A micro-batch's loss tokens after the staleness cap and the objective's selection.

        Returns:
            The ``[B, L]`` loss mask, the per-token staleness weights (``decay``
            mode; None otherwise) and counts for the metrics.
        """
        o = self.cfg.objective
        same = torch.tensor([lineage == self.lineage for lineage in batch.lineages] + [False])
        lag = policy_lag(batch.policy_versions, same[batch.lineage_ids], self.policy_version)  # id -1 -> False
        mask, token_weights = batch.loss_mask, None
        stale = torch.zeros((), dtype=torch.long)
        if o.max_staleness is not None:
            w = staleness_weights(lag, max_staleness=o.max_staleness, mode=o.staleness_mode, decay=o.staleness_decay)
            stale = (mask & (w < 1)).sum()
            if o.staleness_mode == "decay":
                token_weights = w
            mask = mask & (w > 0)
        finite = batch.loss_mask & torch.isfinite(lag)
        stats = {"loss_tokens": float(batch.loss_mask.sum()), "stale_tokens": float(stale),
                 "foreign_tokens": float((batch.loss_mask & torch.isinf(lag)).sum()),
                 "lag_sum": float(lag[finite].sum()), "lag_tokens": float(finite.sum())}
        return self.objective.select(batch, mask), token_weights, stats

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step over ``grad_accum`` micro-batches; its metrics, or None when data ran out.

        A step without any loss token on any rank is skipped (its metrics carry ``train/skipped: 1``).
        """
        t_start = time.perf_counter()
        wait = 0.0
        batches: list[PackedBatch] = []
        for _ in range(self.engine.grad_accum):
            t0 = time.perf_counter()
            batch = self._next_batch()
            wait += time.perf_counter() - t0
            if batch is None:
                return None
            self._check_token_ids(batch)
            batches.append(batch)
        masks, token_weights, stats = zip(*(self._loss_tokens(b) for b in batches))
        responses = step_response_index([b.episode_index for b in batches], [b.episode_ids for b in batches])
        weights, totals = step_loss_weights(
            masks, responses, aggregation=self.objective.aggregation, norm_tokens=self.objective.norm_tokens,
            all_reduce=self._all_reduce if self.world_size > 1 else None,
            scale=self.engine.grad_accum * self.world_size)
        metrics = self._data_metrics(batches, stats)
        metrics.update({"train/loss_tokens": totals.tokens, "train/responses": totals.responses})
        sample_ids = [i for b in batches for i in b.sample_ids]
        if totals.tokens == 0:
            self.skipped_steps += 1
            log.info("step after %d: no loss token left on any rank (stale or filtered): skipped", self.step)
            metrics.update({"train/skipped": 1.0, "train/skipped_steps": self.skipped_steps})
            if self.samples_log is not None:
                self.samples_log.write(_json_line({"skipped_after_step": self.step, "sample_ids": sample_ids}))
            return metrics
        sums: dict[str, float] = defaultdict(float)
        tokens = 0
        for batch, mask, tw, w in zip(batches, masks, token_weights, weights):
            batch = batch.to(self.device)
            logp = self.engine.logprobs(batch)
            ref_logp = self.engine.reference_logprobs(batch)
            out = self.objective(logp, batch, mask=mask.to(self.device), weights=w.to(self.device),
                                 token_weights=None if tw is None else tw.to(self.device), ref_logp=ref_logp)
            self.engine.backward(out.loss)
            self.engine.step()
            for k, v in out.metrics.items():
                sums[k] += float(v)
            tokens += batch.num_tokens
        self.step += 1
        self.tokens += tokens
        self._skip_epochs = None
        dt = time.perf_counter() - t_start
        n = self.engine.grad_accum
        metrics.update({f"train/{k}": v / n for k, v in sums.items()})
        metrics["train/kl"] = metrics.get("train/kl_ref", metrics.get("train/approx_kl", 0.0))
        metrics["train/lr"] = self.engine.lr()
        grad_norm = self.engine.grad_norm()
        if grad_norm is not None:
            metrics["train/grad_norm"] = grad_norm
        metrics["train/policy_version"] = self.policy_version
        metrics["train/skipped_steps"] = self.skipped_steps
        metrics.update({"perf/tokens_per_s": tokens / dt, "perf/data_wait_fraction": wait / dt,
                        "perf/step_time_s": dt, "perf/tokens": self.tokens})
        if self.samples_log is not None:
            self.samples_log.write(_json_line({"step": self.step, "sample_ids": sample_ids}))
        return metrics

    def _data_metrics(self, batches: list[PackedBatch], stats: tuple[dict[str, float], ...]) -> dict[str, float]:
        """``data/…`` counts of the step's micro-batches and its staleness metrics (this rank)."""
        out: dict[str, float] = defaultdict(float)
        for b in batches:
            for k, v in b.counts.as_dict().items():
                out[f"data/{k}"] += v
        total = {k: sum(s[k] for s in stats) for k in stats[0]}
        loss_tokens = max(total["loss_tokens"], 1.0)
        returns = torch.cat([b.episode_returns for b in batches])
        out.update({
            "train/reward": float(returns.mean()) if returns.numel() else 0.0,
            "train/stale_fraction": total["stale_tokens"] / loss_tokens,
            "train/foreign_fraction": total["foreign_tokens"] / loss_tokens,
            "train/staleness": total["lag_sum"] / max(total["lag_tokens"], 1.0),
        })
        return dict(out)

    def _stuck(self) -> bool:
        """Offline: every shard of every rank went through a whole epoch of skipped steps (nothing can change now)."""
        if self.cfg.data.mode != "offline":
            return False
        positions = self.stream.positions()
        if self._skip_epochs is None:
            self._skip_epochs = {}
        done = bool(positions) and all(p.epoch >= self._skip_epochs.setdefault(s, p.epoch) + 2
                                       for s, p in positions.items())
        if self.world_size > 1:
            done = bool(int(self._all_reduce(torch.tensor([int(done)]), op=torch.distributed.ReduceOp.MIN)))
        return done

    def train(self, max_steps: int | None = None) -> dict[str, int]:
        """Train until ``max_steps`` (default ``cfg.max_steps``) or the data ends; publish and checkpoint on the way."""
        cfg = self.cfg
        max_steps = cfg.max_steps if max_steps is None else max_steps
        with _progress(self.show_progress and self.is_main) as bar:
            task = bar.add_task("train", total=max_steps, completed=self.step, info="") if bar else None
            while self.step < max_steps:
                metrics = self.train_step()
                if metrics is None:
                    log.info("data exhausted after %d steps", self.step)
                    break
                self.metrics.log(self.step, metrics)
                if metrics.get("train/skipped"):
                    if self._stuck():
                        log.warning("offline data holds no loss token for policy version %d of lineage %s (every "
                                    "sample stale or filtered) after a whole epoch: stopping after %d steps",
                                    self.policy_version, self.lineage, self.step)
                        break
                    continue
                if bar is not None:
                    bar.update(task, completed=self.step, info=(
                        f"loss {metrics['train/loss']:.4f}  reward {metrics['train/reward']:.3f}  "
                        f"{metrics['perf/tokens_per_s']:,.0f} tok/s  wait {metrics['perf/data_wait_fraction']:.0%}"))
                self._checkpoint_and_publish(
                    publish=bool(cfg.publish.every and self.step % cfg.publish.every == 0),
                    checkpoint=bool(cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0))
        self._checkpoint_and_publish(
            publish=cfg.publish.at_end and self.step > 0 and self._last_published_step != self.step,
            checkpoint=cfg.checkpoint.at_end and self._last_checkpoint_step != self.step)
        return {"steps": self.step, "tokens": self.tokens, "policy_version": self.policy_version}

    # ------------------------------------------------------------------ checkpoint / publish

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def _checkpoint_and_publish(self, *, publish: bool, checkpoint: bool) -> None:
        """Checkpoint, then publish: a version is announced only once a checkpoint holds its weights.

        A publication always checkpoints first, with the new version already taken (``publish_version`` in
        the client state). Killed at any point of the pair, the trainer resumes from a checkpoint that either
        predates the version (nothing of it was announced: the steps are trained again and publish it, once)
        or is the version itself (:meth:`_resume` finishes its publication with the checkpoint's weights), so
        an announced version number is never trained again with other weights. SIGTERM/SIGINT are deferred
        to the end of the pair.
        """
        if not (publish or checkpoint):
            return
        with _stop_signals_deferred():
            if publish:
                version = self._gather(next_policy_version(self.store, current=self.policy_version)
                                       if self.is_main else None)[0]
                self.parent_version, self.policy_version = self.policy_version, version
                self.save_checkpoint(publish_version=version)
                self.publish()
            else:
                self.save_checkpoint()

    def save_checkpoint(self, *, publish_version: int | None = None) -> None:
        """Model, optimizer, scheduler, every rank's RNG and dataset position, under tag ``step-<n>``.

        Args:
            publish_version: these weights are that policy version, about to be published
                (:meth:`_checkpoint_and_publish`); a resume from this checkpoint makes sure it is.
        """
        client_state = {
            "step": self.step, "tokens": self.tokens, "policy_version": self.policy_version,
            "parent_version": self.parent_version, "lineage": self.lineage, "skipped_steps": self.skipped_steps,
            "data": self._gather(self.loader.state_dict()), "rng": self._gather(_rng_state()),
            "publish_version": publish_version,
        }
        tag = f"step-{self.step}"
        self.engine.save_checkpoint(self.ckpt_dir, tag=tag, client_state=client_state)
        # On an object store: uploaded whole, then `latest` names it (one PUT); a crash before leaves the previous.
        self.ckpt.commit(tag, keep_last=self.cfg.checkpoint.keep_last, is_main=self.is_main,
                         barrier=lambda: self._gather(None))
        self._last_checkpoint_step = self.step
        if self.is_main:
            self.files.upload()

    def publish(self) -> None:
        """Write the current policy version (``policy_version``, taken by :meth:`_checkpoint_and_publish`) to the
        store and announce it (collective under ZeRO-3).

        Idempotent: a version already in the store (written before a crash, by this lineage at this step) is
        announced again, not rewritten; its ``policy_published`` has the same event id (deduplicated downstream).

        Raises:
            ValueError: the store holds this version number from another lineage or step.
        """
        state_dict = self.engine.full_state_dict()
        positions = self._gather(self.loader.state_dict())
        version = self.policy_version
        if self.is_main:
            final = loc.join(self.store, f"v{version}")
            # policy.json marks a complete version (on an object store it is uploaded last)
            if loc.is_file(loc.join(final, "policy.json")):
                record = read_policy(final)
                if (record.lineage, record.train_step) != (self.lineage, self.step):
                    raise ValueError(
                        f"policy store {self.store} already holds v{version} of lineage {record.lineage!r} at step "
                        f"{record.train_step}, not this run's ({self.lineage!r}, step {self.step}); give the run "
                        "its own `publish.store`")
                log.info("v%d is in the store already (written before a crash): announcing it", version)
            else:
                save = save_merged_weights(self.engine.module, state_dict, base_model=Path(self.cfg.model),
                                           lora_merge=self.cfg.lora.merge_on_publish)
                remote = loc.is_remote(self.store)
                local_store = self.work_dir / "policies" if remote else Path(self.store)
                if remote:  # a partial upload of this version before a crash is overwritten
                    shutil.rmtree(local_store / f"v{version}", ignore_errors=True)
                record = write_policy(
                    local_store, version=version, parent_version=self.parent_version,
                    base_model=Path(self.cfg.model), train_step=self.step, save_weights=save,
                    adapter=self.cfg.lora.group if self.cfg.lora.enabled else None,
                    lineage=self.lineage, dataset_position=positions, location=final if remote else None,
                )
                if remote:  # uploaded whole (policy.json last) before the event announces it
                    upload_policy(local_store / f"v{version}", final)
                    shutil.rmtree(local_store / f"v{version}", ignore_errors=True)
            if self.emit_event is not None:
                emit_policy_published(self.emit_event, record, domain=self.cfg.publish.domain)
            log.info("published policy v%d at step %d: %s", version, self.step, record.location)
        self._gather(None)  # every rank waits for rank 0's publication
        self._last_published_step = self.step

    # ------------------------------------------------------------------ cleanup

    def cleanup(self) -> None:
        """Stop data workers, close logs and the engine."""
        self._batches = None
        self.metrics.close()
        if self.samples_log is not None:
            self.samples_log.close()
        self.engine.close()
        if self.is_main:
            self.files.upload()
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)


@contextlib.contextmanager
def _stop_signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT received inside the block take effect (with their previous handlers) at its end.

    Only in the main thread (the only one where Python lets handlers be set); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    # (a handler installed outside Python reads as None and cannot be put back: such a signal is left alone)
    previous = {s: h for s in (signal.SIGTERM, signal.SIGINT) if (h := signal.getsignal(s)) is not None}
    for s in previous:
        signal.signal(s, lambda sig, _frame: pending.append(sig))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for sig in pending:
            log.info("signal %d received while publishing/checkpointing: acting on it now", sig)
            signal.raise_signal(sig)


def run(cfg: TrainConfig, *, emit_event: Callable[[Event], None] | None = None,
        progress: bool = True) -> dict[str, int]:
    """``setup → train → save_checkpoint → cleanup``; returns ``{"steps", "tokens", "policy_version"}``."""
    recipe = RLRecipe(cfg, emit_event=emit_event, progress=progress)
    try:
        recipe.setup()
    except BaseException:
        if recipe.work_dir is not None:  # cleanup() would do it; setup failed before there is anything to close
            shutil.rmtree(recipe.work_dir, ignore_errors=True)
        raise
    try:
        return recipe.train()
    finally:
        recipe.cleanup()


# ---------------------------------------------------------------------- helpers


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": _np_state_to_builtin(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _np_state_to_builtin(state: tuple) -> tuple:
    kind, keys, pos, has_gauss, gauss = state
    return (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss))


def _json_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj) + "\n"


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=Console(stderr=True))
