"""`trialledger demo`, `ls` and `show` end to end (the demo drives the real Codex CLI)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.runs import codex_path, in_process

ROOT = Path(__file__).resolve().parents[2]


def trialledger(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    if args[0] == "demo":
        args = (*args, "--codex-bin", codex_path())
    return in_process(*args, cwd=cwd)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    folder = tmp_path_factory.mktemp("demo")
    done = trialledger("demo", cwd=folder)  # the embedded default: trials.db right here
    assert done.returncode == 0, done.stderr
    yield str(folder / "trials.db"), done.stdout


def listing(db: str, *filters: str) -> list[dict[str, Any]]:
    done = trialledger("ls", "--db", db, "--json", *filters)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_demo_runs_every_sample_and_answers_three_questions(demo: tuple[str, str]) -> None:
    db, output = demo
    assert "Outcomes (7 sessions" in output
    assert output.count("SELECT") == 3 and "Which causes made sessions retry" in output
    outcomes = {(r["task"], r["attempt"]): (r["outcome"], r["rule"]) for r in listing(db)}
    assert outcomes == {
        ("clean", 1): ("verify", "completed"),
        ("shell-tool", 1): ("verify", "completed"),
        ("rate-limited", 1): ("retry", "reported"),
        ("rate-limited", 2): ("verify", "completed"),
        ("killed-live", 1): ("verify", "probed"),
        ("timeout", 1): ("verify", "incomplete"),
        ("mcp-tool", 1): ("verify", "completed"),
    }


def test_ls_filters_by_task_state_and_cause(demo: tuple[str, str]) -> None:
    db, _ = demo
    assert [r["attempt"] for r in listing(db, "--task", "rate-limited")] == [1, 2]
    (retried,) = listing(db, "--cause", "model_endpoint")
    assert (retried["task"], retried["total_tokens"]) == ("rate-limited", 0)
    assert len(listing(db, "--state", "closed")) == 7
    assert listing(db, "--state", "running") == []


def test_show_explains_which_rule_fired_on_which_event(demo: tuple[str, str]) -> None:
    db, _ = demo
    (killed,) = listing(db, "--task", "killed-live")
    done = trialledger("show", "--db", db, killed["session_id"])
    assert done.returncode == 0, done.stderr
    assert "rule probe fired on seq" in done.stdout and "(cleanup.reported) → probe" in done.stdout
    assert "rule probed fired on seq" in done.stdout and "(sandbox.probed) → verify" in done.stdout
    # Killed mid-run: Codex reported no total, but under v3 the proxy's calls are the usage.
    assert "usage: 15 tokens" in done.stdout and "since start" in done.stdout
    assert "call 1 POST /v1/responses → 200, completed, 15 tokens" in done.stdout
    as_json = json.loads(trialledger("show", "--db", db, killed["session_id"], "--json").stdout)
    assert as_json["outcome"] == "verify"


def test_show_of_an_unknown_session_is_one_line(demo: tuple[str, str]) -> None:
    done = trialledger("show", "--db", demo[0], "no-such-session")
    assert done.returncode == 2 and done.stderr.strip() == "trialledger: no session no-such-session"
