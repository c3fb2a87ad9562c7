"""The network client of every kafka-python client this project builds, and two log lines it keeps quiet.

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
* ``Metadata refresh: failed Cancelled`` (ERROR, ``kafka.cluster``): a client closed while its
  cluster metadata refresh was in flight (kafka-python cancels the request and logs the
  cancellation as a failed refresh). It came after about one in three reads, end-offset lookups
  and jobs. :class:`CancelledRefreshFilter` turns that one record into a DEBUG record; a refresh
  that fails for any other reason (a broker gone, a refused request) is still an ERROR.

Measured with kafka-python 3.0.12 (the version the Makefile installs).
"""

from __future__ import annotations

import logging
from typing import Any

import kafka.errors as Errors
from kafka.net.compat import KafkaNetClient

__all__ = ["SLOW_STEP_WARN_S", "net_client", "CancelledRefreshFilter"]

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
    return KafkaNetClient(**configs)


class CancelledRefreshFilter(logging.Filter):
    """``kafka.cluster``'s "Metadata refresh: failed Cancelled" (a client closed mid-refresh) as a DEBUG record.

    Other records pass unchanged. The demoted record still reaches the handlers when the
    ``kafka.cluster`` logger is enabled for DEBUG.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _REFRESH_FAILED and record.args and isinstance(record.args[0], Errors.Cancelled):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _install() -> None:
    logger = logging.getLogger("kafka.cluster")
    if not any(isinstance(f, CancelledRefreshFilter) for f in logger.filters):
        logger.addFilter(CancelledRefreshFilter())


_install()
