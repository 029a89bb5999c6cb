"""Jobs (docs/SPEC.md §13) with the real Codex CLI through a scripted endpoint, on SQLite:
tasks × k trials run concurrently, each decided once, summarised by the SQL views,
resumed after a SIGKILL, and refused when the configuration changes."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from tests.runs import codex_path, make_task, on_a_terminal
from trialledger import cli
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint, message, shell, status
from trialledger.adapters.jobs.queue import pass_at_k
from trialledger.store.jobs import trial_id

TASKS = {  # name: (test.sh, the endpoint's replies to this task's requests)
    "clean-a": ("exit 0\n", [message("done")]),
    "clean-b": ("exit 0\n", [message("done")]),
    "clean-c": ("exit 0\n", [message("done")]),
    "fails": ("exit 1\n", [message("I give up")]),
    "flaky": ("exit 0\n", [status(429), message("after a retry")]),
    "tool": ("grep -q hello out.txt\n", [shell("echo hello > out.txt"), message("wrote it")]),
}
BY_TURN = {"tool"}  # replies chosen by the session's turn, not by arrival
SETTINGS = ["--set", "request_max_retries=0", "--set", "stream_max_retries=0"]


def dataset(root: Path) -> Path:
    """A dataset folder: one subfolder per task, each prompt carrying a routing marker."""
    for name, (test_sh, _) in TASKS.items():
        make_task(root / name, instruction=f"[task {name}] do the task", test_sh=test_sh)
    return root


@pytest.fixture
def endpoint() -> Iterator[ScriptedEndpoint]:
    routes: dict[str, list[Reply]] = {f"[task {n}]": r for n, (_, r) in TASKS.items()
                                      if n not in BY_TURN}
    turns = {f"[task {n}]": TASKS[n][1] for n in BY_TURN}
    with ScriptedEndpoint([message("unrouted")], routes=routes, turns=turns) as server:
        yield server


def builders(data: Path, prefix: str, count: int, command: str) -> dict[str, list[Reply]]:
    """`count` tasks whose verifier wants built.txt; the endpoint's replies by turn: run
    `command` (which builds it), then finish."""
    for n in range(count):
        make_task(data / f"{prefix}-{n}", instruction=f"[task {prefix}-{n}] build it",
                  test_sh="test -f built.txt\n")
    return {f"[task {prefix}-{n}]": [shell(command), message("built")] for n in range(count)}


def job_args(db: Path, url: str, *extra: str) -> list[str]:
    return ["--db", str(db), "--model-base-url", url, "--model", "m", "--codex-bin",
            codex_path(), *SETTINGS, *extra]


def rows(db: Path, sql: str) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql)]


def test_a_job_decides_every_trial_once_and_its_summary_is_the_sql(
        tmp_path: Path, endpoint: ScriptedEndpoint, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "jobs.db"
    code = cli.main(["job", "run", "bench", str(dataset(tmp_path / "data")), "-k", "2",
                     "-n", "3", "--max-attempts", "2", *job_args(db, endpoint.url)])
    printed = capsys.readouterr().out
    assert code == 0  # every trial decided: "fails" is scored with reward 0
    trials = rows(db, "SELECT * FROM job_trials ORDER BY task, k_index")
    assert [(t["task"], t["k_index"]) for t in trials] == [
        (name, k) for name in sorted(TASKS) for k in range(2)]
    assert all(t["trial_id"] == trial_id("bench", t["task"], t["k_index"]) for t in trials)
    assert all(t["state"] == "done" and t["outcome"] == "verify" for t in trials), trials
    sessions = rows(db, "SELECT * FROM sessions")
    finals = [s for s in sessions if s["outcome"] == "verify"]
    assert sorted(s["trial_id"] for s in finals) == sorted(t["trial_id"] for t in trials)
    retried = [s for s in sessions if s["outcome"] == "retry"]
    assert len(retried) == sum(r.kind == "status" for r in endpoint.routed["[task flaky]"])
    assert retried and all(s["task"] == "flaky" for s in retried)
    for first in retried:  # each 429 retried as a new session naming it
        (second,) = [s for s in sessions if s["retry_of"] == first["session_id"]]
        assert (second["trial_id"], second["attempt"]) == (first["trial_id"], 2)
    tasks = {t["task"]: t for t in rows(db, "SELECT * FROM job_tasks WHERE task IS NOT NULL")}
    assert {t["dataset"] for t in tasks.values()} == {"data"}  # the dataset folder's name
    for name, task in tasks.items():
        mine = [t for t in trials if t["task"] == name]
        by_hand = [t["reward"] for t in mine if t["scored"]]
        assert task["trials"] == 2 and task["scored"] == len(by_hand)
        assert task["mean_reward"] == pytest.approx(sum(by_hand) / len(by_hand))
        expected = pass_at_k(len(by_hand), sum(r >= 1 for r in by_hand), 2)
        assert task["pass_at_k"] == pytest.approx(expected)
        assert task["retries"] == sum(1 for s in retried if s["task"] == name)
    assert tasks["fails"]["pass_at_k"] == 0.0 and tasks["clean-a"]["pass_at_k"] == 1.0
    assert "fails k=0 verify reward 0" in printed


def test_the_exit_code_says_whether_every_trial_was_scored(
        tmp_path: Path, endpoint: ScriptedEndpoint, capsys: pytest.CaptureFixture[str]) -> None:
    data = dataset(tmp_path / "data")
    db = tmp_path / "jobs.db"
    assert cli.main(["job", "run", "ok", str(data), "--include", "clean-*", "-n", "2",
                     *job_args(db, endpoint.url)]) == 0
    assert cli.main(["job", "show", "ok", "--db", str(db), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [t["task"] for t in shown["tasks"]] == ["clean-a", "clean-b", "clean-c", None]
    assert all(t["scored"] == 1 and t["reward"] == 1.0 for t in shown["trials"])


def test_a_changed_configuration_is_refused_naming_the_field(
        tmp_path: Path, endpoint: ScriptedEndpoint, capsys: pytest.CaptureFixture[str]) -> None:
    data = dataset(tmp_path / "data")
    db = tmp_path / "jobs.db"
    assert cli.main(["job", "run", "j", str(data / "clean-a"), *job_args(db, endpoint.url)]) == 0
    capsys.readouterr()
    before = rows(db, "SELECT COUNT(*) AS n FROM events")
    changed = job_args(db, endpoint.url)
    changed[changed.index("m")] = "another-model"
    assert cli.main(["job", "run", "j", str(data / "clean-a"), *changed]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model differ" in err, err
    assert rows(db, "SELECT COUNT(*) AS n FROM events") == before
    assert cli.main(["job", "run", "j", str(data / "clean-a"), *job_args(db, endpoint.url),
                     "-k", "2"]) == 0  # a larger k adds trials
    assert len(rows(db, "SELECT * FROM job_trials WHERE job = 'j'")) == 2
    capsys.readouterr()
    assert cli.main(["job", "run", "j", str(data / "clean-a"), *job_args(db, endpoint.url),
                     "-k", "1"]) == 2  # a smaller one would drop trials
    assert "a smaller -k 1 would drop trials" in capsys.readouterr().err
    assert cli.main(["job", "show", "nope", "--db", str(db)]) == 2
    assert capsys.readouterr().err.strip() == "trialledger: no job named nope"


def test_a_killed_job_resumes_with_nothing_lost_or_run_twice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    turns = builders(data, "slow", 3, "sleep 3; echo built > built.txt")
    db = tmp_path / "jobs.db"
    with ScriptedEndpoint([message("unrouted")], turns=turns) as endpoint:
        argv = [sys.executable, "-m", "trialledger.cli", "job", "run", "resume", str(data),
                "-n", "2", *job_args(db, endpoint.url)]
        first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(sqlite3.OperationalError):  # not built yet
                    mid = rows(db, "SELECT s.session_id FROM tool_calls t JOIN sessions s ON "
                                   "s.session_id = t.session_id WHERE t.completed_at IS NULL "
                                   "AND s.state = 'running'")
                    if mid:
                        break  # an agent is mid-tool-call
                time.sleep(0.2)
            else:
                pytest.fail("no session reached its tool call within 60 s")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
        finally:
            if first.poll() is None:
                first.kill()
        assert cli.main(["job", "run", "resume", str(data), "-n", "2",
                         *job_args(db, endpoint.url)]) == 0
    sessions = rows(db, "SELECT * FROM sessions")
    recovered = {s["session_id"] for s in sessions if s["close_reason"] == "recovered"}
    killed = mid[0]["session_id"]
    assert killed in recovered, "the session killed mid-tool-call was recovered"
    kinds = [r["type"] for r in rows(db, f"SELECT type FROM events WHERE session_id = "
                                          f"'{killed}' ORDER BY seq")]
    assert "sandbox.lost" in kinds and "item.started" in kinds  # its evidence kept
    finals: dict[str, int] = {}
    for s in sessions:
        if s["outcome"] == "verify":
            finals[s["trial_id"]] = finals.get(s["trial_id"], 0) + 1
    assert sorted(finals.values()) == [1, 1, 1]  # every trial decided exactly once
    assert all(s["state"] == "closed" for s in sessions)
    assert cli.main(["audit", "--db", str(db)]) == 0


@given(st.integers(0, 30), st.integers(0, 30), st.integers(1, 10))
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int) -> None:
    c = min(c, n)
    expected = None if n < k else 1 - math.comb(n - c, k) / math.comb(n, k)
    got = pass_at_k(n, c, k)
    assert (got is None) == (expected is None)
    if expected is not None:
        assert got == pytest.approx(expected)


def test_task_names_must_be_unique_and_present(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    make_task(tmp_path / "a" / "same", test_sh="exit 0\n")
    make_task(tmp_path / "b" / "same", test_sh="exit 0\n")
    code = cli.main(["job", "run", "dup", str(tmp_path / "a"), str(tmp_path / "b"),
                     "--db", str(tmp_path / "j.db"), "--model-base-url", "http://127.0.0.1:9",
                     "--model", "m"])
    assert code == 2 and "two tasks are named same" in capsys.readouterr().err
    assert not (tmp_path / "j.db").exists()
    assert os.path.isdir(tmp_path / "a")


@pytest.mark.anyio
async def test_the_job_views_agree_on_both_databases(db: str) -> None:
    """job_trials / job_tasks over imported sessions: scored, mean reward, pass@k by hand."""
    from tests.scenarios import CLEAN, run
    from trialledger.store import Ledger
    from trialledger.store.jobs import Jobs

    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        config = {"model": "m", "settings": {}, "grants": [], "k": 2, "max_attempts": 1}
        await jobs.define("j", {**config, "k": 3},
                          [("t", "/tasks/t"), ("zero", "/tasks/zero"), ("short", "/t/s")])
        verdicts: dict[str, list[float | None]] = {
            "t": [1.0, 0.0, 0.0], "zero": [0.0, 0.0, 0.0], "short": [1.0, 1.0, None]}
        for name, rewards in verdicts.items():
            for index, reward in enumerate(rewards):
                log = run(CLEAN, 0)
                log.events[0]["data"].update(trial_id=trial_id("j", name, index), task=name)
                if reward is not None:  # else closed unverified: unscored, never a 0
                    log.add("verification.recorded",
                            {"rewards": {"reward": reward}, "detail": None})
                log.add("session.closed", {"reason": "normal"})
                await ledger.import_log(log.events)
        async with ledger._engines.writer.begin() as conn:  # finished: no longer queued
            await conn.execute(text("UPDATE job_queue SET state = 'done'"))
        by_task = {row["task"]: row for row in await jobs.tasks("j")}
        task = by_task["t"]
        trials = [t for t in await jobs.trials("j") if t["task"] == "t"]
        passk = {(p["task"], p["k"]): p["pass_at_k"] for p in await jobs.passk("j")}
    assert [t["scored"] for t in trials] == [1, 1, 1]
    assert [t["reward"] for t in trials] == [1.0, 0.0, 0.0]
    assert task["mean_reward"] == pytest.approx(1 / 3)
    # K = 3 is not in Harbor's k set {2, 4, 5, …}: the deprecated pass_at_k is null, and
    # job_passk has pass@2 = 1 − C(2, 2)/C(3, 2).
    assert task["pass_at_k"] is None
    assert passk[("t", 2)] == pytest.approx(1 - math.comb(2, 2) / math.comb(3, 2))
    assert passk[("t", 2)] == pytest.approx(pass_at_k(3, 1, 2))
    assert (task["trials"], task["scored"], task["retries"]) == (3, 3, 0)
    assert task["total_tokens"] is not None and task["wall_s"] > 0
    assert passk[("zero", 2)] == 0.0 and by_task["zero"]["mean_reward"] == 0.0
    short = by_task["short"]  # 2 of 3 scored; the unverified one counts 0 and fails
    assert (short["scored"], short["unscored"], short["mean_reward"]) == (2, 1, 1.0)
    assert short["mean"] == pytest.approx(2 / 3) and passk[("short", 2)] == 1.0


def test_sigterm_cancels_running_trials_releases_them_and_resume_completes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    turns = builders(data, "long", 2, "sleep 30; echo built > built.txt")
    db = tmp_path / "jobs.db"
    with ScriptedEndpoint([message("unrouted")], turns=turns) as endpoint:
        argv = [sys.executable, "-m", "trialledger.cli", "job", "run", "stop", str(data),
                "-n", "2", "--grace", "1", *job_args(db, endpoint.url)]
        first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(sqlite3.OperationalError):
                    if len(rows(db, "SELECT 1 FROM tool_calls")) == 2:
                        break  # both agents are in their long tool call
                time.sleep(0.2)
            else:
                pytest.fail("the agents did not reach their tool calls within 60 s")
            first.send_signal(signal.SIGTERM)
            _, err = first.communicate(timeout=60)
        finally:
            if first.poll() is None:
                first.kill()
        assert first.returncode == 143 and "Traceback" not in err, err
        queue = rows(db, "SELECT state, lease_token FROM job_queue")
        assert queue == [{"state": "queued", "lease_token": None}] * 2  # released
        cancelled = rows(db, "SELECT * FROM sessions WHERE close_reason = 'cancelled'")
        assert len(cancelled) == 2 and all(s["state"] == "closed" for s in cancelled)
        endpoint.turns.update({f"[task long-{n}]": [shell("echo built > built.txt"),
                                                    message("ok")] for n in range(2)})
        assert cli.main(["job", "run", "stop", str(data), "-n", "2",
                         *job_args(db, endpoint.url)]) == 0
    trials = rows(db, "SELECT * FROM job_trials")
    assert [(t["scored"], t["reward"]) for t in trials] == [(1, 1.0), (1, 1.0)]
    assert all(t["attempts"] == 2 for t in trials)  # the cancelled one, then the scored one


def test_workers_on_postgresql_take_over_a_dead_workers_trial(
        tmp_path: Path, postgres: Any) -> None:
    """`job run` and two `worker`s share a job; one worker is SIGKILLed while its agent runs;
    its lease expires and another takes the trial over. Checked from the event log."""
    db = postgres.create_database()
    data = tmp_path / "data"
    turns = builders(data, "w", 4, "sleep 3; echo built > built.txt")
    # A 12 s lease: each PostgreSQL call then has 4 s (a third), which a loaded CI machine
    # running two test processes beside these three needs (at 3 s, a 2 s call deadline cut
    # the leader's connection as an outage); the takeover waits out those 12 s.
    common = ["--lease-s", "12", "--codex-bin", codex_path()]
    procs: dict[str, subprocess.Popen[str]] = {}
    with ScriptedEndpoint([message("unrouted")], turns=turns) as endpoint:
        def start(name: str, *argv: str) -> None:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "trialledger.cli", *argv, "--db", db,
                 "--model-base-url", endpoint.url, "--runner-id", name, *common],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        try:
            start("leader", "job", "run", "shared", str(data), "--model", "m", *SETTINGS)
            worker = ["worker", "--job", "shared"]
            held: list[Any] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not held:
                with contextlib.suppress(Exception):
                    held = _pg_rows(db, "SELECT 1 FROM jobs")
                time.sleep(0.2)
            assert held, "the job was not created within 60 s"
            start("doomed", *worker)
            start("helper", *worker)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                running = _pg_rows(db, "SELECT s.session_id FROM sessions s JOIN tool_calls t "
                                       "ON t.session_id = s.session_id WHERE s.runner_id = "
                                       "'doomed' AND s.state = 'running'")
                if running:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the doomed worker never ran an agent")
            procs["doomed"].send_signal(signal.SIGKILL)
            for name in ("leader", "helper"):
                _, err = procs[name].communicate(timeout=180)
                assert procs[name].returncode == 0, (name, err)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    sessions = _pg_rows(db, "SELECT session_id, trial_id, runner_id, outcome, close_reason "
                            "FROM sessions")
    finals = sorted(s[1] for s in sessions if s[3] == "verify")
    assert finals == sorted({s[1] for s in sessions}) and len(finals) == 4  # once each
    taken = [s for s in sessions if s[2] == "doomed"]
    assert taken and all(s[4] == "recovered" for s in taken)  # recovered by its taker
    # No two live sessions of one trial at any moment: a trial's sessions never overlap in
    # the global order of events (each one's first event comes after the last one closed).
    spans = _pg_rows(db, "SELECT s.trial_id, MIN(e.position), MAX(e.position) FROM events e "
                         "JOIN sessions s ON s.session_id = e.session_id "
                         "GROUP BY s.trial_id, s.session_id ORDER BY s.trial_id, 2")
    for (trial_a, _, end_a), (trial_b, start_b, _) in itertools.pairwise(spans):
        if trial_a == trial_b:
            assert start_b > end_a, f"two live sessions of trial {trial_a}"
    queue = _pg_rows(db, "SELECT state FROM job_queue")
    assert [q[0] for q in queue] == ["done"] * 4


def _pg_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query on the test PostgreSQL (asyncpg via the store's own engine URL)."""
    import anyio
    from sqlalchemy import text as sql_text

    from trialledger.store.engine import open_engines

    async def go() -> list[tuple[Any, ...]]:
        async with open_engines(url) as engines, engines.reader.connect() as conn:
            return [tuple(r) for r in (await conn.execute(sql_text(sql))).all()]

    return anyio.run(go)


