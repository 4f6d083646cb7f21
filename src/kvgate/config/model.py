"""The configuration file's schema. Every error names the field and the reason."""

from __future__ import annotations

import gc
import hashlib
import ipaddress
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import parse_qs, urlsplit

import yaml
import yaml_rs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ModelWrapValidatorHandler,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema, core_schema

# Every leaf field says how a change of it reaches the running process (kvgate.reload):
# Reload[T] on a reload, Restart[T] only by a restart.
from kvgate.config.reloading import Reload, Restart

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class ConfigError(ValueError):
    """A configuration that cannot be served; the message lists every problem."""


def hash_api_key(api_key: str) -> str:
    """API keys are stored only as SHA-256 hex digests."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# The sections validated so far in one parse_config, by their raw value: a fleet of tenants
# repeats a few limit and budget shapes, validated once and then shared (they are frozen).
_SHARED_SECTIONS: ContextVar[dict[Hashable, Any] | None] = ContextVar(
    "_SHARED_SECTIONS", default=None
)


# Scalars a YAML reader gives, keyed by their exact type (subclasses take the long way).
_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})


def _raw_key(value: Any) -> Hashable | None:
    """A key equal only for raw values that validate alike: each scalar's type is part of
    it (1, 1.0 and True are equal in Python, not to pydantic). None: not keyable."""
    if isinstance(value, dict):
        items: list[Hashable] = []
        for key, item in value.items():
            if not isinstance(key, str):
                return None
            item_type = type(item)
            if item_type in _SCALAR_TYPES:  # most values: no call (a third of the time)
                items.append((key, item_type, item))
                continue
            item_key = _raw_key(item)
            if item_key is None:
                return None
            items.append((key, item_key))
        return (dict, tuple(items))
    if value is None or isinstance(value, str | int | float):  # bool is an int
        return (type(value), value)
    if isinstance(value, list):
        elements = [_raw_key(element) for element in value]
        return None if any(e is None for e in elements) else (list, tuple(elements))
    return None


class _Shared(_Strict):
    """A section whose instances equal raw values share, within one parse_config."""

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[BaseModel], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        # Around the whole section, its own model validators too (a model_validator here
        # would run inside theirs): a shared section is checked once, not at every tenant.
        return core_schema.no_info_wrap_validator_function(cls._share, handler(source))

    @classmethod
    def _share(cls, value: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        shared = _SHARED_SECTIONS.get()
        raw_key = _raw_key(value) if shared is not None and isinstance(value, dict) else None
        if shared is None or raw_key is None:
            return handler(value)
        key = (cls, raw_key)
        section: Self | None = shared.get(key)
        if section is None:
            section = shared[key] = handler(value)
        return section


_gc_pauses = 0
_gc_pauses_lock = threading.Lock()


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a config is built: a config of 100,000
    tenants allocates millions of objects and none of them is garbage, yet each
    allocation burst would start a collection walking all of them (most of the time of a
    large load). Reference counting still frees everything meanwhile; nested and
    concurrent pauses (a reload in a worker thread) turn it back on after the last."""
    global _gc_pauses
    with _gc_pauses_lock:
        if _gc_pauses == 0:
            was_enabled = gc.isenabled()
            gc.disable()
            _gc_pauses = -1 if not was_enabled else 1
        elif _gc_pauses > 0:
            _gc_pauses += 1
        else:
            _gc_pauses -= 1
    try:
        yield
    finally:
        with _gc_pauses_lock:
            if _gc_pauses > 0:
                _gc_pauses -= 1
                if _gc_pauses == 0:
                    gc.enable()
            else:
                _gc_pauses += 1


_URI_SAN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s]+$")
_DNS_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_SAN = re.compile(rf"^(?=.{{1,253}}$){_DNS_LABEL}(\.{_DNS_LABEL})*$")


