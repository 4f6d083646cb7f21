"""Deterministic, well-formed logprobs in vLLM 0.10.2's response shapes.

What vLLM's v1 engine hands the OpenAI layer for each sampled position is an ordered
dict ``{sampled id: Logprob, top-1 id: ..., ..., top-k id: ...}`` (the sampled token
first; a token that is both sampled and in the top-k appears once, in first place).
Token strings are ``tokenizer.decode([id])`` (special tokens kept, so an EOS shows as
``<|im_end|>``). The simulator's "model" is greedy: the sampled token is the top-1, so
each position holds ``max(k, 1)`` entries: the sampled token, then ``k - 1``
alternatives from a fixed pool of printable single tokens, with strictly decreasing
pseudo-random logprobs that depend only on (choice, position, rank).

Only requests that ask for logprobs ever reach this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_sim.tokenization import SimTokenizer

# (token id, decoded token, logprob); entry 0 of a position is the sampled token.
Entry = tuple[int, str, float]
Position = list[Entry]

_POOL_SIZE = 64


def _unit(choice: int, position: int, rank: int) -> float:
    """A stable pseudo-random number in [0, 1)."""
    x = (choice * 0x9E3779B1 + position * 0x85EBCA77 + rank * 0xC2B2AE3D + 0x27D4EB2F) & (
        0xFFFFFFFF
    )
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    x ^= x >> 15
    return x / 4294967296.0


class LogprobSource:
    """Builds the per-position logprob dicts for one tokenizer (caches decodes)."""

    def __init__(self, tokenizer: SimTokenizer) -> None:
        self._tok = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._seen: set[str] = set()
        self._specials = set(tokenizer.special_ids)
        self._next_scan = 0
        self._pool = self._alternatives_pool()

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.decode_token(token_id)
            self._texts[token_id] = text
        return text

    def utf8(self, token_id: int) -> list[int]:
        """vLLM: ``list(token.encode("utf-8", errors="replace"))``."""
        out = self._bytes.get(token_id)
        if out is None:
            out = list(self.text(token_id).encode("utf-8", errors="replace"))
            self._bytes[token_id] = out
        return out

    def _alternatives_pool(self) -> list[int]:
        """Single tokens with distinct, printable texts: the output words first, then
        the first fitting ids of the vocabulary (grown on demand, see _grow_pool)."""
        pool: list[int] = []
        for token_id in self._tok.word_ids:
            self._take(pool, token_id)
        self._grow_pool(pool, _POOL_SIZE)
        return pool

    def _take(self, pool: list[int], token_id: int) -> None:
        if token_id in self._specials:
            return
        text = self.text(token_id)
        if not text.strip() or "\ufffd" in text or not text.isprintable() or text in self._seen:
            return
        self._seen.add(text)
        pool.append(token_id)

    def _grow_pool(self, pool: list[int], size: int) -> None:
        while len(pool) < size and self._next_scan < self._tok.vocab_size:
            self._take(pool, self._next_scan)
            self._next_scan += 1

    def prepare(self, k: int, token_ids: Sequence[int] = ()) -> None:
        """Decode ahead (off the event loop) everything a request's logprobs will show:
        the output words, EOS, the alternatives for top-k, and ``token_ids`` (an
        echoed prompt), so that building them touches the tokenizer no more."""
        if len(self._pool) <= k:
            self._grow_pool(self._pool, k + 1)
        for token_id in (*self._tok.word_ids, *token_ids):
            self.text(token_id)
        if self._tok.eos_token_id is not None:
            self.text(self._tok.eos_token_id)

    def position(self, token_id: int, k: int, choice: int, index: int) -> Position:
        """The ordered logprob dict of one sampled (or prompt) token."""
        logprob = -0.6 * _unit(choice, index, 0)
        entries: Position = [(token_id, self.text(token_id), logprob)]
        if k > 1:
            pool = self._pool
            if len(pool) <= k:  # --max-logprobs above the default pool
                self._grow_pool(pool, k + 1)
            start = (index * 7 + choice * 13) % len(pool)
            rank = 1
            for step in range(len(pool)):
                alt = pool[(start + step) % len(pool)]
                if alt == token_id:
                    continue
                logprob -= 0.05 + 1.5 * _unit(choice, index, rank)
                entries.append((alt, self.text(alt), logprob))
                rank += 1
                if rank == k:
                    break
        return entries

    def positions(
        self, token_ids: Sequence[int], k: int, choice: int, start: int = 0
    ) -> list[Position]:
        return [self.position(t, k, choice, start + i) for i, t in enumerate(token_ids)]

    # --- vLLM's OpenAI shapes ----------------------------------------------------------

    def chat(self, positions: Sequence[Position], k: int) -> dict[str, Any]:
        """``ChatCompletionLogProbs``: content[] of token, logprob, bytes,
        top_logprobs[] (the first k dict entries, the sampled one included)."""
        content = []
        for entries in positions:
            token_id, text, logprob = entries[0]
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": self.utf8(token_id),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": self.utf8(i)}
                        for i, t, lp in entries[:k]
                    ],
                }
            )
        return {"content": content}

    def completion(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Position | None],
        k: int,
        initial_text_offset: int = 0,
    ) -> dict[str, Any]:
        """``CompletionLogProbs``: text_offset, token_logprobs, tokens, top_logprobs
        (a dict of up to k + 1 entries keyed by token text; ``None`` where the
        engine had no logprobs, i.e. the first prompt token of an echo)."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top_logprobs: list[dict[str, float] | None] = []
        offset = initial_text_offset
        for token_id, entries in zip(token_ids, positions, strict=True):
            text = self.text(token_id)
            if entries is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(entries[0][2])
                top_logprobs.append({t: lp for _, t, lp in entries[: k + 1]})
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
        return {
            "text_offset": text_offset,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }

    @staticmethod
    def prompt_logprobs(positions: Sequence[Position | None]) -> list[Any]:
        """A completion choice's ``prompt_logprobs`` (echo with logprobs):
        ``[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``."""
        return [
            None
            if entries is None
            else {
                str(token_id): {"logprob": lp, "rank": rank, "decoded_token": text}
                for rank, (token_id, text, lp) in enumerate(entries, start=1)
            }
            for entries in positions
        ]
