"""The ``trajpipe`` command line: one sub-command per job, each a thin wrapper.

Every command that produces or moves data prints, as its last line, one JSON
object of counts.

Errors (:class:`_RootGroup`): a wrong flag value, a missing or wrong path or a
bad config file prints one line ``error: <what is wrong and how to fix it>``
on stderr and exits with status 2, with no traceback. Usage errors found by
the parser (unknown option, value of the wrong type, missing option) and the
project's typed errors (:data:`USER_ERRORS`, e.g. ``streams.config.ConfigError``,
``trainer.config.ConfigError``, ``trainer.data.DataError``) are reported that
way. Any other exception is a bug or an environment failure: one line
``error: <Type>: <message> (run with --debug for the traceback)`` and exit
status 1. ``trajpipe --debug <command>`` (or ``TRAJPIPE_DEBUG=1``) also prints
the traceback, before the ``error:`` line.

Tracebacks that kafka-python and Beam log for errors handled on the way (a socket
closed under kafka-python's reader, a DoFn ``setup`` that raised before a retry) are
logged as one line too, unless ``--debug``; ``kill -USR1 <pid>`` prints every thread's
stack of a running command (a hang's diagnosis) and the command goes on.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from typer.core import TyperGroup

try:
    from typer._click import exceptions as _click_errors  # typer >= 0.22 parses with its own copy of click
except ImportError:  # older typer: click itself
    from click import exceptions as _click_errors

from trajpipe.settings import load_settings
from trajpipe.shutdown import close_policy, flush_and_report

__all__ = ["app", "main", "report_error", "USER_ERRORS", "CommandLineError", "ModelDirError"]

#: ``(module, class name)`` of the exceptions that mean "the input is wrong" (exit status 2, one line, no
#: traceback): their messages name the flag, file or setting and the fix. Matched along the exception's MRO by
#: name, so reporting an error never imports torch or Beam.
USER_ERRORS: frozenset[tuple[str, str]] = frozenset({
    ("streams.config", "ConfigError"),  # settings, flags, config files (also RunnerConfigError, TopicMismatchError)
    ("trainer.config", "ConfigError"),  # training recipe and flags
    ("trainer.data", "DataError"),  # a dataset that cannot be trained on
    ("pipelines.recipes", "RecipeError"),
    ("pipelines.job_args", "JobError"),  # the trajectory jobs' options (pipelines/trajectory_job.py)
    ("pipelines.commit", "CommitError"),  # CommitConflict (a run that lost the race for its commit: rerun), a
    # dataset's commit log unreadable or differing from legacy manifest files
    ("schemas.commit_log", "CommitLogError"),
    ("pipelines.verify", "VerifiersUnavailable"),
    ("pipelines.runners", "RunnerNotInstalledError"),
    ("streams.broker", "BrokerError"),
    ("streams.archive", "ArchiveError"),
    ("streams.producer", "SpoolError"),
    ("rollout.sandbox", "SandboxError"),
    ("rollout.context", "ChatTemplateError"),
    ("rollout.evaluate", "EvalError"),
    ("trajpipe.cli", "CommandLineError"),  # and ModelDirError
    ("trajpipe.analytics", "AnalyticsError"),  # query, catalog, report
    ("schemas.storage", "StorageError"),  # a location that cannot be used (e.g. s3:// where only local paths work)
    ("schemas.delta", "DeltaCommitError"),  # a Delta table at an output path that is not trajpipe's layout
})
#: Built-in exceptions that, escaping a command, come from a path given on the command line.
_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


class CommandLineError(ValueError):
    """A flag value, path or file given on the command line is wrong; the message names it and the fix."""


class ModelDirError(CommandLineError):
    """``--model`` is not a loadable Hugging Face model directory."""


def _is_user_error(err: BaseException) -> bool:
    return isinstance(err, _PATH_ERRORS) or any(
        (k.__module__, k.__qualname__) in USER_ERRORS for k in type(err).__mro__)


def _debug_requested(argv: Sequence[str]) -> bool:
    """``--debug`` among the global options (before the command name), or ``TRAJPIPE_DEBUG`` set to 1/true/yes."""
    if os.environ.get("TRAJPIPE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    for arg in argv:
        if arg == "--debug":
            return True
        if not arg.startswith("-"):
            return False
    return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _command_path(ctx: Any) -> str:
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["trajpipe", *reversed(names)])


def report_error(err: BaseException, *, debug: bool) -> int:
    """Print ``err`` as one ``error:`` line on stderr (after its traceback when ``debug``); return the exit status.

    Args:
        err: the exception that ended the command.
        debug: also print the traceback (``--debug`` / ``TRAJPIPE_DEBUG=1``).

    Returns:
        2 for usage errors and :data:`USER_ERRORS` (wrong input), 1 for anything else.
    """
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    if isinstance(err, _click_errors.UsageError):
        line, code = f"{_one_line(err.format_message())} (see `{_command_path(err.ctx)} --help`)", 2
    elif isinstance(err, _click_errors.ClickException):
        line, code = _one_line(err.format_message()), err.exit_code
    elif _is_user_error(err):
        line, code = _one_line(str(err)) or type(err).__name__, 2
    else:
        hint = "" if debug else " (run with --debug for the traceback)"
        line, code = f"{type(err).__name__}: {_one_line(str(err))}{hint}", 1
    sys.stdout.flush()
    print(f"error: {line}", file=sys.stderr, flush=True)
    return code


class _RootGroup(TyperGroup):
    """The ``trajpipe`` group: every error that ends a command becomes one line (see the module docstring)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except _click_errors.NoArgsIsHelpError as err:  # `trajpipe` or `trajpipe model` alone: the help
            err.show()
            code = err.exit_code
        except typer.Abort:
            print("error: aborted", file=sys.stderr, flush=True)
            code = 130
        except Exception as err:  # noqa: BLE001 - the one place every command's error is reported
            code = report_error(err, debug=_debug_requested(argv))
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=_RootGroup, help="Event-sourced trajectory data pipeline for RL post-training.",
                  no_args_is_help=True)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="print the traceback of an error (also TRAJPIPE_DEBUG=1)")
                     ] = False,
) -> None:
    """Event-sourced trajectory data pipeline for RL post-training."""
    # `--debug` is read from argv by _RootGroup.main, which reports errors after this context is gone.
broker_app = typer.Typer(help="Embedded single-node broker for local work and tests.", no_args_is_help=True)
app.add_typer(broker_app, name="broker")
pipeline_app = typer.Typer(help="Beam jobs: event log -> versioned Parquet datasets.", no_args_is_help=True)
app.add_typer(pipeline_app, name="pipeline")
model_app = typer.Typer(help="Models for rollouts and training.", no_args_is_help=True)
app.add_typer(model_app, name="model")
audit_app = typer.Typer(help="Check datasets against the policies that produced them.", no_args_is_help=True)
app.add_typer(audit_app, name="audit")

ConfigOpt = Annotated[Optional[str], typer.Option("--config", help="YAML/TOML settings file (or $TRAJPIPE_CONFIG)")]
BootstrapOpt = Annotated[Optional[str], typer.Option("--bootstrap", help="Kafka bootstrap servers host:port[,host:port]")]


def _print_counts(counts: dict) -> None:
    """The last line of every data command: one JSON object of counts."""
    sys.stdout.flush()
    print(json.dumps(counts), flush=True)


def _fail(message: str) -> NoReturn:
    """End the command: ``message`` (what is wrong, naming the flag, and the fix) becomes its ``error:`` line."""
    raise CommandLineError(message)


