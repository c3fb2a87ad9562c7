"""Kafka connection failures as one clear, typed error: unreachable, bad credentials, no ACL.

kafka-python reports a broker that is down, a TLS certificate it cannot verify and a
wrong SASL password the same way: after ``bootstrap_timeout_ms``, ``KafkaTimeoutError:
Unable to bootstrap``. :func:`check_kafka` asks the question itself, one step at a time
(TCP, then TLS with the configured CA, then the SASL handshake and exchange, as the
client would do them), and raises an error whose message names the client, what failed
and the setting that fixes it. Components call it before they build a client;
:func:`kafka_access_errors` turns the broker's authorization errors (a missing ACL) into
:class:`KafkaAccessDenied` the same way.

All three errors subclass :class:`streams.config.ConfigError`, which ``trajpipe``'s
``main()`` prints as one ``error: ...`` line with exit status 2. No message carries a
password.

Examples:
    >>> from streams.config import KafkaConnection
    >>> conn = KafkaConnection(bootstrap_servers="127.0.0.1:1", client_id="doc", connect_timeout_s=0.2)
    >>> try:
    ...     check_kafka(conn)
    ... except KafkaUnavailable as err:
    ...     print(str(err).split(":")[0])
    cannot reach Kafka at 127.0.0.1
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import time
from collections.abc import Iterator

from kafka import errors as kafka_errors

from streams.config import ConfigError, KafkaConnection

__all__ = [
    "KafkaAccessDenied",
    "KafkaAuthError",
    "KafkaUnavailable",
    "access_denied",
    "check_kafka",
    "is_access_denied",
    "kafka_access_errors",
]

_PASSWORD_SETTING = "kafka.sasl_password_file / TRAJPIPE_KAFKA__SASL_PASSWORD_FILE (or TRAJPIPE_SASL_PASSWORD)"


class KafkaUnavailable(ConfigError):
    """No bootstrap server accepted a TCP connection within ``connect_timeout_s``."""


class KafkaAuthError(ConfigError):
    """The broker is there but refused this client: TLS, security protocol, SASL mechanism or credentials."""


class KafkaAccessDenied(KafkaAuthError):
    """The client authenticated, but an ACL does not allow what it asked for."""


class _HungUp(KafkaAuthError):
    """The server accepted TCP, then hung up on the handshake: a listener of another protocol, or a broker going down.

    :func:`check_kafka` tells the two apart by asking again: a broker killed or restarting
    refuses the next connections (and is waited for) or answers them; a listener of
    another protocol hangs up every time, and the third time is reported.
    """


#: :func:`check_kafka` reports a protocol mismatch after this many hang-ups (0.5 s apart for one server).
_HANG_UPS = 3


def _who(conn: KafkaConnection) -> str:
    if conn.security_protocol.startswith("SASL"):
        return f"client {conn.client_id!r} (SASL {conn.sasl_mechanism} user {conn.sasl_username!r})"
    return f"client {conn.client_id!r}"


def check_kafka(conn: KafkaConnection) -> None:
    """Return once a bootstrap server accepts this client; raise a clear error otherwise.

    Waits up to ``conn.connect_timeout_s`` for a server to accept TCP (a broker that is
    starting), then checks TLS and SASL on that server once: a refusal there is not
    retried, since waiting does not fix a password.

    Args:
        conn: the cluster and this client's security settings.

    Raises:
        KafkaUnavailable: no server accepted TCP in time.
        KafkaAuthError: TLS failed (CA, host name, protocol), the SASL mechanism is not
            enabled, or the credentials were rejected.
    """
    deadline = time.monotonic() + conn.connect_timeout_s
    last: OSError | None = None
    hang_ups = 0
    while True:
        for server in conn.servers:
            host, _, port = server.rpartition(":")
            host = host.strip("[]")
            try:
                wait = max(0.1, min(5.0, deadline - time.monotonic()))
                sock = socket.create_connection((host, int(port)), timeout=wait)
            except OSError as err:
                last = err
                continue
            try:
                _handshake(conn, sock, host=host, server=server)
            except _HungUp as err:  # another protocol, or a broker going down under us: ask again
                hang_ups += 1
                if hang_ups >= _HANG_UPS:
                    raise KafkaAuthError(str(err)) from None
                last = ConnectionResetError(f"{server} hung up on the handshake")
                continue
            finally:
                sock.close()
            return
        if time.monotonic() >= deadline:
            reason = getattr(last, "strerror", None) or str(last)
            raise KafkaUnavailable(
                f"cannot reach Kafka at {conn.bootstrap_servers} for {_who(conn)} within {conn.connect_timeout_s:g} s "
                f"({reason}): start the broker (`trajpipe broker start`) or fix --bootstrap / kafka.bootstrap_servers "
                "(TRAJPIPE_BOOTSTRAP); kafka.connect_timeout_s (TRAJPIPE_KAFKA__CONNECT_TIMEOUT_S) sets how long to "
                "wait"
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _handshake(conn: KafkaConnection, sock: socket.socket, *, host: str, server: str) -> None:
    sock.settimeout(max(1.0, conn.request_timeout_ms / 1000))
    if conn.security_protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=conn.ssl_cafile)
        if conn.ssl_certfile:
            ctx.load_cert_chain(conn.ssl_certfile, conn.ssl_keyfile)
        try:
            sock = ctx.wrap_socket(sock, server_hostname=host)
        except ssl.SSLCertVerificationError as err:
            raise KafkaAuthError(
                f"TLS: {_who(conn)} could not verify the certificate of {server} ({err.verify_message}): "
                f"set kafka.ssl_cafile / TRAJPIPE_KAFKA__SSL_CAFILE to the CA that signed it "
                f"(the embedded broker's is <data-dir>/auth/ca.pem), and connect by a name the certificate holds"
            ) from None
        except (ssl.SSLError, OSError) as err:
            raise _HungUp(
                f"TLS handshake of {_who(conn)} with {server} failed ({err}): the listener may not use TLS; "
                f"check kafka.security_protocol / TRAJPIPE_KAFKA__SECURITY_PROTOCOL ({conn.security_protocol})"
            ) from None
    try:
        _authenticate(conn, sock, server=server)
    finally:
        sock.close()  # the TLS socket, when wrapped (the caller closes the plain one)


def _authenticate(conn: KafkaConnection, sock: socket.socket, *, server: str) -> None:
    try:
        if conn.security_protocol.startswith("SASL"):
            _sasl(conn, sock, server=server)
        else:
            from kafka.protocol.metadata import ApiVersionsRequest

            _exchange(conn, sock, ApiVersionsRequest(version=0))
    except TimeoutError:
        raise KafkaUnavailable(
            f"{server} accepted a connection from {_who(conn)} but did not answer within "
            f"{conn.request_timeout_ms / 1000:g} s: the broker may be overloaded or starting; retry, or check that "
            "kafka.bootstrap_servers names a Kafka listener"
        ) from None
    except (OSError, kafka_errors.KafkaError) as err:
        if conn.security_protocol.startswith("SASL"):
            raise KafkaAuthError(
                f"Kafka rejected the credentials of {_who(conn)} at {server} ({err}): check kafka.sasl_username "
                f"and the password ({_PASSWORD_SETTING})"
            ) from None
        raise _HungUp(
            f"{server} did not answer {_who(conn)} over {conn.security_protocol} ({type(err).__name__}): the listener "
            f"may require TLS or SASL; set kafka.security_protocol / TRAJPIPE_KAFKA__SECURITY_PROTOCOL "
            f"(and the SASL settings) to what the cluster uses"
        ) from None


def _exchange(conn: KafkaConnection, sock: socket.socket, request):
    """Send one request and return its decoded response; OSError/KafkaError when the broker hangs up."""
    from kafka.protocol.parser import KafkaProtocol

    proto = KafkaProtocol(client_id=conn.client_id)
    proto.send_request(request)
    sock.sendall(proto.send_bytes())
    while True:
        data = sock.recv(65536)
        if not data:
            raise kafka_errors.KafkaConnectionError("the broker closed the connection")
        responses = proto.receive_bytes(data)
        if responses:
            return responses[0][1]


def _sasl(conn: KafkaConnection, sock: socket.socket, *, server: str) -> None:
    from kafka.net.sasl import get_sasl_mechanism
    from kafka.protocol.sasl import SaslAuthenticateRequest, SaslHandshakeRequest

    hs = _exchange(conn, sock, SaslHandshakeRequest(mechanism=conn.sasl_mechanism, version=1))
    if conn.sasl_mechanism not in hs.mechanisms:
        raise KafkaAuthError(
            f"{server} does not offer SASL {conn.sasl_mechanism} to {_who(conn)} (it offers "
            f"{', '.join(hs.mechanisms) or 'none'}): set kafka.sasl_mechanism / TRAJPIPE_KAFKA__SASL_MECHANISM"
        )
    mechanism = get_sasl_mechanism(conn.sasl_mechanism)(host=server, **conn.client_kwargs())
    while not mechanism.is_done():
        resp = _exchange(conn, sock, SaslAuthenticateRequest(auth_bytes=mechanism.auth_bytes(), version=1))
        if resp.error_code != 0:
            raise kafka_errors.SaslAuthenticationFailedError(resp.error_message or f"error {resp.error_code}")
        mechanism.receive(resp.auth_bytes)
    if not mechanism.is_authenticated():
        raise kafka_errors.SaslAuthenticationFailedError("the server's SCRAM signature did not verify")


@contextlib.contextmanager
def kafka_access_errors(conn: KafkaConnection, *, what: str) -> Iterator[None]:
    """Turn the broker's authorization errors inside the block into :class:`KafkaAccessDenied`.

    Args:
        conn: the client's connection (for its name and user).
        what: what the client was doing, e.g. ``"read topic 'trajpipe.events'"``.

    Raises:
        KafkaAccessDenied: for ``kafka.errors.AuthorizationError`` and its subclasses.
    """
    try:
        yield
    except kafka_errors.KafkaError as err:
        if not is_access_denied(err):
            raise
        raise access_denied(conn, what=what, err=err) from None


def is_access_denied(err: BaseException) -> bool:
    """Whether ``err`` is the broker refusing an operation for want of an ACL.

    kafka-python raises ``AuthorizationError`` subclasses, except for a refused
    InitProducerId (an idempotent producer without any Write ACL), which arrives as a
    plain ``KafkaError`` naming ``ClusterAuthorizationFailedError``.
    """
    return isinstance(err, kafka_errors.AuthorizationError) or "AuthorizationFailedError" in str(err)


def access_denied(conn: KafkaConnection, *, what: str, err: BaseException) -> KafkaAccessDenied:
    """The :class:`KafkaAccessDenied` for an authorization error ``err`` the broker returned."""
    user = conn.sasl_username or "ANONYMOUS"
    named = re.search(r"\w+AuthorizationFailedError", str(err))
    reason = named.group(0) if named else type(err).__name__
    return KafkaAccessDenied(
        f"Kafka denied {_who(conn)} permission to {what} ({reason}): grant user {user!r} an ACL "
        f"(embedded broker: `trajpipe broker acl add --user {user} ...`), or use a user that has one"
    )
