"""The store's CLI end to end on real SQLite files (and `sql` on PostgreSQL too)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios import SCENARIOS, write_examples
from trialledger.cli import main
from trialledger.core import Policy, register_policy
from trialledger.core.policy import V1_OUTCOME_TABLE
from trialledger.store.migrate import head_revision


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    folder = tmp_path / "examples"
    write_examples(folder)
    return folder


def imported(capsys: pytest.CaptureFixture[str], db: str, examples: Path, *names: str
             ) -> list[str]:
    ids = []
    for name in names:
        code, out, err = run(capsys, "import", "--db", db, str(examples / f"{name}.jsonl"))
        assert code == 0, err
        ids.append(out.strip())
    return ids


def test_db_upgrade_builds_a_database(capsys: Any, tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    code, out, _ = run(capsys, "db", "upgrade", "--db", db)
    assert code == 0 and f"schema at revision {head_revision()}" in out and Path(db).exists()


def test_import_export_round_trip(capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    (sid,) = imported(capsys, db, examples, "recovered_then_killed_probe")
    code, out, _ = run(capsys, "export", "--db", db, "--session", sid)
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and lines[-1]["type"] == "outcome.decided"
    assert {"position", "recorded_at", "hash", "event_id", "seq", "schema"} <= set(lines[0])
    again = tmp_path / "again.jsonl"
    again.write_text(out, encoding="utf-8")
    code, out2, _ = run(capsys, "import", "--db", str(tmp_path / "other.db"), str(again))
    assert (code, out2.strip()) == (0, sid)


def test_import_scrubs_secret_env_and_reports_bad_lines(
        capsys: Any, tmp_path: Path, examples: Path, monkeypatch: Any) -> None:
    db = str(tmp_path / "t.db")
    monkeypatch.setenv("LEAKED", "hi there")  # the clean run's agent message
    code, out, _ = run(capsys, "import", "--db", db, str(examples / "clean.jsonl"),
                       "--secret-env", "LEAKED")
    assert code == 0
    code, out, _ = run(capsys, "sql", "--db", db, "--json",
                       "SELECT count(*) AS n FROM events WHERE data LIKE '%hi there%'")
    assert json.loads(out) == [{"n": 0}]
    bad = tmp_path / "bad.jsonl"
    lines = (examples / "clean.jsonl").read_text().splitlines()
    bad.write_text("\n".join([lines[0], lines[0]]) + "\n")
    code, _, err = run(capsys, "import", "--db", str(tmp_path / "x.db"), str(bad))
    assert code == 2 and "line 2:" in err and "session.seeded" in err
    assert not (tmp_path / "x.db").exists()  # nothing half-written, no store file made


@pytest.mark.parametrize("at", ["2026-02-30T00:00:00Z", "2026-11-29T24:00:00Z",
                                "\u0662\u0660\u0662\u0666-01-01T00:00:00Z"])
def test_an_impossible_time_is_refused_on_import_not_crashed_on_show(
        capsys: Any, tmp_path: Path, examples: Path, at: str) -> None:
    """`show` and the policies read each time back as a datetime: a day the calendar has
    not (or digits of another script) is a bad line at import, one line, nothing stored."""
    lines = (examples / "clean.jsonl").read_text().splitlines()
    second = json.loads(lines[1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], json.dumps({**second, "at": at}), *lines[2:]]) + "\n")
    code, out, err = run(capsys, "import", "--db", str(tmp_path / "x.db"), str(bad))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
    assert "line 2:" in err and "is not an RFC 3339 UTC timestamp" in err
    assert not (tmp_path / "x.db").exists()  # nothing stored, no store file made


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_json_cannot_hold_is_refused_on_import(
        capsys: Any, tmp_path: Path, examples: Path, number: str) -> None:
    """Python's JSON reader takes `NaN` and `1e999`; stored, they became null — the log
    silently changed. A bad line instead: one line, exit 2, nothing stored."""
    lines = (examples / "clean.jsonl").read_text().splitlines()
    item = json.dumps({"type": "item.completed", "at": json.loads(lines[2])["at"], "data": {
        "item": {"id": "i1", "type": "agent_message", "text": "hi", "x": "@@"}}})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:3], item.replace('"@@"', number), *lines[3:]]) + "\n")
    code, out, err = run(capsys, "import", "--db", str(tmp_path / "x.db"), str(bad))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
    assert "line 4:" in err and "NaN or infinite" in err
    assert not (tmp_path / "x.db").exists()  # refused before a store was opened


def _launched_with(lines: list[str], **data: Any) -> list[str]:
    """The log with its `agent.launched` holding `data` besides its own."""
    events = [json.loads(line) for line in lines]
    for event in events:
        if event["type"] == "agent.launched":
            event["data"].update(data)
            event["schema"] = 4
    return [json.dumps(e) for e in events]


@pytest.mark.parametrize(("data", "code"), [
    ({"limits": {"enforced": False, "requested": [1, 2]}}, 0),
    ({"limits": {"enforced": False, "requested": "4 cpus"}}, 0),
    ({"environment": {"kind": "image", "ref": ["a"], "digest": {"b": 1}}}, 0)])
def test_an_imported_launch_of_another_shape_is_stored_and_shown(
        capsys: Any, tmp_path: Path, examples: Path, data: dict[str, Any], code: int) -> None:
    """`agent.launched`'s limits and environment are any JSON in an imported log: the
    limits' gap and the environment's columns read what has their shape, the rest is kept
    in the event (a list crashed the gap with a traceback, and the columns' insert)."""
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(_launched_with(
        (examples / "clean.jsonl").read_text().splitlines(), **data)) + "\n")
    db = str(tmp_path / "t.db")
    done, sid, err = run(capsys, "import", "--db", db, str(log))
    assert (done, err) == (code, "")
    shown, out, err = run(capsys, "show", "--db", db, sid.strip())
    assert (shown, err) == (0, "") and f"session {sid.strip()}" in out
    _, out, _ = run(capsys, "sql", "--db", db, "--json",
                    "SELECT environment_ref, environment_digest FROM sessions")
    assert json.loads(out) == [{"environment_ref": None, "environment_digest": None}]


