"""Policy v3 (SPEC §14): what Codex claims about the model endpoint needs the proxy's word.

A session whose `agent.launched.model_proxy` is true has `model.call` events: the harness's
own record of every request, which the agent cannot write. v3 is v2 plus, for `POST
…/responses` calls only (and never one the proxy refused itself, `PROXY_REFUSALS`):
- an endpoint or quota failure, and R5b's reconnect, are believed only when the last call
  failed upstream (408, 429, ≥ 500, a transport error, or an end before
  `response.completed`), with the same status code when the claim names one; an
  unconfirmed claim is probed (R9a) whatever the opt-in says, with gap
  `endpoint_claim_unconfirmed`;
- a timeout while the last call sent nothing for 60 s is the endpoint's (R5b), and so is a
  session whose last call the proxy ended at its deadline (`model_call_max_s`: an endpoint
  dripping bytes never goes silent);
- a reroute is believed only when a call's model differs from the one asked for;
- usage is the calls' sum (a non-2xx call counts zero, a 2xx call without
  `response.completed` makes it unknown), with gap `usage_mismatch` when Codex's native
  total differs.
Without the proxy v3 decides exactly as v2.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from trialledger.core.events import (
    DEADLINE,
    MAX_TOKENS,
    Event,
    Gap,
    ModelCall,
    ModelCallData,
    Usage,
    UsageNative,
)
from trialledger.core.policy import (
    COMPUTED,
    ENDPOINT_FROM_ERROR,
    ENDPOINT_UNREACHABLE,
    STATUS_CODE,
    V2_RULES,
    Facts,
    Policy,
    Rule,
    is_responses_call,
    register_built_in,
)
from trialledger.core.usage import PARTIAL, ZERO, recover_usage

HUNG_S = 60.0
CLAIMED_KINDS = frozenset({"model_endpoint", "quota"})
UPSTREAM_FAILURES = frozenset({408, 429})


def _seconds(at: str) -> float:
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def failed_upstream(call: ModelCallData) -> bool:
    """Whether the proxy saw the endpoint fail this call (`client_closed` is Codex's)."""
    if call.http_status is not None and (call.http_status in UPSTREAM_FAILURES
                                         or call.http_status >= 500):
        return True
    if call.error is not None:
        return call.error != "client_closed"
    return call.http_status is not None and 200 <= call.http_status < 300 and not call.completed


def confirmed(facts: Facts, claim: str | None) -> bool:
    """Whether the last responses call backs an endpoint claim (its status code too)."""
    if not facts.calls:
        return False
    last = facts.calls[-1]
    if not failed_upstream(last):
        return False
    named = STATUS_CODE.search(claim or "")
    return named is None or last.http_status == int(named.group(1))


def hung(facts: Facts) -> bool:
    """The last call was still open at the end and had sent nothing for 60 s."""
    if not facts.calls:
        return False
    last = facts.calls[-1]
    if last.error != "client_closed" or last.completed or last.ended_at is None:
        return False
    quiet_since = last.last_byte_at or last.started_at
    return _seconds(last.ended_at) - _seconds(quiet_since) >= HUNG_S


def past_deadline(facts: Facts) -> bool:
    """The last call was ended by the proxy at its deadline: the endpoint never finished
    it, however often it sent a byte."""
    return bool(facts.calls) and facts.calls[-1].error == DEADLINE


def unconfirmed_claim(facts: Facts) -> str | None:
    """The endpoint claim v3 does not believe (None: none, or it is confirmed)."""
    if not facts.model_proxy or facts.ending_kind not in CLAIMED_KINDS:
        return None
    return None if confirmed(facts, facts.ending_error) else facts.ending_error


def rerouted_by_proxy(facts: Facts) -> str | None:
    """A call answered by another model than the one asked for (the proxy's word)."""
    for call in facts.calls:
        if call.model and facts.asked_model and call.model != facts.asked_model:
            return f"model rerouted: asked for {facts.asked_model}, answered by {call.model}"
    return None


def _rerouted(facts: Facts) -> bool:
    return (rerouted_by_proxy(facts) if facts.model_proxy else facts.rerouted) is not None


def _reroute_error(facts: Facts) -> str | None:
    return rerouted_by_proxy(facts) if facts.model_proxy else facts.rerouted


def _endpoint_unreachable(facts: Facts) -> bool:
    if facts.model_proxy and past_deadline(facts):  # as a timeout with the call open
        return True
    if not facts.timed_out:
        return False
    if not facts.model_proxy:
        return facts.reconnecting is not None
    return (facts.reconnecting is not None and confirmed(facts, facts.reconnecting)) \
        or hung(facts)


def _unreachable_error(facts: Facts) -> str | None:
    if facts.reconnecting is not None and (not facts.model_proxy
                                           or confirmed(facts, facts.reconnecting)):
        return facts.reconnecting
    if past_deadline(facts):
        return (f"the model endpoint did not complete call {facts.calls[-1].call} before "
                f"the proxy's deadline (model_call_max_s)")
    return f"the model endpoint sent nothing for {HUNG_S:g} s before the timeout"


CLAIM_UNCONFIRMED = Rule(name="probe", when=lambda f: unconfirmed_claim(f) is not None,
                         action="probe", http_status=None, status="failed", cause="agent_error",
                         reward_valid=True, error=lambda f: f.error)


def _v3_rules() -> tuple[Rule, ...]:
    rows: list[Rule] = []
    for rule in V2_RULES:
        if rule.name == "rerouted":
            rows.append(replace(rule, when=_rerouted, error=_reroute_error))
        elif rule.name == ENDPOINT_UNREACHABLE.name:
            rows.append(replace(rule, when=_endpoint_unreachable, error=_unreachable_error,
                                cause=ENDPOINT_FROM_ERROR, status=COMPUTED))
        elif rule.name == "reported":
            rows += [CLAIM_UNCONFIRMED, rule]
        else:
            rows.append(rule)
    return tuple(rows)


def proxy_usage(events: Sequence[Event]) -> tuple[Usage | None, list[Gap]]:
    """§4 under v3: the sum of the responses calls' usages, when the proxy ran."""
    native = [e.data.total for e in events if isinstance(e, UsageNative)]
    calls = [e.data for e in events if isinstance(e, ModelCall) and is_responses_call(e.data)]
    if not any(getattr(e.data, "model_proxy", None) for e in events
               if e.type == "agent.launched"):
        return recover_usage(events)
    total: Usage | None = ZERO
    gaps: list[Gap] = []
    for call in calls:
        if call.http_status is None or not 200 <= call.http_status < 300:
            continue  # the endpoint billed nothing for a refusal
        if not call.completed or call.usage is None:
            total = None
            gaps.append(PARTIAL)
            break
        assert total is not None
        summed = {k: (getattr(total, k) or 0) + (getattr(call.usage, k) or 0)
                  for k in Usage.model_fields}
        if max(summed.values()) > MAX_TOKENS:  # no count a model reported (core.events)
            total = None
            gaps.append(PARTIAL)
            break
        total = Usage(**summed)
    if native and total is not None and native[-1].model_dump() != total.model_dump():
        detail = json.dumps({"native": native[-1].model_dump(), "proxy": total.model_dump()},
                            sort_keys=True, separators=(",", ":"))
        gaps.append(Gap(code="usage_mismatch", detail=detail))
    return total, gaps


def _claim_gaps(facts: Facts) -> list[Gap]:
    claim = unconfirmed_claim(facts)
    return [Gap(code="endpoint_claim_unconfirmed", detail=claim)] if claim else []


V3 = register_built_in(Policy(name="v3", rules=_v3_rules(), usage_of=proxy_usage,
                              gaps_of=_claim_gaps))
