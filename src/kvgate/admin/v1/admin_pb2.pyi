from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTenantUsageRequest(_message.Message):
    __slots__ = ("tenant", "teams", "users", "key_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEAMS_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    KEY_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    teams: _containers.RepeatedScalarFieldContainer[str]
    users: _containers.RepeatedScalarFieldContainer[str]
    key_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., teams: _Optional[_Iterable[str]] = ..., users: _Optional[_Iterable[str]] = ..., key_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListTenantUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantUsageResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class ModelUsage(_message.Message):
    __slots__ = ("model", "requests", "prompt_tokens", "cached_prompt_tokens", "output_tokens", "cost_usd", "cache_hits", "cache_saved_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    cost_usd: str
    cache_hits: int
    cache_saved_tokens: int
    def __init__(self, model: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cost_usd: _Optional[str] = ..., cache_hits: _Optional[int] = ..., cache_saved_tokens: _Optional[int] = ...) -> None: ...

class PeriodUsage(_message.Message):
    __slots__ = ("period", "resets_in_seconds", "requests", "prompt_tokens", "cached_prompt_tokens", "output_tokens", "cost_usd", "reserved_usd", "budget_usd", "remaining_usd", "by_model", "cache_hits", "cache_saved_tokens")
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    RESETS_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    RESERVED_USD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_USD_FIELD_NUMBER: _ClassVar[int]
    REMAINING_USD_FIELD_NUMBER: _ClassVar[int]
    BY_MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    period: str
    resets_in_seconds: int
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    cost_usd: str
    reserved_usd: str
    budget_usd: str
    remaining_usd: str
    by_model: _containers.RepeatedCompositeFieldContainer[ModelUsage]
    cache_hits: int
    cache_saved_tokens: int
    def __init__(self, period: _Optional[str] = ..., resets_in_seconds: _Optional[int] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cost_usd: _Optional[str] = ..., reserved_usd: _Optional[str] = ..., budget_usd: _Optional[str] = ..., remaining_usd: _Optional[str] = ..., by_model: _Optional[_Iterable[_Union[ModelUsage, _Mapping]]] = ..., cache_hits: _Optional[int] = ..., cache_saved_tokens: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "today", "this_month", "levels")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TODAY_FIELD_NUMBER: _ClassVar[int]
    THIS_MONTH_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    today: PeriodUsage
    this_month: PeriodUsage
    levels: _containers.RepeatedCompositeFieldContainer[LevelUsage]
    def __init__(self, tenant: _Optional[str] = ..., today: _Optional[_Union[PeriodUsage, _Mapping]] = ..., this_month: _Optional[_Union[PeriodUsage, _Mapping]] = ..., levels: _Optional[_Iterable[_Union[LevelUsage, _Mapping]]] = ...) -> None: ...

class LevelUsage(_message.Message):
    __slots__ = ("level", "name", "today", "this_month")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TODAY_FIELD_NUMBER: _ClassVar[int]
    THIS_MONTH_FIELD_NUMBER: _ClassVar[int]
    level: str
    name: str
    today: LevelPeriod
    this_month: LevelPeriod
    def __init__(self, level: _Optional[str] = ..., name: _Optional[str] = ..., today: _Optional[_Union[LevelPeriod, _Mapping]] = ..., this_month: _Optional[_Union[LevelPeriod, _Mapping]] = ...) -> None: ...

class LevelPeriod(_message.Message):
    __slots__ = ("period", "cost_usd", "budget_usd", "remaining_usd")
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_USD_FIELD_NUMBER: _ClassVar[int]
    REMAINING_USD_FIELD_NUMBER: _ClassVar[int]
    period: str
    cost_usd: str
    budget_usd: str
    remaining_usd: str
    def __init__(self, period: _Optional[str] = ..., cost_usd: _Optional[str] = ..., budget_usd: _Optional[str] = ..., remaining_usd: _Optional[str] = ...) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Backend(_message.Message):
    __slots__ = ("name", "kv_budget_tokens", "kv_tokens_in_flight", "requests_in_flight", "max_concurrent_requests", "pool", "endpoints")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kv_budget_tokens: int
    kv_tokens_in_flight: int
    requests_in_flight: int
    max_concurrent_requests: int
    pool: bool
    endpoints: _containers.RepeatedCompositeFieldContainer[PoolEndpoint]
    def __init__(self, name: _Optional[str] = ..., kv_budget_tokens: _Optional[int] = ..., kv_tokens_in_flight: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., pool: _Optional[bool] = ..., endpoints: _Optional[_Iterable[_Union[PoolEndpoint, _Mapping]]] = ...) -> None: ...

class PoolEndpoint(_message.Message):
    __slots__ = ("address", "state", "kv_budget_tokens", "kv_tokens_in_flight", "requests_in_flight", "last_scrape_age_s", "engine_requests_waiting")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_SCRAPE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    kv_budget_tokens: int
    kv_tokens_in_flight: int
    requests_in_flight: int
    last_scrape_age_s: float
    engine_requests_waiting: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., kv_budget_tokens: _Optional[int] = ..., kv_tokens_in_flight: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., last_scrape_age_s: _Optional[float] = ..., engine_requests_waiting: _Optional[int] = ...) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[Backend]
    def __init__(self, backends: _Optional[_Iterable[_Union[Backend, _Mapping]]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("applied", "error", "generation")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    error: str
    generation: int
    def __init__(self, applied: _Optional[bool] = ..., error: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReconcileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineReconciliation(_message.Message):
    __slots__ = ("ledger", "engine_prompt_tokens", "engine_output_tokens", "booked_prompt_tokens", "booked_output_tokens", "unbooked_prompt_tokens", "unbooked_output_tokens", "engine_restarts", "watching_s")
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOOKED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOOKED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNBOOKED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNBOOKED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WATCHING_S_FIELD_NUMBER: _ClassVar[int]
    ledger: str
    engine_prompt_tokens: int
    engine_output_tokens: int
    booked_prompt_tokens: int
    booked_output_tokens: int
    unbooked_prompt_tokens: int
    unbooked_output_tokens: int
    engine_restarts: int
    watching_s: float
    def __init__(self, ledger: _Optional[str] = ..., engine_prompt_tokens: _Optional[int] = ..., engine_output_tokens: _Optional[int] = ..., booked_prompt_tokens: _Optional[int] = ..., booked_output_tokens: _Optional[int] = ..., unbooked_prompt_tokens: _Optional[int] = ..., unbooked_output_tokens: _Optional[int] = ..., engine_restarts: _Optional[int] = ..., watching_s: _Optional[float] = ...) -> None: ...

class ReconcileResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineReconciliation]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineReconciliation, _Mapping]]] = ...) -> None: ...

