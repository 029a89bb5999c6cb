"""Dockerfile builds never run as host root (docs/SPEC.md §12): a `RUN` step that leaves its
chroot reaches the host as the build user only, and a build past its timeout leaves no
process, working container or scratch folder behind. A build is contained: nothing it
starts outlives it (however it hops from pid to pid), its processes are bounded by its
own pids.max, its network is its own (the host's loopback out of reach) and it builds
from any working folder. Real podman, buildah, slirp4netns, cgroups and gcc."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import images
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from trialledger.adapters.images import build as build_module
from trialledger.adapters.images import builder as builders
from trialledger.adapters.images import imageids
from trialledger.adapters.images.buildbox import BuildBox, contained
from trialledger.adapters.images.builder import Builder, storage_driver
from trialledger.adapters.images.dockerfile import BaseImage, base_images, platform_args
from trialledger.adapters.images.environment import (
    Cache,
    Environment,
    EnvironmentUnavailable,
    Source,
    _tool,
    copy_tree,
)
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox.cgroup import BUILD_PREFIX

LEAVE_CHROOT_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The classic chroot escape (a RUN step keeps CAP_SYS_CHROOT): "yes" when it left its
   chroot and sees `probe`, a path only the host has. */
static const char *leave_chroot(const char *probe) {
    mkdir("/escape-x", 0755);
    int broke = chroot("/escape-x") == 0;
    for (int i = 0; i < 64; i++) chdir("..");
    broke = chroot(".") == 0 && broke;
    struct stat seen;
    return broke && stat(probe, &seen) == 0 ? "yes" : "no";
}
"""

ESCAPE_C = LEAVE_CHROOT_C + r"""
/* The escape, then a write and a read on the host.
   argv: canary folder, secret file, a host-only path, the report (in the image). */
int main(int argc, char **argv) {
    if (argc != 5) return 2;
    FILE *report = fopen(argv[4], "w");
    if (!report) return 1;
    fprintf(report, "escaped: %s\n", leave_chroot(argv[3]));
    char planted[4096];
    snprintf(planted, sizeof planted, "%s/planted", argv[1]);
    int fd = open(planted, O_WRONLY | O_CREAT | O_EXCL, 0644);
    fprintf(report, "canary: %s\n", fd >= 0 ? "CREATED" : strerror(errno));
    char secret[256] = {0};
    fd = open(argv[2], O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, secret, sizeof secret - 1) : -1;
    fprintf(report, "secret: %s\n", n > 0 ? secret : strerror(errno));
    fclose(report);
    return 0;
}
"""


@pytest.fixture
def builder() -> Builder:
    """The build user `trialledger setup` makes (idempotent; CI has run setup already)."""
    return builders.create_build_user()[0] if os.geteuid() == 0 else builders.build_user()


def dockerfile_task(folder: Path, dockerfile: str, *, timeout: float = 600) -> Source:
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    return Source("dockerfile", "Dockerfile", folder, timeout)


def containers(builder: Builder) -> set[str]:
    done = subprocess.run([*builder.as_user, "buildah", "containers", "-q"], check=True,
                          env=builder.env(Path("/tmp")), capture_output=True, text=True)
    return set(done.stdout.split())


def build_of(pid: int) -> str | None:
    """The build (its cgroup's name) a process runs in, if any."""
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    names = {line.rsplit("/", 1)[-1] for line in lines}
    return next((n for n in names if n.startswith(BUILD_PREFIX)), None)


def made_by(builder: Builder, build: str) -> set[str]:
    """The working containers a build made (its id in their record), whatever other
    builds share the storage."""
    graphroot = as_builder(builder, "podman", "info", "--format", "{{.Store.GraphRoot}}")
    found = set()
    for record in Path(graphroot).glob("*-containers/*/userdata/buildah.json"):
        with contextlib.suppress(OSError, ValueError):
            options = json.loads(record.read_text()).get("CommonBuildOpts") or {}
            if options.get("CgroupParent") == build:
                found.add(record.parent.parent.name)
    return found


def compile_static(source: str, target: Path) -> None:
    """`source` (C) built with gcc -static into `target`."""
    target.with_suffix(".c").write_text(source)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(target), str(target.with_suffix(".c"))],
                   check=True, capture_output=True)


