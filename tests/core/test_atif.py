"""ATIF trajectories from the events (core/atif.py, docs/SPEC.md §18): the golden file of
each sample log, each valid by Harbor 0.26's own `Trajectory`, and `show --atif`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.golden import ATIF_SOURCES, GOLDEN, atif_golden, atif_of, atif_text
from tests.harbor_models import models
from trialledger.cli import main
from trialledger.core import replay


@pytest.fixture(scope="module")
def Trajectory() -> Any:
    return models()["trajectory"].Trajectory


@pytest.mark.parametrize("source", ATIF_SOURCES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_golden_atif(source: Path, Trajectory: Any) -> None:
    """The trajectory of each sample log is its golden file (`python -m tests.golden atif`
    rewrites them after a deliberate change), and Harbor's model accepts it as it is."""
    built = atif_of(source)
    golden = atif_golden(source)
    assert atif_text(built) == golden.read_text(encoding="utf-8"), (
        f"{golden.name} differs: rerun `python -m tests.golden atif` if the change is meant")
    parsed = Trajectory.model_validate(built)
    assert parsed.to_json_dict() == Trajectory.model_validate_json(
        golden.read_text(encoding="utf-8")).to_json_dict()


def test_every_golden_has_its_log() -> None:
    """No golden file outlives the log it was made from."""
    assert sorted(p.name for p in (GOLDEN / "atif").glob("*.json")) == sorted(
        atif_golden(s).name for s in ATIF_SOURCES)


def test_tool_calls_carry_arguments_output_and_the_calls_tokens() -> None:
    """A real Codex shell call: its command, its output as the observation, and the
    tokens of the model call that asked for it; the session's usage as final metrics."""
    source = GOLDEN / "v3" / "shell-tool-1.jsonl"
    events = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()]
    view = replay(events)
    steps = atif_of(source)["steps"]
    (tool,) = [s for s in steps if s.get("tool_calls")]
    (call,) = view.observations.tool_calls
    assert tool["tool_calls"][0] == {"tool_call_id": call.id, "function_name": "exec_command",
                                     "arguments": {"cmd": call.arguments["cmd"]}}
    assert tool["observation"]["results"] == [{"source_call_id": call.id,
                                              "content": call.output}]
    first_call = next(e for e in events if e["type"] == "model.call")["data"]["usage"]
    assert tool["metrics"]["prompt_tokens"] == first_call["input_tokens"]
    assert tool["metrics"]["completion_tokens"] == first_call["output_tokens"]
    assert steps[0] == {"step_id": 1, "timestamp": events[0]["at"], "source": "user",
                        "message": events[0]["data"]["instruction"]}
    final = atif_of(source)["final_metrics"]
    assert view.usage is not None
    assert (final["total_prompt_tokens"], final["total_completion_tokens"]) == (
        view.usage.input_tokens, view.usage.output_tokens)


def test_show_atif_prints_the_trajectory(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    """`show SESSION --atif` prints the stored session's trajectory as JSON."""
    db = str(tmp_path / "t.db")
    source = GOLDEN / "v3" / "mcp-tool-1.jsonl"
    assert main(["import", "--db", db, str(source)]) == 0
    session = capsys.readouterr().out.strip()
    assert main(["show", "--db", db, session[:8], "--atif"]) == 0
    assert json.loads(capsys.readouterr().out) == atif_of(source)
