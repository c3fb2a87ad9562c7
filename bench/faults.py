"""Fault injection under steady load, then a reconciliation of everything that was acknowledged.

Real processes on a real broker, no mocks: an embedded Kafka broker; ``trajpipe synth``
and scripted ``trajpipe rollout`` producers, one run after another; the archiver following
the topic; the trajectory job in ``--loop``; the trainer in tail mode with checkpoints every
two steps. While they run, a driver injects faults at random moments:

* ``kill_<role>``: SIGKILL one process. Half of the archiver, pipeline and trainer kills
  wait until the process is inside a commit (temporary/staged files present) or a
  checkpoint (a ``step-<n>`` directory newer than ``latest``) and kill it there; what a
  kill hit is read from the files it left behind (``mid_commit_kills``,
  ``kills_after_commit_point``, ``mid_checkpoint_kills``), not assumed.
* ``kill_broker`` (SIGKILL the JVM, restart on the same log) and ``restart_broker``
  (graceful stop and start);
* ``spool_full``: with the broker down, a producer spools onto a 1 MiB tmpfs (as root;
  else a file-size limit) until the disk is full: it must stop with a clear error
  (no hang), and what an earlier run acknowledged into that spool must survive and replay;
* ``restart_all``: SIGKILL every process, the broker too, and start everything again.

A process that exits is restarted (a producer that did not finish runs its seed again).
At the end the driver stops injecting, lets the producers finish, replays the spools,
drains the archiver and the job, and reconciles:

* every acknowledged event (a synth run's ``--seed``/``--episodes`` that exited 0 with
  its counts line; a rollout run's ``events`` under its own ``--producer-id``) is in the
  archive (``events_lost``), and every Kafka record is archived exactly once
  (``archive_duplicate_records``, ``archive_missing_records``);
* every episode complete in the archive is in ``trajectories/`` exactly once as complete,
  and no other (``dataset_duplicates``, ``dataset_missing``, ``dataset_unexpected``;
  ``step_duplicates``); the commits cover the topic's offsets without gap or overlap and
  each commit's counts balance (``events_in + events_pending_in == events_used +
  events_incomplete + events_pending_out + dead_letters + duplicates + late_events``);
* the trainer's consumed samples (``samples.jsonl``) continue exactly across every crash:
  a step redone after a resume got the same samples (``trainer_redo_mismatches``), and the
  whole sequence equals an uninterrupted run on the final dataset
  (``trainer_sequence_mismatches``).

The last line printed is one JSON object: ``{"faults": N, "events_acknowledged": A,
"events_lost": 0, "dataset_duplicates": 0, ...}`` with per-kind counts.

Usage::

    make faults                                        # >= 50 faults
    .venv/bin/python -m bench.faults --min-faults 50 --keep /tmp/faults   # keep the work dir
    .venv/bin/python -m bench.run faults               # the bench version (fewer faults)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from schemas.manifests import commit_log_of, list_dataset_versions, read_dataset_manifests, read_dataset_records
from streams.broker import free_port

__all__ = ["FaultReport", "run_faults", "main"]

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("faults")

SYNTH_DOMAINS = "math,code"
SYNTH_EPISODES = 8  # two GRPO groups of 4 per run
ROLLOUT_EPISODES = 8
#: a process is killed only once it has run this long (start-up is most of a short run on 2 busy cores)
MIN_AGE_S = {"synth": 0.0, "rollout": 10.0, "archiver": 2.0, "pipeline": 20.0, "trainer": 45.0}
FAULT_WEIGHTS = {
    "kill_synth": 3.0, "kill_rollout": 2.0, "kill_archiver": 3.0, "kill_pipeline": 3.0, "kill_trainer": 2.0,
    "kill_broker": 1.5, "restart_broker": 1.0, "spool_full": 0.5, "restart_all": 0.4,
}
TRAIN_YAML = """\
# written by bench/faults.py: tail mode, checkpoints every 2 steps, every consumed sample id logged
mode: offline
max_steps: {max_steps}
seed: 0
objective:
  name: bc
data:
  mode: tail
  seq_len: 512
  batch_size: 2
  num_workers: 0
  poll_interval_s: 0.5
  idle_timeout_s: {idle_timeout}
optim:
  lr: 1.0e-5
  warmup_steps: 0
  grad_accum: 1
engine:
  zero_stage: 0
checkpoint:
  every: 2
  keep_last: 2
