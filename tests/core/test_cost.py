"""SPEC §18: a session's cost in USD, cached part of input and reasoning part of output."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trialledger.core.cost import (
    Price,
    PricesInvalid,
    as_json,
    parse_prices,
    prices_from,
    session_cost,
    total_cost,
    usage,
    usage_cost,
)
from trialledger.core.events import Usage

PRICE = st.floats(min_value=0, max_value=1000, allow_nan=False, allow_infinity=False)
TOKENS = st.integers(min_value=0, max_value=10**9)


@st.composite
def usages(draw: st.DrawFn) -> Usage:
    input_tokens, output_tokens = draw(TOKENS), draw(TOKENS)
    cached = draw(st.none() | st.integers(min_value=0, max_value=input_tokens))
    reasoning = draw(st.none() | st.integers(min_value=0, max_value=output_tokens))
    return usage(input_tokens, cached, output_tokens, reasoning)


prices = st.builds(Price, input=PRICE, cached_input=PRICE, output=PRICE, reasoning=PRICE)


def test_the_formula_prices_each_token_once() -> None:
    table = parse_prices('["gpt-5"]\ninput = 1.25\ncached_input = 0.125\noutput = 10\n'
                         'reasoning = 20\n')
    cost = session_cost(usage(1000, 400, 200, 50), model="gpt-5", agent="codex",
                        prices=table)
    # (1000 − 400)·1.25 + 400·0.125 + (200 − 50)·10 + 50·20, per million
    assert cost == pytest.approx((600 * 1.25 + 400 * 0.125 + 150 * 10 + 50 * 20) / 1e6)


def test_reasoning_defaults_to_output() -> None:
    table = parse_prices('[m]\ninput = 1\ncached_input = 0.5\noutput = 4\n')
    assert table["m"].reasoning == 4
    assert prices_from(as_json(table)) == table


@given(usages(), prices)
@settings(max_examples=300, deadline=None)
def test_never_negative_and_bounded_by_the_dearest_price(tokens: Usage, price: Price) -> None:
    cost = usage_cost(tokens, price)
    if cost is None:
        return
    dearest = max(price.input, price.cached_input, price.output, price.reasoning)
    assert 0 <= cost <= (tokens.input_tokens + tokens.output_tokens) * dearest / 1e6 * (1 + 1e-9)


@given(usages(), prices, st.integers(min_value=1, max_value=10**6))
@settings(max_examples=300, deadline=None)
def test_cached_tokens_are_priced_at_the_cached_price(tokens: Usage, price: Price,
                                                      more: int) -> None:
    """Moving `more` input tokens into the cache changes the cost by more·(p_cached − p_in)."""
    if tokens.cached_input_tokens is None:
        return
    before = usage_cost(tokens, price)
    after = usage_cost(usage(tokens.input_tokens + more, tokens.cached_input_tokens + more,
                             tokens.output_tokens, tokens.reasoning_output_tokens), price)
    if before is None or after is None:
        assert before is None and after is None
        return
    assert after - before == pytest.approx(more * price.cached_input / 1e6,
                                           rel=1e-9, abs=1e-9)


@given(usages(), prices, st.integers(min_value=1, max_value=10**6))
@settings(max_examples=300, deadline=None)
def test_reasoning_tokens_are_priced_at_the_reasoning_price(tokens: Usage, price: Price,
                                                            more: int) -> None:
    if tokens.reasoning_output_tokens is None:
        return
    before = usage_cost(tokens, price)
    after = usage_cost(usage(tokens.input_tokens, tokens.cached_input_tokens,
                             tokens.output_tokens + more, tokens.reasoning_output_tokens + more),
                       price)
    if before is None or after is None:
        assert before is None and after is None
        return
    assert after - before == pytest.approx(more * price.reasoning / 1e6, rel=1e-9, abs=1e-9)


@given(usages(), prices)
@settings(max_examples=300, deadline=None)
def test_an_unreported_part_is_null_only_when_the_prices_tell_it_apart(
        tokens: Usage, price: Price) -> None:
    cost = usage_cost(tokens, price)
    unknown = ((tokens.cached_input_tokens is None and price.cached_input != price.input)
               or (tokens.reasoning_output_tokens is None and price.reasoning != price.output))
    assert (cost is None) == unknown


@given(usages(), prices, st.sampled_from(["codex", "oracle", "nop"]),
       st.sampled_from(["m", "other", None]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_null_propagates_and_oracle_and_nop_cost_nothing(
        tokens: Usage, price: Price, agent: str, model: str | None, known: bool) -> None:
    table = {"m": price}
    cost = session_cost(tokens if known else None, model=model, agent=agent, prices=table)
    if agent in ("oracle", "nop"):
        assert cost == 0
    elif not known or model != "m":
        assert cost is None
    else:
        assert cost == usage_cost(tokens, price)
    assert session_cost(tokens, model="m", agent="codex", prices=None) is None


@given(st.lists(st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)))
def test_a_total_is_the_sum_only_when_every_cost_is_known(costs: list[float | None]) -> None:
    total = total_cost(costs)
    if any(cost is None for cost in costs):
        assert total is None
    else:
        assert total is not None and math.isclose(total, math.fsum(c for c in costs
                                                                   if c is not None),
                                                  rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize(("text", "said"), [
    ("not = [toml", "not TOML"),
    ("", "no model is priced"),
    ("m = 3", "m is not a table"),
    ('[m]\ninput = 1\noutput = 2', "m has no cached_input"),
    ('[m]\ninput = -1\ncached_input = 1\noutput = 2', "m.input = -1 is not a price"),
    ('[m]\ninput = "1"\ncached_input = 1\noutput = 2', "is not a price"),
    ('[m]\ninput = 1\ncached_input = 1\noutput = 2\ncache = 3', "unknown key cache"),
])
def test_a_bad_table_is_refused_in_one_line(text: str, said: str) -> None:
    with pytest.raises(PricesInvalid, match=said) as caught:
        parse_prices(text)
    assert "\n" not in str(caught.value)