def _check_dir(flag: str, path: Path | None, *, must_exist: bool = False) -> None:
    """``path`` (given by ``flag``) must be a directory, or not exist yet unless ``must_exist``."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        _fail(f"`{flag}` {path} is a file, not a directory; give a directory")
    if must_exist and not path.exists():
        _fail(f"`{flag}` {path} does not exist; give an existing directory")


def _local_location(value: str | Path) -> Path:
    """Parser of the flags that name a dataset, archive or output location: a local path or file:// URI.

    Any other scheme is refused at parse time, before any work: pathlib would turn ``gs://b/x`` into
    the local directory ``gs:/b/x`` (issue 14: silent loss on a remote worker).
    """
    from schemas.storage import StorageError, local_path

    try:
        return local_path(value, flag=None)
    except StorageError as err:  # click names the flag: "Invalid value for '--out': ..."
        raise typer.BadParameter(str(err)) from err


def _dataset_location(value: str | Path) -> Path | str:
    """Parser of the flags that name a dataset to read: a local path, a file:// URI or ``s3://BUCKET/PREFIX``.

    An ``s3://`` URI stays a string (``Path`` would make ``s3:/b``); other schemes are refused at parse time.
    """
    from schemas.storage import StorageError, resolve, scheme_of

    if scheme_of(value) != "s3":
        return _local_location(value)
    try:
        resolve(value)  # a bucket is named, the AWS_* settings parse
    except StorageError as err:
        raise typer.BadParameter(str(err)) from err
    return os.fspath(value).rstrip("/")


def _check_remote_out(flag: str, uri: str) -> None:
    """An output location on an object store: its bucket must exist and be readable (one line otherwise, exit 2)."""
    from schemas import locations as loc
    from schemas.storage import _split_s3

    bucket, _ = _split_s3(uri)
    try:
        found = loc.exists(f"s3://{bucket}")
    except OSError as err:
        _fail(f"`{flag}` {uri} cannot be read: {' '.join(str(err).split())}; check the bucket and the AWS_* "
              "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    if not found:
        _fail(f"`{flag}` {uri}: bucket {bucket!r} does not exist; create it first (e.g. `s3.bucket.create -name "
              f"{bucket}` in SeaweedFS' `weed shell`, `aws s3 mb s3://{bucket}`)")


def _check_remote_archive(uri: str) -> None:
    """``--archive`` on an object store must be readable and hold an event archive (one line otherwise, exit 2)."""
    from streams.archive import is_archive

    try:
        found = is_archive(uri)
    except OSError as err:
        _fail(f"`--archive` {uri} cannot be read: {' '.join(str(err).split())}; check the bucket and the AWS_* "
              "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    if not found:
        _fail(f"`--archive` {uri} holds no event archive (no _archive.json, no _commit_log/); write one with "
              f"`trajpipe archive --out {uri}`")


def _check_remote_data(uri: str) -> None:
    """``--data`` on an object store must be readable and hold a dataset's commit log (one line otherwise, exit 2)."""
    from schemas.manifests import list_dataset_versions

    try:
        found = bool(list_dataset_versions(uri))
    except OSError as err:
        _fail(f"`--data` {uri} cannot be read: {' '.join(str(err).split())}; check the bucket and the AWS_* "
              "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    if not found:
        _fail(f"`--data` {uri} holds no dataset (no _commit_log/); write one with `trajpipe pipeline run --out {uri}`")


def _check_at_least(flag: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        _fail(f"`{flag}` must be >= {low:g}, got {value:g}")


def _check_model_dir(path: Path, *, flag: str = "--model") -> None:
    """``path`` must be a Hugging Face model directory transformers can load (before any process group starts).

    Raises:
        ModelDirError: it does not exist, is not a directory, has no or an unloadable config.json, or no weights.
    """
    make = f"make one with `trajpipe model init-tiny --out {path}`"
    if not path.exists():
        raise ModelDirError(f"`{flag}` {path} does not exist; give a local Hugging Face model directory ({make})")
    if not path.is_dir():
        raise ModelDirError(f"`{flag}` {path} is a file; give a Hugging Face model directory, not a file in it")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"`{flag}` {path} is not a model directory (no config.json); {make}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(f"`{flag}` {path}/config.json is not JSON ({err}); {make}") from err
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelDirError(f"`{flag}` {path}/config.json has no `model_type`, so transformers cannot load it; {make}")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any((path / w).is_file() for w in weights):
        raise ModelDirError(f"`{flag}` {path} has no weights ({', '.join(weights[::2])}); {make}")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as err:
        raise ModelDirError(f"`{flag}` {path}: transformers cannot load its config.json ({_one_line(str(err))})"
                            ) from err


@broker_app.command("start")
def broker_start(
    engine: Annotated[str, typer.Option(help="kafka (Apache Kafka, KRaft; needs Java 17) or tansu (no Java)")] = "kafka",
    port: Annotated[int, typer.Option(help="listener port")] = 9092,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="broker data/log directory")] = None,
    auth: Annotated[str, typer.Option(
        help="none, or sasl-ssl: TLS + SCRAM-SHA-512 users + ACLs (docs/security.md)")] = "none",
    config: ConfigOpt = None,
) -> None:
    """Start the embedded broker in the background and print its bootstrap address."""
    _check_dir("--data-dir", data_dir)
    from streams.broker import BrokerError, start_broker

    settings = load_settings(config)
    try:
        info = start_broker(engine=engine, port=port, data_dir=data_dir or Path(settings.broker_dir), auth=auth)
    except BrokerError as err:
        _fail(str(err))
    typer.echo(f"{info.engine} broker up (pid {info.pid}), data in {info.data_dir}", err=True)
    if info.ca_file is not None:
        typer.echo(f"SASL_SSL, SCRAM-SHA-512, ACLs on: clients need kafka.ssl_cafile={info.ca_file} and a user "
                   f"(`trajpipe broker user add NAME --password-file F --data-dir {info.data_dir}`, then "
                   f"`trajpipe broker acl add --user NAME --data-dir {info.data_dir}`)", err=True)
    print(info.bootstrap, flush=True)


broker_user_app = typer.Typer(help="SCRAM users of an `--auth sasl-ssl` embedded broker.", no_args_is_help=True)
broker_app.add_typer(broker_user_app, name="user")
broker_acl_app = typer.Typer(help="ACLs of an `--auth sasl-ssl` embedded broker.", no_args_is_help=True)
broker_app.add_typer(broker_acl_app, name="acl")


