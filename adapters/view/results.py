"""Sessions' results (pass, fail, unscored) and reasons as the view's lists and grid show
them (docs/SPEC.md §10): `core.why` over the facts the store's projections hold — the
`sessions`, `outcomes` and `rewards` rows and the verification events — so a page of a
thousand sessions says what `show` says without folding one of them. Each page names
its sessions by a subquery (a job's, a trial's, a search's), never by a list of ids; three
queries in all (rewards, the verification events, the endings)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trialledger.adapters.view.store import rows
from trialledger.core import why
from trialledger.core.why import Ending, Failure
from trialledger.store import Ledger

# Scored (SPEC §13), and the headline reward (`reward`'s, else the first name's, 0 for
# none), as `core.why` says them, for the sessions filter.
SCORED_SQL = "(s.outcome = 'verify' AND COALESCE(o.reward_valid, 0) = 1)"
HEADLINE_SQL = ("COALESCE((SELECT r.value FROM rewards r WHERE r.session_id = s.session_id "
                "ORDER BY CASE WHEN r.name = 'reward' THEN 0 ELSE 1 END, r.name LIMIT 1), 0)")
RESULT_SQL = {"pass": f"({SCORED_SQL} AND {HEADLINE_SQL} >= 1)",
              "fail": f"({SCORED_SQL} AND {HEADLINE_SQL} < 1)",
              "unscored": f"(NOT {SCORED_SQL})"}

# Each query reads the sessions a `scope` (a SELECT of session ids) names.
_ENDINGS = ("SELECT s.session_id, s.state, s.outcome, s.close_reason, o.action, o.rule, "
            "o.status, o.cause_kind, o.cause_message, o.error, o.reward_valid FROM sessions s "
            "LEFT JOIN outcomes o ON o.session_id = s.session_id "
            "WHERE s.session_id IN ({scope})")
_REWARDS = "SELECT session_id, name, value FROM rewards WHERE session_id IN ({scope})"
# Failed verifications, and a recorded one whose rewards may be below a pass (its
# verifier's last line is said of a fail).
_VERIFIED = ("SELECT e.session_id, e.type, e.seq, e.data FROM events e "
             "WHERE e.type IN ('verification.failed', 'verification.recorded') "
             "AND e.session_id IN ({scope}) AND (e.type = 'verification.failed' "
             "OR EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = e.session_id "
             "AND r.value < 1) "
             "OR NOT EXISTS (SELECT 1 FROM rewards r WHERE r.session_id = e.session_id)) "
             "ORDER BY e.session_id, e.seq")


def _data(text: str) -> dict[str, Any]:
    """An event's data, from its canonical envelope's text."""
    data = json.loads(text).get("data")
    return data if isinstance(data, dict) else {}


async def endings(ledger: Ledger, scope: str, params: Mapping[str, Any] | None = None
                  ) -> dict[str, Ending]:
    """The `Ending` of each session `scope` names (a SELECT of session ids, with `params`),
    from the projections and its verification events."""
    params = dict(params or {})
    rewards: dict[str, dict[str, float]] = {}
    for r in await rows(ledger, _REWARDS.format(scope=scope), params):
        rewards.setdefault(r["session_id"], {})[r["name"]] = float(r["value"])
    failures: dict[str, list[Failure]] = {}
    said: dict[str, str | None] = {}
    for r in await rows(ledger, _VERIFIED.format(scope=scope), params):
        data = _data(r["data"])
        if r["type"] == "verification.failed":
            failures.setdefault(r["session_id"], []).append(
                Failure(int(r["seq"]), str(data.get("reason")), data.get("detail")))
        else:
            said[r["session_id"]] = why.last_line(data.get("stdout_tail")) or why.last_line(
                data.get("stderr_tail"))
    found = {}
    for r in await rows(ledger, _ENDINGS.format(scope=scope), params):
        session = r["session_id"]
        found[session] = Ending(
            outcome=r["outcome"], state=r["state"], action=r["action"], rule=r["rule"],
            status=r["status"], cause_kind=r["cause_kind"], cause_message=r["cause_message"],
            error=r["error"], reward_valid=bool(r["reward_valid"]),
            rewards=rewards.get(session, {} if r["outcome"] == "verify" else None),
            failures=failures.get(session, ()), closed=r["close_reason"],
            verifier_said=said.get(session))
    return found


def judged(e: Ending | None) -> dict[str, Any]:
    """What a row shows of an ending: its result, reason, label and headline reward."""
    if e is None:
        return {"result": None, "reason": "", "label": "", "reward": None}
    return {"result": why.result(e), "reason": why.reason(e), "label": why.label(e),
            "reward": why.headline(e.rewards) if why.scored(e) else None}
