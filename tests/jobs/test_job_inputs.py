"""What `job run` and `run` check before they write anything (docs/SPEC.md §13, §10):
settings, grants, the Codex binary, task folders and a resumed job's configuration and
task names, each refused in one line with exit 2 and no job left behind; task names are
folder base names; trial ids are `uuid5(NS, …)` with SPEC §2's NS (a job created with the
old private namespace keeps its ids); `--json` prints JSON only. Real sessions (the nop
agent) in real stores: SQLite files and the PostgreSQL fixture."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import text

from tests.runs import in_process, make_task
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message
from trialledger.adapters.jobs.queue import job_config
from trialledger.adapters.session.runner import RunOptions
from trialledger.adapters.tasks.task import Task
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs, trial_id

NOP = ("--agent", "nop")
OLD_NAMESPACE = uuid.UUID("6f0c35f4-5d52-4c1e-9a0b-7d1f6a0f7b11")  # before SPEC §2's NS


def task(folder: Path, *, test_sh: str | None = "exit 0\n", toml: str | None = None) -> Task:
    return make_task(folder, instruction="nothing to do", test_sh=test_sh, toml=toml)


def store_rows(db: str, sql: str) -> list[dict[str, Any]]:
    """Rows of `sql` in the store at `db` (a SQLite path or a PostgreSQL URL)."""
    async def read() -> list[dict[str, Any]]:
        async with await Ledger.open(db) as ledger, ledger._engines.reader.begin() as conn:
            return [dict(r._mapping) for r in await conn.execute(text(sql))]
    return anyio.run(read)


def one_line_refusal(done: Any, words: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


# --- everything validated before anything is written ---------------------------------------


def test_a_bad_setting_leaves_no_job_behind(db: str, tmp_path: Path) -> None:
    task(tmp_path / "alpha")
    bad = in_process("job", "run", "bench", str(tmp_path / "alpha"), "--db", db, *NOP,
                     "--set", "verify_after_agent_error=maybe")
    one_line_refusal(bad, "verify_after_agent_error")
    assert not store_rows(db, "SELECT name FROM jobs")
    fixed = in_process("job", "run", "bench", str(tmp_path / "alpha"), "--db", db, *NOP,
                       "--set", "verify_after_agent_error=true")
    assert fixed.returncode == 0, fixed.stderr
    assert [r["name"] for r in store_rows(db, "SELECT name FROM jobs")] == ["bench"]


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--set", "timeout_s=-1", "timeout_s"),
    ("--set", "policy=v99", "unknown policy 'v99'"),
    ("--set", "colour=blue", "colour"),
    ("--grants", '[{"name": "x"}]', "grant"),
])
def test_bad_settings_and_grants_are_one_line_before_any_store(
        tmp_path: Path, flag: str, value: str, words: str) -> None:
    task(tmp_path / "alpha")
    if flag == "--grants":
        (tmp_path / "grants.json").write_text(value)
        value = str(tmp_path / "grants.json")
    db = tmp_path / "t.db"
    for command in (["job", "run", "bench"], ["run"]):
        done = in_process(*command, str(tmp_path / "alpha"), "--db", str(db), *NOP, flag, value)
        one_line_refusal(done, words)
        assert not db.exists()


def test_job_run_without_a_codex_binary_is_one_line(tmp_path: Path) -> None:
    task(tmp_path / "alpha")
    db = tmp_path / "t.db"
    with ScriptedEndpoint([message("done")]) as server:  # reachable: only Codex is missing
        done = in_process("job", "run", "bench", str(tmp_path / "alpha"), "--db", str(db),
                          "--model-base-url", server.url, "--model", "m",
                          "--codex-bin", str(tmp_path / "no-codex"))
    one_line_refusal(done, "no Codex CLI found")
    assert not db.exists()


# --- task names are folder base names ----------------------------------------------------------


def test_two_folders_sharing_a_declared_name_both_run(tmp_path: Path) -> None:
    shared = "[task]\nname = 'org/same'\n"
    for name in ("first", "second"):
        assert task(tmp_path / "data" / name, toml=shared).declared_name == "org/same"
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db, *NOP)
    assert done.returncode == 0, done.stderr
    trials = store_rows(db, "SELECT task, trial_id, scored FROM job_trials ORDER BY task")
    assert [(t["task"], t["scored"]) for t in trials] == [("first", 1), ("second", 1)]
    sessions = store_rows(db, "SELECT task FROM sessions ORDER BY task")
    assert [s["task"] for s in sessions] == ["first", "second"]


# --- trial ids -------------------------------------------------------------------------------


def test_trial_ids_are_uuid5_of_the_specs_namespace() -> None:
    # uuid5(c103da3a-5624-571b-8699-c4e4db20453f, "bench:hello:0"), computed once by hand
    assert trial_id("bench", "hello", 0) == "62ba3711-3ca8-5065-b599-34d0df38b80e"
    assert trial_id("bench", "hello", 1) == "1a364e64-4949-5c5c-815e-8cec4dfc156e"


def test_a_new_job_queues_its_trials_under_those_ids(tmp_path: Path) -> None:
    task(tmp_path / "hello")
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "bench", str(tmp_path / "hello"), "-k", "2", "--db", db,
                      *NOP)
    assert done.returncode == 0, done.stderr
    ids = [r["trial_id"] for r in store_rows(db, "SELECT trial_id FROM job_queue "
                                                 "ORDER BY k_index")]
    assert ids == ["62ba3711-3ca8-5065-b599-34d0df38b80e",
                   "1a364e64-4949-5c5c-815e-8cec4dfc156e"]
    sessions = store_rows(db, "SELECT trial_id FROM sessions")
    assert {s["trial_id"] for s in sessions} == set(ids)


def test_a_job_made_by_the_old_code_resumes_with_its_old_trial_ids(db: str,
                                                                    tmp_path: Path) -> None:
    """A store as the code before SPEC §2's NS left it: the job's configuration names no
    namespace, its trials' ids are uuid5 of the old one; one trial done, one queued."""
    task(tmp_path / "alpha")
    config = job_config(RunOptions(agent="nop"), 2, 1)
    old = [str(uuid.uuid5(OLD_NAMESPACE, f"old:alpha:{k}")) for k in range(2)]
    assert old[0] == "7fd43934-5e87-57bc-aac1-4dcce3e874b7"

    async def made_by_the_old_code() -> None:
        async with await Ledger.open(db) as ledger, ledger._engines.writer.begin() as conn:
            await conn.execute(text(
                "INSERT INTO jobs (name, config, k, max_attempts, created_at) "
                "VALUES ('old', :c, 2, 1, '2025-01-01T00:00:00Z')"),
                {"c": json.dumps(config, sort_keys=True, separators=(",", ":"))})
            for k, (tid, state) in enumerate(zip(old, ("done", "queued"), strict=True)):
                await conn.execute(text(
                    "INSERT INTO job_queue (trial_id, job, task, k_index, task_dir, state) "
                    "VALUES (:t, 'old', 'alpha', :k, :d, :s)"),
                    {"t": tid, "k": k, "d": str(tmp_path / "alpha"), "s": state})

    anyio.run(made_by_the_old_code)
    done = in_process("job", "run", "old", str(tmp_path / "alpha"), "-k", "2", "--db", db,
                      *NOP)
    assert done.returncode in (0, 1), done.stderr  # the 'done' trial has no session
    queue = store_rows(db, "SELECT trial_id, state FROM job_queue ORDER BY k_index")
    assert [(q["trial_id"], q["state"]) for q in queue] == [(old[0], "done"), (old[1], "done")]
    assert [s["trial_id"] for s in store_rows(db, "SELECT trial_id FROM sessions")] == [old[1]]
    grown = in_process("job", "run", "old", str(tmp_path / "alpha"), "-k", "3", "--db", db,
                       *NOP)
    assert grown.returncode in (0, 1), grown.stderr
    third = store_rows(db, "SELECT trial_id FROM job_queue WHERE k_index = 2")
    assert [t["trial_id"] for t in third] == [str(uuid.uuid5(OLD_NAMESPACE, "old:alpha:2"))]


