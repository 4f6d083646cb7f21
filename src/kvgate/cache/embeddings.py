"""Embedders for the semantic cache: texts in, L2-normalised float32 vectors out.

Two implementations of :class:`Embedder`:

* :class:`WordLlamaEmbedder`, offline: WordLlama's ``l2_supercat`` token embeddings
  (256 dimensions, 32,000 Llama-2 tokens, shipped inside the ``wordllama`` wheel; the
  ``semantic`` extra). A text's vector is the mean of its tokens' vectors, normalised, as
  ``wordllama``'s own ``embed(norm=True)``. The files are read straight from the installed
  package with ``tokenizers`` and ``safetensors``: ``wordllama`` itself is never imported,
  because ``WordLlama.load()`` looks for the tokenizer in a directory that does not exist in
  the wheel (``tokenizer/`` instead of ``tokenizers/``) and then downloads it from Hugging Face,
  and because importing it calls ``logging.basicConfig(level=INFO)`` on the root logger.
  Matryoshka-trained: 64 or 128 dimensions are the first columns, renormalised.
* :class:`OpenAIEmbeddingsClient`: ``POST {base_url}/embeddings`` on an OpenAI-compatible
  server (vLLM serving an embedding model, or the simulator's wordllama), over aiohttp with
  a hard deadline.

Both are shared by every tenant, so both take the ``tenant`` an embedding is for and bound
what one tenant may have outstanding (``max_queued_per_tenant``; past it the call is
refused at once with :class:`EmbeddingBusy`), and both give every call one deadline, waiting
included (past it :class:`EmbeddingDeadlineExceeded`). WordLlama's worker thread takes jobs
by start-time fair queueing over per-tenant queues (the tokenizer pool's scheduler,
``kvgate.tokenize.service``): a tenant flooding long questions delays another tenant's
embedding by at most the one job already running. What was refused is counted by reason in
``refused``.

Every failure to produce vectors is an :class:`EmbeddingError`; the caller treats it as "no
semantic lookup" and serves the request normally. A text without a single meaningful token
(``""``, only special tokens) embeds as the zero vector: its similarity with everything is 0,
so it can never hit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import aiohttp
import numpy as np
import numpy.typing as npt

from kvgate.tokenize.service import TokenizerBusy, _FairScheduler

__all__ = [
    "Embedder",
    "EmbeddingBusy",
    "EmbeddingDeadlineExceeded",
    "EmbeddingError",
    "EmbeddingInputError",
    "EmbeddingUnavailable",
    "OpenAIEmbeddingsClient",
    "WordLlamaEmbedder",
    "cosine",
    "l2_normalise",
]

Vectors = npt.NDArray[np.float32]


class EmbeddingError(Exception):
    """No vectors for this call: skip the semantic lookup (never fail the request)."""


class EmbeddingInputError(EmbeddingError):
    """The input itself was refused (too long, or the server answered 4xx)."""


class EmbeddingUnavailable(EmbeddingError):
    """The embedder could not answer: timeout, connection, 5xx, a malformed answer."""


class EmbeddingBusy(EmbeddingUnavailable):
    """The tenant already has ``max_queued_per_tenant`` embeddings outstanding: this one was
    not queued."""


class EmbeddingDeadlineExceeded(EmbeddingUnavailable):
    """No vectors within the call's deadline (queued behind other work, or a slow server)."""


# The reasons ``refused`` counts (the label of kvgate_semantic_cache_embeddings_refused).
REFUSED_TENANT_QUEUE_FULL = "tenant_queue_full"
REFUSED_DEADLINE = "deadline"

# Embeddings one tenant may have queued or running at once, and every call's deadline,
# unless configured (semantic_cache.embedder.max_queued_per_tenant and timeout_s).
DEFAULT_MAX_QUEUED_PER_TENANT = 8
DEFAULT_DEADLINE_S = 0.5


@runtime_checkable
class Embedder(Protocol):
    """Texts -> an ``(n, dimensions)`` float32 array, each row L2-normalised (or all zeros).

    ``name`` identifies the vector space: vectors are comparable only under the same name.
    """

    @property
    def name(self) -> str: ...

    @property
    def dimensions(self) -> int: ...

    async def embed(self, texts: Sequence[str], *, tenant: str = "") -> Vectors: ...

    async def close(self) -> None: ...


