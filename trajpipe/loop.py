"""``trajpipe loop``: the whole online RL loop on one machine, each part its own process.

::

    trajpipe loop --config trajpipe/configs/loop.yaml            # a new run in the config's run_dir
    trajpipe loop --config trajpipe/configs/loop.yaml --resume   # continue it after a stop or a crash

The processes (every one a plain ``trajpipe`` command, its argv in ``<run_dir>/loop.json``, its output in
``<run_dir>/logs/<name>.log``) are wired only through Kafka and the datasets::

    broker (embedded unless `bootstrap`)
    rollout-<i>   trajpipe rollout --policy vllm|hf --model M --group-size G ... --scheduler-state ...
                  (follows policy_published on the control topic)
    archiver      trajpipe archive --out <run_dir>/archive               (following the topic)
    pipeline      trajpipe pipeline run --source kafka --out <run_dir>/data --loop S   (or --mode stream)
    trainer       trajpipe train --config <run_dir>/train.yaml           (online: tail, staleness cap, publish)
    evaluator     trajpipe eval --follow --group G --lineage L ...       (held-out tasks of each version, in order)

**Budget.** ``budget.seconds`` of wall clock for this invocation and/or ``budget.policy_versions`` versions
published in the run (counted over resumes: the run stops once the newest version is the warm start's plus
that many). Whichever comes first stops the loop cleanly.

**Clean stop** (budget, Ctrl-C, SIGTERM), in this order, so nothing acknowledged is lost and nothing is left
half-made: the rollout workers (they finish or abort their episodes and flush their producers), the trainer
(its checkpoints are taken at every publish, so it resumes from the last published version), the evaluator
once it has reported the newest version (bounded by ``drain_timeout_s``), then the pipeline once its
commits cover every event in the topic, then the archiver once its commits do; the embedded broker last.
Events a process has not consumed stay in Kafka: a later ``--resume`` reads them from the committed offsets.
Likewise the evaluator's versions: it follows the control topic as a consumer group (``eval_group`` in
``loop.json``) and commits a version only once its evaluation finished, so the versions it has not
evaluated by the stop are evaluated first by the next ``--resume``.

**A child that dies unexpectedly** (any exit before the stop) is restarted with the same command (the
trainer with ``--resume`` once it has a checkpoint), at most ``restarts.max_per_child`` times per child
and invocation; one more death stops the whole loop cleanly with one line naming the child, its exit
status and its log, and the loop exits with status 1. Every part restarts from durable state: the
archive and dataset manifests (Kafka offsets), the trainer checkpoint, the scheduler state file, the spool.

**Resume** (``--resume``) continues the run in ``run_dir``: same broker data dir (and port when free), same
lineage, trainer ``--resume`` from its latest checkpoint (version sequence continues), each rollout
worker's scheduler state, the archive's and the datasets' committed offsets, the evaluator's group (every
version of the run without a finished evaluation, in order, then the new ones).

**A loop killed itself** (kill -9, the OOM killer) cannot stop its children in order, so each ends by itself:
the kernel sends it SIGTERM when the loop dies (:mod:`trajpipe.lifeline`), and it stops as at a clean stop
(the trainer at once, or after the checkpoint and publication in hand; the evaluator without committing the
evaluation in flight). Nothing goes on publishing versions that nothing evaluates. ``--resume`` still looks
for processes left over (by their recorded pids) and stops them first: a child slow to stop, or a system
without ``PR_SET_PDEATHSIG``.

The last stdout line is one JSON object (:func:`summarize`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from streams.broker import free_port
from streams.config import ConfigError
from trainer.config import deep_merge, describe_validation_error
from trajpipe.lifeline import lifeline_env

__all__ = ["LoopConfig", "LoopConfigError", "load_loop_config", "run_loop", "summarize", "LoopPaths"]

log = logging.getLogger(__name__)

#: Episodes a rollout worker is asked for: the loop's budget, not the worker, ends it.
UNBOUNDED_EPISODES = 1_000_000_000
_REPO = Path(__file__).resolve().parents[1]


class LoopConfigError(ConfigError):
    """A loop setting is missing, of the wrong type, unknown, or the run dir cannot be (re)used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class BrokerSettings(_Strict):
    """The embedded broker (used when ``bootstrap`` is not given)."""

    engine: Literal["kafka", "tansu"] = Field("kafka", description="kafka (Java 17) or tansu")
    port: int | None = Field(None, description="listener port (default: a free one, kept over --resume when free)")
    keep_running: bool = Field(False, description="leave the broker up after the loop stops")


class BudgetSettings(_Strict):
    """When the loop stops by itself (whichever comes first; at least one is required)."""

    seconds: float | None = Field(None, gt=0, description="wall-clock seconds of this invocation")
    policy_versions: int | None = Field(None, ge=1, description="versions published in the run (over resumes)")


