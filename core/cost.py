"""What a session cost in USD (SPEC §18): its usage priced by a job's price table.

A price table gives, per model, USD per million input, cached-input, output and reasoning
tokens (reasoning defaults to output). Cached tokens are part of the input and reasoning
tokens part of the output (§4), so each token is priced once:

    cost_usd = ((input − cached)·p_in + cached·p_cached
                + (output − reasoning)·p_out + reasoning·p_reasoning) / 10⁶

The cost is None — never 0 — when it is not known: the usage is unknown, the model is not
in the table, or a part the prices tell apart (cached when p_cached ≠ p_in, reasoning when
p_reasoning ≠ p_out) was not reported. An oracle or nop session asks no model: it costs 0.

    >>> table = parse_prices('["gpt-5"]\\ninput = 1.25\\ncached_input = 0.125\\noutput = 10')
    >>> session_cost(usage(1000, 400, 200, 50), model="gpt-5", agent="codex", prices=table)
    0.0028
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trialledger.core.errors import TrialLedgerError
from trialledger.core.events import Usage

MILLION = 1_000_000
FREE_AGENTS = frozenset({"oracle", "nop"})  # they ask no model (SPEC §15)
_FIELDS = ("input", "cached_input", "output", "reasoning")


class PricesInvalid(TrialLedgerError):
    """A price table that is not TOML, or whose model entries are not prices."""


@dataclass(frozen=True)
class Price:
    """One model's prices, USD per million tokens."""

    input: float
    cached_input: float
    output: float
    reasoning: float


def _price(model: str, entry: Any) -> Price:
    if not isinstance(entry, dict):
        raise PricesInvalid(f"prices: {model} is not a table of prices (input, cached_input, "
                            f"output, reasoning)")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise PricesInvalid(f"prices: {model} has unknown key {unknown[0]} (expected input, "
                            f"cached_input, output, reasoning)")
    values: dict[str, float] = {}
    for field in _FIELDS:
        if field not in entry:
            if field == "reasoning":
                values[field] = values["output"]
                continue
            raise PricesInvalid(f"prices: {model} has no {field}")
        value = entry[field]
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            raise PricesInvalid(f"prices: {model}.{field} = {value!r} is not a price "
                                f"(a number ≥ 0, USD per million tokens)")
        values[field] = float(value)
    return Price(**values)


def prices_from(table: Mapping[str, Any]) -> dict[str, Price]:
    """A price table from its parsed form (model → {input, cached_input, output[,
    reasoning]}); refused (`PricesInvalid`) when an entry is not prices."""
    return {str(model): _price(str(model), entry) for model, entry in table.items()}


def parse_prices(text: str) -> dict[str, Price]:
    """A price table from its TOML text: one table per model."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise PricesInvalid(f"prices: not TOML ({error})") from None
    if not table:
        raise PricesInvalid("prices: no model is priced")
    return prices_from(table)


def as_json(prices: Mapping[str, Price]) -> dict[str, dict[str, float]]:
    """The table as stored with a job (read back by `prices_from`)."""
    return {model: {field: getattr(price, field) for field in _FIELDS}
            for model, price in sorted(prices.items())}


def usage(input_tokens: int, cached: int | None, output_tokens: int,
          reasoning: int | None) -> Usage:
    """A `Usage` from its four figures (a helper for callers holding columns)."""
    return Usage(input_tokens=input_tokens, cached_input_tokens=cached,
                 output_tokens=output_tokens, reasoning_output_tokens=reasoning,
                 total_tokens=input_tokens + output_tokens)


def usage_cost(tokens: Usage, price: Price) -> float | None:
    """§18's formula; None when a part the prices tell apart was not reported."""
    cached = tokens.cached_input_tokens
    if cached is None:
        if price.cached_input != price.input:
            return None
        cached = 0
    reasoning = tokens.reasoning_output_tokens
    if reasoning is None:
        if price.reasoning != price.output:
            return None
        reasoning = 0
    cached = min(cached, tokens.input_tokens)
    reasoning = min(reasoning, tokens.output_tokens)
    return ((tokens.input_tokens - cached) * price.input + cached * price.cached_input
            + (tokens.output_tokens - reasoning) * price.output
            + reasoning * price.reasoning) / MILLION


def session_cost(tokens: Usage | None, *, model: str | None, agent: str,
                 prices: Mapping[str, Price] | None) -> float | None:
    """A session's `cost_usd`: 0 for an agent that asks no model, else its usage priced by
    its model's prices; None when the usage, the table or the model's price is unknown."""
    if agent in FREE_AGENTS:
        return 0.0
    if tokens is None or prices is None or model is None or model not in prices:
        return None
    return usage_cost(tokens, prices[model])


def total_cost(costs: Iterable[float | None]) -> float | None:
    """The cost of several sessions (a trial's, a job's): their sum when every one is known,
    else None (a partial sum would pass for the whole)."""
    total = 0.0
    for cost in costs:
        if cost is None:
            return None
        total += cost
    return total


__all__ = ["FREE_AGENTS", "Price", "PricesInvalid", "as_json", "parse_prices", "prices_from",
           "session_cost", "total_cost", "usage", "usage_cost"]
