"""A vLLM policy: the offline engine ``vllm.LLM``, batching the prompts of all episodes in flight.

:class:`VLLMPolicy` is a :class:`rollout.policies.base.Policy` whose ``act``
may be called from many episode threads at once. Calls are queued; a batcher
thread collects every prompt that arrives within ``max_wait_s`` of the first
one (or until ``max_batch`` are waiting) and runs them through **one**
``LLM.generate`` call, each with its own seeded ``SamplingParams``. The
engine's scheduler batches them on the device and the prefix cache
(``enable_prefix_caching=True``) reuses the KV of each episode's growing
conversation from one step to the next.

Logprobs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob,
and the engine is created with ``logprobs_mode="processed_logprobs"``, so it
is the log-prob **after** temperature / top-k / top-p, the distribution the
token was drawn from; :mod:`rollout.policies.hf` uses the same convention
(see its docstring). vLLM's default, ``raw_logprobs``, would record the
untempered model distribution instead.

CPU settings (:func:`configure_cpu_env`, applied before ``vllm`` is imported;
existing environment values win):

* ``VLLM_TARGET_DEVICE=cpu``;
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB of host RAM for the KV cache; ``kv_cache_gib``);
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``:
  engine core and model runner live in this process. No child processes, so no
  ``if __name__ == "__main__"`` guard is needed, start-up is ~4x faster than
  with the spawned engine core + worker, and weights can be swapped in place
  (:meth:`VLLMPolicy.reload`);
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``: by default vLLM pins the process to one
  core and reserves the rest; in-process that would pin the rollout worker's
  own threads (environments, Kafka) too;
* ``enforce_eager=True`` by default: ``torch.compile`` warm-up costs ~40 s on
  2 cores for little gain with a tiny model (pass ``enforce_eager=False`` for
  real models);
* ``enable_chunked_prefill=False``: with chunked prefill, a partially prefilled
  request that has its own seed makes vLLM 0.32's CPU runner call
  ``Generator.set_offset``, which CPU generators do not support
  (``RuntimeError: CPU Generator does not use offset``), and the engine is
  wedged from then on. Whole-prompt prefill avoids it; prompts are capped at
  ``max_model_len`` anyway.

``gpu_memory_utilization`` on CPU is the share of host memory vLLM may plan
with; 0.1 is plenty for the tiny model. Any other ``vllm.LLM`` argument goes
through ``engine_kwargs``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec

from rollout.context import ChatEncoder, prompt_ids_of
from rollout.model import step_seed
from rollout.policies.base import Action, PolicyContext
from schemas.events import SamplingParams

__all__ = ["VLLMEngineError", "VLLMPolicy", "VLLMPolicyClosedError", "configure_cpu_env"]

log = logging.getLogger(__name__)


class VLLMPolicyClosedError(RuntimeError):
    """``act`` was called on (or was waiting in) a closed :class:`VLLMPolicy`."""


def configure_cpu_env(*, kv_cache_gib: int = 1) -> None:
    """Set the environment vLLM's CPU backend reads at import time (see the module docstring).

    Values already in the environment are kept.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VLLMEngineError(RuntimeError):
    """A ``generate`` call failed; the engine may be left inconsistent, so the policy refuses further calls."""


class _Request(msgspec.Struct):
    prompt_ids: list[int]
    seed: int
    future: Future


