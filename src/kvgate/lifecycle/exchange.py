"""One metered request, whatever API it speaks and however it reached kvgate.

``Exchange.decide`` takes the request body to a decision: the API parses it once into the
canonical request, the answer sources are asked (after the tenant's RPM slot is taken and
the body digested once), admission reserves, and the result is a ``Forward`` (the ticket
and the body to send upstream) or an ``Answered`` (a stored answer). Every refusal leaves
as one ``Refused``. Then ``answer_headers``, ``on_chunk``, ``settle`` and ``close`` follow
the answer to its one settlement. No protobuf and no store here: the Envoy adapter
(``kvgate.extproc``) translates messages, the services hold the parts.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.lifecycle.admission import Admission, PromptTokenizers, Rejected, Rejection
from kvgate.lifecycle.answer_run import AnswerRun
from kvgate.lifecycle.answer_sources import AnswerQuery, AnswerSource, Hit
from kvgate.lifecycle.billing import ResponseReading
from kvgate.lifecycle.digest import body_digest
from kvgate.lifecycle.leases import LeaseKeeper
from kvgate.lifecycle.protocol import (
    AnswerMeter,
    ApiProtocol,
    ClientError,
    ErrorVocabulary,
    Outcome,
    PromptCountApi,
    Refused,
    UnmeteredApi,
    rejection_answer,
)
from kvgate.lifecycle.response_cache import CACHE_HEADER
from kvgate.lifecycle.settlement import Settler
from kvgate.lifecycle.ticket import Ticket, served_otherwise_headers
from kvgate.metrics import Metrics
from kvgate.openai import ParsedRequest
from kvgate.policy import ActualUsage, Reason, SettleCause, TenantPolicy
from kvgate.tokenize import TokenizerBusy
from kvgate.usage_records.facts import NO_PRINCIPAL, Principal, RequestFacts

log = logging.getLogger("kvgate.exchange")

T = TypeVar("T")
R = TypeVar("R")

# Bodies larger than this are parsed and digested on a worker thread, not on the event loop.
PARSE_OFF_LOOP_BYTES = 256 * 1024


class FairTokenizers(PromptTokenizers, Protocol):
    async def run(self, tenant: str, work: Callable[[], T], *, cost: int = 1) -> T: ...


class ExchangeServices(Protocol):
    """The parts an exchange works with (``extproc.services.GatewayServices``)."""

    @property
    def answer_sources(self) -> Sequence[AnswerSource]: ...

    @property
    def tokenizers(self) -> FairTokenizers: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def settler(self) -> Settler: ...

    @property
    def leases(self) -> LeaseKeeper: ...

    def admission(self, snapshot: RuntimeSnapshot) -> Admission: ...

    def answer_run(self, sources: Sequence[AnswerSource]) -> AnswerRun: ...

    def track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


@dataclass(frozen=True, slots=True)
class Forward:
    """Admitted: the request goes upstream, with ``body`` when it must change."""

    ticket: Ticket
    body: bytes | None


@dataclass(frozen=True, slots=True)
class RouteScope:
    """What the operator's route says of the request (Envoy's per-route settings)."""

    # The backend the route sends the request to (None: the model's own).
    backend: str | None = None
    # The models the route allows (None: every model).
    models: frozenset[str] | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


# The adapter's part in a wait: tell whoever times the decision out (Envoy) that it may
# now take up to this many seconds from now.
WaitNotice = Callable[[float], None]


class Exchange:
    """One request from its body to its settlement, exactly once."""

    def __init__(
        self,
        services: ExchangeServices,
        snapshot: RuntimeSnapshot,
        api: ApiProtocol,
        tenant: TenantPolicy | None,
        *,
        request_id: str,
        admission_id: str,
        priority: int = 0,
        idempotency_key: str | None = None,
        route: RouteScope = RouteScope(),
        sees_answer: bool = True,
        on_wait: WaitNotice | None = None,
        principal: Principal = NO_PRINCIPAL,
    ) -> None:
        self._svc = services
        self._principal = principal
        self._snapshot = snapshot
        self.api = api
        # The tenant's limits at the decision (None only for an exchange that observes).
        self.tenant = tenant
        self.request_id = request_id
        self._admission_id = admission_id
        self._priority = priority
        self._idempotency_key = idempotency_key
        self._route = route
        # The split layout's request path never sees the answer: another stream meters it.
        self._sees_answer = sees_answer
        self._on_wait = on_wait
        self.request: ParsedRequest | None = None
        self.ticket: Ticket | None = None
        self._meter: AnswerMeter | None = None
        self._answers = services.answer_run(())
        self._settled = False
        # The decision's own deadline, moved when the request waits (see _waiting).
        self._deadline: asyncio.Timeout | None = None
        self._started = 0.0
        self._wait_extended = False
        # Event-loop times of the decision's end and the answer's first bytes (usage records).
        self._decided_at: float | None = None
        self._first_byte_at: float | None = None

    @classmethod
    def observing(
        cls, services: ExchangeServices, snapshot: RuntimeSnapshot, api: ApiProtocol, ticket: Ticket
    ) -> Exchange:
        """The exchange of a request admitted on another stream (the split layout's
        hand-off): it meters the answer and settles."""
        exchange = cls(
            services,
            snapshot,
            api,
            None,
            request_id=ticket.request_id,
            admission_id=ticket.reservation.reservation_id,
        )
        exchange.request = ticket.request
        exchange._forwarded(ticket)
        return exchange

    @property
    def unsettled(self) -> bool:
        """Admitted here and not yet settled."""
        return self.ticket is not None and not self._settled

    # ------------------------------------------------------------------ the decision

    async def decide(self, body: bytes) -> Forward | Hit:
        """Admit the request (``Forward``) or answer it from a source (``Hit``); raises
        ``Refused`` only."""
        timeout_s = self._snapshot.config.server.decision_timeout_s
        self._started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(timeout_s) as self._deadline:
                return await self._decide(body)
        except (ClientError, Rejected, TimeoutError) as error:
            raise _refused(error, self.api.errors, timeout_s) from None

    async def _decide(self, body: bytes) -> Forward | Hit:
        assert self.tenant is not None, "an observing exchange does not decide"
        request = await off_loop(self._svc, self.tenant.name, self.api.parse, body, len(body))
        self.request = request
        if not self._route.allows_model(request.model):
            # OpenAI's answer for a model a key may not use: it "does not exist or you do
            # not have access to it".
            raise Refused(
                self.api.errors.model_not_found(request.model), Outcome.MODEL_NOT_ALLOWED_ON_ROUTE
            )
        admission = self._svc.admission(self._snapshot)
        api = self.api
        client_body = api.client_body(request)
        query = AnswerQuery(
            request=request,
            body=client_body,
            tenant=self.tenant,
            snapshot=self._snapshot,
            owner=self._admission_id,
            route_backend=self._route.backend,
            idempotency_key=self._idempotency_key,
            on_wait=self._waiting,
            errors=api.errors,
            answer_defect=api.answer_defect,
            sees_answer=self._sees_answer,
        )
        # The sources the API allows (each only where its rules read the API's grammar),
        # and of those the ones that apply to this request.
        sources = [
            source
            for source in self._svc.answer_sources
            if source.name in api.answer_sources and source.applies(query)
        ]
        self._answers = self._svc.answer_run(sources)
        self._answers.request_facts = self.request_facts
        request_slot_taken = False
        if sources:
            # What the answer layer does for a tenant is a request it made: the RPM slot is
            # taken first, in O(1), so a tenant over its limit gets its 429 before any of
            # the body is digested, looked up, embedded or waited on.
            request_slot_taken = await admission.take_request_slot(
                request.model, self.tenant, self._admission_id
            )
            # The client's own body: an agent API's canonical request is a converted one.
            digest = await off_loop(
                self._svc, self.tenant.name, body_digest, client_body, request.body_bytes
            )
            hit = await self._answers.lookup(query, digest)
            if hit is not None:
                return hit
        try:
            ticket = await admission.admit(
                request,
                self.tenant,
                self.request_id,
                self._admission_id,
                priority=self._priority,
                on_queued=self._waiting,
                backend=self._route.backend,
                request_slot_taken=request_slot_taken,
            )
        except BaseException:
            # Refused, or the client left: nothing ran, so a retry with the key runs anew.
            self._answers.abandon()
            raise
        self._answers.keep_what_serves(served_otherwise_headers(ticket))
        # An observing stream cannot strip anything: in the split layout nothing is injected.
        if self._sees_answer and self.api.wants_usage_report(request):
            ticket = ticket.with_usage_injected()
        self._forwarded(ticket)
        return Forward(ticket, self.api.forward_body(ticket))

    def _longest_wait_s(self) -> float:
        """The longest the decision may wait in all: its Idempotency-Key's wait, then its
        pool's queue, then the budget fallback model's pool's queue."""
        snapshot = self._snapshot
        waits = snapshot.queue_waits
        wait = snapshot.config.idempotency.max_wait_s if self._idempotency_key else 0.0
        route = snapshot.models.get(self.request.model) if self.request is not None else None
        if route is not None:
            wait += waits.get(self._route.backend or route.backend, 0.0)
        fallback = self.tenant.fallback_model if self.tenant is not None else None
        fallback_route = snapshot.models.get(fallback) if fallback else None
        if fallback_route is not None:
            wait += waits.get(fallback_route.backend, 0.0)
        return wait

    def _waiting(self, max_wait_s: float) -> None:
        """The request starts waiting (an Idempotency-Key's first run, a pool's queue):
        the decision's deadline moves by the longest the whole decision may wait, once
        (Envoy extends a message's timeout once, so the first wait covers every wait)."""
        del max_wait_s  # the whole decision's bound is known in advance
        if self._wait_extended:
            return
        self._wait_extended = True
        loop_now = asyncio.get_running_loop().time()
        timeout_s = self._snapshot.config.server.decision_timeout_s
        ends_at = self._started + self._longest_wait_s() + timeout_s
        if self._deadline is not None:
            self._deadline.reschedule(ends_at)
        if self._on_wait is not None:
            self._on_wait(ends_at - loop_now)

    def _forwarded(self, ticket: Ticket) -> None:
        """The request goes upstream: its lease is kept alive, its answer metered."""
        if self._started:
            self._decided_at = asyncio.get_running_loop().time()
        self.ticket = ticket
        self.request_id = ticket.request_id
        self._meter = self.api.meter(ticket)
        # Renewed on a timer for as long as the request is open, chunks or not.
        self._svc.leases.keep(ticket.reservation)

    # ------------------------------------------------------------------ the answer

    def answer_headers(self, status: int, content_type: str) -> dict[str, str]:
        """The answer's head arrived: the headers kvgate adds to it."""
        assert self._meter is not None and self.ticket is not None
        self._meter.on_headers(status, content_type)
        self._answers.on_headers(status, content_type)
        return {**self.api.answer_headers(self.ticket), CACHE_HEADER: self._answers.cache_header}

    def on_chunk(self, chunk: bytes, *, end_of_stream: bool) -> bytes | None:
        """One chunk of the answer; its replacement when the client must see other bytes."""
        assert self._meter is not None
        if self._first_byte_at is None and chunk and self._started:
            self._first_byte_at = asyncio.get_running_loop().time()
        replacement = self._meter.on_chunk(chunk, end_of_stream=end_of_stream)
        self._answers.on_chunk(chunk if replacement is None else replacement)
        return replacement

    def end_cause(self) -> SettleCause:
        accepted = self._meter is not None and self._meter.accepted
        return SettleCause.COMPLETED if accepted else SettleCause.UPSTREAM_ERROR

    async def settle(self, cause: SettleCause) -> ActualUsage | None:
        """Settle once with what was seen; what was charged (None when there is nothing to
        settle). The store write lands whatever happens to the caller."""
        if not self.unsettled:
            return None
        self._settled = True  # before any await: exactly once
        ticket = self.ticket
        assert ticket is not None
        try:
            reading = await self._reading(ticket)
        except asyncio.CancelledError:
            # Cancelled while counting: settle in the background with what is known.
            self._svc.settler.settle(
                ticket, cause, ResponseReading(streamed=ticket.request.stream), self.request_facts()
            )
            raise
        # The store write is a tracked task of its own, and the answer's last chunk does not
        # wait for it (a Redis round trip).
        charged, _ = self._svc.settler.settle(ticket, cause, reading, self.request_facts())
        self._answers.finish(cause, charged)
        return charged

    def close(self, cause: SettleCause) -> bool:
        """The stream ended. An answer cut short is never kept; an admitted request not yet
        settled settles in the background with what was seen (True when it was so)."""
        if not self._settled:
            # Cut before its answer ended (or refused): a retry with the key runs anew.
            self._answers.abandon()
        if not self.unsettled:
            return False
        self._settled = True
        ticket = self.ticket
        assert ticket is not None

        facts = self.request_facts()

        async def settle_after_disconnect() -> None:
            reading = await self._reading(ticket)
            await self._svc.settler.settle(ticket, cause, reading, facts)[1]

        self._svc.track(settle_after_disconnect())
        return True

    def request_facts(self) -> RequestFacts:
        """What this exchange timed, for the request's usage record: milliseconds from the
        body's arrival (none for an exchange that only observes the answer)."""
        started = self._started
        now = asyncio.get_running_loop().time()

        def since_start(at: float | None) -> float | None:
            return round((at - started) * 1000, 3) if started and at is not None else None

        return RequestFacts(
            api=self.api.name,
            request_id=self.request_id,
            principal=self._principal,
            route=self._route.backend,
            decision_ms=since_start(self._decided_at),
            ttft_ms=since_start(self._first_byte_at),
            duration_ms=since_start(now),
        )

    def hand_off(self) -> None:
        """The split layout: another stream (``Exchange.observing``) meters this request's
        answer and settles it; this one never sees the answer."""
        self._settled = True

    async def _reading(self, ticket: Ticket) -> ResponseReading:
        assert self._meter is not None
        return await self._meter.reading(functools.partial(self._count_output, ticket))

    async def _count_output(self, ticket: Ticket, text: str) -> int:
        try:
            return await self._svc.tokenizers.count_text(ticket.model, text, tenant=ticket.tenant)
        except Exception:
            # E.g. the model was removed by a reload since admission: the billing rule
            # still charges at least one token per content event.
            log.warning(
                "could not count output tokens",
                extra={"request_id": self.request_id, "model": ticket.model},
                exc_info=True,
            )
            return 0


