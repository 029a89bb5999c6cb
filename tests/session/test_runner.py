"""The runner driving the real Codex CLI 0.171.0 under bubblewrap against a scripted endpoint."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from tests.runs import codex_path, in_process, killer, make_task, run_task, run_trial
from tests.views import seeded
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, cut, message, shell, status, tool
from trialledger.adapters.demo.samples import executable
from trialledger.adapters.demo.tools import ToolServer
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.session import verifying
from trialledger.core import SeedRejected
from trialledger.core.events import SessionClosedData
from trialledger.store import Ledger

pytestmark = pytest.mark.anyio
OVERLOADED = {"error": {"message": "overloaded", "type": "server_error",
                        "code": "server_is_overloaded"}}
FAST = {"request_max_retries": 0, "stream_max_retries": 0}


def codes(view: Any) -> list[str]:
    return [g.code for g in view.observations.gaps]


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "trials.db")


@pytest.fixture
def task(tmp_path: Path) -> Any:
    return make_task(tmp_path / "task", test_sh="exit 0\n")


async def test_clean_run_is_graded_with_usage_and_verified(db: str, task: Any) -> None:
    ran = await run_task(db, task, [message("hi there")])
    view = ran.view
    assert (view.state, view.outcome, view.decision.rule) == ("closed", "verify", "completed")
    assert view.usage.total_tokens == 22 and view.usage.cached_input_tokens == 2
    assert [m.text for m in view.observations.invocation.conversation] == ["say hi", "hi there"]
    launched = next(e for e in view.events if e.type == "agent.launched").data
    assert launched.isolation == "bwrap" and "CODEX_HOME" in launched.env_keys
    assert launched.identity["mode"] == "single"  # schema 3; a host task emulates no root
    assert "model_metadata_fallback" in codes(view) and "root_emulated" not in codes(view)
    assert view.rewards == {"reward": 1.0}
    types = [e.type for e in view.events]
    assert types.index("agent.exited") < types.index("cleanup.reported") < types.index(
        "outcome.decided") < types.index("verification.recorded") < types.index("session.closed")


async def test_a_shell_tool_call_really_runs_and_is_observed(db: str, tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="grep -q hello-from-tool out.txt\n")
    ran = await run_task(db, task, [shell("echo hello-from-tool > out.txt; cat out.txt"),
                                    message("done")])
    (call,) = ran.view.observations.tool_calls
    assert (call.name, call.status, call.exit_code, call.output) == (
        "exec_command", "completed", 0, "hello-from-tool\n")
    assert len(ran.endpoint.requests) == 2  # two model calls
    assert ran.view.usage.total_tokens == 15 + 22
    assert ran.view.rewards == {"reward": 1.0}  # the verifier saw the agent's file


@pytest.mark.parametrize("reply", [status(429), status(500), cut(), status(503, OVERLOADED)],
                         ids=["429", "500", "stream-cut", "503-overloaded"])
async def test_endpoint_failures_are_retried_with_cause_model_endpoint(
        db: str, task: Any, reply: Any) -> None:
    ran = await run_task(db, task, [reply], settings=FAST)
    d = ran.view.decision
    assert (d.policy, d.action, d.cause.kind, ran.view.outcome) == (
        "v3", "retry", "model_endpoint", "retry")  # the proxy saw it: the claim holds
    assert "verification.recorded" not in [e.type for e in ran.view.events]
    (call,) = [e.data for e in ran.view.events if e.type == "model.call"]
    assert not call.completed and call.http_status == reply.status


async def test_killed_mid_run_with_opt_in_is_probed_then_graded(
        db: str, task: Any, tmp_path: Path) -> None:
    wrapper = killer(tmp_path / "bin", '"type":"item.started"')
    ran = await run_task(db, task, [shell("sleep 30")], codex_bin=str(wrapper),
                         extra_paths=[wrapper.parent], settings={"verify_after_agent_error": True})
    view = ran.view
    exited = next(e for e in view.events if e.type == "agent.exited").data
    assert exited.return_code == -9
    assert [d.rule for d in view.decisions] == ["probe", "probed"]
    assert view.decision.action == "verify" and view.outcome == "verify"
    (call,) = view.observations.tool_calls
    assert call.status == "incomplete"


async def test_killed_mid_run_without_opt_in_is_retried(db: str, task: Any, tmp_path: Path) -> None:
    wrapper = killer(tmp_path / "bin", '"type":"item.started"')
    ran = await run_task(db, task, [shell("sleep 30")], codex_bin=str(wrapper),
                         extra_paths=[wrapper.parent])
    assert [d.rule for d in ran.view.decisions] == ["execution_error"]
    assert ran.view.outcome == "retry"


async def test_killed_after_a_reported_endpoint_failure_is_retried_without_probe(
        db: str, task: Any, tmp_path: Path) -> None:
    wrapper = killer(tmp_path / "bin", '"type":"turn.failed"')
    ran = await run_task(db, task, [status(429)], codex_bin=str(wrapper),
                         extra_paths=[wrapper.parent],
                         settings={**FAST, "verify_after_agent_error": True})
    assert [d.rule for d in ran.view.decisions] == ["endpoint_killed"]
    assert "sandbox.probed" not in [e.type for e in ran.view.events]


async def test_timeout_is_incomplete_and_keeps_the_partial_tool_call(db: str, task: Any) -> None:
    ran = await run_task(db, task, [shell("sleep 60")], settings={"timeout_s": 3},
                         grace_s=1.0)
    d = ran.view.decision
    assert (d.status, d.incomplete_reason, d.action) == ("incomplete", "timeout", "verify")
    (call,) = ran.view.observations.tool_calls
    assert call.status == "incomplete" and call.arguments["cmd"].endswith("sleep 60'")


async def test_required_mcp_server_down_is_a_startup_failure(db: str, task: Any) -> None:
    token = "tok-Zx81Qw27Ep63Rt45"
    grants = [{"name": "gym", "kind": "mcp", "required": True, "url": "http://127.0.0.1:9/mcp",
               "headers": {"Authorization": f"Bearer {token}"}}]
    ran = await run_task(db, task, [message()], grants=grants)
    d = ran.view.decision
    assert (d.rule, d.action) == ("startup_failed", "retry")
    gaps = {g.code: g.detail for g in ran.view.observations.gaps}
    assert "required MCP servers failed to initialize" in gaps["agent_startup_failed"]
    assert ran.endpoint.requests == []  # no model call was made
    assert token not in Path(db).read_bytes().decode(errors="replace")


async def test_optional_grant_with_a_bad_name_is_left_out(db: str, task: Any) -> None:
    grants = [{"name": "my tools", "kind": "mcp", "url": "http://127.0.0.1:9/mcp"}]
    ran = await run_task(db, task, [message()], grants=grants)
    gaps = {g.code: g.detail for g in ran.view.observations.gaps}
    assert "my tools" in gaps["mcp_server_skipped"]
    assert ran.view.decision.rule == "completed"


async def test_codex_calls_a_real_mcp_tool_with_the_session_token(db: str, task: Any) -> None:
    token = "tok-Mcp4Session8Token"
    with ToolServer() as tools:
        grants = [{"name": "gym", "kind": "mcp", "required": True, "url": tools.url,
                   "headers": {"Authorization": f"Bearer {token}"}}]
        ran = await run_task(db, task, [tool("lookup", {"query": "overlay"},
                                             namespace="mcp__gym"), message("ok")],
                             grants=grants, settings={"mcp_tool_timeout_s": 30})
    assert tools.calls == ["overlay"]
    assert any(h.get("authorization") == f"Bearer {token}" for h in tools.headers)
    (call,) = ran.view.observations.tool_calls
    assert (call.name, call.kind, call.status) == ("lookup", "mcp_tool_call", "completed")
    assert call.output.startswith("definition of overlay")
    assert token[:8] not in Path(db).read_bytes().decode(errors="replace")


async def test_tokens_echoed_by_stderr_or_by_the_agent_never_reach_the_database(
        db: str, task: Any, tmp_path: Path) -> None:
    token = "tok-Echo5Me7Please9X"
    (tmp_path / "bin").mkdir()
    noisy = executable(tmp_path / "bin" / "codex-noisy", f"""#!/bin/bash
