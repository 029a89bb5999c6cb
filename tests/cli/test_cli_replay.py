"""`trialledger replay --log`: the view as JSON; bad input → exit 2 with the line number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import in_process
from tests.scenarios import SCENARIOS, write_examples

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def trialledger(*args: str) -> subprocess.CompletedProcess[str]:
    return in_process(*args, cwd=ROOT)


def test_examples_are_the_scenarios_written_out(tmp_path: Path) -> None:
    write_examples(tmp_path)
    fresh = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.iterdir()}
    shipped = {p.name: p.read_text(encoding="utf-8") for p in EXAMPLES.glob("*.jsonl")}
    assert shipped == fresh, "run: python -m tests.scenarios examples"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_prints_the_view(name: str) -> None:
    done = trialledger("replay", "--log", str(EXAMPLES / f"{name}.jsonl"))
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["decision"]["rule"] == SCENARIOS[name][1]["rule"]
    assert set(view) == {"session_id", "state", "outcome", "decision", "decisions", "usage",
                         "rewards", "observations", "unapplied", "diverged_at", "events"}
    assert view["events"][0]["schema"] == 1


def _write(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_malformed_line_gives_its_number(tmp_path: Path) -> None:
    good = (EXAMPLES / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    done = trialledger("replay", "--log", _write(tmp_path, [good[0], "", "{not json"]))
    assert done.returncode == 2
    assert "line 3: not JSON" in done.stderr and done.stdout == ""


def test_bad_field_names_line_and_field(tmp_path: Path) -> None:
    good = (EXAMPLES / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    bad = json.loads(good[-1])
    bad["data"]["confirmed"] = "maybe"
    done = trialledger("replay", "--log", _write(tmp_path, [*good[:-1], json.dumps(bad)]))
    assert done.returncode == 2
    assert f"line {len(good)}: field 'data.confirmed'" in done.stderr


def test_illegal_transition_names_the_line(tmp_path: Path) -> None:
    good = (EXAMPLES / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    done = trialledger("replay", "--log", _write(tmp_path, [good[0], good[3]]))
    assert done.returncode == 2
    assert "line 2:" in done.stderr and "not allowed in state 'seeded'" in done.stderr


def test_unknown_policy_is_refused(tmp_path: Path) -> None:
    done = trialledger("replay", "--log", str(EXAMPLES / "clean.jsonl"), "--policy", "v9")
    assert done.returncode == 2 and "unknown policy 'v9'" in done.stderr


def test_unknown_event_type_is_named(tmp_path: Path) -> None:
    good = (EXAMPLES / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    line = json.dumps({"type": "agent.danced", "at": "2026-11-29T08:00:01Z", "data": {}})
    done = trialledger("replay", "--log", _write(tmp_path, [good[0], line]))
    assert done.returncode == 2 and "line 2: unknown event type 'agent.danced'" in done.stderr


def test_a_policy_file_that_raises_is_one_line_not_a_difference(tmp_path: Path) -> None:
    broken = tmp_path / "broken_policy.py"
    broken.write_text("raise RuntimeError('typo in my policy')\n")
    done = trialledger("replay", "--log", str(EXAMPLES / "clean.jsonl"), "--policy-file",
                       str(broken))
    assert done.returncode == 2 and "typo in my policy" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_reader_that_leaves_early_is_not_an_error(tmp_path: Path) -> None:
    import json as json_

    log = [json_.loads(line) for line in (EXAMPLES / "clean.jsonl").read_text().splitlines()]
    big = {"type": "codex.unknown", "at": log[2]["at"], "data": {"line": "x" * 400_000}}
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(json_.dumps(e) for e in [*log[:3], big, *log[3:]]) + "\n")
    db = str(tmp_path / "t.db")
    sid = trialledger("import", "--db", db, str(path)).stdout.strip()
    done = subprocess.run(
        f"{sys.executable} -m trialledger.cli export --db {db} --session {sid} | head -c 100",
        shell=True, capture_output=True, text=True, cwd=ROOT, check=False, timeout=120)
    assert done.stdout.startswith("{") and done.stderr == "", done.stderr


def test_an_event_from_a_newer_schema_is_refused_naming_its_line(tmp_path: Path) -> None:
    """A log written by newer trialledger (a schema this code does not know) is refused,
    never read as if it were ours; every schema this code writes is accepted."""
    good = (EXAMPLES / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    index = next(i for i, line in enumerate(good) if '"agent.launched"' in line)
    newer = json.loads(good[index])
    from trialledger.core.events import SCHEMA_VERSION

    today = SCHEMA_VERSION["agent.launched"]
    newer["schema"] = today + 1
    lines = [*good[:index], json.dumps(newer), *good[index + 1:]]
    done = trialledger("replay", "--log", _write(tmp_path, lines))
    assert done.returncode == 2 and f"line {index + 1}: field 'schema'" in done.stderr
    assert f"agent.launched schema {today + 1} is newer" in done.stderr
    newer["schema"] = today  # what the runner writes today
    lines = [*good[:index], json.dumps(newer), *good[index + 1:]]
    assert trialledger("replay", "--log", _write(tmp_path, lines)).returncode == 0
