"""What `job show` and `job run` say of a job's trials (docs/SPEC.md §13, §15): who holds an
open trial and until when, the dataset's tasks skipped with the reason, each trial's own
duration and reward, and the wall time of work only (a session recovered after its runner
died is not charged for the dead time). Real stores (SQLite files, the PostgreSQL fixture),
real sessions (the oracle and nop agents in the sandbox)."""

from __future__ import annotations

import json
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task, on_a_terminal
from tests.scenarios import CLEAN, LogBuilder
from trialledger.core.seed import validate_seed
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

CONFIG = {"model": "m", "settings": {}, "grants": [], "k": 2, "max_attempts": 1}
DEAD_S = 600.0  # how long the first runner lay dead before its session was recovered


def _shown(db: str, name: str, *more: str) -> str:
    done = in_process("job", "show", name, "--db", db, *more)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _at(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


@pytest.mark.anyio
async def test_a_recovered_session_is_not_charged_for_its_dead_runner(db: str) -> None:
    """Trial 0: a session whose runner died 5 s into its work, recovered `DEAD_S` later by
    the trial's next holder; trial 1: a session its runner closed after 10 s. The wall time
    of work is 5 s and 10 s: the dead time is nobody's work."""
    start = datetime.now(UTC) - timedelta(seconds=DEAD_S)
    async with await Ledger.open(db) as ledger:
        jobs = Jobs(ledger)
        await jobs.define("w", CONFIG, [("t", "/tasks/t")])
        for k, (work_s, dies) in enumerate([(5, True), (10, False)]):
            claim = await jobs.claim("w", f"runner-{k}", 60)
            assert claim is not None and claim.k_index == k
            log = LogBuilder().launched().codex(CLEAN)
            if not dies:
                log.finish(0).add("session.closed", {"reason": "normal"})
            for second, event in enumerate(log.events):  # one a second; the last at work_s
                at = work_s if event is log.events[-1] else min(second, work_s)
                event["at"] = _at(start + timedelta(seconds=at))
            log.events[0]["data"].update(trial_id=claim.trial_id, task="t")
            seeded = await ledger.start(validate_seed(log.events[0]["data"]),
                                        at=log.events[0]["at"])
            await ledger.append(seeded.session_id, log.events[1:])
            if dies:  # now, DEAD_S later: the next holder recovers it
                assert await ledger.recover_sessions([seeded.session_id]) == [
                    seeded.session_id]
            assert await jobs.settle(claim, "done")
        trials = {t["k_index"]: t for t in await jobs.trials("w")}
        tasks = await jobs.tasks("w")
        one = await jobs.trial(trials[0]["trial_id"])
        assert one is not None and float(one["wall_s"]) == pytest.approx(5.0, abs=0.01)
    assert float(trials[0]["wall_s"]) == pytest.approx(5.0, abs=0.01)
    assert float(trials[1]["wall_s"]) == pytest.approx(10.0, abs=0.01)
    assert float(tasks[-1]["wall_s"]) == pytest.approx(15.0, abs=0.01)  # the job's total


def test_job_show_says_who_holds_an_open_trial_and_until_when(db: str) -> None:
    async def hold_one() -> None:
        async with await Ledger.open(db) as ledger:
            jobs = Jobs(ledger)
            await jobs.define("w", CONFIG, [("t", "/tasks/t")])
            assert await jobs.claim("w", "runner-7", 60) is not None

    anyio.run(hold_one)
    out = _shown(db, "w")
    held = re.search(r"t #0 \(\S+\): held by runner-7, its lease expires in (\d+) s", out)
    assert held is not None and 0 < int(held.group(1)) <= 60, out
    assert re.search(r"t #1 \(\S+\): queued", out), out


def test_a_dataset_s_skipped_tasks_are_listed_with_the_reason(db: str, tmp_path: Path) -> None:
    make_task(tmp_path / "data" / "graded", instruction="nothing", test_sh="exit 0\n")
    make_task(tmp_path / "data" / "untested", instruction="nothing", test_sh=None)
    done = in_process("job", "run", "bench", str(tmp_path / "data"), "--db", db,
                      "--agent", "nop")
    assert done.returncode == 0, done.stderr
    out = _shown(db, "bench")
    assert re.search(r"^untested: skipped: .*no tests/test\.sh", out, re.M), out
    shown = json.loads(_shown(db, "bench", "--json"))
    assert list(shown["skipped"]) == ["untested"]
    assert [t["task"] for t in shown["tasks"] if t["task"]] == ["graded"]  # in no figure


def test_each_trial_s_line_has_its_own_duration_and_reward(tmp_path: Path) -> None:
    """Two oracle trials run one after the other; each line's duration is that trial's
    own (its session's, as the store has it), not the time since the job began."""
    for name, pause in (("a-slow", "2"), ("b-quick", "0.5")):
        make_task(tmp_path / "data" / name, instruction="wait", test_sh="exit 0\n",
                  solve_sh=f"#!/bin/sh\nsleep {pause}\n")
    db = str(tmp_path / "t.db")
    done = in_process("job", "run", "timing", str(tmp_path / "data"), "--db", db,
                      "--agent", "oracle", "-n", "1")
    assert done.returncode == 0, done.stderr
    said: dict[str, float] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"(\S+) k=0 verify reward 1 \(1 session, ([\d.]+) s\)$", line)
        if found:
            said[found.group(1)] = float(found.group(2))
    trials: list[dict[str, Any]] = json.loads(_shown(db, "timing", "--json"))["trials"]
    own = {t["task"]: round(float(t["wall_s"]), 1) for t in trials}
    assert said == own, done.stdout
    lines = _shown(db, "timing", "--trials")
    for task, seconds in own.items():
        assert f"{task} k=0 verify reward 1 (1 session, {seconds:.1f} s)" in lines, lines


