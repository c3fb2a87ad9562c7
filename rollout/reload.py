"""Policy reload: follow ``policy_published`` on the control topic, switch versions between episodes.

The trainer publishes each new policy version as a
:class:`schemas.events.PolicyPublished` event on the control topic
(``Settings.topic_names().control``), its ``location`` naming a model directory
(``config.json``, safetensors, tokenizer). A rollout worker runs a
:class:`PolicyFollower`: a background thread with a plain kafka-python consumer
(no group, no commits: every worker reads the whole control topic) that keeps
the newest version seen. Between episodes the worker asks
:meth:`PolicyFollower.take` for a version newer than its own and applies it
with :func:`reload_policy`:

* policies with ``reload_in_place = False`` (:class:`rollout.policies.hf.HFPolicy`)
  return a **new** policy object: new episodes use it at once, episodes in
  flight finish on the old one, so every episode is acted by exactly one version;
* policies with ``reload_in_place = True`` (:class:`rollout.policies.vllm.VLLMPolicy`:
  one engine, weights loaded into it) are reloaded only once the worker has
  drained its in-flight episodes (it admits no new ones meanwhile).

A ``location`` on an object store (``s3://BUCKET/.../v<version>``, a trainer publishing to
``publish.store: s3://...``) is downloaded by :func:`fetch_policy` into a local cache directory, one
per version, before the policy loads it: the trainer uploads a version whole (its ``policy.json``
last) before announcing it, so the download is the whole version.

The follower reads the topic from the beginning, so a worker started after a
publication picks up the newest version at once ("newest wins"; older
publications are skipped). The control topic is small (one event per version).

Examples:
    >>> ev = make_policy_published(version=3, location="/ckpt/v3", producer_id="trainer", parent_version=2)
    >>> ev.episode_id, ev.seq, ev.event_type, ev.policy_version
    ('policy-3', 0, 'policy_published', 3)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

from kafka import KafkaConsumer, TopicPartition

from rollout.policies.base import Policy
from schemas import locations as loc
from schemas.codec import EventDecodeError, decode_event
from schemas.events import PolicyPublished, make_event_id
from streams.admin import raise_if_unauthorized
from streams.config import ConfigError, KafkaConnection
from streams.errors import check_kafka, is_access_denied, kafka_access_errors

__all__ = [
    "PolicyFollower",
    "PolicyNotReloadableError",
    "fetch_policy",
    "ReloadablePolicy",
    "make_policy_published",
    "reload_policy",
]

log = logging.getLogger(__name__)


@runtime_checkable
class ReloadablePolicy(Policy, Protocol):
    """A policy that can load another version's weights.

    Attributes:
        reload_in_place: True if :meth:`reload` changes this object (the worker
            must drain in-flight episodes first); False if it returns a new one.
    """

    reload_in_place: bool

    def reload(self, location: str, version: int, *, lineage: str = "") -> Policy: ...


class PolicyNotReloadableError(TypeError):
    """A policy without weights (e.g. the scripted solver) was asked to load a version."""


def make_policy_published(*, version: int, location: str, producer_id: str, parent_version: int | None = None,
                          base_model: str = "", train_step: int = 0, domain: str = "*",
                          lineage: str = "") -> PolicyPublished:
    """The control event announcing policy ``version`` stored at ``location``.

    ``episode_id`` is ``policy-<version>`` and ``seq`` 0, so a re-publication of
    the same version has the same ``event_id`` (deduplicated downstream).
    """
    episode_id = f"policy-{version}"
    return PolicyPublished(
        event_id=make_event_id(episode_id, 0), episode_id=episode_id, seq=0, producer_id=producer_id,
        domain=domain, task_id="", policy_version=version, version=version, location=location,
        parent_version=parent_version, base_model=base_model, train_step=train_step, lineage=lineage,
    )


def fetch_policy(location: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A local directory holding the policy version at ``location``: itself when local, else a downloaded copy.

    An ``s3://`` version is copied whole into ``<cache_dir>/<hash of the URI>-<name>`` (default cache:
    ``trajpipe-policies`` under the system temp), through a temporary directory renamed into place, so
    a crash mid-download never leaves a copy that looks complete; a version already cached is not
    downloaded again (versions are immutable).

    Raises:
        FileNotFoundError: no ``policy.json`` at ``location`` (not a published version, or not yet uploaded).
    """
    if not loc.is_remote(location):
        return location
    location = location.rstrip("/")
    cache = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "trajpipe-policies"
    name = location.rsplit("/", 1)[-1]
    dest = cache / f"{hashlib.sha256(location.encode()).hexdigest()[:16]}-{name}"
    if (dest / "policy.json").is_file():
        return str(dest)
    if not loc.is_file(loc.join(location, "policy.json")):
        raise FileNotFoundError(f"{location} holds no published policy (no policy.json)")
    tmp = cache / f".{dest.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        loc.download_dir(location, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process put the same version in place first
            if not (dest / "policy.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("policy %s downloaded to %s", location, dest)
    return str(dest)


def reload_policy(policy: Policy, event: PolicyPublished, *, cache_dir: str | os.PathLike[str] | None = None) -> Policy:
    """Load ``event``'s weights into ``policy`` (or a new policy); returns the policy to use from now on.

    The policy takes the event's version and lineage: episodes it acts in are
    stamped with both. A location on an object store is downloaded first (:func:`fetch_policy`,
    into ``cache_dir``).

    Raises:
        PolicyNotReloadableError: the policy has no ``reload`` (e.g. scripted).
        FileNotFoundError: ``event.location`` holds no model.
    """
    if not isinstance(policy, ReloadablePolicy):
        raise PolicyNotReloadableError(
            f"{type(policy).__name__} cannot load policy version {event.version}; run the worker with "
            "--policy hf or --policy vllm to follow published versions"
        )
    return policy.reload(fetch_policy(event.location, cache_dir=cache_dir), event.version, lineage=event.lineage)


class PolicyFollower:
    """Background reader of ``policy_published`` events on the control topic.

    Args:
        conn: the cluster.
        topic: the control topic.
        poll_timeout_ms: longest wait of one poll (also the stop latency).
        topic_timeout_s: how long to wait for the topic to exist at start.

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, conn: KafkaConnection, topic: str, *, poll_timeout_ms: int = 250,
                 topic_timeout_s: float = 30.0) -> None:
        self.conn = conn
        self.topic = topic
        self.poll_timeout_ms = poll_timeout_ms
        self.topic_timeout_s = topic_timeout_s
        #: set once the consumer is assigned to every partition (publications from now on are seen).
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._latest: PolicyPublished | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="policy-follower", daemon=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, *, wait_ready_s: float | None = 30.0) -> Self:
        """Start the thread; wait until it listens (``wait_ready_s``, None = don't wait).

        Raises:
            TimeoutError: it was not listening within ``wait_ready_s``.
            streams.config.ConfigError: the broker cannot be reached, refused the credentials, or an ACL
                keeps the control topic from this client (``streams.errors``), when that stopped it first.
        """
        self._thread.start()
        deadline = None if wait_ready_s is None else time.monotonic() + wait_ready_s
        while deadline is not None and not self.ready.wait(0.1) and time.monotonic() < deadline:
            if not self._thread.is_alive():
                break
        if isinstance(self._error, ConfigError) and not self.ready.is_set():
            raise self._error
        if wait_ready_s is not None and not self.ready.is_set():
            raise TimeoutError(f"policy follower not assigned to {self.topic} within {wait_ready_s}s"
                               + (f": {self._error}" if self._error else ""))
        return self

    @property
    def latest(self) -> PolicyPublished | None:
        """The newest ``policy_published`` seen so far."""
        with self._lock:
            return self._latest

    def take(self, *, newer_than: int) -> PolicyPublished | None:
        """The newest published version if it is greater than ``newer_than``, else None."""
        latest = self.latest
        return latest if latest is not None and latest.version > newer_than else None

    def close(self) -> None:
        """Stop the thread and close the consumer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            check_kafka(self.conn)
            with kafka_access_errors(self.conn, what=f"read topic {self.topic!r}"):
                self._follow()
        except ConfigError as err:  # one line, no traceback: the message says what to fix
            self._error = err
            log.error("policy follower on %s stopped: %s", self.topic, err)

    def _follow(self) -> None:
        consumer = KafkaConsumer(**self.conn.client_kwargs(), group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest")
        try:
            deadline = time.monotonic() + self.topic_timeout_s
            parts = consumer.partitions_for_topic(self.topic)
            if not parts:  # missing, or hidden by an ACL: the latter is an error now, not after the timeout
                raise_if_unauthorized(self.conn, self.topic)
            while not parts and not self._stop.is_set():
                if time.monotonic() > deadline:
                    self._error = LookupError(f"control topic {self.topic!r} does not exist")
                    log.error("%s; policy reload is off", self._error)
                    return
                time.sleep(0.2)
                parts = consumer.partitions_for_topic(self.topic)
            tps = [TopicPartition(self.topic, p) for p in sorted(parts or ())]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            for tp in tps:
                consumer.position(tp)  # resolve now: nothing published after `ready` is missed
            self.ready.set()
            while not self._stop.is_set():
                for records in consumer.poll(timeout_ms=self.poll_timeout_ms).values():
                    for rec in records:
                        self._consider(rec)
        except Exception as err:  # any failure: logged and kept; rollouts go on without reloads
            if is_access_denied(err):
                raise  # becomes one KafkaAccessDenied line in _run
            self._error = err
            log.exception("policy follower on %s stopped", self.topic)
        finally:
            consumer.close()

    def _consider(self, rec: Any) -> None:
        try:
            event = decode_event(rec.value)
        except EventDecodeError as err:
            log.warning("undecodable record on %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, err)
            return
        if not isinstance(event, PolicyPublished):
            return
        with self._lock:
            if self._latest is None or event.version > self._latest.version:
                self._latest = event
                log.info("policy version %d published at %s", event.version, event.location)