def test_a_task_whose_environment_fails_is_counted_never_run(
        tmp_path: Path, endpoint: ScriptedEndpoint, capsys: pytest.CaptureFixture[str]) -> None:
    data = dataset(tmp_path / "data")
    make_task(data / "broken", instruction="[task broken] x", test_sh="exit 0\n",
              toml='[environment]\nimage_archive = "missing.tar"\n')
    db = tmp_path / "jobs.db"
    code = cli.main(["job", "run", "env", str(data), "--include", "clean-a", "--include",
                     "broken", *job_args(db, endpoint.url)])
    assert code == 1  # a trial ended unscored: its environment failed
    assert "broken: environment_failed: image_archive missing.tar: no such file" in (
        capsys.readouterr().out)
    trials = {t["task"]: t for t in rows(db, "SELECT * FROM job_trials")}
    assert trials["broken"]["state"] == "environment_failed"
    assert trials["broken"]["attempts"] == 0 and trials["clean-a"]["scored"] == 1
    assert not rows(db, "SELECT 1 FROM sessions WHERE task = 'broken'")
    # --json keeps stdout for the trials' lines: the failure is a line on stderr
    assert cli.main(["job", "run", "env-json", str(data), "--include", "broken", "--json",
                     *job_args(tmp_path / "json.db", endpoint.url)]) == 1
    said = capsys.readouterr()
    assert not said.out and ("trialledger: broken: environment_failed: image_archive "
                             "missing.tar: no such file") in said.err, said
    # Once its environment can be prepared, the next run gives the task its trials back.
    make_task(data / "broken", instruction="[task broken] x", test_sh="exit 0\n", toml="")
    code = cli.main(["job", "run", "env", str(data), "--include", "clean-a", "--include",
                     "broken", *job_args(db, endpoint.url)])
    assert code == 0, capsys.readouterr().out
    trials = {t["task"]: t for t in rows(db, "SELECT * FROM job_trials")}
    assert trials["broken"]["scored"] == 1 and trials["clean-a"]["attempts"] == 1


