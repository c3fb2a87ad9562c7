"""Rollout environments: one module per domain, plus a registry to make them by name.

Built-in domains: ``code``, ``math``, ``docqa``, ``tools`` (see each module's
docstring for its action format and difficulty levels). Register more with
:func:`register_domain`; their step verifiers go in :mod:`rollout.verifiers`.

Examples:
    >>> [t.task_id for t in generate_tasks("math", 2, seed=1, difficulty=0)] == \\
    ...     [t.task_id for t in generate_tasks("math", 2, seed=1, difficulty=0)]
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rollout.envs import code_env, docqa_env, math_env, tools_env
from rollout.envs.base import Environment, EnvironmentFailure, Outcome, StepOutcome, Task

__all__ = [
    "Task",
    "StepOutcome",
    "Outcome",
    "Environment",
    "EnvironmentFailure",
    "DomainSpec",
    "register_domain",
    "domains",
    "max_difficulty",
    "make_env",
    "generate_tasks",
]


@dataclass(frozen=True)
class DomainSpec:
    """How to build one domain's environment and tasks.

    Attributes:
        name: domain name.
        make_env: ``make_env(**kwargs) -> Environment``.
        generate_task: ``generate_task(seed, index, difficulty) -> Task``.
        max_difficulty: highest difficulty level (levels are 0..max_difficulty).
    """

    name: str
    make_env: Callable[..., Environment]
    generate_task: Callable[[int, int, int], Task]
    max_difficulty: int


_DOMAINS: dict[str, DomainSpec] = {}


def register_domain(spec: DomainSpec, *, replace: bool = False) -> None:
    """Add a domain to the registry.

    Raises:
        ValueError: the name is taken and ``replace`` is False.
    """
    if spec.name in _DOMAINS and not replace:
        raise ValueError(f"domain {spec.name!r} is already registered; pass replace=True to override it")
    _DOMAINS[spec.name] = spec


for _spec in (
    DomainSpec("code", code_env.CodeEnv, code_env.generate_task, code_env.MAX_DIFFICULTY),
    DomainSpec("math", math_env.MathEnv, math_env.generate_task, math_env.MAX_DIFFICULTY),
    DomainSpec("docqa", docqa_env.DocQAEnv, docqa_env.generate_task, docqa_env.MAX_DIFFICULTY),
    DomainSpec("tools", tools_env.ToolsEnv, tools_env.generate_task, tools_env.MAX_DIFFICULTY),
):
    register_domain(_spec)


def _get(domain: str) -> DomainSpec:
    try:
        return _DOMAINS[domain]
    except KeyError:
        raise ValueError(f"unknown domain {domain!r}; registered: {domains()}") from None


def domains() -> list[str]:
    """Registered domain names, sorted."""
    return sorted(_DOMAINS)


def max_difficulty(domain: str) -> int:
    """Highest difficulty level of a domain."""
    return _get(domain).max_difficulty


def make_env(domain: str, **kwargs: Any) -> Environment:
    """A new environment of ``domain`` (kwargs go to its constructor, e.g. ``sandbox_factory``)."""
    return _get(domain).make_env(**kwargs)


def generate_tasks(domain: str, n: int, seed: int, difficulty: int = 0, *, start: int = 0) -> list[Task]:
    """``n`` tasks of ``domain`` at ``difficulty``; the same arguments give the same tasks.

    Args:
        domain: a registered domain.
        n: number of tasks (>= 0).
        seed: generator seed.
        difficulty: level in ``0..max_difficulty(domain)``.
        start: index of the first task (tasks ``start..start+n-1`` of this seed).

    Raises:
        ValueError: unknown domain, negative ``n`` or a difficulty out of range.
    """
    spec = _get(domain)
    if n < 0:
        raise ValueError(f"`n` must be >= 0, got {n}")
    if not 0 <= difficulty <= spec.max_difficulty:
        raise ValueError(f"`difficulty` for {domain} must be in 0..{spec.max_difficulty}, got {difficulty}")
    return [spec.generate_task(seed, start + i, difficulty) for i in range(n)]
