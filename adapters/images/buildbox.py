"""Where one Dockerfile build's processes run (docs/SPEC.md §12 "A build is contained").

Every engine command of a build — `podman build` and the `image exists`, `load`, `inspect`,
`save` and `buildah rm` around it — runs as the build user in the build's own cgroup
(`BuildCgroup`: pids, memory, the v1 freezer). Its first process joins before it execs
anything: it starts behind a gate (`sh` waiting for one line on its stdin) while the
runner writes its pid into the cgroup, then is let go. So whatever a `RUN` step forks,
detaches or re-parents stays inside, and when the build ends — done, failed or past its
timeout — the cgroup is frozen, every process in it killed, then thawed: nothing of the
build outlives it, and nothing is killed by user id.

`podman build` also runs in a network namespace of its own (`unshare --net`, made by the
runner before the build user's first instruction) that slirp4netns connects outward as
it does a session's: `--disable-host-loopback` keeps the host's loopback services out of
reach, and `RUN` steps resolve names through slirp's resolver, so downloads still work.

A build's working containers are found by its id: podman applies `--label` only when a
step commits, so the id is given as `--cgroup-parent`, which chroot isolation does not
use but buildah records in each working container (`buildah.json`) as it creates it. At
the end those containers, and only those, are removed (other builds may share the
storage). Every command runs from the build's own folder, so the runner's working folder
need not be one the build user can enter.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio

from trialledger.adapters.images.builder import WHAT, Builder
from trialledger.adapters.images.environment import TOOL_TIMEOUT_S, EnvironmentUnavailable, Source
from trialledger.adapters.places import read_small
from trialledger.adapters.sandbox.cgroup import (
    BUILD_MEMORY_MB,
    BUILD_PIDS,
    BUILD_PREFIX,
    BuildCgroup,
    LimitsNotEnforced,
    build_cgroups,
)
from trialledger.adapters.sandbox.folders import STALE_S, lock_held, remove_tree
from trialledger.adapters.sandbox.hostside import ProgramMissing, program
from trialledger.adapters.sandbox.slirp import SlirpFailed, start_slirp

LOCK_NAME = ".build-lock"  # in a build's folder, held by its runner while it lives
GATE = 'read -r _ && exec "$@"'  # holds the command back until the runner has moved it
NETNS_WAIT_S = 10.0
RECORD_MAX_BYTES = 8 << 20  # a working container's buildah.json is a few KiB
T = TypeVar("T")


class BuildBox:
    """One build's cgroup, user and folder: every engine command of the build runs here."""

    def __init__(self, builder: Builder, cgroup: BuildCgroup, folder: Path, env: dict[str, str]
                 ) -> None:
        self.builder = builder
        self.cgroup = cgroup
        self.folder = folder  # the build user's own: every command's working folder
        self.env = env
        self.built = False  # whether `podman build` ran (and may have left containers)

    @property
    def build_id(self) -> str:
        """The build's id: its cgroup's name, which its working containers record."""
        return self.cgroup.name

    def run(self, argv: Sequence[str], what: str = WHAT, *, timeout: float = TOOL_TIMEOUT_S
            ) -> str:
        """An engine command in the build's cgroup; its stdout, or one line saying what
        failed."""
        code, out, err = self._finish(argv, timeout, what)
        if code != 0:
            lines = [line.strip() for line in err.splitlines() if line.strip()]
            said = lines[-1] if lines else f"exit {code}"
            raise EnvironmentUnavailable(f"{what}: {said[-300:]}")
        return out

    def succeeds(self, argv: Sequence[str]) -> bool:
        """Whether an engine command in the build's cgroup exits 0."""
        return self._finish(argv, TOOL_TIMEOUT_S, WHAT)[0] == 0

    def build(self, argv: Sequence[str], log: IO[bytes], timeout: float) -> int | None:
        """`argv` in a network namespace of its own, connected by slirp4netns, writing to
        `log`; its exit status, or None past `timeout`. Whatever it started is killed as
        it ends."""
        process = self._start(argv, log, log, network=True)
        self.built = True
        slirp = None
        try:
            namespace = _private_netns(process)
            slirp = _run_async(functools.partial(start_slirp, process.pid,
                                                 net_namespace=namespace))
            _go(process)
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        except SlirpFailed as error:
            raise EnvironmentUnavailable(f"{WHAT}: its own network: {error}") from None
        finally:
            self.cgroup.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=NETNS_WAIT_S)  # killed: it ends at once
            if slirp is not None:
                _run_async(slirp.stop)

    def close(self) -> None:
        """End the build: kill all it runs, remove its working containers, then its
        cgroup."""
        self.cgroup.kill()
        with contextlib.suppress(EnvironmentUnavailable):
            for container in working_containers(self.builder, self.build_id.__eq__) \
                    if self.built else ():
                self.run(["buildah", "rm", container])
        self.cgroup.end()

    def remove_dead_builds_containers(self) -> int:
        """Remove the working containers of builds whose run was killed (their folder gone
        or its lock free); how many."""
        dead = working_containers(self.builder, lambda build: build.startswith(BUILD_PREFIX)
                                  and not build_alive(self.builder, build))
        for container in dead:
            with contextlib.suppress(EnvironmentUnavailable):
                self.run(["buildah", "rm", container])
        return len(dead)

    def _start(self, argv: Sequence[str], stdout: int | IO[bytes], stderr: int | IO[bytes],
               *, network: bool = False) -> subprocess.Popen[bytes]:
        """`argv` as the build user behind the gate, already in the build's cgroup."""
        try:
            prefix = [program("unshare"), "--net", "--"] if network else []
            command = [*prefix, *self.builder.as_user, program("sh"), "-c", GATE, "gate",
                       program(argv[0]), *argv[1:]]
        except ProgramMissing as error:
            raise EnvironmentUnavailable(f"{WHAT}: {error}") from None
        process = subprocess.Popen(command,
                                   stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                   env=self.env, cwd=self.folder)
        try:
            self.cgroup.join(process.pid)  # it is still at the gate: it has started nothing
        except OSError as error:
            process.kill()
            process.wait()
            raise EnvironmentUnavailable(f"{WHAT}: cannot join the build's cgroup: "
                                         f"{error.strerror}") from None
        return process

    def _finish(self, argv: Sequence[str], timeout: float, what: str) -> tuple[int, str, str]:
        process = self._start(argv, subprocess.PIPE, subprocess.PIPE)
        try:
            out, err = process.communicate(b"\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cgroup.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=NETNS_WAIT_S)
            raise EnvironmentUnavailable(f"{what}: {argv[0]} ran past {timeout:g} s") from None
        return (process.returncode, out.decode(errors="replace"),
                err.decode(errors="replace"))


@contextlib.contextmanager
def contained(builder: Builder, folder: Path, tmp: Path, source: Source,
              build_id: str | None = None) -> Iterator[BuildBox]:
    """A build's box: a new cgroup with the task's limits (pids.max at least 4,096, memory
    `memory_mb` else 4,096 MiB), named after `build_id` (the build's folder, whose lock
    says whether the build lives); at the end everything in it is killed and removed."""
    pids = max(BUILD_PIDS, int(source.pids or 0))
    memory_mb = source.memory_mb or BUILD_MEMORY_MB
    try:
        cgroup = BuildCgroup.create(build_id or uuid.uuid4().hex[:16], pids=pids,
                                    memory_mb=memory_mb)
    except LimitsNotEnforced as why:
        raise EnvironmentUnavailable(f"{WHAT}: a build runs in a cgroup of its own and none "
                                     f"can be made here: {why}") from None
    box = BuildBox(builder, cgroup, folder, builder.env(tmp))
    try:
        yield box
    finally:
        box.close()


def build_alive(builder: Builder, name: str) -> bool:
    """Whether the build `name` (its folder's and its cgroup's name) still runs: its
    folder holds a lock its runner keeps until the folder is gone (a folder just being
    made, its lock not yet there, counts as alive)."""
    folder = builder.scratch / name
    if (held := lock_held(folder / LOCK_NAME)) is not None:
        return held
    try:
        return time.time() - folder.lstat().st_mtime < STALE_S
    except OSError:
        return False


def end_dead_builds(builder: Builder) -> int:
    """End the cgroups and remove the folders of builds whose run was killed (a build
    never outlives its runner); how many builds. Their working containers go with the
    next build's box (`remove_dead_builds_containers`)."""
    ended = [c for c in build_cgroups() if not build_alive(builder, c.name)]
    for cgroup in ended:
        cgroup.end()
    folders: list[Path] = []
    with contextlib.suppress(OSError):
        folders = [f for f in builder.scratch.glob(f"{BUILD_PREFIX}*")
                   if f.is_dir() and not f.is_symlink() and not build_alive(builder, f.name)]
        remove_tree(*folders)
    return len({c.name for c in ended} | {f.name for f in folders})


def _run_async(function: Callable[[], Awaitable[T]]) -> T:
    """An async function run to its end in a thread of its own (a build is prepared from
    worker threads and from async code alike, whose thread already runs an event loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, function).result()


def _go(process: subprocess.Popen[bytes]) -> None:
    """Let a gated process go (its stdin then reads as empty)."""
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(b"\n")
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()


def _private_netns(process: subprocess.Popen[bytes]) -> int:
    """The inode of the network namespace `unshare --net` gave `process` (waiting until
    it has: before, it is still the host's)."""
    own = os.stat("/proc/self/ns/net").st_ino
    deadline = time.monotonic() + NETNS_WAIT_S
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if (inode := os.stat(f"/proc/{process.pid}/ns/net").st_ino) != own:
                return inode
        time.sleep(0.002)
    raise EnvironmentUnavailable(f"{WHAT}: `unshare --net` made no network namespace "
                                 f"(exit {process.poll()})")


def working_containers(builder: Builder, build: Callable[[str], bool]) -> list[str]:
    """The ids of the working containers in `builder`'s storage made by the builds whose id
    `build` accepts (the id in their record)."""
    found = []
    for record in builder.graphroot.glob("*-containers/*/userdata/buildah.json"):
        options = _record(record).get("CommonBuildOpts")
        made = options.get("CgroupParent") if isinstance(options, dict) else None
        if isinstance(made, str) and build(made):
            found.append(record.parent.parent.name)
    return sorted(found)


def _record(path: Path) -> dict[str, Any]:
    """A working container's buildah.json; empty when it is not such a record."""
    data = read_small(path, RECORD_MAX_BYTES)
    try:
        loaded = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}
