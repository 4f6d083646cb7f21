"""A lexical check next to the semantic cache's similarity (first version: interface only).

A bag-of-tokens embedding cannot see word order, a changed digit or a negation; this guard
refuses a candidate hit whose question differs in those ways. Pure, no I/O.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass


class GuardLevel(enum.StrEnum):
    STRICT = "strict"  # the content words must be the same, in the same order
    NUMBERS = "numbers"  # same numbers in order, same negations, no reordered words
    OFF = "off"


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_WORD = re.compile(r"\d+|[^\W\d_]+")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NEGATIONS = _words(
    "not no never none nothing nobody nor n't nicht kein keine keinen keinem keiner keines "
    "nie niemals ne pas jamais aucun aucune non nunca nada ningún ninguna ninguno jamás "
    "não nao nem nenhum nenhuma niet geen nooit"
)
_DROP = _words("a an the please could you can tell me hi hello thanks kindly")


@dataclass(frozen=True, slots=True)
class Signature:
    """A question normalised once: compare signatures, not strings."""

    words: tuple[str, ...]
    numbers: tuple[str, ...]
    negations: tuple[tuple[str, int], ...]
    content: tuple[str, ...]


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).casefold()


def question_signature(question: str) -> Signature:
    text = _normalise(question)
    words = tuple(_WORD.findall(text))
    numbers = tuple(_NUMBER.findall(text))
    negations = tuple(sorted(Counter(w for w in words if w in _NEGATIONS).items()))
    content = tuple(w for w in words if w not in _DROP)
    return Signature(words, numbers, negations, content)


def _sig(q: str | Signature) -> Signature:
    return q if isinstance(q, Signature) else question_signature(q)


def guard_allows(
    stored_question: str | Signature, new_question: str | Signature, level: GuardLevel
) -> bool:
    """May a stored answer to ``stored_question`` serve ``new_question``?"""
    if level is GuardLevel.OFF:
        return True
    a, b = _sig(stored_question), _sig(new_question)
    if level is GuardLevel.STRICT:
        return a.numbers == b.numbers and a.content == b.content
    if a.numbers != b.numbers or a.negations != b.negations:
        return False
    return not (a.words != b.words and sorted(a.words) == sorted(b.words))
