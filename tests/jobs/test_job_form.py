"""`job run` in Harbor's form too (docs/SPEC.md §19): `-p DATASET -a AGENT -m MODEL
[--job-name NAME]`; a job without a name is named after its dataset and its configuration's
hash, printed with the command that resumes it; a dataset is never read as a name; the two
forms saying different things is one line, exit 2, nothing written. Run for real with the
oracle (bubblewrap, SQLite files)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.runs import in_process, make_task

CHECK = "grep -qx solved answer.txt\n"
SOLVE = "#!/bin/sh\necho solved > answer.txt\n"


def _dataset(folder: Path) -> Path:
    for name in ("alpha", "beta"):
        make_task(folder / name, instruction="write answer.txt", test_sh=CHECK,
                  solve_sh=SOLVE)
    return folder


def _rows(db: Path, sql: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(sql)]


def test_harbors_form_runs_a_named_job(tmp_path: Path) -> None:
    data, db = _dataset(tmp_path / "tb"), tmp_path / "jobs.db"
    done = in_process("job", "run", "-p", str(data), "-a", "oracle", "-m", "some-model",
                      "--job-name", "nightly", "--db", str(db))
    assert done.returncode == 0, done.stderr
    config = json.loads(_rows(db, "SELECT config FROM jobs WHERE name = 'nightly'")[0]["config"])
    assert (config["agent"], config["model"]) == ("oracle", "some-model")
    assert [r["task"] for r in _rows(db, "SELECT task FROM job_trials ORDER BY task")] == [
        "alpha", "beta"]
    assert "resume it with" not in done.stderr  # named: nothing to derive


@pytest.mark.parametrize("form", [["-p", "{data}"], ["{data}"]])
def test_a_nameless_job_is_named_and_its_printed_command_resumes_it(
        tmp_path: Path, form: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`-p DATASET`, or the dataset where the name goes (never read as a name): named
    `tb-<8 hex>`, printed with the command that resumes it; that command runs no trial
    again, nor does the first command re-run."""
    db = tmp_path / "jobs.db"
    _dataset(tmp_path / "tb")
    monkeypatch.chdir(tmp_path)
    argv = [word.format(data="tb") for word in form]
    first = in_process("job", "run", *argv, "-a", "oracle", "-k", "2", "--db", str(db))
    assert first.returncode == 0, first.stderr
    said = re.search(r"^trialledger: job (tb-[0-9a-f]{8}) \(resume it with: (.*)\)$",
                     first.stderr, re.MULTILINE)
    assert said is not None, first.stderr
    name, command = said[1], shlex.split(said[2])
    assert [r["name"] for r in _rows(db, "SELECT name FROM jobs")] == [name]
    sessions = _rows(db, "SELECT session_id FROM sessions")
    assert len(sessions) == 4
    assert command[0] == "trialledger"
    again = in_process(*command[1:])
    assert again.returncode == 0, again.stderr
    assert not re.search(r"k=\d+ verify", again.stdout)  # no trial ran again
    same = in_process("job", "run", *argv, "-a", "oracle", "-k", "2", "--db", str(db))
    assert same.returncode == 0 and f"job {name} " in same.stderr  # the same name
    assert _rows(db, "SELECT session_id FROM sessions") == sessions
    assert [r["name"] for r in _rows(db, "SELECT name FROM jobs")] == [name]
    other = in_process("job", "run", *argv, "-a", "nop", "--db", str(db), "--json")
    assert other.returncode == 0
    assert len(_rows(db, "SELECT name FROM jobs")) == 2  # another configuration, another job


@pytest.mark.parametrize(("argv", "said"), [
    (["nightly", "-p", "{data}", "--job-name", "other"],
     "the job is named twice: nightly and --job-name other"),
    (["nightly", "{data}", "--job-name", "other"],
     "the job is named twice: nightly and --job-name other"),
    (["nightly", "{data}", "-p", "{tmp}"], "the tasks are given twice"),
    (["-p", "{data}", "-a", "oracle", "--agent", "nop"], "-a oracle and --agent nop disagree"),
    (["-p", "{data}", "-a", "oracle", "-m", "x", "--model", "y"], "-m x and --model y disagree"),
    (["nightly"], "nightly is no task or dataset folder"),
])
def test_both_forms_saying_different_things_are_refused_in_one_line(
        tmp_path: Path, argv: list[str], said: str) -> None:
    data, db = _dataset(tmp_path / "tb"), tmp_path / "jobs.db"
    words = [w.format(data=data, tmp=tmp_path) for w in argv]
    done = in_process("job", "run", *words, "--agent", "oracle", "--db", str(db))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert not db.exists()  # nothing written


def test_the_same_values_in_both_forms_are_one(tmp_path: Path) -> None:
    data, db = _dataset(tmp_path / "tb"), tmp_path / "jobs.db"
    done = in_process("job", "run", "nightly", str(data), "-p", str(data), "--job-name",
                      "nightly", "-a", "oracle", "--agent", "oracle", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in _rows(db, "SELECT name FROM jobs")] == ["nightly"]
