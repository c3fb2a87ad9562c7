"""vLLM continuous batching: a short request never waits for a long one; reload, failure and close semantics.

One real in-process engine on the tiny model (``trajpipe model init-tiny``),
driven by a script in a subprocess (vLLM's process-wide settings stay out of
the test process, as in tests/rollout/test_policies_vllm.py). Random weights
never stop early, so a request generates exactly its ``max_tokens``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rollout.model import init_tiny_model
from tests.rollout.test_worker import REPO, _env

pytestmark = [pytest.mark.slow]

_SCRIPT = textwrap.dedent('''
    """Drive one VLLMPolicy through overlapping requests, a reload under load, an engine failure; print JSON."""
    import json
    import sys
    import threading
    import time

    from rollout.envs import generate_tasks
    from rollout.policies.base import Message, PolicyContext
    from rollout.policies.vllm import VLLMEngineError, VLLMPolicy, VLLMPolicyClosedError
    from schemas.events import SamplingParams

    LONG = 300  # decode steps of the long request; the short one needs 4


    def wait_steps(policy, n):
        """Until the engine has run `n` more steps (the running requests are decoding)."""
        target = policy.stats.engine_steps + n
        while policy.stats.engine_steps < target:
            time.sleep(0.001)


    def finished_at(future, log, name):
        future.add_done_callback(lambda f: log.append(name))


    def main() -> None:
        base, new = sys.argv[1:3]
        policy = VLLMPolicy(base, sampling=SamplingParams(temperature=1.0, max_tokens=LONG, seed=3), max_batch=8)
        p0, p1 = (policy.prompt_ids(PolicyContext(task=t, messages=[Message("user", t.prompt)], step_index=0))
                  for t in generate_tasks("math", 2, seed=9))
        out = {}

        # 1. A short request submitted while a long one is decoding finishes first.
        order = []
        long = policy.submit(p0, seed=1)
        finished_at(long, order, "long")
        wait_steps(policy, 3)
        short = policy.submit(p1, seed=2, max_tokens=4)
        finished_at(short, order, "short")
        out["long_running_at_short_submit"] = not long.done()
        short_action = short.result()
        out["long_running_at_short_done"] = not long.done()
        long_action = long.result()
        out["order"] = order
        out["lengths"] = [len(long_action.token_ids), len(short_action.token_ids)]
        out["short_sampling_max_tokens"] = short_action.sampling.max_tokens
        out["runs_after_overlap"] = policy.stats.engine_runs
        out["summary_after_overlap"] = policy.stats.summary()

        # 2. Reload while the long prompt runs again: it finishes on the old weights; a request
        #    submitted after the reload call waits for the new weights.
        order = []
        again = policy.submit(p0, seed=1)
        finished_at(again, order, "in_flight")
        wait_steps(policy, 3)
        queued, put = threading.Event(), policy._queue.put

        def put_and_tell(item):  # so the next request is surely submitted after the reload
            put(item)
            queued.set()

        policy._queue.put = put_and_tell
        reloader = threading.Thread(target=lambda: (policy.reload(new, 1), order.append("reloaded")))
        reloader.start()
        queued.wait()
        policy._queue.put = put
        held = policy.submit(p1, seed=2, max_tokens=4)
        finished_at(held, order, "held")
        held_action = held.result()
        reloader.join()
        again_action = again.result()
        out["reload_order"] = order
        after = policy.submit(p1, seed=2, max_tokens=4).result()
        out["actions"] = {name: [a.token_ids, a.logprobs] for name, a in [
            ("long", long_action), ("short", short_action), ("in_flight", again_action), ("held", held_action),
            ("after", after)]}
        out["version"] = policy.policy_version

        # 3. The engine fails mid-step: every waiting call gets VLLMEngineError, later calls are refused.
        engine = policy.llm.llm_engine
        real_step = engine.step

        def failing_step():
            if policy.stats.engine_steps >= fail_at:
                raise RuntimeError("injected engine failure")
            return real_step()

        fail_at = policy.stats.engine_steps + 5
        engine.step = failing_step
        waiting = [policy.submit(p0, seed=5), policy.submit(p1, seed=6)]
        errors = []
        for f in waiting:
            try:
                f.result(timeout=120)
                errors.append(None)
            except Exception as err:
                errors.append(type(err).__name__)
        out["waiting_errors"] = errors
        refused = []
        for call in (lambda: policy.submit(p0, seed=7), lambda: policy.reload(new, 2)):
            try:
                call()
                refused.append(None)
            except Exception as err:
                refused.append(type(err).__name__)
        out["refused"] = refused
        policy.close()
        print(json.dumps(out))

        # 4. close() ends a long request at once: its caller gets VLLMPolicyClosedError.
        closing = VLLMPolicy(base, sampling=SamplingParams(temperature=1.0, max_tokens=1500, seed=3))
        pending = closing.submit(p0, seed=1)
        wait_steps(closing, 3)
        t0 = time.perf_counter()
        closing.close()
        close_s = time.perf_counter() - t0
        try:
            pending.result(timeout=60)
            closed_error = None
        except VLLMPolicyClosedError as err:
            closed_error = type(err).__name__
        out["close_s"], out["closed_error"] = close_s, closed_error
        print(json.dumps(out))


    if __name__ == "__main__":
        main()
''')


def test_vllm_continuous_batching_short_request_overtakes_long_one(tmp_path):
    base = init_tiny_model(tmp_path / "v0", seed=0)
    new = init_tiny_model(tmp_path / "v1", seed=1)
    script = tmp_path / "continuous_vllm.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(base), str(new)], cwd=REPO,
                          env={**_env("unused"), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 1. The long request was decoding when the short one came and still was when it finished.
    assert out["long_running_at_short_submit"] and out["long_running_at_short_done"], out
    assert out["order"] == ["short", "long"]
    assert out["lengths"] == [300, 4] and out["short_sampling_max_tokens"] == 4
    assert out["runs_after_overlap"] == 1  # the short request joined the long one's run
    # The last-line counts' engine figures: 304 tokens, one a step per running request, so at least 300
    # steps (the long request's) and at most 2 tokens a step (the width: bench.rollout's tokens per step).
    summary = out["summary_after_overlap"]
    assert summary["policy_requests"] == 2 and summary["generated_tokens"] == 304, summary
    assert 300 <= summary["engine_steps"] <= 304 and 1 < summary["generated_tokens"] / summary["engine_steps"] <= 2
    # 2. Reload waits for the request in the engine (old weights throughout, same tokens as before),
    #    and holds the one submitted after it until the new weights are in.
    assert out["reload_order"][0] == "in_flight" and sorted(out["reload_order"]) == ["held", "in_flight", "reloaded"]
    actions = out["actions"]
    assert actions["in_flight"][0] == actions["long"][0]  # same seed, same (old) weights: same tokens
    np.testing.assert_allclose(actions["in_flight"][1], actions["long"][1], atol=1e-4)
    assert actions["after"][0] == actions["held"][0]  # the held request ran on the new weights
    np.testing.assert_allclose(actions["after"][1], actions["held"][1], atol=1e-4)
    assert np.abs(np.subtract(actions["held"][1], actions["short"][1])).max() > 1e-3  # which are not the old ones
    assert out["version"] == 1
    # 3. Engine failure reaches every waiting call, then the policy refuses work.
    assert out["waiting_errors"] == ["VLLMEngineError", "VLLMEngineError"]
    assert out["refused"] == ["VLLMEngineError", "VLLMEngineError"]
    # 4. close() does not wait for a 1500-token request to finish.
    assert out["closed_error"] == "VLLMPolicyClosedError" and out["close_s"] < 10, out