class _ApiWithErrors(Protocol):
    @property
    def errors(self) -> ErrorVocabulary: ...


A = TypeVar("A", bound=_ApiWithErrors)


class _DecidedOnItsBody(abc.ABC, Generic[A, R]):
    """A request decided on its body alone, with no answer to meter after it: the API's
    parse, the tenant's RPM slot, within the decision deadline; every refusal one
    ``Refused`` in the API's shape."""

    def __init__(
        self,
        services: ExchangeServices,
        snapshot: RuntimeSnapshot,
        api: A,
        tenant: TenantPolicy,
        *,
        admission_id: str,
        route: RouteScope = RouteScope(),
    ) -> None:
        self._svc = services
        self._snapshot = snapshot
        self.api: A = api
        self.tenant = tenant
        self._admission_id = admission_id
        self._route = route

    async def _within_deadline(self, body: bytes) -> R:
        timeout_s = self._snapshot.config.server.decision_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await self._decide(body)
        except (ClientError, Rejected, TimeoutError) as error:
            raise _refused(error, self.api.errors, timeout_s) from None

    @abc.abstractmethod
    async def _decide(self, body: bytes) -> R: ...

    def _refuse_model_off_route(self, model: str) -> None:
        if not self._route.allows_model(model):
            raise Refused(
                self.api.errors.model_not_found(model), Outcome.MODEL_NOT_ALLOWED_ON_ROUTE
            )


