"""What `job show` and `job run` say of a job's trials (docs/SPEC.md §13, §15): who holds an
open trial and until when, the dataset's tasks skipped with the reason, each trial's own
duration and reward, and the wall time of work only (a session recovered after its runner
died is not charged for the dead time). Real stores (SQLite files, the PostgreSQL fixture),
real sessions (the oracle and nop agents in the sandbox)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task
from tests.scenarios import CLEAN, LogBuilder
from trialledger.core.seed import validate_seed
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

CONFIG = {"model": "m", "settings": {}, "grants": [], "k": 2, "max_attempts": 1}
DEAD_S = 600.0  # how long the first runner lay dead before its session was recovered


def _shown(db: str, name: str, *more: str) -> str:
    done = in_process("job", "show", name, "--db", db, *more)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _at(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


@pytest.mark.anyio
async def test_a_recovered_session_is_not_charged_for_its_dead_runner(db: str) -> None:
    """Trial 0: a session whose runner died 5 s into its work, recovered `DEAD_S` later by
    the trial's next holder; trial 1: a session its runner closed after 10 s. The wall time
    of work is 5 s and 10 s: the dead time is nobody's work."""
    start = datetime.now(UTC) - timedelta(seconds=DEAD_S)
    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("w", CONFIG, [("t", "/tasks/t")])
        for k, (work_s, dies) in enumerate([(5, True), (10, False)]):
            claim = await jobs.claim("w", f"runner-{k}", 60)
            assert claim is not None and claim.k_index == k
            log = LogBuilder().launched().codex(CLEAN)
            if not dies:
                log.finish(0).add("session.closed", {"reason": "normal"})
            for second, event in enumerate(log.events):  # one a second; the last at work_s
                at = work_s if event is log.events[-1] else min(second, work_s)
                event["at"] = _at(start + timedelta(seconds=at))
            log.events[0]["data"].update(trial_id=claim.trial_id, task="t")
            seeded = await ledger.start(validate_seed(log.events[0]["data"]),
                                        at=log.events[0]["at"])
            await ledger.append(seeded.session_id, log.events[1:])
            if dies:  # now, DEAD_S later: the next holder recovers it
                assert await ledger.recover_sessions([seeded.session_id]) == [
                    seeded.session_id]
            assert await jobs.settle(claim, "done")
        trials = {t["k_index"]: t for t in await jobs.trials("w")}
        tasks = await jobs.tasks("w")
        one = await jobs.trial(trials[0]["trial_id"])
        assert one is not None and float(one["wall_s"]) == pytest.approx(5.0, abs=0.01)
    assert float(trials[0]["wall_s"]) == pytest.approx(5.0, abs=0.01)
    assert float(trials[1]["wall_s"]) == pytest.approx(10.0, abs=0.01)
    assert float(tasks[-1]["wall_s"]) == pytest.approx(15.0, abs=0.01)  # the job's total


def test_job_show_says_who_holds_an_open_trial_and_until_when(db: str) -> None:
    async def hold_one() -> None:
        async with await Ledger.open(db) as ledger:
            jobs = Jobs(ledger)
            await jobs.define("w", CONFIG, [("t", "/tasks/t")])
            assert await jobs.claim("w", "runner-7", 60) is not None

    anyio.run(hold_one)
    out = _shown(db, "w")
    held = re.search(r"t #0 \(\S+\): held by runner-7, its lease expires in (\d+) s", out)
    assert held is not None and 0 < int(held.group(1)) <= 60, out
    assert re.search(r"t #1 \(\S+\): queued", out), out


def test_a_dataset_s_skipped_tasks_are_listed_with_the_reason(db: str, tmp_path: Path) -> None:
    make_task(tmp_path / "data" / "graded", instruction="nothing", test_sh="exit 0\n")
    make_task(tmp_path / "data" / "untested", instruction="nothing", test_sh=None)
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db,
                      "--agent", "nop")
    assert done.returncode == 0, done.stderr
    out = _shown(db, "bench")
    assert re.search(r"^untested: skipped: .*no tests/test\.sh", out, re.M), out
    shown = json.loads(_shown(db, "bench", "--json"))
    assert list(shown["skipped"]) == ["untested"]
    assert [t["task"] for t in shown["tasks"] if t["task"]] == ["graded"]  # in no figure


def test_each_trial_s_line_has_its_own_duration_and_reward(tmp_path: Path) -> None:
    """Two oracle trials run one after the other; each line's duration is that trial's
    own (its session's, as the store has it), not the time since the job began."""
    for name, pause in (("a-slow", "2"), ("b-quick", "0.5")):
        make_task(tmp_path / "data" / name, instruction="wait", test_sh="exit 0\n",
                  solve_sh=f"#!/bin/sh\nsleep {pause}\n")
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "timing", str(tmp_path / "data"), "--db", db,
                      "--agent", "oracle", "-n", "1")
    assert done.returncode == 0, done.stderr
    said: dict[str, float] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"(\S+) k=0 verify reward 1 \(1 session, ([\d.]+) s\)$", line)
        if found:
            said[found.group(1)] = float(found.group(2))
    trials: list[dict[str, Any]] = json.loads(_shown(db, "timing", "--json"))["trials"]
    own = {t["task"]: round(float(t["wall_s"]), 1) for t in trials}
    assert said == own, done.stdout
    lines = _shown(db, "timing", "--trials")
    for task, seconds in own.items():
        assert f"{task} k=0 verify reward 1 (1 session, {seconds:.1f} s)" in lines, lines


def test_a_figure_with_no_finished_session_shows_no_tokens_rather_than_0() -> None:
    from trialledger.cli import _tokens

    assert _tokens({"total_tokens": None, "unknown_usage": 0}) == ""
    assert _tokens({"total_tokens": 0, "unknown_usage": 0}) == "0"  # known: none spent