@broker_user_app.command("add")
def broker_user_add(
    name: Annotated[str, typer.Argument(help="user name")],
    password_file: Annotated[Path, typer.Option("--password-file", help="file whose first line is the password")],
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Create a SCRAM-SHA-512 user (or set its password), as the broker's admin."""
    from streams.admin import upsert_scram_user
    from streams.broker import BrokerError, admin_connection

    settings = load_settings(config)
    try:
        password = password_file.read_text().splitlines()[0]
    except (OSError, IndexError) as err:
        _fail(f"`--password-file` {password_file} cannot be read or is empty ({err})")
    try:
        conn = admin_connection(data_dir or Path(settings.broker_dir))
    except BrokerError as err:
        _fail(str(err))
    upsert_scram_user(conn, name, password)
    typer.echo(f"user {name!r} set (SCRAM-SHA-512); it may do nothing until `trajpipe broker acl add --user {name}`",
               err=True)


@broker_acl_app.command("add")
def broker_acl_add(
    user: Annotated[str, typer.Option(help="user name (principal User:NAME)")],
    topic_prefix: Annotated[str, typer.Option("--topic-prefix", help="topics whose name starts with this")] = "trajpipe.",
    group_prefix: Annotated[str, typer.Option("--group-prefix", help="consumer groups whose name starts with this")] = "trajpipe",
    operations: Annotated[str, typer.Option(help="comma-separated: read, write, describe, create")] = "read,write,describe,create",
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Allow USER the operations on topics (and groups) with the given name prefixes."""
    from streams.admin import grant_acls
    from streams.broker import BrokerError, admin_connection

    settings = load_settings(config)
    try:
        conn = admin_connection(data_dir or Path(settings.broker_dir))
    except BrokerError as err:
        _fail(str(err))
    ops = tuple(o.strip().lower() for o in operations.split(",") if o.strip())
    n = grant_acls(conn, user, topic_prefix=topic_prefix, group_prefix=group_prefix, operations=ops)
    _print_counts({"acls": n})


@broker_app.command("stop")
def broker_stop(
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Stop the broker this data dir's pid file names (and nothing else)."""
    _check_dir("--data-dir", data_dir)
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
    _check_dir("--data-dir", data_dir)
    from streams.broker import broker_status as status

    settings = load_settings(config)
    info = status(data_dir or Path(settings.broker_dir))
    if info is None:
        typer.echo("not running")
        raise typer.Exit(1)
    auth = f", auth {info.auth}, CA {info.ca_file}" if info.ca_file is not None else ""
    typer.echo(f"running: {info.engine} pid {info.pid} at {info.bootstrap} (data {info.data_dir}{auth})")


def _ensure_topics_or_spool(conn, topics, *, spool: bool) -> None:
    """Create the topics; if the broker cannot be reached, go on only when a spool dir was configured.

    Without one, an unreachable broker is an error (after ``kafka.connect_timeout_s``), not
    events silently kept in a default spool dir the user may not know about.
    """
    from streams.admin import ensure_topics
    from streams.errors import KafkaUnavailable

    try:
        ensure_topics(conn, topics)
    except KafkaUnavailable as err:
        if not spool:
            raise KafkaUnavailable(f"{err}; or pass --spool-dir (TRAJPIPE_SPOOL_DIR) to keep the events on disk "
                                   "until it is back") from None
        typer.echo(f"{err}; spooling", err=True)


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
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="token ids are drawn below this")] = 32000,
    bootstrap: BootstrapOpt = None,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir", help="where to spool if Kafka is down")] = None,
    config: ConfigOpt = None,
) -> None:
    """Emit schema-valid synthetic episodes to the events topic."""
    _check_at_least("--episodes", episodes, 0)
    _check_at_least("--vocab-size", vocab_size, 2)
    _check_dir("--spool-dir", spool_dir)
    if not [d for d in domains.split(",") if d.strip()]:
        _fail("`--domains` is empty; name at least one domain, e.g. --domains code,math")
    import time

    from streams.producer import EventProducer
    from streams.synth import generate_episodes

    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-synth")
    topics = settings.topic_names()
    domain_list = [d.strip() for d in domains.split(",") if d.strip()]
    if not domain_list:
        _fail("`--domains` is empty; name at least one domain, e.g. --domains code,math")
    _ensure_topics_or_spool(conn, topics, spool=spool_dir is not None or settings.spool_configured)
    n_events = 0
    t0 = time.perf_counter()
    with EventProducer(conn, topics.events, spool_dir=spool_dir or Path(settings.spool_dir)) as producer, \
            _progress() as bar:
        task = bar.add_task("synth episodes", total=episodes, rate="")
        for i, episode in enumerate(generate_episodes(episodes, domains=domain_list, seed=seed,
                                                      vocab_size=vocab_size)):
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
    out: Annotated[Path, typer.Option(help="archive directory or s3://BUCKET/PREFIX", parser=_dataset_location,
                                      metavar="PATH")],
    until_end: Annotated[bool, typer.Option("--until-end", help="stop at the end offsets seen at start")] = False,
    bootstrap: BootstrapOpt = None,
    commit_every: Annotated[int, typer.Option(help="messages per commit")] = 50_000,
    poll_interval: Annotated[float, typer.Option(help="seconds between drains when following the topic")] = 1.0,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir")] = None,
    config: ConfigOpt = None,
) -> None:
    """Drain the events topic into the append-only Parquet event archive."""
    if isinstance(out, str):
        _check_remote_out("--out", out)
    else:
        _check_dir("--out", out)
    _check_dir("--spool-dir", spool_dir)
    _check_at_least("--commit-every", commit_every, 1)
    if not poll_interval > 0:
        _fail(f"`--poll-interval` must be > 0 seconds, got {poll_interval:g}")
    import threading

    from streams.admin import ensure_topics
    from streams.archive import ArchiveCounts, Archiver
    from streams.deadletter import send_dead_letter
    from streams.errors import KafkaUnavailable
    from streams.producer import EventProducer

    from kafka import errors as kafka_errors

    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-archiver")
    topics = settings.topic_names()
    stop = threading.Event()
    if not until_end:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    while True:
        try:
            ensure_topics(conn, topics)
            break
        except (KafkaUnavailable, kafka_errors.KafkaConnectionError, kafka_errors.KafkaTimeoutError) as err:
            if until_end:
                raise
            # Following the topic, a broker that is down at start is waited for, as one that goes away later.
            typer.echo(f"Kafka unreachable at {conn.bootstrap_servers} ({err}); trying again in 2 s", err=True)
            if stop.wait(2.0):
                _print_counts({"events": 0, "dead_letters": 0, "commits": 0})
                return
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


@app.command("train")
def train(
    data: Annotated[Optional[Path], typer.Option(help="dataset root (holds _commit_log/ and steps/): a directory or "
                                                 "s3://BUCKET/PREFIX", parser=_dataset_location, metavar="PATH")] = None,
    recipe: Annotated[Optional[str], typer.Option(help="dataset version <name>-<hash8> (needed when --data holds several)")] = None,
    model: Annotated[Optional[Path], typer.Option(help="base model: a local HF directory")] = None,
    out: Annotated[Optional[Path], typer.Option(help="run directory: metrics.jsonl, checkpoints/, policies/; a "
                                                "directory or s3://BUCKET/PREFIX", parser=_dataset_location,
                                                metavar="PATH")] = None,
    objective: Annotated[Optional[str], typer.Option(help="bc | awr | ppo | grpo")] = None,
    mode: Annotated[Optional[str], typer.Option(help="offline (epochs) | online (tail + staleness cap + publish)")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="optimizer steps")] = None,
    deepspeed_config: Annotated[Optional[Path], typer.Option("--deepspeed-config", help="DeepSpeed JSON/YAML merged over the generated one")] = None,
    zero_stage: Annotated[Optional[int], typer.Option("--zero-stage", help="ZeRO stage 0-3")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue from the latest checkpoint in --out")] = False,
    publish_every: Annotated[Optional[int], typer.Option("--publish-every", help="publish a policy every N steps")] = None,
    seed: Annotated[Optional[int], typer.Option(help="seed of data order and init")] = None,
    bootstrap: BootstrapOpt = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="training recipe YAML (trainer/configs/*.yaml)")] = None,
    local_rank: Annotated[Optional[int], typer.Option("--local_rank", hidden=True, help="set by the deepspeed launcher")] = None,
) -> None:
    """Train a policy on the steps/ datasets with DeepSpeed (see docs/trainer.md)."""
    from trainer.config import ConfigError as TrainConfigError
    from trainer.config import load_train_config

    try:
        cfg = load_train_config(config, **{
            "data.dir": str(data) if data else None, "data.recipe": recipe, "model": str(model) if model else None,
            "out": str(out) if out else None, "objective.name": objective, "mode": mode, "max_steps": max_steps,
            "engine.deepspeed_config": str(deepspeed_config) if deepspeed_config else None,
            "engine.zero_stage": zero_stage, "resume": resume or None, "publish.every": publish_every,
            "publish.bootstrap": bootstrap, "seed": seed,
        })
    except TrainConfigError as err:
        _fail(str(err))
    # Checked here, before DeepSpeed and the process group start, so a wrong path is one line, not a rank traceback.
    from schemas.storage import local_path, resolve, scheme_of

    s3_data = scheme_of(cfg.data.dir) == "s3"
    if s3_data:
        resolve(cfg.data.dir)  # names a bucket; the AWS_* settings parse
    else:
        local_path(cfg.data.dir, flag="--data (data.dir)")  # the recipe YAML may name another scheme too
    # Outputs: local, or s3:// (written in a local scratch directory and uploaded, trainer/outputs.py).
    outputs = [("--out (out)", cfg.out), ("checkpoint.dir", cfg.checkpoint.dir), ("publish.store", cfg.publish.store)]
    for flag, where in outputs:
        if where is None:
            continue
        if scheme_of(where) == "s3":
            resolve(where)  # names a bucket; the AWS_* settings parse
        else:
            local_path(where, flag=flag)  # the recipe YAML may name another scheme
    _check_model_dir(Path(cfg.model))
    if s3_data:
        _check_remote_data(cfg.data.dir)
    else:
        _check_dir("--data", Path(cfg.data.dir), must_exist=True)
    for flag, where in outputs:
        if where is not None and scheme_of(where) == "s3":
            _check_remote_out(flag.split(" ")[0], where)
    if scheme_of(cfg.out) != "s3":
        _check_dir("--out", Path(cfg.out))
    if cfg.engine.deepspeed_config and not Path(cfg.engine.deepspeed_config).is_file():
        _fail(f"`--deepspeed-config` {cfg.engine.deepspeed_config} is not a file; give a DeepSpeed JSON/YAML file")
    from trainer.recipes.rl import run

    emit = None
    producer = None
    if cfg.publish.bootstrap:
        from streams.producer import EventProducer

        settings = load_settings(None, bootstrap=cfg.publish.bootstrap)
        conn = settings.connection(client_id="trajpipe-trainer")
        # fail before training, not at the first publish (down, bad credentials, no ACL on the topics)
        _ensure_topics_or_spool(conn, settings.topic_names(), spool=settings.spool_configured)
        producer = EventProducer(conn, settings.topic_names().control, spool_dir=Path(settings.spool_dir))

        def emit(event) -> None:
            producer.emit(event)
            producer.flush()

    from trainer.data import DataError

    try:
        summary = run(cfg, emit_event=emit)
    except DataError as err:
        _fail(str(err))
    finally:
        if producer is not None:
            producer.close()
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        _print_counts(summary)