@pytest.mark.anyio
async def test_appends_are_fenced_by_the_trials_lease(db: str) -> None:
    """Once a trial is taken over, its old holder's appends are refused, in the append's own
    transaction, and nothing of theirs is stored; the new holder's go through."""
    from tests.scenarios import claimed_session
    from trialledger.core.seed import validate_seed
    from trialledger.store import LeaseLost, Ledger

    async with await Ledger.open(db) as ledger:
        jobs, old, seeded, log = await claimed_session(ledger, "old-holder")
        await ledger.append(seeded.session_id, log.events[1:3],
                            fence=(old.trial_id, old.token))
        await anyio.sleep(0.5)  # the old holder's lease expires
        new = await jobs.claim("f", "new-holder", 60)
        assert new is not None and new.trial_id == old.trial_id and new.token != old.token
        with pytest.raises(LeaseLost):
            await ledger.append(seeded.session_id, log.events[3:5],
                                fence=(old.trial_id, old.token))
        with pytest.raises(LeaseLost):
            await ledger.start(validate_seed(log.events[0]["data"]),
                               fence=(old.trial_id, old.token))
        assert len(await ledger.events(seeded.session_id)) == 3  # nothing of theirs after
        assert len(await ledger.sessions(trial_id=old.trial_id)) == 1
        await ledger.append(seeded.session_id, log.events[3:5], fence=(new.trial_id, new.token))
        assert len(await ledger.events(seeded.session_id)) == 5