class ClientIdentitiesConfig(_Strict):
    """Which verified client certificates a mutual TLS listener accepts: one whose URI SAN
    (a SPIFFE ID), DNS SAN or subject common name is listed (any one match suffices). Exact
    matches; DNS names ignore case. Without this list any certificate the client CA signed
    is accepted.

    Reload: read from the current snapshot at every call or stream, so a reload revokes (or
    admits) an identity without a restart."""

    uri_sans: Reload[list[str]] = Field(
        default_factory=list, description="URI SANs, e.g. spiffe://cluster.local/ns/NS/sa/SA"
    )
    dns_sans: Reload[list[str]] = Field(default_factory=list, description="DNS SANs, no wildcards")
    common_names: Reload[list[str]] = Field(default_factory=list, description="subject CNs")

    @field_validator("uri_sans")
    @classmethod
    def _uris(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _URI_SAN.match(value):
                raise ValueError(f"{value!r} is not a URI (scheme:rest, no spaces)")
        return _distinct_identities(values)

    @field_validator("dns_sans")
    @classmethod
    def _dns_names(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _DNS_SAN.match(value):
                raise ValueError(f"{value!r} is not a DNS name (wildcards are not matched)")
        return _distinct_identities([value.lower() for value in values])

    @field_validator("common_names")
    @classmethod
    def _common_names(cls, values: list[str]) -> list[str]:
        for value in values:
            if not value or not value.isprintable():
                raise ValueError(f"{value!r}: a common name is non-empty printable text")
        return _distinct_identities(values)

    @model_validator(mode="after")
    def _not_empty(self) -> ClientIdentitiesConfig:
        if not (self.uri_sans or self.dns_sans or self.common_names):
            raise ValueError(
                "list at least one of uri_sans, dns_sans, common_names (or leave "
                "allowed_clients out to accept any certificate the client CA signed)"
            )
        return self


def _distinct_identities(values: list[str]) -> list[str]:
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise ValueError(f"listed twice: {', '.join(duplicates)}")
    return values


class OperatorTlsConfig(_Strict):
    """TLS on the operator listeners (server.admin_listen, server.operator_https_listen): PEM
    files, e.g. a cert-manager Secret volume (tls.crt, tls.key, ca.crt), re-read whenever they
    change. With `client_ca_file`, clients must present a certificate that CA signed (mutual
    TLS), and that certificate authenticates them; `allowed_clients` narrows that to the
    listed identities.

    Restart: the listeners and their credentials are built at start (turning TLS or client
    certificates on or off changes the listener); the files' contents, a renewed certificate
    or CA, are re-read whenever they change, without a reload (kvgate.admin.tls). Reload:
    who may connect (`allowed_clients`)."""

    cert_file: Restart[str] = Field(min_length=1, description="the server certificate (chain), PEM")
    key_file: Restart[str] = Field(min_length=1, description="its private key, PEM, not encrypted")
    client_ca_file: Restart[str | None] = Field(
        default=None,
        min_length=1,
        description="CA certificate(s), PEM, for client certificates: set, mutual TLS",
    )
    allowed_clients: ClientIdentitiesConfig | None = None

    @model_validator(mode="after")
    def _allow_list_needs_client_ca(self) -> OperatorTlsConfig:
        if self.allowed_clients is not None and self.client_ca_file is None:
            raise ValueError("allowed_clients needs client_ca_file (mutual TLS)")
        return self


class GrpcTlsConfig(_Strict):
    """Mutual TLS on the ext_proc listener (server.grpc_listen): Envoy must present a
    certificate the client CA signed (and, with `allowed_clients`, one of the listed
    identities) to open any stream. Same files and renewal as OperatorTlsConfig (the
    listener is built at start, the files re-read when they change)."""

    cert_file: Restart[str] = Field(min_length=1, description="the server certificate (chain), PEM")
    key_file: Restart[str] = Field(min_length=1, description="its private key, PEM, not encrypted")
    client_ca_file: Restart[str] = Field(
        min_length=1, description="CA certificate(s), PEM, that signed Envoy's certificate"
    )
    allowed_clients: ClientIdentitiesConfig | None = None


class ServerConfig(_Strict):
    grpc_listen: Restart[str] = "127.0.0.1:50051"  # bound at start
    http_listen: Restart[str] = "127.0.0.1:9464"  # metrics/health port, bound at start
    # The operator gRPC API (usage, backends, reload): keep it on a private address.
    admin_listen: Restart[str] = "127.0.0.1:50052"  # bound at start
    # DEBUG adds one JSON line per settled or rejected request. Set on the root logger by
    # the reloader.
    log_level: Reload[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = "INFO"
    # Seconds in-flight streams get to finish on SIGTERM before they are cut and settled
    # (read from the snapshot at shutdown).
    shutdown_grace_s: Reload[float] = Field(default=25.0, ge=0)
    # Reservations are leases: one nobody renews (a lost stream) frees itself after this.
    # Restart: the store keeps the TTL it was built with.
    lease_ttl_s: Restart[float] = Field(default=900.0, gt=0)
    tokenizer_threads: Reload[int] = Field(default=2, ge=1, le=64)  # TokenizerService.resize
    # Token counts of prompt segments (the text between special tokens), every model
    # (TokenizerService.resize).
    tokenizer_cache_entries: Reload[int] = Field(default=65536, ge=0)
    # Every tokenizer is loaded again from a new one.
    tokenizer_cache_dir: Reload[str] = "var/tokenizers"
    # Prompt text left to tokenize after the segment cache, up to this many characters, is
    # tokenized on the event loop (about 0.1 ms per 1k tokens): cheaper than a round trip
    # through a worker thread. 0: always on the workers. (TokenizerService.resize)
    inline_tokenize_max_chars: Reload[int] = Field(default=16384, ge=0, le=1024 * 1024)
    # Every admission decision is answered within this, with kvgate's own OpenAI-shaped
    # error when it cannot finish in time: keep it below Envoy's ext_proc message_timeout
    # (2 s in the shipped configs), or Envoy answers an empty 504 first.
    decision_timeout_s: Reload[float] = Field(default=1.5, gt=0, le=60)
    # The most inputs (embeddings) or query-document pairs (rerank, score) one pooling
    # request may carry: each is a prompt the engine encodes, and one request of ten
    # thousand is one request to RPM and concurrency. At most kvgate.pooling.MAX_INPUTS.
    max_pooling_inputs: Reload[int] = Field(default=2048, ge=1, le=65536)
    # The ext_proc filter's max_message_timeout in Envoy's config: the longest kvgate may
    # extend a message's deadline while a request waits in a pool's queue. Envoy ignores an
    # extension above it (and then answers 504 at message_timeout), so kvgate checks every
    # queue's bound against it.
    envoy_max_message_timeout_s: Reload[float] = Field(default=35.0, gt=0, le=3600)
    # What a request cut before its end costs (client gone, Envoy timeout, shutdown) once the
    # backend accepted it (2xx headers): "backend_work" charges the prompt (the prefill was
    # done) plus the output seen, at least one token per content event; "visible_text" is the
    # older rule: nothing unless answer text reached the client, then prompt + counted text.
    cut_request_charge: Reload[Literal["backend_work", "visible_text"]] = "backend_work"
    # gRPC server options, set at start.
    grpc_max_message_bytes: Restart[int] = Field(default=64 * 1024 * 1024, ge=4 * 1024 * 1024)
    # The operator token: when set, `GET /admin/usage` and the admin gRPC API need
    # `Authorization: Bearer <token>`. Without one they answer only on a loopback listener.
    # `admin_token_env` names an environment variable; `admin_token_file` a file (a Kubernetes
    # Secret volume), read at start, on every reload and whenever it changes. With both set,
    # either token is accepted (a rotation: the new one in the file, the old one in the env).
    # Reload: a missing or unusable token rejects the reload (kvgate.admin.auth).
    admin_token_env: Reload[str | None] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    admin_token_file: Reload[str | None] = Field(default=None, min_length=1)
    # TLS for the operator surfaces: the admin gRPC listener, and /admin/usage on its own
    # HTTPS listener (`operator_https_listen`, optional). /metrics, /healthz and /readyz stay
    # plain HTTP on `http_listen`, which then refuses /admin/usage (TLS only). With a client CA
    # (mutual TLS) a client certificate authenticates the caller, on any address; a token, if
    # also set, is required as well.
    operator_tls: OperatorTlsConfig | None = None
    operator_https_listen: Restart[str | None] = None  # bound at start
    # Mutual TLS on the ext_proc listener: without it anyone who reaches grpc_listen can open
    # streams (any route settings) and hold KV. The kubelet's gRPC probes have no client
    # certificate: probe /readyz and /healthz on http_listen instead.
    grpc_tls: GrpcTlsConfig | None = None

    @field_validator("grpc_listen", "http_listen", "admin_listen", "operator_https_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError("must be HOST:PORT with a port from 0 (any free port) to 65535")
        return value

    @model_validator(mode="after")
    def _https_needs_tls(self) -> ServerConfig:
        if self.operator_https_listen is not None and self.operator_tls is None:
            raise ValueError(
                "operator_https_listen needs operator_tls (cert_file and key_file) to serve HTTPS"
            )
        return self


class RequestRateConfig(_Shared):
    """Requests per minute: a bucket of `limit` requests refilled at limit/60 per second."""

    limit: Reload[int] = Field(gt=0)
    shadow: Reload[bool] = False


class TokenRateConfig(_Shared):
    """Tokens per minute as a token bucket over input + output tokens."""

    capacity: Reload[int] = Field(
        gt=0, description="burst: the most tokens one minute can take at once"
    )
    refill_per_s: Reload[float | None] = Field(
        default=None, gt=0, description="default: capacity / 60 (a per-minute rate)"
    )
    shadow: Reload[bool] = False

    @property
    def refill(self) -> float:
        return self.refill_per_s if self.refill_per_s is not None else self.capacity / 60


class ConcurrencyConfig(_Shared):
    limit: Reload[int] = Field(gt=0)
    shadow: Reload[bool] = False


def _shorthand(value: Any, key: str) -> Any:
    """`rpm: 600` means `rpm: {limit: 600}` (and `tpm: 60000` means `{capacity: 60000}`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {key: value}
    return value


class LimitsConfig(_Shared):
    """A tenant's limits (tenant-wide, or on one model), compiled into the snapshot: on a
    reload its rate buckets resize to the new specs."""

    rpm: RequestRateConfig | None = None
    tpm: TokenRateConfig | None = None
    concurrency: ConcurrencyConfig | None = None

    @field_validator("rpm", "concurrency", mode="before")
    @classmethod
    def _limit_shorthand(cls, value: Any) -> Any:
        return _shorthand(value, "limit")

    @field_validator("tpm", mode="before")
    @classmethod
    def _capacity_shorthand(cls, value: Any) -> Any:
        return _shorthand(value, "capacity")


class BudgetConfig(_Shared):
    daily_usd: Reload[Decimal | None] = Field(default=None, ge=0)
    monthly_usd: Reload[Decimal | None] = Field(default=None, ge=0)
    # What happens to a request whose worst-case cost does not fit the remaining budget.
    action: Reload[Literal["block", "fallback", "clamp"]] = "block"
    fallback_model: Reload[str | None] = None
    shadow: Reload[bool] = False

    @model_validator(mode="after")
    def _fallback_named(self) -> BudgetConfig:
        if self.action == "fallback" and not self.fallback_model:
            raise ValueError("action 'fallback' needs fallback_model")
        for amount in (self.daily_usd, self.monthly_usd):
            if amount is not None and amount.as_tuple().exponent < -12:  # type: ignore[operator]
                raise ValueError("budgets have at most 12 decimal places (pico-dollars)")
        return self


class LevelBudgetConfig(_Shared):
    """A team's, a user's or a key's own money caps: always `block` (fallback and clamp are
    the tenant's choices), checked and reserved with the tenant's in one step."""

    daily_usd: Reload[Decimal | None] = Field(default=None, ge=0)
    monthly_usd: Reload[Decimal | None] = Field(default=None, ge=0)
    shadow: Reload[bool] = False

    @model_validator(mode="after")
    def _precision(self) -> LevelBudgetConfig:
        for amount in (self.daily_usd, self.monthly_usd):
            if amount is not None and amount.as_tuple().exponent < -12:  # type: ignore[operator]
                raise ValueError("budgets have at most 12 decimal places (pico-dollars)")
        return self


class LevelConfig(_Shared):
    """The limits of one level under a tenant (a team, a user, an API key), each its own:
    a request takes from the tenant's limits and from every level it belongs to."""

    limits: LimitsConfig = LimitsConfig()
    budget: LevelBudgetConfig | None = None
    # The models this level may use (None: every model the tenant may).
    models: Reload[list[str] | None] = None


class TenantConfig(_Strict):
    """One tenant, compiled into the snapshot: every field applies on a reload (its rate
    buckets resize to the new specs)."""

    name: Reload[str]
    limits: LimitsConfig = LimitsConfig()
    # Optional tighter limits for this tenant on one model.
    model_limits: dict[str, LimitsConfig] = Field(default_factory=dict)
    budget: BudgetConfig | None = None
    # The tenant's priority class in a pool's queue (higher is served first), and the other
    # classes its requests may ask for with the `kvgate-priority` header.
    priority: Reload[int] = Field(default=0, ge=-100, le=100)
    allowed_priorities: Reload[list[int]] = Field(default_factory=list)
    # The response cache for this tenant: None follows response_cache.enabled / .sampled.
    response_cache: Reload[bool | None] = None
    response_cache_sampled: Reload[bool | None] = None
    # With a cache's `scope: model`, this tenant's deterministic answers are shared with,
    # and it is served those of, other tenants that opt in too. Off: its entries are its own.
    # A shared entry tells a tenant, by the speed of its answer, that another asked first.
    cache_sharing: Reload[bool] = False
    # The semantic cache serves this tenant only if it opts in (and the model does too).
    semantic_cache: Reload[bool] = False
    # Teams by name, each with limits of its own (a key's or a token's team names one).
    teams: dict[str, LevelConfig] = Field(default_factory=dict)
    # Users by id, each with limits of its own; `user_limits` applies to each other user
    # separately (a key's or a token's user), none when unset.
    users: dict[str, LevelConfig] = Field(default_factory=dict)
    user_limits: LevelConfig | None = None
    # Empty for a tenant only the mesh identifies (identity.jwt / identity.spiffe).
    api_key_sha256: Reload[list[str] | str] = Field(
        default_factory=list,
        description="SHA-256 hex digest(s) of the tenant's API key(s); `kvgate hash-key`.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-128 characters of letters, digits and . _ : / -")
        return value

    @field_validator("api_key_sha256")
    @classmethod
    def _hashes(cls, value: list[str] | str) -> list[str]:
        hashes = [value] if isinstance(value, str) else value
        for digest in hashes:
            if not _SHA256_HEX.match(digest):
                raise ValueError(
                    "must be a lowercase SHA-256 hex digest (64 characters), "
                    "never the key itself; use `kvgate hash-key`"
                )
        return hashes

    @property
    def key_hashes(self) -> list[str]:
        value = self.api_key_sha256
        return [value] if isinstance(value, str) else list(value)


class PricingConfig(_Strict):
    """US dollars per million tokens, as decimal strings ("0.15")."""

    input_per_million: Reload[Decimal] = Field(default=Decimal(0), ge=0)
    cached_input_per_million: Reload[Decimal | None] = Field(default=None, ge=0)
    output_per_million: Reload[Decimal] = Field(default=Decimal(0), ge=0)

    @model_validator(mode="after")
    def _precision(self) -> PricingConfig:
        for price in (
            self.input_per_million,
            self.cached_input_per_million,
            self.output_per_million,
        ):
            if price is not None and price.as_tuple().exponent < -6:  # type: ignore[operator]
                raise ValueError("prices have at most 6 decimal places")
        return self


class EngineCountingConfig(_Strict):
    """How a model with `counting: engine` is counted: by its vLLM's own /tokenize. On a
    reload the model's counter is built again before the swap (its engine's URL, key,
    bounds)."""

    # vLLM's /tokenize. None: derived from the model's backend (the origin of its
    # discovery.metrics_url, or http://DNS_NAME:PORT of a pool's endpoint_discovery).
    tokenize_url: Reload[str | None] = Field(default=None, pattern=r"^https?://[^\s]+$")
    # Each count's whole deadline, its wait for a free connection included. It must stay
    # below server.decision_timeout_s, so kvgate answers before its own decision deadline.
    timeout_s: Reload[float] = Field(default=0.5, gt=0, le=30)
    # When the engine cannot count in time (slow, down, an error): "refuse" answers 503 +
    # Retry-After; "reserve_max_context" admits at the upper bound (prompt + completion = the
    # model's max_context), never a guess below the real prompt.
    on_unavailable: Reload[Literal["refuse", "reserve_max_context"]] = "refuse"
    retry_after_s: Reload[float] = Field(default=1.0, ge=1, le=600)
    # /tokenize requests in flight to one URL at once (the models sharing a URL share them;
    # the largest setting among them applies).
    max_concurrency: Reload[int] = Field(default=8, ge=1, le=1024)
    # Counts of identical requests (a digest of the exact /tokenize body), this model's LRU,
    # in bytes (0: no cache); an entry is dropped after cache_ttl_s.
    cache_max_bytes: Reload[int] = Field(default=4 * 1024 * 1024, ge=0)
    cache_ttl_s: Reload[float] = Field(default=600.0, gt=0)
    # Chats are cached only when set: a template that reads the clock (Llama 3.x's
    # strftime_now, gpt-oss's date) renders the same messages differently on another day.
    cache_chats: Reload[bool] = False


# vLLM 0.34's ReasoningEffort: the keys its --reasoning-effort-map accepts.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class EngineFlagsConfig(_Strict):
    """The options the model's vLLM server was started with that change a chat's prompt
    (each as vLLM's flag of the same name); kvgate counts with the same values. On a reload
    the model's tokenizer is loaded again (a template file read again) before the swap."""

    # --default-chat-template-kwargs: template keywords under the request's own.
    default_chat_template_kwargs: Reload[dict[str, Any]] = Field(default_factory=dict)
    # --reasoning-effort-map: a request's reasoning_effort rewritten before rendering.
    reasoning_effort_map: Reload[dict[ReasoningEffort, str]] = Field(default_factory=dict)
    # --chat-template: a file path, or the template itself when the value holds "{", "}"
    # or a line break (vLLM's own rule); used in place of the model directory's template.
    chat_template: Reload[str | None] = Field(default=None, min_length=1)
    # --chat-template-content-format: "auto" detects it from the template as vLLM does.
    chat_template_content_format: Reload[Literal["auto", "string", "openai"]] = "auto"
    # --exclude-tools-when-tool-choice-none: no tools in the prompt for tool_choice "none".
    exclude_tools_when_tool_choice_none: Reload[bool] = False


class VisionConfig(_Strict):
    """Bounds on the images of one request to a vision model (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL and LLaVA-1.5 directories; other models refuse image parts). On a reload the
    model's counter is loaded again before the swap."""

    # Image parts in one request (every message together).
    max_images_per_request: Reload[int] = Field(default=8, ge=0, le=1024)
    # A data: URL's decoded bytes.
    max_image_bytes: Reload[int] = Field(default=10 * 1024 * 1024, ge=1024)
    # width x height of a data: image, read from its header before it is decompressed.
    max_image_pixels: Reload[int] = Field(default=16 * 1024 * 1024, ge=1)
    # http(s) image URLs (the engine fetches them; reserved at the most one image can take).
    remote_images: Reload[bool] = True
    # Hosts an image URL may name even when they are private or loopback addresses (literal
    # addresses and localhost are refused otherwise: the engine would fetch from inside).
    allowed_url_hosts: Reload[list[str]] = Field(default_factory=list)
    # The vLLM server's --mm-processor-kwargs, as on its command line: min_pixels,
    # max_pixels and size {shortest_edge, longest_edge} change how many tokens an image is.
    # Other keys are refused (kvgate would not count what they change).
    mm_processor_kwargs: Reload[dict[str, Any]] = Field(default_factory=dict)

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _known_processor_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        def pixels(name: str, number: Any) -> None:
            if number is not None and (
                isinstance(number, bool) or not isinstance(number, int) or number <= 0
            ):
                raise ValueError(f"{name} must be a positive integer")

        unknown = sorted(set(value) - {"min_pixels", "max_pixels", "size"})
        if unknown:
            raise ValueError(f"only min_pixels, max_pixels and size are counted, not {unknown}")
        pixels("min_pixels", value.get("min_pixels"))
        pixels("max_pixels", value.get("max_pixels"))
        size = value.get("size")
        if size is not None:
            # Both edges: the image processor refuses a size without either (every image).
            if not isinstance(size, dict) or set(size) != {"shortest_edge", "longest_edge"}:
                raise ValueError("size must be an object of shortest_edge and longest_edge")
            for key, number in size.items():
                pixels(f"size.{key}", number)
        return value


class ModelConfig(_Strict):
    """One model, compiled into the snapshot: every field applies on a reload; a changed
    tokenizer or counting setting loads the model's counter again before the swap."""

    name: Reload[str]
    tokenizer: Reload[str | None] = Field(
        default=None,
        description="A local directory with tokenizer.json + tokenizer_config.json (or a "
        "Mistral tekken.json / tokenizer.model.v*), or a Hugging Face model id fetched once "
        "at start-up and cached. Required with `counting: local`; not read with `engine`.",
    )
    max_context: Reload[int] = Field(gt=0)
    default_max_new_tokens: Reload[int] = Field(gt=0)
    backend: Reload[str]
    pricing: PricingConfig = PricingConfig()
    # "auto" counts with tiktoken's compiled BPE when the vocabulary passes its exactness
    # checks at load (else the reference); "reference" always uses the model's tokenizers.
    counting_engine: Reload[Literal["auto", "reference"]] = "auto"
    # The prompt path vLLM takes for this model, as its --tokenizer-mode: "auto" decides
    # from the directory as vLLM does (gpt-oss config -> harmony; tekken.json or
    # tokenizer.model.v* with consolidated weights, or without tokenizer.json -> mistral;
    # DeepseekV32ForCausalLM -> deepseek_v32, DeepseekV4For* -> deepseek_v4; else hf). Set
    # it when vLLM is started with an explicit --tokenizer-mode.
    tokenizer_mode: Reload[
        Literal["auto", "hf", "mistral", "harmony", "deepseek_v32", "deepseek_v4"]
    ] = "auto"
    # gpt-oss only: vLLM runs with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=1 (instructions in
    # the system message, and a system message mid-conversation a whole new one).
    harmony_system_instructions: Reload[bool] = False
    # The vLLM server's own options that shape chat prompts, as it was started with them.
    engine_flags: EngineFlagsConfig = EngineFlagsConfig()
    # Images in requests to a vision model: per-request bounds (docs/counting.md, "Images").
    vision: VisionConfig = VisionConfig()
    # Who counts this model's prompts: "local" renders and tokenizes them in kvgate with
    # `tokenizer`; "engine" asks the model's vLLM (/tokenize, `engine_counting`) for every
    # count: exact by construction, for a model whose rendering kvgate cannot reproduce.
    counting: Reload[Literal["local", "engine"]] = "local"
    engine_counting: EngineCountingConfig = EngineCountingConfig()
    # The semantic cache may answer this model's requests (for tenants that opt in too).
    semantic_cache: Reload[bool] = False
    # Whether the exact-match cache may serve this model's sampled (temperature > 0)
    # requests; None follows response_cache.sampled. A tenant's own setting comes first.
    response_cache_sampled: Reload[bool | None] = None
    # Part of every cache key and semantic context of this model: change it (e.g. to the
    # weights' revision) when other weights are served under the same name, and every
    # answer cached before is out of reach at once, on every replica (entries then expire).
    cache_generation: Reload[str] = Field(default="", max_length=128)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-128 characters of letters, digits and . _ : / -")
        return value

    @model_validator(mode="after")
    def _something_counts(self) -> ModelConfig:
        if self.counting == "local" and not self.tokenizer:
            raise ValueError(
                "tokenizer: counting: local needs the model's tokenizer (a directory or a hub "
                "id); without one, count with the engine (counting: engine)"
            )
        return self


def engine_tokenize_url(model: ModelConfig, backend: BackendConfig) -> str | None:
    """Where a `counting: engine` model is counted: its explicit tokenize_url, else its
    backend's engine (the origin of a single server's metrics_url, or a pool's DNS name)."""
    if model.engine_counting.tokenize_url is not None:
        return model.engine_counting.tokenize_url
    discovery = backend.endpoint_discovery
    if discovery is not None:
        host = f"[{discovery.dns_name}]" if ":" in discovery.dns_name else discovery.dns_name
        return f"http://{host}:{discovery.port}/tokenize"
    if backend.discovery is not None and not backend.is_pool:
        parts = urlsplit(backend.discovery.metrics_url)
        if parts.scheme in ("http", "https") and parts.netloc:
            return f"{parts.scheme}://{parts.netloc}/tokenize"
    return None


class DiscoveryConfig(_Strict):
    """Read the backend's own capacity and load from its vLLM `/metrics`. On a reload the
    monitors are restarted (CapacityRegistry.sync)."""

    metrics_url: Reload[str] = Field(description="e.g. http://vllm:8000/metrics")
    # The served model name to filter on when one server exposes several.
    model_name: Reload[str | None] = None
    interval_s: Reload[float] = Field(default=5.0, gt=0)
    # The whole scrape (connect, headers, body) ends by then or counts as failed.
    timeout_s: Reload[float] = Field(default=2.0, gt=0)
    # Older scrapes are ignored: stale numbers never drive admission.
    max_staleness_s: Reload[float] = Field(default=30.0, gt=0)
    # A larger body fails the scrape unread (vLLM's /metrics is about 100 KiB); redirects
    # are never followed and compressed bodies are refused.
    max_body_bytes: Reload[int] = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=256 * 1024 * 1024)


class BackpressureConfig(_Strict):
    """Shed load (429 backend_overloaded) while the engine itself reports pressure. Rebuilt
    on a reload (CapacityRegistry.sync)."""

    max_kv_cache_usage: Reload[float | None] = Field(default=0.95, gt=0, le=1)
    max_requests_waiting: Reload[int | None] = Field(default=8, ge=0)
    retry_after_s: Reload[float] = Field(default=2.0, ge=1)


# A pool's discovered members by default: private ranges (RFC 1918, the RFC 6598 shared
# space some CNIs give pods, IPv6 unique local); never loopback or link-local.
DEFAULT_ALLOWED_ENDPOINT_CIDRS = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "fc00::/7",
)
DEFAULT_MAX_AUTO_KV_BUDGET_TOKENS = 4 * 1024 * 1024

# Envoy's extended message deadline ends this long after kvgate's own, so a request that
# waited its whole bound still gets kvgate's answer (429 + Retry-After), not an empty 504.
QUEUE_DEADLINE_MARGIN_S = 1.0


class EndpointDiscoveryConfig(_Strict):
    """A pool's members from DNS: every address a name resolves to (a Kubernetes headless
    Service gives one A/AAAA record per ready pod). Pool membership follows a reload."""

    dns_name: Reload[str] = Field(min_length=1, max_length=253)
    port: Reload[int] = Field(gt=0, lt=65536)
    refresh_s: Reload[float] = Field(default=5.0, gt=0)
    # A name that suddenly resolves to thousands of addresses must not start thousands of
    # scrapers: the first this many (sorted) are the pool, and kvgate says so in its log.
    max_endpoints: Reload[int] = Field(default=256, ge=1, le=4096)
    # Resolved addresses outside these ranges never join the pool (counted and logged).
    # Loopback (127.0.0.0/8, ::1) and link-local (169.254.0.0/16 with the cloud metadata
    # service, fe80::/10) only by a range written inside them, never by e.g. 0.0.0.0/0;
    # unspecified and multicast addresses never.
    allowed_cidrs: Reload[list[str]] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_ENDPOINT_CIDRS), min_length=1
    )

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                raise ValueError(f"{cidr!r} is not a CIDR range (10.0.0.0/8): {exc}") from None
        return value