@model_app.command("init-tiny")
def model_init_tiny(
    out: Annotated[Path, typer.Option(help="directory to write the model and tokenizer to", parser=_local_location, metavar="PATH")],
    seed: Annotated[int, typer.Option(help="weight seed (same seed, same files)")] = 0,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="BPE vocabulary size")] = 2048,
    hidden_size: Annotated[int, typer.Option("--hidden-size")] = 128,
    num_layers: Annotated[int, typer.Option("--num-layers")] = 2,
    num_heads: Annotated[int, typer.Option("--num-heads", help="head dim = hidden/heads must be 64-ish for vLLM CPU")] = 2,
    intermediate_size: Annotated[int, typer.Option("--intermediate-size")] = 384,
    max_position_embeddings: Annotated[int, typer.Option("--max-position-embeddings")] = 2048,
) -> None:
    """Write a random-init tiny Llama model + from-scratch BPE tokenizer (loads in transformers and vLLM)."""
    _check_dir("--out", out)
    from rollout.model import init_tiny_model

    try:
        path = init_tiny_model(out, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                               num_heads=num_heads, intermediate_size=intermediate_size,
                               max_position_embeddings=max_position_embeddings, seed=seed)
    except ValueError as err:
        _fail(str(err))
    info = json.loads((path / "trajpipe_model.json").read_text())
    print(path, flush=True)
    _print_counts({"params": info["params"], "vocab_size": info["vocab_size"]})


def _published_policy(model: Path | None) -> dict:
    """Version and lineage of a published policy directory (its ``policy.json``), or {} for a base model."""
    if model is None or not (model / "policy.json").is_file():
        return {}
    import msgspec

    from trainer.publish import read_policy

    try:
        record = read_policy(model)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        _fail(f"{model / 'policy.json'} is not a policy record: {err}")
    return {"version": record.version, "lineage": record.lineage}


