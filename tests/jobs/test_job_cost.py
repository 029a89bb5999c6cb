"""A job's cost in USD (docs/SPEC.md §18) through the CLI: `job run --prices FILE` stores a
price table with the job, outside its compared configuration; `job show` (text and --json)
gives each trial's, figure's and the job's `cost_usd` by the formula — null when unknown,
0 for the oracle. Real stores, real sessions (Codex logs as recorded, the oracle agent in
the sandbox)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task
from tests.scenarios import CLEAN, LogBuilder
from trialledger.core.seed import validate_seed
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

CONFIG = {"agent": "codex", "model": "m", "settings": {}, "grants": [], "k": 2,
          "max_attempts": 1}
# CLEAN's usage: 12 input (2 cached), 10 output (3 reasoning).
PRICES = '["m"]\ninput = 2.0\ncached_input = 0.5\noutput = 8.0\nreasoning = 16.0\n'
ONE = ((12 - 2) * 2.0 + 2 * 0.5 + (10 - 3) * 8.0 + 3 * 16.0) / 1e6


def _show(db: str, name: str, *more: str) -> dict[str, Any]:
    done = in_process("job", "show", name, "--db", db, "--json", *more)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


async def _recorded_job(db: str, trials: int) -> None:
    """Job `c` of model `m`, priced by PRICES: `trials` of its 2 trials each with one Codex
    session as recorded (CLEAN: usage reported), closed and settled."""
    from trialledger.core.cost import parse_prices

    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("c", CONFIG, [("t", "/tasks/t")], prices=parse_prices(PRICES))
        for k in range(trials):
            assert await _one_session(ledger, jobs, CLEAN) == k


async def _one_session(ledger: Ledger, jobs: Jobs, codex: list[str]) -> int:
    """The next trial of job `c` claimed, one session of model `m` recorded for it from
    `codex` (Codex's lines), closed and settled; the trial's k."""
    claim = await jobs.claim("c", "runner", 60)
    assert claim is not None
    log = LogBuilder().launched().codex(codex).finish(0)
    log.add("session.closed", {"reason": "normal"})
    log.events[0]["data"].update(trial_id=claim.trial_id, task="t", model="m")
    seeded = await ledger.start(validate_seed(log.events[0]["data"]), at=log.events[0]["at"])
    await ledger.append(seeded.session_id, log.events[1:])
    assert await jobs.settle(claim, "done")
    return claim.k_index


async def _views(db: str, name: str = "c") -> tuple[list[dict[str, Any]], ...]:
    """The job's rows of `session_costs`, `job_trials` and `job_tasks`."""
    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        return (await jobs._rows("SELECT * FROM session_costs WHERE job = :j", name),
                await jobs.trials(name), await jobs.tasks(name))


def test_a_codex_job_costs_its_usage_by_the_formula(db: str, tmp_path: Path) -> None:
    anyio.run(_recorded_job, db, 2)
    shown = _show(db, "c")
    assert [t["cost_usd"] for t in shown["trials"]] == [pytest.approx(ONE)] * 2
    assert shown["cost_usd"] == pytest.approx(2 * ONE)
    assert shown["tasks"][-1]["cost_usd"] == pytest.approx(2 * ONE)
    assert shown["prices"] == {"m": {"input": 2.0, "cached_input": 0.5, "output": 8.0,
                                     "reasoning": 16.0}}
    text = in_process("job", "show", "c", "--db", db)
    assert f"cost: ${2 * ONE:.4f}" in text.stdout, text.stdout
    sessions, trials, tasks = anyio.run(_views, db)  # the SQL views say the same
    assert [s["cost_usd"] for s in sessions] == [pytest.approx(ONE)] * 2
    assert [t["cost_usd"] for t in trials] == [pytest.approx(ONE)] * 2
    assert [t["cost_usd"] for t in tasks] == [pytest.approx(2 * ONE)] * len(tasks)
    # `job show --prices` recomputes by another table (reasoning defaults to output)
    other = tmp_path / "other.toml"
    other.write_text('[m]\ninput = 1\ncached_input = 1\noutput = 1\n')
    assert _show(db, "c", "--prices", str(other))["cost_usd"] == pytest.approx(2 * 22 / 1e6)
    # a model the table does not price: unknown, never 0
    other.write_text('[gpt]\ninput = 1\ncached_input = 1\noutput = 1\n')
    unpriced = _show(db, "c", "--prices", str(other))
    assert unpriced["cost_usd"] is None and unpriced["trials"][0]["cost_usd"] is None
    text = in_process("job", "show", "c", "--db", db, "--prices", str(other))
    assert "cost: unknown" in text.stdout


def test_a_job_with_a_session_of_unknown_usage_has_no_cost(db: str) -> None:
    """One trial's session reports usage, the other's none (killed before any turn
    completed, its work done): that trial's cost and the job's are null, never a sum."""
    async def one_unknown() -> None:
        await _recorded_job(db, 1)
        async with await Ledger.open(db) as ledger:
            await _one_session(ledger, Jobs(ledger), CLEAN[:4])

    anyio.run(one_unknown)
    shown = _show(db, "c")
    costs = sorted((t["cost_usd"] is None, t["cost_usd"]) for t in shown["trials"])
    assert costs == [(False, pytest.approx(ONE)), (True, None)]
    assert shown["cost_usd"] is None
    sessions, trials, tasks = anyio.run(_views, db)
    assert sorted(s["cost_usd"] is None for s in sessions) == [False, True]
    assert sorted(t["cost_usd"] is None for t in trials) == [False, True]
    assert [t["cost_usd"] for t in tasks] == [None] * len(tasks)


def test_an_oracle_job_costs_0_and_a_resume_may_change_the_prices(tmp_path: Path) -> None:
    make_task(tmp_path / "data" / "t", instruction="do it", test_sh="exit 0\n",
              solve_sh="#!/bin/sh\ntrue\n")
    db = str(tmp_path / "t.db")
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    done = in_process("job", "run", "o", str(tmp_path / "data"), "--db", db,
                      "--agent", "oracle", "--prices", str(prices))
    assert done.returncode == 0, done.stderr
    assert "cost: $0.0000" in done.stdout
    shown = _show(db, "o")
    assert shown["cost_usd"] == 0 and shown["trials"][0]["cost_usd"] == 0
    views = anyio.run(_views, db, "o")
    assert all(rows for rows in views)
    assert {r["cost_usd"] for rows in views for r in rows} == {0}
    prices.write_text('["m"]\ninput = 3\ncached_input = 3\noutput = 3\n')
    again = in_process("job", "run", "o", str(tmp_path / "data"), "--db", db,
                       "--agent", "oracle", "--prices", str(prices))
    assert again.returncode == 0, again.stderr  # not refused as another job
    assert _show(db, "o")["prices"] == {"m": {"input": 3.0, "cached_input": 3.0,
                                              "output": 3.0, "reasoning": 3.0}}


@pytest.mark.parametrize("text", ["input = [", '[m]\ninput = 1\noutput = 2\n'])
def test_a_bad_price_table_is_one_line_and_writes_nothing(tmp_path: Path, text: str) -> None:
    make_task(tmp_path / "data" / "t", instruction="do it", test_sh="exit 0\n",
              solve_sh="#!/bin/sh\ntrue\n")
    db = tmp_path / "t.db"
    prices = tmp_path / "prices.toml"
    prices.write_text(text)
    done = in_process("job", "run", "o", str(tmp_path / "data"), "--db", str(db),
                      "--agent", "oracle", "--prices", str(prices))
    assert done.returncode == 2
    assert done.stderr.startswith("trialledger: prices: ") and done.stderr.count("\n") == 1
    assert not db.exists()
    missing = in_process("job", "run", "o", str(tmp_path / "data"), "--db", str(db),
                         "--agent", "oracle", "--prices", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    assert not db.exists()