def still_running(marker: str, within_s: float = 5.0) -> list[int]:
    """The processes whose command line holds `marker` once `within_s` has passed (empty as
    soon as there are none)."""
    deadline = time.monotonic() + within_s
    while (found := running(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def running(marker: str) -> list[int]:
    """The processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if marker.encode() in handle.read().replace(b"\0", b" "):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_run_step_that_leaves_its_chroot_cannot_write_or_read_the_host(
        tmp_path: Path, builder: Builder) -> None:
    canary = tmp_path / "canary"  # root-owned 0755: only host root may create in it
    canary.mkdir(mode=0o755)
    secret = tmp_path / "secret"
    token = f"host-secret-{os.getpid()}-{time.time_ns()}"
    secret.write_text(token)
    secret.chmod(0o600)
    base = images.podman_image(images.BUSYBOX_REF)
    lingering = f"sleep {4000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"
    source = dockerfile_task(tmp_path / "task", (
        f"FROM {base}\nUSER root\nCOPY escape /escape\nCOPY . /context/\n"
        f"RUN setsid {lingering} </dev/null >/dev/null 2>&1 &\n"
        f'RUN ["/escape", "{canary}", "{secret}", "{Path(__file__).resolve()}", '
        f'"/escape-report"]\n'))
    context = source.path
    (context / "escape.c").write_text(ESCAPE_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(context / "escape"),
                    str(context / "escape.c")], check=True, capture_output=True)
    (context / "leak").symlink_to(secret)  # a link out of the context brings nothing in
    try:
        env = prepare(source, Cache(tmp_path / "cache"), owner=None)
    except EnvironmentUnavailable as error:  # failing cleanly is fine too
        report = f"build failed: {error}"
    else:
        assert env.root is not None
        report = (env.root / "escape-report").read_text()
        assert "canary: " in report, report  # the escape ran to its end
        assert token not in tree_text(env.root), report
    assert not (canary / "planted").exists(), report
    assert token not in report, report
    assert running(lingering) == []  # nothing a step started outlives the build


def tree_text(root: Path) -> str:
    """Every regular file's bytes under `root` (links not followed), as text."""
    parts = []
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as handle:
                    parts.append(handle.read().decode(errors="replace"))
    return "\n".join(parts)


def as_builder(builder: Builder, *argv: str, check: bool = True) -> str:
    """A command as the build user in its storage (outside any build); its stdout."""
    return subprocess.run([*builder.as_user, *argv], check=check, capture_output=True,
                          env=builder.env(Path("/tmp")), text=True,
                          cwd=builder.storage).stdout.strip()


def test_the_engine_keeps_the_build_storage_where_and_how_the_runner_wrote(
        builder: Builder) -> None:
    """The runner's storage.conf is the engine's: its graph root (read by the runner
    without asking the engine) and, on a kernel that mounts overlays in a user namespace,
    the overlay driver — not the vfs an older storage's database would keep."""
    from trialledger.adapters.images.builder import storage_driver

    found = as_builder(builder, "podman", "info", "--format",
                       "{{.Store.GraphRoot}}|{{.Store.GraphDriverName}}").split("|")
    assert found == [str(builder.graphroot), storage_driver(os.uname().release)]


def test_a_build_past_its_timeout_leaves_no_process_container_or_scratch(
        tmp_path: Path, builder: Builder) -> None:
    """Its own working container is removed, found by the build's id: another build's,
    made in the same storage while it ran, is left alone (a before/after listing took
    it). Other builds may use the machine's build storage meanwhile: the test looks at
    its own build's containers only (its RUN step's cgroup names the build)."""
    marker = f"{3000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"  # sleep's argument
    base = images.podman_image(images.BUSYBOX_REF)
    source = dockerfile_task(tmp_path / "task", f"FROM {base}\nRUN sleep {marker}\n",
                             timeout=15)
    seen: set[str] = set()
    other: list[str] = []
    builds: list[str] = []
    folders: list[bool] = []  # whether its cgroup's name was a folder in the scratch
    building = True

    def watch() -> None:  # the working container does appear while the step runs
        while building:
            if not builds:
                builds.extend(b for pid in running(f"sleep {marker}")
                              if (b := build_of(pid)) is not None)
            if builds:
                seen.update(made_by(builder, builds[0]))
                folders.append((builder.scratch / builds[0]).is_dir())
            if seen and not other:  # as another build would, in the same storage
                name = as_builder(builder, "buildah", "from", "--name",
                                  f"other-build-{marker}", base)
                other.append(as_builder(builder, "buildah", "inspect", "--type", "container",
                                        "--format", "{{.ContainerID}}", name))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(EnvironmentUnavailable, match="ran past 15 s"):
            prepare(source, Cache(tmp_path / "cache"), owner=None)
    finally:
        building = False
        watcher.join()
    try:
        assert seen, "no working container appeared during the build"
        assert other, "the other build's container was not made"
        assert builds, "the build's RUN step was never seen in its cgroup"
        assert made_by(builder, builds[0]) == set()  # its own removed...
        assert set(other) <= containers(builder)  # ...and only its own
    finally:
        for container in other:
            as_builder(builder, "buildah", "rm", container, check=False)  # gone: fine
    assert running(f"sleep {marker}") == []  # the RUN step was killed with its build
    # its folder (TMPDIR and context) removed: the one its cgroup is named after (other
    # builds' come and go in the same scratch meanwhile)
    assert any(folders) and builds[0] not in os.listdir(builder.scratch)


def test_a_root_runner_without_the_build_user_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root runner's refusal")
    monkeypatch.setattr(builders, "BUILD_USER", "trialledger-no-such-user")
    source = dockerfile_task(tmp_path / "task", "FROM scratch\n")
    with pytest.raises(EnvironmentUnavailable, match=r"never run as root.*trialledger setup"):
        prepare(source, Cache(tmp_path / "cache"), owner=None)


@pytest.mark.parametrize("dockerfile, args, named", [
    ("FROM a/b:1\nRUN x\n", {}, [BaseImage("a/b:1")]),
    ("from --platform=linux/amd64 a AS build\nFROM build\nFROM scratch\nFROM c as d\n"
     "FROM D\n", {}, [BaseImage("a", "linux/amd64"), BaseImage("c")]),
    ("ARG V=1\nFROM base:$V\nFROM a\nFROM a\n", {}, [BaseImage("base:1"), BaseImage("a")]),
    ("ARG V=1\nARG R=reg/${V}x\nFROM ${R}:${V}\n", {"V": "2"}, [BaseImage("reg/2x:2")]),
    ("ARG V\nFROM img${V:-:7}\nFROM img${V:+:9}\nARG W=late\nFROM $W\n", {},
     [BaseImage("img:7"), BaseImage("img")]),
    ("# escape=`\nFROM `\n  --platform=$BUILDPLATFORM `\n# a comment\n  multi:line\n", {},
     [BaseImage("multi:line", platform_args()["BUILDPLATFORM"])]),
    ("FROM a\nRUN echo \\\n  FROM b\n", {}, [BaseImage("a")]),
])
def test_the_from_images_are_resolved_as_the_engine_resolves_them(
        dockerfile: str, args: dict[str, str], named: list[BaseImage]) -> None:
    """Stages and `scratch` are no image; global ARGs (defaults, then the build's
    arguments; an ARG after the first FROM is not global) and the automatic platform
    arguments are substituted; continuation lines are joined, comments dropped."""
    assert base_images(dockerfile, args) == named


def test_a_context_is_copied_with_links_as_links_and_nothing_but_files_and_folders(
        tmp_path: Path) -> None:
    source = tmp_path / "environment"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "tool").write_text("#!/bin/sh\n")
    (source / "sub" / "tool").chmod(0o750)
    (source / "sub").chmod(0o555)  # read-only: its contents still arrive
    (source / "out").symlink_to("/etc/passwd")
    os.mkfifo(source / "pipe")  # read, a fifo would hang the copy
    copy_tree(source, tmp_path / "copy")
    copy = tmp_path / "copy"
    assert os.readlink(copy / "out") == "/etc/passwd"
    assert (copy / "sub" / "tool").read_text() == "#!/bin/sh\n"
    assert (copy / "sub" / "tool").stat().st_mode & 0o777 == 0o750
    assert (copy / "sub").stat().st_mode & 0o777 == 0o555
    assert not os.path.lexists(copy / "pipe")


@pytest.mark.parametrize("how", ["file", "folder", "fifo"])
def test_a_dockerfile_reached_through_a_link_or_not_a_file_is_refused_before_it_is_read(
        tmp_path: Path, how: str) -> None:
    """A Dockerfile is staged with its context, links as links: one reached through a link
    (itself, or a folder on its way) could lead out of the build's folder once staged, so
    podman would read a host file as the Dockerfile. It is refused before anything reads
    it, as is a fifo (read, it would hang the runner)."""
    task = tmp_path / "task"
    (task / "environment" / "real").mkdir(parents=True)
    (task / "environment" / "real" / "Dockerfile").write_text("FROM scratch\n")
    dockerfile = "Dockerfile"
    if how == "file":
        (task / "environment" / "Dockerfile").symlink_to("real/Dockerfile")
    elif how == "folder":
        (task / "environment" / "linked").symlink_to("real")
        dockerfile = "linked/Dockerfile"
    else:
        os.mkfifo(task / "environment" / "Dockerfile")
    source = Source("dockerfile", f"environment/{dockerfile}", task, dockerfile=dockerfile)
    with anyio_free_deadline(30), pytest.raises(EnvironmentUnavailable,
                                                match="reached through no symbolic link"):
        prepare(source, Cache(tmp_path / "cache"), owner=None)


@contextlib.contextmanager
def anyio_free_deadline(seconds: int) -> Iterator[None]:
    """Fail (SIGALRM) rather than hang past `seconds`."""
    def expired(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


HOPPER_C = r"""
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* Leaves its chroot, detaches (double fork, setsid), then hops: each generation forks the
   next and exits, every 2 ms, so no pid of it lasts. Each one touches HEARTBEAT and plants
   PLANTED in every layer folder of the build storage holding VICTIM (a file only a later
   build's step makes), until HEARTBEAT.stop exists. Every generation inherits a shared
   lock on HEARTBEAT.lock: it is free only once none of them lives.
   argv: build storage, victim name, planted name, heartbeat file. */
static void plant(const char *storage, const char *victim, const char *planted) {
    const char *layouts[][2] = {{"vfs/dir", ""}, {"overlay", "/diff"}};
    for (int l = 0; l < 2; l++) {
        char folder[4096], path[4096];
        snprintf(folder, sizeof folder, "%s/%s", storage, layouts[l][0]);
        DIR *dir = opendir(folder);
        struct dirent *entry;
        while (dir && (entry = readdir(dir)) != NULL) {
            if (entry->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "%s/%s%s/%s", folder, entry->d_name, layouts[l][1],
                     victim);
            if (access(path, F_OK) != 0) continue;
            snprintf(path, sizeof path, "%s/%s%s/%s", folder, entry->d_name, layouts[l][1],
                     planted);
            int fd = open(path, O_WRONLY | O_CREAT, 0644);
            if (fd >= 0) close(fd);
        }
        if (dir) closedir(dir);
    }
}

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    char stop[4096], lock[4096];
    snprintf(stop, sizeof stop, "%s.stop", argv[4]);
    snprintf(lock, sizeof lock, "%s.lock", argv[4]);
    mkdir("/hop-x", 0755);
    if (chroot("/hop-x") == 0) {
        for (int i = 0; i < 64; i++) chdir("..");
        chroot(".");
    }
    if (fork() != 0) return 0;  /* the step's process ends: the step is done */
    setsid();
    signal(SIGHUP, SIG_IGN);
    int null = open("/dev/null", O_RDWR);
    dup2(null, 0), dup2(null, 1), dup2(null, 2);
    int held = open(lock, O_RDWR | O_CREAT, 0666);
    if (held < 0 || flock(held, LOCK_SH) != 0) return 1;
    while (access(stop, F_OK) != 0) {
        if (fork() > 0) _exit(0);  /* hop: the parent goes, the child carries on */
        int fd = open(argv[4], O_WRONLY | O_CREAT, 0666);
        if (fd >= 0) close(fd);
        plant(argv[1], argv[2], argv[3]);
        usleep(2000);
    }
    return 0;
}
"""


@pytest.fixture
def host_temp() -> Iterator[Path]:
    """A host folder the build user can write (a `RUN` step that left its chroot can)."""
    folder = Path(tempfile.mkdtemp(prefix="trialledger-hop-"))
    folder.chmod(0o777)
    try:
        yield folder
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def held(lock: Path, within_s: float = 5.0) -> bool:
    """Whether a process still holds `lock` once `within_s` has passed (a hopper cannot
    hide from this as from a scan of /proc: every generation holds the one lock)."""
    fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    deadline = time.monotonic() + within_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return True
                time.sleep(0.05)
    finally:
        os.close(fd)


def test_a_run_step_that_hops_from_pid_to_pid_dies_with_its_build(
        tmp_path: Path, builder: Builder, host_temp: Path) -> None:
    """The process a step leaves behind forks a new one and exits every 2 ms: the one-pass
    sweep by user id after a build never caught it. Killed with the build's frozen cgroup,
    nothing of it touches the host's temp folder or plants a file in a later build's
    layer."""
    mark = f"{os.getpid()}-{time.time_ns()}"
    heartbeat, victim, planted = host_temp / f"beat-{mark}", f"victim-{mark}", f"planted-{mark}"
    storage = as_builder(builder, "podman", "info", "--format", "{{.Store.GraphRoot}}")
    base = images.podman_image(images.BUSYBOX_REF)
    first = dockerfile_task(tmp_path / "first", (
        f'FROM {base}\nUSER root\nCOPY hopper /hopper\n'
        f'RUN ["/hopper", "{storage}", "{victim}", "{planted}", "{heartbeat}"]\n'))
    compile_static(HOPPER_C, first.path / "hopper")
    later = dockerfile_task(tmp_path / "later", (
        f"FROM {base}\nUSER root\nRUN touch /{victim} && sleep 3\n"))
    try:
        prepare(first, Cache(tmp_path / "cache"), owner=None)
        assert heartbeat.exists()  # the hopper did run during its build
        assert not held(host_temp / f"beat-{mark}.lock")  # ... and none of it lives now
        assert still_running(mark) == []
        heartbeat.unlink()
        env = prepare(later, Cache(tmp_path / "cache"), owner=None)
        assert env.root is not None
        assert sorted(p.name for p in env.root.iterdir() if mark in p.name) == [victim]
        assert not heartbeat.exists()  # nothing of the first build ran meanwhile
    finally:
        (host_temp / f"beat-{mark}.stop").touch()  # a survivor (the old code's) ends itself
        still_running(mark)


def test_a_fork_bomb_in_a_run_step_stops_at_the_builds_pids_max(
        tmp_path: Path, builder: Builder) -> None:
    """A step tries to start 6,000 sleeping processes (bounded: never the machine's
    32,768): the build's own pids.max (4,096) stops it, and none outlives the build."""
    mark = f"{3000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"  # sleep's argument
    base = images.podman_image(images.BUSYBOX_REF)
    bomb = (f"i=0; while [ $i -lt 6000 ]; do sleep {mark} & i=$((i+1)); echo $i > /count; "
            f"done")
    # The bomb runs in a session of its own; once a fork fails it ends, and the step (no
    # fork needed: builtins only) kills its group and keeps the count.
    source = dockerfile_task(tmp_path / "task", (
        f"FROM {base}\nUSER root\n"
        f"RUN setsid sh -c 'echo $$ > /group; {bomb}'; read g < /group; kill -9 -$g; "
        f"read n < /count; echo $n > /started\n"))
    try:
        env = prepare(source, Cache(tmp_path / "cache"), owner=None)
        assert env.root is not None
        started = int((env.root / "started").read_text())
        assert 0 < started < 4096, started
    finally:
        assert still_running(f"sleep {mark}") == []


class Listener:
    """A TCP listener on the host that counts the connections it accepts."""

    def __init__(self, address: str) -> None:
        self.socket = socket.create_server((address, 0))
        self.socket.settimeout(0.2)
        self.address, self.port = address, self.socket.getsockname()[1]
        self.accepted = 0
        self.open = True
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        while self.open:
            try:
                connection, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self.open = False
        self.thread.join()
        self.socket.close()


def host_address() -> str | None:
    """The host's own address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_a_run_step_cannot_reach_a_service_on_the_hosts_loopback(
        tmp_path: Path, builder: Builder) -> None:
    """The build's network is its own (slirp4netns): a listener on the host's 127.0.0.1 is
    refused, while the host's outward address is reached as any server would be."""
    loopback = Listener("127.0.0.1")
    outward_address = host_address()
    outward = Listener(outward_address) if outward_address else None
    base = images.podman_image(images.BUSYBOX_REF)
    steps = [f"RUN (echo probe | nc -w 3 127.0.0.1 {loopback.port} && echo reached || "
             f"echo refused) > /loopback"]
    if outward is not None:
        steps.append(f"RUN (echo probe | nc -w 3 {outward.address} {outward.port} && "
                     f"echo reached || echo refused) > /outward")
    source = dockerfile_task(tmp_path / "task", "\n".join(
        [f"FROM {base}", "USER root", f"RUN echo {time.time_ns()} > /nonce", *steps, ""]))
    try:
        env = prepare(source, Cache(tmp_path / "cache"), owner=None)
    finally:
        loopback.close()
        if outward is not None:
            outward.close()
    assert env.root is not None
    assert (env.root / "loopback").read_text().strip() == "refused"
    assert loopback.accepted == 0
    if outward is not None:  # downloads still work: the outside is reached
        assert (env.root / "outward").read_text().strip() == "reached"
        assert outward.accepted == 1


def test_a_build_works_from_a_folder_the_build_user_cannot_enter(
        tmp_path: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # root's alone
    monkeypatch.chdir(private)
    base = images.podman_image(images.BUSYBOX_REF)
    source = dockerfile_task(tmp_path / "task", (
        f"FROM {base}\nUSER root\nRUN echo {time.time_ns()} > /built\n"))
    env = prepare(source, Cache(tmp_path / "cache"), owner=None)
    assert env.root is not None and (env.root / "built").is_file()


@pytest.mark.parametrize("pids, memory_mb, expected", [
    (None, None, ("4096", 4096)),  # the floor and the default
    (100, 512, ("4096", 512)),  # a task's smaller pids never lowers a build's floor
    (5000, None, ("5000", 4096)),
])
def test_a_builds_cgroup_holds_the_tasks_limits(
        tmp_path: Path, builder: Builder, pids: float | None, memory_mb: float | None,
        expected: tuple[str, int]) -> None:
    """Every command of the build runs inside its cgroup, which is gone afterwards."""
    source = Source("dockerfile", "Dockerfile", tmp_path, pids=pids, memory_mb=memory_mb)
    # in a workspace of its own, whose lock tells another process's sweep (its first
    # build, `recover --all`) that this box lives: a box without one is a killed build's
    with build_module._workspace(builder, building=False) as work, \
            contained(builder, builder.storage, tmp_path, source,
                      build_id=work.build_id) as box:
        inside = box.run(["cat", "/proc/self/cgroup"])
        paths = box.cgroup.paths
        assert inside.count(box.build_id) == len(paths)  # in each of its hierarchies
        files = {name: (path / name).read_text().strip() for path in paths
                 for name in ("pids.max", "memory.limit_in_bytes", "memory.max")
                 if (path / name).is_file()}
        assert files["pids.max"] == expected[0]
        memory = files.get("memory.limit_in_bytes") or files["memory.max"]
        assert int(memory) == expected[1] * 1024 * 1024
    assert not any(path.exists() for path in paths)


def test_the_id_a_build_wrote_is_read_without_following_a_link(tmp_path: Path) -> None:
    """A built image's id is what podman wrote with `--iidfile` in the build user's folder
    (no `podman image inspect` after each build): read without following a link or
    blocking on a fifo, a few bytes, and only a `sha256:` id; anything else is None (the
    build storage is then asked)."""
    ident = "sha256:" + "ab" * 32
    written = tmp_path / "image-id"
    written.write_text(ident)
    assert build_module._written_id(written) == ident
    written.write_text(ident.removeprefix("sha256:") + "\n")  # older podman: hex alone
    assert build_module._written_id(written) == ident
    link = tmp_path / "link"
    link.symlink_to(written)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "long").write_text(ident + "0" * 10_000)
    (tmp_path / "junk").write_text("sha256:../../etc/passwd")
    for name in ("link", "fifo", "long", "junk", "missing"):
        assert build_module._written_id(tmp_path / name) is None, name


def test_a_built_images_layers_are_read_from_its_config_only_when_it_hashes_to_its_id(
        tmp_path: Path) -> None:
    """The layers an export needs come from the built image's config as the build storage
    keeps it (no podman start), taken only when its bytes hash to the image's id: a config
    the build user changed, or planted as a link, is None (podman is asked instead)."""
    import base64
    import hashlib

    builder = Builder(uid=os.getuid(), gid=os.getgid(), name="b", storage=tmp_path / "s",
                      locks=tmp_path / "l", scratch=tmp_path / "w")
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64]}})
    ident = "sha256:" + hashlib.sha256(config.encode()).hexdigest()
    folder = imageids.token_file(builder.graphroot, storage_driver(os.uname().release)
                                 ).parent / ident.removeprefix("sha256:")
    folder.mkdir(parents=True)
    kept = folder / ("=" + base64.b64encode(ident.encode()).decode())
    kept.write_text(config)
    assert build_module._diff_ids(builder, ident) == ["sha256:" + "1" * 64]
    kept.write_text(config.replace("1", "2"))  # changed under the same id
    assert build_module._diff_ids(builder, ident) is None
    kept.unlink()
    (tmp_path / "elsewhere").write_text(config)
    kept.symlink_to(tmp_path / "elsewhere")
    assert build_module._diff_ids(builder, ident) is None


