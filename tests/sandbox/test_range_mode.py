"""Range mode (SPEC §15, §11): image and rootfs sessions of a root runner after `setup` get
container-grade root — their own 65,536 host ids, Docker's capabilities in the namespace
only, a seccomp filter of Docker's denials — and never host root.

CI's `.ci/run` runs `trialledger setup`, so range mode is available there: these tests fail
(never skip) where it is not. No test changes a host setting.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import images
from tests.images import private_storage_fixture  # noqa: F401 (the `private_storage` fixture)
from tests.runs import make_task, run_task
from trialledger import cli
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images.imagestore import plain_cache
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox import runc
from trialledger.adapters.sandbox.idrange import DOCKER_CAPS, SLOT, reserved_range
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.rangemode import range_problem
from trialledger.store.ledger import Ledger

pytestmark = pytest.mark.anyio
DOCKER_CAP_MASK = "00000000a80425fb"  # CapEff of root in a default Docker container
PACKAGE = "tl-hello"


@pytest.fixture(scope="module", autouse=True)
def _range_mode_available() -> None:
    assert range_problem() is None, f"range mode must be available here: {range_problem()}"


def local_repository(folder: Path) -> Path:
    """A one-package apt repository (no network): `tl-hello`, printing a greeting."""
    build = folder / "build"
    (build / "DEBIAN").mkdir(parents=True)
    (build / "usr" / "bin").mkdir(parents=True)
    program = build / "usr" / "bin" / PACKAGE
    program.write_text("#!/bin/sh\necho hello from the local repository\n")
    program.chmod(0o755)
    (build / "DEBIAN" / "control").write_text(
        f"Package: {PACKAGE}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        f"Description: a test package\n")
    repo = folder / "repo"
    repo.mkdir()
    deb = repo / f"{PACKAGE}_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(build), str(deb)],
                   check=True, capture_output=True)
    data = deb.read_bytes()
    (repo / "Packages").write_text(
        f"Package: {PACKAGE}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        f"Filename: ./{deb.name}\nSize: {len(data)}\n"
        f"SHA256: {hashlib.sha256(data).hexdigest()}\nDescription: a test package\n\n")
    shutil.rmtree(build)
    return repo


# What real solutions do first: install a package (apt drops to `_apt`), add a user, give
# it a file, and run something as it with `su`.
ROOT_SOLUTION = f"""#!/bin/bash
set -ex
echo 'deb [trusted=yes] file:/solution/repo ./' > /etc/apt/sources.list.d/local.list
apt-get update -o Dir::Etc::sourcelist=sources.list.d/local.list -o Dir::Etc::sourceparts=-
apt-get install -y --no-install-recommends {PACKAGE}
adduser --disabled-password --gecos '' bob
mkdir -p /srv/bob && echo mine > /srv/bob/file && chown -R bob:bob /srv/bob
su bob -c 'id -un > /srv/bob/whoami && cat /srv/bob/file >> /srv/bob/whoami'
"""
ROOT_TEST = f"""#!/bin/bash
{PACKAGE} && [ "$(stat -c %U /srv/bob/file)" = bob ] && grep -qx bob /srv/bob/whoami \\
  && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


@pytest.fixture
def root_task(tmp_path: Path) -> Path:
    """A Harbor-format task over the Debian rootfs whose solution needs container root."""
    folder = tmp_path / "needs-root"
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    _debian_into(folder)
    (folder / "task.toml").write_text('version = "1.0"\n[environment]\nrootfs = "rootfs.tar"\n'
                                      '[verifier]\ntimeout_sec = 120\n')
    (folder / "instruction.md").write_text("Install tl-hello and give bob a file.\n")
    local_repository(folder / "solution")
    for path, text in ((folder / "solution" / "solve.sh", ROOT_SOLUTION),
                       (folder / "tests" / "test.sh", ROOT_TEST)):
        path.write_text(text)
        path.chmod(0o755)
    return folder


def _debian_into(folder: Path) -> None:
    """The Debian rootfs tarball as the task's `rootfs.tar` (a hard link where it can)."""
    tarball = images.debian_tarball()
    if os.stat(tarball).st_dev == os.stat(folder).st_dev:
        os.link(tarball, folder / "rootfs.tar")
    else:
        shutil.copy(tarball, folder / "rootfs.tar")