publish:
  lineage: faults
log_sample_ids: true
"""


@dataclass
class FaultReport:
    """What was injected and what the reconciliation found (see the module docstring)."""

    faults: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    mid_commit_kills: dict[str, int] = field(default_factory=lambda: {"archiver": 0, "pipeline": 0})
    kills_after_commit_point: dict[str, int] = field(default_factory=lambda: {"archiver": 0, "pipeline": 0})
    mid_checkpoint_kills: int = 0
    restarts: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, int] = field(default_factory=dict)
    broker_restarts: int = 0
    spool_full_clear_errors: int = 0
    spool_full_hangs: int = 0
    spool_full_mount: str = ""
    #: producers still running when the drain's deadline passed (each one's stacks are in the log)
    drain_timeouts: dict[str, int] = field(default_factory=dict)


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                return obj
    return None


def tail_lines(text: str, n: int) -> str:
    r"""The last ``n`` characters of ``text`` from the first line that starts in them.

    Examples:
        >>> tail_lines("recipe {...}\nerror: cannot reach Kafka\n", 30)
        'error: cannot reach Kafka\n'
        >>> tail_lines("one line longer than n", 6)  # no line starts in the tail: the plain cut
        'than n'
        >>> tail_lines("short", 100)
        'short'
    """
    if len(text) <= n:
        return text
    tail = text[-n:]
    if text[-n - 1] == "\n":
        return tail
    cut = tail.find("\n")
    return tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail


class _Proc:
    """One run of a role's command, its output in files."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path, n: int,
                 preexec: Callable[[], None] | None = None) -> None:
        self.name, self.argv, self.n = name, argv, n
        self.out_path, self.err_path = logs / f"{name}-{n}.out", logs / f"{name}-{n}.err"
        self.killed = False
        self.started = time.monotonic()
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=preexec)

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the process and everything in its session (sandboxes, Beam workers)."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()

    def dump_stacks(self) -> None:
        """Have the running command write every thread's stack to its stderr (SIGUSR1, trajpipe/cli.py)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGUSR1)
        time.sleep(2.0)

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of its stderr, from the first whole line in them (one line longer than
        ``n`` is cut). Was a plain cut, which began the bench log's "exited 2 unasked" lines mid-line with
        the end of the recipe the job prints before its error line."""
        return tail_lines(self.err_path.read_text(errors="replace"), n)