# --- a resume names the job's tasks; --add adds ----------------------------------------------


def test_a_resume_with_other_tasks_is_refused_and_add_adds_them(db: str, tmp_path: Path) -> None:
    task(tmp_path / "one" / "alpha")
    for name in ("alpha", "beta", "gamma"):
        task(tmp_path / "many" / name)
    assert in_process("job", "run", "bench", str(tmp_path / "one"), "--db", db,
                      *NOP).returncode == 0
    other = in_process("job", "run", "bench", str(tmp_path / "many"), "--db", db, *NOP)
    one_line_refusal(other, "beta, gamma")
    assert "--add" in other.stderr
    assert [r["task"] for r in store_rows(db, "SELECT DISTINCT task FROM job_queue")] == ["alpha"]
    fewer = in_process("job", "run", "bench", str(tmp_path / "many" / "beta"), "--add",
                       "--db", db, *NOP)
    one_line_refusal(fewer, "alpha")  # --add adds; the job's own tasks are still named
    added = in_process("job", "run", "bench", str(tmp_path / "many"), "--add", "--db", db,
                       *NOP)
    assert added.returncode == 0, added.stderr
    rows = store_rows(db, "SELECT task, scored FROM job_trials ORDER BY task")
    assert [(r["task"], r["scored"]) for r in rows] == [("alpha", 1), ("beta", 1), ("gamma", 1)]


