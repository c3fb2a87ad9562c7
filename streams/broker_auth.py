"""Authentication for the embedded Kafka broker: TLS certificates, SCRAM users, ACLs.

``trajpipe broker start --auth sasl-ssl`` (``start_broker(auth="sasl-ssl")``) makes the
client listener ``SASL_SSL`` with ``SCRAM-SHA-512`` and turns on KRaft's
``StandardAuthorizer``. What this module keeps in ``<data_dir>/auth/`` (made on the first
authenticated start, reused afterwards):

* ``ca.pem`` (give it to clients as ``kafka.ssl_cafile``) and ``ca.key``: a CA made for
  this data dir only, valid :data:`CERT_DAYS` days.
* ``server.pem``: the broker's key and certificate chain (a PEM keystore), for
  ``127.0.0.1``, ``::1``, ``localhost`` and the host it advertises. It is remade when the
  advertised host changes or it has less than a day left.
* ``admin.password``: the password of the broker's own SCRAM user ``admin`` (a
  ``super.users`` member), made at random. The broker uses it on its inter-broker
  listener; ``trajpipe broker user|acl`` use it to manage users and ACLs.

Every file here is mode 0600 in a 0700 directory. The controller listener stays on the
loopback interface and requires a TLS client certificate signed by the same CA (the
broker's own), so a local process without the key cannot use it.

Examples:
    >>> import tempfile
    >>> auth = prepare_broker_auth(Path(tempfile.mkdtemp()), hosts=["127.0.0.1"])
    >>> auth.ca_file.name, auth.admin_user, oct(auth.ca_key_file.stat().st_mode & 0o777)
    ('ca.pem', 'admin', '0o600')
    >>> "User:admin" in auth_server_properties(auth, listener="SASL_SSL")
    True
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AUTH_MODES",
    "CERT_DAYS",
    "SCRAM_MECHANISM",
    "BrokerAuth",
    "auth_server_properties",
    "prepare_broker_auth",
    "read_broker_auth",
    "scram_format_args",
]

#: ``--auth`` values of ``trajpipe broker start``.
AUTH_MODES = ("none", "sasl-ssl")
#: Lifetime of the generated CA and server certificate.
CERT_DAYS = 365
SCRAM_MECHANISM = "SCRAM-SHA-512"
_AUTH_DIR = "auth"
_ADMIN_USER = "admin"
_SERVER_CN = "trajpipe-embedded-broker"


@dataclass(frozen=True)
class BrokerAuth:
    """Files and the admin user of an authenticated embedded broker.

    Attributes:
        dir: ``<data_dir>/auth``.
        ca_file: the CA certificate (PEM) clients verify the broker with.
        ca_key_file: the CA's private key (never leaves the data dir).
        server_pem: the broker's private key followed by its certificate chain.
        admin_user: the broker's SCRAM super user.
        admin_password_file: file holding the admin's password (one line).
    """

    dir: Path
    ca_file: Path
    ca_key_file: Path
    server_pem: Path
    admin_user: str
    admin_password_file: Path

    def admin_password(self) -> str:
        """The admin password, read from :attr:`admin_password_file`."""
        return self.admin_password_file.read_text().strip()


def read_broker_auth(data_dir: Path) -> BrokerAuth | None:
    """The auth files of ``data_dir``'s broker, or None if it was never started with auth."""
    d = Path(data_dir).expanduser().resolve() / _AUTH_DIR
    auth = _paths(d)
    if not (auth.ca_file.exists() and auth.admin_password_file.exists()):
        return None
    return auth


def prepare_broker_auth(data_dir: Path, *, hosts: list[str]) -> BrokerAuth:
    """Make (or reuse) the CA, the server certificate for ``hosts`` and the admin password.

    Args:
        data_dir: the broker's data dir.
        hosts: host names or IP addresses clients use to reach the broker; the server
            certificate names each of them (and always ``127.0.0.1``, ``::1``, ``localhost``).

    Returns:
        The :class:`BrokerAuth` of ``data_dir``.
    """
    d = Path(data_dir).expanduser().resolve() / _AUTH_DIR
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    auth = _paths(d)
    if not auth.admin_password_file.exists():
        _write_private(auth.admin_password_file, secrets.token_urlsafe(24) + "\n")
    if not (auth.ca_file.exists() and auth.ca_key_file.exists()):
        _make_ca(auth)
    names = sorted({"127.0.0.1", "::1", "localhost", *(h for h in hosts if h)})
    if not _server_cert_ok(auth, names):
        _make_server_cert(auth, names)
    return auth


def scram_format_args(auth: BrokerAuth) -> list[str]:
    """``kafka-storage format`` arguments that create the admin's SCRAM credential."""
    return ["--add-scram", f"{SCRAM_MECHANISM}=[name={auth.admin_user},password={auth.admin_password()}]"]


def auth_server_properties(auth: BrokerAuth, *, listener: str) -> str:
    """``server.properties`` lines for SASL_SSL clients, an mTLS controller listener and ACLs.

    Args:
        auth: the data dir's auth files.
        listener: name of the client (and inter-broker) listener.
    """
    admin_pw = auth.admin_password()
    lname = listener.lower()
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{auth.admin_user}" password="{admin_pw}";'
    )
    return f"""
# --- authentication (streams/broker_auth.py): SASL_SSL + SCRAM-SHA-512, ACLs ---
sasl.enabled.mechanisms={SCRAM_MECHANISM}
sasl.mechanism.inter.broker.protocol={SCRAM_MECHANISM}
listener.name.{lname}.{SCRAM_MECHANISM.lower()}.sasl.jaas.config={jaas}
ssl.keystore.type=PEM
ssl.keystore.location={auth.server_pem}
ssl.truststore.type=PEM
ssl.truststore.location={auth.ca_file}
ssl.endpoint.identification.algorithm=https
listener.name.controller.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([^,]+)$/$1/,DEFAULT
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{auth.admin_user};User:{_SERVER_CN}
"""


def _paths(d: Path) -> BrokerAuth:
    return BrokerAuth(dir=d, ca_file=d / "ca.pem", ca_key_file=d / "ca.key", server_pem=d / "server.pem",
                      admin_user=_ADMIN_USER, admin_password_file=d / "admin.password")


def _write_private(path: Path, text: str | bytes) -> None:
    """Write ``path`` readable by its owner only (created 0600, never world-readable in between)."""
    data = text.encode() if isinstance(text, str) else text
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _make_ca(auth: BrokerAuth) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"trajpipe embedded broker CA {auth.dir.parent.name}")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_private(auth.ca_key_file, _pem_key(key))
    _write_private(auth.ca_file, cert.public_bytes(serialization.Encoding.PEM))
    if auth.server_pem.exists():
        auth.server_pem.unlink()  # signed by the old CA


def _san(names: list[str]):
    from cryptography import x509

    out = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def _server_cert_ok(auth: BrokerAuth, names: list[str]) -> bool:
    from cryptography import x509

    if not auth.server_pem.exists():
        return False
    try:
        cert = x509.load_pem_x509_certificates(auth.server_pem.read_bytes())[0]
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    return left > dt.timedelta(days=1) and all(s in have for s in _san(names))


def _make_server_cert(auth: BrokerAuth, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(auth.ca_key_file.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(auth.ca_file.read_bytes())
    key = _key()
    now = dt.datetime.now(dt.UTC)
    not_after = min(now + dt.timedelta(days=CERT_DAYS), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _SERVER_CN)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(_san(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # serverAuth for clients; clientAuth for the broker's own mTLS connection to its controller listener
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(auth.server_pem, _pem_key(key) + cert.public_bytes(serialization.Encoding.PEM)
                   + ca_cert.public_bytes(serialization.Encoding.PEM))
