"""`import-harbor`'s comparison (docs/SPEC.md §10): each Harbor trial's verdict, reward
and tokens beside ours, and how many agree."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trialledger.adapters.console.render import out, print_json, table


def print_agreements(agreements: Sequence[Any], *, as_json: bool) -> None:
    """One row per imported trial, then how many agree with Harbor's verdict and how many
    an earlier import already had (`as_json`: the list as JSON)."""
    if as_json:
        print_json([a.as_json() for a in agreements])
        return
    disagreeing = sum(not a.agrees for a in agreements)
    table(["trial", "session", "harbor → verdict, reward", "ours: rule → action, reward",
           "agree", "tokens in/cached/out", "why"], [
        (a.trial, a.session_id,
         f"{a.harbor_exception or '-'} → {a.harbor_verdict}, {rewards_text(a.harbor_rewards)}",
         f"{a.our_rule} → {a.our_action}, {rewards_text(a.our_rewards)}",
         "yes" if a.agrees else "NO", tokens_text(a), a.explanation)
        for a in agreements])
    unchanged = sum(a.status == "unchanged" for a in agreements)
    out.print(f"{len(agreements)} trials imported; {len(agreements) - disagreeing} agree with "
              f"Harbor's verdict" + (f"; {unchanged} unchanged since an earlier import"
                                     if unchanged else ""))


def rewards_text(rewards: Mapping[str, Any] | None) -> str:
    """`reward 1, extra 0.5`, or `-` for none."""
    return ", ".join(f"{name} {value}" for name, value in rewards.items()) if rewards else "-"


def tokens_text(agreement: Any) -> str:
    """Harbor's counts and ours, or one figure when they agree."""
    def said(tokens: Mapping[str, int | None] | None) -> str:
        if tokens is None:
            return "unknown"
        return "/".join("?" if tokens[k] is None else str(tokens[k])
                        for k in ("input", "cached", "output"))
    if agreement.tokens_agree:
        return f"{said(agreement.our_tokens)} (same)"
    return f"Harbor {said(agreement.harbor_tokens)}, ours {said(agreement.our_tokens)}"
