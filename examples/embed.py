"""Embed the store: seed a session, feed Codex's own output, decide, read, close.

    python examples/embed.py [DB]      # DB: a SQLite path (default embedded.db) or postgresql://
"""

import sys
from typing import Any

import anyio

from trialledger.adapters import parse_stream_line
from trialledger.store import Ledger

SEED = {  # every required field; `settings` and `grants` may be left out
    "trial_id": "hello-world:1", "attempt": 1, "runner_id": "my-service",
    "task": "hello-world", "instruction": "Print hello world",
    "agent": {"name": "codex", "version": "0.171.0"}, "model": "gpt-5.4",
}
CODEX_LINES = [  # what `codex exec --json` printed, one line each
    '{"type":"thread.started","thread_id":"0199a213-81c0-7800-8aa1-bbab2a035a53"}',
    '{"type":"turn.started"}',
    '{"type":"item.completed","item":{"id":"item_0","type":"agent_message","text":"hello"}}',
    '{"type":"turn.completed","usage":{"input_tokens":24763,"cached_input_tokens":24448,'
    '"output_tokens":122,"reasoning_output_tokens":0}}',
]
AT = "2026-11-30T12:00:00Z"


async def main(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        # The seed comes first; a bad one raises SeedRejected naming every missing field.
        seeded = await ledger.seed(SEED, api_key="sk-never-stored")
        sid = seeded.session_id
        head: int | None = seeded.head_seq  # the head each append names

        async def add(*events: dict[str, Any]) -> None:
            nonlocal head
            head = (await ledger.append(sid, list(events), expected_seq=head))[-1].event.seq

        await add({"type": "agent.launched", "at": AT, "data": {
            "argv": ["codex", "exec", "--json"], "workdir": "/app", "env_keys": ["PATH"],
            "config_sha256": "", "isolation": "external", "runner_id": "my-service"}})
        for line in CODEX_LINES:  # the public converter: one line → its events
            await add(*parse_stream_line(line).events(AT))
        # The machine decides once both of these are in: no harness writes a decision.
        await add({"type": "agent.exited", "at": AT, "data": {"return_code": 0,
                                                               "timed_out": False}},
                  {"type": "cleanup.reported", "at": AT, "data": {"confirmed": True}})
        view = await ledger.view(sid)
        assert view.decision is not None  # both are in: the machine has decided
        print(sid, view.state, view.decision.rule, view.decision.action,
              view.usage.total_tokens if view.usage else None)
        await ledger.close(sid)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "embedded.db")
