"""TLS for the gRPC port and the REST gateway: one certificate, re-read when its files change or on SIGHUP.

``--tls-cert-file`` (a PEM chain, leaf first) and ``--tls-key-file`` (its unencrypted PEM key) serve
both ports; ``--tls-client-ca-file`` turns on mutual TLS: a client that presents no certificate
signed by one of those CAs fails the handshake, on either port.

Rotation never drops a connection: a new certificate applies to new handshakes only. Before each
handshake the files' stat is compared with the last one read (a few microseconds; gRPC calls its
certificate fetcher for every new connection, the HTTP side its SNI callback), so writing new files
(or Kubernetes swapping a Secret volume's symlink) is enough; SIGHUP re-reads them regardless. A
set of files that does not load (a key written before its certificate, a half-written file) leaves
the current certificate in place with a warning, and is tried again once the files change again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

# The REST gateway speaks HTTP/1.1 (uvicorn): say so in ALPN, so h2-capable clients do not try h2.
HTTP_ALPN = ("http/1.1",)

_FLAGS = {"cert_file": "--tls-cert-file", "key_file": "--tls-key-file", "client_ca_file": "--tls-client-ca-file"}


class TlsError(ValueError):
    """TLS files that cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files the flags name; ``client_ca_file`` None: no client certificates asked for."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @classmethod
    def from_flags(cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> TlsFiles | None:
        """The files given, None for plaintext; a flag given without the ones it needs is a TlsError."""
        if cert_file is None and key_file is None:
            if client_ca_file is not None:
                raise TlsError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
            return None
        if cert_file is None or key_file is None:
            missing = "--tls-key-file" if key_file is None else "--tls-cert-file"
            given = "--tls-cert-file" if key_file is None else "--tls-key-file"
            raise TlsError(f"{given} needs {missing}")
        return cls(cert_file, key_file, client_ca_file)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p is not None)

    def stamp(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """What identifies the files' current contents cheaply; None while one is missing."""
        try:
            stats = [os.stat(path) for path in self.paths()]  # follows a Secret volume's symlinks
        except OSError:
            return None
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats)


@dataclass(frozen=True)
class TlsMaterial:
    """One consistent read of the files: the bytes gRPC takes and the SSLContext the gateway serves."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None
    http_context: ssl.SSLContext
    fingerprint: str  # SHA-256 of the leaf certificate, for the log

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        reason = exc.strerror.lower() if exc.strerror else str(exc)
        raise TlsError(f"{flag}: cannot read {path}: {reason}") from None


def _encrypted_key() -> str:
    # Without a callback OpenSSL would prompt for a passphrase on the terminal: the server would hang.
    raise TlsError("--tls-key-file is encrypted; give the key unencrypted (a Secret mount, mode 0600)")


def _leaf_fingerprint(cert_chain: bytes, path: str) -> str:
    text = cert_chain.decode("ascii", errors="replace")
    start = text.find("-----BEGIN CERTIFICATE-----")
    end = text.find("-----END CERTIFICATE-----", start)
    if start < 0 or end < 0:
        raise TlsError(f"--tls-cert-file: {path} holds no PEM certificate")
    der = ssl.PEM_cert_to_DER_cert(text[start : end + len("-----END CERTIFICATE-----")])
    return hashlib.sha256(der).hexdigest()


def _http_context(files: TlsFiles, client_ca: bytes | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert_file, files.key_file, password=_encrypted_key)
    except ssl.SSLError as exc:
        raise TlsError(
            f"--tls-cert-file {files.cert_file} and --tls-key-file {files.key_file} do not load together "
            f"(a key that is not the certificate's, or not PEM): {exc.reason or exc}"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", errors="replace"))
        except ssl.SSLError as exc:
            raise TlsError(
                f"--tls-client-ca-file: {files.client_ca_file} holds no PEM CA certificate: {exc.reason or exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(list(HTTP_ALPN))
    return context


def read_material(files: TlsFiles) -> TlsMaterial:
    """Read and check the files (the key matches the certificate, the CA file holds a CA); TlsError if not."""
    cert_chain = _read(files.cert_file, _FLAGS["cert_file"])
    private_key = _read(files.key_file, _FLAGS["key_file"])
    client_ca = None if files.client_ca_file is None else _read(files.client_ca_file, _FLAGS["client_ca_file"])
    fingerprint = _leaf_fingerprint(cert_chain, files.cert_file)
    context = _http_context(files, client_ca)
    # The context loaded the files by path: if they changed since the bytes above were read, the two
    # may disagree. A rotation caught in the middle; the next handshake sees the files' next stamp.
    if _read(files.cert_file, _FLAGS["cert_file"]) != cert_chain or _read(
        files.key_file, _FLAGS["key_file"]
    ) != private_key:
        raise TlsError(f"--tls-cert-file {files.cert_file} changed while it was read")
    return TlsMaterial(cert_chain, private_key, client_ca, context, fingerprint)


class TlsCertificates:
    """The certificate both ports serve now, replaced when the files change or ``reload`` is called.

    Called from gRPC's threads (the certificate fetcher) and the event loop (SIGHUP, the gateway's
    handshakes) alike, hence the lock.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = files.stamp()
        self._material = read_material(files)  # a TlsError here is the operator's to fix, at start
        self._lock = threading.Lock()
        self._grpc_material: TlsMaterial | None = self._material
        self._listener_context: ssl.SSLContext | None = None

    @property
    def current(self) -> TlsMaterial:
        return self._material

    def refresh(self) -> bool:
        """Re-read the files if their stat changed since the last read; True if the certificate changed."""
        stamp = self.files.stamp()
        if stamp is None or stamp == self._stamp:
            return False
        return self._load(stamp, force=False)

    def reload(self) -> bool:
        """Re-read the files now (SIGHUP); True if the new ones loaded."""
        return self._load(self.files.stamp(), force=True)

    def _load(self, stamp: tuple | None, *, force: bool) -> bool:
        with self._lock:
            if not force and stamp == self._stamp:
                return False  # another thread read these very files a moment ago
            self._stamp = stamp  # a failed read is tried again only once the files change again
            try:
                material = read_material(self.files)
            except TlsError as exc:
                log.warning("TLS files not reloaded, still serving sha256 %s: %s", self._material.fingerprint, exc)
                return False
            self._material = material
        log.info("TLS certificate loaded for new connections: sha256 %s", material.fingerprint)
        return True

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows the files, per new connection."""
        material = self._material
        return grpc.dynamic_ssl_server_credentials(
            _grpc_configuration(material),
            self._grpc_fetch,
            require_client_authentication=material.mutual,
        )

    def _grpc_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this before every new connection's handshake; None keeps what it has.
        self.refresh()
        material = self._material
        if material is self._grpc_material:
            return None
        self._grpc_material = material
        return _grpc_configuration(material)

    def http_context(self) -> ssl.SSLContext:
        """The SSLContext to listen with: each handshake switches to the current certificate's context."""
        if self._listener_context is None:
            context = self._material.http_context
            context.sni_callback = self._pick_http_context
            self._listener_context = context
        return self._listener_context

    def _pick_http_context(self, connection: ssl.SSLObject, _server_name: str | None, _: ssl.SSLContext) -> None:
        # OpenSSL calls this for every ClientHello, with or without SNI; swapping the connection's
        # context there swaps its certificate and the CAs its client certificate is checked against.
        self.refresh()
        current = self._material.http_context
        if connection.context is not current:
            connection.context = current


def _grpc_configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key, material.cert_chain)], root_certificates=material.client_ca
    )
