"""Who may use kvgate's operator surfaces: `GET /admin/usage` and the kvgate.admin.v1 API.

- With an operator token configured (`server.admin_token_file` / `server.admin_token_env`),
  every call needs `Authorization: Bearer <token>` (HTTP header or gRPC metadata), compared in
  constant time; 401 / UNAUTHENTICATED otherwise, wherever the listener is.
- Without a token, they answer only on a loopback listener (127.0.0.0/8, ::1, localhost): on
  any other address /admin/usage answers 403 and every admin gRPC call PERMISSION_DENIED,
  with a message naming the settings. The decision is made on the listener, never on the
  peer's address: behind a proxy in the same network namespace (an Istio sidecar forwards
  from 127.0.0.6) a remote client would look local.
- With operator TLS (`server.operator_tls`, kvgate.admin.tls), they answer only on the TLS
  listeners (server.admin_listen, server.operator_https_listen); /admin/usage on the plain
  HTTP port answers 403. With a client CA (mutual TLS) the verified client certificate
  authenticates the caller like a loopback listener: no token needed on any address. A token,
  if configured, is required as well (both, never either). `allowed_clients` narrows which of
  the CA's certificates pass (kvgate.admin.identity).
- A token file that goes missing or becomes unusable (unreadable, empty, malformed) revokes:
  every operator token is refused (401, code operator_token_file_unusable) until the file
  holds a valid token again, with a warning logged and kvgate_operator_token_file_valid 0.
  Failing closed is the point: deleting the Secret must not leave the old token working.

/metrics, /healthz, /readyz, the gRPC health service and server reflection (the API's schema,
public in protos/) stay open.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from kvgate.config.model import ConfigError, ServerConfig
from kvgate.config.secrets import read_secret_env, read_secret_file
from kvgate.openai.errors import INVALID_REQUEST_ERROR, ApiError

log = logging.getLogger("kvgate.admin.auth")

ADMIN_METHOD_PREFIX = "/kvgate.admin.v1.Admin/"
TOKEN_SETTINGS = "server.admin_token_file or server.admin_token_env"
CLIENT_CA_SETTING = "server.operator_tls.client_ca_file"
HTTPS_LISTEN_FIELD = "server.operator_https_listen"
MIN_TOKEN_CHARS = 16
# What fits an HTTP header and gRPC metadata unchanged: printable ASCII, no spaces.
_TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")

AdminCheck = Callable[[str | None], ApiError | None]


def is_loopback_listen(listen: str) -> bool:
    """Whether HOST:PORT listens on loopback only. Literal addresses are judged by their
    value, `localhost` is loopback; any other host name counts as exposed (no DNS here)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _valid_token(value: str, field: str) -> str:
    if len(value) < MIN_TOKEN_CHARS or not _TOKEN_CHARS.match(value):
        raise ConfigError(
            f"{field}: the operator token must be at least {MIN_TOKEN_CHARS} printable ASCII "
            "characters without spaces (e.g. `openssl rand -hex 32`)"
        )
    return value


class _TokenFile:
    """A token file, re-read when it changes (a rotated Kubernetes Secret swaps the file
    behind a symlink): checked with one stat() per operator call, which are rare. Missing or
    unusable, it holds no token (None) until a valid one is back: the old token is revoked."""

    FIELD = "server.admin_token_file"

    def __init__(self, path: str) -> None:
        self.path = path
        self._fingerprint = self._stat()
        # At start (and on reload) an unusable file is a ConfigError: nothing starts with it.
        self.value: str | None = _valid_token(read_secret_file(path, self.FIELD), self.FIELD)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> str | None:
        """The valid token, or None while the file is missing or unusable."""
        fingerprint = self._stat()
        if fingerprint == self._fingerprint:
            return self.value
        # Changed or gone. A Secret volume swaps its files with one rename, so a missing file
        # is a deleted Secret (or a broken mount), never a rotation in progress.
        self._fingerprint = fingerprint
        try:
            if fingerprint is None:
                raise ConfigError(f"{self.FIELD}: {self.path} does not exist")
            value = _valid_token(read_secret_file(self.path, self.FIELD), self.FIELD)
        except ConfigError as exc:
            log.warning(
                "the operator token file is missing or cannot be used: every operator token "
                "is refused until it holds a valid token again",
                extra={"error": str(exc)},
            )
            self.value = None
            return None
        log.info(
            "operator token file re-read"
            if self.value is not None
            else "operator token file valid again: operator tokens accepted",
            extra={"path": self.path},
        )
        self.value = value
        return value


