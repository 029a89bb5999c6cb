"""The terminal goes away (docs/SPEC.md §13): a runner whose terminal is closed — SIGHUP,
then EIO on every write — or whose reader left (EPIPE) stops writing, gives its sessions
the hang-up's grace, closes them `cancelled` and exits 129, never with a traceback."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import sqlite3
import subprocess
import sys
import termios
import time
from pathlib import Path

import anyio
import pytest

from tests.runs import make_task
from trialledger.adapters.console import terminal
from trialledger.adapters.console.signals import Interrupted, until_signalled

# `trialledger ARGV`, with a copy of what it logs and of every error no one caught (in the
# main thread, another thread, or unraisable) in the file COPY, and its exit code last:
# its own stderr is the terminal that goes away.
KEEP_A_COPY = """
import logging, sys, threading, traceback
from trialledger import cli

copy = sys.argv[1]

def keep(kind, value, tb):
    with open(copy, "a") as f:
        traceback.print_exception(kind, value, tb, file=f)

handler = logging.FileHandler(copy)
handler.setLevel(logging.WARNING)
logging.getLogger().addHandler(handler)
logging.getLogger().addHandler(logging.lastResort)  # stderr, as without the copy
hook = sys.excepthook
sys.excepthook = lambda *error: (keep(*error), hook(*error))
threading.excepthook = lambda e: keep(e.exc_type, e.exc_value, e.exc_traceback)
sys.unraisablehook = lambda u: keep(type(u.exc_value), u.exc_value, u.exc_traceback)
code = cli.main(sys.argv[2:])
with open(copy, "a") as f:
    f.write(f"exit {code}\\n")
sys.exit(code)
"""


def _own_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is its stdin's."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.parametrize("command", ["job", "run"])
def test_a_closed_terminal_closes_the_sessions_cancelled_and_exits_129(
        tmp_path: Path, reachable_tmp: Path, command: str) -> None:
    task = make_task(tmp_path / "slow", instruction="take your time", test_sh="exit 0\n",
                     solve_sh="#!/bin/sh\ntouch started\nsleep 60\n")
    db, copy, script = tmp_path / "t.db", tmp_path / "copy.log", tmp_path / "keep.py"
    script.write_text(KEEP_A_COPY)
    argv = (["job", "run", "hangup", str(task.folder), "--grace", "1"] if command == "job"
            else ["run", str(task.folder)])
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(copy), *argv, "--db", str(db), "--agent", "oracle"],
        stdin=follower, stdout=follower, stderr=follower, preexec_fn=_own_terminal,
        env={**os.environ, "TMPDIR": str(reachable_tmp), "TERM": "xterm", "COLUMNS": "120"})
    os.close(follower)
    try:
        os.set_blocking(leader, False)
        deadline = time.monotonic() + 90
        while not list(reachable_tmp.glob("trialledger-*/work/started")):
            assert time.monotonic() < deadline, "the agent never started"
            assert proc.poll() is None, copy.read_text() if copy.exists() else proc.returncode
            try:
                os.read(leader, 65536)  # what the terminal shows, read so it never blocks
            except BlockingIOError:
                time.sleep(0.05)
        os.close(leader)  # the terminal goes away: SIGHUP, then EIO on every write
        leader = -1
        code = proc.wait(timeout=90)
    finally:
        if leader >= 0:
            os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = copy.read_text() if copy.exists() else ""
    assert code == 128 + signal.SIGHUP, said
    assert "Traceback" not in said and said.endswith("exit 129\n"), said
    with sqlite3.connect(db) as conn:
        sessions = conn.execute("SELECT state, close_reason FROM sessions").fetchall()
        queue = (conn.execute("SELECT state FROM job_queue").fetchall()
                 if command == "job" else [])
    assert sessions == [("closed", "cancelled")]
    assert queue == ([("queued",)] if command == "job" else [])  # released for a resume


def test_a_failed_write_is_one_hang_up_whose_grace_a_second_one_keeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout's reader left (EPIPE): the write is dropped and the job's first stop begins,
    as a SIGHUP's; the kernel's own SIGHUP after it is the same hang-up, not a second signal
    that would cancel the running trials at once. The descriptor then goes to /dev/null."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = open(write_end, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stdout", stdout)
    stops: list[str] = []
    finished: list[bool] = []

    async def work() -> None:
        print("a trial line", flush=True)  # EPIPE: the terminal is gone
        with anyio.fail_after(30):  # the hang-up's stop begins
            while not stops:
                await anyio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGHUP)  # and the kernel says it too
        await anyio.sleep(0.5)  # it is taken: a second signal would cancel now
        finished.append(True)

    try:
        with terminal.watched():
            with pytest.raises(Interrupted) as stopped:
                anyio.run(lambda: until_signalled(work, stop=lambda: stops.append("stop"),
                                                  grace_s=60))
            assert terminal.lost()
        assert stopped.value.signum == signal.SIGHUP
        assert stops == ["stop"] and finished == [True]  # one hang-up; its grace kept
        print("later lines go nowhere", file=stdout, flush=True)  # no EPIPE any more
    finally:
        stdout.close()
