"""Prices and costs in exact integer units: no float ever touches money.

Prices are configured in US dollars per million tokens as decimal strings (e.g. "0.15").
A cost is an integer number of pico-dollars (1e-12 USD): tokens x dollars-per-million is
exactly a number of micro-dollars, so with prices of at most six decimal places every cost
is a whole number of pico-dollars.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

PICO_PER_USD = 10**12
_PICO_PER_MICRO = 10**6
MAX_PRICE_DECIMALS = 6


def usd_to_pico(value: Decimal) -> int:
    scaled = value * PICO_PER_USD
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{value} has more precision than a pico-dollar")
    return int(scaled)


def pico_to_usd(pico: int) -> Decimal:
    return Decimal(pico) / PICO_PER_USD


def price_per_token_pico(dollars_per_million: Decimal) -> int:
    """Pico-dollars per token for a price in dollars per million tokens."""
    scaled = dollars_per_million * _PICO_PER_MICRO
    if scaled != scaled.to_integral_value():
        raise ValueError(
            f"price {dollars_per_million} has more than {MAX_PRICE_DECIMALS} decimal places"
        )
    return int(scaled)


@dataclass(frozen=True, slots=True)
class Pricing:
    """Pico-dollars per token."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    @classmethod
    def per_million(
        cls, input_usd: Decimal, cached_input_usd: Decimal, output_usd: Decimal
    ) -> Pricing:
        return cls(
            input=price_per_token_pico(input_usd),
            cached_input=price_per_token_pico(cached_input_usd),
            output=price_per_token_pico(output_usd),
        )

    def cost(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> int:
        """Cost of actual usage; cached prompt tokens are billed at the cached price."""
        cached = min(max(0, cached_tokens), prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input
            + cached * self.cached_input
            + output_tokens * self.output
        )

    def worst_case(self, prompt_tokens: int, max_output_tokens: int) -> int:
        """What admission reserves: no cache discount assumed, every output token used."""
        return prompt_tokens * self.input + max_output_tokens * self.output

    def output_tokens_affordable(self, prompt_tokens: int, budget_pico: int) -> int:
        """The most output tokens a remaining budget covers after paying for the prompt."""
        left = budget_pico - prompt_tokens * self.input
        if left < 0:
            return 0
        if self.output == 0:
            return 2**62
        return left // self.output