def test_a_figure_with_no_finished_session_shows_no_tokens_rather_than_0() -> None:
    from trialledger.adapters.console.jobs import tokens

    assert tokens({"total_tokens": None, "unknown_usage": 0}) == ""
    assert tokens({"total_tokens": 0, "unknown_usage": 0}) == "0"  # known: none spent


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
EVERY_COLUMN = ["task", "trials", "open", "scored", "unscored", "passed", "mean", "mean scored",
                "pass@k", "retries", "interrupted", "tokens", "wall s"]


def _on_a_terminal(argv: list[str], columns: int) -> str:
    """What `trialledger ARGV` shows on a pseudo-terminal `columns` wide (escapes removed),
    once it has exited 0."""
    shown = on_a_terminal([sys.executable, "-m", "trialledger.cli", *argv], columns=columns,
                          deadline_s=60)
    return ANSI.sub("", shown).replace("\r\n", "\n")


def _grid(text: str) -> tuple[list[int], list[list[str]], list[list[str]]]:
    """A rich table's column widths (inside the padding), its header lines' cells and its
    body lines' cells, each cell stripped."""
    lines = text.splitlines()
    top = next(line for line in lines if line.startswith("┏"))
    widths = [len(part) - 2 for part in top.strip("┏┓").split("┳")]
    heads = [[c.strip() for c in line.strip("┃").split("┃")] for line in lines
             if line.startswith("┃")]
    body = [[c.strip() for c in line.strip("│").split("│")] for line in lines
            if line.startswith("│")]
    return widths, heads, body


