"""A real S3-compatible object store for tests: SeaweedFS's ``weed server -s3`` on ephemeral ports.

``make install`` builds the binary into ``.cache/bin/weed`` (pipelines/runtime/install_seaweedfs.sh);
a missing binary is a failure, not a skip. The fixture ``s3_store`` (tests/conftest.py) starts one
server per test session in a temporary directory with a generated access key and secret, creates a
bucket, and stops the server (its whole process group) at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from tests.helpers import free_port

__all__ = ["S3Store", "WEED", "start_seaweedfs", "stop_seaweedfs"]

ROOT = Path(__file__).resolve().parents[1]
WEED = Path(os.environ.get("TRAJPIPE_CACHE", ROOT / ".cache")) / "bin" / "weed"
#: Seconds to wait for the S3 gateway to answer (master, volume server, filer and gateway start in turn).
START_TIMEOUT_S = 120.0
#: The volume server's free-space floor (``-volume.minFreeSpace``). Below it SeaweedFS marks every volume
#: read-only and a write then waits until the client gives up (pyarrow: "Operation too slow"; delta-rs: 180 s
#: of retries) -- one CI run lost 30 tests that way on a 250 GiB disk shared with other jobs, 0.9 % free
#: against the default floor of 1 % (2.5 GiB). The tests write tens of MiB, so the floor is absolute.
MIN_FREE_BYTES = 512 * 2**20


@dataclass
class S3Store:
    """A running SeaweedFS with its S3 gateway.

    Attributes:
        endpoint: the gateway's URL, ``http://127.0.0.1:<port>``.
        bucket: a bucket created for the session.
        access_key: the generated access key id.
        secret_key: the generated secret (kept out of ``repr``).
        region: the region clients sign requests for.
        process: the ``weed server`` process (leader of its own process group).
        log: its combined stdout/stderr file.
        grpc_ports: its gRPC ports (weed also listens on ``/tmp/seaweedfs-<service>-grpc-<port>.sock``).
        metrics_port: its Prometheus port (``/metrics``: the volume server's disk, free and available).
    """

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    process: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None
    grpc_ports: tuple[int, ...] = ()
    metrics_port: int = 0

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (pyarrow, delta-rs, polars, DuckDB) uses to reach this store."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def uri(self, *parts: str) -> str:
        """``s3://<bucket>/<parts...>``."""
        return "/".join([f"s3://{self.bucket}", *parts])


def _identities(access_key: str, secret_key: str) -> dict:
    return {"identities": [{"name": "trajpipe-test",
                            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}


def start_seaweedfs(workdir: Path, *, bucket: str = "trajpipe") -> S3Store:
    """Start ``weed server`` (master, volume, filer, S3 gateway) under ``workdir``; return once the bucket exists.

    Every listener is on a free port of 127.0.0.1 (gRPC ports too: by default they are HTTP port +
    10000, which can exceed 65535 for an ephemeral port); the Iceberg and Lance catalogs are off and
    so is the telemetry to seaweedfs.com. Its glog files go to ``workdir`` too (by default they pile up in /tmp).

    Raises:
        FileNotFoundError: no ``.cache/bin/weed`` (run ``make install``).
        RuntimeError: under twice :data:`MIN_FREE_BYTES` free on ``workdir``'s disk (the message says so).
        RuntimeError: the gateway did not answer within :data:`START_TIMEOUT_S` (its log is in the message).
    """
    if not WEED.is_file():
        raise FileNotFoundError(f"{WEED} is missing; build it with `make install` "
                                "(pipelines/runtime/install_seaweedfs.sh)")
    data, config, log = workdir / "data", workdir / "s3-identities.json", workdir / "weed.log"
    data.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(data).free
    if free < 2 * MIN_FREE_BYTES:
        raise RuntimeError(f"only {free / 2**20:.0f} MiB free under {data}: SeaweedFS would mark its volumes "
                           f"read-only below {MIN_FREE_BYTES / 2**20:.0f} MiB and every write would hang; "
                           "free some space (old clones, `uv cache prune`)")
    access_key, secret_key = f"AK{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30)
    config.write_text(json.dumps(_identities(access_key, secret_key)))
    config.chmod(0o600)
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    metrics_port = free_port()
    args = [str(WEED), f"-logdir={workdir}", "server", f"-dir={data}", f"-metricsPort={metrics_port}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=16",
            f"-volume.minFreeSpace={MIN_FREE_BYTES // 2**20}MiB",
            "-filer", "-s3", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={workdir / 'filer.sock'}", f"-s3.localSocket={workdir / 's3.sock'}"]
    grpc_ports = {name: free_port() for name in ports}
    for name, port in ports.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={grpc_ports[name]}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    store = S3Store(endpoint=f"http://127.0.0.1:{ports['s3']}", bucket=bucket, access_key=access_key,
                    secret_key=secret_key, process=proc, log=log, grpc_ports=tuple(grpc_ports.values()), metrics_port=metrics_port)
    fs = pafs.S3FileSystem(access_key=access_key, secret_key=secret_key, region=store.region,
                           endpoint_override=store.endpoint, allow_bucket_creation=True,
                           connect_timeout=2, request_timeout=5)
    deadline, last = time.monotonic() + START_TIMEOUT_S, None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with status {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            fs.create_dir(bucket)
            if fs.get_file_info(bucket).type == pafs.FileType.Directory:
                return store
        except OSError as err:  # not listening yet, or the filer/volume behind the gateway not ready
            last = err
        if time.monotonic() > deadline:
            stop_seaweedfs(store)
            raise RuntimeError(f"SeaweedFS S3 at {store.endpoint} did not answer in {START_TIMEOUT_S:.0f} s "
                               f"({last}); log: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def stop_seaweedfs(store: S3Store, *, timeout_s: float = 5.0) -> None:
    """Stop the server and every process of its group (SIGTERM, then SIGKILL after ``timeout_s``).

    Also removes the Unix sockets weed makes under /tmp for its gRPC ports (not cleaned up on SIGKILL).
    """
    proc = store.process
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
    for port in store.grpc_ports:
        for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
            sock.unlink(missing_ok=True)


@contextlib.contextmanager
def aws_environment(store: S3Store) -> Iterator[S3Store]:
    """Inside the block, this process's AWS_* variables are the store's (any other AWS_* removed): what an
    in-process client (pyarrow, delta-rs, polars, the Beam job's in-process workers) reads; restored after."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        for name, value in store.env().items():
            mp.setenv(name, value)
        yield store
