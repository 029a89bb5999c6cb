"""Per-session settings (SPEC §5): every opt-in defaults off."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# The cap on each task file read whole (task.toml, instruction.md, the compose file) and
# on the verifier's reward file: past it a task is refused by name and a reward is
# `bad_reward` (SPEC §5), so no such file makes the runner hold it.
TASK_FILE_MAX_BYTES = 1024 * 1024
Retries = Annotated[int, Field(ge=0, le=100)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class Settings(BaseModel):
    """How one session runs; stored in `session.seeded`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    verify_after_agent_error: bool = False
    timeout_s: PositiveSeconds = 3600.0
    session_close_timeout_s: PositiveSeconds = 60.0
    verifier_timeout_s: PositiveSeconds = 600.0
    mcp_tool_timeout_s: PositiveSeconds | None = None
    # A model call not completed this long after its request was sent is ended by the
    # proxy (`error: deadline`, SPEC §14): a dripping endpoint never goes silent for R5b.
    model_call_max_s: PositiveSeconds = 900.0
    workdir: str = "/app"
    inherit_sandbox_environment: bool = False
    raise_oom_score_adj: bool = False
    request_max_retries: Retries | None = None
    stream_max_retries: Retries | None = None
    reasoning_effort: ReasoningEffort | None = None
    model_server_forwards_reasoning_effort: bool = False
    features: dict[str, bool] | None = None
    sandbox_logs_dir: str | None = None
    # What the verifier sees (SPEC §11): the agent's whole filesystem, or the pristine root
    # plus the agent's workdir (not possible with workdir /).
    verifier_root: Literal["agent", "pristine"] = "agent"
    # How long an image or rootfs session's sandbox lives (SPEC §15): one container for
    # every phase (`harbor`, the runner's default for them) or a sandbox per phase
    # (`strict`, the only one for host tasks). None: the runner chooses by environment.
    verifier_isolation: Literal["harbor", "strict"] | None = None
    # The decision policy of every decision of the session (SPEC §3 "Which policy"); the
    # store writes its default here when a seed names none.
    policy: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    # See TASK_FILE_MAX_BYTES; the runner loads a task with the value of the run or job.
    task_file_max_bytes: Annotated[int, Field(gt=0, le=1 << 30)] = TASK_FILE_MAX_BYTES

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.mcp_tool_timeout_s is not None and self.mcp_tool_timeout_s > self.timeout_s:
            raise ValueError(
                f"mcp_tool_timeout_s ({self.mcp_tool_timeout_s:g}) must not exceed "
                f"timeout_s ({self.timeout_s:g}): a tool call cannot outlive its run"
            )
        if self.reasoning_effort is not None and not self.model_server_forwards_reasoning_effort:
            raise ValueError(
                "reasoning_effort is set but model_server_forwards_reasoning_effort is false: "
                "check that the model server forwards it, then set "
                "model_server_forwards_reasoning_effort=true"
            )
        if self.verifier_root == "pristine" and self.workdir == "/":
            raise ValueError("verifier_root = pristine needs a workdir other than /: with "
                             "workdir / the agent's files are the whole root")
        if not (self.workdir.startswith("/") and ".." not in self.workdir.split("/")):
            raise ValueError(f"workdir {self.workdir!r} must be absolute and free of '..'")
        return self