def test_on_a_terminal_the_progress_is_shown_live(tmp_path: Path) -> None:
    """Through a real pseudo-terminal: the rich display shows trials by state and the
    retries by cause, refreshed from the store. One trial runs for seconds, so a refresh
    must see it running, however fast or loaded the machine is."""
    data = tmp_path / "data"
    make_task(data / "flaky", instruction="[task flaky] do the task", test_sh="exit 0\n")
    make_task(data / "slow", instruction="[task slow] take your time", test_sh="exit 0\n")
    routes = {"[task flaky]": TASKS["flaky"][1]}
    turns = {"[task slow]": [shell("sleep 3"), message("done")]}
    db = tmp_path / "jobs.db"
    with ScriptedEndpoint([message("unrouted")], routes=routes, turns=turns) as endpoint:
        argv = [sys.executable, "-m", "trialledger.cli", "job", "run", "tty", str(data),
                "--max-attempts", "2", "-n", "1", *job_args(db, endpoint.url)]
        text = on_a_terminal(argv, columns=160)
    assert "running 1" in text and "done 2" in text, text[-2000:]
    assert re.search(r"retries: \S+ ×1", text), text[-2000:]  # the 429, by its cause


def test_the_progress_line_says_states_and_retries_by_cause() -> None:
    from trialledger.adapters.console.live import progress_text

    line = progress_text({"queued": 3, "running": 2, "done": 5, "environment_failed": 1,
                          "retries": {"http_429": 2, "lost": 1}})
    assert line == ("queued 3 · running 2 · done 5 · environment failed 1 · "
                    "retries: http_429 ×2, lost ×1")


