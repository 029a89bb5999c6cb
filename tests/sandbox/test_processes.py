"""SPEC §11 "Processes per session" and "A bwrap that cannot sandbox is never silently
replaced": one agent's processes never limit another's, and a runner whose bwrap check
fails refuses the run rather than running the agent unconfined (as root, before).

The attack of issue 26 (1) is performed for real: an agent fills the process table of the
shared sandbox uid from a Codex tool call while another runner — a fresh process, so
nothing it knew before can help it — starts a session.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.runs import codex_path, in_process, make_task, run_task
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message, shell, tool
from trialledger.adapters.sandbox import hostside
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.cgroup import DEFAULT_PIDS
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.store import Ledger

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]


def processes_of(uid: int) -> int:
    """How many processes of `uid` run on the host now."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                continue
    return count


def launched(view: Any) -> Any:
    return next(e for e in view.events if e.type == "agent.launched").data


async def test_an_agent_filling_the_process_table_leaves_other_runners_sandboxed(
        tmp_path: Path) -> None:
    uid = sandbox_user().uid
    gate = tmp_path / "gate"
    gate.mkdir(mode=0o755)
    gate.chmod(0o755)  # the agent may look for the release file, nothing more
    # Session A forks for as long as it lives, taking every process slot it can get (bash
    # retries a failed fork), until the test releases it; Codex waits up to 30 s for it.
    bomb = (f"( while [ ! -e {gate}/release ]; do sleep 300 >/dev/null 2>&1 & done ) "
            ">/dev/null 2>&1 & "
            f"i=0; while [ ! -e {gate}/release ] && [ $i -lt 140 ]; do sleep 0.2; "
            "i=$((i+1)); done; echo released")
    filler = make_task(tmp_path / "filler", test_sh="exit 0\n")
    make_task(tmp_path / "victim", test_sh="exit 0\n")
    results: dict[str, Any] = {}

    async def fill() -> None:
        results["a"] = await run_task(
            str(tmp_path / "a.db"), filler,
            [tool("exec_command", {"cmd": bomb, "yield_time_ms": 30_000}), message()],
            extra_paths=[gate])

    async with anyio.create_task_group() as tg:
        tg.start_soon(fill)
        try:
            seen = [0]  # until the bomb met its limit, whichever holds it: no growth in 2 s
            with anyio.move_on_after(60):
                while seen[-1] < DEFAULT_PIDS - 50 or max(seen[-8:]) - min(seen[-8:]) > 20:
                    await anyio.sleep(0.25)
                    seen.append(processes_of(uid))
            with ScriptedEndpoint([shell("id -u; echo sandboxed-run"), message()]) as endpoint:
                done = await anyio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "trialledger.cli", "run", str(tmp_path / "victim"),
                     "--db", str(tmp_path / "b.db"), "--model-base-url", endpoint.url,
                     "--model", "test-model", "--codex-bin", codex_path(), "--json"],
                    capture_output=True, text=True, timeout=180, cwd=REPO))
        finally:
            (gate / "release").touch()
    assert DEFAULT_PIDS - 50 <= seen[-1] <= DEFAULT_PIDS, seen[-20:]  # A met its own limit
    assert launched(results["a"].view).limits is None  # which held: nothing to report
    assert done.returncode == 0, done.stderr[-2000:]
    async with await Ledger.open(str(tmp_path / "b.db")) as ledger:
        (summary,) = await ledger.sessions()
        view = await ledger.view(summary["session_id"])
    assert launched(view).isolation == "bwrap"
    (call,) = view.observations.tool_calls
    assert call.output.split() == [str(uid), "sandboxed-run"], call.output


async def test_a_task_pids_limit_holds_the_agent_in_either_isolation(tmp_path: Path) -> None:
    for isolation in ("bwrap", "process-group"):
        task = make_task(tmp_path / isolation, test_sh="exit 0\n",
                         toml="[environment]\npids = 200\n")  # Codex's threads count too
        ran = await run_task(str(tmp_path / f"{isolation}.db"), task, [shell(
            "sh -c 'n=0; while [ $n -lt 400 ]; do sleep 30 >/dev/null 2>&1 & n=$((n+1)); "
            "done; echo spawned $n' 2>&1 | tail -c 200"), message()], isolation=isolation)
        out = ran.view.observations.tool_calls[0].output
        assert "Cannot fork" in out and "spawned 400" not in out, (isolation, out)
        assert launched(ran.view).limits["enforced"] is True, isolation


def failing_bwrap(folder: Path, failures: int) -> Path:
    """A `bwrap` first on PATH that fails its first `failures` calls, then runs the real
    one: a bwrap that cannot sandbox (for now, or for good). The sandbox user runs it."""
    folder.mkdir()
    count = folder / "calls"
    count.write_text("0")
    count.chmod(0o666)
    real = subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True, text=True,
                          check=True).stdout.strip()
    script = folder / "bwrap"
    script.write_text(f"#!/bin/sh\nn=$(cat {count}); echo $((n + 1)) > {count}\n"
                      f"if [ $n -lt {failures} ]; then echo 'bwrap: No permissions to create "
                      f"new namespace' >&2; exit 1; fi\nexec {real} \"$@\"\n")
    script.chmod(0o755)
    folder.chmod(0o755)
    return folder


def test_a_bwrap_that_cannot_sandbox_refuses_and_never_falls_back(
        tmp_path: Path, reachable_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = failing_bwrap(reachable_tmp / "bin", failures=1000)
    monkeypatch.setattr(hostside, "SYSTEM_PATH", f"{folder}:{hostside.SYSTEM_PATH}")
    key = secrets.token_hex(4)
    with pytest.raises(SandboxRefused, match="cannot create its namespaces"):
        LocalSandbox(session_key=key, workdir="/app")
    assert not list(Path(tempfile.gettempdir()).glob(f"trialledger-{key}*"))  # none half made
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    with ScriptedEndpoint([shell("id -u"), message()]) as endpoint:
        done = in_process("run", str(task.folder), "--db", str(tmp_path / "t.db"),
                          "--model-base-url", endpoint.url, "--model", "m",
                          "--codex-bin", codex_path())
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "bwrap" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not endpoint.requests  # no agent ran, unconfined or not


def test_a_transient_bwrap_failure_is_checked_again(
        reachable_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = failing_bwrap(reachable_tmp / "bin", failures=1)
    monkeypatch.setattr(hostside, "SYSTEM_PATH", f"{folder}:{hostside.SYSTEM_PATH}")
    sandbox = LocalSandbox(session_key="recheck-1", workdir="/app")
    try:
        assert sandbox.isolation == "bwrap"
        assert (folder / "calls").read_text().strip() == "2"  # failed, then checked again
        LocalSandbox(session_key="recheck-2", workdir="/app").discard()
        assert (folder / "calls").read_text().strip() == "3"  # every session checks
    finally:
        sandbox.discard()


def test_the_sandbox_user_is_never_root_in_a_process_group(tmp_path: Path) -> None:
    sandbox = LocalSandbox(session_key="pg-user-1", workdir="/app", isolation="process-group")
    try:
        assert sandbox.user.uid != 0 and sandbox.user.uid == sandbox_user().uid
    finally:
        sandbox.discard()
    with pytest.raises(SandboxRefused, match="isolation 'none'"):
        LocalSandbox(session_key="pg-user-2", workdir="/app", isolation="none")