def test_a_build_is_keyed_by_its_from_images_ids_as_dockers_cache_is(
        tmp_path: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same context over another image under its `FROM` name (re-tagged in the build
    storage) is built again, into another image; over the same image it is not built
    again (each `podman build` counted as it runs)."""
    built: list[str] = []
    real_build = build_module._build

    def counted(*args: Any, **kwargs: Any) -> None:
        built.append(args[2])  # the tag
        real_build(*args, **kwargs)

    monkeypatch.setattr(build_module, "_build", counted)
    inspected: list[str] = []  # the build storage asked for an image's id
    real_run = BuildBox.run

    def asked(box: BuildBox, argv: Sequence[str], *args: Any, **kwargs: Any) -> str:
        if list(argv[1:3]) == ["image", "inspect"]:
            inspected.append(argv[-1])
        return real_run(box, argv, *args, **kwargs)

    monkeypatch.setattr(BuildBox, "run", asked)
    nonce = f"{os.getpid()}-{time.time_ns()}"
    base = f"localhost/tl-buildkey-{nonce}:base"
    busybox = images.podman_image(images.BUSYBOX_REF)
    cache = Cache(tmp_path / "cache")
    other = prepare(dockerfile_task(tmp_path / "other", (
        f"FROM {busybox}\nUSER root\nRUN echo {nonce} > /other-base\n")), cache, owner=None)
    assert other.digest is not None
    busybox_id = as_builder(builder, "podman", "image", "inspect", "--format", "{{.Id}}",
                            busybox)
    task = dockerfile_task(tmp_path / "task", f"FROM {base}\nUSER root\nRUN touch /built\n")
    try:
        as_builder(builder, "podman", "tag", busybox_id, base)
        first = prepare(task, cache, owner=None)
        assert len(built) == 2
        assert prepare(task, cache, owner=None).digest == first.digest
        assert len(built) == 2  # the same base: not built again
        # The build wrote the storage, so the look-up above asked again; once it is left
        # unchanged (other tests' builds may write it meanwhile: then it is asked again,
        # rightly), its ids are not asked again.
        token = imageids.token_file(builder.graphroot, storage_driver(os.uname().release))
        quiet = None  # the token over the last look-up, when nothing wrote during it
        for _ in range(60):
            inspected.clear()
            before = imageids._read_token(token)
            assert prepare(task, cache, owner=None).digest == first.digest
            after = imageids._read_token(token)
            if quiet is not None and before == after == quiet:
                assert inspected == []  # asked under this token already: not again
                break
            quiet = after if before == after else None
            time.sleep(0 if quiet else 0.1)
        else:
            pytest.fail("the build storage was written during 60 look-ups in a row")
        as_builder(builder, "podman", "tag", other.digest, base)  # the name, another image
        second = prepare(task, cache, owner=None)
        assert len(built) == 3 and built[2] != built[1]
        assert second.digest != first.digest
        assert second.root is not None and (second.root / "other-base").is_file()
        assert prepare(task, cache, owner=None).digest == second.digest
        assert len(built) == 3
    finally:
        as_builder(builder, "podman", "untag", base, check=False)


def step_marker(builder: Builder, name: str) -> Path | None:
    """The root folder of the working container whose `RUN` step made `/name` (vfs: the
    container's own folder; overlay: its upper layer), if any yet."""
    graphs = builder.storage / "data" / "containers"  # storage-overlay, storage-vfs
    for pattern in (f"storage*/vfs/dir/*/{name}", f"storage*/overlay/*/diff/{name}"):
        for found in graphs.glob(pattern):
            return found.parent
    return None


def release_step(go: str) -> bool:
    """Let a held `RUN` step go on: SIGUSR1 to its shell (the one whose command names
    `go`), whose trap makes `/go` — a file made from outside in its layer's folder is not
    seen through a mounted overlay. Whether one was found."""
    found = False
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"sh") and argv[1:2] == [b"-c"] and go.encode() in argv[2]:
                os.kill(int(proc.name), signal.SIGUSR1)
                found = True
    return found


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`call()` in a thread of its own; its result (or exception) lands in the list."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as error:  # reported by the test, not lost in the thread
            result.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_different_images_build_at_once_and_a_built_one_is_found_meanwhile(
        tmp_path: Path, builder: Builder) -> None:
    """One build is held mid-way (its `RUN` step waits for a file the test makes in its
    working container): meanwhile another task's image builds and is prepared, and an
    image built already is prepared, neither waiting for the held build."""
    nonce = f"{os.getpid()}-{time.time_ns()}"
    base = images.podman_image(images.BUSYBOX_REF)
    cache = Cache(tmp_path / "cache")
    built = dockerfile_task(tmp_path / "built", (
        f"FROM {base}\nUSER root\nRUN echo {nonce} > /built\n"))
    prepare(built, cache, owner=None)
    waiting, go = f"waiting-{nonce}", f"go-{nonce}"
    held = dockerfile_task(tmp_path / "held", (
        f"FROM {base}\nUSER root\nRUN touch /{waiting}; trap 'touch /{go}' USR1; i=0; "
        f"while [ ! -e /{go} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; "
        f"[ -e /{go} ]\n"), timeout=300)
    other = dockerfile_task(tmp_path / "other", (
        f"FROM {base}\nUSER root\nRUN echo {nonce} > /other\n"))
    holder, held_result = in_thread(lambda: prepare(held, cache, owner=None))
    released = False
    try:
        deadline = time.monotonic() + 120
        while (folder := step_marker(builder, waiting)) is None and holder.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert folder is not None, f"the held build's step never started: {held_result}"
        again, again_result = in_thread(lambda: prepare(built, cache, owner=None))
        building, built_result = in_thread(lambda: prepare(other, cache, owner=None))
        deadline = time.monotonic() + 120
        for thread in (again, building):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert holder.is_alive() and not (folder / go).exists()  # still held meanwhile
        assert again_result and isinstance(again_result[0], Environment), again_result
        assert built_result and isinstance(built_result[0], Environment), built_result
        made = built_result[0]
        assert made.root is not None and (made.root / "other").read_text().strip() == nonce
        assert release_step(go)
        released = True
        holder.join(timeout=120)
        assert held_result and isinstance(held_result[0], Environment), held_result
    finally:
        if not released:
            release_step(go)
        holder.join(timeout=120)


def _queue_details(db: Path) -> list[tuple[str, str, str | None]]:
    """Each trial's task, state and detail (why its environment failed), for a failure's
    message."""
    import sqlite3

    with contextlib.suppress(sqlite3.Error), sqlite3.connect(db) as conn:
        return list(conn.execute("SELECT task, state, detail FROM job_queue"))
    return []


@pytest.mark.alone  # its first build sweeps what other processes' killed builds left
def test_job_run_shows_what_each_task_waits_for_while_its_image_builds(
        tmp_path: Path, builder: Builder) -> None:
    """Two tasks of one image, `-n 2`, on a real pseudo-terminal: while the build is held
    at its last step (its `RUN` waits for a file the test makes once the screen said so),
    the live display says which task builds at which step and that the other waits for
    its image's build; then the image is built once and both run over it."""
    import pty
    import sqlite3

    from tests.runs import make_task

    nonce = f"{os.getpid()}-{time.time_ns()}"
    base = images.podman_image(images.BUSYBOX_REF)
    waiting, go = f"waiting-{nonce}", f"go-{nonce}"
    dockerfile = (f"FROM {base}\nUSER root\nRUN echo {nonce} > /nonce\n"
                  f"RUN touch /{waiting}; trap 'touch /{go}' USR1; i=0; "
                  f"while [ ! -e /{go} ] && [ $i -lt 1800 ]; "
                  f"do sleep 0.1; i=$((i+1)); done; [ -e /{go} ]\n")
    data = tmp_path / "data"
    for name in ("alpha", "beta"):
        (data / name / "environment").mkdir(parents=True)
        (data / name / "environment" / "Dockerfile").write_text(dockerfile)
        make_task(data / name, test_sh="exit 0\n", solve_sh="#!/bin/sh\necho solved\n")
    db = tmp_path / "jobs.db"
    argv = [sys.executable, "-m", "trialledger.cli", "job", "run", "waits", str(data),
            "--agent", "oracle", "-n", "2", "--db", str(db),
            "--cache-dir", str(tmp_path / "cache")]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env={**os.environ, "TERM": "xterm", "COLUMNS": "200"})
    os.close(follower)
    shown, released = b"", False
    building = re.compile(rb"building (alpha|beta) \(step 4/4\)")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not released:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                shown += chunk
            seen = building.search(shown)
            said = seen is not None and b"waiting for build of " + (
                b"beta" if seen[1] == b"alpha" else b"alpha") in shown
            # podman prints the step before it runs it: its marker may come a moment later
            if said and step_marker(builder, waiting) is not None:
                released = release_step(go)
        assert released, (_queue_details(db), shown.decode(errors="replace")[-3000:])
        while True:  # the rest of the run's output, until it exits
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
        assert proc.wait(timeout=180) == 0
    finally:
        deadline = time.monotonic() + 60
        while not released and proc.poll() is None and time.monotonic() < deadline:
            if step_marker(builder, waiting) is not None:
                released = release_step(go)  # the build goes on: the run ends as it should
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=180)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    with sqlite3.connect(db) as conn:
        digests = {task: digest for task, digest in conn.execute(
            "SELECT task, environment_digest FROM sessions")}
    assert set(digests) == {"alpha", "beta"} and digests["alpha"] == digests["beta"]


