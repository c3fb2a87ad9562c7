"""VerifySteps: re-run the domain's step verifiers over recorded steps, plus generic checks.

Each verifier votes once per step (:attr:`schemas.datasets.Verification.counted`):

* a rollout verdict (a ``step_verified`` event) counts;
* the pipeline's re-run of a verifier the rollout already judged the step with
  (same name) does not: it records agreement (``details`` start with
  ``agrees`` / ``disagrees``) and a disagreement is counted per step
  (:func:`step_disagreements`) and in ``pipeline/verifier_disagreements``;
* a pipeline verdict of a verifier the rollout did not record counts;
* data-quality checks (``pipeline.*``, e.g. :data:`TOKEN_CONSISTENCY`) never
  count: they describe the data, not the action, and never enter the reward.

``verification_score`` and ``steps_passed`` (and the shaped rewards) use the
counted verdicts only (:func:`pipelines.rewards.verification_score`).

Examples:
    >>> from schemas.events import EpisodeStarted, Step
    >>> ok = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
    ...           step_index=0, action_token_ids=[1, 2], behaviour_logprobs=[-0.5, -0.1])
    >>> check_token_consistency(ok).passed
    True
    >>> bad = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
    ...            step_index=0, action_token_ids=[1, 2], behaviour_logprobs=[0.5, float("nan")])
    >>> v = check_token_consistency(bad); v.passed, v.details, v.counted
    (False, 'logprobs > 0: 1, non-finite logprobs: 1', False)
    >>> rollout = Verification(verifier="math.check", passed=True, score=1.0)
    >>> rerun = Verification(verifier="math.check", passed=False, score=0.0, source="pipeline")
    >>> v = reconcile_verdict(rerun, {"math.check": rollout}); v.counted, v.details
    (False, 'disagrees with rollout (passed=True, score=1.0)')
    >>> step_disagreements([rollout, v])
    1
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import apache_beam as beam
import msgspec
import numpy as np
from apache_beam.metrics import Metrics

from pipelines.forked import ChainStage
from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.datasets import Verification
from schemas.events import EpisodeStarted, Step

__all__ = [
    "VerifySteps",
    "verify_steps",
    "task_spec",
    "StepVerdicts",
    "VerifiersUnavailable",
    "check_token_consistency",
    "reconcile_verdict",
    "step_disagreements",
    "TOKEN_CONSISTENCY",
    "DOMAIN_VERIFIERS_SKIPPED",
]

#: Name of the generic check every step gets.
TOKEN_CONSISTENCY = "pipeline.token_consistency"
#: Prefix of data-quality checks: recorded, never counted.
DATA_QUALITY_PREFIX = "pipeline."
#: Recorded on every step of an episode whose domain verifiers could not run (no readable task spec).
DOMAIN_VERIFIERS_SKIPPED = "pipeline.domain_verifiers_skipped"


class VerifiersUnavailable(RuntimeError):
    """``use_domain_verifiers=True`` but ``rollout.verifiers`` does not import."""


def _import_verifiers():
    try:
        from rollout.verifiers import VerifierNotFound, verify_step
    except ImportError as err:
        raise VerifiersUnavailable(
            f"VerifySteps(use_domain_verifiers=True) needs `rollout.verifiers`, which does not import ({err}); "
            "run from the trajpipe checkout (or install it: `make install`), or pass --no-domain-verifiers "
            "(use_domain_verifiers=False) to keep the rollout-time verdicts only"
        ) from err
    return verify_step, VerifierNotFound

_STEP_FIELDS = ("step_index", "action_text", "tool_name", "tool_args", "tool_result", "exit_status")
_get_step_fields = operator.attrgetter(*_STEP_FIELDS)


_TOKENS_OK = Verification(verifier=TOKEN_CONSISTENCY, passed=True, score=1.0, details="ok", source="pipeline",
                          counted=False)


def _agrees(a: Verification, b: Verification) -> bool:
    return a.passed == b.passed and abs(a.score - b.score) <= 1e-9


def reconcile_verdict(ours: Verification, rollout: dict[str, Verification]) -> Verification:
    """The pipeline's verdict as recorded: a vote, or an agreement check of the rollout's verdict.

    Args:
        ours: a pipeline verdict (``source="pipeline"``).
        rollout: the step's rollout verdicts by verifier name (the first of each name).

    Returns:
        ``ours`` unchanged (it counts) when the rollout has no verdict of that
        verifier and it is not a data-quality check; else a copy with
        ``counted=False`` whose ``details`` say whether it agrees.
    """
    if ours.verifier.startswith(DATA_QUALITY_PREFIX):
        return ours if not ours.counted else msgspec.structs.replace(ours, counted=False)
    theirs = rollout.get(ours.verifier)
    if theirs is None:
        return ours
    word = "agrees" if _agrees(ours, theirs) else "disagrees"
    details = f"{word} with rollout (passed={theirs.passed}, score={theirs.score})"
    if not _agrees(ours, theirs) and ours.details:
        details += f"; pipeline: {ours.details}"
    return msgspec.structs.replace(ours, counted=False, details=details[:500])


def step_disagreements(verdicts: list[Verification]) -> int:
    """Pipeline re-runs on one step whose verdict differs from the rollout's of the same verifier."""
    reruns = [v for v in verdicts if not v.counted and v.source == "pipeline"
              and not v.verifier.startswith(DATA_QUALITY_PREFIX)]
    if not reruns:  # the common case without domain verifiers: no dict built
        return 0
    rollout: dict[str, Verification] = {}
    for v in verdicts:
        if v.source == "rollout":
            rollout.setdefault(v.verifier, v)
    return sum(1 for v in reruns if v.verifier in rollout and not _agrees(v, rollout[v.verifier]))


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
                            details="no behaviour logprobs recorded", source="pipeline", counted=False)
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
                        details=", ".join(problems) or "ok", source="pipeline", counted=False)


