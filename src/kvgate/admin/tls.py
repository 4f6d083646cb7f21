"""TLS for kvgate's operator listeners (`server.operator_tls`): the admin gRPC API on
`server.admin_listen` and `GET /admin/usage` on `server.operator_https_listen`; and mutual TLS
for the ext_proc listener (`server.grpc_tls`, Envoy's side of the hop).

The certificate, its key and the client CA are PEM files, typically a cert-manager Secret
volume (tls.crt, tls.key, ca.crt). They are checked with one stat() per new connection and read
again when they change, so a renewed certificate (or CA) is served without a restart or a
reload; a replacement that cannot be used (half written, a key that does not match) keeps the
last good one and logs a warning. With `client_ca_file`, every client must present a
certificate signed by that CA (mutual TLS), or the handshake fails before any request is read.
Only that CA is trusted for client certificates, never the system's. Which of the CA's
certificates are accepted (`allowed_clients`) is kvgate.admin.identity's concern.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvgate.config.model import ConfigError, GrpcTlsConfig, OperatorTlsConfig

log = logging.getLogger("kvgate.admin.tls")

FIELD = "server.operator_tls"
GRPC_FIELD = "server.grpc_tls"
ListenerTlsConfig = OperatorTlsConfig | GrpcTlsConfig


@dataclass(frozen=True)
class TlsMaterial:
    """One consistent reading of the files: the PEM bytes (for gRPC) and the ssl context built
    from them (for aiohttp)."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext

    def grpc_configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(self.private_key, self.certificate_chain)], root_certificates=self.client_ca
        )


_MARKERS = {"certificate": b"-----BEGIN CERTIFICATE-----", "private key": b"PRIVATE KEY-----"}


def _read_pem(path: str, field: str, kind: str) -> bytes:
    """The file's bytes; ConfigError (naming the field and path, never the contents)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    if _MARKERS[kind] not in data:
        raise ConfigError(f"{field}: {path} holds no PEM {kind}")
    if kind == "private key" and (
        b"ENCRYPTED PRIVATE KEY" in data or b"Proc-Type: 4,ENCRYPTED" in data
    ):
        raise ConfigError(
            f"{field}: {path} is an encrypted key; kvgate needs it unencrypted (keep it in a "
            "Secret volume instead)"
        )
    return data


def _server_context(
    config: ListenerTlsConfig, client_ca: bytes | None, field: str
) -> ssl.SSLContext:
    def no_password() -> str:
        # Never let OpenSSL prompt on a terminal for a key's password.
        raise ConfigError(f"{field}.key_file: the key is encrypted; kvgate needs it unencrypted")

    # Not ssl.create_default_context(Purpose.CLIENT_AUTH): that trusts the system's CAs for
    # client certificates, i.e. any publicly issued certificate would be a way in.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.cert_file, config.key_file, password=no_password)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise ConfigError(
            f"{field}.cert_file / key_file: {config.cert_file} and {config.key_file} are not a "
            f"certificate and its private key ({reason})"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ConfigError(
                f"{field}.client_ca_file: {config.client_ca_file} holds no usable CA "
                f"certificate ({reason})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


Fingerprint = tuple[tuple[int, int, int], ...]


class ListenerTls:
    """A listener's TLS credentials, re-read when the files change.

    `grpc_credentials()` and `ssl_context()` are given to the listeners once, at start; both ask
    `current()` at every new connection, so the files' current contents are served. `field`
    names the config section in every error and log line."""

    def __init__(self, config: ListenerTlsConfig, field: str) -> None:
        self.config = config
        self.field = field
        self._lock = threading.Lock()
        self._warned: Fingerprint | None = None
        self._fingerprint, self.material = self._load()  # ConfigError stops the start

    @property
    def client_certs_required(self) -> bool:
        return self.config.client_ca_file is not None

    @property
    def mode(self) -> str:
        return "mutual TLS" if self.client_certs_required else "TLS"

    def _paths(self) -> list[str]:
        paths = [self.config.cert_file, self.config.key_file]
        if self.config.client_ca_file is not None:
            paths.append(self.config.client_ca_file)
        return paths

    def _stat(self) -> Fingerprint | None:
        stats = []
        for path in self._paths():
            try:
                st = os.stat(path)  # follows the Secret volume's symlinks
            except OSError:
                return None
            stats.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stats)

    def _load(self) -> tuple[Fingerprint, TlsMaterial]:
        before = self._stat()
        config = self.config
        field = self.field
        chain = _read_pem(config.cert_file, f"{field}.cert_file", "certificate")
        key = _read_pem(config.key_file, f"{field}.key_file", "private key")
        ca = None
        if config.client_ca_file is not None:
            ca = _read_pem(config.client_ca_file, f"{field}.client_ca_file", "certificate")
        context = _server_context(config, ca, field)
        after = self._stat()
        if before is None or after != before:
            # The bytes (for gRPC) and the context (read from the paths) must be one version.
            raise ConfigError(f"{field}: the files changed while being read")
        return after, TlsMaterial(chain, key, ca, context)

    def current(self) -> TlsMaterial:
        """The last good material, read again first if the files changed."""
        fingerprint = self._stat()
        if fingerprint is None or fingerprint == self._fingerprint:
            return self.material  # a file gone for a moment (a swap in progress): keep the last
        with self._lock:
            if fingerprint == self._fingerprint:
                return self.material
            try:
                loaded, material = self._load()
            except ConfigError as exc:
                if self._warned != fingerprint:
                    self._warned = fingerprint
                    log.warning(
                        f"the {self.field} files changed but cannot be used; the previous "
                        "certificate stays in use",
                        extra={"error": str(exc)},
                    )
                return self.material
            self._fingerprint, self.material = loaded, material
        what = "operator TLS" if self.field == FIELD else self.field
        log.info(f"{what} files re-read", extra={"cert_file": self.config.cert_file})
        return material

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For `add_secure_port`: gRPC asks for the current certificate before every handshake."""
        served = self.material

        def fetch() -> Any:
            nonlocal served
            try:
                material = self.current()
            except Exception:  # never break the handshake over a check
                log.exception(f"checking the {self.field} files failed")
                return None
            if material is served:
                return None  # no change
            served = material
            return material.grpc_configuration()

        return grpc.dynamic_ssl_server_credentials(
            served.grpc_configuration(),
            fetch,
            require_client_authentication=self.client_certs_required,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For an aiohttp site: the first context, which moves every handshake to the current
        one (OpenSSL's SNI hook runs for every ClientHello, with or without a server name)."""
        first = self.material.context

        def swap(ssl_object: Any, server_name: str | None, context: ssl.SSLContext) -> None:
            try:
                current = self.current().context
                if ssl_object.context is not current:
                    ssl_object.context = current
            except Exception:
                log.exception(f"checking the {self.field} files failed")

        first.sni_callback = swap
        return first


class OperatorTls(ListenerTls):
    """`server.operator_tls`: the admin gRPC API and the operator HTTPS listener."""

    def __init__(self, config: OperatorTlsConfig) -> None:
        super().__init__(config, FIELD)


class GrpcTls(ListenerTls):
    """`server.grpc_tls`: the ext_proc listener, always mutual TLS."""

    def __init__(self, config: GrpcTlsConfig) -> None:
        super().__init__(config, GRPC_FIELD)
