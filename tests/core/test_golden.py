"""Golden transcripts of real Codex runs: every recorded decision must re-derive unchanged."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.golden import GOLDEN
from trialledger.core import replay
from trialledger.core.parsing import parse_jsonl

FILES = sorted(GOLDEN.rglob("*.jsonl"))


def _decisions(events: list[dict[str, Any]]) -> list[str]:
    return [json.dumps({"seq": e["seq"], **e["data"]}, sort_keys=True, indent=1)
            for e in events if e["type"] == "outcome.decided"]


@pytest.mark.parametrize("folder, policy", [(GOLDEN, "v1"), (GOLDEN / "v3", "v3")])
def test_there_are_golden_transcripts_of_every_demo_sample(folder: Path, policy: str) -> None:
    files = sorted(folder.glob("*.jsonl"))
    tasks = {path.stem.rsplit("-", 1)[0] for path in files}
    assert tasks == {"clean", "shell-tool", "rate-limited", "killed-live", "timeout", "mcp-tool"}
    policies = {json.loads(line)["data"]["policy"] for path in files
                for line in path.read_text(encoding="utf-8").splitlines()
                if '"outcome.decided"' in line}
    assert policies == {policy}  # each replays under the policy it was recorded with


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(GOLDEN)) for p in FILES])
def test_golden_transcript_rederives_every_decision(path: Path) -> None:
    with path.open(encoding="utf-8") as lines:
        recorded = [obj for _, obj in parse_jsonl(lines)]
    view = replay(recorded)
    derived = [e.model_dump(mode="json") for e in view.events]
    before, after = _decisions(recorded), _decisions(derived)
    if before != after or view.diverged_at is not None or view.unapplied:
        diff = "\n".join(difflib.unified_diff(
            "\n".join(before).splitlines(), "\n".join(after).splitlines(),
            fromfile=f"{path.name} (recorded)", tofile="re-derived now", lineterm=""))
        pytest.fail(f"{path.name}: re-derived decisions differ\n{diff}")
    assert [e["type"] for e in derived] == [e["type"] for e in recorded]


def test_a_changed_decision_fails_with_a_readable_diff(tmp_path: Path) -> None:
    path = next(p for p in sorted(GOLDEN.glob("*.jsonl")) if p.stem.startswith("killed-live"))
    lines = path.read_text(encoding="utf-8").splitlines()
    tampered = [json.loads(line) for line in lines]
    first = next(e for e in tampered if e["type"] == "outcome.decided")
    first["data"]["rule"], first["data"]["action"] = "execution_error", "retry"
    copy = tmp_path / path.name
    copy.write_text("\n".join(json.dumps(e) for e in tampered) + "\n", encoding="utf-8")
    with pytest.raises(pytest.fail.Exception) as caught:
        test_golden_transcript_rederives_every_decision(copy)
    message = str(caught.value)
    assert '- "rule": "execution_error"' in message and '+ "rule": "probe"' in message


def test_a_schema_1_launch_reads_as_the_host_and_dumps_as_written() -> None:
    """A log written before task images (agent.launched schema 1, no `environment`): its
    launch reads as `{kind: host}`, and its JSON is still exactly what was written."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    lines = (examples / "clean.jsonl").read_text(encoding="utf-8").splitlines()
    written = next(json.loads(line) for line in lines if '"agent.launched"' in line)
    assert written.get("schema", 1) == 1 and "environment" not in written["data"]
    view = replay([json.loads(line) for line in lines])
    launch = next(e for e in view.events if e.type == "agent.launched")
    assert launch.data.ran_in == {"kind": "host"}
    assert launch.data.model_dump(mode="json") == written["data"]
