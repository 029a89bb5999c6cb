"""The oracle and nop agents (docs/SPEC.md §15), run for real: bubblewrap, SQLite files."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.agent_decisions import SNAPSHOT, decisions_by_policy
from tests.runs import in_process, make_task
from tests.views import decided
from trialledger import cli
from trialledger.adapters.session.runner import RunOptions, SessionResult, SessionRunner
from trialledger.adapters.tasks.task import Task
from trialledger.store import Ledger

# The verifier passes when the oracle wrote the file its task asks for.
CHECK = "grep -qx solved answer.txt\n"
SOLVE = "#!/bin/sh\necho solved > answer.txt\necho 'wrote answer.txt'\n"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "trials.db")


def solvable(folder: Path, solve_sh: str | None = SOLVE) -> Task:
    return make_task(folder, instruction="write answer.txt", test_sh=CHECK, solve_sh=solve_sh)


async def run_agent(db: str, task: Task, agent: str) -> SessionResult:
    async with await Ledger.open(db) as ledger:
        return await SessionRunner(ledger, task, RunOptions(agent=agent)).run_session()


def seed_of(result: SessionResult) -> Any:
    return result.view.events[0].data


@pytest.mark.anyio
async def test_the_oracle_runs_the_solution_and_is_graded_by_r0(db: str, tmp_path: Path
                                                                ) -> None:
    result = await run_agent(db, solvable(tmp_path / "task"), "oracle")
    view = result.view
    assert (seed_of(result).agent.name, seed_of(result).model) == ("oracle", None)
    assert view.rewards == {"reward": 1.0}
    d = decided(view)
    assert (d.rule, d.action, d.status, d.http_status, d.error, d.cause) == (
        "scripted_agent", "verify", "completed", 200, None, None)
    assert d.usage is not None and d.usage.total_tokens == 0 and d.reward_valid
    stderr = next(e for e in view.events if e.type == "agent.stderr").data
    assert stderr.tail.strip() == "wrote answer.txt"
    launched = next(e for e in view.events if e.type == "agent.launched").data
    assert launched.model_proxy is False and "codex" not in " ".join(launched.argv)
    assert not [e for e in view.events if e.type == "model.call"]
    async with await Ledger.open(db) as ledger:
        (row,) = await ledger.sessions(trial_id=seed_of(result).trial_id)
    assert (row["agent_name"], row["model"]) == ("oracle", None)


@pytest.mark.anyio
async def test_nop_runs_nothing_and_is_graded_zero(db: str, tmp_path: Path) -> None:
    result = await run_agent(db, solvable(tmp_path / "task"), "nop")
    view = result.view
    assert [e.type for e in view.events][:4] == [
        "session.seeded", "agent.launched", "agent.exited", "cleanup.reported"]
    assert (seed_of(result).agent.name, seed_of(result).model) == ("nop", None)
    assert decided(view).rule == "scripted_agent" and decided(view).status == "completed"
    assert view.rewards == {"reward": 0.0}


@pytest.mark.anyio
async def test_a_failing_solution_is_still_verified(db: str, tmp_path: Path) -> None:
    task = solvable(tmp_path / "task", "#!/bin/bash\necho solved > answer.txt\nexit 3\n")
    view = (await run_agent(db, task, "oracle")).view
    d = decided(view)
    assert (d.rule, d.action, d.status, d.error) == (
        "scripted_agent", "verify", "failed", "oracle exited with code 3")
    assert view.rewards == {"reward": 1.0}  # the verifier runs whatever solve.sh returned


@pytest.mark.anyio
async def test_a_solution_without_shebang_or_exec_bit_runs_under_bash(db: str, tmp_path: Path
                                                                       ) -> None:
    task = solvable(tmp_path / "task")
    script = task.folder / "solution" / "solve.sh"
    script.write_text("[[ 1 == 1 ]] && echo solved > answer.txt\n", encoding="utf-8")
    script.chmod(0o644)
    view = (await run_agent(db, task, "oracle")).view
    assert decided(view).status == "completed" and view.rewards == {"reward": 1.0}


def test_the_oracles_output_is_kept_scrubbed_where_harbor_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §15: oracle.txt, scrubbed of the session's secrets, is `agent/oracle.txt` in
    the session's artifact folder (Harbor's trial folder has it there), listed with the
    verification's files and printed by `trialledger artifacts`."""
    secret = "sk-oracle-" + "7q" * 12
    monkeypatch.setenv("TL_ORACLE_KEY", secret)
    db = tmp_path / "t.db"
    task = make_task(tmp_path / "task", instruction="write answer.txt", test_sh=CHECK,
                     solve_sh=SOLVE + 'echo "key $ORACLE_API_KEY"\n',
                     toml='[solution.env]\nORACLE_API_KEY = "${TL_ORACLE_KEY}"\n')
    done = in_process("run", str(task.folder), "--db", str(db), "--agent", "oracle", "--json")
    assert done.returncode == 0, done.stderr
    session = json.loads(done.stdout.splitlines()[-1])["session_id"]
    listed = in_process("artifacts", session, "--db", str(db))
    assert "agent/oracle.txt" in listed.stdout, listed.stdout + listed.stderr
    printed = in_process("artifacts", session, "agent/oracle.txt", "--db", str(db))
    assert printed.stdout.splitlines()[0] == "wrote answer.txt", printed.stderr
    assert printed.stdout.splitlines()[1].startswith("key ") and secret not in printed.stdout


