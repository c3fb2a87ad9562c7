"""vLLM policy on CPU: the tiny model loads in vLLM, rollouts record valid tokens and logprobs, reload in place.

vLLM runs in subprocesses (the ``trajpipe rollout`` CLI, and a script with a
``__main__`` guard) so its process-wide settings (thread binding, env vars,
torch threads) never leak into the test process. The recorded log-probs are
checked against ``transformers`` re-scoring the same tokens under the same
sampling distribution: both engines follow one convention (after temperature
and top-p; see rollout/policies/hf.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rollout.envs import generate_tasks
from rollout.model import init_tiny_model
from rollout.policies.base import Message, PolicyContext
from rollout.policies.hf import HFPolicy, score_tokens
from schemas.events import EpisodeStarted, SamplingParams, Step
from streams.config import KafkaConnection
from tests.rollout.test_worker import (
    REPO,
    _env,
    _rollout_cmd,
    assert_complete_episodes,
    read_events,
)

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny-vllm") / "m", seed=0)


@pytest.mark.integration
def test_vllm_rollout_records_tokens_and_logprobs(kafka_broker, topic_name, tiny, tmp_path):
    proc = subprocess.run(
        _rollout_cmd(kafka_broker.bootstrap, tmp_path / "spool", "--policy", "vllm", "--model", str(tiny),
                     "--episodes", "8", "--concurrency", "8", "--max-steps", "2", "--max-tokens", "16",
                     "--temperature", "0.8", "--top-p", "0.95", "--domains", "math,docqa,code", "--seed", "4"),
        cwd=REPO, env=_env(topic_name), check=False, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vLLM engine loaded in" in proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    events = read_events(KafkaConnection(bootstrap_servers=kafka_broker.bootstrap), topic_name)
    assert counts["episodes"] == 8 and counts["events"] == len(events)
    episodes = assert_complete_episodes(events)
    assert len(episodes) == 8
    steps = [e for e in events if isinstance(e, Step)]
    assert len(steps) == 16
    for s in steps:
        assert 0 < len(s.action_token_ids) == len(s.behaviour_logprobs) <= 16
        assert np.isfinite(s.behaviour_logprobs).all() and (s.behaviour_logprobs <= 0).all()
        assert s.prompt_tokens > 0 and s.policy_version == 0
    # Same convention as HF: re-score every first action with transformers under the episode's sampling.
    hf = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(max_tokens=16))
    task = generate_tasks("math", 1, seed=0)[0]  # only the messages matter for the prompt
    for evs in episodes.values():
        started, step0 = evs[0], next(e for e in evs if isinstance(e, Step) and e.step_index == 0)
        assert isinstance(started, EpisodeStarted) and started.sampling.temperature == 0.8
        prompt = hf.prompt_ids(PolicyContext(task=task, messages=[Message("user", started.prompt)], step_index=0))
        assert step0.prompt_tokens == len(prompt)
        expected = score_tokens(hf.model, prompt, step0.action_token_ids.tolist(), started.sampling)
        np.testing.assert_allclose(step0.behaviour_logprobs, expected, atol=2e-3)


_RELOAD_SCRIPT = textwrap.dedent('''
    """Batch, reseed, reload in place; print one JSON line."""
    import json
    import sys
    import time

    from rollout.policies.vllm import VLLMPolicy
    from schemas.events import SamplingParams


    def main() -> None:
        base, new, prompts_file = sys.argv[1:4]
        prompts = json.load(open(prompts_file))
        t0 = time.perf_counter()
        policy = VLLMPolicy(base, sampling=SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1),
                            max_batch=8)
        futures = [policy.submit(p, seed=100 + i) for i, p in enumerate(prompts)]
        before = [f.result() for f in futures]
        repeat = policy.generate_batch([prompts[0]], [100])[0]
        t1 = time.perf_counter()
        policy.reload(new, 1)
        reload_s = time.perf_counter() - t1
        after = policy.generate_batch([prompts[0]], [100])[0]
        policy.close()
        print(json.dumps({
            "load_s": policy.load_seconds, "reload_s": reload_s, "total_s": time.perf_counter() - t0,
            "calls": policy.generate_calls, "version": policy.policy_version,
            "before": [[a.token_ids, a.logprobs] for a in before],
            "repeat": repeat.token_ids, "after": [after.token_ids, after.logprobs],
        }))


    if __name__ == "__main__":
        main()
''')


def test_vllm_batches_prompts_and_reloads_weights_in_place(tiny, tmp_path):
    v1 = init_tiny_model(tmp_path / "v1", seed=1)
    hf0 = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(max_tokens=10))
    prompts = [hf0.prompt_ids(PolicyContext(task=t, messages=[Message("user", t.prompt)], step_index=0))
               for t in generate_tasks("math", 4, seed=5)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    script = tmp_path / "reload_vllm.py"
    script.write_text(_RELOAD_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny), str(v1), str(tmp_path / "prompts.json")],
                          cwd=REPO, env={**_env("unused"), "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["calls"] == 3  # the 4 concurrent prompts went through one generate call
    assert out["version"] == 1 and out["repeat"] == out["before"][0][0]  # seeded: same tokens again
    sampling = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10)
    for prompt, (ids, logprobs) in zip(prompts, out["before"]):
        np.testing.assert_allclose(logprobs, score_tokens(hf0.model, prompt, ids, sampling), atol=2e-3)
    hf1 = HFPolicy.from_pretrained(v1, sampling=sampling)
    ids, logprobs = out["after"]
    assert ids != out["before"][0][0]  # new weights, new draw from the same seed
    np.testing.assert_allclose(logprobs, score_tokens(hf1.model, prompts[0], ids, sampling), atol=2e-3)


_FED_SCRIPT = textwrap.dedent('''
    """Run a 4-step math and a 4-step docqa episode on vLLM, recording every prompt the engine was given."""
    import json
    import sys

    from rollout.envs import generate_tasks, make_env
    from rollout.episode import run_episode
    from rollout.policies.vllm import VLLMPolicy
    from schemas.events import SamplingParams, Step


    class Recording(VLLMPolicy):
        fed = []

        def generate_batch(self, prompts, seeds):
            self.fed.extend(list(p) for p in prompts)  # the TokensPrompt ids vLLM runs, untouched
            return super().generate_batch(prompts, seeds)


    def main() -> None:
        policy = Recording(sys.argv[1], sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=7),
                           max_model_len=512, max_batch=1)
        out = []
        for domain in ("math", "docqa"):
            events, env = [], make_env(domain)
            try:
                run_episode(env, policy, generate_tasks(domain, 1, seed=4)[0], episode_id=domain, producer_id="t",
                            max_steps=4, emit=events.append)
            finally:
                env.close()
            out.append([[s.observation_token_ids.tolist(), s.action_token_ids.tolist(), s.context_cut_start,
                         s.context_cut_tokens, s.prompt_tokens] for s in events if isinstance(s, Step)])
        policy.close()
        print(json.dumps({"episodes": out, "fed": Recording.fed}))


    if __name__ == "__main__":
        main()
''')


def test_vllm_recorded_steps_rebuild_exactly_what_the_engine_was_fed(tiny, tmp_path):
    from rollout.context import model_input_of

    script = tmp_path / "fed_vllm.py"
    script.write_text(_FED_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny)], cwd=REPO,
                          env={**_env("unused"), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fed = iter(out["fed"])
    for domain, steps in zip(("math", "docqa"), out["episodes"]):
        assert len(steps) == 4, domain
        obs, act = [s[0] for s in steps], [s[1] for s in steps]
        for k, (_, _, cut_start, cut_tokens, prompt_tokens) in enumerate(steps):
            given = next(fed)
            assert model_input_of(obs, act, step=k, cut_start=cut_start, cut_tokens=cut_tokens) == given, (domain, k)
            assert prompt_tokens == len(given) <= 512 - 24
        assert all(s[3] > 0 for s in steps) if domain == "docqa" else all(s[3] == 0 for s in steps)
