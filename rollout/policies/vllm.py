"""A vLLM policy: one in-process vLLM engine, continuous batching over all episodes in flight.

:class:`VLLMPolicy` is a :class:`rollout.policies.base.Policy` whose ``act``
may be called from many episode threads at once. Each call becomes one
request (its own seeded ``SamplingParams``) for a single engine thread that
owns the engine (``LLM.llm_engine``, vLLM's v1 ``LLMEngine``) and loops:

1. move newly submitted requests into the engine (``LLMEngine.add_request``),
   up to ``max_batch`` unfinished at once;
2. run one engine ``step()`` (one scheduler iteration: prefill of the new
   requests, one decode token for the running ones);
3. resolve the future of every request that finished in that step.

So a request joins the running batch at the next step, and one that is done
leaves it at once (continuous batching, Yu et al. 2022, "Orca", §3): an
episode whose environment step is slow holds nobody, and a short request never
waits for a long one (``tests/rollout/test_policies_vllm_continuous.py``).
It is the loop ``LLM.generate`` itself runs (``_run_engine``: ``add_request``
for each prompt, then ``step()`` until none is unfinished), kept open for new
arrivals. The prefix cache (``enable_prefix_caching=True``) reuses the KV of
each episode's growing conversation from one step to the next. This replaced
rounds (one blocking ``LLM.generate`` over the prompts that arrived within
50 ms; a prompt arriving during a round waited for all of it).

Measured (``make bench``, ``rollout_vllm_*``; docs/rollout.md): 16 episodes
of the tiny model in flight on the shared 2-core machine generated 608-982
tokens/s, the engine busy 97-98 % of that time, against 1,306-1,728 tokens/s
for one offline ``LLM.generate`` over the same 64 prompts (ratio 0.35-0.75,
by machine load) and 795-963 tokens/s for offline calls one step index at a
time (ratio 0.65-1.02).

Logprobs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob,
and the engine is created with ``logprobs_mode="processed_logprobs"``, so it
is the log-prob **after** temperature / top-k / top-p, the distribution the
token was drawn from; :mod:`rollout.policies.hf` uses the same convention
(see its docstring). vLLM's default, ``raw_logprobs``, would record the
untempered model distribution instead. Each request has its own seeded
generator, so the same prompt and seed give the same tokens whatever else is
in the batch.

Weights: :meth:`VLLMPolicy.reload` swaps them in place. The swap runs on the
engine thread between steps: requests already in the engine finish on the old
weights, requests submitted after ``reload`` was called are held until the new
weights are in (requests submitted before it keep their place and use the old
ones). The rollout worker drains its episodes before reloading anyway, so each
episode is acted by one version.

Failures: an exception from the engine (``add_request`` aside, ``step``, a
weight reload) may leave it inconsistent, so every waiting call gets
:class:`VLLMEngineError` and the policy refuses further calls. A request the
engine rejects on its own (``add_request`` raising ``ValueError``, e.g. a
prompt longer than ``max_model_len``) fails only its own call. After
:meth:`VLLMPolicy.close` every waiting and later call gets
:class:`VLLMPolicyClosedError`.

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

Why not ``AsyncLLM``: it is the same engine core behind an asyncio API; in
this process it would need an event loop thread besides the episode threads,
and its ``generate`` streams per request where the rollout wants one final
output. The synchronous ``LLMEngine`` on one thread is the smaller piece.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import msgspec

from rollout.context import ChatEncoder, prompt_ids_of
from rollout.model import step_seed
from rollout.policies.base import Action, PolicyContext
from schemas.events import SamplingParams

__all__ = ["GenerationStats", "VLLMEngineError", "VLLMPolicy", "VLLMPolicyClosedError", "configure_cpu_env",
           "llm_kwargs"]

log = logging.getLogger(__name__)


class VLLMPolicyClosedError(RuntimeError):
    """``act`` was called on (or was waiting in) a closed :class:`VLLMPolicy`."""


class VLLMEngineError(RuntimeError):
    """The engine failed (a step or a weight reload raised); it may be inconsistent, so calls are refused."""


def configure_cpu_env(*, kv_cache_gib: int = 1) -> None:
    """Set the environment vLLM's CPU backend reads at import time (see the module docstring).

    Values already in the environment are kept.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def llm_kwargs(model_dir: str | Path, *, seed: int = 0, max_model_len: int = 2048,
               gpu_memory_utilization: float = 0.1, enable_prefix_caching: bool = True, enforce_eager: bool = True,
               dtype: str = "float32") -> dict[str, Any]:
    """The ``vllm.LLM`` arguments :class:`VLLMPolicy` starts its engine with (see the module docstring).

    ``bench.rollout`` starts vLLM's offline ``LLM.generate`` with the same ones.

    Examples:
        >>> kw = llm_kwargs("/models/tiny")
        >>> kw["logprobs_mode"], kw["enable_chunked_prefill"], kw["distributed_executor_backend"]
        ('processed_logprobs', False, 'uni')
    """
    return {
        "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization, "enable_prefix_caching": enable_prefix_caching,
        "enforce_eager": enforce_eager, "logprobs_mode": "processed_logprobs", "seed": seed,
        "distributed_executor_backend": "uni", "disable_log_stats": True, "enable_chunked_prefill": False,
    }


