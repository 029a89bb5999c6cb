"""A store that cannot take a session's evidence refuses the run before Codex starts (SPEC
§8): tested on a real, nearly full filesystem (a small tmpfs filled with `fallocate`)."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runs import codex_path, make_task
from trialledger.adapters.demo.endpoint import ScriptedEndpoint, message

LEFT = 96 * 1024  # what the run had left on the store's disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of its own (root only), unmounted after."""
    if shutil.which("mount") is None:
        pytest.fail("mount is needed for this test")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(mount)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True,
                       timeout=30)


def fill(disk: Path, leave: int) -> None:
    """Take all of `disk` but `leave` bytes, with one preallocated file."""
    free = shutil.disk_usage(disk).free
    subprocess.run(["fallocate", "-l", str(free - leave), str(disk / "ballast")], check=True,
                   timeout=30)


def test_a_store_on_a_nearly_full_disk_refuses_the_run_before_codex_starts(
        tmp_path: Path, small_disk: Path) -> None:
    task = make_task(tmp_path / "task", test_sh="exit 0\n")
    db = small_disk / "t.db"
    made = subprocess.run([sys.executable, "-m", "trialledger.cli", "db", "upgrade", "--db",
                           str(db)], capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    fill(small_disk, LEFT)
    assert shutil.disk_usage(small_disk).free <= 2 * LEFT
    with ScriptedEndpoint([message()]) as endpoint:
        runner = subprocess.Popen(
            [sys.executable, "-m", "trialledger.cli", "run", str(task.folder), "--db", str(db),
             "--model-base-url", endpoint.url, "--model", "m", "--codex-bin", codex_path()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = runner.communicate(timeout=90)
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.communicate()
        asked = list(endpoint.requests)
    assert runner.returncode == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "KiB free" in err, err
    assert asked == []  # Codex never ran: no model call was made (or billed)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (0,)
