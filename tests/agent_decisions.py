"""Every recorded log's decisions under every built-in policy, as a snapshot.

    python -m tests.agent_decisions > tests/golden/decisions-by-policy.json

R0 `scripted_agent` (docs/SPEC.md §15) was added to v1, v2 and v3 on the promise that no
recorded log changes decision: the snapshot was written by the code before R0, and
`tests/session/test_agents.py` re-derives it with the code now.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trialledger.core import replay
from trialledger.core.parsing import parse_jsonl

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "tests" / "golden" / "decisions-by-policy.json"
POLICIES = ("v1", "v2", "v3")


def recorded_logs() -> list[Path]:
    """The golden transcripts and the examples: every session log in the repository."""
    return [*sorted((REPO / "tests" / "golden").rglob("*.jsonl")),
            *sorted((REPO / "examples").glob("*.jsonl"))]


def decisions_by_policy() -> dict[str, Any]:
    """`<path>:<policy>` → the re-derived decisions, state, outcome and divergence."""
    found: dict[str, Any] = {}
    for path in recorded_logs():
        with path.open(encoding="utf-8") as lines:
            events = [obj for _, obj in parse_jsonl(lines)]
        for policy in POLICIES:
            view = replay(events, policy=policy)
            found[f"{path.relative_to(REPO)}:{policy}"] = {
                "decisions": [d.model_dump(mode="json") for d in view.decisions],
                "state": view.state, "outcome": view.outcome,
                "diverged_at": (view.diverged_at.model_dump(mode="json")
                                if view.diverged_at is not None else None)}
    return found


if __name__ == "__main__":
    print(json.dumps(decisions_by_policy(), sort_keys=True, indent=0))