class GenerationStats(msgspec.Struct, kw_only=True):
    """What the engine thread generated, for throughput figures (``trajpipe rollout`` appends them to its counts).

    Attributes:
        requests: requests that finished with an action.
        generated_tokens: tokens in those actions (EOS included when the model stopped on it).
        generation_s: wall seconds from the first request entering the engine to the last one finishing
            (engine start-up excluded; time the engine sat idle waiting for prompts included).
        engine_busy_s: seconds of that spent inside ``LLMEngine.step`` (the engine computing).
        engine_runs: times the engine went from idle to busy (a run lasts while any request is
            unfinished; requests arriving during a run join it).
        engine_steps: ``LLMEngine.step`` calls (scheduler iterations).
    """

    requests: int = 0
    generated_tokens: int = 0
    generation_s: float = 0.0
    engine_busy_s: float = 0.0
    engine_runs: int = 0
    engine_steps: int = 0

    def summary(self) -> dict[str, float | int]:
        """The keys ``trajpipe rollout --policy vllm`` appends to its last-line counts."""
        return {"policy_requests": self.requests, "generated_tokens": self.generated_tokens,
                "generation_s": round(self.generation_s, 3), "engine_busy_s": round(self.engine_busy_s, 3),
                "engine_steps": self.engine_steps}


class _Request(msgspec.Struct):
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    future: Future


class _Reload(msgspec.Struct):
    location: str
    future: Future


class _State(enum.Enum):
    RUNNING = "running"
    FAILED = "failed"
    CLOSED = "closed"


_STOP = None  # the queue item that ends the engine thread