def run_oracle(task: Path, db: Path, *extra: str) -> tuple[int, list[Any]]:
    """`trialledger run TASK --agent oracle`; its exit code and the session's events."""
    code = cli.main(["run", str(task), "--agent", "oracle", "--db", str(db), *extra])

    async def events() -> list[Any]:
        async with await Ledger.open(str(db), create=False) as ledger:
            (row,) = await ledger.sessions()
            return list((await ledger.view(row["session_id"])).events)

    import anyio

    return code, anyio.run(events)


def oracle_falling_back(tmp_path: Path, caplog: pytest.LogCaptureFixture, why: str
                        ) -> tuple[int, Any, list[str]]:
    """The oracle over a busybox rootfs task where range mode is unavailable for `why`:
    its exit code, its `agent.launched` data and the warnings that name `why`."""
    import logging

    folder = tmp_path / "task"
    folder.mkdir()
    subprocess.run(["tar", "-C", str(images.busybox_root()), "-cf", str(folder / "rootfs.tar"),
                    "."], check=True)
    make_task(folder, test_sh="exit 0\n", toml='[environment]\nrootfs = "rootfs.tar"\n',
              solve_sh="#!/bin/sh\nid -u\n")
    with caplog.at_level(logging.WARNING):
        code, events = run_oracle(folder, tmp_path / "t.db", "--cache-dir",
                                  str(tmp_path / "cache"))
    launched = next(e for e in events if e.type == "agent.launched")
    said = [record.getMessage() for record in caplog.records if why in record.getMessage()]
    return code, launched.data, said


def test_a_solution_that_needs_container_root_gets_reward_1(root_task: Path,
                                                              tmp_path: Path) -> None:
    code, events = run_oracle(root_task, tmp_path / "range.db")
    launched = next(e for e in events if e.type == "agent.launched")
    assert launched.data.identity == {"mode": "range", "user": "0:0"}
    verdict = next(e for e in events if e.type.startswith("verification."))
    assert code == 0 and verdict.type == "verification.recorded", verdict.data
    assert verdict.data.rewards == {"reward": 1.0}, verdict.data
    assert not [e for e in events if e.type == "gap.recorded"
                and e.data.code == "root_emulated"]


def test_in_single_id_mode_the_same_solution_fails_and_says_why(root_task: Path,
                                                                 tmp_path: Path) -> None:
    from trialledger.adapters.sandbox.identity import sandbox_user

    # --sandbox-uid asks for the single-id mapping onto that uid (no range mode)
    _, events = run_oracle(root_task, tmp_path / "single.db",
                              "--sandbox-uid", str(sandbox_user().uid))
    launched = next(e for e in events if e.type == "agent.launched")
    assert launched.data.identity["mode"] == "single"
    verdict = next(e for e in events if e.type.startswith("verification."))
    assert getattr(verdict.data, "rewards", None) != {"reward": 1.0}


SECRET = "root-only-secret-31c7"
USER_IMAGE = "localhost/tl-busybox:root-only-file"


def user_image() -> str:
    """The busybox image with `USER agent` and a root-only file (0600 root) in it."""
    return busybox_with(USER_IMAGE, [("./root-only", SECRET.encode(), 0o600)])


def busybox_with(ref: str, files: Sequence[tuple[str, bytes, int]]) -> str:
    """The busybox image with `USER agent`, `WORKDIR /work` and `files` (name in the
    image, content, mode; owned by root), imported once as `ref`."""
    def fill(archive: tarfile.TarFile) -> None:
        for name, data, mode in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))

    return images.busybox_image(ref, fill)