class PromptCount(_DecidedOnItsBody[PromptCountApi, bytes]):
    """A request kvgate answers itself with its prompt's exact count (``PromptCountApi``):
    parsed once, the tenant's RPM slot taken, counted in its fair share; nothing reserved,
    nothing forwarded."""

    request: ParsedRequest | None = None

    async def answer(self, body: bytes) -> bytes:
        """The answer's JSON body; raises ``Refused`` only."""
        return await self._within_deadline(body)

    async def _decide(self, body: bytes) -> bytes:
        tenant = self.tenant
        request = await off_loop(self._svc, tenant.name, self.api.parse, body, len(body))
        self.request = request
        self._refuse_model_off_route(request.model)
        admission = self._svc.admission(self._snapshot)
        return self.api.answer(await admission.count_prompt(request, tenant, self._admission_id))


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a request that holds no reservation goes: its model's backend (an Envoy
    cluster) and, for a pool, one endpoint of it."""

    model: str
    cluster: str
    endpoint: str | None


class UnmeteredForward(_DecidedOnItsBody[UnmeteredApi, Destination]):
    """A request that generates nothing (``UnmeteredApi``): its body checked, the tenant's
    RPM slot taken, sent to its model's backend; nothing reserved, nothing charged."""

    async def decide(self, body: bytes) -> Destination:
        """Where the request goes; raises ``Refused`` only."""
        return await self._within_deadline(body)

    async def _decide(self, body: bytes) -> Destination:
        tenant = self.tenant
        model = await off_loop(self._svc, tenant.name, self.api.model, body, len(body))
        self._refuse_model_off_route(model)
        admission = self._svc.admission(self._snapshot)
        route, endpoint = await admission.admit_unreserved(
            model, tenant, self._admission_id, self._route.backend
        )
        return Destination(model=route.name, cluster=route.backend, endpoint=endpoint)