class PickingConfig(_Strict):
    """How kvgate chooses one endpoint of a pool (see kvgate.policy.picking). The prefix
    indexes follow a reload (PoolScheduler.sync)."""

    prefix_affinity: Reload[bool] = True
    # Prompts are hashed in blocks of this many characters (about 16 tokens).
    block_chars: Reload[int] = Field(default=64, ge=8, le=4096)
    # About 0.25 µs to hash and 1 µs to record per block, on the event loop: bounded.
    max_blocks: Reload[int] = Field(default=128, ge=1, le=512)
    # (block hash, endpoint) pairs remembered per pool and kvgate process, least recently
    # used dropped first (about 110 bytes each).
    max_entries: Reload[int] = Field(default=100_000, ge=1)
    affinity_weight: Reload[float] = Field(default=0.6, ge=0, le=1)
    # Affinity counts only while the endpoint's KV use after the request stays at or below
    # this, so a popular prefix never piles onto one pod.
    load_gate: Reload[float] = Field(default=0.85, gt=0, le=1)


class QueueConfig(_Strict):
    """Wait for room in the pool instead of a 429 (the tenant's own limits still answer at
    once). The queues follow a reload (PoolScheduler.sync); requests already queued keep
    waiting under the new settings."""

    # kvgate extends Envoy's per-message deadline to this + decision_timeout_s + 1 s while a
    # request waits; that must stay within server.envoy_max_message_timeout_s.
    max_wait_s: Reload[float] = Field(default=10.0, gt=0, le=3600)
    max_queued: Reload[int] = Field(default=1000, ge=1)
    max_queued_per_tenant: Reload[int] = Field(default=100, ge=1)
    input_weight: Reload[float] = Field(default=1.0, gt=0)
    output_weight: Reload[float] = Field(default=2.0, gt=0)
    poll_interval_s: Reload[float] = Field(default=0.05, gt=0, le=5)


