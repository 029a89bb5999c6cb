"""SIGTERM, SIGHUP and SIGINT end a real run the same way: the agent stopped, the session
closed `cancelled` with its evidence, its folder (grant tokens) removed, 128+N."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.runs import codex_path, make_task
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, shell


def _state(db: Path) -> tuple[str, str] | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT session_id, state FROM sessions").fetchone()
    except sqlite3.Error:
        return None
    return (row[0], row[1]) if row else None


@contextlib.contextmanager
def running(db: str | Path, task_folder: Path, endpoint_url: str, *extra: str,
            wait: bool = True) -> Iterator[subprocess.Popen[str]]:
    """`trialledger run` in its own process, returned once its session is running (with
    `wait`); killed at the end if it is still alive."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "run", str(task_folder), "--db", str(db),
         "--model-base-url", endpoint_url, "--model", "m", "--codex-bin", codex_path(),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while wait and ((seen := _state(Path(db))) is None or seen[1] != "running"):
            assert time.monotonic() < deadline, "the run never started"
            assert runner.poll() is None, runner.communicate()
            time.sleep(0.05)
        yield runner
    finally:
        if runner.poll() is None:  # stopped as an operator would, killed if it hangs
            runner.send_signal(signal.SIGTERM)
            try:
                runner.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.communicate()


def _wait_for_process(cmdline: bytes, never: str, within_s: float = 60) -> None:
    """Until a process whose command line starts with `cmdline` runs on this host."""
    deadline = time.monotonic() + within_s
    while not any(_cmdline(entry).startswith(cmdline) for entry in Path("/proc").iterdir()
                  if entry.name.isdigit()):
        assert time.monotonic() < deadline, never
        time.sleep(0.05)


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_closes_the_session_cancelled_and_removes_its_folder(
        tmp_path: Path, signum: signal.Signals) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    with ScriptedEndpoint([shell("sleep 60")]) as endpoint, \
            running(db, task.folder, endpoint.url) as runner:
        session_id = (_state(db) or ("", ""))[0]
        time.sleep(1.0)  # the tool call is running
        runner.send_signal(signum)
        _, err = runner.communicate(timeout=60)
    assert runner.returncode == 128 + signum, err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err
    with sqlite3.connect(db) as conn:
        state, reason = conn.execute("SELECT state, close_reason FROM sessions").fetchone()
        kinds = [r[0] for r in conn.execute("SELECT type FROM events ORDER BY seq")]
    assert (state, reason) == ("closed", "cancelled")
    assert "item.started" in kinds  # the evidence captured before the signal is kept
    assert "agent.stderr" in kinds and "model.call" in kinds, ",".join(kinds)  # after it too
    assert not list(Path("/tmp").glob(f"trialledger-{session_id[:8]}-*"))
    leftover = subprocess.run(["pgrep", "-f", f"trialledger-{session_id[:8]}"],
                              capture_output=True, text=True, check=False).stdout
    assert leftover == ""