def test_the_waits_line_names_each_task_and_what_its_build_waits_on() -> None:
    from trialledger.adapters.console.live import waits_text
    from trialledger.adapters.images.environment import BuildWait

    line = waits_text({"lru-cache": BuildWait("building", (4, 9)),
                       "fresh": BuildWait("building"), "twin": BuildWait("waiting")})
    assert line == ("building fresh · building lru-cache (step 4/9) · "
                    "waiting for build of twin")
    assert waits_text({}) == ""


@pytest.mark.anyio
async def test_a_worker_whose_grants_differ_from_the_jobs_is_refused(tmp_path: Path) -> None:
    """A worker brings its own secrets; their fingerprints must be the job's."""
    from trialledger.adapters.jobs.queue import job_config, worker_runner
    from trialledger.adapters.session.runner import RunOptions
    from trialledger.store import Ledger
    from trialledger.store.jobs import JobRefused, Jobs

    grant = {"name": "gym", "kind": "mcp", "required": True, "url": "http://127.0.0.1:9/mcp",
             "headers": {"Authorization": "Bearer job-token"}}
    created = RunOptions(model_base_url="http://x", model="m", grants=[grant])
    make_task(tmp_path / "t", test_sh="exit 0\n")
    async with await Ledger.open(str(tmp_path / "j.db")) as ledger:
        await Jobs(ledger).define("g", job_config(created, 1, 1), [("t", str(tmp_path / "t"))])
        other = {**grant, "headers": {"Authorization": "Bearer another-token"}}
        with pytest.raises(JobRefused, match="other grants"):
            await worker_runner(ledger, "g", RunOptions(model_base_url="http://y", model="",
                                                        grants=[other]))
        joined = await worker_runner(ledger, "g", RunOptions(
            model_base_url="http://y", model="", grants=[grant]))
        assert joined.options.model == "m" and [t.name for t in joined.tasks] == ["t"]
    stored = (tmp_path / "j.db").read_bytes()
    assert b"job-token" not in stored  # the job keeps a fingerprint, never the secret


