"""The decision policy (SPEC §3) as data: markers, classification, rules and outcome table.

A policy reads the log into `Facts` once, then walks its rule table; the first row whose
`when` holds decides. A new version is a new `Policy` (other markers, rows or outcome
table) registered under a new name; the machine never changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from trialledger.core.errors import PolicyNameTaken, UnknownPolicy
from trialledger.core.events import (
    CODEX_STREAM_TYPES,
    ITEM_EVENTS,
    PROXY_REFUSALS,
    AgentExited,
    AgentLaunched,
    AgentStderr,
    Cause,
    CleanupReported,
    Decision,
    Event,
    Gap,
    ModelCall,
    ModelCallData,
    SandboxLost,
    SandboxProbed,
    SessionSeeded,
    StreamError,
    TurnFailed,
    Usage,
)
from trialledger.core.redact import redact
from trialledger.core.usage import ZERO, recover_usage

Action = Literal["verify", "retry", "probe"]
Status = Literal["completed", "incomplete", "failed"]
STREAM_TYPES = CODEX_STREAM_TYPES - {"codex.unknown"}  # SPEC §2.2's types
# Agents that run a script instead of a model (SPEC §15): only R1, R2 and R0 decide them.
SCRIPTED_AGENTS = frozenset({"oracle", "nop"})


def is_responses_call(call: ModelCallData) -> bool:
    """A `POST …/responses` model call that reached the endpoint: the ones v3 weighs (SPEC
    §14); one the proxy refused itself is no evidence about the endpoint."""
    return call.error not in PROXY_REFUSALS and call.method.upper() == "POST" \
        and call.path.split("?", 1)[0].rstrip("/").endswith("/responses")

# Markers of a row: a token (not a value) says "take it from the facts or the outcome table".
COMPUTED: Literal["computed"] = "computed"  # status: as computed from the run
TIMED_OUT_OR_FAILED: Literal["timed_out_or_failed"] = "timed_out_or_failed"
CLASSIFIED: Literal["classified"] = "classified"  # cause: the classified ending error
BY_TABLE: Literal["by_table"] = "by_table"  # action / reward_valid: the outcome table
ENDPOINT_FROM_ERROR: Literal["endpoint_from_error"] = "endpoint_from_error"  # cause: the
# model endpoint, with the status code parsed from the rule's error
BY_EXIT: Literal["by_exit"] = "by_exit"  # status: from the exit alone (R0, a scripted agent)


@dataclass(frozen=True)
class Facts:
    """What the policy reads from a log, computed once per decision (SPEC §3 "Inputs")."""

    verify_after_agent_error: bool
    fatal_errors: tuple[str, ...]
    warnings: tuple[str, ...]
    rerouted: str | None
    turn_started: bool
    last_turn: str | None
    timed_out: bool
    return_code: int | None
    output_limited: bool
    error: str | None
    status: Status
    ending_error: str | None
    ending_kind: str
    lost: str | None
    cleanup: CleanupReported | None
    probe: SandboxProbed | None
    stderr_tail: str | None
    reconnecting: str | None  # the Reconnecting... message the run was in when it ended
    # §14: what the session's model proxy saw (empty / False without one)
    model_proxy: bool = False
    calls: tuple[ModelCallData, ...] = ()  # POST …/responses calls, by `call`
    asked_model: str | None = None
    agent_name: str | None = None  # the seed's `agent.name` (§15: oracle and nop are R0's)

    @property
    def scripted(self) -> bool:
        """Whether the agent ran a script, not a model (SPEC §15's oracle or nop)."""
        return self.agent_name in SCRIPTED_AGENTS

    @property
    def exit_status(self) -> Status:
        """R0's status: from the exit alone (no Codex stream to read)."""
        if self.timed_out:
            return "incomplete"
        return "completed" if self.return_code == 0 else "failed"


def _matcher(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(patterns), re.IGNORECASE)


def contains(*texts: str) -> re.Pattern[str]:
    """A classification marker: any of these texts, anywhere, any case."""
    return _matcher(*(re.escape(t) for t in texts))


def starts_with(text: str) -> re.Pattern[str]:
    """A classification marker: the message starts with this text, any case."""
    return _matcher("^" + re.escape(text))


STATUS_CODE = re.compile(r"(?:last status:|unexpected status)\s*(\d{3})", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the rule table (docs/SPEC.md §3 "Rules"), every field named."""

    name: str
    when: Callable[[Facts], bool]
    action: Action | Literal["by_table"]
    http_status: int | None
    status: Status | Literal["computed", "timed_out_or_failed", "by_exit"]
    cause: str | None  # a fixed kind, CLASSIFIED, ENDPOINT_FROM_ERROR, or None
    reward_valid: bool | Literal["by_table"]
    error: Callable[[Facts], str | None] = lambda facts: facts.error
    known_zero_usage: bool = False  # the run reached no model: usage is zero, not recovered


def _cleanup_error(facts: Facts) -> str:
    report = facts.cleanup
    detail = report.data.error if report is not None else None
    return "cleanup unconfirmed" + (f": {detail}" if detail else "")


def _startup_error(facts: Facts) -> str:
    base = facts.error or "Codex started no turn"
    return f"{base}: {facts.stderr_tail}" if facts.stderr_tail is not None else base


SANDBOX_LOST = Rule(name="sandbox_lost", when=lambda f: f.lost is not None, action="retry",
                    http_status=502, status="failed", cause="sandbox_lost", reward_valid=False,
                    error=lambda f: f"sandbox lost: {f.lost}")
CLEANUP_UNCONFIRMED = Rule(name="cleanup_unconfirmed",
                           when=lambda f: f.cleanup is not None and not f.cleanup.data.confirmed,
                           action="retry", http_status=502, status="failed",
                           cause="cleanup_unconfirmed", reward_valid=False, error=_cleanup_error)
ENDPOINT_KINDS = frozenset({"model_endpoint", "quota", "model_rerouted"})

V1_RULES: tuple[Rule, ...] = (
    SANDBOX_LOST,
    CLEANUP_UNCONFIRMED,
    Rule(name="rerouted", when=lambda f: f.rerouted is not None, action="retry", http_status=502,
         status=COMPUTED, cause="model_rerouted", reward_valid=False, error=lambda f: f.rerouted),
    Rule(name="startup_failed", when=lambda f: not f.turn_started, action="retry",
         http_status=502, status=COMPUTED, cause="startup_failed", reward_valid=False,
         error=_startup_error),
    Rule(name="completed", when=lambda f: f.status == "completed", action="verify",
         http_status=200, status=COMPUTED, cause=None, reward_valid=True),
    Rule(name="incomplete", when=lambda f: f.status == "incomplete", action="verify",
         http_status=200, status=COMPUTED, cause=None, reward_valid=True),
    Rule(name="reported",
         when=lambda f: f.return_code == 1 and not f.timed_out and f.last_turn == "turn.failed",
         action=BY_TABLE, http_status=200, status="failed", cause=CLASSIFIED,
         reward_valid=BY_TABLE),
    Rule(name="endpoint_killed", when=lambda f: f.ending_kind in ENDPOINT_KINDS, action="retry",
         http_status=502, status="failed", cause=CLASSIFIED, reward_valid=False),
    Rule(name="probe", when=lambda f: f.verify_after_agent_error, action="probe",
         http_status=None, status="failed", cause=None, reward_valid=True),
    Rule(name="execution_error", when=lambda f: True, action="retry", http_status=502,
         status="failed", cause=CLASSIFIED, reward_valid=False),
)
# v2 (SPEC §3): a run that timed out while Codex was reconnecting never heard from the model
# again, so the timeout is the endpoint's: retry, before R6 grades it as incomplete.
ENDPOINT_UNREACHABLE = Rule(name="endpoint_unreachable",
                            when=lambda f: f.timed_out and f.reconnecting is not None,
                            action="retry", http_status=502, status=COMPUTED,
                            cause=ENDPOINT_FROM_ERROR, reward_valid=False,
                            error=lambda f: f.reconnecting)
V2_RULES: tuple[Rule, ...] = tuple(
    row for rule in V1_RULES
    for row in ((ENDPOINT_UNREACHABLE, rule) if rule.name == "incomplete" else (rule,))
)


def _scripted_error(facts: Facts) -> str | None:
    if facts.exit_status != "failed":
        return None
    if facts.return_code is None:
        return f"{facts.agent_name} exit status unknown"
    return f"{facts.agent_name} exited with code {facts.return_code}"


# R0 (SPEC §15): an oracle's or nop's run is graded whatever it returned, as Harbor grades
# it; only a lost sandbox or unconfirmed cleanup (R1, R2) keep it out of the scores.
SCRIPTED_AGENT = Rule(name="scripted_agent", when=lambda f: True, action="verify",
                      http_status=200, status=BY_EXIT, cause=None, reward_valid=True,
                      error=_scripted_error, known_zero_usage=True)
SCRIPTED_RULES: tuple[Rule, ...] = (SANDBOX_LOST, CLEANUP_UNCONFIRMED, SCRIPTED_AGENT)
V1_AFTER_PROBE: tuple[Rule, ...] = (
    SANDBOX_LOST,
    CLEANUP_UNCONFIRMED,
    Rule(name="probed", when=lambda f: f.probe is not None and f.probe.data.alive,
         action="verify", http_status=200, status=TIMED_OUT_OR_FAILED, cause=None,
         reward_valid=True),
    Rule(name="probed", when=lambda f: True, action="retry", http_status=502, status="failed",
         cause="sandbox_unresponsive", reward_valid=False),
)
V1_CLASSIFICATION: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_rerouted", starts_with("model rerouted:")),
    ("context_window", contains("ran out of room in the model's context window")),
    ("quota", contains("quota exceeded", "usage limit")),
    ("model_request", _matcher(r"unexpected status 4(?!08|29)\d\d")),
    ("model_endpoint", contains(
        "exceeded retry limit", "429", "too many requests", "rate limit",
        "unexpected status 408", "unexpected status 5", "internal server error",
        "bad gateway", "service unavailable", "gateway timeout",
        "currently experiencing high demand", "selected model is at capacity",
        "request timed out", "connection timed out", "timeout waiting for child process to exit",
        "stream disconnected before completion", "idle timeout waiting for sse",
        "connection failed", "error while reading the server response",
    )),
)
V1_OUTCOME_TABLE: Mapping[str, tuple[Action, bool]] = {
    "context_window": ("verify", True),
    "model_request": ("verify", False),
}
V1_WARNING_GAPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_metadata_fallback", re.compile(
        r"Model metadata for `.*` not found\. Defaulting to fallback metadata; "
        r"this can degrade performance and cause issues\.", re.DOTALL)),
    ("compaction_accuracy_advisory", re.compile(re.escape(
        "Heads up: Long threads and multiple compactions can cause the model to be less "
        "accurate. Start a new thread when possible to keep threads small and targeted."))),
)


@dataclass(frozen=True)
class Policy:
    """A named, versioned decision policy."""

    name: str
    rules: tuple[Rule, ...] = V1_RULES
    rules_after_probe: tuple[Rule, ...] = V1_AFTER_PROBE
    scripted_rules: tuple[Rule, ...] = SCRIPTED_RULES  # an oracle or nop session's (§15)
    classification: tuple[tuple[str, re.Pattern[str]], ...] = V1_CLASSIFICATION
    outcome_table: Mapping[str, tuple[Action, bool]] = field(
        default_factory=lambda: dict(V1_OUTCOME_TABLE)
    )
    outcome_default: tuple[Action, bool] = ("retry", False)
    warning_markers: tuple[tuple[str, re.Pattern[str]], ...] = V1_WARNING_GAPS
    fallback_warning_gap: str = "agent_warning"
    reconnect_prefix: str = "Reconnecting..."
    rerouted_prefix: str = "model rerouted:"
    output_limit_error: str = (
        "stream disconnected before completion: Incomplete response returned, "
        "reason: max_output_tokens"
    )
    usage_of: Callable[[Sequence[Event]], tuple[Usage | None, list[Gap]]] = recover_usage
    gaps_of: Callable[[Facts], list[Gap]] = lambda facts: []  # gaps only this version derives

    # --- inputs ----------------------------------------------------------------------------

    def classify(self, message: str | None) -> str:
        """The kind of an error message: the first classification row that matches."""
        for kind, marker in self.classification:
            if message and marker.search(message):
                return kind
        return "agent_error"

    def is_rerouted(self, warning: str) -> bool:
        """Whether an item-level warning says the output came from another model."""
        return warning.lower().startswith(self.rerouted_prefix.lower())

    def facts(self, events: Sequence[Event]) -> Facts:
        """Read the policy's inputs from a log."""
        fatal: list[str] = []
        last_turn_failed = last_fatal_stream = None
        warnings: dict[object, str] = {}
        turn_started = turn_completed = False
        last_turn = None
        exited = cleanup = lost = probe = stderr = None
        verify_after_error = False
        model_proxy = False
        asked_model = agent_name = None
        calls: list[ModelCallData] = []
        last_stream: Event | None = None  # the last Codex stream event before agent.exited
        for event in events:
            if exited is None and event.type in STREAM_TYPES:
                last_stream = event
            if isinstance(event, ITEM_EVENTS):  # first: most of a long log
                item = event.data.item
                if item.get("type") == "error":  # keyed by its id, which may be any JSON
                    item_id = item.get("id", len(warnings))
                    key = item_id if isinstance(item_id, Hashable) else repr(item_id)
                    warnings[key] = str(item.get("message", ""))
            elif isinstance(event, TurnFailed):
                message = str((event.data.error or {}).get("message") or "turn failed")
                last_turn_failed = message
                if not fatal or fatal[-1] != message:
                    fatal.append(message)
            elif isinstance(event, StreamError):
                message = event.data.message
                if not message.startswith(self.reconnect_prefix):
                    last_fatal_stream = message
                    if not fatal or fatal[-1] != message:
                        fatal.append(message)
            elif isinstance(event, AgentExited):
                exited = event
            elif isinstance(event, CleanupReported):
                cleanup = event
            elif isinstance(event, SandboxLost):
                lost = event
            elif isinstance(event, SandboxProbed):
                probe = event
            elif isinstance(event, AgentStderr):
                stderr = event
            elif isinstance(event, SessionSeeded):
                verify_after_error = event.data.settings.verify_after_agent_error
                asked_model = event.data.model
                agent_name = event.data.agent.name
            elif isinstance(event, AgentLaunched):
                model_proxy = bool(event.data.model_proxy)
            elif isinstance(event, ModelCall) and is_responses_call(event.data):
                calls.append(event.data)
            if event.type in ("turn.started", "turn.completed", "turn.failed"):
                last_turn = event.type
                turn_started = turn_started or event.type == "turn.started"
                turn_completed = turn_completed or event.type == "turn.completed"
        timed_out = exited.data.timed_out if exited else False
        return_code = exited.data.return_code if exited else None
        output_limited = bool(fatal) and all(m == self.output_limit_error for m in fatal)
        error: str | None
        if output_limited:
            error = None
        elif fatal:
            error = "; ".join(fatal)
        elif timed_out:
            error = None
        elif return_code is None:
            error = "Codex exit status unknown"
        elif return_code != 0:
            error = f"Codex exited with code {return_code}"
        elif not turn_completed:
            error = "Codex ended without turn.completed"
        else:
            error = None
        status: Status = (
            "failed" if error else "incomplete" if timed_out or output_limited else "completed"
        )
        ending_error = last_turn_failed or last_fatal_stream or error
        reconnecting = (last_stream.data.message if isinstance(last_stream, StreamError)
                        and last_stream.data.message.startswith(self.reconnect_prefix) else None)
        warning_list = tuple(warnings.values())
        return Facts(
            verify_after_agent_error=verify_after_error,
            fatal_errors=tuple(fatal),
            warnings=warning_list,
            rerouted=next((w for w in warning_list if self.is_rerouted(w)), None),
            turn_started=turn_started,
            last_turn=last_turn,
            timed_out=timed_out,
            return_code=return_code,
            output_limited=output_limited,
            error=error,
            status=status,
            ending_error=ending_error,
            ending_kind=self.classify(ending_error),
            lost=lost.data.detail if lost else None,
            cleanup=cleanup,
            probe=probe,
            stderr_tail=stderr.data.tail if stderr else None,
            reconnecting=reconnecting,
            model_proxy=model_proxy,
            calls=tuple(sorted(calls, key=lambda c: c.call)),
            asked_model=asked_model,
            agent_name=agent_name,
        )

    # --- the decision ----------------------------------------------------------------------

    def decide(self, events: Sequence[Event], *, after_probe: bool = False) -> Decision:
        """The decision for a log whose evidence is complete (or just probed)."""
        facts = self.facts(events)
        table = (self.scripted_rules if facts.scripted
                 else self.rules_after_probe if after_probe else self.rules)
        rule = next(r for r in table if r.when(facts))
        error = rule.error(facts)
        error = redact(error, ()) if error is not None else None
        kind = facts.ending_kind
        action, reward_valid = rule.action, rule.reward_valid
        if action == BY_TABLE or reward_valid == BY_TABLE:
            table_action, table_valid = self.outcome_table.get(kind, self.outcome_default)
            action = table_action if action == BY_TABLE else action
            reward_valid = table_valid if reward_valid == BY_TABLE else reward_valid
        status: Status
        if rule.status == COMPUTED:
            status = facts.status
        elif rule.status == TIMED_OUT_OR_FAILED:
            status = "incomplete" if facts.timed_out else "failed"
        elif rule.status == BY_EXIT:
            status = facts.exit_status
        else:
            status = rule.status
        usage = ZERO if rule.known_zero_usage else self.usage_of(events)[0]
        return Decision(
            policy=self.name,
            rule=rule.name,
            action=action,
            status=status,
            http_status=rule.http_status,
            error=error,
            cause=self._cause(rule, facts, error),
            incomplete_reason=(
                "max_output_tokens" if facts.output_limited and not facts.scripted
                else "timeout" if facts.timed_out else None
            ),
            reward_valid=bool(reward_valid),
            usage=usage,
        )

    def _cause(self, rule: Rule, facts: Facts, error: str | None) -> Cause | None:
        if rule.cause is None:
            return None
        if rule.cause in (CLASSIFIED, ENDPOINT_FROM_ERROR):
            message = error
            kind = "model_endpoint"
            if rule.cause == CLASSIFIED:
                message = redact(facts.ending_error, ()) if facts.ending_error else None
                kind = facts.ending_kind
            found = STATUS_CODE.search(message or "")
            return Cause(kind=kind, status_code=int(found.group(1)) if found else None,
                         message=message)
        return Cause(kind=rule.cause, status_code=None, message=error)

    def warning_gaps(self, facts: Facts) -> list[Gap]:
        """The gaps item-level warnings give (rerouted warnings decide instead)."""
        gaps = []
        for message in facts.warnings:
            if self.is_rerouted(message):
                continue
            code = next(
                (c for c, marker in self.warning_markers if marker.fullmatch(message)),
                self.fallback_warning_gap,
            )
            gaps.append(Gap(code=code, detail=message))
        return gaps


V1 = Policy(name="v1")
V2 = Policy(name="v2", rules=V2_RULES)
BUILT_IN = frozenset({"v1", "v2", "v3"})
POLICIES: dict[str, Policy] = {V1.name: V1, V2.name: V2}
DEFAULT_POLICY = V2.name  # for sessions seeded without one (SPEC §3 "Which policy")


def register_built_in(policy: Policy) -> Policy:
    """Register one of the built-in versions (only this module family does)."""
    POLICIES[policy.name] = policy
    return policy


def register_policy(policy: Policy) -> Policy:
    """Make a policy version available to `replay(..., policy=name)` and the CLI (a
    built-in name is refused: a recorded decision must always mean what it meant)."""
    if policy.name in BUILT_IN:
        raise PolicyNameTaken(f"policy name {policy.name!r} is built in; choose another name")
    POLICIES[policy.name] = policy
    return policy


def get_policy(policy: str | Policy) -> Policy:
    """A registered policy by name (a `Policy` passes through)."""
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise UnknownPolicy(policy, POLICIES) from None