def test_past_16_mib_the_oracles_output_keeps_its_end(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    task = make_task(tmp_path / "task", instruction="write answer.txt", test_sh=CHECK,
                     solve_sh="#!/bin/sh\necho solved > answer.txt\n"
                              "head -c 16777316 /dev/zero | tr '\\0' x\necho END\n")
    done = in_process("run", str(task.folder), "--db", str(db), "--agent", "oracle", "--json")
    session = json.loads(done.stdout.splitlines()[-1])["session_id"]
    printed = in_process("artifacts", session, "agent/oracle.txt", "--db", str(db))
    first, rest = printed.stdout.split("\n", 1)
    left_out = re.fullmatch(r"\[(\d+) earlier bytes not kept\]", first)
    assert left_out is not None, first[:80]
    # at most 16 MiB kept, its end; what was left out is counted (a little more than the
    # 104 bytes past the cap: the start a secret might have been cut through is dropped)
    assert int(left_out[1]) + len(rest) == 16777316 + len("END\n")
    assert 104 <= int(left_out[1]) < 1024 and rest.endswith("xxxEND\n")


def test_run_refuses_the_oracle_on_a_task_without_a_solution(tmp_path: Path) -> None:
    task = solvable(tmp_path / "task", solve_sh=None)
    done = in_process("run", str(task.folder), "--db", str(tmp_path / "t.db"),
                      "--agent", "oracle")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no solution/solve.sh" in done.stderr
    assert not (tmp_path / "t.db").exists()


def test_codex_still_needs_its_endpoint_and_model(tmp_path: Path) -> None:
    task = solvable(tmp_path / "task")
    done = in_process("run", str(task.folder), "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--model-base-url and --model" in done.stderr


def test_run_with_the_oracle_needs_no_model(tmp_path: Path) -> None:
    task = solvable(tmp_path / "task")
    done = in_process("run", str(task.folder), "--db", str(tmp_path / "t.db"), "--agent",
                      "oracle", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["outcome"] == "verify"


def _rows(db: Path, sql: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(sql)]


def test_an_oracle_job_checks_a_dataset_and_a_worker_keeps_its_agent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    for name in ("alpha", "beta"):
        solvable(data / name)
    db = tmp_path / "jobs.db"
    code = cli.main(["job", "run", "check", str(data), "--agent", "oracle", "--db", str(db)])
    assert code == 0, capsys.readouterr()
    tasks = _rows(db, "SELECT task, trials, scored, mean_reward FROM job_tasks "
                      "WHERE job = 'check' AND task IS NOT NULL ORDER BY task")
    assert [(t["task"], t["scored"], t["mean_reward"]) for t in tasks] == [
        ("alpha", 1, 1.0), ("beta", 1, 1.0)]
    config = _rows(db, "SELECT config FROM jobs WHERE name = 'check'")[0]["config"]
    assert json.loads(config)["agent"] == "oracle"
    capsys.readouterr()
    refused = in_process("worker", "--db", str(db), "--job", "check", "--agent", "nop")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "runs the oracle agent, not --agent nop" in refused.stderr
    assert in_process("worker", "--db", str(db), "--job", "check").returncode == 0


def test_an_oracle_job_leaves_a_task_without_solution_unscored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    solvable(data / "alpha")
    solvable(data / "broken", solve_sh=None)
    db = tmp_path / "jobs.db"
    code = cli.main(["job", "run", "check", str(data), "--agent", "oracle", "--db", str(db)])
    assert code == 1  # a trial ended unscored
    assert "broken: no_solution:" in capsys.readouterr().out
    trials = {t["task"]: t for t in _rows(db, "SELECT * FROM job_trials")}
    assert trials["broken"]["state"] == "no_solution" and trials["broken"]["scored"] == 0
    assert trials["broken"]["attempts"] == 0 and trials["alpha"]["scored"] == 1
    assert not _rows(db, "SELECT 1 FROM sessions WHERE task = 'broken'")


def test_every_recorded_log_decides_as_before_r0_under_every_policy() -> None:
    """The snapshot was written by the code before R0 (`python -m tests.agent_decisions`)."""
    before = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    now = json.loads(json.dumps(decisions_by_policy()))
    assert sorted(now) == sorted(before)
    changed = [key for key in before if now[key] != before[key]]
    assert not changed, f"decisions changed for {changed}"