# Every attack a tool call makes; each line it prints names an attack that worked, or a
# fact the test checks.
ATTACK = (
    "id -u | sed 's/^/UID /'; awk '{print \"MAP\", $1, $2, $3}' /proc/self/uid_map; "
    "grep -E '^CapEff' /proc/self/status; grep -E '^Seccomp:' /proc/self/status; "
    "cat /root-only 2>/dev/null && echo READ root-only; "
    "find /proc/sys -type f -writable 2>/dev/null | head -3 | sed 's/^/WRITABLE /'; "
    "unshare -U true 2>/dev/null && echo NESTED userns; "
    "unshare -m true 2>/dev/null && echo NESTED mountns; "
    "mount -t tmpfs none /tmp 2>/dev/null && echo MOUNTED; "
    # the host's kernel and cgroups, probed by access(2) only (never written: a test
    # changes no host setting)
    "for f in /proc/sysrq-trigger /proc/sys/kernel/core_pattern /sys/kernel/uevent_helper "
    "/sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/pids.max /sys/fs/cgroup/pids/pids.max "
    "/sys/fs/cgroup/memory/memory.limit_in_bytes; do [ -w $f ] && echo WRITABLE $f; done; "
    "mknod /tmp/tl-null c 1 3 2>/dev/null && echo MKNOD; "
    "touch /work/made-by-agent /tmp/made-by-agent; echo done")


# Range mode's default runtime (`setup`'s: runc here, docs/SPEC.md §16) and bwrap, still
# a `--runtime`
RUNTIMES = [None, "bwrap"]


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["runc", "bwrap"])
async def test_range_mode_escape_suite_through_a_codex_tool_call(
        tmp_path: Path, private_storage: None, kept: list[LocalSandbox],
        runtime: str | None) -> None:
    """A non-root image user in range mode: its own slot's ids, no capability, no root-only
    file, no nested namespace, no mount, `/proc/sys` read-only, its files in its slot."""
    ref = user_image()
    task_dir = tmp_path / "task"
    task = make_task(task_dir, test_sh="exit 0\n",
                     toml=f'[environment]\ndocker_image = "{ref}"\n')
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    assert env.plain and env.uid == 1000
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(ATTACK), message()],
                         environment=env, runtime=runtime)
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert "done" in out, [e.model_dump_json()[:600] for e in ran.view.events]
    assert ran.view.events[1].data.isolation == (runtime or runc.default_runtime())
    for attack in ("READ", "WRITABLE", "NESTED", "MOUNTED", "MKNOD"):
        assert attack not in out, out
    assert SECRET not in "\n".join(e.model_dump_json() for e in ran.view.events)
    sandbox = kept[-1]
    assert sandbox.range is not None
    start = sandbox.range.slot.start
    assert f"MAP 0 {start} {SLOT}" in out and "UID 1000" in out, out
    assert "CapEff:\t0000000000000000" in out, out  # a non-root USER: none, as Docker's
    assert "Seccomp:\t2" in out, out
    assert ran.view.events[1].data.identity == {"mode": "range", "user": "1000:1000"}
    # on the host, everything the agent made belongs to its slot: never root, never us
    owners = {(os.lstat(os.path.join(folder, name)).st_uid,
               os.lstat(os.path.join(folder, name)).st_gid)
              for folder, dirs, files in os.walk(sandbox.root / "upper")
              for name in [*dirs, *files]}
    assert owners and all(start <= uid < start + SLOT and start <= gid < start + SLOT
                          for uid, gid in owners), owners
    made = sandbox.root / "upper" / "work" / "made-by-agent"
    assert (os.lstat(made).st_uid, os.lstat(made).st_gid) == (start + 1000, start + 1000)


@pytest.mark.parametrize("runtime", RUNTIMES, ids=["runc", "bwrap"])
async def test_inner_root_has_exactly_dockers_capabilities(
        tmp_path: Path, kept: list[LocalSandbox], runtime: str | None) -> None:
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    _debian_into(task_dir)
    task = make_task(task_dir, test_sh="exit 0\n", toml='[environment]\nrootfs = "rootfs.tar"\n')
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    ran = await run_task(str(tmp_path / "t.db"), task, [shell(ATTACK), message()],
                         environment=env, runtime=runtime)
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert ran.view.events[1].data.isolation == (runtime or runc.default_runtime())
    assert "UID 0" in out and f"CapEff:\t{DOCKER_CAP_MASK}" in out, out
    for attack in ("WRITABLE", "NESTED", "MOUNTED", "MKNOD"):
        assert attack not in out, out
    assert len(DOCKER_CAPS) == bin(int(DOCKER_CAP_MASK, 16)).count("1")
    start = kept[-1].range.slot.start if kept[-1].range else -1
    made = kept[-1].root / "upper" / "tmp" / "made-by-agent"
    assert os.lstat(made).st_uid == start  # inner root is the slot's first id, not host root


