"""The network client of every kafka-python client this project builds, and the log lines it keeps quiet.

kafka-python 3.0 runs each client's I/O as tasks of one event loop (``kafka.net.selector``) and
logs two things on a healthy run of this project that read like faults:

* ``Task ... ran for 0.144s (>0.100s threshold). It is blocking the event loop -- likely a tight
  sync loop inside a coroutine. Other pollers will time out.`` (WARNING). The loop times each
  step of a task against ``slow_task_threshold_secs`` (0.1 s). Our readers fetch up to 16 MiB a
  partition at a time (kafka-python reads slowly in small fetches), and receiving and parsing such
  a response is one step: 0.10-0.2 s on this 2-core machine, up to 1.1 s under load (a 1M-event
  ``make bench`` run logged 30 of them). Every client from
  :meth:`streams.config.KafkaConnection.client_kwargs` is built by :func:`net_client`, whose
  threshold is :data:`SLOW_STEP_WARN_S`: a loop that really stalls is still reported, a large
  fetch is not.
* ``Metadata refresh: failed Cancelled`` and ``Metadata refresh: failed Transport closed for
  writes`` (ERROR, ``kafka.cluster``): a client closed while its cluster metadata refresh was in
  flight. ``KafkaNetClient.close`` closes the connections first and stops the client's IO thread
  after, and that thread's refresh task finds its request cancelled or, not sent yet, its
  connection closed. Measured: 30 rounds of an end-offset lookup, a :class:`~streams.fetch.PartitionReader`,
  a producer and a consumer, each built and closed, logged 11 and 2 such records, all on the
  closing clients' IO threads; in ``make bench`` logs the first came after ~1 in 3 reads and jobs,
  the second once in each of three logs. The same close logs two more refresh failures
  (``NetworkSelector closed!``: the refresh started after the selector closed; ``KafkaConnectionError:
  Node not connected``: after its connection closed) and, from the transport, ``Error receiving
  network data closing socket`` with a traceback ending in ``'NoneType' object has no attribute
  'recv'``: a read woken by the close finds the socket already gone (kafka-python issue #3097).
  30 exact-range reads (:func:`streams.consumer.read_range`, a fetch in flight at each close) logged one
  of each, all at ERROR, all on the closing clients' IO threads; the last was in a ``make bench`` log
  (its rollout part) on 2026-12-07. :class:`ClosingClientFilter` makes all of these DEBUG records
  when the thread that logs them runs the network loop of a client whose ``close`` is under way
  (:func:`net_client` marks it); a refresh or a read that fails for any other reason, or on a client
  not closing (a broker gone, a refused request, a connection the broker dropped), is still an ERROR.

Measured with kafka-python 3.0.12 (the version the Makefile installs).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from typing import Any

import kafka.errors as Errors
from kafka.net.compat import KafkaNetClient

__all__ = ["SLOW_STEP_WARN_S", "net_client", "ClosingClientFilter"]

#: A step of a client's network loop longer than this is logged as blocking the loop
#: (kafka-python's ``slow_task_threshold_secs``; its default, 0.1 s, is under one large fetch's parse).
SLOW_STEP_WARN_S = 5.0

_REFRESH_FAILED = "Metadata refresh: failed %s"


def net_client(**configs: Any) -> KafkaNetClient:
    """kafka-python's ``KafkaNetClient`` with :data:`SLOW_STEP_WARN_S`; the ``kafka_client`` of every client we build.

    kafka-python's producer, consumer and admin client call their ``kafka_client`` setting with their
    own configuration; :class:`streams.fetch.PartitionReader` calls it directly.
    """
    configs.setdefault("slow_task_threshold_secs", SLOW_STEP_WARN_S)
    client = KafkaNetClient(**configs)
    client.close = functools.partial(_close_marked, client, client.close)
    return client


#: Idents of the threads that run a closing client's network loop: its IO thread, or the caller's when it has
#: none (each client has its own IO thread, and a caller runs one close at a time). Set operations are atomic
#: under the GIL: no lock, so none a forked worker could inherit held.
_CLOSING: set[int] = set()
#: ``(type, message)`` of the errors a refresh fails with because its own client is closing (besides ``Cancelled``).
_CLOSED_UNDER_REFRESH = ((RuntimeError, ("Transport closed for writes",)), (RuntimeError, ("NetworkSelector closed!",)),
                         (Errors.KafkaConnectionError, ("Node not connected",)))
_RECV_FAILED = "%s: Error receiving network data closing socket"

# A forked worker (the jobs fork theirs from the driver) starts with no close under way: a driver thread that
# was closing a client at the fork is not in the child.
os.register_at_fork(after_in_child=_CLOSING.clear)


def _close_marked(client: KafkaNetClient, close: Any, node_id: Any = None) -> Any:
    """Run ``client.close`` with its loop thread marked as closing: what that thread logs meanwhile is a closing client's."""
    if node_id is not None:  # one connection, not the client
        return close(node_id)
    io_thread = getattr(getattr(client, "_net", None), "_io_thread", None)
    ident = io_thread.ident if io_thread is not None and io_thread.ident is not None else threading.get_ident()
    _CLOSING.add(ident)
    try:
        return close()
    finally:
        _CLOSING.discard(ident)


class ClosingClientFilter(logging.Filter):
    """What kafka-python logs of a client closing under its own network loop, as DEBUG records.

    ``kafka.cluster``'s "Metadata refresh: failed ..." with ``Cancelled``, "Transport closed for writes",
    "NetworkSelector closed!" or "Node not connected", and ``kafka.net.transport``'s "Error receiving network
    data closing socket" on a socket gone (``None``) or closed (``EBADF``), when the thread that logs them
    runs the network loop of a client whose ``close`` is under way (:func:`net_client`). Other records
    pass unchanged. A demoted record still reaches the handlers when its logger is enabled for DEBUG.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread in _CLOSING and (_closing_refresh(record) or _closing_read(record)):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _closing_refresh(record: logging.LogRecord) -> bool:
    if record.msg != _REFRESH_FAILED or not record.args:
        return False
    err = record.args[0]
    return isinstance(err, Errors.Cancelled) or any(type(err) is kind and getattr(err, "args", None) == args
                                                    for kind, args in _CLOSED_UNDER_REFRESH)


def _closing_read(record: logging.LogRecord) -> bool:
    if record.msg != _RECV_FAILED or not record.exc_info:
        return False
    err = record.exc_info[1]
    return (isinstance(err, AttributeError) and "'NoneType'" in str(err)) or (
        isinstance(err, OSError) and err.errno == errno.EBADF)


def _install() -> None:
    for name in ("kafka.cluster", "kafka.net.transport"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ClosingClientFilter) for f in logger.filters):
            logger.addFilter(ClosingClientFilter())


_install()
