"""`trialledger import-harbor` on job folders built from Harbor's documented result fields."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from trialledger.cli import main
from trialledger.store import Ledger

TURN = '{"type":"turn.started"}'
THREAD = '{"type":"thread.started","thread_id":"01a2267b-4236-7150-ac29-c438e0ea4228"}'
SLEEP = ('{"type":"item.started","item":{"id":"item_1","type":"command_execution","command":'
         '"/bin/bash -lc \'make test\'","aggregated_output":"","exit_code":null,'
         '"status":"in_progress"}}')
RATE = [THREAD, TURN,
        '{"type":"error","message":"exceeded retry limit, last status: 429 Too Many Requests"}',
        '{"type":"turn.failed","error":{"message":"exceeded retry limit, last status: 429 Too '
        'Many Requests"}}']
CLEAN = [THREAD, TURN,
         '{"type":"item.completed","item":{"id":"item_1","type":"agent_message","text":"done"}}',
         '{"type":"turn.completed","usage":{"input_tokens":12,"cached_input_tokens":2,'
         '"output_tokens":10,"reasoning_output_tokens":3}}']
POLICY = {  # Harbor's error_policy rows: (should_retry, should_grade, has_valid_reward)
    "AgentTimeoutError": (False, True, True),
    "NonZeroAgentExitCodeError": (False, True, True),
    "ApiRateLimitError": (True, True, False),
}


def token_count(i: int, o: int) -> str:
    total = {"input_tokens": i, "cached_input_tokens": 0, "output_tokens": o,
             "reasoning_output_tokens": 0, "total_tokens": i + o}
    return json.dumps({"timestamp": "2026-10-20T14:19:00.000Z", "type": "event_msg",
                       "payload": {"type": "token_count", "info": {
                           "total_token_usage": total, "last_token_usage": total}}})


def trial(job: Path, name: str, *, exception: tuple[str, str] | None, rewards: Any,
          codex: list[str], rollout: list[str] | None = None) -> str:
    """One trial folder: result.json with Harbor's TrialResult fields, codex.txt, rollout."""
    folder = job / name
    (folder / "agent").mkdir(parents=True)
    trial_id = str(uuid.uuid5(uuid.NAMESPACE_URL, name))
    info: dict[str, Any] | None = None
    if exception:
        retry, grade, valid = POLICY[exception[0]]
        info = {"exception_type": exception[0], "exception_message": exception[1],
                "exception_traceback": "Traceback ...", "occurred_at": "2026-10-20T14:19:13.712Z",
                "policy": {"should_retry": retry, "should_grade": grade,
                           "has_valid_reward": valid}}
    reward_valid = bool(rewards) and (info is None or info["policy"]["has_valid_reward"])
    result = {
        "schema_version": 1, "id": trial_id, "task_name": name.split("__")[0],
        "trial_name": name, "trial_uri": f"file:///jobs/j/{name}", "task_id": {"path": "/t"},
        "source": "terminal-bench", "task_checksum": "3f9a",
        "config": {"agent": {"name": "codex", "model_name": "openai/gpt-5.1-codex"}},
        "agent_info": {"name": "codex", "version": "0.124.0",
                       "model_info": {"name": "gpt-5.1-codex", "provider": "openai"}},
        "agent_result": {"n_input_tokens": 1843200, "n_cache_tokens": 1612800,
                         "n_output_tokens": 21450, "cost_usd": 0.6358},
        "verifier_result": {"rewards": rewards} if rewards is not None else None,
        "exception_info": info,
        "started_at": "2026-10-20T14:03:11.412000Z", "finished_at": "2026-10-20T14:19:55.312000Z",
        "agent_execution": {"started_at": "2026-10-20T14:04:13.612000Z",
                            "finished_at": "2026-10-20T14:19:13.712000Z"},
        "verifier": {"started_at": "2026-10-20T14:19:16.412000Z",
                     "finished_at": "2026-10-20T14:19:48.812000Z"},
        "step_results": None, "reward_valid": reward_valid,
    }
    (folder / "result.json").write_text(json.dumps(result))
    (folder / "agent" / "codex.txt").write_text("\n".join(codex) + "\n")
    if rollout:
        day = folder / "agent" / "sessions" / "2026" / "10" / "20"
        day.mkdir(parents=True)
        (day / "rollout-2026-10-20T14-04-14-x.jsonl").write_text("\n".join(rollout) + "\n")
    return trial_id


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    job = tmp_path / "jobs" / "2026-10-20__14-03-05"
    job.mkdir(parents=True)
    (job / "result.json").write_text(json.dumps({"stats": {"n_retries": 2}}))
    ids = {
        "timeout": trial(job, "fix-git-merge__Hk3pQ9a",
                         exception=("AgentTimeoutError",
                                    "Agent execution timed out after 900.0 seconds"),
                         rewards={"reward": 0.0}, codex=[THREAD, TURN, SLEEP],
                         rollout=[token_count(1843200, 21450)]),
        "rate": trial(job, "build-cache__Zz81Aa2",
                      exception=("NonZeroAgentExitCodeError", "Command failed with exit code 1"),
                      rewards={"reward": 0.0},
                      codex=["Reading prompt from stdin...", *RATE]),
        "clean": trial(job, "hello__Qq11Ww2", exception=None, rewards={"reward": 1.0},
                       codex=CLEAN),
        "api": trial(job, "flaky__Rr22Tt3", exception=("ApiRateLimitError", "rate limit"),
                     rewards=None, codex=["Error: thread/start failed: rate limit reached"]),
    }
    return job, ids


