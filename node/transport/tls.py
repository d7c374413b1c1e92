"""The cluster's TLS: every connection between members is TLS 1.3, both ends proving membership with a
certificate, and the cluster token is never sent (docs/threat-model-gossip.md, "Links over the internet").

The token is the one secret a user hands out, so the cluster's certificate authority is derived from it: scrypt
(slow, so a captured certificate does not make a weak token cheap to guess offline), then Ed25519. Every holder
of the token derives the same CA key and the same CA certificate (Ed25519 signs deterministically, and every
field is fixed), so nothing but the token is distributed: a node issues its own short-lived certificate, naming
its node id, under that CA, and trusts only certificates the CA signed. An eavesdropper sees neither the token
nor anything that lets it join; a node started with another token is refused at the handshake, and says why.

Pure but for the key and certificate making; the contexts it builds are Python's `ssl`, the sockets are
hypercorn's and httpx's."""
from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile
import weakref

import attrs
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_SALT = b"pp cluster CA, v1"
SCRYPT_N = 1 << 14  # ~40 ms and 16 MiB once a process: each guess at a token costs an attacker as much
CERT_LIFETIME = datetime.timedelta(days=7)
RENEW_S = 24 * 3600.0  # a node issues itself a fresh certificate this often, long before the last one ends
CLOCK_SKEW = datetime.timedelta(days=1)  # a certificate is valid from a day back: machines' clocks differ
ALPN = ["h2", "http/1.1"]
CLUSTER_SNI = "cluster.pp.invalid"  # the name members ask for in their handshakes (.invalid: never a real host)
_EPOCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
_END = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)


@attrs.frozen
class Authority:
    """The cluster's CA: its key (derived from the token) and its certificate, the same on every member."""

    key: ed25519.Ed25519PrivateKey = attrs.field(repr=False)
    cert: x509.Certificate
    fingerprint: str  # 8 hex digits of its public key's SHA-256: two clusters' CAs tell apart in logs

    @property
    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()


def authority(token: str) -> Authority:
    """The CA every holder of `token` derives alike."""
    seed = Scrypt(salt=CA_SALT, length=32, n=SCRYPT_N, r=8, p=1).derive(token.encode())
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    public = key.public_key()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    fingerprint = hashlib.sha256(raw).hexdigest()[:8]
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pp"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"pp cluster CA {fingerprint}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(int.from_bytes(hashlib.sha256(raw).digest()[:16], "big") >> 1)
            .not_valid_before(_EPOCH).not_valid_after(_END)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, None))
    return Authority(key, cert, fingerprint)


def issue(ca: Authority, node_id: str, now: datetime.datetime) -> tuple[bytes, bytes]:
    """A fresh key and a certificate naming `node_id` (its common name), signed by the cluster's CA, for
    serving and for calling: (certificate PEM, key PEM)."""
    key = ed25519.Ed25519PrivateKey.generate()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pp"),
                         x509.NameAttribute(NameOID.COMMON_NAME, node_id[:64])])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + CERT_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, None))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


class ClusterTls:
    """One member's TLS: its certificate under the cluster's CA, and the contexts it serves and calls with. Every
    context it made takes the next certificate when it renews (new connections use it; open ones go on)."""

    def __init__(self, token: str, node_id: str, *, now: datetime.datetime | None = None):
        self.ca, self.node_id = authority(token), node_id
        self._contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()
        self._chain = issue(self.ca, node_id, now or _now())

    def server_context(self, api: ssl.SSLContext | None = None) -> ssl.SSLContext:
        """For a node's port: a member's certificate is asked for, and checked if sent (a client without one
        reaches only what needs no membership: the API with its key, /health). With `api` (stage 0's own
        certificate, --tls-cert), a client that does not name CLUSTER_SNI, as every member does, is shown that
        one instead: a browser or an OpenAI client checks the operator's certificate, members the cluster's."""
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_OPTIONAL
        if api is not None:
            def pick(connection, server_name, _ctx):
                if server_name != CLUSTER_SNI:
                    connection.context = api
            ctx.sni_callback = pick
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """For calling members: the server must show a certificate of this cluster's CA. Its name is not checked
        against the address (members are reached by IP); who it is, its common name, is the membership's to
        know. One context a client: httpx sets its ALPN on it."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def renew(self, now: datetime.datetime | None = None) -> None:
        self._chain = issue(self.ca, self.node_id, now or _now())
        for ctx in list(self._contexts):
            _load(ctx, *self._chain)

    def _context(self, protocol: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cadata=self.ca.pem)
        ctx.set_alpn_protocols(ALPN)
        _load(ctx, *self._chain)
        self._contexts.add(ctx)
        return ctx


async def renew_certificates(tls: ClusterTls, every_s: float = RENEW_S) -> None:
    """Issue this member a fresh certificate every `every_s`, until cancelled (its lifetime is a week)."""
    while True:
        await trio.sleep(every_s)
        tls.renew()


def member_id(peer_cert: dict | None) -> str | None:
    """The node id a verified peer certificate names (ssl's getpeercert()), or None where the peer sent none."""
    for rdn in (peer_cert or {}).get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None


def api_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """Stage 0's API over TLS (--tls-cert, --tls-key): the operator's own certificate, for clients that connect
    straight to it; no client certificate is asked for. Raises OSError / ssl.SSLError naming what is wrong."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # OpenAI clients and browsers; the cluster's own links are 1.3
    ctx.set_alpn_protocols(ALPN)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def _load(ctx: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """ssl loads a certificate only from files: a private directory, gone once read."""
    with tempfile.TemporaryDirectory(prefix="pp-tls-") as folder:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert, cert_pem), (key, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
