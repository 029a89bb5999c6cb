"""Who builds Dockerfiles (docs/SPEC.md §12): never host root.

A `RUN` step of `podman build --isolation chroot` keeps CAP_SYS_CHROOT and can leave its
chroot, so a build runs rootless, as `trialledger-build`: a system user `trialledger
setup` creates (`create_build_user`) with a subordinate range of its own (65,536 ids, far
above the session slots) and an engine storage of its own (`/var/lib/trialledger/build`,
0700). Inside a `RUN` step root is the build user and every other id one of its range, so
an escape reaches the host as those ids only. Only a root runner builds: each build runs
in a cgroup and a network namespace of its own (`adapters/images/buildbox.py`), which only root
can make here.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.images.environment import (
    DEFAULT_PATH,
    EnvironmentUnavailable,
)
from trialledger.adapters.sandbox.hostside import program
from trialledger.adapters.sandbox.idrange import subid_entries

BUILD_USER = "trialledger-build"
BUILD_IDS = 65_536
# Far above the session slots (64 × 65,536 from 2**20), so a later slot range never meets it.
BUILD_IDS_FLOOR = 1 << 28
STATE = Path("/var/lib/trialledger")
STORAGE = STATE / "build"  # the build user's HOME, XDG folders and engine storage
SCRATCH = STATE / "builds"  # one private folder per build
LOCKS = STATE / "build-locks"  # root's: one lock file per build key, and the FROM copy's
SUBIDS = {"subuid": Path("/etc/subuid"), "subgid": Path("/etc/subgid")}
WHAT = "environment/Dockerfile build"


@dataclass(frozen=True)
class Builder:
    """Who builds Dockerfiles here, and where its engine keeps images."""

    uid: int
    gid: int
    name: str
    storage: Path  # the build user's HOME, XDG folders and engine storage
    locks: Path  # one lock per build key (a build holds its image's only)
    scratch: Path  # where each build's private folder is made

    @property
    def graphroot(self) -> Path:
        """The engine storage's graph root (`storage_conf`: no engine asked)."""
        return graph_root(self.storage, storage_driver(os.uname().release))

    @property
    def as_user(self) -> list[str]:
        """The prefix that runs a command as the build user."""
        return [program("setpriv"), f"--reuid={self.uid}", f"--regid={self.gid}",
                "--init-groups", "--"]

    def env(self, tmp: Path) -> dict[str, str]:
        """The build user's environment: nothing of ours, every folder in its storage."""
        home = self.storage
        return {"PATH": DEFAULT_PATH, "HOME": str(home), "USER": self.name,
                "LOGNAME": self.name, "TMPDIR": str(tmp),
                "XDG_RUNTIME_DIR": str(home / "run"), "XDG_CONFIG_HOME": str(home / "config"),
                "XDG_DATA_HOME": str(home / "data"), "XDG_CACHE_HOME": str(home / "cache")}


def subordinate_ranges(path: Path, name: str, uid: int) -> list[tuple[int, int]]:
    """The (start, count) ranges `/etc/subuid` or `/etc/subgid` gives a user."""
    return [(start, count) for who, start, count in subid_entries(path)
            if who in (name, str(uid))]