@pytest.fixture(scope="module")
def summary_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A real job: the oracle over two tasks (one with a long name, one that fails), k=2."""
    root = tmp_path_factory.mktemp("fit")
    for name, verdict in (("count-the-primes-below-one-hundred", "exit 1"),
                          ("hello", "exit 0")):
        make_task(root / "data" / name, instruction="do it", test_sh=f"{verdict}\n",
                  solve_sh="#!/bin/sh\ntrue\n")
    db = str(root / "t.db")
    done = in_process("job", "run", "fit", str(root / "data"), "--db", db, "--agent",
                      "oracle", "-k", "2", "-n", "2")
    assert done.returncode == 0, done.stderr  # (a reward 0 is a final decision)
    return db, json.loads(_shown(db, "fit", "--json"))


def test_job_show_fits_80_columns_without_cutting_a_figure(
        summary_job: tuple[str, dict[str, Any]]) -> None:
    """At 80 columns `job show` leaves columns out rather than squeeze them: every header
    whole, every figure whole on its row's line, no column under 6 characters unless all it
    holds is shorter; the columns left out are named, with `--wide`."""
    db, summary = summary_job
    text = _on_a_terminal(["job", "show", "fit", "--db", db], 80)
    widths, heads, body = _grid(text)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    names = [" ".join(w for w in words if w) for words in zip(*heads, strict=True)]
    for must in ("task", "trials", "scored", "passed", "mean", "pass@2"):
        assert must in names, text
    assert set(names) <= {*EVERY_COLUMN, "pass@2"}, text
    assert "…" not in text, text
    for width, name in zip(widths, names, strict=True):
        longest = max(len(name), *(len(r[names.index(name)]) for r in body))
        assert width >= min(6, longest), (name, width, text)
    firsts = [dict(zip(names, row, strict=True)) for row in body if row[names.index("trials")]]
    assert len(firsts) == len(summary["tasks"]), text  # a name may fold; its figures may not
    for cells, figure in zip(firsts, summary["tasks"], strict=True):
        k2 = [p["pass_at_k"] for p in summary["passk"] if p["k"] == 2
              and (p["task"], p["dataset"]) == (figure["task"], figure["dataset"])]
        assert cells["trials"] == str(figure["trials"]), text
        assert cells["scored"] == str(figure["scored"]), text
        assert cells["passed"] == str(figure["passed"]), text
        assert cells["mean"] == f"{figure['mean']:.3f}", text
        assert cells["pass@2"] == f"{k2[0]:.3f}", text
    hidden = [c for c in EVERY_COLUMN if c not in names and c != "pass@k"]
    assert hidden, text  # 80 columns cannot hold all of them
    said = " ".join(text.split())  # the note wraps at the terminal's width
    assert f"not shown at this width: {', '.join(hidden)} (--wide" in said, text


def test_job_show_wide_holds_every_column_at_80(
        summary_job: tuple[str, dict[str, Any]]) -> None:
    """`--wide` shows every column however narrow the terminal, wrapped to fit."""
    db, _ = summary_job
    text = _on_a_terminal(["job", "show", "fit", "--db", db, "--wide"], 80)
    _, heads, _ = _grid(text)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    headers = ["".join(words).replace(" ", "") for words in zip(*heads, strict=True)]
    assert headers == [c.replace(" ", "") for c in EVERY_COLUMN], text
    assert "not shown" not in text, text


def test_job_ls_gives_each_job_s_agent_model_and_headline_mean(db: str, tmp_path: Path) -> None:
    """Three real oracle jobs: one of a single reward name (two tasks, one failing), one
    whose verifier writes `speed`, `reward` and `coverage` (the headline is `reward`'s,
    though `coverage` and `speed` come first by name) and one without `reward` (the first
    name's, named)."""
    write = "printf '{%s}' > /logs/verifier/reward.json\n"
    several = write % '"speed": 0.25, "reward": 1, "coverage": 0.5'
    no_reward = write % '"speed": 0.25, "coverage": 0.5'
    for folder, test_sh, exit_code in (("plain/pass", "exit 0\n", True),
                                       ("plain/fail", "exit 1\n", True),
                                       ("multi/t", several, False), ("named/t", no_reward, False)):
        make_task(tmp_path / folder, instruction="do it", test_sh=test_sh,
                  solve_sh="#!/bin/sh\ntrue\n", exit_code_reward=exit_code)
    for job, more in (("plain", ["--model", "gpt-x"]), ("multi", []), ("named", [])):
        done = in_process("job", "run", job, str(tmp_path / job), "--db", db, "--agent",
                          "oracle", *more)
        assert done.returncode == 0, done.stderr
    listed = in_process("job", "ls", "--db", db, "--json")
    assert listed.returncode == 0, listed.stderr
    got = {r["job"]: (r["agent"], r["model"], r["mean"], r["mean_name"])
           for r in map(json.loads, listed.stdout.splitlines())}
    assert got == {"plain": ("oracle", "gpt-x", 0.5, "reward"),
                   "multi": ("oracle", None, 1.0, "reward"),
                   "named": ("oracle", None, 0.5, "coverage")}
    text = in_process("job", "ls", "--db", db)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    heads = next(line for line in lines if line.startswith("┃"))
    names = [c.strip() for c in heads.strip("┃").split("┃")]
    assert names[:3] == ["job", "agent", "model"] and "mean" in names, text.stdout
    rows = {cells[0]: dict(zip(names, cells, strict=True)) for cells in (
        [c.strip() for c in line.strip("│").split("│")] for line in lines
        if line.startswith("│")) if cells[0]}  # (a cell folded onto a next line: not a job)
    assert [(r["agent"], r["model"], r["mean"]) for r in rows.values()] == [
        ("oracle", "gpt-x", "0.500"), ("oracle", "", "1.000"), ("oracle", "", "0.500 (coverage)")
    ], text.stdout