#: float32 bit patterns read as int32: those of finite values <= 0 are exactly those <= this one (the bits of
#: the most negative finite float32, 0xFF7FFFFF; -inf, negative NaNs and positive values are all above it).
_FINITE_NONPOSITIVE_BITS = -8388609
_FLOAT32 = np.dtype(np.float32)


def _tokens_ok(steps: Sequence[Step]) -> list[bool]:
    """Per step, True where :func:`check_token_consistency` is certainly ``_TOKENS_OK``, found for all steps at once.

    The common case of every decoded step (float32 logprobs, one per action token, all finite and < 0)
    costs one reduction per episode instead of two per step: the steps' logprob bytes joined, read as
    int32, a maximum per step (``np.maximum.reduceat``) compared with :data:`_FINITE_NONPOSITIVE_BITS`.
    False is no verdict: the caller runs :func:`check_token_consistency` on that step (any other dtype,
    a count mismatch, no logprobs, a zero or a non-finite logprob).
    """
    ok = [False] * len(steps)
    arrays, starts, where, start = [], [], [], 0
    for i, s in enumerate(steps):
        lp = s.behaviour_logprobs
        n = len(lp)
        if n and n == len(s.action_token_ids) and isinstance(lp, np.ndarray) and lp.dtype == _FLOAT32 \
                and lp.flags.c_contiguous:
            arrays.append(lp)
            starts.append(start)
            where.append(i)
            start += n
    if arrays:
        bits = np.frombuffer(b"".join(arrays), dtype=np.int32)
        for i, top in zip(where, np.maximum.reduceat(bits, starts).tolist()):
            ok[i] = top <= _FINITE_NONPOSITIVE_BITS
    return ok