class ListUsageRecordsRequest(_message.Message):
    __slots__ = ("tenant", "since_unix_s", "until_unix_s", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    since_unix_s: float
    until_unix_s: float
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., since_unix_s: _Optional[float] = ..., until_unix_s: _Optional[float] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class UsageRecord(_message.Message):
    __slots__ = ("record_id", "request_id", "occurred_at", "ledger_day", "ledger_month", "tenant", "api", "path", "requested_model", "served_model", "backend", "endpoint", "prompt_tokens", "cached_tokens", "output_tokens", "reasoning_tokens", "cost_usd", "pricing_version", "answer_source", "status", "settle_cause", "booked_request", "cache_hit", "saved_tokens", "route", "decision_ms", "ttft_ms", "duration_ms", "team_id", "user_id", "key_id")
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_FIELD_NUMBER: _ClassVar[int]
    LEDGER_DAY_FIELD_NUMBER: _ClassVar[int]
    LEDGER_MONTH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    PRICING_VERSION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SETTLE_CAUSE_FIELD_NUMBER: _ClassVar[int]
    BOOKED_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    DECISION_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    record_id: str
    request_id: str
    occurred_at: str
    ledger_day: str
    ledger_month: str
    tenant: str
    api: str
    path: str
    requested_model: str
    served_model: str
    backend: str
    endpoint: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int
    cost_usd: str
    pricing_version: str
    answer_source: str
    status: int
    settle_cause: str
    booked_request: bool
    cache_hit: bool
    saved_tokens: int
    route: str
    decision_ms: float
    ttft_ms: float
    duration_ms: float
    team_id: str
    user_id: str
    key_id: str
    def __init__(self, record_id: _Optional[str] = ..., request_id: _Optional[str] = ..., occurred_at: _Optional[str] = ..., ledger_day: _Optional[str] = ..., ledger_month: _Optional[str] = ..., tenant: _Optional[str] = ..., api: _Optional[str] = ..., path: _Optional[str] = ..., requested_model: _Optional[str] = ..., served_model: _Optional[str] = ..., backend: _Optional[str] = ..., endpoint: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cost_usd: _Optional[str] = ..., pricing_version: _Optional[str] = ..., answer_source: _Optional[str] = ..., status: _Optional[int] = ..., settle_cause: _Optional[str] = ..., booked_request: _Optional[bool] = ..., cache_hit: _Optional[bool] = ..., saved_tokens: _Optional[int] = ..., route: _Optional[str] = ..., decision_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., duration_ms: _Optional[float] = ..., team_id: _Optional[str] = ..., user_id: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class ListUsageRecordsResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[UsageRecord]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[UsageRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("key_id", "tenant", "team", "user", "labels", "created_at_unix_s", "expires_at_unix_s", "revoked_at_unix_s", "limits_json", "state")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LIMITS_JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant: str
    team: str
    user: str
    labels: _containers.ScalarMap[str, str]
    created_at_unix_s: float
    expires_at_unix_s: float
    revoked_at_unix_s: float
    limits_json: str
    state: str
    def __init__(self, key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., team: _Optional[str] = ..., user: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at_unix_s: _Optional[float] = ..., expires_at_unix_s: _Optional[float] = ..., revoked_at_unix_s: _Optional[float] = ..., limits_json: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class CreatedKey(_message.Message):
    __slots__ = ("secret", "key")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    secret: str
    key: ApiKey
    def __init__(self, secret: _Optional[str] = ..., key: _Optional[_Union[ApiKey, _Mapping]] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("tenant", "team", "user", "labels", "expires_at_unix_s", "ttl_s", "limits_json")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEAM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LIMITS_JSON_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    team: str
    user: str
    labels: _containers.ScalarMap[str, str]
    expires_at_unix_s: float
    ttl_s: float
    limits_json: str
    def __init__(self, tenant: _Optional[str] = ..., team: _Optional[str] = ..., user: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., expires_at_unix_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., limits_json: _Optional[str] = ...) -> None: ...

class GetKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("tenant", "page_size", "page_token")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys", "next_page_token")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    next_page_token: str
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RotateKeyRequest(_message.Message):
    __slots__ = ("key_id", "grace_s")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    grace_s: float
    def __init__(self, key_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...