def test_setup_keeps_a_reserved_range_and_refuses_an_overlapping_one() -> None:
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.idrange import reserve_range

    ids = reserved_range()
    assert ids is not None and ids.count % SLOT == 0 and ids.start >= 1 << 20
    assert reserve_range() == (ids, False)  # kept, nothing written
    build = [line for line in Path("/etc/subuid").read_text().splitlines()
             if line.startswith("trialledger-build:")]
    assert build
    start = int(build[0].split(":")[1])
    # a second user's range over the build user's is refused before usermod runs
    with pytest.raises(SandboxRefused, match="overlaps"):
        reserve_range(f"{start}:{SLOT}", name="root")


def test_a_plain_cache_needs_a_folder_only_root_can_write(tmp_path: Path) -> None:
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.idrange import check_plain_folder

    check_plain_folder(tmp_path / "cache")  # under /tmp (root's sticky folder): fine
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(SandboxRefused, match="must be root's"):
        check_plain_folder(open_folder / "cache")


def test_each_phase_runs_as_its_own_user(tmp_path: Path) -> None:
    """`[agent] user` and `[verifier] user` (a name, `name:group`) as Docker resolves them."""
    folder = tmp_path / "users"
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    _debian_into(folder)
    (folder / "task.toml").write_text(
        '[environment]\nrootfs = "rootfs.tar"\n[agent]\nuser = "nobody"\n'
        '[verifier]\nuser = "daemon:sys"\n')
    (folder / "instruction.md").write_text("Say who you are.\n")
    for path, text in (
            (folder / "solution" / "solve.sh",
             # no fd of ours reaches the agent (bwrap's user namespace fd did)
             "#!/bin/bash\n[ \"$(ls /proc/self/fd | tr '\\n' ' ')\" = '0 1 2 3 ' ] || exit 3\n"
             "echo \"$(id -u):$(id -g)\" > /tmp/agent-ids\n"),
            (folder / "tests" / "test.sh",
             '#!/bin/bash\n[ "$(cat /tmp/agent-ids)" = 65534:65534 ] && '
             '[ "$(id -u):$(id -g)" = 1:3 ] && echo 1 > /logs/verifier/reward.txt '
             '|| echo 0 > /logs/verifier/reward.txt\n')):
        path.write_text(text)
        path.chmod(0o755)
    code, events = run_oracle(folder, tmp_path / "users.db")
    launched = next(e for e in events if e.type == "agent.launched")
    assert launched.data.identity == {"mode": "range", "user": "65534:65534"}
    verdict = next(e for e in events if e.type.startswith("verification."))
    assert code == 0 and verdict.data.rewards == {"reward": 1.0}, verdict.data


@pytest.mark.parametrize(("spec", "found"), [
    ("app", (1000, 1000)), ("1000:0", (1000, 0)), ("4242", (4242, 0)), ("app:staff", (1000, 50)),
    ("²", None), ("0:²", None), ("nobody-here", None), ("70000", None)])
def test_a_user_is_resolved_as_docker_does_and_odd_digits_are_no_id(
        tmp_path: Path, spec: str, found: tuple[int, int] | None) -> None:
    """An image's /etc/passwd and a task's `user` are hostile text: "²" passes
    `str.isdigit` but is no id (it used to raise ValueError out of the verifier's start)."""
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.idrange import resolve_user

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n"
                                             "app:x:1000:1000::/home/app:/bin/sh\n"
                                             "odd:x:²:²::/:/bin/sh\n")
    (tmp_path / "etc" / "group").write_text("root:x:0:\nstaff:x:50:\napp:x:1000:\n")
    if found is None:
        with pytest.raises(SandboxRefused):
            resolve_user(tmp_path, spec, (0, 0))
    else:
        user = resolve_user(tmp_path, spec, (0, 0))
        assert (user.uid, user.gid) == found