class _Cluster:
    """The broker and the supervised roles; restarts what exits, records what producers acknowledged."""

    def __init__(self, work: Path, *, rng: random.Random, report: FaultReport, vocab_size: int, tiny: Path) -> None:
        self.work, self.rng, self.report = work, rng, report
        self.vocab_size, self.tiny = vocab_size, tiny
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port(restartable=True)  # not one a client's connection may take while it is down
        self.broker_dir = work / "broker"
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "TRAJPIPE_TOPICS__PARTITIONS": "2",
                    "TRAJPIPE_SPOOL_DIR": str(work / "spool" / "default"), "TOKENIZERS_PARALLELISM": "false"}
        self.procs: dict[str, _Proc | None] = dict.fromkeys(("synth", "rollout", "archiver", "pipeline", "trainer"))
        self.runs = 0
        self.synth_seed = 1
        self.rollout_seed = 1
        self.rollout_attempt = 0
        self.acked_synth: list[tuple[int, int]] = []  # (seed, episodes) of synth runs that exited 0
        self.acked_rollout: dict[str, int] = {}  # producer id -> events acknowledged
        self.draining = False
        self.drain_rollout_failures = 0
        self.producers_done = {"synth": False, "rollout": False}

    # -- broker ----------------------------------------------------------------

    def start_broker(self) -> None:
        from streams.broker import start_broker

        start_broker(engine="kafka", port=self.port, data_dir=self.broker_dir, timeout_s=180)

    def stop_broker(self) -> None:
        from streams.broker import stop_broker

        stop_broker(self.broker_dir)

    def kill_broker(self) -> None:
        from streams.broker import broker_status

        info = broker_status(self.broker_dir)
        if info is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(info.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)

    # -- roles -------------------------------------------------------------------

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "trajpipe", *args]

    def _argv(self, role: str) -> list[str] | None:
        w = self.work
        if role == "synth":
            return self._py("synth", "--bootstrap", self.bootstrap, "--episodes", str(SYNTH_EPISODES),
                            "--seed", str(self.synth_seed), "--domains", SYNTH_DOMAINS,
                            "--vocab-size", str(self.vocab_size), "--spool-dir", str(w / "spool" / "synth"))
        if role == "rollout":
            self.rollout_attempt += 1
            return self._py("rollout", "--bootstrap", self.bootstrap, "--policy", "scripted", "--model", str(self.tiny),
                            "--episodes", str(ROLLOUT_EPISODES), "--seed", str(self.rollout_seed),
                            "--domains", "math", "--concurrency", "2", "--no-follow-policies",
                            "--producer-id", f"faults-r{self.rollout_seed}-a{self.rollout_attempt}",
                            "--spool-dir", str(w / "spool" / "rollout"))
        if role == "archiver":
            return self._py("archive", "--bootstrap", self.bootstrap, "--out", str(w / "archive"),
                            "--poll-interval", "0.5", "--spool-dir", str(w / "spool" / "archiver"))
        if role == "pipeline":
            return self._py("pipeline", "run", "--source", "kafka", "--bootstrap", self.bootstrap,
                            "--out", str(w / "data"), "--loop", "1", *self.pipeline_args())
        if role == "trainer":
            return self._py("train", "--config", str(w / "train.yaml"), "--data", str(w / "data"),
                            "--model", str(self.tiny), "--out", str(w / "train"), "--resume")
        raise ValueError(role)

    @staticmethod
    def pipeline_args() -> list[str]:
        # Synthetic event times are fixed in January: no episode or group may time out on the event-time clock
        # (a killed producer's unfinished episodes stay pending, every GRPO group waits for its members).
        return ["--incomplete-after", "1e9", "--group-timeout", "1e9"]

    def start(self, role: str) -> None:
        argv = self._argv(role)
        self.runs += 1
        self.procs[role] = _Proc(role, argv, self.env, self.logs, self.runs)

    def _wanted(self, role: str) -> bool:
        if self.producers_done.get(role, False):
            return False
        # The trainer starts once the first dataset commit exists (DeepSpeed's start-up is the slow part).
        return role != "trainer" or any(read_dataset_records(self.work / "data", v)
                                         for v in list_dataset_versions(self.work / "data"))

    def start_all(self) -> None:
        for role in self.procs:
            if self.procs[role] is None and self._wanted(role):
                self.start(role)

    def tick(self) -> None:
        """Handle exited processes: record what a producer acknowledged, restart the role."""
        for role, proc in self.procs.items():
            if proc is None:
                if self._wanted(role):
                    self.start(role)
                continue
            if proc.poll() is None:
                continue
            rc = proc.poll()
            self.procs[role] = None
            if role == "synth":
                counts = _last_json(proc.stdout()) if rc == 0 else None
                if counts is not None:
                    self.acked_synth.append((self.synth_seed, int(counts["episodes"])))
                    self.synth_seed += 1
                    if self.draining:
                        self.producers_done["synth"] = True
            elif role == "rollout":
                counts = _last_json(proc.stdout()) if rc == 0 else None
                if counts is not None:
                    pid = proc.argv[proc.argv.index("--producer-id") + 1]
                    self.acked_rollout[pid] = int(counts["events"])
                    self.rollout_seed += 1
                    if self.draining:
                        self.producers_done["rollout"] = True
                elif self.draining:  # one that did not finish left unfinished episodes only: retried twice at most
                    self.drain_rollout_failures += 1
                    self.producers_done["rollout"] = self.drain_rollout_failures > 2
            if rc != 0 and not proc.killed:
                self.report.unexpected_exits[role] = self.report.unexpected_exits.get(role, 0) + 1
                log.warning("%s exited %s unasked: %s", role, rc, proc.stderr_tail(600))
            if self._wanted(role):
                if rc != 0 or role in ("archiver", "pipeline", "trainer"):
                    self.report.restarts[role] = self.report.restarts.get(role, 0) + 1
                self.start(role)

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(0.1)

    def kill(self, role: str) -> _Proc | None:
        proc = self.procs.get(role)
        if proc is None or proc.poll() is not None:
            return None
        proc.kill()
        return proc

    def killable(self, role: str) -> bool:
        proc = self.procs.get(role)
        return proc is not None and proc.poll() is None and time.monotonic() - proc.started >= MIN_AGE_S[role]

    def dump_stuck_producers(self) -> None:
        """Producers still running at the drain deadline: their stacks (SIGUSR1, trajpipe/cli.py) logged and counted."""
        for role, done in self.producers_done.items():
            proc = self.procs.get(role)
            if done or proc is None or proc.poll() is not None:
                continue
            self.report.drain_timeouts[role] = self.report.drain_timeouts.get(role, 0) + 1
            proc.dump_stacks()
            log.warning("%s (%s) still running at the drain deadline; its stacks: %s", role, proc.err_path,
                        proc.stderr_tail(8000))

    def kill_all(self) -> None:
        for role in self.procs:
            self.kill(role)