class BackendConfig(_Strict):
    """One backend (or pool), compiled into the snapshot: every field applies on a reload;
    its ledger takes the new limits for new work."""

    name: Reload[str]
    # A number, or "auto": num_gpu_blocks x block_size read from vLLM's
    # vllm:cache_config_info (needs `discovery`).
    kv_budget_tokens: Reload[int | Literal["auto"]]
    # The most an automatic budget may be, whatever an endpoint's /metrics claims (a rogue
    # or broken pod reporting a huge cache would otherwise take most prompts); a capped
    # report is counted and logged. 4 Mi tokens: above one engine of a 7-8B model on an 80
    # GB GPU (0.4-1 M tokens); raise it for data-parallel servers or small models. Read
    # whenever a budget is taken from a reading.
    max_auto_kv_budget_tokens: Reload[int] = Field(default=DEFAULT_MAX_AUTO_KV_BUDGET_TOKENS, gt=0)
    kv_block_size: Reload[int] = Field(default=16, gt=0)
    max_concurrent_requests: Reload[int] = Field(default=256, gt=0)
    discovery: DiscoveryConfig | None = None
    backpressure: BackpressureConfig | None = None
    # The backend's own API key (vLLM --api-key), sent as `Authorization: Bearer` on every
    # request kvgate forwards to it. Tenants' keys never reach a backend. `api_key_env` names
    # an environment variable holding it, so the secret need not live in this file.
    api_key: Reload[str | None] = Field(default=None, min_length=1, repr=False)
    api_key_env: Reload[str | None] = Field(default=None, min_length=1)
    # A pool: the backend is served by several endpoints (IP:PORT), each with this
    # section's KV budget and concurrency. kvgate picks one per request and names it to
    # Envoy in x-kvgate-destination (an ORIGINAL_DST cluster). Static, or from DNS.
    endpoints: Reload[list[str] | None] = None
    endpoint_discovery: EndpointDiscoveryConfig | None = None
    picking: PickingConfig = PickingConfig()
    queue: QueueConfig | None = None

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("needs at least one IP:PORT")
        for address in value:
            parse_endpoint_address(address)
        if len(set(value)) != len(value):
            raise ValueError("lists an endpoint twice")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        # Backend names double as Envoy cluster names (routing uses x-kvgate-backend).
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", value):
            raise ValueError("must be 1-128 characters of letters, digits and . _ -")
        return value

    @field_validator("kv_budget_tokens")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError('must be greater than 0 (or "auto")')
        return value

    @model_validator(mode="after")
    def _budget_holds_a_block(self) -> BackendConfig:
        if self.kv_budget_tokens == "auto":
            if self.discovery is None:
                raise ValueError("kv_budget_tokens: auto needs a discovery.metrics_url")
        elif self.kv_budget_tokens < self.kv_block_size:
            raise ValueError("kv_budget_tokens must hold at least one KV block")
        capped = "max_auto_kv_budget_tokens" in self.model_fields_set
        if capped and self.kv_budget_tokens != "auto":
            raise ValueError(
                "max_auto_kv_budget_tokens caps kv_budget_tokens: auto; this backend's budget "
                "is a number"
            )
        if self.max_auto_kv_budget_tokens < self.kv_block_size:
            raise ValueError("max_auto_kv_budget_tokens must hold at least one KV block")
        if self.backpressure is not None and self.discovery is None:
            raise ValueError("backpressure needs a discovery.metrics_url to read load from")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: environment variable {self.api_key_env} is not set")
        if self.endpoints is not None and self.endpoint_discovery is not None:
            raise ValueError("set endpoints or endpoint_discovery, not both")
        if self.is_pool and self.discovery is not None:
            if "{endpoint}" not in self.discovery.metrics_url:
                raise ValueError(
                    "discovery.metrics_url of a pool must contain {endpoint} (each endpoint "
                    "is scraped on its own), e.g. http://{endpoint}/metrics"
                )
        elif self.discovery is not None and "{endpoint}" in self.discovery.metrics_url:
            raise ValueError("discovery.metrics_url has {endpoint} but the backend is no pool")
        if self.queue is not None and not self.is_pool:
            raise ValueError("queue needs a pool (endpoints or endpoint_discovery)")
        return self

    @property
    def is_pool(self) -> bool:
        return self.endpoints is not None or self.endpoint_discovery is not None

    @property
    def upstream_api_key(self) -> str | None:
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env)
        return self.api_key


