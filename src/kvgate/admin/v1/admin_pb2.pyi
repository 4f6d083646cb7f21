from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTenantUsageRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("tenant", "today", "this_month")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TODAY_FIELD_NUMBER: _ClassVar[int]
    THIS_MONTH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    today: PeriodUsage
    this_month: PeriodUsage
    def __init__(self, tenant: _Optional[str] = ..., today: _Optional[_Union[PeriodUsage, _Mapping]] = ..., this_month: _Optional[_Union[PeriodUsage, _Mapping]] = ...) -> None: ...

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