def _run(capsys: Any, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


async def _session_count(db: str) -> int:
    async with await Ledger.open(db) as ledger:
        return len(await ledger.sessions())


async def _views(db: str, ids: dict[str, str]) -> dict[str, Any]:
    async with await Ledger.open(db) as ledger:
        return {name: await ledger.view(sid) for name, sid in ids.items()}


def test_import_harbor_maps_each_trial_and_explains_disagreements(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]]) -> None:
    folder, ids = job
    db = str(tmp_path / "t.db")
    code, out = _run(capsys, "import-harbor", "--db", db, str(folder), "--json")
    assert code == 1  # a disagreement is something found
    rows = {row["trial"]: row for row in json.loads(out)}
    assert {row["status"] for row in rows.values()} == {"imported"}
    timed_out = rows["fix-git-merge__Hk3pQ9a"]
    assert (timed_out["our_rule"], timed_out["our_action"], timed_out["agrees"]) == (
        "incomplete", "verify", True)
    assert timed_out["rewards_appended"] is True
    rate = rows["build-cache__Zz81Aa2"]
    assert (rate["our_rule"], rate["our_action"], rate["agrees"]) == ("reported", "retry", False)
    assert rate["explanation"] == (  # Harbor's exception policy, our rule, our evidence
        "Harbor: NonZeroAgentExitCodeError (should_retry false, should_grade true, "
        "has_valid_reward true) → verify, reward valid; we: rule reported → retry, reward "
        "invalid, on cause model_endpoint (status 429); error 'exceeded retry limit, last "
        "status: 429 Too Many Requests'")
    assert rate["rewards_appended"] is False  # compared, never appended
    assert (rate["harbor_rewards"], rate["our_rewards"]) == ({"reward": 0.0}, None)
    hello = rows["hello__Qq11Ww2"]
    assert hello["agrees"] and hello["rewards_appended"]
    assert hello["our_rewards"] == hello["harbor_rewards"] == {"reward": 1.0}
    assert timed_out["harbor_tokens"] == {"input": 1843200, "cached": 1612800,
                                          "output": 21450}
    assert timed_out["our_tokens"] == {"input": 1843200, "cached": 0, "output": 21450}
    assert timed_out["tokens_agree"] is False  # the rollout says no cached tokens
    assert hello["our_tokens"] == {"input": 12, "cached": 2, "output": 10}
    api = rows["flaky__Rr22Tt3"]
    assert (api["our_rule"], api["harbor_verdict"], api["agrees"]) == (
        "startup_failed", "retry", True)

    views = anyio.run(_views, db, ids)
    assert views["timeout"].rewards == {"reward": 0.0}
    assert views["timeout"].usage.total_tokens == 1843200 + 21450
    assert views["timeout"].observations.tool_calls[0].status == "incomplete"
    assert views["rate"].rewards is None and views["rate"].outcome == "retry"
    gaps = [g.code for g in views["timeout"].observations.gaps]
    assert "cleanup_assumed" in gaps and "harbor_retries_discarded" in gaps
    stderr = next(e for e in views["rate"].events if e.type == "agent.stderr").data.tail
    assert stderr == "Reading prompt from stdin..."


def test_import_harbor_twice_is_a_no_op_and_prints_a_table(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]]) -> None:
    folder, _ = job
    db = str(tmp_path / "t.db")
    first = _run(capsys, "import-harbor", "--db", db, str(folder))[1]
    assert "4 trials imported; 3 agree with Harbor's verdict\n" in first
    code, out = _run(capsys, "import-harbor", "--db", db, str(folder))
    assert code == 1 and ("4 trials imported; 3 agree with Harbor's verdict; 4 unchanged "
                          "since an earlier import") in " ".join(out.split())
    assert "│ NO    │" in out  # the disagreeing row, marked
    code, out = _run(capsys, "sql", "--db", db, "--json", "SELECT count(*) AS n FROM sessions")
    assert json.loads(out) == [{"n": 4}]


