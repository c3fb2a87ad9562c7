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


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        app()
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