POISONED_REWARD = ("printf '{\"reward\": %s}' $(head -c 400 /dev/zero | tr '\\0' 1) "
                   "> verdict.json")


def poisoned_dataset(data: Path) -> dict[str, list[Reply]]:
    """Two honest tasks and one whose agent writes the verdict its verifier hands on as
    the reward: `{"reward": <400 digits>}`, past every float. The endpoint's replies by
    turn."""
    for name in ("clean-a", "clean-b"):
        make_task(data / name, instruction=f"[task {name}] do it", test_sh="exit 0\n")
    make_task(data / "poisoned", instruction="[task poisoned] do it",
              test_sh='cp verdict.json "$TRIALLEDGER_VERIFIER_DIR/reward.json"\n')
    return {"[task clean-a]": [message("done")], "[task clean-b]": [message("done")],
            "[task poisoned]": [shell(POISONED_REWARD), message("planted")]}


def test_a_poisoned_trial_ends_alone_and_the_honest_ones_are_scored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    turns = poisoned_dataset(data)
    db = tmp_path / "jobs.db"
    with ScriptedEndpoint([message("unrouted")], turns=turns) as endpoint:
        code = cli.main(["job", "run", "poison", str(data), "-n", "3", "--max-attempts", "2",
                         *job_args(db, endpoint.url)])
    assert code == 1, capsys.readouterr().out  # the job ended: one trial unscored
    trials = {t["task"]: t for t in rows(db, "SELECT * FROM job_trials")}
    assert all(t["state"] == "done" and t["attempts"] == 1 for t in trials.values()), trials
    assert trials["clean-a"]["scored"] == trials["clean-b"]["scored"] == 1
    assert trials["clean-a"]["reward"] == trials["clean-b"]["reward"] == 1.0
    poisoned = trials["poisoned"]
    assert (poisoned["scored"], poisoned["outcome"]) == (0, "unverified")  # a bad reward
    (failed,) = rows(db, "SELECT data FROM events WHERE type = 'verification.failed' AND "
                         f"session_id = '{poisoned['final_session_id']}'")
    assert json.loads(failed["data"])["data"]["reason"] == "bad_reward"