@dataclass(frozen=True)
class OperatorTokens:
    env_token: str | None = None
    file: _TokenFile | None = None

    @property
    def configured(self) -> bool:
        return self.env_token is not None or self.file is not None

    def current(self) -> list[str] | None:
        """The tokens that are valid now; None while the token file revokes them all."""
        tokens = [self.env_token] if self.env_token is not None else []
        if self.file is not None:
            file_token = self.file.current()
            if file_token is None:
                return None
            tokens.append(file_token)
        return tokens

    def file_valid(self) -> bool | None:
        """Whether the token file holds a valid token now; None without a token file."""
        return None if self.file is None else self.file.current() is not None


def load_operator_tokens(server: ServerConfig) -> OperatorTokens:
    """Read the configured tokens now; ConfigError (naming the field, never the value)."""
    env_token = None
    if server.admin_token_env is not None:
        field = "server.admin_token_env"
        env_token = _valid_token(read_secret_env(server.admin_token_env, field), field)
    file = _TokenFile(server.admin_token_file) if server.admin_token_file is not None else None
    return OperatorTokens(env_token=env_token, file=file)


def _error(status: int, message: str, code: str) -> ApiError:
    headers = {"www-authenticate": 'Bearer realm="kvgate-admin"'} if status == 401 else None
    return ApiError(status, message, INVALID_REQUEST_ERROR, code, None, headers)


