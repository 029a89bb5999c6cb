"""Every event of a session (SPEC §2): one immutable pydantic model per type, one union.

The JSONL form of an event is `{"type", "at", "data"}` plus the optional `session_id`,
`seq`, `event_id` and `schema`. `data` of a Codex stream event is Codex's own object
without its `type`, kept whole (unknown fields included); our own event types forbid
unknown fields so a typo is an error, not silently dropped evidence. Reading them from
JSONL (and upcasting an older schema) is core/parsing.py's.

Over 500 lines on purpose: the schema is one idea, and every type, its data fields and its
limits read together here (docs/SPEC.md §2 lists them in the same order).
"""

from __future__ import annotations

import re
from datetime import date
from typing import Annotated, Any, Literal, TypeAlias, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from trialledger.core.redact import REDACTED, fingerprint
from trialledger.core.settings import Settings

Model = TypeVar("Model", bound=BaseModel)

# ASCII digits (`\d` also takes other scripts' digits, which no date parser reads), each
# field in its range; a day past the 28th is checked against its month and year.
_RFC3339_UTC = re.compile(r"(?!0000)[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
                          r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|\+00:00)")


def _utc_timestamp(value: str) -> str:
    """A real instant, so that every reader of an event's times (the policies, `show`,
    the view, SQL) can read it back as one."""
    if not _RFC3339_UTC.fullmatch(value) or (value[8:10] > "28" and not _is_day(value[:10])):
        raise ValueError(f"{value!r} is not an RFC 3339 UTC timestamp (like 2026-01-31T12:00:00Z)")
    return value


def _is_day(text: str) -> bool:
    try:
        date.fromisoformat(text)
    except ValueError:
        return False
    return True


def built(cls: type[Model], fields: dict[str, Any]) -> Model:
    """An instance of `cls` (no extra fields, no private attributes) holding `fields`, every
    field of it, each made by the caller as its type says: not validated again. For what
    core derives by the thousand; `model_construct` costs twice what validation does."""
    model = cls.__new__(cls)
    object.__setattr__(model, "__dict__", fields)
    object.__setattr__(model, "__pydantic_fields_set__", set(fields))
    object.__setattr__(model, "__pydantic_extra__", None)
    object.__setattr__(model, "__pydantic_private__", None)
    return model


Timestamp = Annotated[str, AfterValidator(_utc_timestamp)]
Count = Annotated[int, Field(ge=0)]
# A token count above a trillion is no count a model reported: the readers of what the
# sandbox wrote take it as unknown and an event may not hold it, so that the sums SQL makes
# over a job's sessions stay within 64 bits.
MAX_TOKENS = 10**12
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
FiniteNumber = Annotated[float, Field(allow_inf_nan=False)]


class _Data(BaseModel):
    """Data of one of our own event types: immutable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class _CodexData(BaseModel):
    """Data of a Codex stream event: Codex's object without `type`, every field kept."""

    model_config = ConfigDict(frozen=True, extra="allow")


# --- values shared by several events ------------------------------------------------------


class Usage(_Data):
    """Token usage of a run (SPEC §4); cached ⊂ input, reasoning ⊂ output; None = unavailable."""

    input_tokens: Tokens
    cached_input_tokens: Tokens | None
    output_tokens: Tokens
    reasoning_output_tokens: Tokens | None
    total_tokens: Tokens


class TokenCounts(_Data):
    """One native usage record from Codex's rollout (all five figures known)."""

    input_tokens: Tokens
    cached_input_tokens: Tokens
    output_tokens: Tokens
    reasoning_output_tokens: Tokens
    total_tokens: Tokens


class Cause(_Data):
    """Why a run failed, as the decision classified it."""

    kind: str
    status_code: int | None
    message: str | None


class Decision(_Data):
    """Data of `outcome.decided` (SPEC §2.4)."""

    policy: str
    rule: str
    action: Literal["verify", "retry", "probe"]
    status: Literal["completed", "incomplete", "failed"]
    http_status: int | None
    error: str | None
    cause: Cause | None
    incomplete_reason: Literal["max_output_tokens", "timeout"] | None
    reward_valid: bool
    usage: Usage | None


class AgentInfo(_Data):
    name: str
    version: str