class RolloutSettings(_Strict):
    """The rollout workers (``trajpipe rollout``)."""

    workers: int = Field(1, ge=1, description="worker processes")
    policy: Literal["vllm", "hf"] = Field("vllm", description="vllm (default) or hf (transformers)")
    domains: list[str] = Field(["math", "code"], min_length=1, description="training domains")
    levels: list[int] | None = Field(None, min_length=1, description="pin difficulty levels (default: the "
                                     "scheduler's curriculum over every level)")
    group_size: int = Field(4, ge=1, description="episodes per task (GRPO group)")
    task_pool: int = Field(0, ge=0, description="tasks per domain and level drawn from a fixed pool (0: new ones)")
    concurrency: int = Field(4, ge=1, description="episodes in flight per worker")
    max_steps: int = Field(8, ge=1, description="steps per episode")
    max_tokens: int = Field(48, ge=1, description="new tokens per action")
    temperature: float = Field(1.0, ge=0, description="sampling temperature")
    seed: int = Field(0, description="seed of worker 0 (worker i: seed + 1000 i)")
    staleness_control: bool = Field(True, description="hold rollouts within the trainer's staleness cap (AReaL's "
                                    "rule, `trajpipe rollout --samples-per-version`): no episodes made only to be "
                                    "dropped as stale")


class PipelineSettings(_Strict):
    """The Beam trajectory job reading the events topic."""

    mode: Literal["batch", "stream"] = Field("batch", description="batch: --loop micro-batches; stream: --mode stream")
    interval_s: float = Field(2.0, gt=0, description="batch: seconds between micro-batches (--loop)")
    window_s: float = Field(5.0, gt=0, description="stream: event-time window per commit")
    runner: str | None = Field(None, description="Beam runner (default: FnApiRunner batch, PrismRunner stream)")
    recipe: str = Field("outcome", description="reward recipe: builtin name or YAML file")
    group_timeout_s: float = Field(120.0, gt=0, description="hold incomplete GRPO groups this long (event time)")
    incomplete_after_s: float = Field(600.0, gt=0, description="an episode silent this long is incomplete")


class TrainerSettings(_Strict):
    """The online trainer (``trajpipe train --mode online``)."""

    config: str = Field("trainer/configs/grpo-online.yaml", description="training recipe YAML (repo-relative ok)")
    publish_every: int = Field(10, ge=1, description="publish a policy version every N optimizer steps")
    overrides: dict[str, Any] = Field({}, description="training settings merged over the recipe (nested YAML)")


class EvalSettings(_Strict):
    """The evaluator (``trajpipe eval --follow``) on held-out tasks."""

    enabled: bool = True
    policy: Literal["vllm", "hf"] = Field("hf", description="policy backend of the evaluation")
    domains: list[str] | None = Field(None, description="default: the rollout domains")
    levels: list[int] = Field([0, 1], min_length=1, description="difficulty levels")
    tasks_per_level: int = Field(4, ge=1, description="held-out tasks per domain and level")
    max_steps: int | None = Field(None, ge=1, description="default: the rollout's")
    max_tokens: int | None = Field(None, ge=1, description="default: the rollout's")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    warm_start: bool = Field(True, description="also evaluate the warm-start model once at the run's start (the "
                             "baseline of the pass-rate curve)")


class RestartSettings(_Strict):
    """What happens when a child dies unexpectedly."""

    max_per_child: int = Field(3, ge=0, description="restarts per child and invocation; then the loop stops")


class LoopConfig(_Strict):
    """One loop run (``trajpipe loop --config FILE``); see trajpipe/configs/loop.yaml."""

    run_dir: str = Field(description="everything of the run: logs, archive, datasets, trainer run, state")
    model: str = Field(description="warm-start model dir (e.g. a BC run's policies/v1, or a base model)")
    bootstrap: str | None = Field(None, description="Kafka bootstrap servers; default: an embedded broker")
    broker: BrokerSettings = BrokerSettings()
    budget: BudgetSettings
    rollout: RolloutSettings = RolloutSettings()
    pipeline: PipelineSettings = PipelineSettings()
    trainer: TrainerSettings = TrainerSettings()
    eval: EvalSettings = EvalSettings()
    restarts: RestartSettings = RestartSettings()
    progress_every_s: float = Field(5.0, gt=0, description="seconds between progress lines")
    drain_timeout_s: float = Field(120.0, gt=0, description="longest wait for each part to drain at stop")