@pytest.mark.parametrize("fingerprints", [[1], "ab", 5])
def test_a_grant_whose_fingerprints_are_not_an_object_is_refused_on_import(
        capsys: Any, tmp_path: Path, examples: Path, fingerprints: Any) -> None:
    lines = (examples / "clean.jsonl").read_text().splitlines()
    seed = json.loads(lines[0])
    seed["data"]["grants"] = [{"name": "g", "kind": "mcp", "url": "http://127.0.0.1:9/mcp",
                               "headers": {"Authorization": "Bearer sk-grant-secret-1"},
                               "header_fingerprints": fingerprints}]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join([json.dumps(seed), *lines[1:]]) + "\n")
    code, out, err = run(capsys, "import", "--db", str(tmp_path / "t.db"), str(log))
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
    assert "header_fingerprints" in err and "sk-grant-secret-1" not in err


def test_audit_ok_then_names_a_tampered_event(capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean", "http_429")
    code, out, _ = run(capsys, "audit", "--db", db)
    assert code == 0 and "2 sessions" in out
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE events SET data = replace(data, 'say hi', 'say bye') WHERE seq = 1")
    code, _, err = run(capsys, "audit", "--db", db)
    assert code == 1 and "seq 1: hash mismatch" in err


def test_sql_reads_views_as_table_or_json_and_refuses_writes(
        capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean", "http_429", "capacity_killed")
    code, out, _ = run(capsys, "sql", "--db", db, "--json",
                       "SELECT rule, action FROM outcomes ORDER BY rule")
    assert json.loads(out) == [{"rule": "completed", "action": "verify"},
                               {"rule": "endpoint_killed", "action": "retry"},
                               {"rule": "reported", "action": "retry"}]
    code, out, _ = run(capsys, "sql", "--db", db, "SELECT state, count(*) FROM sessions "
                                                  "GROUP BY state ORDER BY state")
    assert code == 0 and "graded" in out and "lost" in out
    code, _, err = run(capsys, "sql", "--db", db, "DELETE FROM events")
    assert code == 2 and "readonly" in err.replace("-", "")
    code, _, err = run(capsys, "sql", "--db", db, "--timeout", "0.2",
                       "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                       "SELECT count(*) FROM n")
    assert code == 2 and "past its 0.2 s limit" in err


def test_sql_on_postgresql_is_read_only_and_time_limited(capsys: Any, postgres: Any) -> None:
    db = postgres.create_database()
    assert run(capsys, "db", "upgrade", "--db", db)[0] == 0
    code, _, err = run(capsys, "sql", "--db", db, "SELECT 1")
    assert code == 2 and "--create-readonly-role" in err  # never as the store's own role
    assert run(capsys, "db", "upgrade", "--db", db, "--create-readonly-role")[0] == 0
    code, out, _ = run(capsys, "sql", "--db", db, "--json", "SELECT count(*) AS n FROM outcomes")
    assert (code, json.loads(out)) == (0, [{"n": 0}])
    code, _, err = run(capsys, "sql", "--db", db, "DELETE FROM events")
    assert code == 2 and "read-only" in err
    code, _, err = run(capsys, "sql", "--db", db, "--timeout", "0.2", "SELECT pg_sleep(5)")
    assert code == 2 and "past its 0.2 s limit" in err
    # What the store's own (here: super) user could do, the reader role cannot.
    for attack in ("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                   "WHERE pid <> pg_backend_pid()",
                   "COPY (SELECT 1) TO PROGRAM 'true'",
                   "SELECT pg_read_file('/etc/hostname')"):
        code, _, err = run(capsys, "sql", "--db", db, attack)
        assert code == 2 and any(word in err for word in (
            "permission denied", "must be superuser", "must be a superuser", "read-only")), (
            attack, err)


def test_replay_diff_lists_sessions_a_new_policy_decides_otherwise(
        capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean", "context_window_reported")
    code, out, _ = run(capsys, "replay", "--db", db, "--all", "--diff")
    assert code == 0 and "0 of 2 sessions differ under each session's own policy" in out
    register_policy(Policy(name="test-strict", outcome_table={
        **V1_OUTCOME_TABLE, "context_window": ("retry", False)}))
    code, out, _ = run(capsys, "replay", "--db", db, "--all", "--diff",  # registered in
                       "--policy", "test-strict", "--json", "--jobs", "1")  # this process only
    (differs,) = json.loads(out)
    assert code == 1 and (differs["recorded"], differs["derived"]) == (
        "reported/verify", "reported/retry")


def test_recover_needs_a_runner_or_all(capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    run(capsys, "db", "upgrade", "--db", db)
    code, _, err = run(capsys, "recover", "--db", db)
    assert code == 2 and "--runner" in err
    assert SCENARIOS["clean"][0].events[0]["data"]["runner_id"] == "runner-a"
    imported(capsys, db, examples, "timeout")  # graded, not closed
    code, out, _ = run(capsys, "recover", "--db", db, "--runner", "runner-a")
    assert code == 0 and "1 sessions recovered" in out
    code, out, _ = run(capsys, "sql", "--db", db, "--json", "SELECT code FROM gaps")
    assert {"code": "verification_interrupted"} in json.loads(out)  # said, not silent


def test_out_of_date_database_names_the_upgrade(capsys: Any, tmp_path: Path) -> None:
    import sqlite3

    db = str(tmp_path / "t.db")
    run(capsys, "db", "upgrade", "--db", db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0000'")
    code, _, err = run(capsys, "audit", "--db", db)
    assert code == 2 and f"trialledger db upgrade --db {db}" in err


def test_replay_diff_under_the_example_policy_names_the_probed_session(
        capsys: Any, tmp_path: Path) -> None:
    from tests.golden import GOLDEN

    db = str(tmp_path / "golden.db")
    for path in sorted(GOLDEN.glob("*.jsonl")):
        assert run(capsys, "import", "--db", db, str(path))[0] == 0
    policy = str(Path(__file__).parents[2] / "examples" / "policy_no_probe.py")
    said = []
    for jobs in ("1", "3"):  # three processes, each loading the policy file, say the same
        code, out, _ = run(capsys, "replay", "--db", db, "--all", "--diff", "--policy",
                           "no-probe", "--policy-file", policy, "--json", "--jobs", jobs)
        said.append((code, out))
    assert said[0] == said[1]
    code, out = said[0]
    (differs,) = json.loads(out)
    assert code == 1 and (differs["recorded"], differs["derived"]) == (
        "probe/probe", "execution_error/retry")


def test_a_database_password_is_never_shown(capsys: Any) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # connections are refused
    port = closed.getsockname()[1]
    try:
        code, out, err = run(capsys, "ls", "--db",
                             f"postgresql://analyst:Pw-Hunter2-xyz@127.0.0.1:{port}/trials")
    finally:
        closed.close()
    assert code == 2 and "Pw-Hunter2" not in out + err
    assert "postgresql://analyst:***@127.0.0.1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["ls"], ["audit"], ["show", "abc"],
                                  ["export", "--session", "abc"], ["replay", "--all", "--diff"],
                                  ["sql", "SELECT 1"]])
def test_read_only_commands_refuse_a_missing_database_and_create_nothing(
        capsys: Any, tmp_path: Path, argv: list[str]) -> None:
    typo = tmp_path / "typo.db"
    code, _, err = run(capsys, *argv, "--db", str(typo))
    assert code == 2 and err.count("\n") == 1 and "no database" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("query, why", [
    ("ATTACH '{dir}/attached.db' AS a", "not allowed"),
    ("VACUUM INTO '{dir}/copy.db'", "not allowed"),
    ("PRAGMA user_version = 7", "not allowed"),
    ("SELECT load_extension('/nonexistent')", "not allowed"),
    ("SELECT zeroblob(900000000) FROM outcomes", "too big"),
    ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) "
     "SELECT printf('%.2000c', 'x') FROM r LIMIT 100000", "MiB"),
])
def test_sql_refuses_what_would_write_reach_out_or_exhaust_memory(
        capsys: Any, tmp_path: Path, examples: Path, query: str, why: str) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean")
    def files() -> list[str]:  # (a reader of a WAL database may add its -wal and -shm)
        return sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm")))

    before = files()
    code, _, err = run(capsys, "sql", "--db", db, query.format(dir=tmp_path))
    assert code == 2 and why in err and err.count("\n") == 1, err
    assert files() == before


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf"])
def test_sql_timeout_must_be_a_real_limit(capsys: Any, tmp_path: Path, examples: Path,
                                          timeout: str) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean")
    code, _, err = run(capsys, "sql", "--db", db, "--timeout", timeout, "SELECT 1")
    assert code == 2 and "--timeout" in err


def test_sql_reads_a_path_with_uri_characters(capsys: Any, tmp_path: Path,
                                              examples: Path) -> None:
    folder = tmp_path / "odd %20 #x ?y"
    folder.mkdir()
    db = str(folder / "t.db")
    imported(capsys, db, examples, "clean")
    code, out, err = run(capsys, "sql", "--db", db, "--json", "SELECT COUNT(*) AS n FROM sessions")
    assert code == 0 and json.loads(out) == [{"n": 1}], err


@pytest.mark.parametrize("db", ["mysql://u@h/db", "http://example.com/x"])
def test_an_unsupported_database_url_is_one_line(capsys: Any, db: str) -> None:
    code, _, err = run(capsys, "ls", "--db", db)
    assert code == 2 and "not supported" in err and err.count("\n") == 1


def _hostile(tmp_path: Path, examples: Path, kind: str) -> str:
    """A log whose second-to-last line is hostile (or a path that is not a log)."""
    if kind == "dev-zero":
        return "/dev/zero"
    good = (examples / "clean.jsonl").read_bytes().splitlines()
    path = tmp_path / f"{kind}.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
        return str(path)
    bad = {"invalid-utf8": b'{"type": "codex.unknown", "at": "2026-11-29T08:00:09Z", '
                           b'"data": {"line": "\xff\xfe"}}',
           "deep": b'{"type": "codex.unknown", "at": "2026-11-29T08:00:09Z", "data": '
                   + b'{"line": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
           "int128": b'{"type": "usage.native", "at": "2026-11-29T08:00:09Z", "data": '
                     b'{"total": {"input_tokens": 340282366920938463463374607431768211456, '
                     b'"output_tokens": 1, "total_tokens": 2}, "last": null}}',
           "surrogate": b'{"type": "codex.unknown", "at": "2026-11-29T08:00:09Z", '
                        b'"data": {"line": "\\ud800"}}'}[kind]
    path.write_bytes(b"\n".join([*good[:-1], bad, good[-1]]) + b"\n")
    return str(path)


@pytest.mark.parametrize("kind", ["invalid-utf8", "deep", "int128", "surrogate", "dev-zero",
                                  "fifo"])
def test_hostile_logs_are_one_line_and_store_nothing(
        capsys: Any, tmp_path: Path, examples: Path, kind: str) -> None:
    log = _hostile(tmp_path, examples, kind)
    db = str(tmp_path / "t.db")
    code, _, err = run(capsys, "import", "--db", db, log)
    assert code == 2 and err.count("\n") == 1, err
    assert not Path(db).exists()  # refused before the store was even opened
    code, _, err = run(capsys, "replay", "--log", log)
    assert code == 2 and err.count("\n") == 1, err


def test_audit_names_an_event_whose_text_is_damaged(capsys: Any, tmp_path: Path,
                                                     examples: Path) -> None:
    import sqlite3

    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean")
    with sqlite3.connect(db) as conn:  # bytes that are no UTF-8, as a bad sector leaves
        conn.execute("UPDATE events SET data = CAST(X'7B22FF' AS TEXT) WHERE seq = 3")
    code, _, err = run(capsys, "audit", "--db", db)
    assert code == 1 and "seq 3 is damaged" in err and err.count("\n") == 1, err


def test_audit_runs_the_database_integrity_check(capsys: Any, tmp_path: Path,
                                                 examples: Path) -> None:
    import sqlite3

    db = tmp_path / "t.db"
    imported(capsys, str(db), examples, "clean", "http_429")
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")  # one file to damage
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = "
                            "'events_type'").fetchone()[0]
    raw = bytearray(db.read_bytes())
    start = (root - 1) * page
    raw[start + 8:start + page] = b"\x00" * (page - 8)  # an index page's cells gone
    db.write_bytes(bytes(raw))
    code, _, err = run(capsys, "audit", "--db", str(db))
    assert code == 1 and "damaged" in err, err


def test_show_and_export_take_a_unique_prefix_and_name_the_candidates_otherwise(
        capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = str(tmp_path / "t.db")
    first, second = imported(capsys, db, examples, "clean", "http_429")
    shared = next(i for i in range(len(first)) if first[i] != second[i])
    code, out, err = run(capsys, "export", "--db", db, "--session", first[:shared + 1])
    assert code == 0 and json.loads(out.splitlines()[0])["session_id"] == first, err
    code, out, _ = run(capsys, "show", "--db", db, second[:shared + 1])
    assert code == 0 and second in out
    code, _, err = run(capsys, "show", "--db", db, first[:shared])  # both start so
    assert code == 2 and first in err and second in err and err.count("\n") == 1
    code, out, _ = run(capsys, "ls", "--db", db, "--json")
    assert {row["runner_id"] for row in json.loads(out)} == {"runner-a"}


def test_a_full_disk_says_disk_full(tmp_path: Path, examples: Path) -> None:
    # A 200 KiB tmpfs in a private mount namespace of a child: no host setting changes.
    import subprocess
    import sys

    lines = (examples / "clean.jsonl").read_text().splitlines()
    big = {"type": "codex.unknown", "at": json.loads(lines[2])["at"],
           "data": {"line": "x" * 300_000}}
    log = tmp_path / "big.jsonl"
    log.write_text("\n".join([*lines[:3], json.dumps(big), *lines[3:]]) + "\n")
    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=200k tmpfs "$1" && exec "$2" -m trialledger.cli import '
         '--db "$1/t.db" "$3"', "sh", str(small), sys.executable, str(log)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.strip().endswith("disk full"), done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["ls", "--state", "bogus"], "invalid choice"),
    (["run", "/nonexistent-task", "--model-base-url", "http://127.0.0.1:9", "--model", "m"],
     "no such task folder"),
    (["run", ".", "--model-base-url", "http://x", "--model", "m", "--max-attempts", "0"],
     "at least 1"),
    (["no-such-command"], "invalid choice"),
    (["sql", "--timeout", "0", "SELECT 1"], "--timeout must be more than 0"),
    (["job", "run", "j", ".", "--model-base-url", "http://x", "--model", "m", "--lease-s",
      "0"], "above 0"),
    (["job", "run", "j", ".", "--model-base-url", "http://x", "--model", "m", "--grace",
      "nan"], "0 or more"),
    (["job", "run", "j", ".", "--model-base-url", "http://x", "--model", "m", "-k", "0"],
     "at least 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys: Any, tmp_path: Path,
                                               argv: list[str], says: str) -> None:
    try:  # argparse's refusals exit; the command's own return
        code = main([*argv, *(["--db", str(tmp_path / "t.db")] if argv[0] in ("ls", "sql")
                              else [])])
    except SystemExit as stopped:
        code = int(stopped.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.count("\n") == 1, err


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                 ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [((*path, name), sub), *_subcommands(sub, (*path, name))]
    return found


def test_every_help_says_what_it_does_and_its_examples_parse() -> None:
    """Each subcommand's --help opens with a sentence and ends with examples, and every
    example is a command line the parser accepts as written."""
    from trialledger.cli import build_parser

    commands = _subcommands(build_parser())
    assert len(commands) == 26  # every command and subcommand
    for path, sub in commands:
        text = sub.format_help()
        assert sub.description and sub.description.endswith("."), path
        assert "examples:\n  trialledger " in text or "examples:\n  sudo trialledger" in text
        examples = [line.strip() for line in text.split("examples:\n", 1)[1].splitlines()]
        assert examples and all("trialledger " in line for line in examples), path
        for example in examples:
            words = shlex.split(example.split(" > ")[0])
            argv = words[words.index("trialledger") + 1:]
            assert argv[:len(path)] == list(path), example
            build_parser().parse_args(argv)  # a refusal exits 2 and fails the test


def test_version_and_an_empty_log(capsys: Any, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out.startswith("trialledger ")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(capsys, "replay", "--log", str(empty))
    assert code == 2 and "is empty" in err


def test_sql_writes_csv_with_a_header(capsys: Any, tmp_path: Path, examples: Path) -> None:
    import csv
    import io

    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean", "http_429")
    code, out, _ = run(capsys, "sql", "--db", db, "--csv",
                       "SELECT task, attempt, outcome FROM sessions ORDER BY outcome")
    rows = list(csv.reader(io.StringIO(out)))
    assert code == 0 and rows[0] == ["task", "attempt", "outcome"] and len(rows) == 3
    assert {row[2] for row in rows[1:]} == {"retry", "pending"}


def test_a_bad_busy_timeout_is_one_line(capsys: Any, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIALLEDGER_SQLITE_BUSY_MS", "soon")
    code, _, err = run(capsys, "db", "upgrade", "--db", str(tmp_path / "t.db"))
    assert code == 2 and "TRIALLEDGER_SQLITE_BUSY_MS must be a whole number" in err
    assert err.count("\n") == 1


def test_markup_in_logged_text_is_printed_never_parsed(capsys: Any, tmp_path: Path,
                                                       examples: Path) -> None:
    """A task name or a gap's detail (a path the agent chose) holding rich markup — an
    unmatched closing tag would raise — is printed as written by `show` and `ls`."""
    lines = [json.loads(line) for line in (examples / "clean.jsonl").read_text().splitlines()]
    lines[0]["data"]["task"] = "task[/evil]"
    gap = {"type": "gap.recorded", "at": lines[0]["at"],
           "data": {"code": "unsafe_agent_file", "detail": "/app/[/evil][link=x]y"}}
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_text("\n".join(json.dumps(e) for e in [lines[0], gap, *lines[1:]]) + "\n")
    db = str(tmp_path / "t.db")
    code, out, err = run(capsys, "import", "--db", db, str(hostile))
    assert code == 0, err
    code, shown, err = run(capsys, "show", "--db", db, out.strip())
    assert code == 0 and "task[/evil]" in shown and "/app/[/evil][link=x]y" in shown, err
    code, listed, err = run(capsys, "ls", "--db", db)
    assert code == 0 and "[/evil]" in listed, err


# --- `sql` stays inside its bounds: no other role's rights, no unbounded time or disk ------

def _reader_store(capsys: pytest.CaptureFixture[str], postgres: Any) -> tuple[str, str]:
    """A PostgreSQL store and its reader login (named for the store: roles are shared by
    every database of the test server)."""
    db = postgres.create_database()
    role = "reader_" + db.rsplit("/", 1)[1]
    code, _, err = run(capsys, "db", "upgrade", "--db", db, "--create-readonly-role", role)
    assert code == 0, err
    return db, role


def _as_owner(db: str, statement: str) -> None:
    import anyio
    from sqlalchemy import text

    from trialledger.store.engine import open_engines

    async def go() -> None:
        async with open_engines(db) as engines, engines.writer.begin() as conn:
            await conn.execute(text(statement))

    anyio.run(go)


@pytest.fixture
def drop_folder() -> Any:
    """A folder the database server's own user may write in (where a program it ran as
    the store's owner would leave its mark)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="trialledger-escape-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("escape", [
    "PERFORM set_config('role', '{owner}', false)",
    "SET ROLE {owner}",
    "RESET ROLE",
    "SET SESSION AUTHORIZATION {owner}",
    "EXECUTE 'SET ROLE {owner}'",
])
def test_sql_on_postgresql_cannot_take_another_roles_rights(
        capsys: Any, postgres: Any, drop_folder: Path, escape: str) -> None:
    """On a connection where the store's owner had SET ROLE to the reader, a DO block set
    the role back and ran a program on the server; the reader login has no role to go to."""
    from tests.pg import SUPERUSER

    db, role = _reader_store(capsys, postgres)
    mark = drop_folder / "ran"
    step = escape.format(owner=SUPERUSER)
    for query in (f"DO $$ BEGIN {step}; EXECUTE 'COPY (SELECT 1) TO PROGRAM ''touch {mark}''';"
                  " END $$",
                  f"DO $$ BEGIN {step}; END $$; COPY (SELECT 1) TO PROGRAM 'touch {mark}'"):
        code, _, err = run(capsys, "sql", "--db", db, "--role", role, query)
        assert code == 2 and err.count("\n") == 1, err
        assert not mark.exists(), query
    code, out, err = run(capsys, "sql", "--db", db, "--role", role, "--json",
                         "SELECT current_user AS u, session_user AS s")
    assert (code, json.loads(out)) == (0, [{"u": role, "s": role}]), err


def test_sql_on_postgresql_keeps_the_bounds_set_on_the_reader_login(
        capsys: Any, postgres: Any) -> None:
    import time

    db, role = _reader_store(capsys, postgres)
    start = time.monotonic()
    code, _, err = run(capsys, "sql", "--db", db, "--role", role, "--timeout", "1",
                       "DO $$ BEGIN PERFORM set_config('statement_timeout', '0', false); "
                       "PERFORM pg_sleep(20); END $$")
    assert code == 2 and "past its 1 s limit" in err, err
    assert time.monotonic() - start < 10  # the timer set when the statement began held
    code, _, err = run(capsys, "sql", "--db", db, "--role", role,
                       "SELECT set_config('temp_file_limit', '-1', false)")
    assert code == 2 and "permission denied" in err, err
    code, out, err = run(capsys, "sql", "--db", db, "--role", role, "--json",
                         "SELECT current_setting('default_transaction_read_only') AS ro, "
                         "current_setting('work_mem') AS mem, "
                         "current_setting('temp_file_limit') AS temp")
    assert (code, json.loads(out)) == (0, [{"ro": "on", "mem": "16MB", "temp": "1GB"}]), err
    # ... and what it holds: nothing; with another role it is refused before any query
    _as_owner(db, f"GRANT pg_read_server_files TO {role}")
    code, _, err = run(capsys, "sql", "--db", db, "--role", role, "SELECT 1")
    assert code == 2 and "holds pg_read_server_files" in err and err.count("\n") == 1, err


def test_sql_on_postgresql_names_what_to_configure_when_the_reader_cannot_connect(
        capsys: Any, postgres: Any) -> None:
    db, role = _reader_store(capsys, postgres)
    _as_owner(db, f"ALTER ROLE {role} NOLOGIN")  # as an older trialledger made it
    code, _, err = run(capsys, "sql", "--db", db, "--role", role, "SELECT 1")
    assert code == 2 and "not permitted to log in" in err and err.count("\n") == 1, err
    assert f"--create-readonly-role {role}" in err
    assert run(capsys, "db", "upgrade", "--db", db, "--create-readonly-role", role)[0] == 0
    hba = postgres.folder / "data" / "pg_hba.conf"
    before = hba.read_text()
    hba.write_text(f"host all {role} 127.0.0.1/32 reject\n{before}")
    try:
        postgres._run("pg_ctl", "-D", str(postgres.folder / "data"), "reload")
        code, _, err = run(capsys, "sql", "--db", db, "--role", role, "SELECT 1")
    finally:
        hba.write_text(before)
        postgres._run("pg_ctl", "-D", str(postgres.folder / "data"), "reload")
    assert code == 2 and "pg_hba.conf" in err and err.count("\n") == 1, err
    from tests.pg import PASSWORD

    assert PASSWORD not in err


def _sql_in_a_process(tmp_path: Path, db: str, timeout: str, query: str
                      ) -> tuple[int, str, float, int]:
    """`trialledger sql` in a process of its own, its SQLite temp folder a test folder
    (SQLite reads SQLITE_TMPDIR once per process); what it said, how long it took, and the
    most bytes its temp files held (they are unlinked at once, so counted through /proc)."""
    import subprocess
    import sys
    import time

    temp = tmp_path / "sqlite-temp"
    temp.mkdir()
    start = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "sql", "--db", db, "--timeout", timeout,
         query], env={**os.environ, "SQLITE_TMPDIR": str(temp)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    most = 0
    while child.poll() is None and time.monotonic() - start < 120:
        held = 0
        for fd in Path(f"/proc/{child.pid}/fd").glob("*"):
            try:
                if os.readlink(fd).startswith(str(temp)):
                    held += fd.stat().st_size
            except OSError:  # closed meanwhile
                pass
        most = max(most, held)
        time.sleep(0.02)
    child.kill()
    _, err = child.communicate()
    return child.wait(), err, time.monotonic() - start, most


@pytest.mark.parametrize("query", [
    # millions of rows, ordered by random(): the sort spilled gigabytes to temp files
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 50000000) "
    "SELECT i FROM n ORDER BY random()",
    # few steps, each long: the progress handler alone looked at the clock after ~50 s
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 3000) "
    "SELECT i FROM n ORDER BY length(randomblob(30000000)) + random()",
])
def test_sql_on_sqlite_stops_a_long_sort_at_its_deadline(
        capsys: Any, tmp_path: Path, examples: Path, query: str) -> None:
    db = str(tmp_path / "t.db")
    imported(capsys, db, examples, "clean")
    code, err, took, temp_bytes = _sql_in_a_process(tmp_path, db, "2", query)
    assert code == 2 and "past its 2 s limit" in err and err.count("\n") == 1, err
    assert took < 3 * 2 + 4  # three times the limit, and the process's start
    assert temp_bytes == 0


def test_sql_on_sqlite_refuses_a_sort_past_its_memory_and_writes_no_temp_file(
        capsys: Any, tmp_path: Path, examples: Path) -> None:
    db = tmp_path / "t.db"
    imported(capsys, str(db), examples, "clean")
    before = db.read_bytes()
    code, err, _, temp_bytes = _sql_in_a_process(  # 2 GB to sort: it used 2 GB of temp disk
        tmp_path, str(db), "60", "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
        "LIMIT 2000) SELECT i, printf('%.1000000c', 'x') FROM n ORDER BY random()")
    assert code == 2 and "more than 512 MiB of memory" in err and err.count("\n") == 1, err
    assert temp_bytes == 0 and list((tmp_path / "sqlite-temp").iterdir()) == []
    assert db.read_bytes() == before


def test_a_sqlite_query_gives_the_heap_cap_back(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The cap is the whole process's: a service embedding the store keeps its own
    connections uncapped once `sql` has answered (here, in this process)."""
    import sqlite3

    def cap() -> int:
        conn = sqlite3.connect(":memory:")
        try:
            return int(conn.execute("PRAGMA hard_heap_limit").fetchone()[0])
        finally:
            conn.close()

    before = cap()
    db = str(tmp_path / "t.db")
    assert run(capsys, "db", "upgrade", "--db", db)[0] == 0
    code, out, _ = run(capsys, "sql", "--db", db, "--json", "SELECT count(*) AS n FROM sessions")
    assert code == 0 and json.loads(out) == [{"n": 0}]
    assert cap() == before
