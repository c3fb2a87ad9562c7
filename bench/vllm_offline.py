"""vLLM's own offline ``LLM.generate`` over a fixed list of prompts, timed: the reference for ``bench.rollout``.

Reads a JSON request (model directory, prompts as token ids, one seed per
prompt, the sampling parameters), starts ``vllm.LLM`` with the arguments
:class:`rollout.policies.vllm.VLLMPolicy` uses (:func:`rollout.policies.vllm.llm_kwargs`),
runs **one** ``generate`` call over all prompts (each with its own seeded
``SamplingParams``, ``logprobs=0`` as the policy asks) and writes a JSON
answer: generated tokens, the wall seconds of that call (engine start-up not
counted) and every generated token id list.

Then, with the prefix cache emptied, the same prompts once more in one
``generate`` call per step index (all step-0 prompts, then all step-1 prompts,
...): an episode's step ``k`` prompt extends its step ``k-1`` prompt, so this
order lets the prefix cache reuse the previous step's KV the way a rollout
does, which one call over everything cannot (a prompt and its extension are
prefilled side by side).

Fair to the reference:

* the calls run on a worker thread, as the policy steps its engine on its own
  thread: with vLLM's CPU backend the same ``generate`` calls took 10-13 s on
  the main thread and ~2 s on a worker thread on the shared 2-core machine
  (torch keeps 2 OpenMP threads: vLLM's CPU worker turns
  ``torch.set_num_threads`` into a no-op before it would reduce them to 1);
* the engine is warmed with one untimed ``generate`` over the same prompts
  first (the first calls on a fresh engine pay seconds of one-time set-up; the
  rollout's figure includes them, the reference does not, so the ratio errs
  low); the prefix cache is emptied before each timed call.

It runs in its own process (vLLM's process-wide settings, a second engine's
memory), started by ``bench.rollout``::

    .venv/bin/python -m bench.vllm_offline REQUEST.json ANSWER.json
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["run_offline_generate"]


def run_offline_generate(request: dict) -> dict:
    """Time one ``LLM.generate`` over ``request["prompts"]`` (see the module docstring).

    Args:
        request: ``{"model", "prompts": [[ids]], "seeds": [int], "step_indexes": [int], "sampling":
            {temperature, top_p, top_k, max_tokens, seed}, "max_model_len"}``.

    Returns:
        ``{"prompts", "generated_tokens", "generate_s", "generate_engine_steps", "load_s", "token_ids",
        "by_step_generated_tokens", "by_step_generate_s", "by_step_engine_steps", "max_num_seqs"}``
        (the last: the engine's batch width, its scheduler's ``max_num_seqs``).
    """
    from rollout.policies.vllm import configure_cpu_env, llm_kwargs

    configure_cpu_env()
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    s = request["sampling"]
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(request["model"], seed=s.get("seed") or 0, max_model_len=request["max_model_len"]))
    load_s = time.perf_counter() - t0
    params = [VSamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=max(0, s["top_k"]),
                              max_tokens=s["max_tokens"], seed=seed, logprobs=0, skip_special_tokens=True)
              for seed in request["seeds"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    steps = request["step_indexes"]

    engine, steps_taken = llm.llm_engine, [0]
    engine_step = engine.step

    def counted_step(*args, **kwargs):  # the engine steps each call takes (its batch width: tokens / steps)
        steps_taken[0] += 1
        return engine_step(*args, **kwargs)

    engine.step = counted_step

    def generate(indexes: list[int]) -> list:
        return llm.generate([prompts[i] for i in indexes], [params[i] for i in indexes], use_tqdm=False)

    def cold_cache() -> None:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache (blocks still in use)")

    def measure() -> tuple[list, float, int, int, float, int]:
        everything = list(range(len(prompts)))
        generate(everything)  # warm-up, untimed
        cold_cache()
        steps_taken[0], t1 = 0, time.perf_counter()
        outputs = generate(everything)
        one_call_s, one_call_steps = time.perf_counter() - t1, steps_taken[0]
        cold_cache()
        by_step_tokens, steps_taken[0], t2 = 0, 0, time.perf_counter()
        for k in sorted(set(steps)):
            outs = generate([i for i, step in enumerate(steps) if step == k])
            by_step_tokens += sum(len(out.outputs[0].token_ids) for out in outs)
        return outputs, one_call_s, one_call_steps, by_step_tokens, time.perf_counter() - t2, steps_taken[0]

    with ThreadPoolExecutor(max_workers=1) as pool:
        outputs, generate_s, generate_steps, by_step_tokens, by_step_s, by_step_steps = pool.submit(measure).result()
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    return {"prompts": len(prompts), "generated_tokens": sum(len(t) for t in token_ids),
            "generate_s": generate_s, "generate_engine_steps": generate_steps, "load_s": load_s,
            "token_ids": token_ids, "by_step_generated_tokens": by_step_tokens, "by_step_generate_s": by_step_s,
            "by_step_engine_steps": by_step_steps,
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs}


if __name__ == "__main__":
    answer = run_offline_generate(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(answer))
