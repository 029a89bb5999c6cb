"""`trialledger show SESSION` says why a session did not score (docs/SPEC.md §13), from its
events: a `verification.failed`'s reason and detail, and an `unscored:` line for a session
decided `retry`, closed before a decision, or verified without a reward. Sessions run for
real with the oracle (bubblewrap) or imported from recorded logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.runs import in_process, make_task
from tests.scenarios import HTTP_429, THREAD, TURN, LogBuilder, run
from trialledger.store import Ledger

SOLVE = "#!/bin/sh\necho solved > answer.txt\n"


def _ran(tmp_path: Path, db: Path, name: str, test_sh: str, *, exit_code_reward: bool) -> str:
    """The session id of an oracle run of a task whose verifier is `test_sh`."""
    make_task(tmp_path / name, instruction="write answer.txt", test_sh=test_sh,
              solve_sh=SOLVE, exit_code_reward=exit_code_reward)
    done = in_process("run", str(tmp_path / name), "--agent", "oracle", "--db", str(db))
    assert done.returncode in (0, 1), done.stderr
    return done.stdout.split()[0]


def _imported(db: Path, log: LogBuilder) -> str:
    async def put() -> str:
        async with await Ledger.open(str(db)) as ledger:
            return await ledger.import_log(log.events)

    return anyio.run(put)


def _why(db: Path, session: str) -> list[str]:
    shown = in_process("show", session, "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    return [line for line in shown.stdout.splitlines()
            if line.startswith(("verification failed", "unscored:"))]


def test_show_says_why_a_verification_failed(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    silent = _ran(tmp_path, db, "silent", "true\n", exit_code_reward=False)
    assert _why(db, silent) == [
        "verification failed at seq 6: no_reward: the verifier wrote neither reward.json "
        "nor reward.txt",
        "unscored: no reward: the verification failed (no_reward)"]
    passed = _ran(tmp_path, db, "passes", "grep -qx solved answer.txt\n",
                  exit_code_reward=True)
    assert _why(db, passed) == []  # scored: nothing to explain
    failing = _ran(tmp_path, db, "fails", "exit 1\n", exit_code_reward=True)
    assert _why(db, failing) == []  # reward 0 is a score, not a failure to score


@pytest.mark.parametrize(("log", "said"), [
    (lambda: run(HTTP_429, 1).add("session.closed", {"reason": "normal"}),
     "unscored: decided retry by rule "),
    (lambda: LogBuilder().launched().codex([THREAD, TURN]).add(
        "session.closed", {"reason": "cancelled"}),
     "unscored: closed cancelled before a decision"),
])
def test_show_says_why_a_session_is_unscored(tmp_path: Path, log: Callable[[], LogBuilder],
                                             said: str) -> None:
    db = tmp_path / "t.db"
    session = _imported(db, log())
    lines = _why(db, session)
    assert len(lines) == 1 and lines[0].startswith(said), lines
    if "retry" in said:
        assert "cause model_endpoint: exceeded retry limit" in lines[0]
        assert lines[0].count("429") == 1  # the cause's message, not again as the error