# -- what a kill hit, read from the files it left ----------------------------------------------------


def _archive_in_commit(archive: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(archive):
            if entry.name.startswith("bucket=") and entry.is_dir():
                if any(e.name.endswith(".tmp") for e in os.scandir(entry.path)):
                    return True
    return False


def _archive_after_commit_point(archive: Path) -> bool:
    """Temporary data files (``<file>.<run>.tmp``) of a made commit: killed between the commit point and the moves."""
    from streams.archive import read_commits

    with contextlib.suppress(Exception):
        commits = read_commits(archive)
        if commits and _archive_in_commit(archive):
            last = commits[-1]
            return any(any(archive.glob(f + ".*.tmp")) for f in _manifest_files(last))
    return False


def _manifest_files(manifest: Any) -> list[str]:
    files = getattr(manifest, "files", [])
    return [f if isinstance(f, str) else getattr(f, "path", "") for f in files]


def _pipeline_in_commit(data: Path) -> bool:
    staging = data / "_staging"
    with contextlib.suppress(FileNotFoundError):
        for version in os.scandir(staging):
            if any(True for _ in os.scandir(version.path)):
                return True
    return False


def _pipeline_after_commit_point(data: Path) -> bool:
    """A staged commit the commit log has (rolled forward on restart)."""
    staging = data / "_staging"
    with contextlib.suppress(FileNotFoundError):
        for version in os.scandir(staging):
            for commit in os.scandir(version.path):
                if commit.name.isdigit() and commit_log_of(data, version.name).head() >= int(commit.name):
                    return True
    return False


def _trainer_in_checkpoint(ckpt: Path) -> bool:
    """A ``step-<n>`` directory newer than the tag ``latest`` names: a checkpoint being written."""
    try:
        latest = (ckpt / "latest").read_text().strip()
        done = int(latest.split("-")[1]) if latest else -1
    except (FileNotFoundError, IndexError, ValueError):
        done = -1
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(ckpt):
            if entry.name.startswith("step-") and entry.name[5:].isdigit() and int(entry.name[5:]) > done:
                return True
    return False


def _kill_when(cluster: _Cluster, role: str, condition: Callable[[], bool], timeout_s: float) -> _Proc | None:
    """SIGKILL ``role`` as soon as ``condition()`` holds (polled every 2 ms), or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    proc = cluster.procs.get(role)
    while proc is not None and proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return cluster.kill(role)
        time.sleep(0.002)
    return cluster.kill(role)


# -- faults --------------------------------------------------------------------------------------------


class _Injector:
    def __init__(self, cluster: _Cluster, report: FaultReport, rng: random.Random) -> None:
        self.c, self.report, self.rng = cluster, report, rng
        self.spool_full_seed = 100_000
        self._mount: Path | None = None

    def _kill_in_commit(self, name: str, root: Path, in_commit, after_commit_point, bound_s: float) -> None:
        """SIGKILL ``name``; half the time only once it is inside a commit (half of those: once its manifest is
        written, before the renames), waiting at most ``bound_s``. What the kill hit is read from ``root``."""
        targeted = self.rng.random() < 0.5
        where = after_commit_point if self.rng.random() < 0.5 else in_commit
        _kill_when(self.c, name, lambda: where(root), bound_s if targeted else 0.0)
        if in_commit(root):
            self.report.mid_commit_kills[name] += 1
            if after_commit_point(root):
                self.report.kills_after_commit_point[name] += 1

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False when there was nothing to hit (not counted)."""
        c, w = self.c, self.c.work
        if kind.startswith("kill_") and kind != "kill_broker" and not c.killable(kind[5:]):
            return False
        if kind in ("kill_synth", "kill_rollout"):
            c.kill(kind[5:])
        elif kind == "kill_archiver":
            self._kill_in_commit("archiver", w / "archive", _archive_in_commit, _archive_after_commit_point, 20.0)
        elif kind == "kill_pipeline":
            self._kill_in_commit("pipeline", w / "data", _pipeline_in_commit, _pipeline_after_commit_point, 30.0)
        elif kind == "kill_trainer":
            targeted = self.rng.random() < 0.7
            _kill_when(c, "trainer", lambda: _trainer_in_checkpoint(w / "train" / "checkpoints"),
                       30.0 if targeted else 0.0)
            if _trainer_in_checkpoint(w / "train" / "checkpoints"):
                self.report.mid_checkpoint_kills += 1
        elif kind == "kill_broker":
            c.kill_broker()
            c.wait(self.rng.uniform(0.5, 3.0))
            c.start_broker()
            self.report.broker_restarts += 1
        elif kind == "restart_broker":
            c.stop_broker()
            c.wait(self.rng.uniform(0.5, 3.0))
            c.start_broker()
            self.report.broker_restarts += 1
        elif kind == "spool_full":
            self._spool_full()
        elif kind == "restart_all":
            c.kill_all()
            c.kill_broker()
            c.start_broker()
            self.report.broker_restarts += 1
        else:
            raise ValueError(kind)
        self.report.faults += 1
        self.report.by_kind[kind] = self.report.by_kind.get(kind, 0) + 1
        return True

    def _spool_full_dir(self) -> tuple[Path, Callable[[], None] | None]:
        """A 1 MiB tmpfs for the spool (root), else a 1 MiB file-size limit on the producer that fills it."""
        d = self.c.work / "spool" / "full"
        if self._mount is None:
            d.mkdir(parents=True, exist_ok=True)
            ok = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)],
                                                      capture_output=True).returncode == 0
            self._mount = d if ok else Path()
            self.report.spool_full_mount = "tmpfs size=1m" if ok else "RLIMIT_FSIZE 1 MiB"

        def limit() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

        return d, (None if self._mount == d else limit)

    def _spool_full(self) -> None:
        """Broker down: an acknowledged run into the spool, then one that fills its disk; broker up, replay."""
        c = self.c
        d, limit = self._spool_full_dir()
        c.stop_broker()
        acked_seed = self.spool_full_seed
        self.spool_full_seed += 2
        small = _Proc("spoolfull-ack", c._py("synth", "--bootstrap", c.bootstrap, "--episodes", "3",
                                             "--seed", str(acked_seed), "--domains", SYNTH_DOMAINS,
                                             "--vocab-size", str(c.vocab_size), "--spool-dir", str(d)),
                      c.env, c.logs, c.runs + 1)
        c.runs += 1
        if _wait_proc(c, small, 180) == 0 and _last_json(small.stdout()) is not None:
            c.acked_synth.append((acked_seed, 3))
        big = _Proc("spoolfull-fill", c._py("synth", "--bootstrap", c.bootstrap, "--episodes", "2000",
                                            "--seed", str(acked_seed + 1), "--domains", SYNTH_DOMAINS,
                                            "--vocab-size", str(c.vocab_size), "--spool-dir", str(d)),
                    c.env, c.logs, c.runs + 1, preexec=limit)
        c.runs += 1
        rc = _wait_proc(c, big, 240)
        if rc is None:
            self.report.spool_full_hangs += 1
            big.kill()
        elif rc != 0 and "cannot write the spool" in big.stderr_tail(4000):
            self.report.spool_full_clear_errors += 1
        else:
            log.warning("spool_full: the filling run exited %s without the spool error: %s", rc, big.stderr_tail(800))
        c.start_broker()
        self.report.broker_restarts += 1
        self.replay(d)

    def replay(self, spool_dir: Path) -> None:
        """Replay a spool with an empty producer run (it also drops a torn tail)."""
        c = self.c
        for _ in range(5):
            if not any(spool_dir.glob("*.spool")):
                return
            proc = _Proc("replay", c._py("synth", "--bootstrap", c.bootstrap, "--episodes", "0",
                                         "--vocab-size", str(c.vocab_size), "--spool-dir", str(spool_dir)),
                         c.env, c.logs, c.runs + 1)
            c.runs += 1
            _wait_proc(c, proc, 180)

    def close(self) -> None:
        if self._mount is not None and self._mount != Path():
            subprocess.run(["umount", "-l", str(self._mount)], capture_output=True)