# --- a task without tests/test.sh --------------------------------------------------------------


def test_run_refuses_a_task_without_tests_up_front(tmp_path: Path) -> None:
    task(tmp_path / "untested", test_sh=None)
    db = tmp_path / "t.db"
    done = in_process("run", str(tmp_path / "untested"), "--db", str(db), *NOP)
    one_line_refusal(done, "no tests/test.sh")
    assert not db.exists()


def test_a_datasets_task_without_tests_is_skipped_with_the_reason(tmp_path: Path) -> None:
    task(tmp_path / "data" / "graded")
    task(tmp_path / "data" / "untested", test_sh=None)
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db, *NOP)
    assert done.returncode == 0, done.stderr
    assert "skipped task untested" in done.stderr and "no tests/test.sh" in done.stderr
    assert [r["task"] for r in store_rows(db, "SELECT DISTINCT task FROM job_queue")] == [
        "graded"]


# --- what `run` prints; --json is JSON only ----------------------------------------------------


@pytest.mark.parametrize(("test_sh", "reward"), [("exit 0\n", "reward=1"),
                                                 ("exit 1\n", "reward=0")])
def test_run_prints_the_reward_beside_the_outcome(tmp_path: Path, test_sh: str,
                                                  reward: str) -> None:
    task(tmp_path / "alpha", test_sh=test_sh)
    done = in_process("run", str(tmp_path / "alpha"), "--db", str(tmp_path / "t.db"), *NOP)
    assert done.returncode == 0, done.stderr  # scored, whatever the reward
    words = done.stdout.split()
    assert words[1:] == ["verify", reward], done.stdout


def test_json_output_is_json_only(tmp_path: Path) -> None:
    task(tmp_path / "data" / "alpha")
    task(tmp_path / "data" / "beta", test_sh="exit 1\n")
    db = str(tmp_path / "t.db")
    commands = [
        ["job", "run", "bench", str(tmp_path / "data"), "-k", "2", "--db", db, *NOP, "--json"],
        ["run", str(tmp_path / "data" / "alpha"), "--db", db, *NOP, "--json"],
        ["job", "show", "bench", "--db", db, "--json"],
        ["job", "ls", "--db", db, "--json"],
        ["worker", "--db", db, "--json"],
        ["ls", "--db", db, "--json"],
    ]
    for command in commands:
        done = in_process(*command)
        assert done.returncode in (0, 1), (command, done.stderr)
        lines = done.stdout.splitlines()
        if command[:2] in (["job", "show"], ["ls", "--db"]):
            json.loads(done.stdout)  # one document
        else:
            for line in lines:
                json.loads(line)  # every line a JSON value, nothing else
    trials = in_process(*commands[0]).stdout  # resumed: nothing left to run, nothing printed
    assert trials == ""


def test_codex_binary_is_checked_only_for_codex(tmp_path: Path) -> None:
    """The nop agent needs no Codex: `--codex-bin` pointing nowhere is not a refusal."""
    task(tmp_path / "alpha")
    done = in_process("run", str(tmp_path / "alpha"), "--db", str(tmp_path / "t.db"), *NOP,
                      "--codex-bin", str(tmp_path / "nowhere"))
    assert done.returncode == 0, done.stderr


