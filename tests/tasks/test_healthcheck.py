"""A task's healthcheck (SPEC §15), run as Harbor 0.25 runs it: Docker's start period,
interval and retries, before the agent, in the session's sandbox; a failed one is a lost
sandbox (R1), never a graded run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.runs import in_process
from tests.sandbox.test_range_mode import _debian_into
from trialledger.adapters.tasks.healthcheck import Healthcheck, HealthcheckInvalid, run_healthcheck


def count_tries(check: Healthcheck, results: list[int]) -> tuple[int, str | None]:
    """How many tries `run_healthcheck` makes over these exit codes (then 1 forever)."""
    tries = 0

    async def attempt(timeout_s: float) -> tuple[int | None, str]:
        nonlocal tries
        tries += 1
        return (results[tries - 1] if tries <= len(results) else 1), f"try {tries}"

    failure = anyio.run(run_healthcheck, check, attempt)
    return tries, failure


@settings(max_examples=40, deadline=None)
@given(retries=st.integers(1, 6), passing_at=st.integers(1, 8))
def test_retries_consecutive_failures_then_the_check_fails(retries: int, passing_at: int) -> None:
    """Without a start period: healthy on the first pass within `retries` tries, else failed
    after exactly `retries` of them, the last try's output quoted."""
    check = Healthcheck("probe", interval_sec=0, retries=retries)
    tries, failure = count_tries(check, [1] * (passing_at - 1) + [0])
    if passing_at <= retries:
        assert (tries, failure) == (passing_at, None)
    else:
        assert tries == retries
        assert failure == (f"healthcheck failed after {retries} retries: probe: the last try "
                           f"exited 1: try {retries}")


def test_failures_in_the_start_period_do_not_count() -> None:
    check = Healthcheck("probe", interval_sec=0, start_interval_sec=0.01,
                        start_period_sec=0.3, retries=1)
    tries, failure = count_tries(check, [])
    assert tries > 2 and failure is not None  # several tries in the period, then one counted


@pytest.mark.parametrize(("docker", "start_period", "waited"), [
    (False, 0.0, (0.0, 1.0)),  # Harbor's task check: at once
    (True, 0.0, (1.0, 60.0)),  # Docker's daemon: one interval first
    (True, 10.0, (0.05, 1.0))])  # within a start period: one start interval first
def test_a_compose_services_first_try_waits_an_interval_as_dockers(
        docker: bool, start_period: float, waited: tuple[float, float]) -> None:
    check = Healthcheck("probe", interval_sec=1.0, start_interval_sec=0.05,
                        start_period_sec=start_period)

    async def first_try() -> float:
        began = anyio.current_time()

        async def attempt(timeout_s: float) -> tuple[int | None, str]:
            return 0, ""

        assert await run_healthcheck(check, attempt, first_after_interval=docker) is None
        return anyio.current_time() - began

    low, high = waited
    assert low <= anyio.run(first_try) < high


def test_a_table_harbor_would_refuse_is_refused_by_name() -> None:
    for table, named in (({"interval_sec": 1}, "command"), ({"command": "x", "retries": 0},
                                                          "retries"),
                         ({"command": "x", "timeout_sec": "5s"}, "timeout_sec"),
                         ({"command": "x", "every": 5}, "every")):
        with pytest.raises(HealthcheckInvalid, match=named):
            Healthcheck.parse(table, "task.toml")


def _task(folder: Path, check: str) -> Path:
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    _debian_into(folder)
    (folder / "task.toml").write_text(
        'version = "1.0"\n[environment]\nrootfs = "rootfs.tar"\n'
        f"[environment.healthcheck]\n{check}")
    (folder / "instruction.md").write_text("Say ok.\n")
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\necho ok > /tmp/solved\n")
    (folder / "tests" / "test.sh").write_text(
        "#!/bin/bash\n[ -f /tmp/solved ] && echo 1 > /logs/verifier/reward.txt "
        "|| echo 0 > /logs/verifier/reward.txt\n")
    for script in (folder / "solution" / "solve.sh", folder / "tests" / "test.sh"):
        script.chmod(0o755)
    return folder


def _events(db: Path) -> list[tuple[str, dict[str, object]]]:
    with sqlite3.connect(db) as conn:
        return [(kind, json.loads(data)["data"]) for kind, data in
                conn.execute("SELECT type, data FROM events ORDER BY session_id, seq")]


def test_a_check_that_passes_on_its_second_try_lets_the_agent_run(tmp_path: Path) -> None:
    """The first try fails (and leaves a mark in the container), the second passes: the
    oracle then runs and is graded."""
    task = _task(tmp_path / "task", 'command = "test -f /tmp/seen || { touch /tmp/seen; '
                                    'exit 1; }"\ninterval_sec = 0.1\nretries = 2\n')
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = [kind for kind, _ in _events(tmp_path / "t.db")]
    assert "sandbox.lost" not in kinds and "verification.recorded" in kinds, kinds


def test_a_failing_check_loses_the_sandbox_before_the_agent(tmp_path: Path) -> None:
    task = _task(tmp_path / "task", 'command = "echo not ready; exit 3"\n'
                                    "interval_sec = 0.05\nretries = 2\n")
    in_process("run", str(task), "--agent", "oracle", "--max-attempts", "1",
               "--db", str(tmp_path / "t.db"))
    events = _events(tmp_path / "t.db")
    kinds = [kind for kind, _ in events]
    assert "agent.launched" not in kinds and "verification.recorded" not in kinds, kinds
    (lost,) = [data for kind, data in events if kind == "sandbox.lost"]
    assert lost["detail"] == ("healthcheck failed after 2 retries: echo not ready; exit 3: "
                              "the last try exited 3: not ready")


def test_a_bad_healthcheck_table_is_one_line_and_exit_2(tmp_path: Path) -> None:
    task = _task(tmp_path / "task", 'command = "true"\nretries = 0\n')
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "retries" in done.stderr and not (tmp_path / "t.db").exists()
