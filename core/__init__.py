"""trialledger's domain: events, the session machine, the policy, usage, observations, redaction.

Pure functions and pydantic models; no I/O. What this package exports is the public
contract (SPEC §10; docs/library.md, "The public names", lists it and a test keeps the two
equal): replay and explain, redaction, registering a policy, the types a view holds and
the errors replay raises. Everything else is importable by its module path
(`trialledger.core.events`, `.parsing`, `.machine`, …) and may change:

    from trialledger.core import replay, redact, scrub
"""

# v3 registers itself as its module loads (built in, so every use of core loads it).
from trialledger.core import policy_v3  # noqa: F401
from trialledger.core.errors import (
    BadEvent,
    IllegalTransition,
    PolicyNameTaken,
    SeedRejected,
    TrialLedgerError,
    UnknownPolicy,
)
from trialledger.core.events import Cause, Decision, Event, Gap, Usage
from trialledger.core.observations import Invocation, Message, Observations, ToolCall
from trialledger.core.policy import Policy, register_policy
from trialledger.core.redact import redact, scrub
from trialledger.core.replay import Divergence, SessionView, explain, replay

__all__ = [
    "BadEvent",
    "Cause",
    "Decision",
    "Divergence",
    "Event",
    "Gap",
    "IllegalTransition",
    "Invocation",
    "Message",
    "Observations",
    "Policy",
    "PolicyNameTaken",
    "SeedRejected",
    "SessionView",
    "ToolCall",
    "TrialLedgerError",
    "UnknownPolicy",
    "Usage",
    "explain",
    "redact",
    "register_policy",
    "replay",
    "scrub",
]
