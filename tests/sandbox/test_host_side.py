"""A task's environment never reaches a host-side process (docs/SPEC.md §11 "The host
side"), attacked as an adversary did: a task's `env` tables name a preloaded library, an
audit library, a library path, a `PATH` and a `GCONV_PATH` of the task's choosing —
absolute and relative to the runner's working folder — in a job beside an honest task.

Each library writes a mark when it is loaded and each program of the fake `PATH` writes
one before running the real program; the marks' folder is outside every sandbox, so a
mark means the task's code ran on the host side. The task's variables must still reach
its own processes (the solution, the verifier and Codex read them back), and no host
process may carry them in its command line or, outside the sandbox, in its environment.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import images
from tests.runs import in_process, make_task, run_task
from trialledger.adapters.demo import samples
from trialledger.adapters.demo.endpoint import message, shell

# new in each run: only this run's processes can hold it (another on the machine may
# print this file)
SECRET = f"tl-task-secret-{secrets.token_hex(8)}"
EVIL_SOURCE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
static void mark(const char *how) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s-%d", MARKS, how, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0)
        close(fd);
}
__attribute__((constructor)) static void loaded(void) { mark("loaded"); }
unsigned int la_version(unsigned int version) { mark("audited"); return version; }
"""
# Every program the runner or our init might start on the host side.
HOST_PROGRAMS = ("bwrap", "slirp4netns", "nsenter", "nft", "rm", "true", "unshare", "podman",
                 "buildah", "skopeo", "umoci", "runc", "setpriv", "sh", "env")


@dataclass
class Evil:
    """The attacker's files on the host: its library, fake programs, gconv modules."""

    root: Path
    marks: Path

    def marked(self) -> list[str]:
        return sorted(os.listdir(self.marks))

    def env(self, *, relative: bool, own: dict[str, str]) -> str:
        """An inline TOML table: every attack, in absolute or relative form, plus `own`."""
        base = "." if relative else str(self.root)
        table = {
            "LD_PRELOAD": f"{base}/libtlevil.so" if not relative else "libtlevil.so",
            "LD_LIBRARY_PATH": base,
            "LD_AUDIT": f"{base}/libtlevil.so",
            "PATH": f"{base}/bin:/usr/local/bin:/usr/bin:/bin",
            "GCONV_PATH": f"{base}/gconv",
            **own,
        }
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + " }"


@pytest.fixture
def evil() -> Iterator[Evil]:
    # Outside pytest's 0700 tree, so the sandbox user (bwrap runs as it) could load them.
    root = Path(tempfile.mkdtemp(prefix="tl-evil-"))
    root.chmod(0o755)
    marks = root / "marks"
    marks.mkdir()
    marks.chmod(0o1777)
    source = root / "evil.c"
    source.write_text(EVIL_SOURCE)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKS="{marks}"', "-o",
                    str(root / "libtlevil.so"), str(source)], check=True)
    (root / "bin").mkdir()
    for name in HOST_PROGRAMS:
        samples.executable(root / "bin" / name,
                           f'#!/bin/sh\n: > "{marks}/path-{name}-$$"\n'
                           f'PATH=/usr/sbin:/usr/bin:/sbin:/bin exec {name} "$@"\n')
    (root / "gconv").mkdir()
    (root / "gconv" / "gconv-modules").write_text(
        "module INTERNAL TLEVIL// ../libtlevil 1\nmodule TLEVIL// INTERNAL ../libtlevil 1\n"
        "alias UTF-8// TLEVIL//\nalias ANSI_X3.4-1968// TLEVIL//\n")
    try:
        yield Evil(root, marks)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@dataclass
class Watch:
    """Host-side processes (those of our PID namespace, outside every sandbox) sampled while
    a run goes on: any whose command line or environment holds the secret."""

    found: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    samples: int = 0

    def run(self) -> None:
        ours = os.readlink("/proc/self/ns/pid")
        needle = SECRET.encode()
        while not self.stop.wait(0.01):
            self.samples += 1
            for pid in filter(str.isdigit, os.listdir("/proc")):
                if int(pid) == os.getpid():
                    continue
                try:
                    # (inside a sandbox the task's own commands may name it: `grep "$X"`)
                    if os.readlink(f"/proc/{pid}/ns/pid") != ours:
                        continue
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        if needle in handle.read():
                            self.found.append(f"{pid} cmdline: {_comm(pid)}")
                    with open(f"/proc/{pid}/environ", "rb") as handle:
                        if needle in handle.read():
                            self.found.append(f"{pid} environ: {_comm(pid)}")
                except OSError:
                    continue


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def watching() -> tuple[Watch, threading.Thread]:
    watch = Watch()
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    return watch, thread


