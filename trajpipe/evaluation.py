"""``trajpipe eval``: wires settings, Kafka and signals to :mod:`rollout.evaluate` (the command's body).

Kept out of ``trajpipe/cli.py`` (which only declares the flags) so the command stays one call there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path

import typer

from trajpipe.settings import load_settings
from trajpipe.shutdown import close_policy, flush_and_report

__all__ = ["run_eval"]


def _ints(flag: str, text: str) -> tuple[int, ...]:
    from trajpipe.cli import _fail

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        _fail(f"`{flag}` must be comma-separated integers, e.g. 0,1; got {text!r}")
    if not values:
        _fail(f"`{flag}` is empty; give at least one level, e.g. 0")
    return values


def run_eval(*, bootstrap: str | None, config: str | None, policy_version: str | None, model: Path | None,
             policy: str, domains: str, levels: str, tasks_per_level: int, max_steps: int, max_tokens: int,
             temperature: float, top_p: float, seed: int, concurrency: int, follow: bool,
             group: str | None = None, lineage: str | None = None) -> None:
    """Run ``trajpipe eval`` (see the command's help); prints one JSON line per evaluated version."""
    from trajpipe.cli import _check_model_dir, _fail, _print_counts, _progress, _published_policy

    if (policy_version is None) == (model is None):
        _fail("give exactly one of `--policy-version V|latest` (a version published on the control topic) "
              "and `--model DIR` (a model directory)")
    if follow and model is not None:
        _fail("`--follow` evaluates versions published on the control topic; use it with `--policy-version latest`, "
              "not `--model`")
    if group is not None and not follow:
        _fail("`--group` records what `--follow` has evaluated (so a restart evaluates the versions published "
              "meanwhile); use it with `--follow`")
    if group is not None and not group.strip():
        _fail("`--group` is empty; give a consumer group id, e.g. trajpipe-eval-<run>")
    if policy not in ("hf", "vllm"):
        _fail(f"`--policy` {policy!r} is not one of hf, vllm")
    if policy_version is not None and policy_version != "latest" and not policy_version.isdigit():
        _fail(f"`--policy-version` must be a version number or `latest`, got {policy_version!r}")
    from rollout.envs import domains as known_domains
    from rollout.heldout import EVAL_POOL

    domain_list = tuple(d.strip() for d in domains.split(",") if d.strip())
    if not domain_list:
        _fail("`--domains` is empty; name at least one domain, e.g. --domains math,code")
    unknown = sorted(set(domain_list) - set(known_domains()))
    if unknown:
        _fail(f"`--domains` names unknown domains {', '.join(unknown)}; known: {', '.join(known_domains())}")
    if not 1 <= tasks_per_level <= EVAL_POOL:
        _fail(f"`--tasks-per-level` must be in 1..{EVAL_POOL} (the held-out pool per domain and level), "
              f"got {tasks_per_level}")
    for flag, value in (("--max-steps", max_steps), ("--max-tokens", max_tokens), ("--concurrency", concurrency)):
        if value < 1:
            _fail(f"`{flag}` must be >= 1, got {value}")
    if model is not None:
        _check_model_dir(model)

    from rollout.evaluate import (
        ControlReader,
        EvalConfig,
        eval_tasks,
        find_finished_evaluation,
        follow_evaluations,
        load_policy,
        resolve_version,
        run_evaluation,
    )
    from streams.admin import ensure_topics
    from streams.errors import kafka_access_errors
    from streams.producer import EventProducer

    cfg = EvalConfig(domains=domain_list, levels=_ints("--levels", levels), tasks_per_level=tasks_per_level,
                     max_steps=max_steps, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                     concurrency=concurrency, producer_id=f"eval@{socket.gethostname()}:{os.getpid()}")
    eval_tasks(cfg)  # a level a domain lacks is an error now, before the model loads
    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-eval")
    topics = settings.topic_names()
    ensure_topics(conn, topics)  # an unreachable broker is one error line here
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo(f"eval: {json.dumps({'domains': cfg.domains, 'levels': cfg.levels, 'tasks_per_level': tasks_per_level, 'policy': policy, 'policy_version': policy_version, 'model': str(model) if model else None, 'temperature': temperature, 'max_steps': max_steps, 'max_tokens': max_tokens, 'follow': follow, 'group': group, 'lineage': lineage, 'topic': topics.events})}", err=True)

    # Its own spool directory: a rollout worker on the same machine spools the same topic to settings.spool_dir.
    spool = Path(settings.spool_dir) / "eval"
    with kafka_access_errors(conn, what=f"read topic {topics.control!r} and write {topics.events!r}"), \
            ControlReader(conn, topics.control, group_id=group, lineage=lineage) as reader, \
            EventProducer(conn, topics.events, spool_dir=spool) as producer, _progress() as bar:
        def progress_for(version: int):
            task = bar.add_task(f"eval v{version}", total=len(eval_tasks(cfg)), rate="")

            def on_episode(_result, c) -> None:
                bar.update(task, completed=c.episodes, rate=f"passed {c.passed}/{c.episodes}")
            return on_episode

        def report(result) -> None:
            _print_counts(result.summary())

        if follow:
            typer.echo(f"eval: following {topics.control}; Ctrl-C or SIGTERM stops", err=True)
            def already_evaluated(event, published_ms: int) -> str | None:
                return find_finished_evaluation(conn, topics.events, event, tasks=eval_tasks(cfg),
                                                since_ms=published_ms)

            follow_evaluations(reader, kind=policy, config=cfg, emit=producer.emit, flush=producer.flush, stop=stop,
                               on_result=report, progress_for=progress_for, already_evaluated=already_evaluated)
            typer.echo("eval: stopped", err=True)
            return
        if model is not None:
            published = _published_policy(model)
            location, version, lineage = str(model), published.get("version", 0), published.get("lineage", "")
        else:
            event = resolve_version(reader.read_to_end(), policy_version, topic=topics.control)
            location, version, lineage = event.location, event.version, event.lineage
            if not Path(location).is_dir():
                _fail(f"policy version {version} is published at {location}, which is not a directory here; "
                      "evaluate on a machine that sees the policy store")
        actor = load_policy(policy, location, version=version, lineage=lineage, config=cfg)
        try:
            result = run_evaluation(actor, emit=producer.emit, config=cfg, stop=stop, on_episode=progress_for(version))
        finally:
            close_policy(actor)
        flush_and_report(producer, stop=stop, aborted=result.aborted, prefix="eval: ")
    report(result)