def _text_list(texts: Sequence[str]) -> list[str]:
    """The texts as a list; a caller passing anything but strings is a bug, not input."""
    out = list(texts)
    if not all(isinstance(t, str) for t in out):
        raise TypeError("texts must be strings")
    return out


def l2_normalise(vectors: npt.ArrayLike) -> Vectors:
    """Rows scaled to unit length, as float32; an all-zero row stays zero."""
    out = np.array(vectors, dtype=np.float32, copy=True, ndmin=2)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.divide(out, norms, out=out, where=norms > 0)
    return out


# --------------------------------------------------------------------------- WordLlama

WORDLLAMA_CONFIG = "l2_supercat"
WORDLLAMA_WEIGHTS = "weights/l2_supercat_256.safetensors"
WORDLLAMA_TOKENIZER = "tokenizers/l2_supercat_tokenizer_config.json"
WORDLLAMA_TENSOR = "embedding.weight"
WORDLLAMA_DIMENSIONS = (64, 128, 256)  # matryoshka prefixes of the shipped 256 columns
# The longest token of the Llama-2 vocabulary is 16 characters, and the tokenizer's
# normalizer never shortens a text, so a text of more than 16 x N characters has more than
# N tokens: refused without tokenizing it.
_MAX_CHARS_PER_TOKEN = 16