@pytest.mark.alone  # empties the machine's build storage: no other test may build meanwhile
def test_cache_prune_empties_the_build_storage_but_never_under_a_running_build(
        tmp_path: Path, builder: Builder, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trialledger import cli

    built: list[str] = []
    real_build = build_module._build

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(args[2])  # the tag
        return real_build(*args, **kwargs)

    monkeypatch.setattr(build_module, "_build", counted)
    nonce = f"{os.getpid()}-{time.time_ns()}"
    task = dockerfile_task(tmp_path / "task", f"FROM {images.podman_image(images.BUSYBOX_REF)}"
                           f"\nUSER root\nRUN echo {nonce} > /nonce\n")
    prepare(task, Cache(tmp_path / "cache"), owner=None)
    stored = as_builder(builder, "podman", "images", "--quiet", "--no-trunc").split()
    assert len(stored) >= 2  # the built image and its FROM image, copied in
    prune = ["cache", "prune", "--cache-dir", str(tmp_path / "cache")]
    with build_module._workspace(builder):  # another runner's build, under way
        capsys.readouterr()
        assert cli.main(prune) == 0
        said = capsys.readouterr().out
        assert "kept the image store's and the build storage's images: a build is running" \
            in said, said
        assert as_builder(builder, "podman", "images", "--quiet", "--no-trunc").split() == stored
    assert cli.main(prune) == 0
    assert "removed the build storage's images" in capsys.readouterr().out
    assert as_builder(builder, "podman", "images", "--quiet", "--no-trunc").split() == []
    again = prepare(task, Cache(tmp_path / "cache"), owner=None)
    assert len(built) == 2, built  # built again, from nothing
    assert again.root is not None and (again.root / "nonce").read_text() == f"{nonce}\n"


def test_a_warm_build_is_found_with_no_build_box_and_no_engine_asked(
        tmp_path: Path, builder: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later process (nothing in memory) preparing a Dockerfile built before finds it from
    the answers kept in root's folder: no build box is made and no engine is asked."""
    nonce = f"{os.getpid()}-{time.time_ns()}"
    task = dockerfile_task(tmp_path / "task", f"FROM {images.podman_image(images.BUSYBOX_REF)}"
                           f"\nUSER root\nRUN echo {nonce} > /nonce\n")
    cache = Cache(tmp_path / "cache")
    first = prepare(task, cache, owner=None)
    boxes: list[str | None] = []
    real_contained = contained

    def boxed(*args: Any, **kwargs: Any) -> Any:
        boxes.append(kwargs.get("build_id"))
        return real_contained(*args, **kwargs)

    asked: list[Sequence[str]] = []
    real_tool = _tool

    def engine(argv: Sequence[str], what: str, **options: Any) -> str:
        asked.append(argv)
        return real_tool(argv, what, **options)

    monkeypatch.setattr(build_module, "contained", boxed)
    monkeypatch.setattr(imageids, "_tool", engine)
    for _ in range(60):  # (another test's build or pull writes a storage: tried again)
        monkeypatch.setattr(imageids, "_known", {})  # a later process
        boxes.clear()
        asked.clear()
        assert prepare(task, cache, owner=None).digest == first.digest
        if not boxes:
            break
    assert boxes == [] and asked == [], (boxes, asked)