def test_an_unexpected_error_ends_its_trial_never_the_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What no rule foresees (here: the reward reader raising for one trial) ends that
    trial, recorded — its session closed, the reason in the queue — and nothing else;
    a resumed job does not run it again."""
    from trialledger.adapters.session import capture

    honest = capture.read_reward

    def read_reward(tree: Any, return_code: int | None, timed_out: bool, **kw: Any) -> Any:
        if (tree.root / "boom").exists():
            raise RuntimeError("the reward reader broke")
        return honest(tree, return_code, timed_out, **kw)

    monkeypatch.setattr(capture, "read_reward", read_reward)
    data = tmp_path / "data"
    turns = poisoned_dataset(data)
    make_task(data / "poisoned", instruction="[task poisoned] do it",
              test_sh='touch "$TRIALLEDGER_VERIFIER_DIR/boom"\n')
    db = tmp_path / "jobs.db"
    with ScriptedEndpoint([message("unrouted")], turns=turns) as endpoint:
        args = ["job", "run", "boom", str(data), "-n", "3", "--max-attempts", "2",
                *job_args(db, endpoint.url)]
        assert cli.main(args) == 1  # a trial ended unscored
        trials = {t["task"]: t for t in rows(db, "SELECT * FROM job_trials")}
        assert trials["clean-a"]["scored"] == trials["clean-b"]["scored"] == 1
        assert all(t["state"] == "done" for t in trials.values()), trials
        (queued,) = rows(db, "SELECT detail FROM job_queue WHERE task = 'poisoned'")
        assert "RuntimeError: the reward reader broke" in queued["detail"]
        sessions = rows(db, "SELECT * FROM sessions WHERE task = 'poisoned'")
        assert len(sessions) == 1 and sessions[0]["state"] == "closed"
        assert cli.main(args) == 1  # resumed: nothing left to run
    assert len(rows(db, "SELECT * FROM sessions")) == 3


@pytest.mark.parametrize("failing", ["the run", "its settling"])
def test_a_store_call_that_fails_in_a_held_trial_leaves_it_to_the_next_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """A store call of a held trial fails once past its retries while its lease holds (on a
    loaded server a statement runs past its deadline): the trial is left to its next holder
    — here this job's own next claim, which finds it decided — never the end of the job
    (it used to stop `job run` with exit 2, its trials undecided)."""
    from trialledger.adapters.jobs.trial import Trial
    from trialledger.store import StoreUnavailable
    from trialledger.store.jobs import Jobs

    failed: list[str] = []

    def once(method: Any) -> Any:
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not failed and (failing == "the run" or args[1:2] == ("done",)):
                failed.append(method.__name__)
                raise StoreUnavailable("cannot use the database: TimeoutError")
            return await method(self, *args, **kwargs)
        return call

    if failing == "the run":  # read once the session ran, before the trial's result
        monkeypatch.setattr(Trial, "_final", once(Trial._final))
    else:
        monkeypatch.setattr(Jobs, "settle", once(Jobs.settle))
    task = make_task(tmp_path / "t", instruction="x", test_sh="exit 0\n",
                     solve_sh="#!/bin/sh\nexit 0\n")
    db = tmp_path / "jobs.db"
    assert cli.main(["job", "run", "blip", str(task.folder), "--agent", "oracle",
                     "--db", str(db)]) == 0
    assert failed
    assert [r["state"] for r in rows(db, "SELECT state FROM job_queue")] == ["done"]
    (session,) = rows(db, "SELECT outcome FROM sessions")  # decided once, never run again
    assert session["outcome"] == "verify"


@pytest.mark.anyio
async def test_a_store_that_fails_every_run_stops_the_job_past_its_retry_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store answers claims but fails every run of the trial: the job stops the trial
    and claims it again after a growing pause, and once `store_retry_s` passed with no
    trial settled it raises the store's error (the job run's one line, exit 2) — never
    claiming, stopping and releasing the same trial for ever."""
    from trialledger.adapters.jobs.queue import JobRunner
    from trialledger.adapters.jobs.trial import Trial
    from trialledger.adapters.session.runner import RunOptions
    from trialledger.store import Ledger, StoreUnavailable
    from trialledger.store.jobs import Jobs

    failures: list[int] = []

    async def failing(self: Any, *args: Any) -> Any:
        failures.append(1)
        raise StoreUnavailable("cannot use the database: TimeoutError")

    monkeypatch.setattr(Trial, "_final", failing)
    task = make_task(tmp_path / "t", instruction="x", test_sh="exit 0\n",
                     solve_sh="#!/bin/sh\nexit 0\n")
    options = RunOptions(agent="oracle", store_retry_s=2.0)
    async with await Ledger.open(str(tmp_path / "jobs.db")) as ledger:
        with anyio.fail_after(60), pytest.raises(StoreUnavailable, match="TimeoutError"):
            await JobRunner(ledger, "failing", [task], options).run()
        assert 3 <= len(failures) <= 6, failures  # paused 0.25, 0.5, 1, 2 s between them
        (trial,) = await Jobs(ledger).trials("failing")
        assert trial["state"] == "queued"  # released, never settled done
        assert len(await ledger.sessions()) == 1  # its session ran once, decided