def wordllama_package_dir() -> Path:
    """The installed wordllama package's directory, found without importing it."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or spec.origin is None:
        raise EmbeddingUnavailable("wordllama is not installed (pip install 'kvgate[semantic]')")
    return Path(spec.origin).parent


class WordLlamaEmbedder:
    """WordLlama ``l2_supercat``: mean of token vectors, normalised; offline.

    ``embed`` runs on the event loop when the batch is at most ``inline_max_chars``
    characters (a short question costs less than a hop to a thread), else on the embedder's
    own worker thread (one: batches queue, they never take more than one core). The thread
    serves tenants fairly (start-time fair queueing weighted by characters); a tenant with
    ``max_queued_per_tenant`` batches queued or running gets :class:`EmbeddingBusy`, and a
    batch not done within ``deadline_s`` of the call :class:`EmbeddingDeadlineExceeded`
    (still queued, it never runs). Texts of more than ``max_tokens`` tokens are refused
    with :class:`EmbeddingInputError` (a mean over thousands of tokens says little, and the
    cache should not key on it).

    Loading reads 16 MB of weights (about 0.1 s warm): do it at start-up.
    """

    def __init__(
        self,
        *,
        dimensions: int = 256,
        max_tokens: int = 2048,
        inline_max_chars: int = 256,
        max_queued_per_tenant: int = DEFAULT_MAX_QUEUED_PER_TENANT,
        deadline_s: float = DEFAULT_DEADLINE_S,
        package_dir: Path | None = None,
    ) -> None:
        if dimensions not in WORDLLAMA_DIMENSIONS:
            raise ValueError(f"dimensions must be one of {WORDLLAMA_DIMENSIONS}, not {dimensions}")
        if max_tokens < 1 or inline_max_chars < 0:
            raise ValueError("max_tokens must be >= 1 and inline_max_chars >= 0")
        if max_queued_per_tenant < 1 or deadline_s <= 0:
            raise ValueError("max_queued_per_tenant must be >= 1 and deadline_s > 0")
        from safetensors.numpy import load
        from tokenizers import Tokenizer

        pkg = package_dir or wordllama_package_dir()
        weights_path = pkg / WORDLLAMA_WEIGHTS
        tokenizer_path = pkg / WORDLLAMA_TOKENIZER
        for path in (weights_path, tokenizer_path):
            if not path.is_file():
                raise EmbeddingUnavailable(f"wordllama file missing: {path}")
        raw = weights_path.read_bytes()
        self._digest = hashlib.sha256(raw).hexdigest()
        table = load(raw)[WORDLLAMA_TENSOR]
        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if table.ndim != 2 or table.shape[0] < vocab or table.shape[1] < dimensions:
            raise EmbeddingUnavailable(f"unexpected wordllama weights shape {table.shape}")
        self._table: Vectors = np.ascontiguousarray(table[:, :dimensions], dtype=np.float32)
        # Special tokens (<unk>, <s>, </s>) carry no meaning: left out of the mean (they only
        # appear when a text spells them out, as add_special_tokens is off).
        self._pooled = np.ones(self._table.shape[0], dtype=bool)
        for token_id, token in self._tokenizer.get_added_tokens_decoder().items():
            if token.special and token_id < self._pooled.size:
                self._pooled[token_id] = False
        self._dimensions = dimensions
        self.max_tokens = max_tokens
        self.inline_max_chars = inline_max_chars
        self.max_queued_per_tenant = max_queued_per_tenant
        self.deadline_s = deadline_s
        # Calls refused, by reason (REFUSED_TENANT_QUEUE_FULL, REFUSED_DEADLINE).
        self.refused: Counter[str] = Counter()
        try:
            self.version = importlib.metadata.version("wordllama")
        except importlib.metadata.PackageNotFoundError:
            self.version = "unknown"
        self._worker: _FairScheduler | None = None

    @property
    def name(self) -> str:
        return f"wordllama:{WORDLLAMA_CONFIG}-{self._dimensions}:{self._digest[:12]}"

    @property
    def dimensions(self) -> int:
        return self._dimensions

    async def embed(self, texts: Sequence[str], *, tenant: str = "") -> Vectors:
        """The texts' vectors; ``tenant`` is whose fair share and bound the work counts
        against ("" : nobody's, never refused for the bound, still under the deadline)."""
        texts = _text_list(texts)
        self._check_lengths(texts)
        chars = sum(len(t) for t in texts)
        if chars <= self.inline_max_chars:
            return self.embed_sync(texts)
        worker = self._ensure_worker()
        try:
            job = worker.submit(tenant, lambda: self.embed_sync(texts), chars, bounded=True)
        except TokenizerBusy as exc:
            self.refused[REFUSED_TENANT_QUEUE_FULL] += 1
            raise EmbeddingBusy(
                f"tenant '{tenant}' already has {exc.jobs} embeddings queued or running"
            ) from exc
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s):
                return cast(Vectors, await job.future)
        except TimeoutError as exc:
            self.refused[REFUSED_DEADLINE] += 1
            raise EmbeddingDeadlineExceeded(
                f"no vectors within {self.deadline_s:g} s "
                f"({time.monotonic() - started:.3f} s, {chars} characters)"
            ) from exc
        except RuntimeError as exc:  # closed while queued
            raise EmbeddingUnavailable(f"the embedder is closed: {exc}") from exc
        finally:
            worker.drop(job)  # still queued (deadline, cancelled caller): it never runs

    def _ensure_worker(self) -> _FairScheduler:
        if self._worker is None:
            # One thread: batches never take more than one core. The bound is in batches,
            # not characters (each is at most max_tokens tokens anyway), and no batch counts
            # as large (with one thread there is nothing to reserve).
            self._worker = _FairScheduler(
                1,
                max_jobs_per_tenant=self.max_queued_per_tenant,
                max_cost_per_tenant=sys.maxsize,
                large_job_cost=sys.maxsize,
                reserved_workers=0,
            )
        return self._worker

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        """The computation itself, on the calling thread."""
        texts = list(texts)
        self._check_lengths(texts)
        out = np.zeros((len(texts), self._dimensions), dtype=np.float32)
        if not texts:
            return out
        if len(texts) == 1:
            encodings = [self._tokenizer.encode(texts[0], add_special_tokens=False)]
        else:
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        pooled, table = self._pooled, self._table
        for row, encoding in enumerate(encodings):
            ids = np.array(encoding.ids, dtype=np.intp)
            if ids.size > self.max_tokens:
                raise EmbeddingInputError(
                    f"text {row} has {ids.size} tokens, more than max_tokens={self.max_tokens}"
                )
            ids = ids[pooled[ids]]
            if ids.size:
                # The mean's direction is the sum's: normalising the sum skips a division.
                total = np.add.reduce(table[ids], axis=0)
                norm = math.sqrt(float(total @ total))
                if norm > 0:
                    out[row] = total / norm
        return out

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _check_lengths(self, texts: Sequence[str]) -> None:
        limit = self.max_tokens * _MAX_CHARS_PER_TOKEN
        for row, text in enumerate(texts):
            if len(text) > limit:
                raise EmbeddingInputError(
                    f"text {row} has {len(text)} characters: more than max_tokens="
                    f"{self.max_tokens} tokens"
                )

    async def close(self) -> None:
        """Stop the worker thread (queued calls fail as unavailable; the next call that
        needs the thread starts a new one)."""
        if self._worker is not None:
            self._worker.close(wait=False)
            self._worker = None