def _wait_proc(cluster: _Cluster, proc: _Proc, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        cluster.tick()
        time.sleep(0.1)
    return proc.poll()


# -- reconciliation ------------------------------------------------------------------------------------


def _reconcile(c: _Cluster, out: dict[str, Any]) -> None:
    import duckdb

    from streams.config import KafkaConnection, Topics
    from streams.consumer import end_offsets
    from streams.synth import generate_episodes

    w = c.work
    topic = Topics().events
    ends = end_offsets(KafkaConnection(bootstrap_servers=c.bootstrap), topic)
    sql = duckdb.connect()
    sql.execute(f"create view archive as select * from read_parquet('{w}/archive/bucket=*/*.parquet', "
                "hive_partitioning=true)")
    # Archive: every Kafka record once.
    [(rows, distinct)] = sql.sql("select count(*), count(distinct (kafka_partition, kafka_offset)) from archive").fetchall()
    out["kafka_records"] = sum(ends.values())
    out["archive_duplicate_records"] = rows - distinct
    out["archive_missing_records"] = out["kafka_records"] - distinct
    archived = {r[0] for r in sql.sql("select distinct event_id from archive").fetchall()}
    out["archive_duplicate_events"] = rows - len(archived)  # transport duplicates (resends, replays): expected
    # Acknowledged events.
    acked, lost = 0, 0
    domains = SYNTH_DOMAINS.split(",")
    for seed, n in c.acked_synth:
        for ep in generate_episodes(n, domains=domains, seed=seed, vocab_size=c.vocab_size):
            for ev in ep:
                acked += 1
                lost += ev.event_id not in archived
    by_producer = dict(sql.sql("select producer_id, count(distinct event_id) from archive group by 1").fetchall())
    for pid, n in c.acked_rollout.items():
        acked += n
        lost += max(0, n - by_producer.get(pid, 0))
    out["events_acknowledged"] = acked
    out["events_lost"] = lost
    out["synth_runs_acknowledged"] = len(c.acked_synth)
    out["rollout_runs_acknowledged"] = len(c.acked_rollout)
    # Dataset: every episode complete in the archive once, as complete.
    complete = {r[0] for r in sql.sql(
        "select episode_id from archive group by 1 having bool_or(event_type = 'episode_started') "
        "and bool_or(event_type = 'episode_finished') and count(distinct seq) = max(seq) + 1").fetchall()}
    traj = dict(sql.sql(f"select episode_id, count(*) from read_parquet('{w}/data/trajectories/**/*.parquet', "
                        "hive_partitioning=true) where complete group by 1").fetchall())
    out["episodes_complete"] = len(complete)
    out["dataset_episodes"] = len(traj)
    out["dataset_duplicates"] = sum(n - 1 for n in traj.values())
    out["dataset_missing"] = len(complete - set(traj))
    out["dataset_unexpected"] = len(set(traj) - complete)
    [(steps, distinct_steps)] = sql.sql(
        f"select count(*), count(distinct (episode_id, step_index)) from "
        f"read_parquet('{w}/data/steps/**/*.parquet', hive_partitioning=true)").fetchall()
    out["step_duplicates"] = steps - distinct_steps
    # Commits: offsets covered without gap or overlap; each commit's counts balance.
    manifests = [m for v in list_dataset_versions(w / "data") for m in read_dataset_manifests(w / "data", v)]
    covered: dict[int, int] = {}
    gaps = 0
    unbalanced = 0
    totals = dict.fromkeys(("events_in", "events_used", "events_incomplete", "dead_letters", "duplicates",
                            "late_events"), 0)
    for m in manifests:
        for part, (start, end) in m.offsets.get(topic, {}).items():
            gaps += start != covered.get(int(part), 0)
            covered[int(part)] = end
        k = m.counts
        lhs = k.get("events_in", 0) + k.get("events_pending_in", 0)
        rhs = sum(k.get(x, 0) for x in ("events_used", "events_incomplete", "events_pending_out", "dead_letters",
                                         "duplicates", "late_events"))
        unbalanced += lhs != rhs
        for key in totals:
            totals[key] += k.get(key, 0)
    gaps += sum(covered.get(p, 0) != e for p, e in ends.items())
    out["dataset_commits"] = len(manifests)
    out["offset_gaps_or_overlaps"] = gaps
    out["commits_unbalanced"] = unbalanced
    last = manifests[-1].counts if manifests else {}
    out["events_pending_at_end"] = last.get("events_pending_out", 0)
    out["groups_held_at_end"] = last.get("groups_held", 0)
    # in = used + incomplete + still pending + dead letters + duplicates + late, over all commits
    out["counts_balance"] = (totals["events_in"] - totals["events_used"] - totals["events_incomplete"]
                             - out["events_pending_at_end"] - totals["dead_letters"] - totals["duplicates"]
                             - totals["late_events"])
    out.update({f"pipeline_{k}": v for k, v in totals.items()})


def _samples(path: Path) -> tuple[dict[int, list[list[str]]], int]:
    """step -> the sample ids logged for it (once per attempt), and the torn lines skipped."""
    steps: dict[int, list[list[str]]] = {}
    torn = 0
    if not path.exists():
        return steps, 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            torn += 1  # the line a SIGKILL cut
            continue
        if "step" in rec:
            steps.setdefault(int(rec["step"]), []).append(rec["sample_ids"])
    return steps, torn


def _check_trainer(c: _Cluster, out: dict[str, Any], timeout_s: float) -> None:
    w = c.work
    got, torn = _samples(w / "train" / "samples.jsonl")
    out["trainer_steps"] = max(got, default=0)
    out["trainer_steps_redone"] = sum(len(v) - 1 for v in got.values())
    out["trainer_redo_mismatches"] = sum(any(a != v[0] for a in v[1:]) for v in got.values())
    out["trainer_torn_sample_lines"] = torn
    if not got:
        out["trainer_sequence_mismatches"] = None
        return
    ref_dir = w / "train-ref"
    (w / "train-ref.yaml").write_text(TRAIN_YAML.format(max_steps=out["trainer_steps"], idle_timeout=20))
    proc = _Proc("trainer-ref", c._py("train", "--config", str(w / "train-ref.yaml"), "--data", str(w / "data"),
                                      "--model", str(c.tiny), "--out", str(ref_dir)),
                 c.env, c.logs, c.runs + 1)
    if _wait_proc(c, proc, timeout_s) != 0:
        proc.kill()
        raise RuntimeError(f"the reference trainer run failed: {proc.stderr_tail()}")
    ref, _ = _samples(ref_dir / "samples.jsonl")
    out["trainer_sequence_mismatches"] = sum(ref.get(s, [None])[0] != v[-1] for s, v in got.items())


# -- the run -------------------------------------------------------------------------------------------


def run_faults(work: Path, *, min_faults: int = 50, min_duration_s: float = 120.0, max_duration_s: float = 1800.0,
               seed: int = 0, weights: dict[str, float] | None = None) -> dict[str, Any]:
    """Run the load, inject at least ``min_faults`` faults, drain and reconcile; return the figures.

    Args:
        work: an empty scratch directory (broker log, spools, archive, datasets, trainer runs, logs).
        min_faults: inject at least this many faults (unless ``max_duration_s`` runs out first).
        min_duration_s: inject for at least this long.
        max_duration_s: stop injecting after this long even with fewer faults.
        seed: the driver's RNG seed (which fault, when).
        weights: relative frequency per fault kind (default :data:`FAULT_WEIGHTS`).
    """
    from rollout.model import init_tiny_model

    rng = random.Random(seed)
    report = FaultReport()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tiny = init_tiny_model(work / "tiny", seed=0)
    vocab_size = int(json.loads((tiny / "config.json").read_text())["vocab_size"])
    (work / "train.yaml").write_text(TRAIN_YAML.format(max_steps=1_000_000, idle_timeout="null"))
    c = _Cluster(work, rng=rng, report=report, vocab_size=vocab_size, tiny=tiny)
    injector = _Injector(c, report, rng)
    weights = weights or FAULT_WEIGHTS
    kinds, w = list(weights), list(weights.values())
    out: dict[str, Any] = {}
    try:
        c.start_broker()
        c.start_all()
        c.wait(15.0)  # steady load first
        t_inject = time.monotonic()
        while time.monotonic() - t_inject < max_duration_s and (
                report.faults < min_faults or time.monotonic() - t_inject < min_duration_s):
            c.wait(rng.uniform(1.5, 5.0))
            kind = rng.choices(kinds, w)[0]
            if kind == "spool_full" and report.by_kind.get("spool_full", 0) >= 3:
                continue
            forced_at = (min_faults // 5, min_faults // 2) if min_faults >= 20 else (min_faults // 2,)
            if "spool_full" in weights and report.faults in forced_at and report.by_kind.get("spool_full", 0) < 2:
                kind = "spool_full"  # at least once or twice per run, whatever the draw
            if injector.inject(kind):
                log.info("fault %d: %s", report.faults, kind)
        out["inject_s"] = round(time.monotonic() - t_inject, 1)
        # Drain: no more faults; producers finish their current run, spools replay, consumers catch up.
        c.draining = True
        deadline = time.monotonic() + 600
        while not all(c.producers_done.values()) and time.monotonic() < deadline:
            c.wait(0.5)
        c.dump_stuck_producers()
        for role in ("trainer", "archiver", "pipeline"):  # the trainer stops at a random moment like any kill
            c.producers_done[role] = True  # not restarted by tick()
            c.kill(role)
        for spool in ("synth", "rollout", "full"):
            injector.replay(work / "spool" / spool)
        _run_once(c, "archive-final", c._py("archive", "--bootstrap", c.bootstrap, "--out", str(work / "archive"),
                                            "--until-end", "--spool-dir", str(work / "spool" / "archiver")))
        _run_once(c, "pipeline-final", c._py("pipeline", "run", "--source", "kafka", "--bootstrap", c.bootstrap,
                                             "--out", str(work / "data"), *c.pipeline_args()))
        _reconcile(c, out)
        _check_trainer(c, out, timeout_s=900)
    finally:
        c.kill_all()
        with contextlib.suppress(Exception):
            c.stop_broker()
        injector.close()
    figures = {
        "faults": report.faults,
        **{k: out[k] for k in ("events_acknowledged", "events_lost", "dataset_duplicates")},
        "faults_by_kind": report.by_kind,
        "mid_commit_kills": report.mid_commit_kills,
        "kills_after_commit_point": report.kills_after_commit_point,
        "mid_checkpoint_kills": report.mid_checkpoint_kills,
        "restarts": report.restarts,
        "unexpected_exits": report.unexpected_exits,
        "broker_restarts": report.broker_restarts,
        "spool_full_clear_errors": report.spool_full_clear_errors,
        "spool_full_hangs": report.spool_full_hangs,
        "spool_full_disk": report.spool_full_mount,
        "drain_timeouts": report.drain_timeouts,
        **{k: v for k, v in out.items() if k not in ("events_acknowledged", "events_lost", "dataset_duplicates")},
        "duration_s": round(time.monotonic() - t0, 1),
    }
    figures["ok"] = _ok(figures)
    return figures


def _ok(f: dict[str, Any]) -> bool:
    """Whether the reconciliation found nothing wrong."""
    zero = ("events_lost", "dataset_duplicates", "dataset_missing", "dataset_unexpected", "step_duplicates",
            "archive_duplicate_records", "archive_missing_records", "offset_gaps_or_overlaps", "commits_unbalanced",
            "counts_balance", "trainer_redo_mismatches", "spool_full_hangs")
    return all(f.get(k) == 0 for k in zero) and f.get("trainer_sequence_mismatches") in (0, None)


def _run_once(c: _Cluster, name: str, argv: list[str], timeout_s: float = 600) -> dict:
    proc = _Proc(name, argv, c.env, c.logs, c.runs + 1)
    c.runs += 1
    rc = _wait_proc(c, proc, timeout_s)
    if rc is None:  # still running: its stacks into its stderr first
        proc.dump_stacks()
    if rc != 0:
        proc.kill()
        raise RuntimeError(f"{name} failed ({rc}): {proc.stderr_tail()}")
    return _last_json(proc.stdout()) or {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-faults", type=int, default=50, help="inject at least this many faults")
    parser.add_argument("--min-duration-s", type=float, default=120.0, help="inject for at least this long")
    parser.add_argument("--max-duration-s", type=float, default=1800.0, help="stop injecting after this long")
    parser.add_argument("--seed", type=int, default=0, help="the driver's RNG seed")
    parser.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kafka", "streams", "rollout", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.keep is not None:
        work = args.keep
        shutil.rmtree(work, ignore_errors=True)
        figures = run_faults(work, min_faults=args.min_faults, min_duration_s=args.min_duration_s,
                             max_duration_s=args.max_duration_s, seed=args.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="trajpipe-faults-") as tmp:
            figures = run_faults(Path(tmp), min_faults=args.min_faults, min_duration_s=args.min_duration_s,
                                 max_duration_s=args.max_duration_s, seed=args.seed)
    print(json.dumps(figures), flush=True)
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