class Grant(_Data):
    """A tool grant (SPEC §6). As a harness gives it, its header values are in clear and it
    has no fingerprints; as stored (`stored()`), each value is `[redacted]` and its
    fingerprint kept in `header_fingerprints`."""

    name: str
    kind: Literal["mcp", "direct_http"]
    required: bool = False
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    header_fingerprints: dict[str, str] = Field(default_factory=dict)

    def stored(self) -> Grant:
        """The grant as stored: values `[redacted]`, each with its fingerprint."""
        return Grant(
            name=self.name,
            kind=self.kind,
            required=self.required,
            url=self.url,
            headers=dict.fromkeys(self.headers, REDACTED),
            header_fingerprints={k: fingerprint(v) for k, v in self.headers.items()},
        )


# --- data of each event type ---------------------------------------------------------------


class StepInfo(_Data):
    """Which step of a multi-step task a session runs (SPEC §17): its `name`, its 1-based
    `index` and the task's `count` of steps."""

    name: Annotated[str, Field(min_length=1)]
    index: Annotated[int, Field(ge=1)]
    count: Annotated[int, Field(ge=1)]

    @model_validator(mode="after")
    def _within(self) -> StepInfo:
        if self.index > self.count:
            raise ValueError(f"step index {self.index} is past the count {self.count}")
        return self


class SessionSeededData(_Data):
    trial_id: Annotated[str, Field(min_length=1)]
    attempt: Annotated[int, Field(ge=1)]
    retry_of: str | None = None
    runner_id: str
    task: str
    instruction: str
    agent: AgentInfo
    model: str | None  # null for an agent that asks no model (SPEC §15's oracle and nop)
    settings: Settings = Field(default_factory=Settings)
    grants: list[Grant] = Field(default_factory=list)
    # Schema 2 (SPEC §17): the step of a multi-step task; absent from a schema-1 seed, and
    # from a one-step session's (which is still written as schema 1, byte for byte as
    # before), so it dumps as written.
    step: StepInfo | None = None

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        if dumped.get("step") is None:
            dumped.pop("step", None)
        return dumped

    @property
    def schema_version(self) -> int:
        """The schema this seed is written as: 2 with a step, else 1 (SPEC §17)."""
        return 2 if self.step is not None else 1


class AgentLaunchedData(_Data):
    argv: list[str]
    workdir: str
    env_keys: list[str]
    config_sha256: str
    oom_score_adj: int | None = None
    # external: an imported run; runc, crun (schema 5, SPEC §16): a range-mode container
    # started by that OCI runtime
    isolation: Literal["bwrap", "process-group", "external", "runc", "crun"]
    runner_id: str
    # Schema 2 (SPEC §12, §14); absent from a schema-1 event, which then dumps as written.
    environment: dict[str, Any] | None = None  # {kind: host|image|rootfs, ref, digest}
    limits: dict[str, Any] | None = None
    model_proxy: bool | None = None  # the session's model calls went through our proxy
    # Schema 3 (SPEC §15): {mode: range|single, user: "uid:gid" inside}; None when older.
    identity: dict[str, str] | None = None
    # Schema 4 (SPEC §8): {host, path} of the runner's evidence journal; None when older.
    journal: dict[str, str] | None = None

    @property
    def ran_in(self) -> dict[str, Any]:
        """The environment the agent ran in: a schema-1 event, written before task images,
        reads as the host (`{kind: host}`), while it dumps exactly as written."""
        return self.environment if self.environment is not None else {"kind": "host"}

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        for key in LATER_LAUNCH_FIELDS:
            if dumped.get(key) is None:
                dumped.pop(key, None)
        return dumped


# Fields added by schemas 2 to 4: absent from an older event, which dumps as written.
LATER_LAUNCH_FIELDS = ("environment", "limits", "model_proxy", "identity", "journal")


# What the proxy answers itself (SPEC §14): such a call never reached the endpoint, so it
# is never an upstream failure and never the call a claim is weighed against.
PROXY_REFUSALS = frozenset({"refused_path", "refused_size", "refused_concurrency"})
# A call the proxy ended because it was not completed `model_call_max_s` after its request
# was sent (schema 2 of `model.call`): the endpoint's failure, not the proxy's refusal.
DEADLINE = "deadline"


class ModelCallData(_Data):
    """One request Codex made through the session's model proxy (SPEC §14)."""

    call: Annotated[int, Field(ge=1)]
    method: str
    path: str
    started_at: Timestamp
    ended_at: Timestamp | None = None  # the event's `at`
    http_status: int | None = None
    error: str | None = None  # upstream transport error, `deadline`, `client_closed`, or
    # a refusal
    completed: bool = False  # the stream reached `response.completed`
    last_byte_at: Timestamp | None = None  # when the endpoint last sent anything
    response_id: str | None = None
    model: str | None = None
    usage: Usage | None = None
    output: list[str] = Field(default_factory=list)