def test_links_out_of_the_job_are_never_followed(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]]) -> None:
    folder, ids = job
    canary = tmp_path / "host-secret.txt"
    canary.write_text('{"type":"item.completed","item":{"id":"x","type":"agent_message",'
                      '"text":"canary-host-secret"}}\n')
    codex = folder / "hello__Qq11Ww2" / "agent" / "codex.txt"
    codex.unlink()
    codex.symlink_to(canary)  # the agent's harness pointed its log at a host file
    (folder / "linked-trial").symlink_to(folder / "hello__Qq11Ww2")  # a trial twice
    db = str(tmp_path / "t.db")
    _run(capsys, "import-harbor", "--db", db, str(folder))
    views = anyio.run(_views, db, ids)
    clean = views["clean"]
    assert "canary-host-secret" not in clean.model_dump_json()
    assert ("unsafe_agent_file" in [g.code for g in clean.observations.gaps])

    assert anyio.run(_session_count, db) == len(ids)  # the linked folder is no second trial


@pytest.mark.parametrize("broken", ["not json {", "[1, 2]", '{"started_at": "yesterday"}',
                                    "link"])
def test_a_malformed_trial_refuses_the_whole_job_naming_it(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]], broken: str) -> None:
    folder, _ = job
    result = folder / "flaky__Rr22Tt3" / "result.json"
    if broken == "link":
        result.unlink()
        result.symlink_to("/etc/hostname")
    else:
        result.write_text(broken)
    db = str(tmp_path / "t.db")
    code = main(["import-harbor", "--db", db, str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "flaky__Rr22Tt3" in err and err.count("\n") == 1, err
    assert anyio.run(_session_count, db) == 0  # nothing of the job was stored


@pytest.mark.parametrize(("field", "value"), [
    (("exception_info", "policy"), "yes"), (("agent_result",), [1]),
    (("agent_result",), "many"), (("exception_info", "policy"), [True])])
def test_a_result_field_of_another_shape_is_read_as_absent(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]],
        field: tuple[str, ...], value: Any) -> None:
    """Read after the trial was checked, Harbor's policy and token counts crashed the
    import with a traceback (the session stored, the table never printed)."""
    folder, ids = job
    path = folder / "fix-git-merge__Hk3pQ9a" / "result.json"
    result = json.loads(path.read_text())
    holder = result
    for key in field[:-1]:
        holder = holder[key]
    holder[field[-1]] = value
    path.write_text(json.dumps(result))
    code, out = _run(capsys, "import-harbor", "--db", str(tmp_path / "t.db"), str(folder))
    assert code in (0, 1) and f"{len(ids)} trials imported" in out  # 1: a verdict differs
    assert anyio.run(_session_count, str(tmp_path / "t.db")) == len(ids)


@pytest.mark.parametrize("what", ["empty", "a task folder"])
def test_a_folder_without_trials_is_refused_in_one_line(
        capsys: Any, tmp_path: Path, what: str) -> None:
    folder = tmp_path / "jobs" / "nothing"
    folder.mkdir(parents=True)
    if what == "a task folder":
        (folder / "instruction.md").write_text("do it\n")
        (folder / "tests").mkdir()
    db = tmp_path / "t.db"
    code = main(["import-harbor", "--db", str(db), str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and "no trial folder" in err and err.count("\n") == 1, err
    assert not db.exists() or anyio.run(_session_count, str(db)) == 0


def test_a_missing_codex_log_is_a_gap_that_explains_the_retry(
        capsys: Any, tmp_path: Path, job: tuple[Path, dict[str, str]]) -> None:
    """Harbor scored the trial, but its codex.txt is gone: nothing shows the agent ran, so
    we do not grade it — and the gap says why, in the store and in the explanation."""
    folder, ids = job
    (folder / "hello__Qq11Ww2" / "agent" / "codex.txt").unlink()
    db = str(tmp_path / "t.db")
    code, out = _run(capsys, "import-harbor", "--db", db, str(folder), "--json")
    assert code == 1
    hello = next(row for row in json.loads(out) if row["trial"] == "hello__Qq11Ww2")
    assert (hello["our_action"], hello["agrees"]) == ("retry", False)
    assert "gaps agent_output_missing" in hello["explanation"]
    view = anyio.run(_views, db, ids)["clean"]
    assert "agent_output_missing" in [g.code for g in view.observations.gaps]


def test_markup_in_an_agents_output_is_shown_as_text_never_parsed(
        capsys: Any, tmp_path: Path) -> None:
    """Codex's output reaches the tables (an error becomes the explanation): rich markup in
    it — an unmatched closing tag would raise — is printed as it is."""
    job = tmp_path / "jobs" / "j"
    job.mkdir(parents=True)
    forged = [*RATE[:2], '{"type":"error","message":"exceeded retry limit, last status: 429 '
              '[/evil] [link=file:///etc/shadow]x[/link]"}',
              '{"type":"turn.failed","error":{"message":"429 [/evil]"}}']
    trial(job, "forged__Aa1", exception=("NonZeroAgentExitCodeError", "exit code 1"),
          rewards={"reward": 0.0}, codex=forged)
    code, out = _run(capsys, "import-harbor", "--db", str(tmp_path / "t.db"), str(job))
    assert code == 1 and "[/evil]" in out