class VLLMPolicy:
    """A policy on ``vllm.LLM`` (offline engine, in this process).

    Args:
        model_dir: model directory (``config.json``, safetensors, tokenizer).
        sampling: temperature, top-p, top-k, ``max_tokens``, base seed.
        policy_version: version recorded on the events (0 = base model).
        max_model_len: context length; the episode's context is cut to ``max_model_len - max_tokens``.
        gpu_memory_utilization: share of device (on CPU: host) memory vLLM plans with.
        kv_cache_gib: KV cache size on CPU, GiB (``VLLM_CPU_KVCACHE_SPACE``).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
        enforce_eager: skip ``torch.compile`` / graph capture.
        max_batch: most prompts per ``generate`` call.
        max_wait_s: how long the batcher waits for more prompts after the first.
        dtype: model dtype (``float32``; AVX2-only CPUs have no fast bf16).
        engine_kwargs: further ``vllm.LLM`` arguments (they override the above).
        policy_lineage: lineage of published versions the weights belong to (empty: base).

    Raises:
        FileNotFoundError: ``model_dir`` does not exist.
        ValueError: the context cannot hold a prompt plus ``max_tokens``.
    """

    reload_in_place = True

    def __init__(self, model_dir: str | Path, *, sampling: SamplingParams, policy_version: int = 0,
                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.1, kv_cache_gib: int = 1,
                 enable_prefix_caching: bool = True, enforce_eager: bool = True, max_batch: int = 64,
                 max_wait_s: float = 0.05, dtype: str = "float32",
                 engine_kwargs: dict[str, Any] | None = None, policy_lineage: str = "") -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist; create one with "
                                    f"`trajpipe model init-tiny --out {model_dir}`")
        if max_model_len - sampling.max_tokens < 2:
            raise ValueError(f"`max_tokens` {sampling.max_tokens} leaves no room for a prompt in "
                             f"`max_model_len` {max_model_len}; lower `max_tokens`")
        configure_cpu_env(kv_cache_gib=kv_cache_gib)
        from vllm import LLM

        self.sampling = sampling
        self.policy_version = policy_version
        self.policy_lineage = policy_lineage
        self.location = str(model_dir)
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_model_len - sampling.max_tokens
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        kwargs: dict[str, Any] = {
            "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization, "enable_prefix_caching": enable_prefix_caching,
            "enforce_eager": enforce_eager, "logprobs_mode": "processed_logprobs", "seed": sampling.seed or 0,
            "distributed_executor_backend": "uni", "disable_log_stats": True, "enable_chunked_prefill": False,
        }
        kwargs.update(engine_kwargs or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        #: seconds the engine took to start (load, KV cache, warm-up).
        self.load_seconds = time.perf_counter() - t0
        log.info("vLLM engine for %s up in %.1f s", model_dir, self.load_seconds)
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = ChatEncoder.from_tokenizer(self.tokenizer)
        self._eos = self.tokenizer.eos_token_id
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._engine_lock = threading.Lock()  # generate vs weight reload
        self._closed = False
        self._failed: BaseException | None = None
        #: generate calls made and prompts they carried (batching efficiency = prompts / calls).
        self.generate_calls = 0
        self.prompts_generated = 0
        self._thread = threading.Thread(target=self._batch_loop, name="vllm-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ Policy

    def prompt_ids(self, context: PolicyContext) -> list[int]:
        """Token ids this policy feeds the model for ``context`` (:func:`rollout.context.prompt_ids_of`)."""
        return prompt_ids_of(context, self.chat, max_prompt_tokens=self.max_prompt_tokens)

    def act(self, context: PolicyContext) -> Action:
        """Queue this episode's prompt for the next batched ``generate`` call and wait for its action.

        Raises:
            VLLMPolicyClosedError: the policy was closed before the action was generated.
        """
        seed = step_seed(self.sampling.seed or 0, context.task.task_id, context.step_index, sample=context.sample)
        return self.submit(self.prompt_ids(context), seed=seed).result()

    def submit(self, prompt_ids: list[int], *, seed: int) -> Future:
        """Queue one prompt; the future resolves to its :class:`Action`."""
        if self._closed:
            raise VLLMPolicyClosedError("the vLLM policy is closed")
        if self._failed is not None:
            raise VLLMEngineError(f"the vLLM engine failed earlier ({self._failed}); restart the worker")
        fut: Future = Future()
        self._queue.put(_Request(list(prompt_ids), seed, fut))
        return fut

    def generate_batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Action]:
        """One ``LLM.generate`` call for several prompts, each with its own seed."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        s = self.sampling
        params = [
            VSamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(0, s.top_k),
                            max_tokens=s.max_tokens, seed=seed, logprobs=0, skip_special_tokens=True)
            for seed in seeds
        ]
        with self._engine_lock:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        self.generate_calls += 1
        self.prompts_generated += len(prompts)
        actions = []
        for prompt, seed, out in zip(prompts, seeds, outputs):
            completion = out.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
            actions.append(Action(text=completion.text, token_ids=token_ids, logprobs=logprobs,
                                  prompt_tokens=len(prompt), sampling=msgspec.structs.replace(s, seed=seed)))
        return actions

    # ------------------------------------------------------------------ reload

    def reload(self, location: str, version: int, *, lineage: str = "") -> VLLMPolicy:
        """Load the weights at ``location`` into the running engine, in place; returns ``self``.

        Uses the engine's ``reload_weights`` worker call (seconds for small
        models, versus a full engine restart).

        The caller must make sure no episode is in flight (the rollout worker
        drains first), or in-flight episodes would continue on the new weights.
        The prefix cache is reset: cached KV was computed with the old weights.

        Raises:
            FileNotFoundError: no ``*.safetensors`` at ``location``.
        """
        if not any(Path(location).glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors files in {location}; PolicyPublished.location must be "
                                    "a model directory with merged weights")
        t0 = time.perf_counter()
        with self._engine_lock:
            # vLLM's in-place reload: re-runs the checkpoint loader (which also redoes
            # the CPU backend's weight repacking) without rebuilding the engine.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(location),
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        self.policy_version, self.location, self.policy_lineage = version, str(location), lineage
        log.info("vLLM weights of version %d loaded from %s in %.2f s", version, location, time.perf_counter() - t0)
        return self

    # ------------------------------------------------------------------ batcher

    def _batch_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            stop = False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if batch and self._failed is not None:  # queued just before the engine failed
                for r in batch:
                    r.future.set_exception(VLLMEngineError(f"the vLLM engine failed earlier ({self._failed})"))
            elif batch:
                try:
                    actions = self.generate_batch([r.prompt_ids for r in batch], [r.seed for r in batch])
                except Exception as err:  # handed to every waiting episode
                    log.exception("vLLM generate failed; the policy refuses further calls")
                    self._failed = err
                    failure = VLLMEngineError(f"vLLM generate failed: {type(err).__name__}: {err}")
                    for r in batch:
                        r.future.set_exception(failure)
                    self._fail_queued(failure)
                else:
                    for r, action in zip(batch, actions):
                        r.future.set_result(action)
            if stop:
                return

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.put(None)  # keep the stop signal for the loop
                return
            item.future.set_exception(error)

    def close(self) -> None:
        """Stop the batcher (waiting ``act`` calls fail) and free the engine."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)  # a generate call wedged inside vLLM is abandoned
        self._fail_queued(VLLMPolicyClosedError("the vLLM policy was closed"))
        del self.llm