class AgentStderrData(_Data):
    tail: str
    truncated: bool


class AgentExitedData(_Data):
    return_code: int | None
    timed_out: bool


class CleanupReportedData(_Data):
    confirmed: bool
    error: str | None = None


class SandboxLostData(_Data):
    detail: str


class SandboxProbedData(_Data):
    alive: bool
    detail: str | None = None


class GapRecordedData(_Data):
    code: Annotated[str, Field(min_length=1)]
    detail: str | None = None


Gap = GapRecordedData  # a gap, recorded or derived: what could not be captured, and why


class ArchiveCopiedData(_Data):
    files: Count
    bytes: Count


class ArchiveSkippedData(_Data):
    reason: Literal["timeout", "error", "no_source", "no_time"]
    detail: str | None = None


def _inside_path(value: str) -> str:
    parts = value.split("/")
    if not value or any(part in ("", ".", "..") for part in parts) or "\0" in value:
        raise ValueError(f"{value!r} is not a relative path inside the artifact folder")
    return value


class KeptFile(_Data):
    """A file kept in the session's artifact folder (SPEC §15): its path there, its size
    and the sha256 of its bytes as written (hex)."""

    path: Annotated[str, AfterValidator(_inside_path)]
    size: Count
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _distinct_paths(files: list[KeptFile]) -> list[KeptFile]:
    if len({f.path for f in files}) != len(files):
        raise ValueError("a path is listed twice")
    return files


class _VerifierOutput(_Data):
    """Schema 2 of the verification events: the verifier's stdout and stderr tails
    (redacted, at most 2,000 characters each); schema 3: the `files` kept. Each is absent
    from an older event, which reads as no tails and `files: []` in memory and dumps as
    written (so an old log re-derives byte for byte)."""

    stdout_tail: str | None = None
    stderr_tail: str | None = None
    files: Annotated[list[KeptFile], AfterValidator(_distinct_paths)] = Field(
        default_factory=list)

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        for key in ("stdout_tail", "stderr_tail"):
            if dumped.get(key) is None:
                dumped.pop(key, None)
        if "files" not in self.model_fields_set:  # written before schema 3
            dumped.pop("files", None)
        return dumped


class VerificationRecordedData(_VerifierOutput):
    rewards: dict[str, FiniteNumber]
    detail: str | None = None


class VerificationFailedData(_VerifierOutput):
    reason: Literal["timeout", "no_reward", "bad_reward", "error"]
    detail: str | None = None


class SessionClosedData(_Data):
    reason: Annotated[str, Field(min_length=1)]


class UsageNativeData(_Data):
    total: TokenCounts
    last: TokenCounts | None = None


class ThreadStartedData(_CodexData):
    thread_id: str | None = None


class TurnCompletedData(_CodexData):
    usage: dict[str, Any] | None = None


class TurnFailedData(_CodexData):
    error: dict[str, Any] | None = None


class ItemData(_CodexData):
    item: dict[str, Any]


class StreamErrorData(_CodexData):
    message: str = ""


class CodexUnknownData(_Data):
    line: str


# --- the envelope ---------------------------------------------------------------------------