async def off_loop(
    services: ExchangeServices, tenant: str, work: Callable[[T], R], argument: T, size: int
) -> R:
    """``work(argument)``; off the event loop when the body is large (megabytes of JSON take
    tens of milliseconds), in the tenant's fair share of the workers, so other tenants'
    decisions go on."""
    if size <= PARSE_OFF_LOOP_BYTES:
        return work(argument)
    try:
        return await services.tokenizers.run(tenant, functools.partial(work, argument), cost=size)
    except TokenizerBusy as busy:
        raise Rejected(
            Rejection(
                Reason.COUNTING_BUSY,
                "Too many of your requests are waiting to be read; "
                "retry when some have been answered.",
                retry_after_s=busy.retry_after_s,
            )
        ) from None


def _refused(
    error: ClientError | Rejected | TimeoutError, errors: ErrorVocabulary, timeout_s: float
) -> Refused:
    """What leaves a decision that did not end in an answer: one ``Refused``."""
    if isinstance(error, ClientError):
        return Refused(error.answer, Outcome.INVALID_REQUEST)
    if isinstance(error, Rejected):
        rejection = error.rejection
        return Refused(rejection_answer(rejection, errors), rejection.reason)
    # Answer before Envoy's message timeout does (an empty 504): whatever the decision was
    # waiting on was cancelled, and a reserve in flight is abandoned.
    return Refused(
        errors.service_unavailable(
            f"kvgate could not decide on this request within {timeout_s:g} s "
            "(it is busy counting prompts). Please retry.",
            retry_after_s=1,
        ),
        Outcome.DECISION_TIMEOUT,
    )
