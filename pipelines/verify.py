"""VerifySteps: re-run the domain's step verifiers over recorded steps, plus generic checks.

Examples:
    >>> from schemas.events import Step
    >>> ok = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
    ...           step_index=0, action_token_ids=[1, 2], behaviour_logprobs=[-0.5, -0.1])
    >>> check_token_consistency(ok).passed
    True
    >>> bad = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
    ...            step_index=0, action_token_ids=[1, 2], behaviour_logprobs=[0.5, float("nan")])
    >>> v = check_token_consistency(bad); v.passed, v.details
    (False, 'logprobs > 0: 1, non-finite logprobs: 1')
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import apache_beam as beam
import msgspec
import numpy as np
from apache_beam.metrics import Metrics

from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.datasets import Verification
from schemas.events import Step

__all__ = ["VerifySteps", "check_token_consistency", "TOKEN_CONSISTENCY"]

#: Name of the generic check every step gets.
TOKEN_CONSISTENCY = "pipeline.token_consistency"

_STEP_FIELDS = ("step_index", "action_text", "tool_name", "tool_args", "tool_result", "exit_status")


_TOKENS_OK = Verification(verifier=TOKEN_CONSISTENCY, passed=True, score=1.0, details="ok", source="pipeline")


def check_token_consistency(step: Step) -> Verification:
    """Generic check: one behaviour logprob per action token, all finite and <= 0.

    An empty logprob array (the rollout did not record them) passes with
    score 0.5 and says so, since off-policy objectives cannot use the step.
    """
    lp = np.asarray(step.behaviour_logprobs)
    n_tok = len(step.action_token_ids)
    problems = []
    if len(lp) == 0:
        return Verification(verifier=TOKEN_CONSISTENCY, passed=True, score=0.5,
                            details="no behaviour logprobs recorded", source="pipeline")
    if len(lp) == n_tok and math.isfinite(float(lp.sum())) and lp.max() <= 0:  # the common case, 2 reductions
        return _TOKENS_OK
    if len(lp) != n_tok:
        problems.append(f"{len(lp)} logprobs for {n_tok} action tokens")
    finite = np.isfinite(lp)
    if (lp[finite] > 0).any():
        problems.append(f"logprobs > 0: {int((lp[finite] > 0).sum())}")
    if not finite.all():
        problems.append(f"non-finite logprobs: {int((~finite).sum())}")
    return Verification(verifier=TOKEN_CONSISTENCY, passed=not problems, score=0.0 if problems else 1.0,
                        details=", ".join(problems) or "ok", source="pipeline")


class _VerifyFn(beam.DoFn):
    def __init__(self, use_domain_verifiers: bool) -> None:
        self._use_domain = use_domain_verifiers
        self._verify_step = None
        self._not_found: type[Exception] = LookupError
        self._checked = Metrics.counter(METRICS_NAMESPACE, "steps_verified")
        self._failed = Metrics.counter(METRICS_NAMESPACE, "steps_failed_token_consistency")
        self._no_verifier = Metrics.counter(METRICS_NAMESPACE, "episodes_without_domain_verifier")
        self._errors = Metrics.counter(METRICS_NAMESPACE, "verifier_errors")

    def setup(self) -> None:
        if not self._use_domain:
            return
        try:  # rollout/ is optional for the pipeline: without it, rollout-time verdicts only
            from rollout.verifiers import VerifierNotFound, verify_step
        except ImportError:
            return
        self._verify_step, self._not_found = verify_step, VerifierNotFound

    def process(self, episode: Episode) -> Iterator[Episode]:
        spec = self._task_spec(episode) if self._verify_step is not None else None  # specs can be whole documents
        domain_ok = spec is not None
        verdicts = []
        for step, recorded in zip(episode.steps, episode.verdicts):
            ours = [check_token_consistency(step)]
            if not ours[0].passed:
                self._failed.inc()
            if domain_ok:
                fields = {k: getattr(step, k) for k in _STEP_FIELDS}
                try:
                    ours.extend(
                        Verification(verifier=v.verifier, passed=v.passed, score=v.score, details=v.details,
                                     source="pipeline")
                        for v in self._verify_step(episode.domain, spec, fields)
                    )
                except self._not_found:
                    domain_ok = False
                    self._no_verifier.inc()
                except (ValueError, TypeError, KeyError) as err:
                    self._errors.inc()
                    ours.append(Verification(verifier=f"{episode.domain}.verifier_error", passed=False, score=0.0,
                                             details=str(err)[:200], source="pipeline"))
            verdicts.append([*recorded, *ours])
        self._checked.inc(len(episode.steps))
        yield msgspec.structs.replace(episode, verdicts=verdicts)

    @staticmethod
    def _task_spec(episode: Episode) -> dict | None:
        if episode.started is None:
            return None
        try:
            spec = msgspec.json.decode(episode.started.task_spec)
        except msgspec.DecodeError:
            try:  # the stdlib also reads what msgspec refuses (NaN, Infinity)
                spec = json.loads(episode.started.task_spec)
            except ValueError:
                return None
        return spec if isinstance(spec, dict) else None


class VerifySteps(beam.PTransform):
    """Add the pipeline's verdicts to each step of each episode.

    Keeps the rollout-time ``step_verified`` verdicts (``source="rollout"``)
    and appends, with ``source="pipeline"``: :func:`check_token_consistency`
    on every step, and the domain's verifiers from
    ``rollout.verifiers.verify_step`` (imported lazily; a domain without a
    registered verifier keeps only the rollout-time verdicts).

    Args:
        use_domain_verifiers: run ``rollout.verifiers`` (False: generic check only).
    """

    def __init__(self, *, use_domain_verifiers: bool = True) -> None:
        super().__init__()
        self._use_domain = use_domain_verifiers

    def expand(self, episodes):
        return episodes | "Verify" >> beam.ParDo(_VerifyFn(self._use_domain)).with_output_types(Episode)
