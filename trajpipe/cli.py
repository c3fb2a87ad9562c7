"""The ``trajpipe`` command line: one sub-command per job, each a thin wrapper.

Every command that produces or moves data prints, as its last line, one JSON
object of counts.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streams.config import ConfigError
from trajpipe.settings import load_settings

__all__ = ["app", "main"]

app = typer.Typer(help="Event-sourced trajectory data pipeline for RL post-training.", no_args_is_help=True)
broker_app = typer.Typer(help="Embedded single-node broker for local work and tests.", no_args_is_help=True)
app.add_typer(broker_app, name="broker")

ConfigOpt = Annotated[Optional[str], typer.Option("--config", help="YAML/TOML settings file (or $TRAJPIPE_CONFIG)")]
BootstrapOpt = Annotated[Optional[str], typer.Option("--bootstrap", help="Kafka bootstrap servers host:port[,host:port]")]


def _print_counts(counts: dict) -> None:
    """The last line of every data command: one JSON object of counts."""
    sys.stdout.flush()
    print(json.dumps(counts), flush=True)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@broker_app.command("start")
def broker_start(
    engine: Annotated[str, typer.Option(help="kafka (Apache Kafka, KRaft; needs Java 17) or tansu (no Java)")] = "kafka",
    port: Annotated[int, typer.Option(help="listener port")] = 9092,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="broker data/log directory")] = None,
    config: ConfigOpt = None,
) -> None:
    """Start the embedded broker in the background and print its bootstrap address."""
    from streams.broker import BrokerError, start_broker

    settings = load_settings(config)
    try:
        info = start_broker(engine=engine, port=port, data_dir=data_dir or Path(settings.broker_dir))
    except BrokerError as err:
        _fail(str(err))
    typer.echo(f"{info.engine} broker up (pid {info.pid}), data in {info.data_dir}", err=True)
    print(info.bootstrap, flush=True)


@broker_app.command("stop")
def broker_stop(
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Stop the broker this data dir's pid file names (and nothing else)."""
    from streams.broker import BrokerError, stop_broker

    settings = load_settings(config)
    try:
        stopped = stop_broker(data_dir or Path(settings.broker_dir))
    except BrokerError as err:
        _fail(str(err))
    typer.echo("stopped" if stopped else "not running")


@broker_app.command("status")
def broker_status(
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Say whether the broker of this data dir is running, and where."""
    from streams.broker import broker_status as status

    settings = load_settings(config)
    info = status(data_dir or Path(settings.broker_dir))
    if info is None:
        typer.echo("not running")
        raise typer.Exit(1)
    typer.echo(f"running: {info.engine} pid {info.pid} at {info.bootstrap} (data {info.data_dir})")


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"), transient=False, console=_stderr_console(),
    )


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("topics")
def topics_create(
    bootstrap: BootstrapOpt = None,
    partitions: Annotated[Optional[int], typer.Option(help="partitions of the events topic")] = None,
    config: ConfigOpt = None,
) -> None:
    """Create the project's topics (events, dead letters, control); idempotent."""
    from streams.admin import ensure_topics

    settings = load_settings(config, bootstrap=bootstrap, partitions=partitions)
    created = ensure_topics(settings.connection(client_id="trajpipe-admin"), settings.topic_names())
    _print_counts({"created": len(created)})


@app.command("synth")
def synth(
    episodes: Annotated[int, typer.Option(help="episodes to emit")] = 100,
    domains: Annotated[str, typer.Option(help="comma-separated domains")] = "code,math,docqa,tools",
    seed: Annotated[int, typer.Option(help="RNG seed (same seed, same events)")] = 0,
    bootstrap: BootstrapOpt = None,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir", help="where to spool if Kafka is down")] = None,
    config: ConfigOpt = None,
) -> None:
    """Emit schema-valid synthetic episodes to the events topic."""
    import time

    from streams.admin import ensure_topics
    from streams.producer import EventProducer
    from streams.synth import generate_episodes

    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-synth")
    topics = settings.topic_names()
    domain_list = [d.strip() for d in domains.split(",") if d.strip()]
    if not domain_list:
        _fail("`--domains` is empty; name at least one domain, e.g. --domains code,math")
    ensure_topics(conn, topics)
    n_events = 0
    t0 = time.perf_counter()
    with EventProducer(conn, topics.events, spool_dir=spool_dir or Path(settings.spool_dir)) as producer, _progress() as bar:
        task = bar.add_task("synth episodes", total=episodes, rate="")
        for i, episode in enumerate(generate_episodes(episodes, domains=domain_list, seed=seed)):
            for event in episode:
                producer.emit(event)
            n_events += len(episode)
            if i % 50 == 0 or i == episodes - 1:
                bar.update(task, completed=i + 1, rate=f"{n_events / (time.perf_counter() - t0):,.0f} events/s")
        stats = producer.flush()
    if stats.spooled:
        typer.echo(f"Kafka unreachable: {stats.spooled} events kept in the spool; they replay on the next run", err=True)
    _print_counts({"episodes": episodes, "events": n_events})


@app.command("archive")
def archive(
    out: Annotated[Path, typer.Option(help="archive directory")],
    until_end: Annotated[bool, typer.Option("--until-end", help="stop at the end offsets seen at start")] = False,
    bootstrap: BootstrapOpt = None,
    commit_every: Annotated[int, typer.Option(help="messages per commit")] = 50_000,
    poll_interval: Annotated[float, typer.Option(help="seconds between drains when following the topic")] = 1.0,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Drain the events topic into the append-only Parquet event archive."""
    import signal
    import threading

    from streams.admin import ensure_topics
    from streams.archive import ArchiveCounts, Archiver
    from streams.deadletter import send_dead_letter
    from streams.producer import EventProducer

    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-archiver")
    topics = settings.topic_names()
    ensure_topics(conn, topics)
    stop = threading.Event()
    if not until_end:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    console = _stderr_console()

    def progress(c: ArchiveCounts) -> None:
        console.print(f"commit {c.commits}: {c.events:,} events archived, {c.dead_letters} dead letters")

    with EventProducer(conn, topics.dead_letters, spool_dir=spool_dir or Path(settings.spool_dir)) as dlq:
        archiver = Archiver(
            out, conn=conn, topic=topics.events,
            dead_letter=lambda rec, err: send_dead_letter(dlq, topics.dead_letters, rec, err, detected_by="archiver"),
            flush_dead_letters=dlq.flush, commit_every=commit_every, progress=progress,
        )
        counts = archiver.run(until_end=until_end, stop=stop, poll_interval_s=poll_interval)
    _print_counts({"events": counts.events, "dead_letters": counts.dead_letters, "commits": counts.commits})


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        app()
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