@pytest.mark.anyio
async def test_a_jobs_prepared_images_are_held_until_its_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each task's environment is held (`images_held`: kept by `cache prune`) from its
    preparation until the job's run ends, not only while one of its sessions lives: a
    prune between two trials of a task must not take the image the next one runs on."""
    from trialledger.adapters.images import imagestore
    from trialledger.adapters.jobs import queue
    from trialledger.adapters.session.runner import RunOptions
    from trialledger.store import Ledger

    seen: list[str] = []

    @contextlib.contextmanager
    def held(environment: Any) -> Iterator[None]:
        seen.append("held")
        yield
        seen.append("released")

    monkeypatch.setattr(imagestore, "images_held", held)
    tasks = [make_task(tmp_path / name, instruction="x", test_sh="exit 0\n",
                       solve_sh="#!/bin/sh\nexit 0\n") for name in ("a", "b")]
    async with await Ledger.open(str(tmp_path / "jobs.db")) as ledger:
        runner = queue.JobRunner(ledger, "held", tasks, RunOptions(agent="oracle"), k=2,
                                 on_trial=lambda done: seen.append("trial"))
        with anyio.fail_after(120):
            await runner.run()
    assert seen.count("held") == 2 and seen.count("trial") == 4, seen
    assert seen[-2:] == ["released", "released"], seen  # after every trial, not per trial
    assert seen.index("released") > max(i for i, e in enumerate(seen) if e == "trial")


def _session(attempt: int, close_reason: str, outcome: str | None) -> dict[str, Any]:
    return {"session_id": f"s{attempt}", "attempt": attempt, "close_reason": close_reason,
            "outcome": outcome}


@pytest.mark.parametrize(("closes", "max_attempts", "runs_again"), [
    ([], 1, True),
    (["cancelled"] * 3, 1, True),  # three harness failures: each gave another attempt
    (["cancelled"] * 4, 1, False),  # a fourth: the trial ends (SPEC §13's cap)
    (["cancelled", "recovered", "cancelled", "recovered"], 5, False),
    (["normal", "cancelled", "cancelled", "cancelled"], 2, True),
    (["normal", "normal"], 2, False),
])
def test_uncounted_attempts_are_capped(closes: list[str], max_attempts: int,
                                       runs_again: bool) -> None:
    from trialledger.adapters.session.runner import next_attempt

    sessions = [_session(i + 1, reason, "retry" if reason == "normal" else "interrupted")
                for i, reason in enumerate(closes)]
    assert (next_attempt(sessions, max_attempts) is not None) is runs_again


@pytest.mark.parametrize(("close_reason", "verified", "runs_again"), [
    ("normal", True, False),  # its verifier failed: `verification.failed` ends the trial
    ("cancelled", False, True),  # stopped while its verifier ran: it finishes nothing
    ("recovered", False, True),  # its runner died before the verdict was recorded
    ("cancelled", True, False),  # stopped after its verdict was recorded
    ("recovered", True, False),
])
def test_only_a_recorded_verification_finishes_a_graded_trial(
        close_reason: str, verified: bool, runs_again: bool) -> None:
    from trialledger.adapters.jobs.trial import next_attempt

    graded = {**_session(1, close_reason, "unverified"), "verified": verified}
    assert (next_attempt([graded], 1) is not None) is runs_again


@pytest.mark.anyio
@pytest.mark.parametrize("verdict", [False, True])
async def test_a_resume_queues_again_a_trial_settled_on_a_session_cancelled_unverified(
        db: str, verdict: bool) -> None:
    """Earlier versions settled `done` a trial whose session was cancelled while its
    verifier ran; resuming the job queues it again (docs/SPEC.md §13) — but not one whose
    verification was stored before the cancel, which that verification finished."""
    from tests.scenarios import claimed_session
    from trialledger.store import Ledger

    async with await Ledger.open(db) as ledger:
        jobs, claim, seeded, log = await claimed_session(ledger, "old-version", lease_s=60)
        at = log.events[-1]["at"]
        verification = [{"type": "verification.failed", "at": at,
                         "data": {"reason": "error", "detail": "the verifier broke"}}]
        await ledger.append(seeded.session_id, [
            *log.events[1:], *(verification if verdict else []),
            {"type": "session.closed", "at": at, "data": {"reason": "cancelled"}}],
            fence=(claim.trial_id, claim.token))
        assert (await ledger.view(seeded.session_id)).outcome == "unverified"
        assert await jobs.settle(claim, "done")  # as an earlier version's resume left it
        config = {"agent": "codex", "model": "m", "settings": {}, "grants": [], "k": 1,
                  "max_attempts": 1}
        await jobs.define("f", config, [("t", "/tasks/t")])  # the job resumed
        (trial,) = await jobs.trials("f")
    assert trial["state"] == ("done" if verdict else "queued")