# --------------------------------------------------------------------------- OpenAI API


class OpenAIEmbeddingsClient:
    """An OpenAI-compatible embeddings endpoint (``POST {base_url}/embeddings``).

    ``base_url`` is what the OpenAI SDK takes, e.g. ``http://vllm-embed:8000/v1``.
    ``dimensions`` is the width the answers must have (checked); ``send_dimensions`` also
    asks the server for it (the ``dimensions`` field: a matryoshka model truncates, vLLM
    refuses it for other models). Answers are asked for as ``base64`` (little-endian
    float32, what vLLM and OpenAI send) unless ``encoding_format="float"``, and are
    renormalised here whatever the server did. One deadline, ``timeout_s``, covers the
    whole call: connecting, sending and reading, and every request when more than
    ``max_batch`` texts are sent as several, one after the other (past it
    :class:`EmbeddingDeadlineExceeded`); ``connect_timeout_s`` bounds the connect alone.
    A tenant with ``max_queued_per_tenant`` calls in flight gets :class:`EmbeddingBusy` at
    once: the server schedules what it receives, so what kvgate bounds is how much of it one
    tenant can have outstanding.
    4xx answers (429 excepted) raise :class:`EmbeddingInputError`; timeouts, connection
    failures, 429, 5xx and malformed answers :class:`EmbeddingUnavailable`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        dimensions: int,
        api_key: str | None = None,
        send_dimensions: bool = False,
        encoding_format: str = "base64",
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        max_batch: int = 256,
        max_queued_per_tenant: int = DEFAULT_MAX_QUEUED_PER_TENANT,
        extra_headers: Mapping[str, str] | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if dimensions < 1:
            raise ValueError("dimensions must be >= 1")
        if encoding_format not in ("base64", "float"):
            raise ValueError("encoding_format must be 'base64' or 'float'")
        if timeout_s <= 0 or connect_timeout_s <= 0 or max_batch < 1:
            raise ValueError("timeouts must be > 0 and max_batch >= 1")
        if max_queued_per_tenant < 1:
            raise ValueError("max_queued_per_tenant must be >= 1")
        self.url = base_url.rstrip("/") + "/embeddings"
        self.model = model
        self._dimensions = dimensions
        self.send_dimensions = send_dimensions
        self.encoding_format = encoding_format
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_batch = max_batch
        self.max_queued_per_tenant = max_queued_per_tenant
        # Calls refused, by reason (REFUSED_TENANT_QUEUE_FULL, REFUSED_DEADLINE).
        self.refused: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()  # per tenant
        self._headers = {
            **(extra_headers or {}),
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session = session
        self._owns_session = session is None
        # What the server said it counted, summed (usage.prompt_tokens).
        self.prompt_tokens_total = 0

    @property
    def name(self) -> str:
        return f"openai:{self.model}:{self._dimensions}"

    @property
    def dimensions(self) -> int:
        return self._dimensions

    async def embed(self, texts: Sequence[str], *, tenant: str = "") -> Vectors:
        """The texts' vectors; ``tenant`` is whose bound the call counts against ("":
        nobody's, still under the deadline)."""
        texts = _text_list(texts)
        if not texts:
            return np.zeros((0, self._dimensions), dtype=np.float32)
        # As the WordLlama worker: a tenant with nothing outstanding is always served.
        if tenant and self._in_flight[tenant] >= self.max_queued_per_tenant:
            self.refused[REFUSED_TENANT_QUEUE_FULL] += 1
            raise EmbeddingBusy(
                f"tenant '{tenant}' already has {self._in_flight[tenant]} embedding requests "
                f"in flight to {self.url}"
            )
        self._in_flight[tenant] += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            parts = [
                await self._embed_batch(texts[i : i + self.max_batch], deadline)
                for i in range(0, len(texts), self.max_batch)
            ]
        except EmbeddingDeadlineExceeded:
            self.refused[REFUSED_DEADLINE] += 1
            raise
        finally:
            self._in_flight[tenant] -= 1
            if not self._in_flight[tenant]:
                del self._in_flight[tenant]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def _embed_batch(self, texts: list[str], deadline: float) -> Vectors:
        body: dict[str, Any] = {
            "model": self.model,
            "input": texts,
            "encoding_format": self.encoding_format,
        }
        if self.send_dimensions:
            body["dimensions"] = self._dimensions
        payload = json.dumps(body, ensure_ascii=False).encode()
        # A float answer is at most ~25 bytes a value; base64 ~5.4. Anything much larger
        # is not an embeddings answer: stop reading.
        limit = 65536 + len(texts) * self._dimensions * 32
        session = self._ensure_session()
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                async with session.post(
                    self.url,
                    data=payload,
                    headers=self._headers,
                    timeout=aiohttp.ClientTimeout(
                        total=left, sock_connect=min(left, self.connect_timeout_s)
                    ),
                ) as resp:
                    raw = await _read_capped(resp, limit)
                    status = resp.status
        except TimeoutError as exc:
            raise EmbeddingDeadlineExceeded(
                f"{self.url}: no answer within {self.timeout_s:g} s"
            ) from exc
        except EmbeddingError:
            raise
        except (aiohttp.ClientError, OSError) as exc:
            raise EmbeddingUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            message = _error_message(raw)
            # 4xx: this input (or the configuration) is refused; 429 and 5xx: try later.
            refused = 400 <= status < 500 and status != 429
            err = EmbeddingInputError if refused else EmbeddingUnavailable
            raise err(f"{self.url}: HTTP {status}: {message}")
        return self._parse(raw, len(texts))

    def _parse(self, raw: bytes, n: int) -> Vectors:
        try:
            answer = json.loads(raw)
            data = answer["data"]
            if not isinstance(data, list) or len(data) != n:
                raise ValueError(f"{len(data) if isinstance(data, list) else 'no'} rows for {n}")
            rows: list[Any] = [None] * n
            for item in data:
                index = item["index"]
                if not isinstance(index, int) or not 0 <= index < n or rows[index] is not None:
                    raise ValueError(f"bad index {index!r}")
                rows[index] = self._decode(item["embedding"])
            usage = answer.get("usage") or {}
            tokens = usage.get("prompt_tokens")
            if isinstance(tokens, int):
                self.prompt_tokens_total += tokens
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise EmbeddingUnavailable(f"{self.url}: malformed embeddings answer: {exc}") from exc
        return l2_normalise(np.stack(rows))

    def _decode(self, embedding: Any) -> Vectors:
        if isinstance(embedding, str):
            vector = np.frombuffer(base64.b64decode(embedding, validate=True), dtype="<f4")
        elif isinstance(embedding, list):
            vector = np.asarray(embedding, dtype=np.float32)
        else:
            raise ValueError(f"embedding of type {type(embedding).__name__}")
        if vector.shape != (self._dimensions,):
            raise ValueError(f"{vector.size} dimensions, expected {self._dimensions}")
        if not np.all(np.isfinite(vector)):
            raise ValueError("non-finite values")
        return vector.astype(np.float32, copy=False)

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    length = resp.content_length
    if length is not None and length > limit:
        raise EmbeddingUnavailable(f"answer of {length} bytes, over {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise EmbeddingUnavailable(f"answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error_message(raw: bytes) -> str:
    """The OpenAI-shaped error's message, else the start of the body."""
    try:
        err = json.loads(raw)["error"]
        message = err["message"] if isinstance(err, dict) else err
        return str(message)[:300]
    except (ValueError, KeyError, TypeError):
        text = raw[:300].decode("utf-8", "replace")
        return text if text.strip() else "(empty body)"


def cosine(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    """Cosine similarity of two vectors (0 when either is zero)."""
    va = np.asarray(a, dtype=np.float64).ravel()
    vb = np.asarray(b, dtype=np.float64).ravel()
    denom = float(np.linalg.norm(va) * np.linalg.norm(vb))
    return 0.0 if denom == 0 or not math.isfinite(denom) else float(va @ vb / denom)
