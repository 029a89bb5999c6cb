"""The bwrap command line of one spawn, as pure functions of what the spawn needs.

This is the security-critical part of the sandbox (docs/SPEC.md §11): which host paths the
agent, the probe and the verifier see, which of them are writable, which namespaces are
private. It reads nothing and writes nothing — `LocalSandbox` says which host system paths
exist and which are links, stages what the sandbox user may not read, and clears planted
mount points — so it is tested by tables (tests/sandbox/test_bwrap_argv.py), without bwrap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# "container": the one sandbox of a session under `verifier_isolation = harbor` (SPEC §15),
# mounted for every phase at once (the tests are copied in for the verifier, never bound).
Role = Literal["agent", "probe", "verifier", "container"]
PRIVATE = "/run/trialledger"
INIT_INSIDE = f"{PRIVATE}/init"
TESTS_INSIDE = "/tests"
# Codex unpacks its bundled skills into its home on every start (about 80 files and
# folders): a tmpfs there keeps them off the disk and frees them with the namespace, so the
# runner's removal of the session folder stays short. Nothing of ours reads them.
CODEX_SCRATCH = ("skills",)
VERIFIER_LOGS_INSIDE = "/logs/verifier"
VERIFIER_STDOUT = "test-stdout.txt"  # the verifier's stdout and stderr, as Harbor names it

# Every spawn: the user namespace maps only the given uid/gid (never host root) and forbids
# nested ones; no capability; private PID (our init is PID 1, so it gets the signals we
# forward and the namespace dies with it), IPC, UTS and cgroup views; a new terminal
# session (no TIOCSTI into ours); bwrap dies with the runner.
NAMESPACES = ("--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts",
              "--unshare-cgroup-try", "--new-session")
ISOLATION = ("--die-with-parent", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
             *NAMESPACES)
# Range mode (docs/SPEC.md §15): the session's own user namespace (made and mapped by the
# runner, nested ones forbidden in it), joined rather than made; Docker's capabilities,
# which bwrap also makes the bounding set, and the seccomp filter of Docker's denials.
RANGE_ISOLATION = ("--die-with-parent", "--cap-drop", "ALL", *NAMESPACES)


@dataclass(frozen=True)
class Mount:
    """One bwrap mount: `kind` is its option (`--ro-bind`, `--bind`, `--symlink`, `--proc`,
    `--dev`, `--tmpfs`)."""

    kind: str
    source: str | None
    target: str
    whole: bool = False  # whatever the agent planted at target is replaced whole (a link)
    staged: bool = False  # a host source the sandbox user may be unable to read: when the
    # runner is root it is bound read-only onto a staging point first


@dataclass(frozen=True)
class Spawn:
    """What one spawn needs of its sandbox."""

    role: Role
    uid: int  # inside the sandbox (an image's User; else the sandbox uid)
    gid: int
    workdir: str  # inside
    init: str  # our static init on the host
    session_dir: str  # the session's writable home, bound at its own path
    bwrap: str = "/usr/bin/bwrap"  # bwrap's absolute path (never found by a PATH search)
    root: str | None = None  # a merged overlay bound at `/`; None: the host's system folders
    system: Sequence[tuple[str, str | None]] = ()  # the host's system folders, mounted over
    # the root read-only (none over an image): (path, link target or None)
    workdir_source: str | None = None  # bound at the workdir; None: it lives in `root`
    codex: Sequence[tuple[str, str]] = ()  # (host file, path inside): the agent's Codex
    readonly: Sequence[str] = ()  # granted host paths, bound read-only at their own paths
    sees_agent_files: bool = True  # the grants and the session folder are visible
    tests: str | None = None  # a fresh writable copy of the task's tests, bound at /tests
    # (the verifier's only; None over an overlay, whose layer holds them as a real folder)
    verifier_logs: str | None = None  # where the verifier writes its reward
    isolated_network: bool = False  # a private network namespace: only our proxies answer
    block_fd: int | None = None  # bwrap waits on it (the proxies are opened inside first)
    info_fd: int = 0  # bwrap reports its child's pid here
    userns_fd: int | None = None  # range mode: the session's user namespace
    seccomp_fd: int | None = None  # range mode: the filter bwrap loads
    caps: Sequence[str] = ()  # range mode: inner root's capabilities
    hostname: str | None = None  # the UTS namespace's name (a container's: docs/SPEC.md §15)
    resolver: str | None = None  # a host file bound at /etc/resolv.conf (slirp's resolver)


def mounts(spawn: Spawn) -> list[Mount]:
    """Every mount of the spawn, in bwrap's order (a later mount may sit inside an earlier
    one). The root overlay, when there is one, is not among them: it is bound first."""
    found: list[Mount] = []
    for path, link in spawn.system:
        found.append(Mount("--symlink", link, path, whole=True) if link is not None
                     else Mount("--ro-bind", path, path))
    if spawn.resolver is not None:
        found.append(Mount("--ro-bind", spawn.resolver, "/etc/resolv.conf", staged=True))
    found += [Mount("--proc", None, "/proc"), Mount("--ro-bind", "/proc/sys", "/proc/sys"),
              Mount("--dev", None, "/dev")]
    if spawn.root is None or spawn.system:  # over an image, /tmp is the image's, in the
        # session's layer (it persists to the verifier, as in a container)
        found.append(Mount("--tmpfs", None, "/tmp"))
    found.append(Mount("--ro-bind", spawn.init, INIT_INSIDE))
    if spawn.role in ("agent", "container"):
        found += [Mount("--ro-bind", source, inside, staged=True)
                  for source, inside in spawn.codex]
    if spawn.sees_agent_files:
        found += [Mount("--ro-bind", path, path, staged=True) for path in spawn.readonly]
        found.append(Mount("--bind", spawn.session_dir, spawn.session_dir))
        if spawn.role in ("agent", "container"):
            found += [Mount("--tmpfs", None, f"{spawn.session_dir}/{name}")
                      for name in CODEX_SCRATCH]
    if spawn.workdir_source is not None:
        found.append(Mount("--bind", spawn.workdir_source, spawn.workdir))
    if spawn.role in ("verifier", "container"):
        if spawn.tests is not None:
            found.append(Mount("--bind", spawn.tests, TESTS_INSIDE))
        if spawn.verifier_logs is not None:
            found.append(Mount("--bind", spawn.verifier_logs, VERIFIER_LOGS_INSIDE))
    return found


def bwrap_argv(spawn: Spawn, placed: Sequence[Mount], command: Sequence[str]) -> list[str]:
    """bwrap's argv for `command` with the mounts `placed` (those of `mounts(spawn)`, their
    staged sources replaced where the runner staged them)."""
    if spawn.userns_fd is not None:  # our init switches each process to its user
        assert spawn.seccomp_fd is not None, "range mode never runs without its filter"
        argv = [spawn.bwrap, *RANGE_ISOLATION, "--userns", str(spawn.userns_fd),
                "--seccomp", str(spawn.seccomp_fd),
                *(option for cap in spawn.caps for option in ("--cap-add", cap))]
    else:
        argv = [spawn.bwrap, *ISOLATION, "--uid", str(spawn.uid), "--gid", str(spawn.gid)]
    if spawn.isolated_network:
        argv.append("--unshare-net")
    if spawn.block_fd is not None:
        argv += ["--block-fd", str(spawn.block_fd)]
    if spawn.hostname is not None:
        argv += ["--hostname", spawn.hostname]
    if spawn.root is not None:
        argv += ["--bind", spawn.root, "/"]
    for mount in placed:
        argv += [mount.kind, *([mount.source] if mount.source is not None else []),
                 mount.target]
    return [*argv, "--chdir", spawn.workdir, "--info-fd", str(spawn.info_fd), "--", *command]