def parse_endpoint_address(address: str) -> tuple[str, int]:
    """An endpoint as Envoy's ORIGINAL_DST cluster takes it: an IP literal and a port
    ("10.0.0.5:8000", "[fd00::5]:8000"); never a host name, which Envoy would not resolve."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"endpoint {address!r} must be IP:PORT")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ValueError(f"endpoint {address!r}: {host!r} is not an IP address") from None
    if ip.version == 6 and not bracketed:
        raise ValueError(f"endpoint {address!r}: write an IPv6 address in brackets")
    return str(ip), int(port_text)


class SentinelConfig(_Strict):
    """Find the Redis master through Sentinel (the `store` URL then gives only credentials,
    database and TLS for the master). Restart: read once at start, like the connection."""

    master: Restart[str] = Field(min_length=1, description="the monitored master's name")
    nodes: Restart[list[str]] = Field(min_length=1, description="sentinels as HOST:PORT")
    password: Restart[str | None] = Field(
        default=None, repr=False, description="the sentinels' own password (prefer _env/_file)"
    )
    password_env: Restart[str | None] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    password_file: Restart[str | None] = Field(default=None, min_length=1)

    @field_validator("nodes")
    @classmethod
    def _host_ports(cls, value: list[str]) -> list[str]:
        for node in value:
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"'{node}' must be HOST:PORT")
        return value

    @model_validator(mode="after")
    def _one_password(self) -> SentinelConfig:
        given = [self.password, self.password_env, self.password_file]
        if sum(value is not None for value in given) > 1:
            raise ValueError("set one of password, password_env and password_file")
        return self


class RedisConfig(_Strict):
    """The shared store (used when `store` is a redis:// or rediss:// URL). Restart: the
    store (and the answer store beside it) is built once, at start."""

    # Every key is "{key_prefix}:...": one hash tag, so one Redis Cluster slot per deployment.
    key_prefix: Restart[str] = Field(default="kvgate", pattern=r"^[A-Za-z0-9._:/-]{1,64}$")
    # Every call is bounded by this (socket timeouts and an overall deadline): no request
    # waits longer on Redis.
    timeout_s: Restart[float] = Field(default=0.25, gt=0, le=30)
    connect_timeout_s: Restart[float] = Field(default=0.25, gt=0, le=30)
    # What admission does while Redis cannot answer: 503 with Retry-After, or admit with
    # per-replica local limits and reconcile the ledger when Redis returns.
    failure_policy: Restart[Literal["fail_closed", "fail_open"]] = "fail_closed"
    unavailable_retry_after_s: Restart[float] = Field(default=2.0, gt=0)
    # While Redis is down it is pinged this often; requests never wait for it meanwhile.
    probe_interval_s: Restart[float] = Field(default=1.0, gt=0)
    # Settlements waiting for Redis to come back; past this the oldest are dropped (reported).
    max_pending_settlements: Restart[int] = Field(default=10_000, ge=1)
    # Settlements of requests admitted by the fallback (fail_open) while Redis was down are
    # delivered when it returns; their ids are kept this long so each is booked once. Must
    # outlast the longest outage (about 100 bytes each in Redis: rate x retention).
    # Settlements of Redis leases need no window: their billing record is consumed once.
    settled_id_retention_s: Restart[float] = Field(default=86_400.0, ge=1)
    # Redis runs with noeviction: at maxmemory every write fails, reserves included. Past
    # this fraction of maxmemory the answer store (idempotency keys, cached answers) takes
    # no new entries, so admission keeps its room.
    answer_store_max_memory_fraction: Restart[float] = Field(default=0.8, gt=0, le=0.95)
    # Redis calls in flight at once per replica (and connections per Redis node).
    max_connections: Restart[int] = Field(default=64, ge=1, le=10_000)
    # The URL is one node of a Redis Cluster.
    cluster: Restart[bool] = False
    sentinel: SentinelConfig | None = None
    # The password (for Sentinel: the master's) from an environment variable or a file (a
    # Kubernetes Secret volume) instead of the `store` URL; read once at start. The URL may
    # still give the user name (redis://kvgate@redis:6379/0) for a Redis ACL user. Like the
    # connection they authenticate: rotate by restarting.
    password_env: Restart[str | None] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    password_file: Restart[str | None] = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_topology(self) -> RedisConfig:
        if self.cluster and self.sentinel is not None:
            raise ValueError("cluster and sentinel are mutually exclusive")
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("set password_env or password_file, not both")
        return self


class TracingConfig(_Strict):
    """OpenTelemetry spans of each decision and settlement (kvgate.tracing); needs the
    `otel` extra (`pip install 'kvgate[otel]'`). Read once at start: the tracer provider
    and its exporter are built then (kvgate.tracing)."""

    enabled: Restart[bool] = False
    # The OTLP/gRPC collector, e.g. http://otel-collector:4317 (https:// for TLS). None: the
    # standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT environment,
    # else http://localhost:4317.
    otlp_endpoint: Restart[str | None] = Field(default=None, pattern=r"^https?://[^\s]+$")
    service_name: Restart[str] = Field(default="kvgate", min_length=1, max_length=256)
    # The fraction of requests whose spans are kept. A request's incoming traceparent still
    # names the trace its spans join, but its sampled flag is a client's say: kvgate decides.
    sample_ratio: Restart[float] = Field(default=1.0, ge=0, le=1)
    # Follow the sampled flag of the incoming traceparent instead (sample_ratio then applies
    # only to traces kvgate starts): for a deployment where whatever sets it is trusted, e.g.
    # Envoy's own tracing overwriting what clients send.
    trust_parent_sampling: Restart[bool] = False
    # Put the tenant's name on the spans (`kvgate.tenant`): off, as a tracing backend is often
    # shared more widely than kvgate's metrics.
    tenant_attribute: Restart[bool] = False


class ResponseCacheConfig(_Strict):
    """Exact-match answers: the same model and request again -> the stored answer. Read per
    request from the snapshot; the memory store is built at start."""

    enabled: Reload[bool] = False
    ttl_s: Reload[float] = Field(default=3600.0, gt=0)
    # tenant: a tenant's entries serve only that tenant; model: every tenant of the model
    # (identical requests by different tenants share the answer).
    scope: Reload[Literal["tenant", "model"]] = "tenant"
    # Only deterministic requests (temperature 0) by default: a sampled answer served from
    # cache is the same sample again, which the operator may allow.
    sampled: Reload[bool] = False
    # What a hit costs: nothing (counted in kvgate_response_cache_*), or what the stored
    # answer took (TPM, budget and price, booked in the ledger as a request).
    hit_charge: Reload[Literal["free", "full"]] = "free"
    max_answer_bytes: Reload[int] = Field(default=1024 * 1024, ge=1024)
    memory_max_bytes: Restart[int] = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    # What one tenant's cached answers (both caches) may hold at once; past it new answers
    # are not cached (nothing of another tenant's is ever evicted for them). Passed with
    # every claim.
    tenant_max_bytes: Reload[int] = Field(default=32 * 1024 * 1024, ge=64 * 1024)


class SemanticEmbedderConfig(_Strict):
    """Where question vectors come from. Restart: the embedder is built at start."""

    # wordllama: offline, in process (the `semantic` extra); openai: an OpenAI-compatible
    # /v1/embeddings endpoint (vLLM serving an embedding model).
    kind: Restart[Literal["wordllama", "openai"]] = "wordllama"
    dimensions: Restart[int] = Field(default=256, ge=1, le=16384)
    base_url: Restart[str | None] = Field(default=None, pattern=r"^https?://[^\s]+$")
    model: Restart[str | None] = Field(default=None, min_length=1, max_length=256)
    # The name of the environment variable holding the endpoint's API key, if it needs one.
    api_key_env: Restart[str | None] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # Ask a matryoshka model for `dimensions` (vLLM refuses it for other models).
    send_dimensions: Restart[bool] = False
    # Every embedding's whole deadline, waiting for its turn included (both kinds; for
    # openai every request of the call): past it the lookup gives up and the request runs
    # uncached (result "unavailable").
    timeout_s: Restart[float] = Field(default=0.5, gt=0, le=10)
    # Embeddings one tenant may have queued or running at once (wordllama: batches waiting
    # for the worker thread, which serves tenants in fair shares; openai: requests in
    # flight); past it the lookup is refused at once and the request runs uncached.
    max_queued_per_tenant: Restart[int] = Field(default=8, ge=1, le=10_000)

    @model_validator(mode="after")
    def _endpoint(self) -> SemanticEmbedderConfig:
        if self.kind == "openai" and (self.base_url is None or self.model is None):
            raise ValueError("an openai embedder needs base_url and model")
        if self.kind == "wordllama" and self.dimensions not in (64, 128, 256):
            raise ValueError("wordllama's dimensions are 64, 128 or 256")
        return self


class SemanticCacheConfig(_Strict):
    """Similar questions in the same context -> the stored answer (off by default; tenants
    and models opt in with their own `semantic_cache: true`). The embedder and the index are
    built at start; the rest is read per request."""

    enabled: Restart[bool] = False
    embedder: SemanticEmbedderConfig = SemanticEmbedderConfig()
    # A hit needs cosine similarity >= threshold AND the lexical guard's consent. None: the
    # measured default for WordLlama with the strict guard (docs/semantic-cache.md); any
    # other embedder or guard must set the threshold it was measured at.
    threshold: Reload[float | None] = Field(default=None, gt=0, le=1)
    # strict: the same content words in the same order (filler and articles aside);
    # numbers: the same numbers and negations, never the same words reordered; off: none.
    guard: Reload[Literal["strict", "numbers", "off"]] = "strict"
    # tenant: a tenant's entries serve only that tenant; model: every opted-in tenant.
    scope: Reload[Literal["tenant", "model"]] = "tenant"
    # Requests with tools (or tool calls in their history) are never served by default.
    allow_tools: Reload[bool] = False
    # Only deterministic requests (temperature 0) by default.
    sampled: Reload[bool] = False
    ttl_s: Reload[float] = Field(default=3600.0, gt=0)
    hit_charge: Reload[Literal["free", "full"]] = "free"
    max_answer_bytes: Reload[int] = Field(default=1024 * 1024, ge=1024)
    # Longer last turns are not looked up (a mean vector over a long text says little).
    max_question_chars: Reload[int] = Field(default=2000, ge=1, le=32_768)
    # The bucket of one context (the search runs over it); older entries drop out.
    max_entries_per_context: Restart[int] = Field(default=256, ge=1, le=65_536)
    # This replica's mirror of the entries, in all contexts (least recently searched first
    # out), and the memory store's entries (least recently written context first out), in
    # bytes: about 2 KB an entry (its 256-float vector twice and the question).
    mirror_max_bytes: Restart[int] = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    memory_max_bytes: Restart[int] = Field(default=64 * 1024 * 1024, ge=1024 * 1024)

    @model_validator(mode="after")
    def _threshold(self) -> SemanticCacheConfig:
        if self.threshold is None and (self.embedder.kind != "wordllama" or self.guard != "strict"):
            raise ValueError(
                "semantic_cache.threshold is required for this embedder and guard: no "
                "default was measured for them (tools/semantic_threshold.py measures one)"
            )
        return self


class IdempotencyConfig(_Strict):
    """Idempotency-Key on chat and completions requests (one generation per tenant and key).
    Read per request from the snapshot; the memory store is built at start."""

    enabled: Reload[bool] = True
    # How long a completed answer is replayed for a duplicate.
    retention_s: Reload[float] = Field(default=86_400.0, gt=0)
    # How long a duplicate waits for the first request still running (then 409 + Retry-After);
    # like a pool queue's wait, within server.envoy_max_message_timeout_s.
    max_wait_s: Reload[float] = Field(default=10.0, gt=0, le=3600)
    # An answer larger than this is not kept: a duplicate after completion gets 409.
    max_answer_bytes: Reload[int] = Field(default=8 * 1024 * 1024, ge=1024)
    # The memory store's bound (all keys of this process); Redis keeps its own.
    memory_max_bytes: Restart[int] = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    # What one tenant's keys and their answers may hold at once (each replica's memory
    # store, or Redis for all replicas): past it a new key is 429, an answer that does not
    # fit leaves a marker (a duplicate gets 409, never a second generation). Passed with
    # every claim.
    tenant_max_bytes: Reload[int] = Field(default=32 * 1024 * 1024, ge=64 * 1024)
    # Duplicates of one tenant waiting for running requests, per replica (then 429).
    max_waiting_per_tenant: Reload[int] = Field(default=32, ge=1, le=10_000)


class UsageRecordsConfig(_Strict):
    """One durable record per request in a database (docs/usage-records.md). Restart: the
    sink, its spool and its writer are built once, at start. Off unless `sink` is set."""

    # none: no records; sqlite: an embedded file (one replica); postgres: shared by replicas.
    sink: Restart[Literal["none", "sqlite", "postgres"]] = "none"
    sqlite_path: Restart[str] = Field(default="var/usage-records.sqlite3", min_length=1)
    # A PostgreSQL URL (postgresql://user@host:5432/db) from an environment variable or a
    # file (a Kubernetes Secret volume): it may carry a password, so never in the file itself.
    postgres_dsn_env: Restart[str | None] = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    postgres_dsn_file: Restart[str | None] = Field(default=None, min_length=1)
    # Batches land here (fsynced) before the sink sees them; a sink that is slow or down
    # leaves them here until it is back. One kvgate process per directory.
    spool_dir: Restart[str] = Field(default="var/usage-spool", min_length=1)
    # Past this the newest records are dropped (counted and logged), never the request.
    max_spool_bytes: Restart[int] = Field(default=1024 * 1024 * 1024, ge=1024 * 1024)
    # Records waiting in memory for the next spool write; past this they are dropped.
    max_buffered_records: Restart[int] = Field(default=100_000, ge=100)
    # The memory buffer is written to the spool this often (the most a SIGKILL can lose).
    flush_interval_s: Restart[float] = Field(default=0.2, gt=0, le=10)
    batch_size: Restart[int] = Field(default=1000, ge=1, le=100_000)
    # One batch's write to the sink; past it the sink counts as down and is retried.
    write_timeout_s: Restart[float] = Field(default=10.0, gt=0, le=600)
    # First wait before retrying a sink that failed (doubles up to 30 s).
    retry_interval_s: Restart[float] = Field(default=1.0, gt=0, le=60)

    @model_validator(mode="after")
    def _postgres_dsn(self) -> UsageRecordsConfig:
        given = (self.postgres_dsn_env, self.postgres_dsn_file)
        if self.sink == "postgres" and sum(value is not None for value in given) != 1:
            raise ValueError("sink postgres needs one of postgres_dsn_env and postgres_dsn_file")
        return self


class JwtIdentityConfig(_Strict):
    """Callers identified by a token Envoy's jwt_authn filter verified: its payload, which
    the provider puts in the filter's dynamic metadata (`payload_in_metadata`) and the
    ext_proc filter forwards (`metadata_options.forwarding_namespaces.untyped`)."""

    metadata_namespace: Reload[str] = Field(default="envoy.filters.http.jwt_authn", min_length=1)
    # The provider's payload_in_metadata.
    payload_key: Reload[str] = Field(default="jwt_payload", min_length=1)
    # The claim whose value is the tenant's name in this config (a dotted path reaches into
    # nested claims), and the one naming the user (access log, usage records).
    tenant_claim: Reload[str] = Field(default="tenant", min_length=1)
    user_claim: Reload[str | None] = Field(default="sub", min_length=1)
    # The claim naming the caller's team under its tenant (its limits: tenants[].teams).
    team_claim: Reload[str | None] = Field(default=None, min_length=1)
    # Only tokens whose `iss` is one of these (empty: every issuer jwt_authn accepts).
    issuers: Reload[list[str]] = Field(default_factory=list)


class SpiffeIdentityConfig(_Strict):
    """Callers identified by their mTLS certificate's SPIFFE ID (its URI SAN), which the
    ext_proc filter sends as the `connection.uri_san_peer_certificate` request attribute."""

    # SPIFFE ID -> tenant.
    tenants: Reload[dict[str, str]] = Field(min_length=1)

    @field_validator("tenants")
    @classmethod
    def _spiffe_ids(cls, value: dict[str, str]) -> dict[str, str]:
        for spiffe_id in value:
            if not spiffe_id.startswith("spiffe://") or len(spiffe_id) <= len("spiffe://"):
                raise ValueError(f"{spiffe_id!r} is not a SPIFFE ID (spiffe://trust-domain/path)")
        return value


class ExtAuthzIdentityConfig(_Strict):
    """Callers identified by an ext_authz server in front of kvgate: the `dynamic_metadata`
    of its OK CheckResponse, which Envoy's ext_authz filter puts in its namespace and the
    ext_proc filter forwards (`metadata_options.forwarding_namespaces.untyped`)."""

    metadata_namespace: Reload[str] = Field(default="envoy.filters.http.ext_authz", min_length=1)
    # The metadata keys naming the tenant (its name in this config), the user and the team.
    tenant_key: Reload[str] = Field(default="tenant", min_length=1)
    user_key: Reload[str | None] = Field(default="user", min_length=1)
    team_key: Reload[str | None] = Field(default=None, min_length=1)


class IdentityConfig(_Strict):
    """Who is calling, besides API keys: what the mesh verified (docs/identity.md). A
    verified token is read first, then an ext_authz server's identity, then an API key,
    then the connection's SPIFFE ID."""

    jwt: JwtIdentityConfig | None = None
    ext_authz: ExtAuthzIdentityConfig | None = None
    spiffe: SpiffeIdentityConfig | None = None


class KeysConfig(_Strict):
    """API keys as data (docs/keys.md): created, rotated and revoked through the admin API
    (`kvgate keys`), each with its tenant, optional team and user, labels, expiry and limits
    of its own; in force on every replica within `refresh_s` without a reload. Keys in the
    tenants' `api_key_sha256` keep working beside them. Restart: the store is built once."""

    # auto: the state store's Redis when `store` is one (every replica sees every key), else
    # the embedded file; embedded: a SQLite file (one replica, survives restarts); off.
    store: Restart[Literal["auto", "embedded", "redis", "off"]] = "auto"
    path: Restart[str] = Field(default="var/keys.sqlite3", min_length=1)
    # Looked-up keys (and unknown ones) kept in memory; a change anywhere empties it.
    cache_entries: Restart[int] = Field(default=100_000, ge=0, le=10_000_000)
    # How often a replica asks the store whether any key changed (the most a revocation
    # made on another replica takes to be in force here).
    refresh_s: Restart[float] = Field(default=0.25, gt=0, le=1.0)


class KvgateConfig(_Strict):
    server: ServerConfig = ServerConfig()
    # "memory" (one process) or a Redis URL (redis://[[user]:password@]host:port/db or
    # rediss:// for TLS) shared by every replica; see the `redis` section. Built once.
    store: Restart[str] = "memory"
    redis: RedisConfig = RedisConfig()
    tenants: list[TenantConfig]
    models: list[ModelConfig]
    backends: list[BackendConfig]
    tracing: TracingConfig = TracingConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    semantic_cache: SemanticCacheConfig = SemanticCacheConfig()
    usage_records: UsageRecordsConfig = UsageRecordsConfig()
    identity: IdentityConfig = IdentityConfig()
    keys: KeysConfig = KeysConfig()

    @field_validator("store")
    @classmethod
    def _store(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://")):
            raise ValueError("must be 'memory' or a redis:// or rediss:// URL")
        return value

    @property
    def uses_redis(self) -> bool:
        return self.store != "memory"

    def _one_message_waits_fit(self) -> None:
        """Envoy extends a message's timeout once: every wait one request body may do (its
        Idempotency-Key's, a pool's queue, the budget fallback model's pool's queue) must
        fit the one extension kvgate asks for."""
        server = self.server
        queue_waits = {b.name: b.queue.max_wait_s for b in self.backends if b.queue is not None}
        if not queue_waits:
            return
        models = {m.name: m.backend for m in self.models}
        fallback_wait = max(
            (
                queue_waits.get(models.get(t.budget.fallback_model, ""), 0.0)
                for t in self.tenants
                if t.budget is not None and t.budget.fallback_model
            ),
            default=0.0,
        )
        key_wait = self.idempotency.max_wait_s if self.idempotency.enabled else 0.0
        # A route may name any backend: the longest queue is the one to fit.
        total = (
            key_wait
            + max(queue_waits.values())
            + fallback_wait
            + server.decision_timeout_s
            + QUEUE_DEADLINE_MARGIN_S
        )
        if total > server.envoy_max_message_timeout_s:
            raise ValueError(
                f"one request may wait {total:g} s in all (idempotency.max_wait_s "
                f"{key_wait:g} s + the longest queue's max_wait_s "
                f"{max(queue_waits.values()):g} s + a budget fallback pool's queue "
                f"{fallback_wait:g} s + server.decision_timeout_s "
                f"{server.decision_timeout_s:g} s + {QUEUE_DEADLINE_MARGIN_S:g} s), over "
                f"server.envoy_max_message_timeout_s ({server.envoy_max_message_timeout_s:g} s,"
                " Envoy's max_message_timeout, which it extends once per message)"
            )

    @model_validator(mode="after")
    def _cross_references(self) -> KvgateConfig:
        redis_cfg = self.redis
        if (
            self.uses_redis
            and url_has_password(self.store)
            and (redis_cfg.password_env or redis_cfg.password_file)
        ):
            raise ValueError(
                "store: the URL carries a password and redis.password_env/password_file "
                "gives another; keep only one (preferably the env or file form)"
            )
        _unique("tenants", [t.name for t in self.tenants])
        _unique("models", [m.name for m in self.models])
        _unique("backends", [b.name for b in self.backends])
        seen_keys: dict[str, str] = {}
        for tenant in self.tenants:
            for digest in tenant.key_hashes:
                other = seen_keys.setdefault(digest, tenant.name)
                if other != tenant.name:
                    raise ValueError(
                        f"tenants: tenants '{other}' and '{tenant.name}' share an API key"
                    )
        models = {m.name for m in self.models}
        tenant_names = {t.name for t in self.tenants}
        spiffe = self.identity.spiffe
        spiffe_tenants = set(spiffe.tenants.values()) if spiffe else set()
        for spiffe_id, name in spiffe.tenants.items() if spiffe else ():
            if name not in tenant_names:
                raise ValueError(
                    f"identity.spiffe.tenants: {spiffe_id!r} names '{name}', not a tenant"
                )
        # Whether a tenant without a key is unreachable depends on it only by spiffe.
        no_other_source = (
            self.identity.jwt is None
            and self.identity.ext_authz is None
            and self.keys.store == "off"
        )
        for i, tenant in enumerate(self.tenants):
            unreachable = no_other_source and tenant.name not in spiffe_tenants
            if not tenant.api_key_sha256 and unreachable:
                raise ValueError(
                    f"tenants.{i}.api_key_sha256: '{tenant.name}' has no API key, and no "
                    "identity source (identity.jwt, identity.ext_authz, identity.spiffe, keys) can "
                    "name it"
                )
        for i, tenant in enumerate(self.tenants):
            for name in tenant.model_limits:
                if name not in models:
                    raise ValueError(
                        f"tenants.{i}.model_limits: '{name}' is not a configured model"
                    )
            if not (tenant.teams or tenant.users or tenant.user_limits):
                levels = []  # most tenants (no need to build the list)
            else:
                levels = [
                    *(("teams", name, level) for name, level in tenant.teams.items()),
                    *(("users", name, level) for name, level in tenant.users.items()),
                    *([("user_limits", None, tenant.user_limits)] if tenant.user_limits else []),
                ]
            for section, level_name, level in levels:
                where = f"tenants.{i}.{section}" + (f".{level_name}" if level_name else "")
                for name in level.models or ():
                    if name not in models:
                        raise ValueError(f"{where}.models: '{name}' is not a configured model")
            budget = tenant.budget
            if budget and budget.fallback_model and budget.fallback_model not in models:
                raise ValueError(
                    f"tenants.{i}.budget.fallback_model: '{budget.fallback_model}' is not a "
                    "configured model"
                )
        server = self.server
        waited = self.idempotency.max_wait_s + server.decision_timeout_s + QUEUE_DEADLINE_MARGIN_S
        if self.idempotency.enabled and waited > server.envoy_max_message_timeout_s:
            raise ValueError(
                f"idempotency.max_wait_s: {self.idempotency.max_wait_s:g} s + "
                f"server.decision_timeout_s + {QUEUE_DEADLINE_MARGIN_S:g} s is over "
                f"server.envoy_max_message_timeout_s ({server.envoy_max_message_timeout_s:g} s)"
            )
        for i, backend in enumerate(self.backends):
            queue = backend.queue
            if queue is not None and (
                queue.max_wait_s + server.decision_timeout_s + QUEUE_DEADLINE_MARGIN_S
                > server.envoy_max_message_timeout_s
            ):
                raise ValueError(
                    f"backends.{i}.queue.max_wait_s: {queue.max_wait_s:g} s of waiting + "
                    f"server.decision_timeout_s ({server.decision_timeout_s:g} s) + "
                    f"{QUEUE_DEADLINE_MARGIN_S:g} s is over "
                    f"server.envoy_max_message_timeout_s ({server.envoy_max_message_timeout_s:g}"
                    " s, Envoy's max_message_timeout): Envoy would ignore the extension and "
                    "answer 504"
                )
        self._one_message_waits_fit()
        backends = {b.name for b in self.backends}
        for i, model in enumerate(self.models):
            if model.backend not in backends:
                raise ValueError(
                    f"models.{i}.backend: '{model.backend}' is not a configured backend "
                    f"(known: {', '.join(sorted(backends)) or 'none'})"
                )
        self._engines_to_ask()
        return self

    def _engines_to_ask(self) -> None:
        """Every `counting: engine` model has an engine to ask, in time for a decision."""
        backends = {b.name: b for b in self.backends}
        for i, model in enumerate(self.models):
            if model.counting != "engine":
                continue
            if engine_tokenize_url(model, backends[model.backend]) is None:
                raise ValueError(
                    f"models.{i}.engine_counting.tokenize_url: counting: engine needs the "
                    f"engine's /tokenize URL; backend '{model.backend}' gives none (set "
                    "tokenize_url, or a discovery.metrics_url on a single-server backend), "
                    "and without it nothing can count this model"
                )
            timeout = model.engine_counting.timeout_s
            if timeout >= self.server.decision_timeout_s:
                raise ValueError(
                    f"models.{i}.engine_counting.timeout_s: {timeout:g} s must be below "
                    f"server.decision_timeout_s ({self.server.decision_timeout_s:g} s), so "
                    "a slow engine gets kvgate's own answer, not the decision deadline's"
                )


def url_has_password(url: str) -> bool:
    """A redis:// URL with a password inline (`user:secret@host` or `?password=`)."""
    try:
        parts = urlsplit(url)
        return bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        return False


def _unique(section: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{section}: the name '{name}' appears twice")
        seen.add(name)


# A list of tenants validated alone, as KvgateConfig validates its `tenants` (same errors).
_TENANT_LIST: TypeAdapter[list[TenantConfig]] = TypeAdapter(list[TenantConfig])
_FIELD_ORDER = {name: i for i, name in enumerate(KvgateConfig.model_fields)}
# Tenants validated at a time: the raw tree of one chunk is alive at once, not the fleet's.
TENANT_CHUNK = 1000

_Location = tuple[int | str, ...]


def _invalid(source: str, errors: list[tuple[_Location, str]]) -> ConfigError:
    problems = []
    for loc, msg in errors:
        where = ".".join(str(p) for p in loc) or "(top level)"
        problems.append(f"  {where}: {msg.removeprefix('Value error, ')}")
    return ConfigError(f"{source}: invalid configuration\n" + "\n".join(problems))


def _located(exc: ValidationError, prefix: _Location = ()) -> list[tuple[_Location, str]]:
    return [((*prefix, *err["loc"]), err["msg"]) for err in exc.errors()]


def _validate(
    rest: dict[str, Any], tenant_chunks: Iterator[list[Any]], source: str
) -> KvgateConfig:
    """KvgateConfig of `rest` (the config without its tenants) and the tenants, validated
    chunk by chunk, each raw chunk dropped once its TenantConfigs exist. The whole config is
    then validated with those instances (pydantic takes them as they are), so every check
    across tenants runs as on a config validated at once, and the errors read the same:
    at their places (tenants.123.limits.rpm), in the order of the fields."""
    tenants: list[TenantConfig] = []
    tenant_errors: list[tuple[_Location, str]] = []
    index = 0
    for chunk in tenant_chunks:
        try:
            tenants += _TENANT_LIST.validate_python(chunk)
        except ValidationError as exc:
            for loc, msg in _located(exc):
                tenant_errors.append((("tenants", index + int(loc[0]), *loc[1:]), msg))
        index += len(chunk)
        del chunk
    if not tenant_errors:
        try:
            return KvgateConfig.model_validate({**rest, "tenants": tenants})
        except ValidationError as exc:
            raise _invalid(source, _located(exc)) from None
    # As when validated at once: every field's errors, and none of the checks across
    # sections (they run only on valid fields).
    errors = list(tenant_errors)
    try:
        KvgateConfig.model_validate({**rest, "tenants": []})
    except ValidationError as exc:
        errors += [(loc, msg) for loc, msg in _located(exc) if loc]
    errors.sort(key=lambda error: _FIELD_ORDER.get(str(error[0][0]), len(_FIELD_ORDER)))
    raise _invalid(source, errors)


def _chunks(items: list[Any]) -> Iterator[list[Any]]:
    for start in range(0, len(items), TENANT_CHUNK):
        yield items[start : start + TENANT_CHUNK]


def parse_config(data: Any, source: str = "<config>") -> KvgateConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    shared = _SHARED_SECTIONS.set({})
    try:
        with gc_paused():
            tenants = data.get("tenants")
            if not isinstance(tenants, list):  # missing or not a list: pydantic says so
                try:
                    return KvgateConfig.model_validate(data)
                except ValidationError as exc:
                    raise _invalid(source, _located(exc)) from None
            rest = {key: value for key, value in data.items() if key != "tenants"}
            return _validate(rest, _chunks(tenants), source)
    finally:
        _SHARED_SECTIONS.reset(shared)


# LibYAML's parser when PyYAML was built with it (its wheels are): the pure-Python one spends
# seconds per ten thousand tenants. The same safe constructor either way. PyYAML's reading
# (YAML 1.1) is the config's meaning; yaml-rs (YAML 1.2, about 25 times faster on a large
# file) reads every file in which the two cannot differ.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Where YAML 1.1 (PyYAML) and yaml-rs read a file differently: a whole plain scalar that
# 1.1 reads as a boolean (yes/no/on/off), an octal or sexagesimal number or a timestamp, or
# that yaml-rs reads as a number and 1.1 as text (0o17, 1e3, -.5, 09); tags, merge keys,
# the value key, directives and a second document. Matched anywhere in the text (in a
# comment or a quoted string too): a false alarm only costs PyYAML's time. Each scalar is
# matched from the character before it (a search starting on a character class is the
# fast one), and only where the next character can start one of them (the first
# characters of the alternatives below): most spaces are indentation or come before a
# key, and fail there at once (three times faster, about 0.5 s over 100,000 tenants).
_YAML_1_1_SCALAR = re.compile(
    r"""[\s\[{,](?=[yYnNoO0-9+\-._=])(?:
        (?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)
      | [-+]?0(?:[0-9_]+|[oO][0-7_]+|[xX][0-9a-fA-F_]+|[bB][01_]+)   # 017, 09, 0o17, 0X1f
      | [-+]?[0-9][0-9_]*(?::[0-9_]+)+(?:\.[0-9_]*)?   # 1:30
      | [-+]?[0-9_.]+[eE][-+]?[0-9_]+         # 1e3, 1.0e3, 0E_0 (yaml-rs drops the _)
      | [-+]\.[0-9][0-9_]*                    # -.5
      | [-+]?[0-9_.]*_[0-9_.]*                # _0, 1__0 (1_000 alike, flagged too)
      | [0-9]{4}-[0-9]{1,2}-[0-9]{1,2}\S*      # 2024-01-15
      | =
    )(?=[ \t]*(?:$|\#|,|\]|\}|:(?:\s|$)))""",
    re.MULTILINE | re.VERBOSE,
)
_YAML_1_1_MARKS = ("!", "<<", "\n%", "\n---", "\n...")


def _yaml_1_1_only(text: str) -> bool:
    if text.startswith(("%", "...")) or any(mark in text for mark in _YAML_1_1_MARKS):
        return True
    return _YAML_1_1_SCALAR.search(text) is not None or (
        _YAML_1_1_SCALAR.match("\n" + text[:256]) is not None  # a scalar at the very start
    )


def read_yaml(text: str) -> Any:
    """The YAML document in `text` as PyYAML's safe loader reads it (its errors too)."""
    if not _yaml_1_1_only(text):
        try:
            data = yaml_rs.loads(text, parse_datetime=False)
        except Exception:  # PyYAML's reading decides, with PyYAML's message
            data = None
        if isinstance(data, dict):
            return data
    return yaml.load(text, Loader=_SAFE_LOADER)


# Reading the tenants a chunk at a time: the `tenants:` line at the top level, its block
# sequence (items at one indentation), and where it ends (a line indented less, not a
# comment); the rest of the file is read with a placeholder for the tenants.
_TENANTS_KEY = re.compile(r"tenants:[ \t]*(?:#[^\n]*)?\n")
_BLANK_LINES = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*")
_FIRST_ITEM = re.compile(r"( *)-[ \t\n]")
_TENANTS_PLACEHOLDER = "kvgate-tenants-read-in-chunks"
_DOCUMENT_MARKS = ("\n%", "\n---", "\n...")


class _ChunksDisagree(Exception):
    """The tenants cannot be read chunk by chunk as the whole file would read them."""


def _yaml_rs_reading(text: str) -> Any:
    return yaml_rs.loads(text, parse_datetime=False)


def _pyyaml_reading(text: str) -> Any:
    return yaml.load(text, Loader=_SAFE_LOADER)


def _read_in_chunks(
    text: str, reading: Callable[[str], Any] = _yaml_rs_reading
) -> tuple[dict[str, Any], Iterator[list[Any]]] | None:
    """The config without its tenants, and the tenants chunk by chunk (each a list, read
    when asked for), or None when the file is not laid out for that (then it is read
    whole). Each part is read with `reading` (yaml-rs, or PyYAML where YAML 1.1 reads the
    file otherwise), in a file without anchors or aliases (they may cross chunks) and of
    one document without directives. A chunk boundary the whole file would not read as one
    (inside a quoted or flow scalar spanning lines) leaves a chunk unreadable or of another
    length: the iterator raises _ChunksDisagree and the file is read whole."""
    if _TENANTS_PLACEHOLDER in text or "&" in text or "*" in text:
        return None
    if text.startswith(("%", "---", "...")) or any(m in text for m in _DOCUMENT_MARKS):
        return None
    key = 0 if text.startswith("tenants:") else text.find("\ntenants:") + 1
    if (key == 0 and not text.startswith("tenants:")) or text.find("\ntenants:", key) != -1:
        return None
    header = _TENANTS_KEY.match(text, key)
    if header is None:
        return None
    first = _BLANK_LINES.match(text, header.end()).end()  # type: ignore[union-attr]
    item = _FIRST_ITEM.match(text, first)
    if item is None:
        return None
    indent = len(item.group(1))
    # The end: the first line indented less than the items (a comment aside); for items
    # at column 0, the first line at column 0 that is not an item.
    if indent:
        end_pattern = re.compile(rf"\n {{0,{indent - 1}}}[^ \n#]")
    else:
        end_pattern = re.compile(r"\n(?:[^ \n#-]|-[^ \t\n])")
    section_end = end_pattern.search(text, first - 1)
    end = section_end.start() + 1 if section_end is not None else len(text)
    starts = [first]
    starts += [
        m.start() + 1 for m in re.compile(rf"\n {{{indent}}}-[ \t\n]").finditer(text, first, end)
    ]
    rest_text = f"{text[:key]}tenants: {_TENANTS_PLACEHOLDER}\n{text[end:]}"
    try:
        rest = reading(rest_text)
    except Exception:
        return None
    if not isinstance(rest, dict) or rest.pop("tenants", None) != _TENANTS_PLACEHOLDER:
        return None
    return rest, _tenant_chunks(text, starts, end, reading)


def _tenant_chunks(
    text: str, starts: list[int], end: int, reading: Callable[[str], Any]
) -> Iterator[list[Any]]:
    for i in range(0, len(starts), TENANT_CHUNK):
        chunk_starts = starts[i : i + TENANT_CHUNK]
        chunk_end = starts[i + TENANT_CHUNK] if i + TENANT_CHUNK < len(starts) else end
        try:
            items = reading(text[chunk_starts[0] : chunk_end])
        except Exception:  # the whole file's reading decides, with its own message
            raise _ChunksDisagree from None
        if not isinstance(items, list) or len(items) != len(chunk_starts):
            raise _ChunksDisagree
        yield items


def load_config(path: str | Path) -> KvgateConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    reading = _pyyaml_reading if _yaml_1_1_only(text) else _yaml_rs_reading
    shared = _SHARED_SECTIONS.set({})
    try:
        with gc_paused():
            in_chunks = _read_in_chunks(text, reading)
            if in_chunks is not None:
                return _validate(*in_chunks, str(path))
    except _ChunksDisagree:
        pass
    finally:
        _SHARED_SECTIONS.reset(shared)
    try:
        with gc_paused():
            data = read_yaml(text)
    except (yaml.YAMLError, ValueError) as exc:  # PyYAML fails so on 0x_ (int(""))
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    del text
    return parse_config(data, str(path))
