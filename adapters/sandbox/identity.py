"""Who the agent runs as, and the static init that is its PID 1 (SPEC §11).

The agent never runs as host root: bwrap itself runs as the *sandbox user* — the runner's
own uid when the runner is not root; when it is, `--sandbox-uid` or the
`trialledger-sandbox` system user that `trialledger setup` creates. bwrap then maps only
that uid into the sandbox, so no uid inside maps to host root.

The init is built from `init.c` with `gcc -static` (by `trialledger setup`, or on first
use) into a cache folder keyed by the source's hash, and mounted read-only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import grp
import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.hostside import program

SANDBOX_USER = "trialledger-sandbox"
PROCESS_LIMIT = 8192  # RLIMIT_NPROC of the sandbox user where no session pids cgroup exists
INIT_SOURCE = Path(__file__).with_name("init.c")


@dataclass(frozen=True)
class SandboxUser:
    """The host uid and gid bwrap (and so the agent) runs as."""

    uid: int
    gid: int

    @property
    def switches(self) -> bool:
        """Whether launching needs a switch from our own uid (we are root)."""
        return os.geteuid() != self.uid

    def staged(self, init: Path, overlays: Sequence[str] = (), binds: Sequence[str] = (),
               cgroups: Sequence[Path] = (), nproc: int = PROCESS_LIMIT,
               idmap: Sequence[tuple[int, Path, Path]] = ()) -> list[str]:
        """The argv prefix our static init (`init --stage`) makes of a launch: first it
        joins `cgroups` (each a session cgroup's `cgroup.procs`); in a private mount
        namespace, when there is anything to mount, the overlays (options, target) and the
        read-only binds (source, target); then, as root, the drop to this user (no groups,
        no new privileges) under the process limit `nproc`: the dedicated user's processes
        and threads, all sessions together, where no pids cgroup of the session's own
        holds them; 0 when one does, so no other session's processes count against this
        one. Not root, a user namespace maps us to root for the mounts, and there is
        nothing to drop. `idmap` (range mode: each the session's user namespace fd, the cache
        entry or a layer of the image store, its mount point) is mounted first, for the
        overlays to lie on."""
        mounting = bool(overlays or binds)
        if not self.switches and not mounting and not cgroups:
            return []
        namespace: list[str] = []
        options = ["--drop", str(self.uid), str(self.gid), str(nproc)] if self.switches else []
        if mounting and os.geteuid() == 0:
            options[0:0] = [str(part) for one in idmap
                            for part in ("--idmap", *one)]
            options.insert(0, "--mount-ns")
        elif mounting:
            namespace = [program("unshare"), "--user", "--map-root-user", "--mount",
                         "--propagation", "private", "--"]
        joins = [option for procs in cgroups for option in ("--cgroup", str(procs))]
        return [*namespace, str(init), "--stage", *joins, *options, *overlays, "--", *binds,
                "--"]


def sandbox_user(uid: int | None = None) -> SandboxUser:
    """The sandbox user: ourselves when not root, else `uid` or `trialledger-sandbox`."""
    if os.geteuid() != 0:
        return SandboxUser(os.geteuid(), os.getegid())
    if uid is not None:
        if uid == 0:
            raise SandboxRefused("--sandbox-uid 0 would run the agent as host root")
        try:
            return SandboxUser(uid, pwd.getpwuid(uid).pw_gid)
        except KeyError:
            return SandboxUser(uid, uid)
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        raise SandboxRefused(
            f"running as root, the agent needs an unprivileged user: run `trialledger setup` "
            f"(creates the {SANDBOX_USER} system user) or pass --sandbox-uid") from None
    if entry.pw_uid == 0:
        raise SandboxRefused(f"the {SANDBOX_USER} user has uid 0; it must be unprivileged")
    return SandboxUser(entry.pw_uid, entry.pw_gid)


def create_sandbox_user() -> tuple[SandboxUser, bool]:
    """Create the `trialledger-sandbox` system user if it is missing (root only)."""
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
        return SandboxUser(entry.pw_uid, entry.pw_gid), False
    except KeyError:
        pass
    if os.geteuid() != 0:
        raise SandboxRefused("only root needs (and can create) the sandbox user")
    command = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
               "--shell", "/usr/sbin/nologin", "--user-group", SANDBOX_USER]
    try:
        grp.getgrnam(SANDBOX_USER)
        command[-2:-1] = ["--gid", SANDBOX_USER]
    except KeyError:
        pass
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxRefused(f"useradd {SANDBOX_USER} failed: {done.stderr.strip()}")
    entry = pwd.getpwnam(SANDBOX_USER)
    return SandboxUser(entry.pw_uid, entry.pw_gid), True


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, for the calls Python's os module lacks (setfsuid, setns)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def cache_dir() -> Path:
    """Where the runner keeps what it builds for the sandbox (the init, Codex's copy)."""
    if os.geteuid() == 0:
        return Path("/var/cache/trialledger")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trialledger"


@functools.cache
def _init_digest() -> str:
    """The init source's digest, read once per process (every session asks for the init)."""
    return hashlib.sha256(INIT_SOURCE.read_bytes()).hexdigest()[:16]


def init_path() -> Path:
    """Where the init for this source lives (built or not)."""
    return cache_dir() / f"init-{_init_digest()}"


def ensure_init() -> Path:
    """The static init, built now if it is missing (gcc -static)."""
    return built_static(INIT_SOURCE, init_path(), "the sandbox init")


def built_static(source: Path, target: Path, what: str, libs: Sequence[str] = ()) -> Path:
    """`source` (C) compiled with `gcc -static` into `target`, unless it is there already
    (the target's name carries the source's digest); atomic, so concurrent builders agree.
    `SandboxRefused` names `what` when there is no compiler or the build fails."""
    if target.is_file():
        return target
    compiler = shutil.which("gcc") or shutil.which("cc")
    needs = "gcc libc6-dev" + (" libseccomp-dev" if libs else "")
    if compiler is None:
        raise SandboxRefused(f"{what} needs building once and no C compiler is installed: "
                             f"apt-get install {needs}, then trialledger setup")
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([compiler, "-static", "-O2", "-o", str(built), str(source),
                               *libs], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxRefused(f"building {what} failed (it needs {needs}): "
                                 f"{done.stderr.strip().splitlines()[-1:]}")
        built.chmod(0o755)
        os.replace(built, target)
    return target
