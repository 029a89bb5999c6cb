"""SPEC §11: a session's folders are no other local user's to reach, and what the agent
writes there is mounted `nosuid,nodev` — so a setuid file the agent makes (through a real
Codex tool call, under real bwrap) is neither runnable by another host user nor honoured.

The other user is `nobody`, switched to with `setpriv` (no user is created)."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.runs import make_task, run_task
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.sandbox.folders import lock_held, take_lock
from trialledger.adapters.sandbox.identity import sandbox_user
from trialledger.adapters.sandbox.local import LocalSandbox

pytestmark = pytest.mark.anyio
# (setpriv keeps its capabilities until it execs: the program it runs does the access)
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
MAKE_SUID = ("cp /usr/bin/id suid && chmod 4755 suid && ls -ln suid && echo EUID $(./suid -u) "
             "UID $(id -u); for point in \"$PWD\" \"$HOME\" /tmp; do "
             "awk -v p=\"$point\" '$5 == p {print \"MOUNT\", $5, $6}' /proc/self/mountinfo; done")


def watch_as_nobody(sandboxes: list[LocalSandbox], seen: dict[str, Any]) -> threading.Thread:
    """While the session lives: once the agent's setuid file exists, what `nobody` gets
    when it stats and runs it, and whether the session folder was still there."""
    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            path = sandboxes[0].host_work / "suid" if sandboxes else None
            if path is not None and path.is_file() and path.stat().st_mode & stat.S_ISUID:
                for verb, argv in (("stat", ["stat", "-c", "%u", str(path)]),
                                   ("run", ["sh", "-c", 'exec "$0" -u', str(path)])):
                    done = subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True,
                                          check=False, timeout=30)
                    seen[verb] = (done.returncode, done.stdout + done.stderr)
                seen["setuid"] = path.stat().st_mode & stat.S_ISUID
                root = os.stat(sandboxes[0].root)
                seen["root"] = (stat.S_IMODE(root.st_mode), root.st_uid, root.st_gid)
                seen["alive"] = sandboxes[0].root.is_dir()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_a_setuid_file_the_agent_makes_is_neither_reachable_nor_honoured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandboxes: list[LocalSandbox] = []
    launch = LocalSandbox.launch

    async def recorded(self: LocalSandbox, *args: Any, **kwargs: Any) -> Any:
        sandboxes.append(self)
        return await launch(self, *args, **kwargs)

    monkeypatch.setattr(LocalSandbox, "launch", recorded)
    seen: dict[str, Any] = {}
    watcher = watch_as_nobody(sandboxes, seen)
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    # the second call keeps the session alive while `nobody` tries
    script = [shell(MAKE_SUID), shell("sleep 3; echo slept"), message()]
    ran = await run_task(str(tmp_path / "t.db"), task, script)
    watcher.join(5)
    said = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert seen.get("alive") is True, (seen, said)  # checked while the session lived
    assert seen["setuid"]  # and the agent's file was setuid then
    code, text = seen["stat"]
    assert code != 0 and "Permission denied" in text, text  # nobody cannot even stat it
    code, text = seen["run"]
    assert code != 0 and "Permission denied" in text, text
    assert seen["root"] == (0o710, 0, sandbox_user().gid)  # only bwrap's user may pass
    lines = said.splitlines()
    euid = next(line for line in lines if line.startswith("EUID")).split()
    assert euid[1] == euid[3]  # run inside, the setuid bit raised nothing
    mounts = [line.split() for line in lines if line.startswith("MOUNT")]
    assert {m[1] for m in mounts} >= {"/tmp", launched_workdir(ran)}, said
    for _, point, options in mounts:  # every folder the agent writes in
        assert {"nosuid", "nodev"} <= set(options.split(",")), (point, options)
    assert ran.view.rewards == {"reward": 1.0}


def launched_workdir(ran: Any) -> str:
    return str(next(e.data for e in ran.view.events if e.type == "agent.launched").workdir)


def test_a_sweep_never_finds_a_folders_lock_there_and_free(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A sweep looking while a session's or a build's folder takes its lock finds no lock
    file (a folder being made: alive while young) or a held one — never a free one, which
    it would take for a killed run's and remove under the run (a build then failed with a
    traceback, its folder gone between its lock file's creation and its flock)."""
    seen: list[bool | None] = []
    real = fcntl.flock

    def looking(fd: int, operation: int) -> None:
        if not seen:  # (lock_held's own flock passes through)
            seen.append(lock_held(tmp_path / ".lock"))
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", looking)
    fd = take_lock(tmp_path, ".lock")
    monkeypatch.undo()
    try:
        assert seen == [None] and lock_held(tmp_path / ".lock") is True
        assert os.listdir(tmp_path) == [".lock"]
    finally:
        os.close(fd)
