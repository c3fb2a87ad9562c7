import numpy as np
import pytest

from schemas.events import (
    EpisodeFinished,
    EpisodeStarted,
    EpisodeStatus,
    Feedback,
    PolicyPublished,
    SamplingParams,
    Step,
    StepVerified,
    make_event_id,
)


def _env(seq: int, **kw):
    return dict(event_id=make_event_id("ep-1", seq), episode_id="ep-1", seq=seq, producer_id="w-0",
                domain="code", task_id="code-0007", policy_version=3, **kw)


@pytest.fixture
def one_of_each():
    """One event of every type, as a rollout worker would emit them."""
    rng = np.random.default_rng(0)
    return [
        EpisodeStarted(**_env(0), task_spec='{"fn": "add"}', env_config='{"cpu_s": 5}', difficulty=2,
                       prompt="Write add(a, b).", sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=11),
                       task_group="code-0007/g0"),
        Step(**_env(1), step_index=0, observation="Write add(a, b).",
             observation_token_ids=rng.integers(0, 32000, 40), action_text="WRITE add.py\ndef add(a, b): return a + b",
             action_token_ids=rng.integers(0, 32000, 300), behaviour_logprobs=-rng.random(300),
             tool_name="write_file", tool_args='{"path": "add.py"}', tool_result="ok", exit_status=0,
             latency_ms=12.5, prompt_tokens=40),
        StepVerified(**_env(2), step_index=0, verifier="code.parses", passed=True, score=1.0, details="ast ok"),
        Feedback(**_env(3), source="reviewer-2", target_step=0, rating=0.8, correction=None, comment="fine"),
        EpisodeFinished(**_env(4), status=EpisodeStatus.SUCCESS, outcome_reward=1.0, num_steps=1,
                        verifier_summary="3/3 tests"),
        PolicyPublished(event_id="p4", episode_id="policy-4", seq=0, producer_id="trainer", domain="*",
                        task_id="-", policy_version=4, version=4, location="/policies/v4", parent_version=3,
                        base_model="tiny-llama", train_step=200),
    ]
