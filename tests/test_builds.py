"""Dockerfile builds never run as host root (docs/SPEC.md §12): a `RUN` step that leaves its
chroot reaches the host as the build user only, and a build past its timeout leaves no
process, working container or scratch folder behind. Real podman, buildah and gcc."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests import images
from trialledger.adapters import builder as builders
from trialledger.adapters.build import base_images
from trialledger.adapters.builder import Builder
from trialledger.adapters.environment import (
    Cache,
    EnvironmentUnavailable,
    Source,
    copy_tree,
    prepare,
)

ESCAPE_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The classic chroot escape, then a write and a read on the host.
   argv: canary folder, secret file, a host-only path, the report (in the image). */
int main(int argc, char **argv) {
    if (argc != 5) return 2;
    FILE *report = fopen(argv[4], "w");
    if (!report) return 1;
    mkdir("/escape-x", 0755);
    int broke = chroot("/escape-x") == 0;
    for (int i = 0; i < 64; i++) chdir("..");
    broke = chroot(".") == 0 && broke;
    struct stat seen;
    fprintf(report, "escaped: %s\n", broke && stat(argv[3], &seen) == 0 ? "yes" : "no");
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


@pytest.fixture(autouse=True)
def private_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our engine calls use the tests' own podman storage (the build user has its own)."""
    monkeypatch.setenv("CONTAINERS_STORAGE_CONF", str(images.storage_conf()))


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


def test_a_build_past_its_timeout_leaves_no_process_container_or_scratch(
        tmp_path: Path, builder: Builder) -> None:
    marker = f"{3000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"  # sleep's argument
    base = images.podman_image(images.BUSYBOX_REF)
    source = dockerfile_task(tmp_path / "task", f"FROM {base}\nRUN sleep {marker}\n",
                             timeout=15)
    before = containers(builder)
    scratch_before = set(os.listdir(builder.scratch)) if builder.scratch.is_dir() else set()
    seen: set[str] = set()
    building = True

    def watch() -> None:  # the working container does appear while the step runs
        while building:
            seen.update(containers(builder) - before)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(EnvironmentUnavailable, match="ran past 15 s"):
            prepare(source, Cache(tmp_path / "cache"), owner=None)
    finally:
        building = False
        watcher.join()
    assert seen, "no working container appeared during the build"
    assert containers(builder) == before  # ... and it was removed
    assert running(f"sleep {marker}") == []  # the RUN step was killed with its group
    assert set(os.listdir(builder.scratch)) == scratch_before  # TMPDIR and context removed


def test_a_root_runner_without_the_build_user_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root runner's refusal")
    monkeypatch.setattr(builders, "BUILD_USER", "trialledger-no-such-user")
    source = dockerfile_task(tmp_path / "task", "FROM scratch\n")
    with pytest.raises(EnvironmentUnavailable, match=r"never run as root.*trialledger setup"):
        prepare(source, Cache(tmp_path / "cache"), owner=None)


@pytest.mark.parametrize("dockerfile, named", [
    ("FROM a/b:1\nRUN x\n", ["a/b:1"]),
    ("from --platform=linux/amd64 a AS build\nFROM build\nFROM scratch\nFROM c as d\n",
     ["a", "c"]),
    ("ARG V=1\nFROM base:$V\nFROM a\nFROM a\n", ["a"]),
])
def test_base_images_are_the_from_images_but_stages_scratch_and_args(
        dockerfile: str, named: list[str]) -> None:
    assert base_images(dockerfile) == named


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
