"""Attacks on range mode (SPEC §11, §15) from inside the sandbox that got through.

A folder nested deeper than Python's recursion limit, made by the agent in its layer (any
user can make one: `mkdir d; chdir d`, 1,500 times) made every `shutil.rmtree` of it raise
RecursionError (it recurses once per level in Python 3.11), which nothing caught:
- at the end of the session the runner died with a traceback; the session folder
  (config.toml with grant tokens, the agent's layer) and its registry entry stayed, and in a
  long-lived process so did its slot — and every later runner start and `recover` died the
  same way in the sweep, until someone removed the folder by hand;
- at `/tests` (replaced by a fresh copy before the verifier) or at a mount point the
  verifier's sandbox needs replaced, the runner died before the verdict: the session
  closed `cancelled`, unverified, whatever the agent had done.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox.test_range_mode import _debian_into, run_oracle
from trialledger.adapters.sandbox import folders
from trialledger.adapters.sandbox.rangemode import range_problem

DEPTH = 1500  # beyond Python's default recursion limit (1,000)
DEEP_SOLUTION = f"""#!/bin/bash
# the sandbox's mount points may be moved away with the folder above them
[ WHERE != /run/trialledger/init ] || mv /run/trialledger /run/moved
mkdir -p WHERE && cd WHERE && perl -e 'for (1..{DEPTH}) {{ mkdir "d" or die; chdir "d" or die }}'
"""


@pytest.fixture
def own_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A temp folder bwrap's slot ids can pass (0755) and a registry of this test's own,
    so nothing left behind here reaches another runner's sweep; removed with `rm -rf`
    (which, unlike `shutil.rmtree` on Python 3.11, does not recurse per level)."""
    parent = Path(tempfile.mkdtemp(prefix="tl-attack-"))
    parent.chmod(0o755)
    cache = tmp_path / "registry-cache"
    monkeypatch.setattr(folders, "default_cache_dir", lambda: cache)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    try:
        yield parent, cache / "session-folders"
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(parent)], check=False,
                       timeout=120)


def _deep_tree(top: Path, depth: int = DEPTH) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["/tmp", "/tests", "/run/trialledger/init"])
def test_an_agents_deep_folder_neither_crashes_the_runner_nor_outlives_the_session(
        own_folders: tuple[Path, Path], tmp_path: Path, where: str) -> None:
    """Anywhere in its layer — also at `/tests`, which the runner replaces with a fresh
    copy before the verifier runs, or at a mount point of the verifier's sandbox that the
    runner must replace (there the crash came before the verdict: the session closed
    `cancelled`, unverified, whatever the agent had done)."""
    assert range_problem() is None, f"range mode must be available here: {range_problem()}"
    parent, registry = own_folders
    task = tmp_path / "deep"
    for sub in ("solution", "tests"):
        (task / sub).mkdir(parents=True)
    _debian_into(task)
    (task / "task.toml").write_text('version = "1.0"\n[environment]\nrootfs = "rootfs.tar"\n')
    (task / "instruction.md").write_text("Make a deep folder.\n")
    for path, text in ((task / "solution" / "solve.sh", DEEP_SOLUTION.replace("WHERE", where)),
                       (task / "tests" / "test.sh",
                        "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")):
        path.write_text(text)
        path.chmod(0o755)
    code, events = run_oracle(task, tmp_path / "deep.db")
    launched = next(e for e in events if e.type == "agent.launched")
    assert launched.data.identity["mode"] == "range"
    verdict = next((e for e in events if e.type.startswith("verification.")), None)
    assert code == 0 and verdict is not None and verdict.type == "verification.recorded"
    assert verdict.data.rewards == {"reward": 1.0}
    # the session folder (config.toml, the layer) is gone, and so is its registry entry
    assert not list(parent.glob(f"{folders.FOLDER_PREFIX}*"))
    assert not (registry.exists() and list(registry.iterdir()))


def test_a_deep_folder_left_by_a_crashed_runner_does_not_stop_the_sweep(
        own_folders: tuple[Path, Path]) -> None:
    """The sweep at every runner start (and `recover`) removes such a folder, and the
    runner starts; it used to die in it, every time."""
    parent, _ = own_folders
    left, lock = folders.make_session_folder("crashed-runner")
    assert left.parent == parent
    (left / "upper").mkdir()
    _deep_tree(left / "upper")
    os.close(lock)  # the runner is gone: its lock is free
    assert folders.sweep_stale_sessions() == 1
    assert not left.exists()
