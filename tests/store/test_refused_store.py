"""A refused command creates no database file (docs/SPEC.md §10): every command taking
`--db`, refused on a store path that does not exist yet, leaves no file there — nor its
-wal, -shm or -journal — while a store that took a record is kept. Real commands, in
process, on real SQLite paths."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.runs import in_process
from tests.tasks.test_mcp_servers import write_task

COMPANIONS = ("", "-wal", "-shm", "-journal")


def harbor_job_without_trials(root: Path) -> list[str]:
    (root / "job").mkdir()
    return ["import-harbor", str(root / "job")]


def harbor_trial_with_a_broken_result(root: Path) -> list[str]:
    (root / "job" / "trial-1").mkdir(parents=True)
    (root / "job" / "trial-1" / "result.json").write_text("{not json")
    return ["import-harbor", str(root / "job")]


def log_with_a_bad_event(root: Path) -> list[str]:
    (root / "bad.jsonl").write_text('{"seq": 1}\n')
    return ["import", str(root / "bad.jsonl")]


def log_that_is_not_json(root: Path) -> list[str]:
    (root / "garbage.jsonl").write_text("garbage\n")
    return ["import", str(root / "garbage.jsonl")]


def task_of_a_wrong_type(root: Path) -> list[str]:
    write_task(root / "typed", '[agent]\ntimeout_sec = "thirty"\n')
    return ["run", str(root / "typed"), "--agent", "nop"]


def dataset_without_tasks(root: Path) -> list[str]:
    (root / "empty").mkdir()
    return ["job", "run", "j", str(root / "empty"), "--agent", "nop"]


def read_only(*argv: str) -> Callable[[Path], list[str]]:
    return lambda _root: list(argv)


REFUSALS = {
    "import-harbor, no trials": harbor_job_without_trials,
    "import-harbor, a broken result.json": harbor_trial_with_a_broken_result,
    "import, a bad event": log_with_a_bad_event,
    "import, not JSON": log_that_is_not_json,
    "run, a wrong type": task_of_a_wrong_type,
    "job run, no tasks": dataset_without_tasks,
    "recover without --runner": read_only("recover"),
    "ls": read_only("ls"),
    "show": read_only("show", "abc"),
    "export": read_only("export", "--session", "abc"),
    "audit": read_only("audit"),
    "sql": read_only("sql", "SELECT 1"),
    "replay --all --diff": read_only("replay", "--all", "--diff"),
    "job show": read_only("job", "show", "j"),
    "job ls": read_only("job", "ls"),
    "job diff": read_only("job", "diff", "a", "b"),
    "worker": read_only("worker", "--agent", "nop"),
    "artifacts": read_only("artifacts", "abc"),
    "view --export": read_only("view", "--export", "out"),
}


@pytest.mark.parametrize("refusal", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_refused_command_leaves_no_database_file(
        tmp_path: Path, refusal: Callable[[Path], list[str]]) -> None:
    db = tmp_path / "new.db"
    done = in_process(*refusal(tmp_path), "--db", str(db), cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("new.db")] == []


def test_a_refusal_keeps_a_store_that_existed(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    assert in_process("db", "upgrade", "--db", str(db)).returncode == 0
    done = in_process(*harbor_job_without_trials(tmp_path), "--db", str(db))
    assert done.returncode == 2 and db.exists()
