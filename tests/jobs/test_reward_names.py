"""A job whose verifier writes several reward names (docs/SPEC.md §13), run for real with
the oracle: `job run`'s line per trial, `job show --trials`, `job show` (text and JSON),
`job diff` and the `job_tasks` rows give the same names and values, `reward` first."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.runs import make_task
from trialledger import cli

SOLVE = "#!/bin/sh\necho solved > answer.txt\n"
# One binary name (`reward`), one that is not (`coverage`); `speed` before `reward` by name.
TWO_NAMES = ("printf '{\"speed\": 0.25, \"reward\": 1, \"coverage\": 0.5}' "
             "> /logs/verifier/reward.json\n")
ONE_NAME = "printf '{\"reward\": 1}' > /logs/verifier/reward.json\n"


def _dataset(folder: Path) -> Path:
    make_task(folder / "named", instruction="write answer.txt", test_sh=TWO_NAMES,
              solve_sh=SOLVE, exit_code_reward=False)
    make_task(folder / "plain", instruction="write answer.txt", test_sh=ONE_NAME,
              solve_sh=SOLVE, exit_code_reward=False)
    return folder


def _rows(db: Path, sql: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(sql)]


def _trial_lines(out: str) -> list[str]:
    """The per-trial lines (`TASK k=N OUTCOME REWARDS (…)`), in order."""
    return sorted(re.findall(r"^\w+ k=\d+ .*\(\d+ sessions?.*\)$", out, re.MULTILINE))


def test_every_place_gives_each_reward_name_and_reward_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, db = _dataset(tmp_path / "multi"), tmp_path / "jobs.db"
    code = cli.main(["job", "run", "multi", str(data), "--agent", "oracle", "-k", "2",
                     "--db", str(db)])
    ran = capsys.readouterr().out
    assert code == 0, ran
    run_lines = _trial_lines(ran)
    assert len(run_lines) == 4
    assert "named k=0 verify reward 1 coverage 0.5 speed 0.25 (1 session" in ran
    assert "plain k=1 verify reward 1 (1 session" in ran

    assert cli.main(["job", "show", "multi", "--trials", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert _trial_lines(shown) == run_lines  # the same names and values as job run's

    assert cli.main(["job", "show", "multi", "--json", "--db", str(db)]) == 0
    summary = json.loads(capsys.readouterr().out)
    figures = [(t["task"], t["name"]) for t in summary["tasks"]]
    assert figures == [("named", "reward"), ("named", "coverage"), ("named", "speed"),
                       ("plain", "reward"), (None, "reward"), (None, "coverage"),
                       (None, "speed")]
    by = {(t["task"], t["name"]): t for t in summary["tasks"]}
    assert (by[(None, "reward")]["mean"], by[(None, "reward")]["passed"]) == (1.0, 4)
    assert by[(None, "coverage")]["mean"] == pytest.approx(0.25)  # plain's trials count 0
    assert by[(None, "coverage")]["passed"] is None  # not all 0 or 1
    assert by[("named", "coverage")]["mean_scored"] == pytest.approx(0.5)
    assert by[("named", "reward")]["pass_at_k"] == 1.0  # pass@2 at the job's k
    assert [p["name"] for p in summary["passk"] if p["task"] is None] == ["reward"]
    named = [t for t in summary["trials"] if t["task"] == "named"]
    assert [list(t["rewards"]) for t in named] == [["reward", "coverage", "speed"]] * 2

    # job_tasks holds the same rows, one per figure and name.
    rows = _rows(db, "SELECT task, name, mean, mean_scored, passed, pass_at_k FROM job_tasks "
                     "WHERE job = 'multi'")
    assert sorted(map(str, rows)) == sorted(str({key: t[key] for key in rows[0]})
                                            for t in summary["tasks"])

    # The text shows every name's row, `reward` first, none of them blank.
    assert cli.main(["job", "show", "multi", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    total = [line for line in text.splitlines() if "(all)" in line or
             re.match(r"^\W*(reward|coverage|speed)\b", line.strip("│ "))]
    assert any("(all)" in line and "reward" in line and "1.000" in line for line in total)
    assert text.index("coverage") < text.index("speed")
    assert any("0.250" in line and "coverage" in line for line in text.splitlines())

    # job diff: a job of one name against this one, name by name.
    code = cli.main(["job", "run", "single", str(data), "--agent", "oracle", "--include",
                     "plain", "--db", str(db)])
    assert code == 0, capsys.readouterr()
    capsys.readouterr()
    assert cli.main(["job", "diff", "single", "multi", "--json", "--db", str(db)]) == 0
    diff = {f["figure"]: f for f in json.loads(capsys.readouterr().out)["figures"]}
    assert diff["(all)"]["mean"] == {"a": 1.0, "b": 1.0, "diff": 0.0}
    assert diff["(all) · coverage"]["mean"]["b"] == pytest.approx(0.25)
    assert diff["(all) · coverage"]["passed"]["b"] is None
    assert diff["named · speed"]["only"] == "b" and diff["plain"]["only"] is None
    assert cli.main(["job", "diff", "single", "multi", "--db", str(db)]) == 0
    assert "coverage" in capsys.readouterr().out

    # The view's job page (its export, the same pages) says the same.
    assert cli.main(["view", "--db", str(db), "--export", str(tmp_path / "site"),
                     "--job", "multi"]) == 0
    page = (tmp_path / "site" / "job" / "multi.html").read_text(encoding="utf-8")
    assert re.findall(r'<tr data-figure="\(all\)" data-name="(\w+)"', page) == [
        "reward", "coverage", "speed"]
    assert re.findall(r'<tr data-task="named" data-name="(\w+)"', page) == [
        "reward", "coverage", "speed"]
    titles = re.findall(r'title="done · verify · ([^"]*)" data-task="(\w+)"', page)
    assert sorted(f"{task} {said}" for said, task in titles) == sorted(
        re.sub(r"^(\w+) k=\d+ verify (.*) \(.*$", r"\1 \2", line) for line in run_lines)
    trial = next((tmp_path / "site" / "trial").iterdir()).read_text(encoding="utf-8")
    said = re.search(r'<span id="trial-rewards">([^<]*)</span>', trial)
    assert said is not None and said[1] in {"reward 1", "reward 1 coverage 0.5 speed 0.25"}