@app.command("rollout")
def rollout(
    episodes: Annotated[int, typer.Option(help="episodes to run")] = 100,
    domains: Annotated[str, typer.Option(help="comma-separated domains")] = "code,math,docqa,tools",
    policy: Annotated[str, typer.Option(help="scripted | hf | vllm")] = "scripted",
    model: Annotated[Optional[Path], typer.Option(
        help="model directory (hf, vllm; scripted: speak its tokenizer, so the demonstrations are trainable)")] = None,
    concurrency: Annotated[int, typer.Option(help="episodes in flight")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="episodes per task run as one GRPO group")] = 1,
    task_pool: Annotated[int, typer.Option("--task-pool", help="draw tasks from a fixed pool of N per domain and "
                                                               "level (0: always new tasks)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of task draws and sampling")] = 0,
    levels: Annotated[Optional[str], typer.Option(help="pin difficulty levels, e.g. 0 or 0,1 (drawn uniformly; "
                                                       "default: the curriculum)")] = None,
    max_steps: Annotated[int, typer.Option("--max-steps", help="steps per episode")] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="new tokens per action (hf, vllm)")] = 64,
    temperature: Annotated[float, typer.Option(help="sampling temperature (hf, vllm); 0 = greedy")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", help="nucleus mass (hf, vllm)")] = 1.0,
    noise: Annotated[float, typer.Option(help="scripted: probability of a wrong decision")] = 0.0,
    policy_version: Annotated[Optional[int], typer.Option(
        "--policy-version", help="version of --model (default: its policy.json, else 0)")] = None,
    policy_lineage: Annotated[Optional[str], typer.Option(
        "--policy-lineage", help="lineage of --model's version (default: its policy.json, else none)")] = None,
    follow_policies: Annotated[bool, typer.Option("--follow-policies/--no-follow-policies",
                                                  help="load versions published on the control topic")] = True,
    producer_id: Annotated[Optional[str], typer.Option("--producer-id", help="worker id on the events")] = None,
    scheduler_state: Annotated[Optional[Path], typer.Option(
        "--scheduler-state", help="JSON file of the task scheduler's state: saved after every episode, resumed "
                                  "from when it exists (levels, pass rates, RNG, group rounds)")] = None,
    samples_per_version: Annotated[int, typer.Option(
        "--samples-per-version", help="staleness control (AReaL): episodes the trainer consumes per version; start "
                                      "groups only while judged + in flight < (versions since start + max-ahead + "
                                      "1) x N (0: off)")] = 0,
    max_ahead: Annotated[int, typer.Option("--max-ahead", help="staleness control: versions rollouts may run "
                                                               "ahead of the trainer")] = 0,
    bootstrap: BootstrapOpt = None,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir", help="where to spool if Kafka is down")] = None,
    config: ConfigOpt = None,
) -> None:
    """Run episodes with a policy in the environments and emit their events to the events topic."""
    _check_at_least("--episodes", episodes, 0)
    _check_at_least("--concurrency", concurrency, 1)
    _check_at_least("--max-steps", max_steps, 1)
    _check_at_least("--max-tokens", max_tokens, 1)
    _check_at_least("--samples-per-version", samples_per_version, 0)
    _check_at_least("--max-ahead", max_ahead, 0)
    if samples_per_version and not follow_policies:
        _fail("`--samples-per-version` waits for new policy versions; it needs `--follow-policies`")
    _check_dir("--spool-dir", spool_dir)
    from rollout.envs import domains as known_domains

    unknown = sorted({d.strip() for d in domains.split(",") if d.strip()} - set(known_domains()))
    if unknown:
        _fail(f"`--domains` names unknown domains {', '.join(unknown)}; known: {', '.join(known_domains())}")
    import socket
    import threading

    from rollout.reload import PolicyFollower
    from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
    from schemas.events import SamplingParams
    from streams.producer import EventProducer

    domain_list = [d.strip() for d in domains.split(",") if d.strip()]
    if not domain_list:
        _fail("`--domains` is empty; name at least one domain, e.g. --domains code,math")
    if policy not in ("scripted", "hf", "vllm"):
        _fail(f"`--policy` {policy!r} is not one of scripted, hf, vllm")
    if policy != "scripted" and model is None:
        _fail(f"`--policy {policy}` needs `--model DIR` (make one with `trajpipe model init-tiny --out DIR`)")
    if model is not None and not (model / "config.json").is_file():
        _fail(f"`--model` {model} is not a model directory (no config.json); make one with "
              f"`trajpipe model init-tiny --out {model}`")
    if group_size < 1:
        _fail(f"`--group-size` must be >= 1, got {group_size}")
    if seed < 0:
        _fail(f"`--seed` must be >= 0 (negative seeds are the held-out evaluation tasks), got {seed}")
    if task_pool < 0:
        _fail(f"`--task-pool` must be >= 0 (0: always new tasks), got {task_pool}")
    if scheduler_state is not None and scheduler_state.is_dir():
        _fail(f"`--scheduler-state` {scheduler_state} is a directory; give a JSON file path")
    try:
        level_list = tuple(int(x) for x in levels.split(",") if x.strip()) if levels else ()
    except ValueError as err:
        _fail(f"`--levels` {levels!r}: {err}")
    try:
        scheduler = make_scheduler(domain_list, seed=seed, task_pool=task_pool, levels=level_list,
                                   state_path=scheduler_state)
    except ValueError as err:
        if "levels" in str(err):
            _fail(f"`--levels` {levels!r}: {err}")
        _fail(f"`--scheduler-state` {scheduler_state} cannot be resumed from: {err}")
    except (KeyError, json.JSONDecodeError) as err:
        _fail(f"`--scheduler-state` {scheduler_state} cannot be resumed from: {err}")
    published = _published_policy(model)
    policy_version = policy_version if policy_version is not None else published.get("version", 0)
    policy_lineage = policy_lineage if policy_lineage is not None else published.get("lineage", "")
    settings = load_settings(config, bootstrap=bootstrap)
    producer_id = producer_id or f"rollout@{socket.gethostname()}:{os.getpid()}"
    conn = settings.connection(client_id="trajpipe-rollout")
    topics = settings.topic_names()
    _ensure_topics_or_spool(conn, topics, spool=spool_dir is not None or settings.spool_configured)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    if policy == "scripted":
        from rollout.policies.scripted import ScriptedPolicy

        tokenizer, max_prompt = None, 1536
        if model is not None:
            from transformers import AutoConfig, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
            # Scripted actions (whole source files) run longer than sampled ones: leave them 512 tokens.
            max_prompt = int(AutoConfig.from_pretrained(model).max_position_embeddings) - max(512, max_tokens)
        actor = ScriptedPolicy(noise=noise, seed=seed, policy_version=policy_version, tokenizer=tokenizer,
                               max_prompt_tokens=max_prompt)
    elif policy == "hf":
        from rollout.policies.hf import HFPolicy

        actor = HFPolicy.from_pretrained(model, sampling=sampling, policy_version=policy_version,
                                         policy_lineage=policy_lineage)
    else:
        from rollout.policies.vllm import VLLMPolicy

        actor = VLLMPolicy(model, sampling=sampling, policy_version=policy_version,
                           max_batch=max(concurrency, group_size), policy_lineage=policy_lineage)
        typer.echo(f"vLLM engine loaded in {actor.load_seconds:.1f} s", err=True)
    typer.echo(f"rollout: {json.dumps({'episodes': episodes, 'domains': domain_list, 'policy': policy, 'model': str(model) if model else None, 'concurrency': concurrency, 'group_size': group_size, 'seed': seed, 'max_steps': max_steps, 'sampling': {'temperature': temperature, 'top_p': top_p, 'max_tokens': max_tokens}, 'producer_id': producer_id, 'topic': topics.events})}", err=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    follower = PolicyFollower(conn, topics.control) if follow_policies and policy != "scripted" else None
    with EventProducer(conn, topics.events, spool_dir=spool_dir or Path(settings.spool_dir)) as producer, \
            _progress() as bar:
        task = bar.add_task("rollout episodes", total=episodes, rate="")

        def on_episode(_result, c) -> None:
            per_domain = " ".join(f"{d} {dc.passed}/{dc.episodes}" for d, dc in sorted(c.domains.items()))
            bar.update(task, completed=c.episodes, rate=f"{c.episodes_per_s:.2f} ep/s | passed {per_domain}")

        worker = RolloutWorker(actor, emit=producer.emit,
                               config=RolloutConfig(episodes=episodes, concurrency=concurrency, max_steps=max_steps,
                                                    producer_id=producer_id, group_size=group_size,
                                                    samples_per_version=samples_per_version, max_ahead=max_ahead),
                               scheduler=scheduler,
                               follower=follower, on_episode=on_episode)
        if follower is not None:
            follower.start()
        try:
            counts = worker.run(stop)
        finally:
            if follower is not None:
                follower.close()
            close_policy(worker.policy)
        flush_and_report(producer, stop=stop, aborted=counts.aborted)
    if samples_per_version:
        typer.echo(f"staleness control: held new groups back {counts.throttled_s:.1f} s, released "
                   f"{counts.throttle_releases} groups without a new version", err=True)
    # vLLM appends what its engine generated (generated tokens, generation wall time; bench.rollout reads them).
    _print_counts({**counts.summary(), **(actor.stats.summary() if policy == "vllm" else {})})
    if counts.stuck:  # their threads never returned; events are flushed, so leave without joining them
        typer.echo(f"{counts.stuck} episodes were stuck at shutdown (closed as aborted); exiting", err=True)
        sys.stderr.flush()
        os._exit(3)


@app.command("eval")
def eval_(
    policy_version: Annotated[Optional[str], typer.Option(
        "--policy-version", help="version published on the control topic, or `latest`")] = None,
    model: Annotated[Optional[Path], typer.Option(help="evaluate this model directory instead")] = None,
    policy: Annotated[str, typer.Option(help="hf | vllm")] = "hf",
    domains: Annotated[str, typer.Option(help="comma-separated domains")] = "math,code",
    levels: Annotated[str, typer.Option(help="comma-separated difficulty levels")] = "0",
    tasks_per_level: Annotated[int, typer.Option("--tasks-per-level", help="held-out tasks per domain and level")
                               ] = 8,
    max_steps: Annotated[int, typer.Option("--max-steps", help="steps per episode")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="new tokens per action")] = 64,
    temperature: Annotated[float, typer.Option(help="sampling temperature; 0 = greedy (pass@1)")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="nucleus mass")] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed (temperature > 0)")] = 0,
    concurrency: Annotated[int, typer.Option(help="episodes in flight")] = 4,
    follow: Annotated[bool, typer.Option("--follow", help="evaluate every newly published version until stopped")
                      ] = False,
    group: Annotated[Optional[str], typer.Option(help="--follow: consumer group recording the versions evaluated; a "
                                                 "restart evaluates every version this group has not (all for a new "
                                                 "group)")] = None,
    lineage: Annotated[Optional[str], typer.Option(help="only versions of this lineage")] = None,
    bootstrap: BootstrapOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Evaluate a policy version on the held-out tasks; episodes go to the log marked purpose=eval."""
    from trajpipe.evaluation import run_eval

    run_eval(bootstrap=bootstrap, config=config, policy_version=policy_version, model=model, policy=policy,
             domains=domains, levels=levels, tasks_per_level=tasks_per_level, max_steps=max_steps,
             max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, concurrency=concurrency,
             follow=follow, group=group, lineage=lineage)


@audit_app.command("logprobs")
def audit_logprobs(
    data: Annotated[Path, typer.Option(help="dataset root (holds _commit_log/ and steps/)", parser=_local_location, metavar="PATH")],
    model: Annotated[Path, typer.Option(help="the weights that acted: a base model or a published policy dir")],
    recipe: Annotated[Optional[str], typer.Option(help="dataset version <name>-<hash8> (when --data holds several)")] = None,
    policy_version: Annotated[Optional[int], typer.Option(
        "--policy-version", help="compare steps of this version (default: --model's policy.json, else 0)")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="trainer sequence length (>= the policy's context)")] = 4096,
    domains: Annotated[Optional[str], typer.Option(help="comma-separated domains (default: all)")] = None,
) -> None:
    """Re-score every recorded action with --model on the trainer's data path; print max |Δ| to the behaviour log-probs.

    Under the weights that acted, the trainer must get the recorded log-probs back (see trainer/audit.py).
    """
    import msgspec

    from trainer.audit import audit_behaviour_logprobs
    from trainer.data import DataError

    _check_model_dir(model)
    _check_dir("--data", data, must_exist=True)
    version = policy_version if policy_version is not None else _published_policy(model).get("version", 0)
    try:
        result = audit_behaviour_logprobs(
            data, model, recipe=recipe, policy_version=version, seq_len=seq_len,
            domains=tuple(d.strip() for d in domains.split(",") if d.strip()) if domains else None)
    except DataError as err:
        _fail(str(err))
    if result.tokens == 0:
        _fail(f"{data} holds no recorded action of policy version {version} to compare (with behaviour log-probs, "
              "in an exact window); name the version that acted with --policy-version")
    _print_counts({"policy_version": version, **msgspec.to_builtins(result)})


@app.command("feedback")
def feedback(
    episode: Annotated[str, typer.Option(help="the episode the feedback is about (its episode_id)")],
    step: Annotated[Optional[int], typer.Option(help="the step it is about (default: the whole episode)")] = None,
    score: Annotated[Optional[float], typer.Option(help="a rating (verifier outcomes are in [0, 1])")] = None,
    correction: Annotated[Optional[str], typer.Option(help="the action the policy should have taken at --step")] = None,
    source: Annotated[str, typer.Option(help="who gives it (annotator, reviewer, reward model)")] = "cli",
    comment: Annotated[str, typer.Option(help="free text")] = "",
    data: Annotated[Optional[Path], typer.Option(help="dataset root to look the episode up in: a directory or "
                                                 "s3://BUCKET/PREFIX", parser=_dataset_location,
                                                 metavar="PATH")] = None,
    archive: Annotated[Optional[Path], typer.Option(help="event archive to look the episode up in: a directory "
                                                    "or s3://BUCKET/PREFIX", parser=_dataset_location,
                                                    metavar="PATH")] = None,
    domain: Annotated[Optional[str], typer.Option(help="the episode's domain (instead of a look-up)")] = None,
    task_id: Annotated[Optional[str], typer.Option("--task-id", help="its task (with --domain)")] = None,
    policy_version: Annotated[int, typer.Option("--policy-version", help="its policy version (with --domain)")] = 0,
    feedback_id: Annotated[Optional[str], typer.Option("--feedback-id", help="your id for it (dedupe key)")] = None,
    bootstrap: BootstrapOpt = None,
    spool_dir: Annotated[Optional[Path], typer.Option("--spool-dir", help="where to spool if Kafka is down")] = None,
    config: ConfigOpt = None,
) -> None:
    """Send a rating or a correction of an episode (or one of its steps) as a `feedback` event (docs/feedback.md)."""
    if isinstance(data, str):
        _check_remote_data(data)
    else:
        _check_dir("--data", data, must_exist=True)
    if isinstance(archive, str):
        _check_remote_archive(archive)
    else:
        _check_dir("--archive", archive, must_exist=True)
    _check_dir("--spool-dir", spool_dir)
    from streams.feedback import EpisodeRef, FeedbackError, find_episode, make_feedback, send_feedback

    if domain is not None:
        if not task_id:
            _fail("`--domain` needs `--task-id` (and `--policy-version`), or look the episode up with --data/--archive")
        ref = EpisodeRef(episode, domain=domain, task_id=task_id, policy_version=policy_version)
    elif data is None and archive is None:
        _fail("say where the episode is: `--data DIR` (datasets) or `--archive DIR`, or give `--domain`, "
              "`--task-id` and `--policy-version`")
    else:
        ref = find_episode(episode, data=data, archive=archive)
        if ref is None:
            _fail(f"episode {episode!r} is in neither {data or '-'} (--data) nor {archive or '-'} (--archive); "
                  "check the id, or give `--domain`, `--task-id` and `--policy-version`")
    try:
        event = make_feedback(ref, source=source, target_step=step, rating=score, correction=correction,
                              comment=comment, feedback_id=feedback_id)
    except FeedbackError as err:
        _fail(str(err))
    settings = load_settings(config, bootstrap=bootstrap)
    conn = settings.connection(client_id="trajpipe-feedback")
    topics = settings.topic_names()
    _ensure_topics_or_spool(conn, topics, spool=spool_dir is not None or settings.spool_configured)
    sent = send_feedback(conn, topics.events, event, spool_dir=spool_dir or Path(settings.spool_dir))
    if not sent:
        typer.echo("Kafka unreachable: the feedback is kept in the spool; it replays on the next run", err=True)
    _print_counts({"feedback": 1, "sent": int(sent), "event_id": event.event_id, "episode_id": ref.episode_id,
                   "domain": ref.domain, "policy_version": ref.policy_version})


DataOpt = Annotated[Optional[Path], typer.Option("--data", help="dataset root (trajpipe pipeline run --out): a "
                                                 "directory or s3://BUCKET/PREFIX", parser=_dataset_location,
                                                 metavar="PATH")]
ArchiveOpt = Annotated[Optional[Path], typer.Option("--archive", help="event archive (trajpipe archive --out): a "
                                                    "directory or s3://BUCKET/PREFIX", parser=_dataset_location,
                                                    metavar="PATH")]
RunsOpt = Annotated[Optional[list[Path]], typer.Option("--runs", help="training run dir(s) (or their parent), "
                                                       "directories or s3://BUCKET/PREFIX: policies/v*/policy.json "
                                                       "become the `policies` view",
                                                       parser=_dataset_location, metavar="PATH")]
VersionOpt = Annotated[Optional[str], typer.Option("--version", help="dataset version <recipe>-<hash8> (or recipe "
                                                   "name), `all` for every one; default: the newest committed")]
AsOfOpt = Annotated[Optional[str], typer.Option("--as-of", help="the version as of this commit number, or as of "
                                                 "this ISO 8601 time, e.g. 2026-12-02T10:15:00Z (default: newest)")]
FormatOpt = Annotated[str, typer.Option("--format", help="table, csv, json or parquet")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", help="write to this file (or s3://BUCKET/KEY) instead of "
                                                "stdout", parser=_dataset_location, metavar="PATH")]


@app.command("query")
def query(
    sql: Annotated[str, typer.Argument(help="SQL over the catalog's views (docs/analytics.md)")],
    data: DataOpt = None, archive: ArchiveOpt = None, runs: RunsOpt = None, version: VersionOpt = None,
    as_of: AsOfOpt = None, fmt: FormatOpt = "table", out: OutOpt = None,
) -> None:
    """Query the archive and datasets with DuckDB (views: events, steps, trajectories, commits, ...)."""
    from trajpipe.analytics import query_command

    if out is not None and isinstance(out, str):
        _check_remote_out("--out", out)
    counts = query_command(sql, data=data, archive=archive, runs=runs or [], version=version, as_of=as_of, fmt=fmt,
                           out=out)
    if counts is not None:
        _print_counts(counts)


@app.command("catalog")
def catalog(
    db: Annotated[Path, typer.Option("--db", help="DuckDB database file to write (replaced atomically)",
                                     parser=_local_location, metavar="PATH")],
    data: DataOpt = None, archive: ArchiveOpt = None, runs: RunsOpt = None, version: VersionOpt = None,
    as_of: AsOfOpt = None,
) -> None:
    """Write a DuckDB database whose views are every table (open it with `duckdb FILE`); rerun to refresh."""
    from trajpipe.analytics import catalog_command

    _print_counts(catalog_command(db=db, data=data, archive=archive, runs=runs or [], version=version, as_of=as_of))


@app.command("report")
def report(
    name: Annotated[str, typer.Argument(help="list, html, or a report name (`trajpipe report list`)")],
    data: DataOpt = None, archive: ArchiveOpt = None, runs: RunsOpt = None, version: VersionOpt = None,
    as_of: AsOfOpt = None, fmt: FormatOpt = "table", out: OutOpt = None,
) -> None:
    """Canned analyst reports; `html --out FILE` writes them all as charts in one self-contained page."""
    from trajpipe.analytics import report_command

    if out is not None and isinstance(out, str):
        _check_remote_out("--out", out)
    counts = report_command(name, data=data, archive=archive, runs=runs or [], version=version, as_of=as_of,
                            fmt=fmt, out=out)
    if counts is not None:
        _print_counts(counts)


@pipeline_app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def pipeline_run(ctx: typer.Context) -> None:
    """Run the trajectory job (`trajpipe pipeline run --help` lists its options).

    --source kafka|archive [--bootstrap B] [--archive DIR] --out DIR [--mode batch|stream]
    [--recipe NAME|FILE] [--runner R] [--loop SECONDS] [beam options...]; every option
    the job does not know goes to Beam's PipelineOptions.
    """
    from pipelines.recipes import RecipeError
    from pipelines.trajectory_job import JobError, run
    from pipelines.verify import VerifiersUnavailable

    argv = list(ctx.args)
    settings = load_settings(None)
    if "--source" in argv and "kafka" in argv and not any(a.startswith("--bootstrap") for a in argv):
        argv += ["--bootstrap", settings.kafka.bootstrap_servers]
    try:
        counts = run(argv, conn=settings.connection(client_id="trajpipe-pipeline"),
                     default_topic=settings.topics.events)
    except (JobError, RecipeError, VerifiersUnavailable) as err:
        _fail(str(err))
    _print_counts(counts)


@app.command("flink-cluster")
def flink_cluster(
    action: Annotated[str, typer.Argument(help="up | down | status")],
    dir: Annotated[Path, typer.Option("--dir", help="cluster directory (config, logs, pids)")],
    task_managers: Annotated[int, typer.Option("--task-managers", help="TaskManager processes (up)")] = 2,
    slots: Annotated[int, typer.Option("--slots", help="task slots per TaskManager (up)")] = 1,
) -> None:
    """A Flink 1.19 session cluster on this machine (pipelines/flink_cluster.py; docs/runners.md)."""
    from pipelines.flink_cluster import FlinkClusterError, cluster_command

    _check_dir("--dir", dir)
    try:
        _print_counts(cluster_command(action, dir=dir, task_managers=task_managers, slots=slots))
    except FlinkClusterError as err:
        _fail(str(err))


@app.command("loop")
def loop(
    config: Annotated[Path, typer.Option("--config", help="loop YAML (trajpipe/configs/loop.yaml)")],
    resume: Annotated[bool, typer.Option("--resume", help="continue the run in the config's run_dir")] = False,
) -> None:
    """The online RL loop: rollouts, archiver, Beam job, online trainer, evaluator, each its own process (docs/loop.md)."""
    from trajpipe.loop import load_loop_config, run_loop

    if not config.is_file():
        _fail(f"`--config` {config} is not a file; give a loop YAML (see trajpipe/configs/loop.yaml)")
    cfg = load_loop_config(config)
    from schemas.storage import local_path

    local_path(cfg.run_dir, flag=f"run_dir (in --config {config})")
    summary = run_loop(cfg, resume=resume, echo=lambda line: print(line, file=sys.stderr, flush=True))
    _print_counts(summary)
    if summary.get("error"):
        sys.stdout.flush()
        print(f"error: {summary['error']}", file=sys.stderr, flush=True)
        raise typer.Exit(1)


#: What the demo leaves in its workdir (and so may wipe on the next run).
_DEMO_ENTRIES = frozenset({"broker", "tiny", "archive", "datasets", "bc", "grpo", "spool", "catalog.duckdb",
                           "report.html", "loop", "loop.yaml"})


@app.command("demo")
def demo(
    workdir: Annotated[Path, typer.Option(help="where the demo keeps its broker, data and runs (wiped first)")] = Path(
        ".trajpipe/demo"),
    episodes: Annotated[int, typer.Option(help="scripted rollout episodes over the four domains")] = 20,
    group_size: Annotated[int, typer.Option("--group-size", help="GRPO group size of the policy's rollouts")] = 4,
    groups: Annotated[int, typer.Option(help="groups of policy rollouts")] = 4,
) -> None:
    """The learning loop on an embedded broker, every step a real `trajpipe` command (printed, so it can be copied).

    Scripted demonstrations in the tiny model's tokens (sandboxed domains) -> archive -> Beam job -> rebuild
    with another reward recipe -> BC warm start (v1) -> v1's rollouts in GRPO groups -> Beam job (complete-group
    advantages) -> query -> round-trip audit of v1's log-probs -> GRPO from v1, v2 published on the control
    topic -> rollouts that load v2 -> the online loop (`trajpipe loop`) from v1 for three versions, each
    evaluated on held-out tasks, and the pass rate per version.
    """
    import shutil
    import socket
    import subprocess

    from schemas.manifests import list_dataset_versions
    from streams.broker import kafka_jars_dir

    for flag, value in (("--episodes", episodes), ("--group-size", group_size), ("--groups", groups)):
        _check_at_least(flag, value, 1)
    _check_dir("--workdir", workdir)
    strangers = sorted(p.name for p in workdir.iterdir() if p.name not in _DEMO_ENTRIES) if workdir.exists() else []
    if strangers:  # the demo wipes its workdir: never a directory that holds anything else
        _fail(f"`--workdir` {workdir} holds {', '.join(strangers[:5])}, which the demo did not make, and the demo "
              "wipes its workdir; give a new or empty directory")
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = "kafka" if shutil.which("java") and any(kafka_jars_dir().glob("kafka_2.13-*.jar")) else "tansu"
    bootstrap = f"127.0.0.1:{port}"
    console = _stderr_console()
    env = {**__import__("os").environ, "TRAJPIPE_SPOOL_DIR": str(workdir / "spool")}
    configs = Path(__file__).resolve().parents[1] / "trainer" / "configs"
    results: dict[str, dict] = {}

    def step(title: str, *args: str) -> dict:
        console.rule(f"[bold]{title}")
        console.print(f"[cyan]$ trajpipe {' '.join(args)}")
        proc = subprocess.run([sys.executable, "-m", "trajpipe", *args], env=env, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.strip().splitlines()
        for line in lines:
            print(line, flush=True)
        if proc.returncode != 0:
            raise typer.Exit(proc.returncode)
        try:
            return json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            return {}

    data, archive, tiny = workdir / "datasets", workdir / "archive", workdir / "tiny"
    v1, grpo_run = workdir / "bc" / "policies" / "v1", workdir / "grpo"
    pool = ["--domains", "math", "--task-pool", "2", "--seed", "7"]
    step(f"1. embedded broker ({engine})", "broker", "start", "--engine", engine, "--port", str(port),
         "--data-dir", str(workdir / "broker"))
    try:
        results["model"] = step("2. tiny base model", "model", "init-tiny", "--out", str(tiny))
        results["rollout"] = step("3. scripted rollouts in sandboxed environments, in the model's tokens", "rollout",
                                  "--bootstrap", bootstrap, "--episodes", str(episodes), "--domains",
                                  "code,math,docqa,tools", "--policy", "scripted", "--model", str(tiny),
                                  "--concurrency", "4")
        results["demos"] = step("4. demonstrations on a pool of two math tasks", "rollout", "--bootstrap", bootstrap,
                                "--episodes", "20", "--policy", "scripted", "--model", str(tiny), *pool)
        results["archive"] = step("5. archive the event log", "archive", "--bootstrap", bootstrap, "--out",
                                  str(archive), "--until-end")
        results["pipeline"] = step("6. Beam trajectory job from Kafka (FnApiRunner)", "pipeline", "run", "--source",
                                   "kafka", "--bootstrap", bootstrap, "--out", str(data))
        results["rebuild"] = step("7. rebuild from the archive with another reward recipe", "pipeline", "run",
                                  "--source", "archive", "--archive", str(archive), "--out", str(data), "--recipe",
                                  "verification_shaped")
        version = next(v for v in list_dataset_versions(data) if v.startswith("outcome-"))
        results["bc"] = step("8. warm start: behaviour cloning of the demonstrations (DeepSpeed)", "train",
                             "--config", str(configs / "bc-warmstart.yaml"), "--data", str(data), "--recipe", version,
                             "--model", str(tiny), "--out", str(workdir / "bc"))
        results["groups"] = step(f"9. the warm policy v1 in GRPO groups of {group_size} (transformers)", "rollout",
                                 "--bootstrap", bootstrap, "--policy", "hf", "--model", str(v1), "--group-size",
                                 str(group_size), "--episodes", str(groups * group_size), "--max-steps", "8",
                                 "--max-tokens", "24", "--temperature", "1.0", "--concurrency", "8",
                                 "--no-follow-policies", *pool)
        results["pipeline_groups"] = step("10. Beam job: the new micro-batch, advantages over complete groups",
                                          "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap, "--out",
                                          str(data))
        step("11. analyst query: v1's groups", "query", "--data", str(data),
             f"select task_group, list(group_member order by group_member) members, "
             f"list(outcome_reward order by group_member) reward, "
             f"list(round(group_advantage, 3) order by group_member) advantage from trajectories "
             f"where recipe = '{version}' and policy_version = 1 group by task_group order by task_group")
        results["audit"] = step("12. round trip: the trainer's data path gives back v1's behaviour log-probs",
                                "audit", "logprobs", "--data", str(data), "--recipe", version, "--model", str(v1),
                                "--seq-len", "2048")
        results["train"] = step("13. GRPO from v1 on its groups (DeepSpeed), v2 published", "train", "--config",
                                str(configs / "grpo-groups.yaml"), "--data", str(data), "--recipe", version,
                                "--model", str(v1), "--out", str(grpo_run), "--bootstrap", bootstrap)
        published = sorted((grpo_run / "policies").glob("v*"))
        if not published:
            _fail("the trainer published no policy")
        results["rollout_new_policy"] = step(
            "14. rollouts that follow the published policy (transformers)", "rollout", "--bootstrap", bootstrap,
            "--episodes", "8", "--group-size", str(group_size), "--policy", "hf", "--model", str(v1), "--max-steps",
            "8", "--max-tokens", "24", "--temperature", "1.0", *pool)
        analytics = ("--data", str(data), "--archive", str(archive), "--runs", str(workdir))
        results["catalog"] = step("15. analytics: every table as DuckDB views (open with `duckdb FILE`)", "catalog",
                                  *analytics, "--db", str(workdir / "catalog.duckdb"))
        results["report"] = step("16. analytics: the HTML report (charts, self-contained)", "report", "html",
                                 *analytics, "--out", str(workdir / "report.html"))
    finally:
        step("17. stop the broker", "broker", "stop", "--data-dir", str(workdir / "broker"))
    results["loop"] = step("18. the online loop from v1 (own broker; 3 versions, each evaluated on held-out tasks)",
                           "loop", "--config", str(_demo_loop_config(workdir, v1)))
    console.rule("[bold]pass rate per policy version (held-out evaluation)")
    for version, rate in results["loop"].get("pass_rate_by_version", {}).items():
        console.print(f"v{version}: {rate:.3f}")
    console.rule("[bold]summary")
    console.print(f"archive: {archive}\ndatasets: {data}\npolicies: {workdir / 'bc' / 'policies'}, "
                  f"{grpo_run / 'policies'}\ncatalog: {results['catalog'].get('db')}\n"
                  f"report: {results['report'].get('out')}")
    _print_counts({
        "rollout_episodes": results["rollout"].get("episodes"), "rollout_passed": results["rollout"].get("passed"),
        "events_archived": results["archive"].get("events"), "trajectories": results["pipeline"].get("episodes"),
        "steps": results["pipeline"].get("steps"), "groups": results["pipeline_groups"].get("groups_released"),
        "group_episodes_passed": results["groups"].get("passed"),
        "behaviour_logprob_max_abs_err": results["audit"].get("max_abs_err"),
        "train_steps": results["train"].get("steps"), "policy_version": results["train"].get("policy_version"),
        "episodes_with_new_policy": results["rollout_new_policy"].get("episodes"),
        "new_policy_passed": results["rollout_new_policy"].get("passed"),
        "loop_policy_versions": results["loop"].get("policy_versions"),
        "loop_pass_rate_by_version": results["loop"].get("pass_rate_by_version"),
    })


def _demo_loop_config(workdir: Path, model: Path) -> Path:
    """The demo's loop: trajpipe/configs/loop-tiny.yaml from the BC policy, in ``workdir/loop``."""
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parent / "configs" / "loop-tiny.yaml").read_text())
    doc.update(run_dir=str(workdir / "loop"), model=str(model))
    doc["budget"] = {"seconds": 300, "policy_versions": 3}
    path = workdir / "loop.yaml"
    path.write_text(f"# trajpipe loop --config {path}\n" + yaml.safe_dump(doc, sort_keys=False))
    return path