class StepVerdicts(NamedTuple):
    """:func:`verify_steps`' answer for one episode.

    Attributes:
        verdicts: per step, its recorded verdicts then the pipeline's.
        tokens_failed: steps whose :func:`check_token_consistency` failed.
        errors: steps on which a domain verifier raised (recorded as a ``<domain>.verifier_error`` verdict).
        agreements: pipeline re-runs that agree with the rollout's verdict of the same verifier.
        disagreements: ... that do not.
        no_verifier: the domain has no registered verifier (its verdicts stop at the first step that asks).
        spec_skipped: the domain verifiers did not run: no readable task spec (each step records why).
    """

    verdicts: list[list[Verification]]
    tokens_failed: int = 0
    errors: int = 0
    agreements: int = 0
    disagreements: int = 0
    no_verifier: bool = False
    spec_skipped: bool = False


def task_spec(started: EpisodeStarted | None) -> dict | None:
    """The episode's task spec as a dict, or None (no ``episode_started``, or its spec is not a JSON object)."""
    if started is None:
        return None
    try:
        spec = msgspec.json.decode(started.task_spec)
    except msgspec.DecodeError:
        try:  # the stdlib also reads what msgspec refuses (NaN, Infinity)
            spec = json.loads(started.task_spec)
        except ValueError:
            return None
    return spec if isinstance(spec, dict) else None


def verify_steps(domain: str, started: EpisodeStarted | None, steps: Sequence[Step],
                 recorded: Sequence[list[Verification]], *, verify_step: Callable[..., Any] | None = None,
                 not_found: type[Exception] = LookupError, tokens_ok: Sequence[bool] | None = None) -> StepVerdicts:
    """The verdicts of one episode's steps (:class:`VerifySteps`' rules), without an :class:`Episode` object.

    Args:
        domain: the episode's domain.
        started: its ``episode_started`` event (the task spec the domain verifiers read), or None.
        steps: its steps, in step order.
        recorded: per step, the rollout's verdicts (its ``step_verified`` events).
        verify_step: ``rollout.verifiers.verify_step`` (None: the generic check only).
        not_found: the exception ``verify_step`` raises for a domain without verifiers.
        tokens_ok: :func:`_tokens_ok` of ``steps``, when the caller found it for many episodes' steps at once.
    """
    spec = task_spec(started) if verify_step is not None else None  # specs can be whole documents
    domain_ok = spec is not None
    skipped = None
    if verify_step is not None and spec is None:  # recorded on each step and counted, never silent
        skipped = Verification(
            verifier=DOMAIN_VERIFIERS_SKIPPED, passed=False, score=0.0, source="pipeline", counted=False,
            details="domain verifiers not run: " + ("no episode_started event" if started is None
                                                    else "task_spec is not a JSON object"))
    verdicts = []
    tokens_failed = errors = disagreements = agreements = 0
    no_verifier = False
    for step, rec, ok in zip(steps, recorded, _tokens_ok(steps) if tokens_ok is None else tokens_ok):
        ours = [_TOKENS_OK if ok else check_token_consistency(step)]
        if not ours[0].passed:
            tokens_failed += 1
        if skipped is not None:
            ours.append(skipped)
        if domain_ok:
            fields = dict(zip(_STEP_FIELDS, _get_step_fields(step)))
            try:
                rerun = verify_step(domain, spec, fields)
            except not_found:
                domain_ok, no_verifier = False, True
            except (ValueError, TypeError, KeyError) as err:
                errors += 1
                # A verifier that crashed judged nothing: recorded, no vote.
                ours.append(Verification(verifier=f"{domain}.verifier_error", passed=False, score=0.0,
                                         details=str(err)[:200], source="pipeline", counted=False))
            else:
                rollout = {v.verifier: v for v in reversed(rec)}  # the first verdict of each name
                for v in rerun:
                    got = Verification(verifier=v.verifier, passed=v.passed, score=v.score, details=v.details,
                                       source="pipeline")
                    if v.verifier in rollout or v.verifier.startswith(DATA_QUALITY_PREFIX):
                        got = reconcile_verdict(got, rollout)
                        if v.verifier in rollout:
                            if _agrees(got, rollout[v.verifier]):
                                agreements += 1
                            else:
                                disagreements += 1
                    ours.append(got)
        verdicts.append([*rec, *ours])
    return StepVerdicts(verdicts=verdicts, tokens_failed=tokens_failed, errors=errors, agreements=agreements,
                        disagreements=disagreements, no_verifier=no_verifier, spec_skipped=skipped is not None)