class Envelope(BaseModel):
    """What every event carries: its `type` and `at`, and the optional `session_id`, `seq`,
    `event_id` and `schema` (its data's version)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        serialize_by_alias=True,
        validate_by_alias=True,
        validate_by_name=True,
    )

    type: str
    at: Timestamp
    session_id: str | None = None
    seq: Annotated[int, Field(ge=1)] | None = None
    event_id: str | None = None
    schema_: Annotated[int, Field(ge=1, alias="schema")] = 1


class SessionSeeded(Envelope):
    type: Literal["session.seeded"] = "session.seeded"
    data: SessionSeededData


class AgentLaunched(Envelope):
    type: Literal["agent.launched"] = "agent.launched"
    data: AgentLaunchedData


class AgentStderr(Envelope):
    type: Literal["agent.stderr"] = "agent.stderr"
    data: AgentStderrData


class ModelCall(Envelope):
    type: Literal["model.call"] = "model.call"
    data: ModelCallData


class AgentExited(Envelope):
    type: Literal["agent.exited"] = "agent.exited"
    data: AgentExitedData


class CleanupReported(Envelope):
    type: Literal["cleanup.reported"] = "cleanup.reported"
    data: CleanupReportedData


class SandboxLost(Envelope):
    type: Literal["sandbox.lost"] = "sandbox.lost"
    data: SandboxLostData


class SandboxProbed(Envelope):
    type: Literal["sandbox.probed"] = "sandbox.probed"
    data: SandboxProbedData


class GapRecorded(Envelope):
    type: Literal["gap.recorded"] = "gap.recorded"
    data: GapRecordedData


class ArchiveCopied(Envelope):
    type: Literal["archive.copied"] = "archive.copied"
    data: ArchiveCopiedData


class ArchiveSkipped(Envelope):
    type: Literal["archive.skipped"] = "archive.skipped"
    data: ArchiveSkippedData


class VerificationRecorded(Envelope):
    type: Literal["verification.recorded"] = "verification.recorded"
    data: VerificationRecordedData


class VerificationFailed(Envelope):
    type: Literal["verification.failed"] = "verification.failed"
    data: VerificationFailedData


class SessionClosed(Envelope):
    type: Literal["session.closed"] = "session.closed"
    data: SessionClosedData


class OutcomeDecided(Envelope):
    type: Literal["outcome.decided"] = "outcome.decided"
    data: Decision


class UsageNative(Envelope):
    type: Literal["usage.native"] = "usage.native"
    data: UsageNativeData


class ThreadStarted(Envelope):
    type: Literal["thread.started"] = "thread.started"
    data: ThreadStartedData


class TurnStarted(Envelope):
    type: Literal["turn.started"] = "turn.started"
    data: _CodexData = Field(default_factory=_CodexData)


class TurnCompleted(Envelope):
    type: Literal["turn.completed"] = "turn.completed"
    data: TurnCompletedData


class TurnFailed(Envelope):
    type: Literal["turn.failed"] = "turn.failed"
    data: TurnFailedData


class ItemStarted(Envelope):
    type: Literal["item.started"] = "item.started"
    data: ItemData


class ItemUpdated(Envelope):
    type: Literal["item.updated"] = "item.updated"
    data: ItemData


class ItemCompleted(Envelope):
    type: Literal["item.completed"] = "item.completed"
    data: ItemData


ITEM_EVENTS = (ItemStarted, ItemUpdated, ItemCompleted)  # for isinstance (a union is built per use)


class StreamError(Envelope):
    type: Literal["stream.error"] = "stream.error"
    data: StreamErrorData


class CodexUnknown(Envelope):
    type: Literal["codex.unknown"] = "codex.unknown"
    data: CodexUnknownData


Event: TypeAlias = Annotated[
    SessionSeeded
    | AgentLaunched
    | AgentStderr
    | ModelCall
    | AgentExited
    | CleanupReported
    | SandboxLost
    | SandboxProbed
    | GapRecorded
    | ArchiveCopied
    | ArchiveSkipped
    | VerificationRecorded
    | VerificationFailed
    | SessionClosed
    | OutcomeDecided
    | UsageNative
    | ThreadStarted
    | TurnStarted
    | TurnCompleted
    | TurnFailed
    | ItemStarted
    | ItemUpdated
    | ItemCompleted
    | StreamError
    | CodexUnknown,
    Field(discriminator="type"),
]

EVENT_TYPES: dict[str, type[Envelope]] = {
    cls.model_fields["type"].default: cls
    for cls in Envelope.__subclasses__()
}
CODEX_STREAM_TYPES = frozenset(
    {
        "thread.started",
        "turn.started",
        "turn.completed",
        "turn.failed",
        "item.started",
        "item.updated",
        "item.completed",
        "stream.error",
        "codex.unknown",
    }
)

# Each type's newest schema version, as this code writes it. A new version that only adds
# optional fields (as 2 of these did) needs no upcaster; one that changes a field registers
# an upcaster from the old version, so old logs keep folding. A version above this one was
# written by newer code: it is refused, never read as if it were ours (core/parsing.py).
SCHEMA_VERSION: dict[str, int] = {
    **dict.fromkeys(EVENT_TYPES, 1),
    "model.call": 2,  # 2: `last_byte_at`, and `error` may be `deadline` (older: neither)
    # 2: model_proxy, environment, limits; 3: identity; 4: journal; 5: isolation runc and
    # crun (values an older event never holds: it folds unchanged, no upcaster)
    "agent.launched": 5,
    "session.seeded": 2,  # 2: step (SPEC §17; a seed without one is still written as 1)
    "verification.recorded": 3,  # 2: stdout_tail, stderr_tail; 3: files
    "verification.failed": 3,
}