def load_loop_config(path: str | Path) -> LoopConfig:
    """The loop config in ``path`` (YAML), validated.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "l.yaml"
        >>> _ = p.write_text("run_dir: r\\nmodel: m\\nbudget: {policy_versions: 3}\\nrollout: {policy: hf}\\n")
        >>> cfg = load_loop_config(p)
        >>> cfg.rollout.policy, cfg.budget.policy_versions, cfg.pipeline.mode
        ('hf', 3, 'batch')

    Raises:
        LoopConfigError: unreadable, not a mapping, an unknown key or a value of the wrong type or range.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise LoopConfigError(f"`--config` {path}: {' '.join(str(err).split())}") from None
    if not isinstance(doc, dict):
        raise LoopConfigError(f"`--config` {path} holds a {type(doc).__name__}, not a mapping of loop settings; "
                              "see trajpipe/configs/loop.yaml")
    try:
        cfg = LoopConfig.model_validate(doc)
    except ValidationError as err:
        why = describe_validation_error(err, see="see trajpipe/configs/loop.yaml, docs/loop.md")
        raise LoopConfigError(f"invalid loop config {path}: {why}") from None
    if cfg.budget.seconds is None and cfg.budget.policy_versions is None:
        raise LoopConfigError(f"invalid loop config {path}: `budget` needs `seconds` and/or `policy_versions`")
    from rollout.envs import domains as known

    unknown = sorted(set(cfg.rollout.domains + (cfg.eval.domains or [])) - set(known()))
    if unknown:
        raise LoopConfigError(f"invalid loop config {path}: unknown domains {', '.join(unknown)}; "
                              f"known: {', '.join(known())}")
    from rollout.envs import max_difficulty

    for key, doms, levels in (("rollout.levels", cfg.rollout.domains, cfg.rollout.levels or []),
                              ("eval.levels", cfg.eval.domains or cfg.rollout.domains, cfg.eval.levels)):
        for d in doms:
            bad = sorted({lv for lv in levels if not 0 <= lv <= max_difficulty(d)})
            if bad:
                raise LoopConfigError(f"invalid loop config {path}: `{key}` {bad} not levels of domain {d} "
                                      f"(0..{max_difficulty(d)})")
    return cfg


# ---------------------------------------------------------------------------------------------- run dir


def read_evaluations(path: Path) -> dict[int, dict[str, Any]]:
    """The evaluator's JSON lines (``trajpipe eval --follow``) by policy version; the newest line of a version wins.

    Only finished evaluations count: one cut short by a stop (fewer ``episodes`` than ``tasks``, or any
    ``aborted``) did not evaluate the version and is skipped; the evaluator runs it again (its consumer group
    was not committed).

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "evals.jsonl"
        >>> _ = p.write_text('{"policy_version": 1, "pass_rate": 0.5, "tasks": 2, "episodes": 2, "aborted": 0}\\n'
        ...                  '{"policy_version": 2, "pass_rate": 0.0, "tasks": 2, "episodes": 1, "aborted": 1}\\n')
        >>> sorted(read_evaluations(p))
        [1]
    """
    out: dict[int, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("policy_version"), int) and "pass_rate" in doc \
                and doc.get("episodes") and not doc.get("aborted") and doc["episodes"] >= doc.get("tasks", 0):
            out[doc["policy_version"]] = doc
    return out


def _under_root(name: str, doc: str) -> property:
    """A :class:`LoopPaths` entry: ``root / name``."""
    return property(lambda self: self.root / name, doc=doc)


@dataclass(frozen=True)
class LoopPaths:
    """Where a run keeps its parts (all under ``run_dir``)."""

    root: Path

    state = _under_root("loop.json", "bootstrap, lineage, recorded child pids, invocations")
    logs = _under_root("logs", "one log per child process")
    broker = _under_root("broker", "the embedded broker's data dir")
    archive = _under_root("archive", "the event archive")
    data = _under_root("data", "the dataset root")
    train = _under_root("train", "the trainer's run dir (checkpoints, policies)")
    train_config = _under_root("train.yaml", "the trainer recipe built from the loop config")
    evals = _under_root("evals.jsonl", "the evaluator's JSON lines (one per evaluated version)")

    def spool(self, name: str) -> Path:
        return self.root / "spool" / name

    def scheduler_state(self, worker: int) -> Path:
        return self.root / f"scheduler-{worker}.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _free_port(preferred: int | None = None) -> int:
    """``preferred`` if free, else a new port below the ephemeral range (the loop restarts its broker on it)."""
    if preferred:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    return free_port(restartable=True)


def _policy_record(model: Path) -> dict[str, Any]:
    doc = _read_json(model / "policy.json")
    return {"version": int(doc.get("version", 0)), "lineage": str(doc.get("lineage", ""))}


# ---------------------------------------------------------------------------------------------- children


@dataclass
class Child:
    """One loop process: its command, log, and restarts."""

    name: str
    argv: list[str]
    log: Path
    stdout: Path | None = None  # its stdout goes here (JSON lines) instead of the log
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list[int] = field(default_factory=list)
    stopping: bool = False
    argv_on_restart: Callable[[], list[str]] | None = None
    spool: Path | None = None  # its producer spool (TRAJPIPE_SPOOL_DIR)
    exit_with_loop: bool = True  # SIGTERM when the loop dies (trajpipe/lifeline.py); not the broker's starter

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        err = open(self.log, "ab")
        out = open(self.stdout, "ab") if self.stdout is not None else err
        err.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} $ {' '.join(self.argv)}\n".encode())
        err.flush()
        # Own session: a Ctrl-C at the terminal reaches the loop only, which stops the children in order.
        # The lifeline: a loop killed itself (kill -9) cannot stop them, so each ends by itself when the loop
        # dies (PR_SET_PDEATHSIG fires when the starting *thread* exits: children are started from the main one).
        # Own spool dir: two producers may not share one (and never the caller's working directory).
        child_env = {**env, **({"TRAJPIPE_SPOOL_DIR": str(self.spool)} if self.spool else {}),
                     **(lifeline_env(os.getpid()) if self.exit_with_loop else {})}
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env,
                                     start_new_session=True)
        err.close()
        if out is not err:
            out.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # its session: vLLM's engine processes too
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL (the part restarts from its durable state)."""
        self.stopping = True
        self.signal(signal.SIGTERM)
        code = self.wait(timeout_s)
        if code is None and self.proc is not None:
            log.warning("%s did not stop within %.0f s of SIGTERM: killed", self.name, timeout_s)
            self.signal(signal.SIGKILL)
            code = self.wait(30)
        return code