def main() -> None:
    """Console-script entry point."""
    from trajpipe.lifeline import exit_with_parent

    exit_with_parent()  # a part of `trajpipe loop`: end with the loop (trajpipe/lifeline.py)
    # `kill -USR1 <pid>`: every thread's Python stack on stderr, and the command goes on (a hang's diagnosis)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    logging.getLogger("apache_beam.io.gcp").setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:  # Beam warns about optional GCP clients at import
        handler.addFilter(lambda record: "apitools not found" not in record.getMessage())
        if not _debug_requested(sys.argv[1:]):
            handler.addFilter(_library_tracebacks_as_one_line)
    app()  # errors are reported by _RootGroup.main


#: Libraries whose logged tracebacks :func:`_library_tracebacks_as_one_line` shortens.
_ONE_LINE_LOGGERS = ("kafka", "apache_beam")


def _library_tracebacks_as_one_line(record: logging.LogRecord) -> bool:
    """A traceback that kafka-python or Beam logs becomes one line: the message and ``(Type: error)``.

    They log one for errors that are handled: kafka-python for a socket closed under its
    reader (it reconnects), Beam for a DoFn whose ``setup`` raised (the command then retries,
    or ends with its own one ``error:`` line). ``--debug`` / ``TRAJPIPE_DEBUG`` keeps them.
    """
    if record.exc_info and record.exc_info[1] is not None and record.name.split(".")[0] in _ONE_LINE_LOGGERS:
        err = record.exc_info[1]
        message, detail = record.getMessage(), _one_line(str(err))
        record.msg = message if detail and detail in message else f"{message} ({type(err).__name__}: {detail})"
        record.args, record.exc_info, record.exc_text = None, None, None
    return True