class OperatorAuth:
    """The operator tokens of the running config (replaced on reload) and the listeners'
    exposure, as one check per surface."""

    def __init__(self, tokens: OperatorTokens) -> None:
        self._tokens = tokens
        # Operator TLS: the listener fields that serve it (None: no operator TLS), and whether
        # their clients present a certificate the client CA verified (mutual TLS).
        self._tls_fields: frozenset[str] | None = None
        self._client_certs = False

    @property
    def configured(self) -> bool:
        return self._tokens.configured

    def use_tls(self, tls_fields: Iterable[str], *, client_certs: bool) -> None:
        """Operator TLS is on: the operator endpoints answer only on these listeners (any other
        refuses them, 403 / PERMISSION_DENIED), and with client_certs (mutual TLS, enforced by
        the handshake) a caller on them is authenticated like one on a loopback listener."""
        self._tls_fields = frozenset(tls_fields)
        self._client_certs = client_certs

    def client_certs_on(self, listen_field: str) -> bool:
        """Whether the listener's clients are authenticated by a verified certificate."""
        return self._client_certs and listen_field in (self._tls_fields or ())

    def replace(self, tokens: OperatorTokens) -> None:
        self._tokens = tokens

    def token_file_valid(self) -> bool | None:
        """For kvgate_operator_token_file_valid (read at every scrape)."""
        return self._tokens.file_valid()

    def check(
        self, authorization: str | None, *, listen: str, listen_field: str
    ) -> ApiError | None:
        """None when the call may proceed, else the answer (401 or 403)."""
        if self._tls_fields is not None and listen_field not in self._tls_fields:
            where = (
                f"/admin/usage is on {HTTPS_LISTEN_FIELD} (HTTPS), the admin API on "
                "server.admin_listen"
                if HTTPS_LISTEN_FIELD in self._tls_fields
                else f"the admin API is on server.admin_listen; set {HTTPS_LISTEN_FIELD} for "
                "/admin/usage over HTTPS"
            )
            return _error(
                403,
                f"Operator endpoints are served over TLS only (server.operator_tls is set), not "
                f"on {listen} ({listen_field}): {where}.",
                "operator_endpoint_requires_tls",
            )
        tokens = self._tokens.current()
        if tokens is None:
            return _error(
                401,
                "The operator token file (server.admin_token_file) is missing or holds no "
                "valid token: every operator token is refused until it is restored.",
                "operator_token_file_unusable",
            )
        if tokens:
            scheme, _, given = (authorization or "").strip().partition(" ")
            given = given.strip()
            if scheme.lower() != "bearer" or not given:
                return _error(
                    401,
                    "This is an operator endpoint: send `Authorization: Bearer <operator "
                    f"token>` (the token of {TOKEN_SETTINGS}).",
                    "operator_token_required",
                )
            given_bytes = given.encode("utf-8", "surrogateescape")
            matched = False
            for token in tokens:  # compare with every token: no early exit
                matched |= hmac.compare_digest(given_bytes, token.encode("ascii"))
            if not matched:
                return _error(401, "The operator token is not valid.", "invalid_operator_token")
            return None
        if is_loopback_listen(listen) or self.client_certs_on(listen_field):
            return None
        return _error(
            403,
            f"Operator endpoints are refused on {listen} ({listen_field}): it is not a loopback "
            f"address and no operator token is configured. Set {TOKEN_SETTINGS}, or "
            f"{CLIENT_CA_SETTING} (mutual TLS), or listen on 127.0.0.1.",
            "operator_endpoint_not_exposed",
        )

    def for_listener(self, listen: str, listen_field: str) -> AdminCheck:
        def check(authorization: str | None) -> ApiError | None:
            return self.check(authorization, listen=listen, listen_field=listen_field)

        return check

    def exposure_warnings(self, listeners: dict[str, str]) -> list[str]:
        """One line per operator listener that refuses every call (for the start-up log).

        Not for a mutual TLS listener (the certificate authenticates), nor for a plain listener
        next to operator TLS (refused on purpose: TLS only)."""
        if self.configured:
            return []
        tls = self._tls_fields is not None
        warnings = []
        for field, listen in listeners.items():
            if is_loopback_listen(listen) or self.client_certs_on(field):
                continue
            if tls and field not in (self._tls_fields or ()):
                continue  # a plain listener: TLS only, refused on purpose
            note = " (TLS without client certificates authenticates no one)" if tls else ""
            warnings.append(
                f"{field} is {listen}, not a loopback address, and no operator token is "
                f"configured{note}: its operator endpoints answer 403 / PERMISSION_DENIED. Set "
                f"{TOKEN_SETTINGS}, or {CLIENT_CA_SETTING} (mutual TLS), to use them there."
            )
        return warnings


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item in metadata or ():
        name, value = item[0], item[1]
        if name == key:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


class OperatorAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization` metadata on every kvgate.admin.v1.Admin call; other services
    on the admin port (server reflection) pass untouched."""

    def __init__(self, check: AdminCheck) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if not method.startswith(ADMIN_METHOD_PREFIX):
            return await continuation(handler_call_details)
        authorization = _metadata_value(handler_call_details.invocation_metadata, "authorization")
        denial = self._check(authorization)
        if denial is None:
            return await continuation(handler_call_details)
        code = (
            grpc.StatusCode.UNAUTHENTICATED
            if denial.status == 401
            else grpc.StatusCode.PERMISSION_DENIED
        )
        log.info(
            "operator call refused",
            extra={"method": method, "status": code.name, "reason": denial.code},
        )
        handler = await continuation(handler_call_details)
        return _refusing_handler(handler, code, denial.message)


def _refusing_handler(
    handler: grpc.RpcMethodHandler[Any, Any] | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[Any, Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - an async generator that never yields

    deserializer = handler.request_deserializer if handler else None
    serializer = handler.response_serializer if handler else None
    request_streaming = bool(handler and handler.request_streaming)
    response_streaming = bool(handler and handler.response_streaming)
    if not request_streaming and not response_streaming:
        return grpc.unary_unary_rpc_method_handler(unary, deserializer, serializer)
    if not request_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, deserializer, serializer)
    if not response_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, deserializer, serializer)
    return grpc.stream_stream_rpc_method_handler(streaming, deserializer, serializer)