class _VerifyFn(beam.DoFn):
    def __init__(self, use_domain_verifiers: bool) -> None:
        self._use_domain = use_domain_verifiers
        self._verify_step = None
        self._not_found: type[Exception] = LookupError
        self._checked = Metrics.counter(METRICS_NAMESPACE, "steps_verified")
        self._failed = Metrics.counter(METRICS_NAMESPACE, "steps_failed_token_consistency")
        self._no_verifier = Metrics.counter(METRICS_NAMESPACE, "episodes_without_domain_verifier")
        self._no_spec = Metrics.counter(METRICS_NAMESPACE, "episodes_domain_verifiers_skipped")
        self._errors = Metrics.counter(METRICS_NAMESPACE, "verifier_errors")
        self._disagreements = Metrics.counter(METRICS_NAMESPACE, "verifier_disagreements")
        self._agreements = Metrics.counter(METRICS_NAMESPACE, "verifier_agreements")

    def setup(self) -> None:
        if self._use_domain:
            self._verify_step, self._not_found = _import_verifiers()

    def process(self, episode: Episode) -> Iterator[Episode]:
        out = verify_steps(episode.domain, episode.started, episode.steps, episode.verdicts,
                           verify_step=self._verify_step, not_found=self._not_found)
        if out.spec_skipped:
            self._no_spec.inc()
        if out.tokens_failed:
            self._failed.inc(out.tokens_failed)
        if out.no_verifier:
            self._no_verifier.inc()
        if out.errors:
            self._errors.inc(out.errors)
        self._checked.inc(len(episode.steps))
        if out.disagreements:
            self._disagreements.inc(out.disagreements)
        if out.agreements:
            self._agreements.inc(out.agreements)
        yield msgspec.structs.replace(episode, verdicts=out.verdicts)


class VerifySteps(beam.PTransform):
    """Add the pipeline's verdicts to each step of each episode.

    Keeps the rollout-time ``step_verified`` verdicts (``source="rollout"``,
    counted) and appends, with ``source="pipeline"``: :func:`check_token_consistency`
    on every step (never counted), and the domain's verifiers from
    ``rollout.verifiers.verify_step`` — a vote where the rollout has no verdict
    of that verifier, an agreement check (not counted) where it has
    (:func:`reconcile_verdict`; see the module docstring). A domain without a
    registered verifier keeps only the rollout-time verdicts (counted in
    ``pipeline/episodes_without_domain_verifier``). An episode whose task spec
    cannot be read (no ``episode_started``, or not a JSON object) gets a
    :data:`DOMAIN_VERIFIERS_SKIPPED` verdict (never counted) on every step and
    counts in ``pipeline/episodes_domain_verifiers_skipped``: the verifiers did
    not run, and the data says so.

    Args:
        use_domain_verifiers: run ``rollout.verifiers`` (False: generic check only).

    Raises:
        VerifiersUnavailable: ``use_domain_verifiers`` is set and
            ``rollout.verifiers`` does not import (checked at construction).
    """

    def __init__(self, *, use_domain_verifiers: bool = True) -> None:
        super().__init__()
        self._use_domain = use_domain_verifiers
        if use_domain_verifiers:
            _import_verifiers()  # fail in the driver, with the fix, not in a worker

    def stage(self, name: str = "verify") -> ChainStage:
        """This transform as a stage of a :class:`pipelines.forked.ForkedChain`."""
        return ChainStage(name, _VerifyFn(self._use_domain))

    def expand(self, episodes):
        return episodes | "Verify" >> beam.ParDo(self.stage().fn).with_output_types(Episode)