grep -h Authorization "$CODEX_HOME/config.toml" >&2
echo "cut echo: {token[:11]}" >&2
exec {codex_path()} "$@"
""")
    with ToolServer() as tools:
        grants = [{"name": "gym", "kind": "mcp", "url": tools.url,
                   "headers": {"Authorization": f"Bearer {token}"}}]
        ran = await run_task(db, task, [shell('cat "$CODEX_HOME/config.toml"'), message()],
                             grants=grants, codex_bin=str(noisy), extra_paths=[noisy.parent])
    stderr = next(e for e in ran.view.events if e.type == "agent.stderr").data.tail
    assert "[redacted]" in stderr
    (call,) = ran.view.observations.tool_calls
    assert "[redacted]" in call.output and "http_headers" in call.output
    on_disk = b"".join(p.read_bytes() for p in Path(db).parent.glob("trials.db*"))
    assert not any(token[i:i + 8].encode() in on_disk for i in range(len(token) - 7))


@pytest.mark.parametrize("script, expected", [
    ('echo \'{"reward": 0.5, "style": 1}\' > "$TRIALLEDGER_VERIFIER_DIR/reward.json"',
     ("verification.recorded", {"reward": 0.5, "style": 1.0})),
    ("exit 3", ("verification.recorded", {"reward": 0.0})),
    ("sleep 30", ("verification.failed", "timeout")),
    ('echo nonsense > "$TRIALLEDGER_VERIFIER_DIR/reward.txt"',
     ("verification.failed", "bad_reward")),
])
async def test_verifier_rewards(db: str, tmp_path: Path, script: str, expected: Any) -> None:
    task = make_task(tmp_path / "task", test_sh=script + "\n",
                     toml="[verifier]\ntimeout_sec = 2\n")
    ran = await run_task(db, task, [message()])
    event = next(e for e in ran.view.events if e.type.startswith("verification."))
    kind, detail = expected
    assert event.type == kind
    if kind == "verification.recorded":
        assert event.data.rewards == detail
    else:
        assert event.data.reason == detail


async def test_verifier_sees_tests_only_at_verification(db: str, tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh='test -f /tests/test.sh && test -w . && exit 0\n'
                                                'exit 1\n')
    ran = await run_task(db, task, [shell("ls /tests 2>&1 || echo no-tests-here"), message()])
    (call,) = ran.view.observations.tool_calls
    assert "no-tests-here" in call.output  # the agent cannot see the verifier's tests
    assert ran.view.rewards == {"reward": 1.0}


async def test_max_attempts_retries_a_lost_session(db: str, task: Any) -> None:
    results = await run_trial(db, task, [status(429), message()], settings=FAST, max_attempts=2)
    first, second = results
    assert (first.outcome, second.outcome) == ("retry", "verify")
    seed = seeded(second.view)
    assert (seed.attempt, seed.retry_of) == (2, first.session_id)
    assert seed.trial_id == seeded(first.view).trial_id
    async with await Ledger.open(db) as ledger:  # the runner's own fold is the stored view
        assert [r.view for r in results] == [await ledger.view(r.session_id) for r in results]


async def test_slow_archive_within_a_3s_budget_keeps_the_run(
        db: str, task: Any, tmp_path: Path, monkeypatch: Any) -> None:
    copy = verifying.copy_archive

    def slow_copy(*args: Any) -> Any:
        time.sleep(8)  # a copy stuck on a slow disk, past the 3 s budget
        return copy(*args)

    monkeypatch.setattr(verifying, "copy_archive", slow_copy)
    ran = await run_task(db, task, [message()],
                         settings={"session_close_timeout_s": 3,
                                   "sandbox_logs_dir": str(tmp_path / "logs")})
    skipped = next(e for e in ran.view.events if e.type == "archive.skipped").data
    assert skipped.reason == "timeout"
    assert ran.view.usage.total_tokens == 22
    assert ran.view.decision.rule == "completed" and ran.view.outcome == "verify"


async def test_archive_copies_the_rollout(db: str, task: Any, tmp_path: Path) -> None:
    ran = await run_task(db, task, [message()],
                         settings={"sandbox_logs_dir": str(tmp_path / "logs")})
    copied = next(e for e in ran.view.events if e.type == "archive.copied").data
    assert copied.files == 1 and copied.bytes > 0
    assert list((tmp_path / "logs").rglob("rollout-*.jsonl"))


async def test_workdir_slash_runs_on_an_overlay(db: str, tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="test -f /made-by-agent && exit 0; exit 1\n",
                     workspace={"seed.txt": "pristine"})
    ran = await run_task(db, task, [shell("pwd; cat seed.txt; echo x > /made-by-agent"),
                                    message()], settings={"workdir": "/"})
    (call,) = ran.view.observations.tool_calls
    assert call.output.startswith("/\npristine")
    assert ran.view.rewards == {"reward": 1.0}
    assert not Path("/made-by-agent").exists()


@pytest.mark.parametrize("workdir", ["/tmp", "symlink"])
async def test_workdir_overlapping_the_session_folders_is_rejected(
        db: str, task: Any, tmp_path: Path, workdir: str) -> None:
    if workdir == "symlink":  # a link whose target is inside the session folders' root
        link = tmp_path / "link-to-tmp"
        link.symlink_to("/tmp")
        workdir = str(link)
    with pytest.raises(SeedRejected, match="overlaps"):
        await run_task(db, task, [message()], settings={"workdir": workdir})
    async with await Ledger.open(db) as ledger:
        assert await ledger.sessions() == []


PROBE = ["sleep", "60.25"]  # a command line no other process here has


def _running(argv: list[str]) -> bool:
    """Whether a process with exactly this command line is running on the host."""
    wanted = ("\0".join(argv) + "\0").encode()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == wanted:
                return True
    return False


async def test_closing_during_the_probe_keeps_the_observations(
        db: str, task: Any, tmp_path: Path) -> None:
    wrapper = killer(tmp_path / "bin", '"type":"item.started"')
    with ScriptedEndpoint([shell("sleep 30")]) as endpoint:
        async with await Ledger.open(db) as ledger:
            from trialledger.adapters.codex.install import install_paths
            from trialledger.adapters.session.runner import RunOptions, SessionRunner

            runner = SessionRunner(ledger, task, RunOptions(
                model_base_url=endpoint.url, model="test-model", codex_bin=str(wrapper),
                overrides={"verify_after_agent_error": True}, probe_command=PROBE,
                readonly_paths=[wrapper.parent, *install_paths(codex_path())]))
            async with anyio.create_task_group() as tg:
                tg.start_soon(runner.run_session)
                with anyio.fail_after(60):  # the probe runs: its process is there to see
                    while not _running(PROBE):
                        await anyio.sleep(0.05)
                (row,) = await ledger.sessions()
                assert row["state"] == "failed-live"
                tg.cancel_scope.cancel()
            assert not _running(PROBE)  # the cancelled probe did not outlive its session
            (row,) = await ledger.sessions()
            view = await ledger.view(row["session_id"])
    assert (view.state, view.outcome) == ("closed", "interrupted")
    assert cast(SessionClosedData, view.events[-1].data).reason == "cancelled"
    (call,) = view.observations.tool_calls
    assert call.arguments["cmd"].endswith("sleep 30'")
    assert "agent_activation_interrupted" in codes(view)


def test_run_cli_prints_each_session_and_outcome(tmp_path: Path, task: Any) -> None:
    with ScriptedEndpoint([status(429), message()]) as endpoint:
        done = in_process(
            "run",
            str(task.folder), "--db", str(tmp_path / "cli.db"),
            "--model-base-url", endpoint.url, "--model", "test-model",
            "--codex-bin", codex_path(), "--max-attempts", "2",
            "--set", "request_max_retries=0", "--set", "stream_max_retries=0")
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [words[1:] for words in lines] == [["retry"], ["verify", "reward=1"]]


def test_sandbox_refuses_slash_without_bwrap(tmp_path: Path) -> None:
    from trialledger.adapters.sandbox.local import LocalSandbox

    with pytest.raises(SandboxRefused, match="overlay"):
        LocalSandbox(session_key="x" * 8, workdir="/", isolation="process-group")


async def test_a_launch_that_cannot_spawn_is_a_lost_sandbox(
        db: str, task: Any, tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    ghost = executable(tmp_path / "bin" / "codex", "#!/no/such/interpreter\n")  # cannot exec
    ran = await run_task(db, task, [message()], codex_bin=str(ghost))
    d = ran.view.decision
    assert (d.rule, d.action, ran.view.outcome) == ("sandbox_lost", "retry", "retry")
    assert "could not be spawned" in d.error
    assert "agent.exited" not in [e.type for e in ran.view.events]


async def test_an_unusable_archive_folder_is_skipped_and_the_verifier_still_runs(
        db: str, task: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    ran = await run_task(db, task, [message()],
                         settings={"sandbox_logs_dir": str(blocker / "logs")})
    skipped = next(e for e in ran.view.events if e.type == "archive.skipped").data
    assert skipped.reason == "error"
    assert ran.view.outcome == "verify" and ran.view.rewards == {"reward": 1.0}
    assert ran.view.events[-1].data.reason == "normal"


def test_run_exits_1_when_the_trial_is_left_unscored_and_speaks_json(
        tmp_path: Path, task: Any) -> None:
    import json

    with ScriptedEndpoint([status(429)]) as endpoint:  # retried until attempts run out
        done = in_process(
            "run",
            str(task.folder), "--db", str(tmp_path / "cli.db"), "--json",
            "--model-base-url", endpoint.url, "--model", "test-model",
            "--codex-bin", codex_path(), "--max-attempts", "2",
            "--set", "request_max_retries=0", "--set", "stream_max_retries=0")
    assert done.returncode == 1, done.stderr  # SPEC §10: a trial left unscored
    sessions = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(s["attempt"], s["outcome"], s["rule"], s["cause"]) for s in sessions] == [
        (1, "retry", "reported", "model_endpoint"), (2, "retry", "reported", "model_endpoint")]


async def test_the_verifiers_output_is_kept_redacted_and_shown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Schema 2 of the verification events: the tail of what the verifier printed (stdout
    and stderr together, as Harbor keeps them in `test-stdout.txt`), redacted of the
    session's secrets and bounded, whatever the verifier printed."""
    from trialledger import cli

    secret = "sk-verifier-visible-key-1234"
    task = make_task(tmp_path / "task", test_sh=(
        "for i in $(seq 1 3000); do echo \"line $i of a long log\"; done\n"
        f"echo 'FAILED test_parse: expected 3, got 4 (key {secret})'\n"
        "echo 'warning: slow test' >&2\nexit 1\n"))
    db = tmp_path / "t.db"
    ran = await run_task(str(db), task, [message()], api_key=secret)
    (verdict,) = [e for e in ran.view.events if e.type == "verification.recorded"]
    assert verdict.schema_ == 3 and verdict.data.rewards == {"reward": 0.0}  # 3: files
    out, err = verdict.data.stdout_tail, verdict.data.stderr_tail
    assert out.rstrip().endswith("expected 3, got 4 (key [redacted])\nwarning: slow test")
    assert secret not in out and 0 < len(out) <= 2000 and "line 3000 of a long log" in out
    assert err is None  # one stream, as Harbor's
    assert await anyio.to_thread.run_sync(
        cli.main, ["show", ran.result.session_id, "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "verifier stdout (tail):" in shown and "expected 3, got 4" in shown
    assert secret not in shown