class VLLMPolicy:
    """A policy on one in-process vLLM engine with continuous batching (see the module docstring).

    Args:
        model_dir: model directory (``config.json``, safetensors, tokenizer).
        sampling: temperature, top-p, top-k, ``max_tokens``, base seed.
        policy_version: version recorded on the events (0 = base model).
        max_model_len: context length; the episode's context is cut to ``max_model_len - max_tokens``.
        gpu_memory_utilization: share of device (on CPU: host) memory vLLM plans with.
        kv_cache_gib: KV cache size on CPU, GiB (``VLLM_CPU_KVCACHE_SPACE``).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
        enforce_eager: skip ``torch.compile`` / graph capture.
        max_batch: most requests unfinished in the engine at once (more wait for a free place).
        dtype: model dtype (``float32``; AVX2-only CPUs have no fast bf16).
        engine_kwargs: further ``vllm.LLM`` arguments (they override the above).
        policy_lineage: lineage of published versions the weights belong to (empty: base).
        warm_up_requests: short requests run through the engine at start (0: none; see ``_warm_up``).

    Raises:
        FileNotFoundError: ``model_dir`` does not exist.
        ValueError: the context cannot hold a prompt plus ``max_tokens``, or ``max_batch`` < 1.
        VLLMEngineError: the engine failed its warm-up.
    """

    reload_in_place = True

    def __init__(self, model_dir: str | Path, *, sampling: SamplingParams, policy_version: int = 0,
                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.1, kv_cache_gib: int = 1,
                 enable_prefix_caching: bool = True, enforce_eager: bool = True, max_batch: int = 64,
                 dtype: str = "float32", engine_kwargs: dict[str, Any] | None = None,
                 policy_lineage: str = "", warm_up_requests: int = 8) -> None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist; create one with "
                                    f"`trajpipe model init-tiny --out {model_dir}`")
        if max_model_len - sampling.max_tokens < 2:
            raise ValueError(f"`max_tokens` {sampling.max_tokens} leaves no room for a prompt in "
                             f"`max_model_len` {max_model_len}; lower `max_tokens`")
        if max_batch < 1:
            raise ValueError(f"`max_batch` must be >= 1, got {max_batch}")
        configure_cpu_env(kv_cache_gib=kv_cache_gib)
        from vllm import LLM

        self.sampling = sampling
        self.policy_version = policy_version
        self.policy_lineage = policy_lineage
        self.location = str(model_dir)
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_model_len - sampling.max_tokens
        self.max_batch = max_batch
        kwargs = llm_kwargs(model_dir, seed=sampling.seed or 0, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, dtype=dtype)
        kwargs.update(engine_kwargs or {})
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = ChatEncoder.from_tokenizer(self.tokenizer)
        #: throughput counters, written by the engine thread only.
        self.stats = GenerationStats()
        self._queue: queue.Queue[_Request | _Reload | None] = queue.Queue()
        self._lock = threading.Lock()  # state changes vs. submissions, so nothing is queued behind the end
        self._state = _State.RUNNING
        self._failure: BaseException | None = None
        self._next_id = 0
        self._first_admit: float | None = None
        self._warm_up_requests = warm_up_requests
        self._ready: Future = Future()
        self._thread = threading.Thread(target=self._engine_loop, name="vllm-engine", daemon=True)
        self._thread.start()
        self._ready.result()  # the warm-up ran (or the engine failed: raised here)
        #: seconds the engine took to start (load, KV cache, vLLM's and our warm-up).
        self.load_seconds = time.perf_counter() - t0
        log.info("vLLM engine for %s up in %.1f s", model_dir, self.load_seconds)

    @property
    def generate_calls(self) -> int:
        """Engine runs so far (idle to busy; see :class:`GenerationStats`): the batches formed."""
        return self.stats.engine_runs

    @property
    def prompts_generated(self) -> int:
        """Requests that finished with an action."""
        return self.stats.requests

    # ------------------------------------------------------------------ Policy

    def prompt_ids(self, context: PolicyContext) -> list[int]:
        """Token ids this policy feeds the model for ``context`` (:func:`rollout.context.prompt_ids_of`)."""
        return prompt_ids_of(context, self.chat, max_prompt_tokens=self.max_prompt_tokens)

    def act(self, context: PolicyContext) -> Action:
        """Send this episode's prompt to the engine (it joins the running batch) and wait for its action.

        Raises:
            VLLMPolicyClosedError: the policy was closed before the action was generated.
            VLLMEngineError: the engine failed.
        """
        seed = step_seed(self.sampling.seed or 0, context.task.task_id, context.step_index, sample=context.sample)
        return self.generate_batch([self.prompt_ids(context)], [seed])[0]

    def submit(self, prompt_ids: list[int], *, seed: int, max_tokens: int | None = None) -> Future:
        """Queue one prompt for the engine; the future resolves to its :class:`Action`.

        Args:
            prompt_ids: the token ids to feed the model.
            seed: the request's sampling seed.
            max_tokens: new tokens at most (default: ``sampling.max_tokens``); recorded on ``Action.sampling``.

        Raises:
            ValueError: ``max_tokens`` < 1.
            VLLMPolicyClosedError: the policy is closed.
            VLLMEngineError: the engine failed earlier.
        """
        max_tokens = self.sampling.max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}")
        fut: Future = Future()
        with self._lock:
            self._check_running()
            self._queue.put(_Request(list(prompt_ids), seed, max_tokens, fut))
        return fut

    def generate_batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Action]:
        """Several prompts, each with its own seed, through the engine together; their actions in order."""
        futures = [self.submit(p, seed=s) for p, s in zip(prompts, seeds, strict=True)]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------ reload

    def reload(self, location: str, version: int, *, lineage: str = "") -> VLLMPolicy:
        """Load the weights at ``location`` into the running engine, in place; returns ``self``.

        Uses the engine's ``reload_weights`` worker call (seconds for small
        models, versus a full engine restart), on the engine thread: requests
        already in the engine finish on the old weights first; requests
        submitted after this call are held until the swap is done. The prefix
        cache is reset (cached KV was computed with the old weights).

        Raises:
            FileNotFoundError: no ``*.safetensors`` at ``location``.
            VLLMEngineError: the engine failed (now or earlier); the policy refuses further calls.
            VLLMPolicyClosedError: the policy is closed.
        """
        if not any(Path(location).glob("*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors files in {location}; PolicyPublished.location must be "
                                    "a model directory with merged weights")
        t0 = time.perf_counter()
        fut: Future = Future()
        with self._lock:
            self._check_running()
            self._queue.put(_Reload(str(location), fut))
        fut.result()
        self.policy_version, self.location, self.policy_lineage = version, str(location), lineage
        log.info("vLLM weights of version %d loaded from %s in %.2f s", version, location, time.perf_counter() - t0)
        return self

    # ------------------------------------------------------------------ engine thread

    def _check_running(self) -> None:
        if self._state is _State.CLOSED:
            raise VLLMPolicyClosedError("the vLLM policy is closed")
        if self._state is _State.FAILED:
            raise VLLMEngineError(f"the vLLM engine failed earlier ({self._failure}); restart the worker")

    def _engine_loop(self) -> None:
        engine = self.llm.llm_engine
        backlog: collections.deque[_Request | _Reload] = collections.deque()  # not in the engine yet, in order
        running: dict[str, _Request] = {}  # in the engine, by request id
        try:
            self._warm_up(engine)
        except Exception as err:
            with self._lock:
                self._state, self._failure = _State.FAILED, err
            self._ready.set_exception(VLLMEngineError(f"the vLLM engine failed its warm-up: "
                                                      f"{type(err).__name__}: {err}"))
            return
        self._ready.set_result(None)
        try:
            # Idle: sleep until something arrives. Busy: take whatever arrived, then step.
            while not self._take(backlog, wait=not running and not backlog):
                self._admit(engine, backlog, running)
                if running:
                    self._step(engine, running)
        except Exception as err:  # handed to every waiting call: the engine may be inconsistent now
            log.exception("the vLLM engine failed; the policy refuses further calls")
            with self._lock:
                self._state, self._failure = _State.FAILED, err
            failure: RuntimeError = VLLMEngineError(f"the vLLM engine failed: {type(err).__name__}: {err}")
        else:
            failure = VLLMPolicyClosedError("the vLLM policy was closed")
        for item in [*backlog, *running.values()]:
            _settle(item.future, failure)
        self._fail_queued(failure)

    def _warm_up(self, engine: Any) -> None:
        """A few short requests through the engine, on this thread, before the policy takes any.

        On CPU the first steps of a fresh engine take seconds each (one-time
        set-up inside torch and vLLM's CPU kernels that vLLM's own start-up
        warm-up does not reach): 8 requests of 16 tokens took 3.7 s, after which
        half a rollout's requests (32 calls, 1,024 tokens) took 1.1 s instead of
        13.6 s on a fresh engine. Here it is paid once, in ``load_seconds``.
        Not counted in :attr:`stats`.
        """
        new_tokens = min(8, self.max_model_len // 2)
        prompt = (self.tokenizer.encode("Warm up the engine before the episodes arrive.") * 4)[
            :min(32, self.max_model_len - new_tokens)]
        for i in range(self._warm_up_requests):
            warm = _Request(prompt, i, new_tokens, Future())
            engine.add_request(f"warm-up-{i}", self._engine_input(warm.prompt_ids), self._request_params(warm))
        while engine.has_unfinished_requests():
            engine.step()

    def _take(self, backlog: collections.deque, *, wait: bool) -> bool:
        """Move what was submitted into ``backlog``; True when the stop signal came."""
        try:
            item = self._queue.get() if wait else self._queue.get_nowait()
            while item is not _STOP:
                backlog.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            return False
        return True

    def _admit(self, engine: Any, backlog: collections.deque, running: dict[str, _Request]) -> None:
        """Add backlog requests to the engine in order, up to ``max_batch``; a reload waits for an empty engine."""
        from vllm.exceptions import VLLMClientError

        while backlog:
            head = backlog[0]
            if isinstance(head, _Reload):
                if running:
                    return  # the requests in the engine finish on the old weights first
                self._swap_weights(head.location)
                backlog.popleft()
                head.future.set_result(None)
                continue
            if len(running) >= self.max_batch:
                return
            backlog.popleft()
            if not head.future.set_running_or_notify_cancel():
                continue
            request_id, was_idle = str(self._next_id), not running
            self._next_id += 1
            running[request_id] = head  # from here on a failure reaches its caller
            try:
                engine.add_request(request_id, self._engine_input(head.prompt_ids), self._request_params(head))
            except (ValueError, VLLMClientError) as err:  # this request's own fault (e.g. too long): only it fails
                del running[request_id]
                head.future.set_exception(err)
                continue
            if was_idle:
                self.stats.engine_runs += 1
                if self._first_admit is None:
                    self._first_admit = time.perf_counter()

    def _step(self, engine: Any, running: dict[str, _Request]) -> None:
        """One engine iteration; resolve the requests that finished in it."""
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        self.stats.engine_busy_s += t1 - t0
        self.stats.engine_steps += 1
        for out in outputs:
            if not out.finished:
                continue
            request = running[out.request_id]
            action = self._action_of(request, out)
            del running[out.request_id]
            self.stats.requests += 1
            self.stats.generated_tokens += len(action.token_ids)
            self.stats.generation_s = t1 - self._first_admit
            request.future.set_result(action)

    def _engine_input(self, prompt_ids: list[int]) -> Any:
        """The prompt as the engine takes it: rendered the way ``LLM.generate`` renders a ``TokensPrompt``."""
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        renderer = self.llm.renderer
        parsed = parse_model_prompt(self.llm.model_config, TokensPrompt(prompt_token_ids=prompt_ids))
        (engine_input,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def _request_params(self, request: _Request) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        return VSamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(0, s.top_k),
                               max_tokens=request.max_tokens, seed=request.seed, logprobs=0,
                               skip_special_tokens=True, output_kind=RequestOutputKind.FINAL_ONLY)

    def _action_of(self, request: _Request, out: Any) -> Action:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
        sampling = msgspec.structs.replace(self.sampling, seed=request.seed, max_tokens=request.max_tokens)
        return Action(text=completion.text, token_ids=token_ids, logprobs=logprobs,
                      prompt_tokens=len(request.prompt_ids), sampling=sampling)

    def _swap_weights(self, location: str) -> None:
        # vLLM's in-place reload: re-runs the checkpoint loader (which also redoes
        # the CPU backend's weight repacking) without rebuilding the engine.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": location, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _settle(item.future, error)

    def close(self) -> None:
        """Stop the engine thread (waiting and later calls fail with :class:`VLLMPolicyClosedError`), free the engine.

        The thread stops between two engine steps; one wedged inside vLLM is
        abandoned after 60 s (its waiting calls then never return).
        """
        with self._lock:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSED
            self._queue.put(_STOP)  # behind every submission: none can follow it
        self._thread.join(timeout=60)
        self._fail_queued(VLLMPolicyClosedError("the vLLM policy was closed"))
        del self.llm


def _settle(future: Future, error: BaseException) -> None:
    """Fail ``future`` unless it is already done or was cancelled."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass
