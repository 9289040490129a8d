"""The egress proxy's own CA, for the hosts a plugin's secrets are bound to (``runtime.plugin_secrets``).

The daemon keeps one CA in its state dir (``egress-ca.key`` 0600, ``egress-ca.pem``), made on first use
with PyCA ``cryptography`` (EC P-256, ten years, ``pathlen=0``). For a ``CONNECT`` to a secret-bound
host the proxy presents a short-lived leaf certificate for that host signed by it. Only workers of
plugins with secrets trust it: their ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE`` and
``NODE_EXTRA_CA_CERTS`` name ``egress-ca-bundle.pem`` (the system's CAs and this one, 0644, readable in
the sandbox); the daemon's own trust and the host's are untouched.

On the way out the proxy is an ordinary TLS client: the system's trust store (and, when the operator
names one, ``egress_ca_file``), the host name checked, HTTP/1.1 only (ALPN) on both sides.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import stat
import tempfile
import threading
import time

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from runtime.egress_rules import ip_literal

CA_KEY = "egress-ca.key"
CA_CERT = "egress-ca.pem"
BUNDLE = "egress-ca-bundle.pem"
CA_DAYS = 3650
LEAF_DAYS = 7
#: A leaf is made again when less than this is left of it.
LEAF_RENEW_S = 86400.0
ALPN = ["http/1.1"]
#: The worker's variables that name the bundle (OpenSSL and Python, requests, curl, Node).
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


class EgressTLSError(Exception):
    """The CA cannot be made or trusted; says what to fix."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _system_cas() -> bytes:
    paths = ssl.get_default_verify_paths()
    for path in (paths.cafile, paths.openssl_cafile, "/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/cert.pem"):
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                return f.read()
    return b""


class EgressCA:
    """The per-daemon CA: leaf contexts for bound hosts, the upstream context, the workers' bundle."""

    #: Leaf contexts kept (a secret bound to ``*.example.com`` reaches any number of hosts; the oldest
    #: goes first and gets a new leaf if it comes back).
    LEAVES_MAX = 256

    def __init__(self, state_dir: str, upstream_ca_file: str | None = None) -> None:
        self.state_dir = state_dir
        self.upstream_ca_file = upstream_ca_file
        self.bundle_path = os.path.join(state_dir, BUNDLE)
        self._key, self._cert = self._load_or_make()
        self._write_bundle()
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaves: dict[str, tuple[ssl.SSLContext, float]] = {}
        self._lock = threading.Lock()
        self._upstream: ssl.SSLContext | None = None

    # -- the CA on disk ------------------------------------------------------------------------------

    def _load_or_make(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key_path, cert_path = os.path.join(self.state_dir, CA_KEY), os.path.join(self.state_dir, CA_CERT)
        try:
            key_pem = _read_private(key_path)
            if key_pem is not None:
                key = serialization.load_pem_private_key(key_pem, password=None)
                cert = x509.load_pem_x509_certificate(_wait_for(cert_path))
                if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.public_key() != key.public_key():
                    raise EgressTLSError(f"{cert_path} is not the certificate of {key_path}: remove both to make a new CA")
                if cert.not_valid_after_utc < _now() + datetime.timedelta(days=LEAF_DAYS):
                    raise EgressTLSError(f"{cert_path} expires soon: remove it and {key_path} to make a new CA")
                return key, cert
        except (OSError, ValueError) as exc:
            raise EgressTLSError(f"the egress CA in {self.state_dir} cannot be read: {exc}") from None
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"toolcell egress CA ({os.uname().nodename})")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        try:
            if not _publish(key_path, key_pem, cert_path, cert.public_bytes(serialization.Encoding.PEM)):
                return self._load_or_make()  # another daemon sharing this state dir made one first
        except OSError as exc:
            raise EgressTLSError(f"the egress CA cannot be written to {self.state_dir}: {exc}") from None
        return key, cert

    def _write_bundle(self) -> None:
        ca = self._cert.public_bytes(serialization.Encoding.PEM)
        system = _system_cas()
        try:
            _write_atomically(self.bundle_path, system.rstrip(b"\n") + b"\n" + ca if system else ca, 0o644)
        except OSError as exc:
            raise EgressTLSError(f"the egress CA bundle cannot be written to {self.bundle_path}: {exc}") from None

    @property
    def certificate_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    # -- TLS contexts --------------------------------------------------------------------------------

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a leaf for ``host`` (cached, renewed before it ends)."""
        with self._lock:
            cached = self._leaves.get(host)
            if cached is not None and cached[1] - _now().timestamp() > LEAF_RENEW_S:
                return cached[0]
            ctx, ends = self._make_leaf(host)
            self._leaves.pop(host, None)
            if len(self._leaves) >= self.LEAVES_MAX:
                del self._leaves[next(iter(self._leaves))]
            self._leaves[host] = (ctx, ends)
            return ctx

    def _make_leaf(self, host: str) -> tuple[ssl.SSLContext, float]:
        now = _now()
        ends = now + datetime.timedelta(days=LEAF_DAYS)
        ip = ip_literal(host)
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(ip)) if ip is not None else x509.DNSName(host)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
                .issuer_name(self._cert.subject).public_key(self._leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(ends)
                .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        pem = (cert.public_bytes(serialization.Encoding.PEM)
               + self._leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(ALPN)
        # ``ssl`` loads a chain only from a file: a private one, gone as soon as it is read.
        fd, path = tempfile.mkstemp(prefix=".egress-leaf-", dir=self.state_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            ctx.load_cert_chain(path)
        finally:
            os.unlink(path)
        return ctx, ends.timestamp()

    def upstream_context(self) -> ssl.SSLContext:
        """The client context toward the real host: system trust, plus the operator's CA file if any."""
        if self._upstream is None:
            ctx = ssl.create_default_context()
            if self.upstream_ca_file:
                try:
                    ctx.load_verify_locations(cafile=self.upstream_ca_file)
                except (OSError, ssl.SSLError) as exc:
                    raise EgressTLSError(f"egress_ca_file {self.upstream_ca_file}: {exc}") from None
            ctx.set_alpn_protocols(ALPN)
            self._upstream = ctx
        return self._upstream

    def worker_env(self) -> dict[str, str]:
        return dict.fromkeys(CA_VARS, self.bundle_path)


def _read_private(path: str) -> bytes | None:
    """A 0600 file of this user (not a symlink), or None when there is none; raises ``EgressTLSError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise EgressTLSError(f"{path} is not a regular file owned by uid {os.geteuid()} and private to it")
        return os.read(fd, 64 * 1024)
    finally:
        os.close(fd)


def _write_atomically(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _publish(key_path: str, key_pem: bytes, cert_path: str, cert_pem: bytes) -> bool:
    """Put a new CA in place unless one is there (False): the key is linked in, never replaced, so two
    daemons starting together agree on one CA; its certificate follows at once."""
    tmp = f"{key_path}.{os.getpid()}.tmp"
    _write_atomically(tmp, key_pem, 0o600)
    try:
        os.link(tmp, key_path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    _write_atomically(cert_path, cert_pem, 0o644)
    return True


def _wait_for(path: str, wait_s: float = 2.0) -> bytes:
    """A file another daemon is about to write (the CA certificate just after its key)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
