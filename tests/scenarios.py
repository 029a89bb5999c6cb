"""Session logs for every required case of SPEC §3, built from real Codex 0.171.0 lines.

The lines are copied from `shared/reference/codex-formats.md` (observed against a
scripted endpoint). `examples/*.jsonl` are these logs written out
(`python -m tests.scenarios examples`); a test keeps the two identical.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.adapters.codex.stream import parse_stream_line

METADATA = (
    '{"type":"item.completed","item":{"id":"item_0","type":"error","message":"Model metadata for '
    '`test-model` not found. Defaulting to fallback metadata; this can degrade performance and '
    'cause issues."}}'
)
THREAD = '{"type":"thread.started","thread_id":"01a2267b-4236-7150-ac29-c438e0ea4228"}'
TURN = '{"type":"turn.started"}'
CLEAN = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"hi there"}}',
    '{"type":"turn.completed","usage":{"input_tokens":12,"cached_input_tokens":2,'
    '"cache_write_input_tokens":0,"output_tokens":10,"reasoning_output_tokens":3}}',
]
HTTP_500 = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"error","message":"Reconnecting... 1/1 (We’re currently experiencing high demand, '
    'which may cause temporary errors.)"}',
    '{"type":"error","message":"We’re currently experiencing high demand, which may cause '
    'temporary errors."}',
    '{"type":"turn.failed","error":{"message":"We’re currently experiencing high demand, which '
    'may cause temporary errors."}}',
]
HTTP_429 = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"error","message":"exceeded retry limit, last status: 429 Too Many Requests"}',
    '{"type":"turn.failed","error":{"message":"exceeded retry limit, last status: 429 Too Many '
    'Requests"}}',
]
STREAM_CUT = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"hi there"}}',
    '{"type":"error","message":"Reconnecting... 1/1 (stream disconnected before completion: '
    'stream closed before response.completed)"}',
    '{"type":"item.completed","item":{"id":"item_2","type":"agent_message","text":"hi there"}}',
    '{"type":"error","message":"stream disconnected before completion: stream closed before '
    'response.completed"}',
    '{"type":"turn.failed","error":{"message":"stream disconnected before completion: stream '
    'closed before response.completed"}}',
]
CAPACITY = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"error","message":"Selected model is at capacity. Please try a different model."}',
    '{"type":"turn.failed","error":{"message":"Selected model is at capacity. Please try a '
    'different model."}}',
]
TOOL_CALL = [
    THREAD,
    METADATA,
    TURN,
    '{"type":"item.started","item":{"id":"item_1","type":"command_execution","command":'
    '"/bin/bash -lc \'echo hello-from-tool > out.txt; cat out.txt\'","aggregated_output":"",'
    '"exit_code":null,"status":"in_progress"}}',
    '{"type":"item.completed","item":{"id":"item_1","type":"command_execution","command":'
    '"/bin/bash -lc \'echo hello-from-tool > out.txt; cat out.txt\'","aggregated_output":'
    '"hello-from-tool\\n","exit_code":0,"status":"completed"}}',
    '{"type":"item.completed","item":{"id":"item_2","type":"agent_message","text":"done"}}',
    '{"type":"turn.completed","usage":{"input_tokens":20,"cached_input_tokens":0,'
    '"cache_write_input_tokens":0,"output_tokens":10,"reasoning_output_tokens":0}}',
]
MCP_STDERR = (
    "2026-11-29T08:46:00.089395Z ERROR codex_core::session: Failed to create session: required "
    "MCP servers failed to initialize: gym_tools: handshaking with MCP server failed: Send "
    "message error Transport [...] error: Client error: HTTP request failed\n"
    "Error: thread/start: thread/start failed: error creating thread: Fatal error: Failed to "
    "initialize session: required MCP servers failed to initialize: gym_tools: handshaking with "
    "MCP server failed: ...\n"
)
OUTPUT_LIMIT = (
    "stream disconnected before completion: Incomplete response returned, reason: "
    "max_output_tokens"
)
KILLED = -9


@dataclass
class LogBuilder:
    """Builds a session's JSONL events in runner order, one second apart."""

    verify_after_agent_error: bool = False
    instruction: str = "say hi"
    settings: dict[str, Any] = field(default_factory=dict)
    grants: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        settings = {"verify_after_agent_error": self.verify_after_agent_error, **self.settings}
        self.add("session.seeded", {
            "trial_id": "trial-1", "attempt": 1, "retry_of": None, "runner_id": "runner-a",
            "task": "hello-world", "instruction": self.instruction,
            "agent": {"name": "codex", "version": "0.171.0"}, "model": "test-model",
            "settings": settings, "grants": self.grants,
        })

    def add(self, kind: str, data: dict[str, Any]) -> LogBuilder:
        """Append one event."""
        second = len(self.events)
        at = f"2026-11-29T08:{second // 60:02d}:{second % 60:02d}Z"
        self.events.append({"type": kind, "at": at, "data": data})
        return self

    def launched(self) -> LogBuilder:
        """`agent.launched`, as the local sandbox records it."""
        return self.add("agent.launched", {
            "argv": ["codex", "exec", "--json"], "workdir": "/app", "env_keys": ["PATH", "HOME"],
            "config_sha256": "0" * 64, "oom_score_adj": None, "isolation": "bwrap",
            "runner_id": "runner-a",
        })

    def codex(self, lines: list[str]) -> LogBuilder:
        """Codex stdout lines, mapped as the stream adapter maps them."""
        for line in lines:
            record = parse_stream_line(line)
            self.add(record.type, record.data)
            if record.gap is not None:
                self.add("gap.recorded", record.gap)
        return self

    def finish(self, rc: int | None, *, timed_out: bool = False, confirmed: bool = True,
               stderr: str | None = None, error: str | None = None) -> LogBuilder:
        """stderr tail, `agent.exited` and `cleanup.reported` (the machine then decides)."""
        if stderr is not None:
            self.add("agent.stderr", {"tail": stderr, "truncated": False})
        self.add("agent.exited", {"return_code": rc, "timed_out": timed_out})
        return self.add("cleanup.reported", {"confirmed": confirmed, "error": error})

    def native(self, total: tuple[int, int, int], last: tuple[int, int, int] | None = None
               ) -> LogBuilder:
        """`usage.native` with (input, output, total) figures."""
        def counts(f: tuple[int, int, int]) -> dict[str, int]:
            return {"input_tokens": f[0], "cached_input_tokens": 0, "output_tokens": f[1],
                    "reasoning_output_tokens": 0, "total_tokens": f[2]}
        return self.add("usage.native", {"total": counts(total),
                                         "last": counts(last) if last else None})