def test_recover_leaves_a_running_runner_alone(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    cli = [sys.executable, "-m", "trialledger.cli"]
    with ScriptedEndpoint([shell("sleep 60")]) as endpoint, \
            running(db, task.folder, endpoint.url, "--runner-id", "busy-runner"):
        by_id = subprocess.run([*cli, "recover", "--db", str(db), "--runner", "busy-runner"],
                               capture_output=True, text=True, timeout=60, check=False)
        every = subprocess.run([*cli, "recover", "--db", str(db), "--all"],
                               capture_output=True, text=True, timeout=60, check=False)
        still = _state(db)
    assert by_id.returncode == 2 and "alive" in by_id.stderr
    assert every.returncode == 0 and "0 sessions recovered" in every.stdout
    assert still is not None and still[1] == "running"  # the live session was not closed


def test_a_store_locked_past_its_busy_timeout_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process holds SQLite's write lock for 3× the runner's busy timeout (cut from
    # 30 s to 1.5 s for the test) while Codex works: the runner's appends wait it out, in
    # order, and the run ends well.
    import sqlite3

    monkeypatch.setenv("TRIALLEDGER_SQLITE_BUSY_MS", "1500")
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = tmp_path / "t.db"
    with ScriptedEndpoint([shell("sleep 2; echo worked"), message()]) as endpoint, \
            running(db, task.folder, endpoint.url) as runner:
        holder = sqlite3.connect(db, timeout=60, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, held
        time.sleep(4.5)
        holder.execute("COMMIT")
        holder.close()
        out, err = runner.communicate(timeout=120)
    assert runner.returncode == 0, err
    assert out.split()[1] == "verify"
    with sqlite3.connect(db) as conn:
        kinds = [r[0] for r in conn.execute("SELECT type FROM events ORDER BY seq")]
    assert kinds.count("item.completed") >= 2 and kinds[-1] == "session.closed"
    assert "verification.recorded" in kinds


def test_a_postgresql_restart_mid_run_loses_nothing(tmp_path: Path, postgres: Any) -> None:
    db = postgres.create_database()
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    pause = f"4.{os.getpid():07d}"  # this test's own, so it finds its tool call alone
    with ScriptedEndpoint([shell(f"sleep {pause}; echo worked"), message()]) as endpoint, \
            running(db, task.folder, endpoint.url, wait=False) as runner:  # not SQLite
        _wait_for_process(f"sleep\0{pause}".encode(), "Codex never ran its tool call")
        postgres.restart(down_s=5)  # every connection of the runner dies
        out, err = runner.communicate(timeout=180)
    assert runner.returncode == 0, err
    assert out.split()[1] == "verify", out


SLOW_ARCHIVE = """
import sys, time
from trialledger.adapters.session import verifying
from trialledger import cli

def slow(tree, target, secrets):  # the archive, one file every 0.3 s
    for n in range(100):
        (target / f"part-{n:03d}").write_text("x")
        time.sleep(0.3)
    raise AssertionError("the copy outlived its runner")

verifying.copy_archive = slow
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_runner_killed_mid_archive_writes_nothing_after_and_recover_names_it(
        tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db, archive = tmp_path / "t.db", tmp_path / "archive"
    script = tmp_path / "slow_archive.py"
    script.write_text(SLOW_ARCHIVE)
    with ScriptedEndpoint([message()]) as endpoint:
        runner = subprocess.Popen(
            [sys.executable, str(script), "run", str(task.folder), "--db", str(db),
             "--model-base-url", endpoint.url, "--model", "m", "--codex-bin", codex_path(),
             "--set", f"sandbox_logs_dir={archive}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not list(archive.glob("*/part-001")):
                assert time.monotonic() < deadline, "the archive never started"
                assert runner.poll() is None, "the runner ended before its archive"
                time.sleep(0.05)
            runner.send_signal(signal.SIGKILL)
            runner.wait(timeout=30)
        finally:
            if runner.poll() is None:
                runner.kill()
    written = sorted(archive.rglob("part-*"))
    time.sleep(1.5)  # a copy that outlived the runner would write 5 more files
    assert sorted(archive.rglob("part-*")) == written
    seen = _state(db)
    assert seen is not None and seen[1] == "graded"  # decided verify, verdict not recorded
    done = subprocess.run([sys.executable, "-m", "trialledger.cli", "recover", "--db", str(db),
                           "--all"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        gaps = conn.execute("SELECT code FROM gaps").fetchall()
        closed = conn.execute("SELECT state, close_reason FROM sessions").fetchone()
    assert ("verification_interrupted",) in gaps  # why it has no verdict: a re-run is due
    assert closed == ("closed", "recovered")


def test_run_trial_continues_a_crashed_runners_trial_as_its_next_attempt(
        tmp_path: Path) -> None:
    from trialledger import cli

    task = make_task(tmp_path / "task", test_sh="test -f built.txt\n")
    db = tmp_path / "t.db"
    turns = {"build it": [shell("sleep 20; echo built > built.txt"), message("built")]}
    task.folder.joinpath("instruction.md").write_text("build it")
    with ScriptedEndpoint([message()], turns=turns) as endpoint:
        with running(db, task.folder, endpoint.url, "--trial", "t-1") as runner:
            runner.send_signal(signal.SIGKILL)  # a crash: nothing closes the session
            runner.wait(timeout=30)
        seen = _state(db)
        assert seen is not None and seen[1] == "running"
        endpoint.turns["build it"] = [shell("echo built > built.txt"), message("built")]
        code = cli.main(["run", str(task.folder), "--db", str(db), "--model-base-url",
                         endpoint.url, "--model", "m", "--codex-bin", codex_path(),
                         "--trial", "t-1"])
    assert code == 0
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT session_id, attempt, retry_of, close_reason, outcome "
                            "FROM sessions ORDER BY attempt").fetchall()
    (first, second) = rows
    assert first[3] == "recovered" and first[4] == "retry"  # sandbox.lost, evidence kept
    assert second[1:] == (2, first[0], "normal", "verify")  # the next attempt, chained


SLOW_VERIFIER = """touch /logs/verifier/started
if [ -f /tests/slow ]; then sleep 60; fi
exit 0
"""


def _signalled_when(argv: list[str], tmp: Path, signum: signal.Signals, never: str,
                    ready: Callable[[], bool]) -> tuple[int, str, str]:
    """`trialledger ARGV` in its own process (TMPDIR `tmp`), sent `signum` once `ready`
    (within 90 s, else the test fails saying `never`); its exit code, stdout and stderr."""
    runner = subprocess.Popen([sys.executable, "-m", "trialledger.cli", *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert time.monotonic() < deadline, never
            assert runner.poll() is None, runner.communicate()
            time.sleep(0.05)
        runner.send_signal(signum)
        out, err = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
    return runner.returncode, out, err


@pytest.mark.parametrize(("signum", "settled_by_old_version"), [
    (signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)])
def test_a_trial_cancelled_while_verified_runs_again_whole_on_resume(
        tmp_path: Path, reachable_tmp: Path, signum: signal.Signals,
        settled_by_old_version: bool) -> None:
    """docs/SPEC.md §13: a session closed `cancelled` before its verification is recorded
    finishes nothing — the resumed job runs the trial again, agent and verifier, as an
    uncounted attempt, and scores it. (`settled_by_old_version`: the trial was left `done`
    on that session, as earlier versions settled it; a resume queues it again.)"""
    from tests.runs import in_process

    task = make_task(tmp_path / "data" / "judged", instruction="wait for the verdict",
                     test_sh=SLOW_VERIFIER, solve_sh="#!/bin/sh\necho solved > solved.txt\n")
    slow = task.folder / "tests" / "slow"  # the first verifier sleeps; the next one does not
    slow.write_text("")
    db = tmp_path / "t.db"
    argv = ["job", "run", "judged", str(task.folder), "--db", str(db), "--agent", "oracle",
            "--grace", "0.5"]
    code, _, err = _signalled_when(
        argv, reachable_tmp, signum, "the verifier never started",
        lambda: bool(list(reachable_tmp.glob("trialledger-*/verifier-*/started"))))
    assert code == 128 + signum and "Traceback" not in err, err
    with sqlite3.connect(db) as conn:
        first = conn.execute("SELECT close_reason, outcome FROM sessions").fetchall()
        if settled_by_old_version:
            conn.execute("UPDATE job_queue SET state = 'done'")
    assert first == [("cancelled", "unverified")]  # graded, stopped before its verdict
    slow.unlink()
    resumed = in_process(*argv)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    with sqlite3.connect(db) as conn:
        sessions = conn.execute("SELECT attempt, close_reason, outcome FROM sessions "
                                "ORDER BY attempt").fetchall()
        kinds = [t for (t,) in conn.execute(
            "SELECT e.type FROM events e JOIN sessions s ON s.session_id = e.session_id "
            "WHERE s.attempt = 2 ORDER BY e.seq")]
    assert sessions == [(1, "cancelled", "unverified"), (2, "normal", "verify")]
    assert "agent.launched" in kinds and "verification.recorded" in kinds  # run whole
    shown = in_process("job", "show", "judged", "--db", str(db), "--json")
    summary = json.loads(shown.stdout)
    (trial,) = summary["trials"]
    assert (trial["state"], trial["scored"], trial["reward"]) == ("done", 1, 1.0)
    assert (trial["attempts"], trial["interrupted"]) == (2, 1)  # the cancelled one uncounted
    total = next(t for t in summary["tasks"] if t["task"] is None)
    assert (total["scored"], total["unscored"], total["mean"]) == (1, 0, 1.0)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_job_prints_the_partial_summary_of_what_finished(
        tmp_path: Path, reachable_tmp: Path, signum: signal.Signals) -> None:
    """Ctrl-C (or SIGTERM) in a real `job run` once one trial finished and another is mid
    way: after the grace, stdout has the summary of the finished one, marked partial, with
    the cancelled trial listed as open; then exit 128+N."""
    make_task(tmp_path / "data" / "quick", instruction="be quick", test_sh="exit 0\n",
              solve_sh="#!/bin/sh\ntrue\n")
    make_task(tmp_path / "data" / "slow", instruction="take your time", test_sh="exit 0\n",
              solve_sh="#!/bin/sh\ntouch started\nsleep 60\n")
    db = tmp_path / "t.db"
    code, out, err = _signalled_when(
        ["job", "run", "halted", str(tmp_path / "data"), "--db", str(db), "--agent", "oracle",
         "-n", "2", "--grace", "0.5"], reachable_tmp, signum,
        "the slow agent never started mid-way",
        lambda: bool(list(reachable_tmp.glob("trialledger-*/work/started"))
                     and _queue(db).get("quick") == "done"))
    assert code == 128 + signum and "Traceback" not in err, err
    name = signal.Signals(signum).name
    said = out.index(f"partial summary (interrupted by {name}): the trials that finished; "
                     f"1 trial left for a resume")
    assert out.index("quick k=0 verify reward 1") < said, out  # the trial's line, then this
    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("│").split("│")] for line in out[said:].splitlines()
        if line.startswith("│"))}
    heads = next(line for line in out[said:].splitlines() if line.startswith("┃"))
    names = [c.strip() for c in heads.strip("┃").split("┃")]
    quick, slow = (dict(zip(names, rows[t], strict=True)) for t in ("quick", "slow"))
    assert (quick["trials"], quick["scored"], quick["mean"]) == ("1", "1", "1.000"), out
    assert (slow["open"], slow["scored"], slow["mean"]) == ("1", "0", ""), out
    assert re.search(r"^partial: 1 trial\(s\) still open.*\n  slow #0 \(\S+\): queued$",
                     out, re.M), out


def _queue(db: Path) -> dict[str, str]:
    """Each task's trial state in the job's queue, as far as the store file says yet."""
    if not db.exists():
        return {}
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            return dict(conn.execute("SELECT task, state FROM job_queue").fetchall())
    except sqlite3.Error:
        return {}
