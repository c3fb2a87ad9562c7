"""Boot one Beam Python SDK worker for a runner's PROCESS environment (what the SDK container's ``boot`` does).

A TaskManager running a stage of a Python pipeline in ``--environment_type=PROCESS``
starts ``<command> --id=ID --provision_endpoint=HOST:PORT --control_endpoint=...
--logging_endpoint=... --artifact_endpoint=...``. Beam ships that command only as a Go
binary inside its Docker images; this is its Python equivalent for a machine that has
the SDK and the project installed: ask the provision service for the job's pipeline
options, set the environment ``apache_beam.runners.worker.sdk_worker_main`` reads, and
become that worker (``exec``). Nothing is staged: the workers import the project from
``PYTHONPATH`` (docs/runners.md).

The session cluster (:mod:`pipelines.flink_cluster`) writes a ``bin/beam-sdk-worker``
script that runs ``python -m pipelines.sdk_worker_boot "$@"`` and gives it as
``--environment_config={"command": ".../bin/beam-sdk-worker"}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["worker_environment", "main"]


def worker_environment(argv: Sequence[str], *, timeout_s: float = 60.0) -> dict[str, str]:
    """The environment variables ``sdk_worker_main`` needs, from the runner's arguments and provision service.

    Args:
        argv: the arguments the runner passed (``--id``, ``--provision_endpoint``, ``--control_endpoint``, ...).
        timeout_s: how long to wait for the provision service.

    Returns:
        ``WORKER_ID``, ``PIPELINE_OPTIONS`` (JSON), ``CONTROL_API_SERVICE_DESCRIPTOR``,
        ``LOGGING_API_SERVICE_DESCRIPTOR``, ``SEMI_PERSISTENT_DIRECTORY``, ``RUNNER_CAPABILITIES``.
    """
    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc, endpoints_pb2
    from google.protobuf import json_format, text_format

    parser = argparse.ArgumentParser(prog="sdk_worker_boot")
    parser.add_argument("--id", required=True)
    parser.add_argument("--provision_endpoint", required=True)
    parser.add_argument("--control_endpoint", default="")
    parser.add_argument("--logging_endpoint", default="")
    parser.add_argument("--artifact_endpoint", default="")
    parser.add_argument("--status_endpoint", default="")
    parser.add_argument("--semi_persist_dir", default="/tmp")
    args, _ = parser.parse_known_args(argv)

    channel = grpc.insecure_channel(args.provision_endpoint)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        info = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel).GetProvisionInfo(
            beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=[("worker_id", args.id)],
            timeout=timeout_s).info
    finally:
        channel.close()

    def descriptor(url: str) -> str:
        return text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))

    # The provision info's endpoints win over the flags, as in Beam's Go boot.
    control = info.control_endpoint.url or args.control_endpoint
    logging_url = info.logging_endpoint.url or args.logging_endpoint
    env = {
        "WORKER_ID": args.id,
        "PIPELINE_OPTIONS": json_format.MessageToJson(info.pipeline_options),
        "CONTROL_API_SERVICE_DESCRIPTOR": descriptor(control),
        "SEMI_PERSISTENT_DIRECTORY": args.semi_persist_dir,
        "RUNNER_CAPABILITIES": " ".join(info.runner_capabilities),
    }
    if logging_url:
        env["LOGGING_API_SERVICE_DESCRIPTOR"] = descriptor(logging_url)
    if args.status_endpoint:
        env["STATUS_API_SERVICE_DESCRIPTOR"] = descriptor(args.status_endpoint)
    return env


def main(argv: Sequence[str] | None = None) -> None:
    """Become the SDK worker: ``exec python -m apache_beam.runners.worker.sdk_worker_main``."""
    env = {**os.environ, **worker_environment(sys.argv[1:] if argv is None else argv)}
    os.execve(sys.executable, [sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"], env)


if __name__ == "__main__":
    main()