def run(lines: list[str], rc: int | None, *, vaae: bool = False, **finish: Any) -> LogBuilder:
    """A launched run that printed `lines` and ended with `rc`."""
    return LogBuilder(verify_after_agent_error=vaae).launched().codex(lines).finish(rc, **finish)


def _recovered_then_killed() -> list[str]:
    return [THREAD, METADATA, TURN,
            '{"type":"error","message":"Reconnecting... 1/5 (request timed out)"}',
            '{"type":"item.completed","item":{"id":"item_1","type":"agent_message",'
            '"text":"working on it"}}']


def _error_line(message: str) -> list[str]:
    body = json.dumps(message)
    return [f'{{"type":"error","message":{body}}}',
            f'{{"type":"turn.failed","error":{{"message":{body}}}}}']


# name → (builder, expected: {rule, action, state, …})
SCENARIOS: dict[str, tuple[LogBuilder, dict[str, Any]]] = {
    "clean": (run(CLEAN, 0), {"rule": "completed", "action": "verify", "state": "graded"}),
    "tool_call": (run(TOOL_CALL, 0), {"rule": "completed", "action": "verify"}),
    "http_429": (run(HTTP_429, 1), {"rule": "reported", "action": "retry",
                                     "cause": "model_endpoint", "status_code": 429}),
    "http_500": (run(HTTP_500, 1), {"rule": "reported", "action": "retry",
                                     "cause": "model_endpoint"}),
    "stream_cut": (run(STREAM_CUT, 1), {"rule": "reported", "action": "retry",
                                         "cause": "model_endpoint"}),
    "capacity": (run(CAPACITY, 1), {"rule": "reported", "action": "retry",
                                     "cause": "model_endpoint"}),
    "http_429_killed": (run(HTTP_429, KILLED, vaae=True),
                        {"rule": "endpoint_killed", "action": "retry", "state": "lost"}),
    "http_500_killed": (run(HTTP_500, KILLED, vaae=True),
                        {"rule": "endpoint_killed", "action": "retry", "state": "lost"}),
    "stream_cut_killed": (run(STREAM_CUT, KILLED, vaae=True),
                          {"rule": "endpoint_killed", "action": "retry", "state": "lost"}),
    "capacity_killed": (run(CAPACITY, KILLED, vaae=True),
                        {"rule": "endpoint_killed", "action": "retry", "state": "lost"}),
    "recovered_then_killed_probe": (
        run(_recovered_then_killed(), KILLED, vaae=True).add(
            "sandbox.probed", {"alive": True, "detail": "true ran in the workdir"}),
        {"rule": "probed", "action": "verify", "state": "graded", "first_rule": "probe"}),
    "bad_request_killed": (
        run([THREAD, TURN, *_error_line("unexpected status 400 Bad Request: invalid tool")],
            KILLED, vaae=True),
        {"rule": "probe", "action": "probe", "state": "failed-live"}),
    "bad_request_killed_opt_out": (
        run([THREAD, TURN, *_error_line("unexpected status 400 Bad Request: invalid tool")],
            KILLED),
        {"rule": "execution_error", "action": "retry", "cause": "model_request",
         "status_code": 400}),
    "max_output_tokens": (
        run([THREAD, TURN, *_error_line(OUTPUT_LIMIT)], 1),
        {"rule": "incomplete", "action": "verify", "status": "incomplete",
         "incomplete_reason": "max_output_tokens"}),
    "timeout": (
        run([THREAD, TURN, TOOL_CALL[3]], -15, timed_out=True),
        {"rule": "incomplete", "action": "verify", "status": "incomplete",
         "incomplete_reason": "timeout"}),
    "timeout_before_turn": (
        run([THREAD], -15, timed_out=True),
        {"rule": "startup_failed", "action": "retry"}),
    "required_mcp_down": (
        run([], 1, stderr=MCP_STDERR),
        {"rule": "startup_failed", "action": "retry", "cause": "startup_failed"}),
    "cleanup_unconfirmed": (
        run(CLEAN, 0, confirmed=False, error="2 processes still running"),
        {"rule": "cleanup_unconfirmed", "action": "retry"}),
    "sandbox_lost": (
        LogBuilder().launched().codex([THREAD, TURN]).add(
            "sandbox.lost", {"detail": "container vanished"}),
        {"rule": "sandbox_lost", "action": "retry", "state": "lost"}),
    "rerouted": (
        run([THREAD, TURN, '{"type":"item.completed","item":{"id":"item_1","type":"error",'
             '"message":"model rerouted: gpt-5.4 -> gpt-5.4-mini (HighRiskCyberActivity)"}}',
             *CLEAN[3:]], 0),
        {"rule": "rerouted", "action": "retry", "cause": "model_rerouted"}),
    "unknown_warning": (
        run([THREAD, TURN, '{"type":"item.completed","item":{"id":"item_1","type":"error",'
             '"message":"config key foo is deprecated"}}', *CLEAN[3:]], 0),
        {"rule": "completed", "action": "verify", "gap": "agent_warning"}),
    "killed_opt_out": (
        run(_recovered_then_killed(), KILLED),
        {"rule": "execution_error", "action": "retry", "cause": "agent_error"}),
    "context_window_reported": (
        run([THREAD, TURN, *_error_line(
            "Codex ran out of room in the model's context window. Start a new thread or clear "
            "earlier history before retrying.")], 1),
        {"rule": "reported", "action": "verify", "cause": "context_window",
         "reward_valid": True}),
    "bad_request_reported": (
        run([THREAD, TURN, *_error_line("unexpected status 400 Bad Request: invalid tool")], 1),
        {"rule": "reported", "action": "verify", "cause": "model_request",
         "reward_valid": False}),
}