def build_user() -> Builder:
    """The build user `trialledger setup` made (never root); only a root runner builds."""
    if os.geteuid() != 0:
        raise EnvironmentUnavailable(f"{WHAT}: only a root runner builds Dockerfiles (as "
                                     f"{BUILD_USER}, each build in a cgroup and a network "
                                     f"namespace of its own)")
    try:
        entry = pwd.getpwnam(BUILD_USER)
    except KeyError:
        raise EnvironmentUnavailable(f"{WHAT}: there is no {BUILD_USER} user to build as "
                                     f"(builds never run as root): run `trialledger setup`"
                                     ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise EnvironmentUnavailable(f"{WHAT}: the {BUILD_USER} user must be unprivileged")
    for path in SUBIDS.values():
        if not any(count >= BUILD_IDS for _, count in
                   subordinate_ranges(path, BUILD_USER, entry.pw_uid)):
            raise EnvironmentUnavailable(f"{WHAT}: {BUILD_USER} has no range in {path}: run "
                                         f"`trialledger setup`")
    _prepare_storage(entry.pw_uid, entry.pw_gid)
    return Builder(entry.pw_uid, entry.pw_gid, BUILD_USER, STORAGE, LOCKS, SCRATCH)


def create_build_user() -> tuple[Builder, bool]:
    """Create the build user, its subordinate range and its storage where missing (root
    only; an existing range is kept); the builder, and whether anything was created."""
    if os.geteuid() != 0:
        raise EnvironmentUnavailable("only root creates (and needs) the build user")
    created = False
    try:
        entry = pwd.getpwnam(BUILD_USER)
    except KeyError:
        _useradd()
        entry = pwd.getpwnam(BUILD_USER)
        created = True
    missing = [file for file, path in SUBIDS.items() if not any(
        count >= BUILD_IDS for _, count in subordinate_ranges(path, BUILD_USER, entry.pw_uid))]
    if missing:
        start = free_range_start()  # one start, free in both files
        ids = f"{start}-{start + BUILD_IDS - 1}"
        _setup_tool(["usermod", *(a for file in missing for a in (f"--add-{file}s", ids)),
                     BUILD_USER])
        created = True
    return build_user(), created


def free_range_start() -> int:
    """The first 65,536-aligned start at or above 2**28 whose 65,536 ids meet no entry of
    /etc/subuid or /etc/subgid (anyone's) and no user's or group's id."""
    taken = [(start, start + count) for path in SUBIDS.values()
             for _, start, count in subid_entries(path)]
    ids = {e.pw_uid for e in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    start = BUILD_IDS_FLOOR
    while (any(low < start + BUILD_IDS and start < high for low, high in taken)
           or any(start <= i < start + BUILD_IDS for i in ids)):
        start += BUILD_IDS
    if start + BUILD_IDS > 1 << 32:
        raise EnvironmentUnavailable("no free subordinate id range for the build user")
    return start


def _useradd() -> None:
    command = ["useradd", "--system", "--no-create-home", "--home-dir", str(STORAGE),
               "--shell", "/usr/sbin/nologin", "--user-group", BUILD_USER]
    with contextlib.suppress(KeyError):
        grp.getgrnam(BUILD_USER)
        command[-2:-1] = ["--gid", BUILD_USER]
    _setup_tool(command)


def _setup_tool(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise EnvironmentUnavailable(f"{argv[0]} {BUILD_USER} failed: {done.stderr.strip()}")


def _own(folder: Path, uid: int, gid: int, mode: int) -> None:
    """Make `folder` (never a link) and give it to `uid` with `mode`."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=mode)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def storage_driver(kernel: str) -> str:
    """The build storage's driver: `overlay` where the kernel mounts overlays in a user
    namespace (5.13 and later: each `RUN` layer a diff, not a full copy of the tree as
    `vfs` makes it), `vfs` elsewhere."""
    release = tuple(int(part) for part in re.findall(r"\d+", kernel)[:2])
    return "overlay" if release >= (5, 13) else "vfs"


def storage_conf(kernel: str) -> str:
    """The build user's `containers/storage.conf`: its driver, in a graph root of its own
    (an older `vfs` storage's database would otherwise keep its driver)."""
    driver = storage_driver(kernel)
    return (f'[storage]\ndriver = "{driver}"\n'
            f'graphroot = "{graph_root(STORAGE, driver)}"\n'
            f'runroot = "{STORAGE}/run/containers-{driver}"\n')


def graph_root(storage: Path, driver: str) -> Path:
    """Where the build user's engine keeps its images and containers."""
    return storage / "data" / "containers" / f"storage-{driver}"


def _write_storage_conf(uid: int, gid: int) -> None:
    """`config/containers/storage.conf` in the build user's storage, root's (0644): each
    folder opened without following a link (the build user owns `config/`), the file
    replaced by a rename only when it differs."""
    wanted = storage_conf(os.uname().release).encode()
    _own(STORAGE / "config", uid, gid, 0o700)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    config = os.open(STORAGE / "config", flags)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir("containers", 0o755, dir_fd=config)
        folder = os.open("containers", flags, dir_fd=config)
    finally:
        os.close(config)
    try:
        os.fchown(folder, 0, 0)
        os.fchmod(folder, 0o755)
        with contextlib.suppress(OSError):
            current = os.open("storage.conf", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=folder)
            with os.fdopen(current, "rb") as readable:
                if readable.read(len(wanted) + 1) == wanted:
                    return
        staged = f".storage.conf.{os.getpid()}.{threading.get_ident()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged, dir_fd=folder)
        out = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o644, dir_fd=folder)
        with os.fdopen(out, "wb") as writable:
            writable.write(wanted)
        os.rename(staged, "storage.conf", src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


def _prepare_storage(uid: int, gid: int) -> None:
    try:
        STATE.parent.mkdir(parents=True, exist_ok=True)
        _own(STATE, 0, 0, 0o755)
        _own(SCRATCH, 0, 0, 0o711)
        _own(LOCKS, 0, 0, 0o700)
        _own(STORAGE, uid, gid, 0o700)
        _own(STORAGE / "run", uid, gid, 0o700)  # XDG_RUNTIME_DIR
        _write_storage_conf(uid, gid)
    except OSError as error:
        raise EnvironmentUnavailable(f"the build storage {STORAGE}: {error.strerror} "
                                     f"({error.filename})") from None