def test_jobs_names_its_tasks_in_the_store(tmp_path: Path) -> None:
    """`Jobs.define` refuses other names without writing (the library, as the CLI)."""
    db = str(tmp_path / "t.db")
    config = job_config(RunOptions(agent="nop"), 1, 1)

    async def go() -> str:
        async with await Ledger.open(db) as ledger:
            jobs = Jobs(ledger)
            await jobs.define("j", config, [("a", "/x/a")])
            try:
                await jobs.define("j", config, [("a", "/x/a"), ("b", "/x/b")])
            except Exception as error:  # the message is what is checked
                return f"{type(error).__name__}: {error}"
            return "accepted"

    said = anyio.run(go)
    assert said.startswith("JobRefused: job j has no task b"), said
    assert len(store_rows(db, "SELECT trial_id FROM job_queue")) == 1


# --- sizes: task files and the reward file are capped by task_file_max_bytes -------------------

CAP_WORDS = "over the 1048576-byte cap on a task file (setting task_file_max_bytes)"


def oversized(folder: Path) -> Path:
    """A task whose instruction.md is 128 MiB (sparse: the file system holds no data)."""
    task(folder)
    os.truncate(folder / "instruction.md", 128 * 1024 * 1024)
    return folder / "instruction.md"


def test_run_refuses_an_oversized_instruction_in_one_line(tmp_path: Path) -> None:
    big = oversized(tmp_path / "huge")
    db = tmp_path / "t.db"
    done = in_process("run", str(tmp_path / "huge"), "--db", str(db), *NOP)
    one_line_refusal(done, f"{big}: 134217728 bytes, {CAP_WORDS}")
    assert not db.exists()


def test_a_datasets_oversized_task_is_skipped_with_the_reason(tmp_path: Path) -> None:
    task(tmp_path / "data" / "graded")
    big = oversized(tmp_path / "data" / "huge")
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db, *NOP)
    assert done.returncode == 0, done.stderr
    assert "skipped task huge" in done.stderr and f"{big}: 134217728 bytes" in done.stderr
    assert "Traceback" not in done.stderr
    assert [r["task"] for r in store_rows(db, "SELECT DISTINCT task FROM job_queue")] == [
        "graded"]


def test_task_file_max_bytes_is_a_setting_of_the_run(tmp_path: Path) -> None:
    task(tmp_path / "alpha")
    (tmp_path / "alpha" / "instruction.md").write_text("x" * 2000)
    db = tmp_path / "t.db"
    for command in (["job", "run", "bench"], ["run"]):
        lowered = in_process(*command, str(tmp_path / "alpha"), "--db", str(db), *NOP,
                             "--set", "task_file_max_bytes=1024")
        one_line_refusal(lowered, "instruction.md: 2000 bytes, over the 1024-byte cap")
        bad = in_process(*command, str(tmp_path / "alpha"), "--db", str(db), *NOP,
                         "--set", "task_file_max_bytes=0")
        one_line_refusal(bad, "task_file_max_bytes")
        assert not db.exists()


@pytest.mark.parametrize(("cap", "code", "outcome"), [(None, 0, "verify reward=1"),
                                                      ("1500", 1, "unverified")])
def test_a_reward_file_over_the_cap_is_a_bad_reward(tmp_path: Path, cap: str | None,
                                                    code: int, outcome: str) -> None:
    # a valid reward.json of 2013 bytes: past a cap of 1500, within the default 1 MiB
    writes = ("r=\"$TRIALLEDGER_VERIFIER_DIR/reward.json\"\n"
              "printf '{\"reward\": 1}' > \"$r\"\n"
              "head -c 2000 /dev/zero | tr '\\0' ' ' >> \"$r\"\n")
    task(tmp_path / "alpha", test_sh=writes)
    db = str(tmp_path / "t.db")
    extra = ["--set", f"task_file_max_bytes={cap}"] if cap else []
    done = in_process("run", str(tmp_path / "alpha"), "--db", db, *NOP, *extra)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stdout.split(maxsplit=1)[1].strip() == outcome, done.stdout
    gaps = store_rows(db, "SELECT code, detail FROM gaps")
    failed = [json.loads(r["data"])["data"] for r in store_rows(
        db, "SELECT data FROM events WHERE type = 'verification.failed'")]
    if cap:
        assert {"code": "unsafe_agent_file",
                "detail": "reward.json: 2013 bytes, over the 1500-byte cap"} in gaps, gaps
        assert [f["reason"] for f in failed] == ["bad_reward"], failed
    else:
        assert not gaps and not failed, (gaps, failed)