def _trajpipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "trajpipe", *args]


def _pid_alive_with(pid: int, marker: str) -> bool:
    """``pid`` runs (not a zombie) and is a child of this run: ``marker`` (the run dir) is in its command line
    or its environment (every child's ``TRAJPIPE_SPOOL_DIR`` is under the run dir; the evaluator's argv is not)."""
    try:
        if "\tZ" in Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1][:3]:
            return False
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, IndexError):
        return False
    return marker.encode() in cmdline or marker.encode() in environ


class Loop:
    """Starts, watches, restarts and stops the loop's processes (see the module docstring)."""

    def __init__(self, cfg: LoopConfig, *, resume: bool, echo: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.resume = resume
        self.echo = echo
        self.paths = LoopPaths(Path(cfg.run_dir).resolve())
        self.model = Path(cfg.model).resolve()
        self.start_policy = _policy_record(self.model)
        self.children: dict[str, Child] = {}
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.failed: str | None = None
        self.t0 = time.monotonic()
        self.state: dict[str, Any] = {}
        self.bootstrap = cfg.bootstrap or ""
        self.env: dict[str, str] = {}
        self._lock_file = None
        self._last_events: tuple[float, int] | None = None
        self._conn = None
        self._topics = None
        self._evals_seen = 0
        self.oneshots: list[Child] = []  # the warm start's evaluation: it ends by itself, never restarted

    # -- setup -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check the run dir and the model, lock the run dir, write the trainer recipe."""
        from trajpipe.cli import _check_model_dir

        root = self.paths.root
        if root.exists() and not root.is_dir():
            raise LoopConfigError(f"`run_dir` {root} is a file; give a directory")
        exists = self.paths.state.is_file()
        if self.resume and not exists:
            raise LoopConfigError(f"`--resume`: {root} holds no loop run (no loop.json); start it without --resume")
        if not self.resume and root.exists() and any(root.iterdir()):
            raise LoopConfigError(f"`run_dir` {root} is not empty; continue that run with --resume or give a new "
                                  "run_dir")
        _check_model_dir(self.model, flag="model")
        root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(root / ".lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LoopConfigError(f"another `trajpipe loop` runs in {root}; stop it first") from None
        for d in (self.paths.logs, self.paths.data, self.paths.archive, self.paths.train):
            d.mkdir(parents=True, exist_ok=True)
        self.state = _read_json(self.paths.state) if self.resume else {}
        if self.resume and self.state.get("model") not in (None, str(self.model)):
            raise LoopConfigError(f"`model` {self.model} differs from the run's {self.state['model']}; a resumed run "
                                  "keeps its warm start")
        self._stop_leftovers()
        self.state.setdefault("model", str(self.model))
        self.state.setdefault("start_version", self.start_policy["version"])
        self.state.setdefault("lineage", self.start_policy["lineage"] or f"loop-{uuid.uuid4().hex[:12]}")
        self.state.setdefault("eval_group", f"trajpipe-eval-{uuid.uuid4().hex[:12]}")
        self.state["invocations"] = int(self.state.get("invocations", 0)) + 1
        self._write_train_config()
        _write_json(self.paths.state, self.state)

    def _stop_leftovers(self) -> None:
        """Stop children of a killed loop still up (recorded pids): they end with the loop (trajpipe/lifeline.py),
        but one may be slow to, and without PR_SET_PDEATHSIG (not Linux) none does."""
        for name, pid in (self.state.get("pids") or {}).items():
            if _pid_alive_with(int(pid), str(self.paths.root)):
                self.echo(f"loop: stopping {name} (pid {pid}) left over by the previous invocation")
                try:
                    os.killpg(int(pid), signal.SIGTERM)
                except ProcessLookupError:
                    continue
                for _ in range(100):
                    if not _pid_alive_with(int(pid), str(self.paths.root)):
                        break
                    time.sleep(0.2)
                else:
                    os.killpg(int(pid), signal.SIGKILL)
        self.state["pids"] = {}

    def _write_train_config(self) -> None:
        from trainer.config import ConfigError as TrainConfigError
        from trainer.config import load_train_config

        src = Path(self.cfg.trainer.config)
        if not src.is_file() and (_REPO / src).is_file():
            src = _REPO / src
        try:
            base = yaml.safe_load(src.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise LoopConfigError(f"`trainer.config` {src}: {' '.join(str(err).split())}") from None
        if not isinstance(base, dict):
            raise LoopConfigError(f"`trainer.config` {src} is not a mapping of training settings")
        doc = deep_merge(base, self.cfg.trainer.overrides)
        doc = deep_merge(doc, {
            "mode": "online", "max_steps": 1_000_000_000,
            "publish": {"every": self.cfg.trainer.publish_every, "lineage": self.state["lineage"]},
            # A checkpoint at every publish: a trainer stopped or killed resumes at its last published version.
            "checkpoint": {"every": self.cfg.trainer.publish_every},
        })
        doc["publish"].pop("at_end", None)
        doc["publish"]["at_end"] = False  # a stop must not publish an extra, unplanned version
        try:
            train = load_train_config(None, **{"data.dir": str(self.paths.data), "model": str(self.model),
                                               "out": str(self.paths.train)}, **_flatten(doc))
        except TrainConfigError as err:
            raise LoopConfigError(f"`trainer`: {err}") from None
        # The staleness control's budget: the episodes one version consumes (one rank; episodes pack into
        # windows about one to one at these lengths), shared by the workers, and the trainer's staleness cap.
        per_version = train.data.batch_size * train.optim.grad_accum * self.cfg.trainer.publish_every
        self.samples_per_version = -(-per_version // self.cfg.rollout.workers)
        self.max_ahead = train.objective.max_staleness  # None: no cap, so nothing to hold the rollouts to
        text = yaml.safe_dump(doc, sort_keys=False)
        cmd = (f"# trajpipe train --config {self.paths.train_config} --data {self.paths.data} --model {self.model} "
               f"--out {self.paths.train} --bootstrap B   (written by trajpipe loop from {src})\n")
        self.paths.train_config.write_text(cmd + text)

    def start_broker(self) -> None:
        if self.cfg.bootstrap:
            return
        from streams.broker import broker_status

        info = broker_status(self.paths.broker)
        if info is not None:
            self.bootstrap = info.bootstrap
            self.echo(f"loop: broker of the run already up at {info.bootstrap}")
        else:
            port = self.cfg.broker.port or _free_port(self.state.get("broker_port"))
            child = Child("broker", _trajpipe("broker", "start", "--engine", self.cfg.broker.engine, "--port",
                                              str(port), "--data-dir", str(self.paths.broker)),
                          self.paths.logs / "broker.log", stdout=self.paths.logs / "broker.out",
                          exit_with_loop=False)  # the broker outlives a killed loop; --resume reuses it
            child.start(self.env)
            code = child.wait(180)
            if code != 0:
                raise LoopConfigError(f"the embedded broker did not start (status {code}); see {child.log}")
            self.bootstrap = f"127.0.0.1:{port}"
            self.state["broker_port"] = port
            self.echo(f"loop: embedded {self.cfg.broker.engine} broker at {self.bootstrap} "
                      f"(data {self.paths.broker})")
        self.state["bootstrap"] = self.bootstrap

    def stop_broker(self) -> None:
        if self.cfg.bootstrap or self.cfg.broker.keep_running:
            return
        subprocess.run(_trajpipe("broker", "stop", "--data-dir", str(self.paths.broker)), env=self.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)

    # -- the children ----------------------------------------------------------------------------

    def build_children(self) -> None:
        c, p, B = self.cfg, self.paths, self.bootstrap
        r = c.rollout
        for i in range(r.workers):
            name = f"rollout-{i}"
            argv = _trajpipe(
                "rollout", "--bootstrap", B, "--episodes", str(UNBOUNDED_EPISODES), "--policy", r.policy,
                "--model", str(self.model), "--domains", ",".join(r.domains), "--group-size", str(r.group_size),
                *(["--levels", ",".join(map(str, r.levels))] if r.levels else []),
                "--task-pool", str(r.task_pool), "--concurrency", str(r.concurrency), "--max-steps",
                str(r.max_steps), "--max-tokens", str(r.max_tokens), "--temperature", str(r.temperature),
                "--seed", str(r.seed + 1000 * i), "--producer-id", f"loop-{name}",
                "--scheduler-state", str(p.scheduler_state(i)), "--spool-dir", str(p.spool(name)),
                *(["--samples-per-version", str(self.samples_per_version), "--max-ahead", str(self.max_ahead)]
                  if r.staleness_control and self.max_ahead is not None else []))
            self.children[name] = Child(name, argv, p.logs / f"{name}.log")
        self.children["archiver"] = Child("archiver", _trajpipe(
            "archive", "--bootstrap", B, "--out", str(p.archive), "--poll-interval", "1", "--commit-every", "5000",
            "--spool-dir", str(p.spool("archiver"))), p.logs / "archiver.log")
        pl = c.pipeline
        pipe = ["pipeline", "run", "--source", "kafka", "--bootstrap", B, "--out", str(p.data), "--recipe",
                pl.recipe, "--group-timeout", str(pl.group_timeout_s), "--incomplete-after", str(pl.incomplete_after_s)]
        if pl.mode == "stream":
            pipe += ["--mode", "stream", "--window-s", str(pl.window_s)]
        else:
            pipe += ["--loop", str(pl.interval_s)]
        if pl.runner:
            pipe += ["--runner", pl.runner]
        self.children["pipeline"] = Child("pipeline", _trajpipe(*pipe), p.logs / "pipeline.log")
        train = ["train", "--config", str(p.train_config), "--data", str(p.data), "--recipe", self.recipe_version(),
                 "--model", str(self.model), "--out", str(p.train), "--bootstrap", B]
        trainer = Child("trainer", _trajpipe(*train, *(["--resume"] if self._has_checkpoint() else [])),
                        p.logs / "trainer.log")
        trainer.argv_on_restart = lambda: _trajpipe(*train, *(["--resume"] if self._has_checkpoint() else []))
        self.children["trainer"] = trainer
        if c.eval.enabled:
            e = c.eval
            ev = ["eval", "--bootstrap", B, "--policy-version", "latest", "--follow", "--policy", e.policy,
                  "--domains", ",".join(e.domains or r.domains), "--levels", ",".join(map(str, e.levels)),
                  "--tasks-per-level", str(e.tasks_per_level), "--max-steps", str(e.max_steps or r.max_steps),
                  "--max-tokens", str(e.max_tokens or r.max_tokens), "--temperature", str(e.temperature),
                  # resumable: a restart (or --resume) evaluates every version of the run not evaluated yet
                  "--group", self.state["eval_group"], "--lineage", self.state["lineage"]]
            self.children["evaluator"] = Child("evaluator", _trajpipe(*ev), p.logs / "evaluator.log", stdout=p.evals)
        for child in self.children.values():
            child.spool = p.spool(child.name)

    def recipe_version(self) -> str:
        from pipelines.recipes import RecipeError, load_recipe

        try:
            return load_recipe(self.cfg.pipeline.recipe).version
        except RecipeError as err:
            raise LoopConfigError(f"`pipeline.recipe`: {err}") from None

    def _has_checkpoint(self) -> bool:
        ckpt = self.paths.train / "checkpoints"
        return ckpt.is_dir() and any(ckpt.glob("step-*"))

    def start_children(self) -> None:
        # Consumers first, producers last: the archiver and the job are reading when the first event lands.
        order = ["archiver", "pipeline", "trainer", "evaluator"] + [n for n in self.children if n.startswith("rollout")]
        for name in order:
            if name in self.children:
                self.children[name].start(self.env)
                self.echo(f"loop: started {name} (pid {self.children[name].pid}), log {self.children[name].log}")
        evaluator = self.children.get("evaluator")
        if evaluator is not None and self.cfg.eval.warm_start and not self.resume:
            argv = [a for a in evaluator.argv if a != "--follow"]
            i = argv.index("--policy-version")
            argv[i:i + 2] = ["--model", str(self.model)]
            i = argv.index("--group")  # a one-off, not a follower
            del argv[i:i + 2]
            baseline = Child("eval-warm-start", argv, evaluator.log, stdout=self.paths.evals,
                             spool=self.paths.spool("eval-warm-start"))
            baseline.start(self.env)
            self.oneshots.append(baseline)
            self.echo(f"loop: evaluating the warm start v{self.state['start_version']} (pid {baseline.pid})")
        self._record_pids()

    def _record_pids(self) -> None:
        self.state["pids"] = {n: c.pid for n, c in [*self.children.items(), *((c.name, c) for c in self.oneshots)]
                              if c.pid is not None and c.poll() is None}
        self.state["argv"] = {n: c.argv for n, c in self.children.items()}
        _write_json(self.paths.state, self.state)

    def check_children(self) -> None:
        """Restart a child that exited (bounded), or stop the loop naming it."""
        for child in self.children.values():
            code = child.poll()
            if code is None or child.stopping:
                continue
            child.exits.append(code)
            tail = _tail(child.log)
            if child.restarts >= self.cfg.restarts.max_per_child:
                self.failed = (f"{child.name} exited with status {code} {child.restarts + 1} times "
                               f"(restarts.max_per_child {self.cfg.restarts.max_per_child}); see {child.log}"
                               + (f": {tail}" if tail else ""))
                self.request_stop("child failed")
                return
            child.restarts += 1
            if child.argv_on_restart is not None:
                child.argv = child.argv_on_restart()
            self.echo(f"loop: {child.name} exited with status {code}; restart {child.restarts}/"
                      f"{self.cfg.restarts.max_per_child}" + (f" (last line: {tail})" if tail else ""))
            child.start(self.env)
            self._record_pids()

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.stop_event.set()

    # -- observation -----------------------------------------------------------------------------

    def _kafka(self):
        if self._conn is None:
            from trajpipe.settings import load_settings

            settings = load_settings(None, bootstrap=self.bootstrap)
            self._conn = settings.connection(client_id="trajpipe-loop")
            self._topics = settings.topic_names()
        return self._conn, self._topics

    def topic_end(self) -> dict[int, int] | None:
        from streams.consumer import end_offsets

        conn, topics = self._kafka()
        try:
            return end_offsets(conn, topics.events, timeout_s=15.0)
        except Exception as err:  # noqa: BLE001 - progress only: the topic may not exist yet, a broker may restart
            log.debug("end offsets of %s: %s", topics.events, err)
            return None

    def archive_offsets(self) -> dict[int, int]:
        from streams.archive import ArchiveError, read_commits

        out: dict[int, int] = {}
        try:
            commits = read_commits(self.paths.archive)
        except (ArchiveError, OSError):
            return out
        for c in commits:
            for part, r in c.offsets.items():
                out[int(part)] = max(out.get(int(part), 0), r.end)
        return out

    def dataset_offsets(self) -> dict[int, int]:
        from pipelines.commit import CommitError, DatasetLayout, covered_offsets, read_manifests

        _, topics = self._kafka()
        version = self.recipe_version()
        try:
            manifests = read_manifests(DatasetLayout(out=str(self.paths.data), version=version, recipe_hash=""))
        except (CommitError, OSError):
            return {}
        return covered_offsets(manifests, topics.events)

    def policy_versions(self) -> list[int]:
        store = self.paths.train / "policies"
        out = []
        for p in store.glob("v*") if store.is_dir() else []:
            if p.is_dir() and p.name[1:].isdigit() and (p / "policy.json").is_file():
                out.append(int(p.name[1:]))
        return sorted(out)

    def trainer_progress(self) -> dict[str, float]:
        """The last step's metrics line of the trainer (``metrics.jsonl``)."""
        path = self.paths.train / "metrics.jsonl"
        last: dict[str, float] = {}
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 65536))
                for line in f.read().decode(errors="replace").splitlines():
                    try:
                        doc = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(doc, dict) and "step" in doc:
                        last = doc
        except OSError:
            pass
        return last

    def evaluations(self) -> dict[int, dict[str, Any]]:
        """The evaluator's JSON lines by policy version (the newest line of a version wins)."""
        return read_evaluations(self.paths.evals)

    def progress_line(self) -> str:
        now = time.monotonic()
        end = self.topic_end()
        events = sum(end.values()) if end else None
        rate = ""
        if events is not None:
            if self._last_events is not None and now > self._last_events[0]:
                rate = f" ({(events - self._last_events[1]) / (now - self._last_events[0]):.1f}/s)"
            self._last_events = (now, events)
        lag = ""
        if end:
            arch, data = self.archive_offsets(), self.dataset_offsets()
            lag = (f" | lag: archive {sum(e - arch.get(p, 0) for p, e in end.items())}, "
                   f"datasets {sum(e - data.get(p, 0) for p, e in end.items())} events")
        versions = self.policy_versions()
        tp = self.trainer_progress()
        step = f"step {tp.get('step')}" if tp else "no step yet"
        stale = f", staleness {tp['train/staleness']:.2f}" if "train/staleness" in tp else ""
        evals = self.evaluations()
        ev = " ".join(f"v{v} {d['pass_rate']:.2f}" for v, d in sorted(evals.items())) or "-"
        vtxt = f"v{versions[-1]}" if versions else f"v{self.state['start_version']} (warm start)"
        return (f"[{now - self.t0:6.0f}s] policy {vtxt} | trainer {step}{stale} | events "
                f"{events if events is not None else '?'}{rate}{lag} | pass rate {ev}")

    def _progress(self) -> None:
        while not self.stop_event.wait(self.cfg.progress_every_s):
            try:
                line = self.progress_line()
            except Exception as err:  # noqa: BLE001 - progress must never end the loop
                line = f"loop: progress unavailable ({type(err).__name__}: {err})"
            if not self.stop_event.is_set():
                self.echo(line)

    def report_new_evaluations(self) -> None:
        evals = self.evaluations()
        if len(evals) == self._evals_seen:
            return
        self._evals_seen = len(evals)
        for v, d in sorted(evals.items())[-1:]:
            per = " ".join(f"{k} {x.get('passed')}/{x.get('episodes')}"
                           for k, x in sorted((d.get("by_domain_level") or {}).items()))
            self.echo(f"loop: evaluated v{v}: pass rate {d['pass_rate']:.3f} ({d.get('passed')}/"
                      f"{d.get('episodes')}) {per}")

    # -- budget and stop -------------------------------------------------------------------------

    def budget_reached(self) -> str | None:
        b = self.cfg.budget
        if b.seconds is not None and time.monotonic() - self.t0 >= b.seconds:
            return f"budget: {b.seconds:g} s"
        if b.policy_versions is not None:
            versions = self.policy_versions()
            if versions and versions[-1] >= self.state["start_version"] + b.policy_versions:
                return f"budget: {b.policy_versions} policy versions (v{versions[-1]})"
        return None

    def _wait_until(self, what: str, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(1.0)
        self.echo(f"loop: {what} did not happen within {timeout_s:g} s; stopping anyway (what is not consumed stays "
                  "in Kafka for --resume)")
        return False

    def _report_unevaluated(self) -> None:
        """At stop: the versions without a finished evaluation (the evaluator's group still has them pending)."""
        evaluator = self.children["evaluator"]
        evals = self.evaluations()
        missing = [v for v in self.policy_versions() if v not in evals]
        if missing:
            self.echo(f"loop: not evaluated at stop: {', '.join(f'v{v}' for v in missing)} (see {evaluator.log}); the "
                      f"next --resume evaluates them first (or `trajpipe eval --policy-version V`)")

    def _covered(self, offsets: Callable[[], dict[int, int]], end: dict[int, int] | None, name: str) -> bool:
        child = self.children.get(name)
        if child is not None and child.poll() is not None:
            return True  # dead: nothing more will come; its committed offsets are where --resume starts
        if end is None:
            return False
        have = offsets()
        return all(have.get(p, 0) >= e for p, e in end.items())

    def shutdown(self) -> None:
        """Producers first, then the consumers once they cover the topic (see the module docstring)."""
        t = self.cfg.drain_timeout_s
        for name, child in self.children.items():
            child.stopping = True
        rollouts = [c for n, c in self.children.items() if n.startswith("rollout")]
        for c in rollouts:
            c.signal(signal.SIGTERM)
        for c in rollouts:
            if c.wait(t) is None:
                c.stop(10)
        self.echo("loop: rollout workers stopped (events flushed)")
        if "trainer" in self.children:
            self.children["trainer"].stop(60)
            self.echo("loop: trainer stopped")
        evaluator = self.children.get("evaluator")
        if evaluator is not None:
            # It evaluates the versions in order: once it has the newest, it has all (but one it could not load).
            versions = self.policy_versions()
            if versions and evaluator.poll() is None and self.failed is None and self.stop_reason != "signal":
                self._wait_until(f"evaluation of v{versions[-1]}",
                                 lambda: versions[-1] in self.evaluations() or evaluator.poll() is not None, t)
            evaluator.stop(60)
            self.echo("loop: evaluator stopped")
            for one in self.oneshots:
                if one.poll() is None and (self.failed is not None or self.stop_reason == "signal"
                                           or one.wait(self.cfg.drain_timeout_s) is None):
                    one.stop(30)
            self._report_unevaluated()
        end = self.topic_end()
        if "pipeline" in self.children:
            self._wait_until("datasets covering the topic",
                             lambda: self._covered(self.dataset_offsets, end, "pipeline"), t)
            self.children["pipeline"].stop(60)
            self.echo("loop: pipeline stopped")
        if "archiver" in self.children:
            self._wait_until("archive covering the topic",
                             lambda: self._covered(self.archive_offsets, end, "archiver"), t)
            self.children["archiver"].stop(60)
            self.echo("loop: archiver stopped")
        self.state["pids"] = {}
        _write_json(self.paths.state, self.state)

    # -- main ------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.prepare()
        self._evals_seen = len(self.evaluations())  # --resume: announce only what this invocation evaluates
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.start_broker()
        _write_json(self.paths.state, self.state)
        try:
            self.build_children()
            self._record_pids()
            self.echo(f"loop: run {self.paths.root} ({'resumed, invocation ' + str(self.state['invocations']) if self.resume else 'new'}),"
                      f" warm start {self.model} (v{self.state['start_version']}), lineage {self.state['lineage']}")
            self.start_children()
            # Progress reads Kafka and the manifests (slow on a busy machine): its own thread, so that the
            # budget and dead children are seen within a second.
            progress = threading.Thread(target=self._progress, name="loop-progress", daemon=True)
            progress.start()
            while not self.stop_event.wait(1.0):
                self.check_children()
                self.report_new_evaluations()
                reason = self.budget_reached()
                if reason:
                    self.request_stop(reason)
            self.echo(f"loop: stopping ({self.stop_reason})")
            self.shutdown()
            self.report_new_evaluations()
            summary = summarize(self.paths, start_version=self.state["start_version"],
                                seconds=time.monotonic() - self.t0, stopped_by=self.stop_reason,
                                restarts={n: c.restarts for n, c in self.children.items()},
                                topic_events=sum((self.topic_end() or {}).values()))
        finally:
            for child in [*self.children.values(), *self.oneshots]:  # anything still up (an error): not left behind
                if child.poll() is None:
                    child.stop(30)
            self.stop_broker()
        if self.failed:
            summary["error"] = self.failed
        return summary


def summarize(paths: LoopPaths, *, start_version: int, seconds: float, stopped_by: str,
              restarts: dict[str, int], topic_events: int) -> dict[str, Any]:
    """The loop's last line: versions, events, episodes, trained steps, pass rate per version."""
    versions = sorted(int(p.name[1:]) for p in (paths.train / "policies").glob("v*")
                      if p.name[1:].isdigit() and (p / "policy.json").is_file()) if (paths.train / "policies").is_dir() else []
    evals = read_evaluations(paths.evals)
    steps = 0
    metrics = paths.train / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("step"), int):
                steps = max(steps, doc["step"])
    archived = episodes = 0
    try:
        import duckdb

        con = duckdb.connect()
        from pipelines.query import register_views

        views = register_views(con, archive=paths.archive, data=paths.data)
        if "events" in views:
            archived = con.sql("select count(distinct event_id) from events").fetchall()[0][0]
        if "trajectories" in views:
            episodes = con.sql("select count(distinct episode_id) from trajectories").fetchall()[0][0]
    except Exception as err:  # noqa: BLE001 - the summary must still be printed
        log.warning("summary query failed: %s", err)
    return {
        "policy_versions": versions, "start_version": start_version,
        "latest_policy_version": versions[-1] if versions else start_version,
        "events": topic_events, "events_archived": archived, "episodes": episodes, "trained_steps": steps,
        "pass_rate_by_version": {str(v): d["pass_rate"] for v, d in sorted(evals.items())},
        "eval_episodes_by_version": {str(v): d.get("episodes") for v, d in sorted(evals.items())},
        "seconds": round(seconds, 1), "stopped_by": stopped_by, "restarts": restarts,
    }


def run_loop(cfg: LoopConfig, *, resume: bool, echo: Callable[[str], None]) -> dict[str, Any]:
    """Run the loop until its budget, a signal, or a child that keeps dying; return the summary.

    SIGINT and SIGTERM request the clean stop (a second one is ignored: the stop is under way).

    Raises:
        LoopConfigError: the run dir cannot be used, the model is not a model, the broker does not start.
    """
    logging.getLogger("kafka").setLevel(logging.ERROR)  # the progress reader's client: its warnings are noise here
    loop = Loop(cfg, resume=resume, echo=echo)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda *_: loop.request_stop("signal"))
    try:
        return loop.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------- helpers


def _tail(path: Path) -> str:
    """The last non-empty line of a log (progress bars and all), for the one-line reports."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").replace("\r", "\n").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln and not ln.startswith("====")]
    return lines[-1][:300] if lines else ""


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
