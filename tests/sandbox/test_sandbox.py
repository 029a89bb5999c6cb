"""The local sandbox under real bubblewrap: escapes fail, stragglers die, settings hold."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from tests.runs import make_task, run_task
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.procscan import marked_pids

pytestmark = pytest.mark.anyio
HOST_HOME = Path("/root") if os.geteuid() == 0 else Path.home()


async def run_in(sandbox: LocalSandbox, script: str, env: dict[str, str] | None = None
                 ) -> tuple[str, int | None]:
    """Run a bash script as the agent would be run; return its stdout and exit code."""
    run = await sandbox.launch(["bash", "-c", script], stdin=b"",
                               env=env or {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    lines: list[bytes] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(run.read_stderr)
        async for batch in run.stdout_batches():
            lines += cast(list[bytes], batch)  # no line here is over the limit
    status = await run.wait()
    report = await sandbox.confirm_cleanup(run, 5)
    await run.aclose()
    assert report.confirmed, report.error
    return b"\n".join(lines).decode(), status.return_code


@pytest.fixture
def sandboxes(tmp_path: Path) -> Iterator[tuple[LocalSandbox, LocalSandbox]]:
    tests = tmp_path / "task" / "tests"
    tests.mkdir(parents=True)
    (tests / "test.sh").write_text("exit 0\n")
    first = LocalSandbox(session_key="first-session", workdir="/app", tests=tests)
    second = LocalSandbox(session_key="second-session", workdir="/app")
    (second.session_dir / "auth.json").write_text('{"secret": "theirs"}')
    yield first, second
    first.discard()
    second.discard()


@pytest.fixture
def store_file(tmp_path: Path) -> Path:
    db = tmp_path / "store" / "trials.db"
    db.parent.mkdir()
    db.write_bytes(b"SQLite format 3\0 not for agents")
    return db


async def test_escape_attempts_fail_and_leave_the_host_untouched(
        sandboxes: tuple[LocalSandbox, LocalSandbox], store_file: Path) -> None:
    sandbox, other = sandboxes
    assert sandbox.isolation == "bwrap"
    victim = subprocess.Popen(["sleep", "300"])
    marker = HOST_HOME / "trialledger-escape-probe"
    assert HOST_HOME.exists()  # so not seeing it inside means something
    assert sandbox.tests is not None
    tests_file = sandbox.tests / "test.sh"
    before = {p: p.read_bytes() for p in (tests_file, store_file)}
    secret = store_file.parent / "root-only.txt"  # planted (in a temp folder): readable by
    secret.write_text("planted-root-only-secret\n")  # the host's root alone
    secret.chmod(0o600)
    attempts = {
        "write host home": f"echo x > {marker}",
        "write /etc": "echo x > /etc/trialledger-escape",
        "write the task tests": f"echo pwned > {tests_file}",
        "write another session": f"echo x > {other.session_dir}/pwned",
        "write the store": f"echo x >> {store_file}",
        "read the store": f"cat {store_file}",
        "read another session CODEX_HOME": f"cat {other.session_dir}/auth.json",
        "see the host home": f"test -e {HOST_HOME}",
        "read a root-only host file": f"grep -q planted-root-only-secret {secret}",
        "signal a host process": f"kill -9 {victim.pid}",
    }
    script = "\n".join(f"if ( {cmd} ) >/dev/null 2>&1; then echo 'ESCAPED: {name}'; fi"
                       for name, cmd in attempts.items())
    try:
        out, code = await run_in(sandbox, script + "\necho done")
    finally:
        alive = victim.poll() is None
        victim.kill()
    assert code == 0 and out.strip().endswith("done")
    assert "ESCAPED" not in out, out
    assert alive, "a process outside the sandbox was killed"
    assert not marker.exists() and not Path("/etc/trialledger-escape").exists()
    assert not (other.session_dir / "pwned").exists()
    assert {p: p.read_bytes() for p in before} == before


async def test_the_agent_runs_as_an_unprivileged_user_in_its_own_pid_namespace(
        sandboxes: tuple[LocalSandbox, LocalSandbox]) -> None:
    sandbox, _ = sandboxes
    out, _ = await run_in(sandbox, "id -u; echo $$; ls /proc | grep -c '^[0-9]'; pwd; "
                                   "touch /usr/x 2>/dev/null || echo ro-usr; "
                                   "touch /app/ok && echo rw-app")
    uid, pid, processes, cwd, ro, rw = out.split()
    assert uid != "0" and int(pid) < 10 and int(processes) < 10
    assert (cwd, ro, rw) == ("/app", "ro-usr", "rw-app")
    assert (sandbox.host_work / "ok").exists()


@pytest.mark.parametrize("isolation", ["bwrap", "process-group"])
async def test_a_daemonised_grandchild_is_gone_after_the_run(tmp_path: Path, isolation: str
                                                             ) -> None:
    sandbox = LocalSandbox(session_key=f"daemon-{isolation}", workdir="/app",
                           isolation=isolation)
    try:
        out, _ = await run_in(sandbox, "setsid nohup sleep 1000 >/dev/null 2>&1 & echo started")
        assert out.strip() == "started"
        assert marked_pids(sandbox.marker) == []
    finally:
        sandbox.discard()


async def test_an_escape_through_a_real_codex_tool_call_fails(
        tmp_path: Path, store_file: Path) -> None:
    marker = HOST_HOME / "trialledger-codex-escape"
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    # One pipe for both streams, so "tried" is reliably the last line.
    command = (f"exec 2>&1; echo pwned > {marker}; echo pwned >> {store_file}; "
               f"echo pwned > {task.folder}/tests/test.sh; cat {store_file}; echo tried")
    ran = await run_task(str(tmp_path / "trials.db"), task, [shell(command), message()])
    (call,) = ran.view.observations.tool_calls
    assert call.output.strip().endswith("tried") and "not for agents" not in call.output
    assert not marker.exists()
    assert store_file.read_bytes() == b"SQLite format 3\0 not for agents"
    assert (task.folder / "tests" / "test.sh").read_text() == "exit 0\n"
    assert ran.view.rewards == {"reward": 1.0}


@pytest.mark.parametrize("inherit", [False, True])
async def test_environment_allowlist_or_inherited_task_environment(
        tmp_path: Path, inherit: bool, monkeypatch: Any) -> None:
    monkeypatch.setenv("HARNESS_ONLY_SECRET", "must-not-leak")
    task = make_task(tmp_path / "task", test_sh="exit 0\n",
                     toml='[environment]\nenv = { TASK_DECLARED = "from-task" }\n')
    ran = await run_task(str(tmp_path / "t.db"), task, [shell("env | sort"), message()],
                         settings={"inherit_sandbox_environment": inherit})
    (call,) = ran.view.observations.tool_calls
    env = dict(line.split("=", 1) for line in call.output.splitlines() if "=" in line)
    assert "HARNESS_ONLY_SECRET" not in env
    assert ("TASK_DECLARED" in env) is inherit
    assert env["CODEX_HOME"] == env["HOME"] and env["CODEX_HOME"].startswith(
        os.path.join(tempfile.gettempdir(), "trialledger-"))
    assert env["TRIALLEDGER_SUPERVISOR"] == ran.view.session_id
    launched = next(e for e in ran.view.events if e.type == "agent.launched").data
    assert "TRIALLEDGER_MODEL_API_KEY" in launched.env_keys


@pytest.mark.parametrize("raise_it, expected", [(True, "1000"), (False, "0")])
async def test_raise_oom_score_adj(tmp_path: Path, raise_it: bool, expected: str) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [shell("cat /proc/self/oom_score_adj"), message()],
                         settings={"raise_oom_score_adj": raise_it})
    (call,) = ran.view.observations.tool_calls
    assert call.output.strip() == expected
    launched = next(e for e in ran.view.events if e.type == "agent.launched").data
    assert launched.oom_score_adj == (1000 if raise_it else None)


async def test_a_process_group_runs_only_when_asked_and_never_as_root(tmp_path: Path) -> None:
    task = make_task(tmp_path / "task", test_sh='test -f "$TRIALLEDGER_TESTS_DIR/test.sh"\n')
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [shell("echo hi > made.txt; id -u"), message()],
                         isolation="process-group")
    launched = next(e for e in ran.view.events if e.type == "agent.launched").data
    assert launched.isolation == "process-group"
    (call,) = ran.view.observations.tool_calls
    assert call.output.split() == [str(sandbox_user().uid)] and sandbox_user().uid != 0
    assert ran.view.decision.rule == "completed" and ran.view.rewards == {"reward": 1.0}


async def test_a_bwrap_that_cannot_create_the_sandbox_is_a_lost_sandbox(
        tmp_path: Path, monkeypatch: Any) -> None:
    # bwrap passes the one-time check, then fails to set up this sandbox (as a full /tmp or
    # a namespace limit would make it): one line, sandbox.lost, retried.
    from tests.runs import make_task, run_task
    from trialledger.adapters.demo.endpoint import message as reply
    from trialledger.adapters.sandbox.hostside import program
    real = program("bwrap")
    import shutil
    import tempfile

    bin_dir = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))  # outside pytest's 0700 tree
    fake = bin_dir / "bwrap"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --info-fd ] && '
                    f'{{ echo "bwrap: Creating new namespace failed: No space left on device" '
                    f'>&2; exit 1; }}; done\nexec {real} "$@"\n')
    fake.chmod(0o755)
    bin_dir.chmod(0o755)  # the sandbox user runs it (the one-time check)
    # (the runner never finds bwrap by PATH: a task could name its own; so the fake is
    # put where the runner looks for its programs)
    from trialledger.adapters.sandbox import spawning
    monkeypatch.setattr(spawning, "program",
                        lambda name: str(fake) if name == "bwrap" else program(name))
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    try:
        ran = await run_task(str(tmp_path / "t.db"), task, [reply()])
    finally:
        shutil.rmtree(bin_dir)
    d = ran.view.decision
    assert (d.rule, d.action) == ("sandbox_lost", "retry")
    assert "No space left on device" in d.error and "\n" not in d.error
