"""Analysts answer questions with plain SQL over the views, the same query on both databases."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from tests.scenarios import SCENARIOS, seed_of
from trialledger.store import Ledger

pytestmark = pytest.mark.anyio

RETRY_RATE_BY_CAUSE = """
SELECT COALESCE(cause_kind, 'none') AS cause, COUNT(*) AS sessions,
       SUM(CASE WHEN action = 'retry' THEN 1 ELSE 0 END) AS retries
FROM outcomes GROUP BY COALESCE(cause_kind, 'none') ORDER BY cause
"""
TOKENS_BY_TASK = """
SELECT s.task, SUM(o.total_tokens) AS tokens, COUNT(o.total_tokens) AS known
FROM sessions s JOIN outcomes o ON o.session_id = s.session_id
GROUP BY s.task ORDER BY s.task
"""
ATTEMPTS_PER_TRIAL = """
SELECT trial_id, COUNT(*) AS attempts, MAX(attempt) AS last_attempt
FROM sessions GROUP BY trial_id ORDER BY trial_id
"""


async def _populate(ledger: Ledger) -> None:
    plan = [  # (trial, attempt, task, scenario)
        ("t1", 1, "lexer", "http_429"),
        ("t1", 2, "lexer", "clean"),
        ("t2", 1, "parser", "capacity_killed"),
        ("t2", 2, "parser", "stream_cut"),
        ("t2", 3, "parser", "tool_call"),
        ("t3", 1, "parser", "required_mcp_down"),
    ]
    previous: dict[str, str] = {}
    for trial, attempt, task, name in plan:
        seed = {**seed_of(name), "trial_id": trial, "attempt": attempt, "task": task,
                "retry_of": previous.get(trial)}
        sid = (await ledger.seed(seed)).session_id
        await ledger.append(sid, SCENARIOS[name][0].events[1:])
        previous[trial] = sid


async def _query(ledger: Ledger, sql: str) -> list[tuple[Any, ...]]:
    async with ledger._engines.reader.begin() as conn:
        return [tuple(row) for row in (await conn.execute(text(sql))).all()]


async def test_retry_rate_by_cause_kind(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        await _populate(ledger)
        assert await _query(ledger, RETRY_RATE_BY_CAUSE) == [
            ("model_endpoint", 3, 3), ("none", 2, 0), ("startup_failed", 1, 1)]


async def test_tokens_by_task(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        await _populate(ledger)
        # lexer: 429 before output (known 0) + clean 22; parser: capacity (0), stream cut
        # after work (unknown), tool call 30, required MCP down (0)
        assert await _query(ledger, TOKENS_BY_TASK) == [("lexer", 22, 2), ("parser", 30, 3)]


async def test_attempts_per_trial(db: str) -> None:
    async with await Ledger.open(db) as ledger:
        await _populate(ledger)
        assert await _query(ledger, ATTEMPTS_PER_TRIAL) == [
            ("t1", 2, 2), ("t2", 3, 3), ("t3", 1, 1)]