for _name, (_builder, _) in SCENARIOS.items():  # one trial per case, so session ids differ
    _builder.events[0]["data"]["trial_id"] = _name


def seed_data(**changes: Any) -> dict[str, Any]:
    """A valid seed's data, with `changes`."""
    return {**LogBuilder().events[0]["data"], **changes}


def seed_of(name: str) -> dict[str, Any]:
    """The seed data of a required-case scenario."""
    return dict(SCENARIOS[name][0].events[0]["data"])


def run_of(name: str) -> list[dict[str, Any]]:
    """The harness events after the seed of a required-case scenario."""
    return SCENARIOS[name][0].events[1:]


def write_examples(folder: Path) -> None:
    """Write every scenario's log as `<name>.jsonl` into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (builder, _) in SCENARIOS.items():
        text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in builder.events)
        (folder / f"{name}.jsonl").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    write_examples(Path(sys.argv[1] if len(sys.argv) > 1 else "examples"))


async def claimed_session(ledger: Any, holder: str, lease_s: float = 0.2
                          ) -> tuple[Any, Any, Any, LogBuilder]:
    """A one-trial job `f` whose trial `holder` claimed, and the seed of a clean session
    started under that claim's lease (fenced): (jobs, claim, seeded, the session's log)."""
    from trialledger.core.seed import validate_seed
    from trialledger.store.jobs import Jobs

    jobs = Jobs(ledger)
    config = {"model": "m", "settings": {}, "grants": [], "k": 1, "max_attempts": 1}
    await jobs.define("f", config, [("t", "/tasks/t")])
    claim = await jobs.claim("f", holder, lease_s)
    assert claim is not None
    log = run(CLEAN, 0)
    log.events[0]["data"].update(trial_id=claim.trial_id, task="t")
    seeded = await ledger.start(validate_seed(log.events[0]["data"]),
                                fence=(claim.trial_id, claim.token))
    return jobs, claim, seeded, log