def rootfs(folder: Path) -> str:
    """A busybox root as the task's `rootfs.tar` (range mode); its TOML line."""
    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info
    with tarfile.open(folder / "rootfs.tar", "w") as archive:
        archive.add(images.busybox_root(), arcname=".", filter=as_root)
    return 'rootfs = "rootfs.tar"\n'


def attacker(folder: Path, evil: Evil, *, relative: bool, image: bool = False) -> None:
    """A task whose every env table attacks; its solution and verifier read back the
    variables it declares (reward 1 only when they reached them)."""
    folder.mkdir(parents=True)
    environment = rootfs(folder) if image else ""
    toml = (f"[environment]\n{environment}"
            f"env = {evil.env(relative=relative, own={'TL_ENV': 'env-' + SECRET})}\n"
            f"[solution]\nenv = {evil.env(relative=relative, own={'TL_SOLUTION': SECRET})}\n"
            f"[verifier]\nenv = {evil.env(relative=relative, own={'TL_EXPECT': SECRET})}\n")
    make_task(folder, instruction="write answer.txt", toml=toml,
              solve_sh='#!/bin/sh\necho "$TL_SOLUTION $TL_ENV" > answer.txt\nsleep 1\n',
              test_sh='sleep 1\ngrep -qx "$TL_EXPECT $TL_ENV" answer.txt\n')


def honest(folder: Path) -> None:
    make_task(folder, instruction="write answer.txt", solve_sh="#!/bin/sh\necho ok > answer.txt\n",
              test_sh="grep -qx ok answer.txt\n")


def rewards(db: Path) -> dict[str, float | None]:
    with sqlite3.connect(db) as conn:
        return {task: reward for task, reward in conn.execute(
            "SELECT task, reward FROM job_trials")}


@pytest.mark.parametrize("image", [False, True], ids=["host", "range"])
def test_a_tasks_env_runs_nothing_on_the_host_side(tmp_path: Path, evil: Evil,
                                                   image: bool) -> None:
    data = tmp_path / "data"
    attacker(data / "attacker-absolute", evil, relative=False, image=image)
    attacker(data / "attacker-relative", evil, relative=True, image=image)
    honest(data / "victim")
    db = tmp_path / "t.db"
    watch, thread = watching()
    try:
        # the runner's working folder is the attacker's: relative names resolve there
        done = in_process("job", "run", "attacks", str(data), "--agent", "oracle", "-n", "2",
                          "--db", str(db), cwd=evil.root)
    finally:
        watch.stop.set()
        thread.join(timeout=10)
    assert evil.marked() == [], "the task's code ran on the host side"
    assert watch.samples > 10 and watch.found == [], watch.found
    assert done.returncode == 0, done.stderr
    # the variables reached the solution and the verifier; the victim is untouched
    assert rewards(db) == {"attacker-absolute": 1.0, "attacker-relative": 1.0, "victim": 1.0}


@pytest.mark.anyio
async def test_codex_gets_the_tasks_env_and_nothing_outside_does(tmp_path: Path,
                                                                 evil: Evil) -> None:
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    toml = (f"[environment]\nenv = {evil.env(relative=False, own={'TL_ENV': SECRET})}\n"
            f"[verifier]\nenv = {evil.env(relative=False, own={'TL_EXPECT': SECRET})}\n")
    task = make_task(task_dir, toml=toml, test_sh='grep -qx "$TL_EXPECT" seen.txt\n')
    watch, thread = watching()
    try:
        ran = await run_task(str(tmp_path / "t.db"), task,
                             [shell('echo "$TL_ENV" > seen.txt; sleep 1'), message("done")],
                             settings={"inherit_sandbox_environment": True})
    finally:
        watch.stop.set()
        thread.join(timeout=10)
    assert evil.marked() == [], "the task's code ran on the host side"
    assert watch.found == [], watch.found
    assert ran.view.rewards == {"reward": 1.0}
