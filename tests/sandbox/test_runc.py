"""Range mode on the OCI runtime runc (SPEC §16): `--runtime runc` starts a session's
container with `runc run` from the runner's own `config.json`, without `no_new_privs`, so a
setuid-root helper of the image works for a non-root `USER` as under Docker — and a
setuid file is setuid only to the session's slot, never to a host id outside it.

CI installs runc and runs `trialledger setup`: these tests fail (never skip) where runc
cannot start a container. (The rest of the range-mode suite runs under runc too, the
runtime `setup` finds able here; under bwrap with TRIALLEDGER_TEST_RUNTIME=bwrap,
tests/conftest.py.)
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.images import private_storage_fixture  # noqa: F401 (the `private_storage` fixture)
from tests.sandbox.test_range_mode import SECRET, busybox_with, oracle_falling_back, run_oracle
from trialledger.adapters.sandbox.idrange import SLOT
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.ociruntime import runtime_problem
from trialledger.adapters.sandbox.rangemode import range_problem

SETUID_IMAGE = "localhost/tl-busybox:setuid-helper-2"
HELPER = "/usr/local/bin/rootcat"
# A static `cat` that, setuid root, reads what only root may; with --setuid-copy it writes
# a copy of itself, inner root's and setuid, at DEST; with --no-randomize it asks for what
# `setarch -R` does, which Docker's seccomp profile refuses (exit 7).
HELPER_SOURCE = r"""
#include <fcntl.h>
#include <string.h>
#include <sys/personality.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char buffer[4096];
    ssize_t n;
    if (argc == 3 && strcmp(argv[1], "--setuid-copy") == 0) {
        int in = open("/proc/self/exe", O_RDONLY);
        int out = open(argv[2], O_WRONLY | O_CREAT | O_EXCL, 0755);
        if (in < 0 || out < 0)
            return 2;
        while ((n = read(in, buffer, sizeof buffer)) > 0)
            if (write(out, buffer, (size_t)n) != n)
                return 3;
        return fchmod(out, 04755) == 0 ? 0 : 4;
    }
    if (argc == 2 && strcmp(argv[1], "--no-randomize") == 0)
        return personality(ADDR_NO_RANDOMIZE) == -1 ? 7 : 0;
    int fd = argc == 2 ? open(argv[1], O_RDONLY) : -1;
    if (fd < 0)
        return 1;
    while ((n = read(fd, buffer, sizeof buffer)) > 0)
        if (write(1, buffer, (size_t)n) != n)
            return 3;
    return 0;
}
"""
SOLVE = f"""#!/bin/sh
id -u > /work/solver-uid
{HELPER} /root-only > /work/answer
{HELPER} --setuid-copy /work/setuid-copy
{HELPER} --no-randomize; echo $? > /work/no-randomize
"""
TEST = """#!/bin/sh
if [ "$(cat /work/answer)" = "{secret}" ] && [ "$(cat /work/solver-uid)" = 1000 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.fixture(scope="module", autouse=True)
def _runc_available() -> None:
    assert range_problem() is None, f"range mode must be available here: {range_problem()}"
    assert runtime_problem("runc") is None, runtime_problem("runc")


def setuid_image() -> str:
    """busybox with `USER agent`, a root-only file (0600 root) and a setuid-root static
    reader (4755 root:root)."""
    with tempfile.TemporaryDirectory() as scratch:
        source, helper = Path(scratch) / "rootcat.c", Path(scratch) / "rootcat"
        source.write_text(HELPER_SOURCE)
        subprocess.run(["gcc", "-static", "-O2", "-o", str(helper), str(source)], check=True,
                       capture_output=True)
        return busybox_with(SETUID_IMAGE, [("./root-only", SECRET.encode(), 0o600),
                                           (f".{HELPER}", helper.read_bytes(), 0o4755)])


def setuid_task(folder: Path, *, metadata: str = "") -> Path:
    """An oracle task over the image: its solution, as the non-root USER, reads the
    root-only file through the setuid helper."""
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    (folder / "task.toml").write_text(f'version = "1.0"\n[environment]\ndocker_image = '
                                      f'"{setuid_image()}"\n{metadata}')
    (folder / "instruction.md").write_text("Read /root-only.\n")
    for path, text in ((folder / "solution" / "solve.sh", SOLVE),
                       (folder / "tests" / "test.sh", TEST.format(secret=SECRET))):
        path.write_text(text)
        path.chmod(0o755)
    return folder


def _outcome(events: list[Any]) -> tuple[str, Any]:
    launched = next(e for e in events if e.type == "agent.launched")
    verdict = next(e for e in events if e.type.startswith("verification."))
    assert verdict.type == "verification.recorded", verdict.data
    return launched.data.isolation, verdict.data.rewards


def test_a_setuid_root_helper_works_under_runc_and_is_setuid_only_to_the_slot(
        tmp_path: Path, private_storage: None, kept: list[LocalSandbox]) -> None:
    task = setuid_task(tmp_path / "task")
    # No --runtime: the runtime `setup` found able, runc here (recorded as `isolation`)
    code, events = run_oracle(task, tmp_path / "runc.db", "--cache-dir", str(tmp_path / "cache"))
    assert code == 0
    assert _outcome(events) == ("runc", {"reward": 1.0})
    sandbox = kept[-1]
    assert sandbox.range is not None
    start = sandbox.range.slot.start
    # The copy the helper wrote as inner root (its group the USER's: setuid keeps the gid)
    # is setuid to the slot's first id on the host, never to host root.
    made = os.lstat(sandbox.root / "upper" / "work" / "setuid-copy")
    assert made.st_mode & stat.S_ISUID, oct(made.st_mode)
    assert (made.st_uid, made.st_gid) == (start, start + 1000) and start >= SLOT
    # The phase's process has the container's seccomp profile: Docker's whole one.
    refused = (sandbox.root / "upper" / "work" / "no-randomize").read_text()
    assert refused == "7\n", refused


def test_under_bwrap_the_same_helper_does_not_raise_privileges(
        tmp_path: Path, private_storage: None, kept: list[LocalSandbox]) -> None:
    # bwrap always sets no_new_privs: the helper runs as the USER, and the answer is empty.
    task = setuid_task(tmp_path / "task")
    _, events = run_oracle(task, tmp_path / "bwrap.db", "--runtime", "bwrap",
                           "--cache-dir", str(tmp_path / "cache"))
    assert _outcome(events) == ("bwrap", {"reward": 0.0})
    # bwrap's filter is the list of §15's refusals, not Docker's whole profile.
    allowed = (kept[-1].root / "upper" / "work" / "no-randomize").read_text()
    assert allowed == "0\n", allowed


def test_a_task_that_asks_for_no_new_privileges_gets_it_under_runc(
        tmp_path: Path, private_storage: None) -> None:
    task = setuid_task(tmp_path / "task",
                       metadata="[metadata.trialledger]\nno_new_privileges = true\n")
    _, events = run_oracle(task, tmp_path / "nnp.db", "--runtime", "runc",
                           "--cache-dir", str(tmp_path / "cache"))
    assert _outcome(events) == ("runc", {"reward": 0.0})


@pytest.mark.anyio
async def test_a_leases_extensions_reach_the_runc_containers_pid_1(
        tmp_path: Path, private_storage: None) -> None:
    """A job trial's lease (SPEC §13) holds the container under runc as under bwrap: its
    extensions reach PID 1 (descriptor 3, `--preserve-fds`), and a lapse ends it."""
    import uuid

    from trialledger.adapters.images.imagestore import plain_cache
    from trialledger.adapters.images.prepare import prepare
    from trialledger.adapters.sandbox.deadline import DeadManSwitch
    from trialledger.adapters.tasks.task import Task

    task = Task.load(setuid_task(tmp_path / "task"))
    assert task.source is not None
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    switch = DeadManSwitch(1.0)
    sandbox = LocalSandbox(session_key=str(uuid.uuid4()), workdir="/work", environment=env,
                           lifetime="harbor", runtime="runc", switch=switch)
    try:
        await sandbox._ensure_container()
        assert sandbox.launched_isolation == "runc"
        switch.extend(120)
        await anyio.sleep(2.0)  # past the first deadline: only an extension heard keeps it
        assert sandbox.container_lost() is None
        switch.extend(0.05)  # the lease lapses: PID 1's command is killed, it ends
        assert await sandbox.container_ended(30) is not None
    finally:
        await sandbox.close()
        sandbox.discard()
        switch.close()


def test_a_runtime_setup_found_unable_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tests.runs import make_task
    from trialledger import cli
    from trialledger.adapters.sandbox import ociruntime

    monkeypatch.setattr(ociruntime, "records_dir", lambda: tmp_path)
    (tmp_path / "runtime-runc.json").write_text(json.dumps(
        {"runtime": "runc", "problem": "runc cannot start a container here: no cgroups"}))
    task = make_task(tmp_path / "task", test_sh="exit 0\n", solve_sh="#!/bin/sh\n")
    code = cli.main(["run", str(task.folder), "--agent", "oracle", "--db",
                     str(tmp_path / "t.db"), "--runtime", "runc"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--runtime runc: runc cannot start a container here: no cgroups" in err, err
    assert "Traceback" not in err


def _running(marker: str) -> list[int]:
    """The pids of processes whose command line is `sleep <marker>`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[:2] == [
                        b"sleep", marker.encode()]:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_crashed_runners_container_ends_and_its_sweep_deletes_it(
        tmp_path: Path, private_storage: None) -> None:
    """runc's container does not die with runc (bwrap's did, `--die-with-parent`): our
    init, its PID 1, ends it when the runner's lifeline closes; the next sweep of session
    folders deletes runc's state."""
    import signal
    import sys
    import time

    from trialledger.adapters.sandbox import folders
    from trialledger.adapters.sandbox.runc import STATE

    marker = "31.4159"
    task = setuid_task(tmp_path / "task")
    (task / "solution" / "solve.sh").write_text(f"#!/bin/sh\nsleep {marker}\n")
    runner = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "run", str(task), "--agent", "oracle",
         "--db", str(tmp_path / "t.db"), "--runtime", "runc", "--cache-dir",
         str(tmp_path / "cache")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _running(marker):
            assert time.monotonic() < deadline, "the oracle never started"
            assert runner.poll() is None, runner.communicate()
            time.sleep(0.05)
        # its own session folder: the one whose lock it holds (TMPDIR is shared: another
        # test's live runc session made meanwhile is not its to sweep)
        left = [folder for folder in _locked_by(runner.pid) if (folder / STATE).is_dir()]
        runner.send_signal(signal.SIGKILL)  # a crash: nothing of ours stops the container
        runner.wait(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
    deadline = time.monotonic() + 30
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(marker), "the container outlived its runner"
    assert left, "the runner held no session folder with runc's state"
    folders.sweep_stale_sessions()  # (another runner's start may have swept it already)
    assert not [folder for folder in left if folder.exists()]


def _locked_by(pid: int) -> list[Path]:
    """The session folders whose lock process `pid` holds open."""
    from trialledger.adapters.sandbox.folders import LOCK

    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.name == LOCK:
            found.append(target.parent)
    return found


def test_a_containers_bwrap_mounts_become_oci_binds_and_tmpfs() -> None:
    from trialledger.adapters.sandbox.bwrap import Mount
    from trialledger.adapters.sandbox.oci import Bind
    from trialledger.adapters.sandbox.runc import oci_mounts

    placed = [Mount("--proc", None, "/proc"), Mount("--ro-bind", "/proc/sys", "/proc/sys"),
              Mount("--dev", None, "/dev"), Mount("--ro-bind", "/c/init", "/run/t/init"),
              Mount("--bind", "/s/home", "/s/home"), Mount("--tmpfs", None, "/s/home/skills")]
    # /proc, /dev and a read-only /proc/sys are Docker's own mounts there
    assert oci_mounts(placed) == ((Bind("/c/init", "/run/t/init", read_only=True),
                                   Bind("/s/home", "/s/home", read_only=False)),
                                  ("/s/home/skills",))
    with pytest.raises(ValueError, match="--symlink"):
        oci_mounts([Mount("--symlink", "usr/bin", "/bin")])


def test_dockers_profile_in_the_filter_compilers_line_form() -> None:
    from trialledger.adapters.sandbox.ocifilter import filter_text

    text = filter_text({
        "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X32"],
        "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
                     {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
                     {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                      "args": [{"index": 0, "value": 2114060288, "valueTwo": 0,
                                "op": "SCMP_CMP_MASKED_EQ"}]}]})
    assert text.splitlines() == [
        "default ERRNO 1", "arch x86_64", "arch x32", "rule ALLOW 1 read 0",
        "rule ALLOW 1 write 0", "rule ERRNO 38 clone3 0",
        "rule ALLOW 1 clone 1 0 MASKED_EQ 2114060288 0"]


def test_where_no_runtime_can_start_a_container_range_mode_falls_back_saying_why_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`setup` found no OCI runtime able (its record, in a temporary folder): an image
    task runs in single-id mode under bwrap, and the run says why once."""
    import json

    from trialledger.adapters.sandbox import ociruntime

    why = f"runc cannot start a container here: {tmp_path.name}"  # (said once per process)
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "runtime.json").write_text(
        json.dumps({"runtime": None, "problem": why}))
    monkeypatch.setattr(ociruntime, "records_dir", lambda: tmp_path / "records")
    code, launched, said = oracle_falling_back(tmp_path, caplog, why)
    assert launched.isolation == "bwrap", launched
    assert launched.identity is not None and launched.identity["mode"] == "single"
    assert len(said) == 1, said
    assert "no OCI runtime can start a container here" in said[0], said
    assert "single-id mode" in said[0], said
    assert code == 0
