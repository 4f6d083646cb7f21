"""Answer sources: what may answer a request instead of a backend.

A source (an Idempotency-Key, the exact-match cache, the semantic cache, ...) is asked in
turn once the tenant's RPM slot is taken and the body digested once, and answers
``lookup → Hit | Miss | Bypass``:

* ``Hit``: a stored answer answers the request now (charged as the source says, nothing
  forwarded);
* ``Miss``: the request runs, and the source's recorder keeps its answer when it completes;
* ``Bypass``: the source has nothing to do with this request.

Each source maps its own store's failures (a refusal raises, an unavailable store that
fails open is a ``Bypass``). The composition root lists the sources in the order they are
asked (``app.py``): a new cache is one module with an ``AnswerSource`` and one line there.
``answer_run.AnswerRun`` is one request's walk through them and the recorders that keep its
answer.

Which sources an API allows is the API's (``ApiProtocol.answer_sources``, by ``SourceName``),
and so is the rule that says an answer is complete enough to keep
(``ApiProtocol.answer_defect``, carried to every recorder as ``AnswerQuery.answer_defect``):
a source asks nothing about the API it serves, and keeps nothing the API's own grammar does
not call finished. What the sources key, fingerprint and compare is the client's own body
(``AnswerQuery.body``), not the canonical request an agent API is converted into.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter

from kvgate.cache.answers import StoredAnswer
from kvgate.config.snapshot import RuntimeSnapshot
from kvgate.openai import ParsedRequest
from kvgate.openai.completeness import AnswerDefect
from kvgate.policy import TenantPolicy

if TYPE_CHECKING:
    from kvgate.lifecycle.idempotency import AnswerRecorder
    from kvgate.lifecycle.protocol import ErrorVocabulary


class SourceName(enum.StrEnum):
    """The answer sources, by the name an API allows them by (and metrics and logs use)."""

    IDEMPOTENCY = "idempotency"
    EXACT_CACHE = "exact_cache"
    SEMANTIC_CACHE = "semantic_cache"


class AnswerJudge(Protocol):
    """An API's completeness rule: why its answer may not be kept, or None when it is
    complete by the API's grammar (``kvgate.openai.completeness.answer_defect`` is
    chat/completions')."""

    def __call__(
        self, *, stream: bool, status: int, content_type: str, body: bytes
    ) -> AnswerDefect | None: ...


@dataclass(frozen=True, slots=True)
class AnswerQuery:
    """What every source may read about the request it is asked for."""

    request: ParsedRequest
    # The client's own body (``ApiProtocol.client_body``): what the exact cache's key and
    # the Idempotency-Key's fingerprint digest, what the semantic cache's context is made
    # of, and where determinism (``temperature``) is read.
    body: Mapping[str, Any]
    tenant: TenantPolicy
    snapshot: RuntimeSnapshot
    # The admission's own id: the owner of any lock a source takes for this request.
    owner: str
    # The backend the route names for this request (None: the model's own).
    route_backend: str | None
    # The client's Idempotency-Key, when it sent one.
    idempotency_key: str | None
    # Called when the request starts waiting (its deadlines move for the wait).
    on_wait: Callable[[float], None]
    # The request's API's refusals: a source that refuses answers in its shape.
    errors: ErrorVocabulary
    # The request's API's completeness rule: every recorder keeps only what it accepts.
    answer_defect: AnswerJudge
    # Whether this stream sees the answer at all (the split layout's request path does not:
    # nothing it runs can be kept).
    sees_answer: bool = True


@dataclass(frozen=True, slots=True)
class HitCharge:
    """How a cache hit is charged: ``mode`` as its cache's ``hit_charge`` (``full``: what
    the stored answer took from the tenant's TPM and budgets), and its saved tokens'
    counter."""

    mode: str
    saved_tokens: Counter


@dataclass(frozen=True, slots=True)
class Hit:
    answer: StoredAnswer
    headers: Mapping[str, str]
    # The decision's name in metrics, logs and dynamic metadata.
    reason: str
    # None: a replay of an answer this tenant was charged for when it ran.
    charge: HitCharge | None = None


@dataclass(frozen=True, slots=True)
class Miss:
    recorder: AnswerRecorder
    # An Idempotency-Key keeps whatever answers its request (a fallback's or a clamp's, with
    # the headers that say so, or a cache hit's); a cache keeps only the exact answer.
    keeps_any_answer: bool = False
    cache_header: str | None = None


@dataclass(frozen=True, slots=True)
class Bypass:
    cache_header: str | None = None


class AnswerSource(abc.ABC):
    """One way a request may be answered without a backend."""

    name: SourceName

    @abc.abstractmethod
    def applies(self, query: AnswerQuery) -> bool:
        """Whether this source may answer the request: configuration and O(1) checks only
        (the RPM slot is taken and the body digested only when some source applies)."""

    @abc.abstractmethod
    async def lookup(self, query: AnswerQuery, digest: str) -> Hit | Miss | Bypass:
        """Answer, run with a recorder, or stay out; ``digest`` is the body's canonical
        digest, computed once for all sources."""
