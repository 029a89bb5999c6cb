"""The local sandbox (SPEC §11): bubblewrap, or a process group only when asked for.

Under **bwrap** the agent runs as the unprivileged sandbox user (never mapped to host
root; `identity.py`), with every capability dropped, no nested user namespaces and a
read-only `/proc/sys`. It sees a minimal read-only root (the system folders and `/etc`),
our static init and the Codex binary at private paths under `/run/trialledger`, a
private `/tmp`, fresh `/dev` and `/proc`, its own PID, IPC and UTS namespaces, and the
host's network. Only the workdir and the session folder are writable; the task's tests
are mounted for the verifier only. Workdir `/` runs on a per-session kernel overlay
(lower: the copied workspace, upper: the session's changes). Before every launch the
mount points are cleared of anything the agent planted in its writable layer, so bwrap
never creates a mount point through the agent's symbolic link and the system symlinks
always come from the host. Cleanup is structural: the run is over when its PID namespace
is gone.

When the runner is root, every mount source that is not world-readable (the Codex
binary, the tests, granted paths) is first bound read-only onto a staging folder in a
private mount namespace, so the sandbox user can bind it without reading the host.

bwrap's ability to sandbox is checked before every session, exactly as the session will
run (as the sandbox user, in its cgroups), and a failure is checked once more: a bwrap that
cannot sandbox refuses the session, never falls back. Only when the operator asks for
`isolation="process-group"` does the agent run in its own process group instead — still
as the sandbox user, never as root — every process carrying the `TRIALLEDGER_SUPERVISOR`
marker; cleanup kills the stragglers the marker finds. That mode does not stop the agent
from writing outside its workdir, and every session records it (`isolation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import anyio

from trialledger.adapters.codex.install import CodexInstall
from trialledger.adapters.environment import (
    HOST,
    Environment,
    copy_tree,
    resolve_inside,
)
from trialledger.adapters.sandbox.agentfiles import AgentTree
from trialledger.adapters.sandbox.allowlist import AllowList
from trialledger.adapters.sandbox.base import (
    SUPERVISOR_ENV,
    CleanupReport,
    ProbeResult,
    SandboxRefused,
    VerifierRun,
)
from trialledger.adapters.sandbox.bwrap import (
    INIT_INSIDE,
    PRIVATE,
    TESTS_INSIDE,
    VERIFIER_LOGS_INSIDE,
    VERIFIER_STDOUT,
    Mount,
    Role,
    Spawn,
    bwrap_argv,
    mounts,
)
from trialledger.adapters.sandbox.cgroup import CONTROLLERS, SessionCgroup, hold
from trialledger.adapters.sandbox.container import Container, caps_mask, entry_command
from trialledger.adapters.sandbox.deadline import DeadManSwitch
from trialledger.adapters.sandbox.egress import (
    EgressProxy,
    apply_rules,
    egress_problem,
    egress_rules,
    open_ping,
)
from trialledger.adapters.sandbox.folders import (
    forget_session_folder,
    make_session_folder,
    remove_lock_last,
    remove_tree,
)
from trialledger.adapters.sandbox.identity import (
    PROCESS_LIMIT,
    SandboxUser,
    ensure_init,
    sandbox_user,
)
from trialledger.adapters.sandbox.idrange import (
    DOCKER_CAPS,
    InnerUser,
    Slot,
    ensure_filter,
    make_userns,
    reserved_range,
    resolve_user,
)
from trialledger.adapters.sandbox.mountpoints import Want, make_mount_point
from trialledger.adapters.sandbox.network import Network, listen_inside
from trialledger.adapters.sandbox.process import LocalRun
from trialledger.adapters.sandbox.procscan import kill_marked, pids_in_namespace
from trialledger.adapters.sandbox.slirp import (
    Slirp,
    hostname_of,
    injected_files,
    slirp_problem,
    start_slirp,
)

log = logging.getLogger(__name__)
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# A recorded session folder without its lock this old is no session being made right now
# (its lock follows its creation within microseconds): a removal or a creation cut short.
ISOLATIONS = ("bwrap", "process-group")
LIFETIMES = ("harbor", "strict")  # verifier_isolation (docs/SPEC.md §15)
CHECK_TAIL = 4096  # bytes of a healthcheck try's output kept
REMOVE_BATCH = 1000  # names per `rm` run (well inside ARG_MAX)
EGRESS_PORT = 15001  # where an allowlist's egress proxy listens in the container
RECHECK_AFTER_S = 0.2
_overlays_made: set[tuple[int, int, bool]] = set()  # (lower's device, upper's,
# range mode): overlays work


def bwrap_problem(user: SandboxUser, cgroups: Sequence[Path] = (),
                  nproc: int = PROCESS_LIMIT, userns_fd: int | None = None) -> str | None:
    """Why bwrap cannot sandbox here as `user` (None: it can): a missing bwrap, no user
    namespaces, or a seccomp/AppArmor policy that forbids them. Run as a session runs (the
    drop to `user` under `nproc`, joined to `cgroups`, in range mode joining the session's
    user namespace `userns_fd`) and, when it fails, once more: a transient failure
    (another session's processes filling a shared limit, say) is never taken for the
    machine's, and nothing is cached."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    users = (["--userns", str(userns_fd)] if userns_fd is not None
             else ["--unshare-user", "--disable-userns"])
    command = [*user.staged(ensure_init(), cgroups=cgroups, nproc=nproc), "bwrap",
               *users, "--cap-drop", "ALL", "--unshare-pid",
               "--as-pid-1", "--ro-bind", "/", "/", "true"]
    for attempt in range(2):
        if attempt:
            time.sleep(RECHECK_AFTER_S)
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              pass_fds=() if userns_fd is None else (userns_fd,))
        if done.returncode == 0:
            return None
    return f"bwrap cannot create its namespaces here: {done.stderr.strip()[-200:]}"


def _contains(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_granted_paths(paths: Sequence[Path], protected: Sequence[Path]) -> list[Path]:
    """Read-only paths to mount; refuse one that holds the store, the task or a home."""
    homes = [Path("/root"), Path("/home"), Path.home()]
    checked = []
    for path in paths:
        real = Path(os.path.realpath(path))
        for kept in [*protected, *homes]:
            kept_real = Path(os.path.realpath(kept))
            if _contains(real, kept_real):
                raise SandboxRefused(f"refusing to mount {path} into the sandbox: it holds "
                                     f"{kept}, which the agent must not see")
        if real.exists():
            checked.append(real)
    return checked


def _chown_tree(top: Path, owner: tuple[int, int]) -> None:
    """Give a tree we created to host ids `owner` (links themselves, never followed)."""
    os.lchown(top, *owner)
    for folder, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(folder, name), *owner)


@dataclass(frozen=True)
class RangeIds:
    """A range-mode session's ids: its slot, its user namespace, the user it runs as."""

    slot: Slot
    userns_fd: int
    users: Mapping[str, InnerUser]  # each role's user inside (agent, probe, verifier)

    @property
    def runs_as(self) -> SandboxUser:
        """bwrap's host uid: the slot's first id, the owner of the user namespace."""
        return SandboxUser(self.slot.start, self.slot.start)


def _clear_planted(layer: Path, relative: str, *, whole: bool) -> None:
    """Remove from an agent-writable `layer` whatever would redirect a mount point at
    `relative`: a component that is not a real folder (a symlink, a file, a whiteout), or
    with `whole`, the entry itself (system symlinks are always set from the host)."""
    parts = [p for p in relative.split("/") if p]
    current = layer
    for index, part in enumerate(parts):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return
        last = index == len(parts) - 1
        if stat.S_ISDIR(mode) and not (whole and last):
            continue
        if stat.S_ISDIR(mode):
            remove_tree(current)
        else:
            os.unlink(current)
        return


class LocalSandbox:
    """One session's sandbox on this machine."""

    def __init__(
        self,
        *,
        session_key: str,
        workdir: str,
        workspace: Path | None = None,
        tests: Path | None = None,
        codex: CodexInstall | None = None,
        readonly_paths: Sequence[Path] = (),
        protected_paths: Sequence[Path] = (),
        isolation: str = "bwrap",
        raise_oom_score_adj: bool = False,
        verifier_root: str = "agent",
        sandbox_uid: int | None = None,
        network: Network | None = None,
        environment: Environment = HOST,
        limits: Mapping[str, float] | None = None,
        users: Mapping[str, str] | None = None,
        switch: DeadManSwitch | None = None,
        lifetime: str = "strict",
        task_env: Mapping[str, str] | None = None,
        allowed_hosts: AllowList | None = None,
    ) -> None:
        self.workdir = workdir
        self.environment = environment
        self.image = environment if environment.root is not None else None
        if isolation not in ISOLATIONS:
            raise SandboxRefused(f"isolation {isolation!r}: expected bwrap or process-group")
        self.isolation = isolation
        self.user = sandbox_user(sandbox_uid)  # never host root, in either isolation
        self.overlay = workdir == "/" or self.image is not None
        if isolation == "process-group":
            self._refuse_unconfined(environment, network)
        self.network = network
        if verifier_root == "pristine" and workdir == "/":
            raise SandboxRefused("verifier_root = pristine needs a workdir other than /")
        self.verifier_root = verifier_root
        if lifetime not in LIFETIMES:
            raise SandboxRefused(f"verifier_isolation {lifetime!r}: expected harbor or strict")
        if lifetime == "harbor" and self.image is None:
            raise SandboxRefused("verifier_isolation = harbor needs an image or rootfs "
                                 "environment: a host task's phases run strict")
        if lifetime == "harbor" and verifier_root == "pristine":
            raise SandboxRefused("verifier_root = pristine cannot be used under "
                                 "verifier_isolation = harbor: one sandbox serves every phase")
        if (lifetime == "harbor" and network is not None and network.outward
                and (problem := slirp_problem()) is not None):
            raise SandboxRefused(f"a public network for an image's container needs "
                                 f"slirp4netns: {problem}")
        if allowed_hosts is not None:
            if lifetime != "harbor":
                raise SandboxRefused("network_mode = 'allowlist' needs the session's own "
                                     "container: an image or rootfs task under "
                                     "verifier_isolation = harbor")
            if (problem := egress_problem() or slirp_problem()) is not None:
                raise SandboxRefused(f"network_mode = 'allowlist' cannot be set up here: "
                                     f"{problem}")
        self.allowed_hosts = allowed_hosts
        # Docker's capabilities, less NET_RAW under an allowlist (a packet socket would
        # pass beside its rules)
        self.caps = tuple(cap for cap in DOCKER_CAPS
                          if not (allowed_hosts is not None and cap == "CAP_NET_RAW"))
        self.egress: EgressProxy | None = None
        # Where the egress proxy reports a refused connection (the runner's gap)
        self.egress_sink: Callable[[str], Awaitable[None]] | None = None
        self.lifetime = lifetime
        self.container: Container | None = None  # harbor: the session's one sandbox
        self.slirp: Slirp | None = None  # its outward connection (a public network)
        self.task_env = dict(task_env or {})  # [environment] env, for the container's PID 1
        self.init = ensure_init()
        self.codex = codex
        self.tests = tests
        self.readonly_paths = check_granted_paths(readonly_paths,
                                                  [*protected_paths, *([tests] if tests else [])])
        self.marker = session_key
        self.oom_score_adj = 1000 if raise_oom_score_adj else None
        # Recorded, then made, then locked — before anything (config.toml's grant tokens)
        # is written in it. The lock is held while the session lives: a folder whose lock is
        # free was left by a crash.
        self.root, self._lock = make_session_folder(session_key)
        self._verifications = 0
        self.limits = dict(limits or {})
        self.cgroup: SessionCgroup | None = None
        self.limits_reason: str | None = None
        self.range: RangeIds | None = None
        self.users = dict(users or {})  # phase → its `user` (range mode honours them)
        self.switch = switch  # a job trial's lease: every process killed once it lapses
        try:
            self.cgroup, self.limits_reason = hold(self.limits, self.marker)
            if self.image is not None and self.image.plain:
                self.range = self._take_range()
            if isolation == "bwrap" and (problem := bwrap_problem(
                    self.runs_as, self._cgroup_procs, self._nproc,
                    self.range.userns_fd if self.range else None)) is not None:
                raise SandboxRefused(f"{problem} (refusing to run the agent unconfined; "
                                     f"--isolation process-group runs it without a sandbox)")
            self._lay_out(workspace)
        except BaseException:
            self.discard()
            raise
        if isolation == "process-group":
            log.warning("session %s runs in a process group as uid %d, not in a sandbox "
                        "(isolation: process-group)", session_key, self.user.uid)

    def _refuse_unconfined(self, environment: Environment, network: Network | None) -> None:
        """What a process group cannot do safely: an image, workdir /, a private network."""
        if self.image is not None:
            raise SandboxRefused(f"the task's {environment.kind} environment needs bwrap; "
                                 f"--isolation process-group cannot run it")
        if self.overlay:
            raise SandboxRefused("workdir / needs a per-session overlay, which needs bwrap; "
                                 "refusing to let the agent write to the host's root")
        if network is not None and network.isolated:
            raise SandboxRefused("allow_internet = false needs a private network namespace, "
                                 "which needs bwrap; --isolation process-group cannot run it")

    def _take_range(self) -> RangeIds:
        """A slot of the sandbox user's range and the session's user namespace over it
        (a plain cache entry is only ever mounted this way)."""
        assert self.image is not None and self.image.root is not None
        ids = reserved_range()
        if os.geteuid() != 0 or ids is None:
            raise SandboxRefused("this image's cache entry keeps its own ownership (range "
                                 "mode), which needs a root runner after `trialledger setup`")
        if self.cgroup is None or "pids" not in self.cgroup.held:
            raise SandboxRefused(f"range mode needs a pids cgroup of the session's own "
                                 f"({self.limits_reason})")
        ensure_filter()
        image_user = (self.image.uid, self.image.gid)
        users = {role: resolve_user(self.image.root, self.users.get(role)
                                    if role in ("agent", "verifier") else None, image_user)
                 for role in ("agent", "probe", "verifier", "container")}
        slot = Slot.acquire(ids)
        try:
            userns_fd = make_userns(self.init, slot)
        except BaseException:
            slot.release()
            raise
        return RangeIds(slot, userns_fd, users)

    @property
    def runs_as(self) -> SandboxUser:
        """Who bwrap runs as on the host: the sandbox user, or (range) the slot's first id."""
        return self.range.runs_as if self.range is not None else self.user

    def owner(self, role: Role = "agent") -> tuple[int, int]:
        """The host ids of a role's files: the sandbox user's, or (range) the role's user's
        in the slot."""
        if self.range is not None:
            inner = self.range.users[role]
            return self.range.slot.host(inner.uid), self.range.slot.host(inner.gid)
        return self.user.uid, self.user.gid

    @property
    def agent_owner(self) -> tuple[int, int]:
        """The host ids of the agent's files."""
        return self.owner("agent")

    def give(self, top: Path) -> None:
        """Hand a tree the runner made for the agent to its user (links not followed)."""
        if self.runs_as.switches:
            _chown_tree(top, self.agent_owner)

    @property
    def _root_owner(self) -> tuple[int, int]:
        """The host ids of what inner root owns: the sandbox user's, or the slot's first."""
        return (self.runs_as.uid, self.runs_as.gid)

    def identity_record(self) -> dict[str, str]:
        """`agent.launched.identity` (schema 3): the id mode and the inner uid:gid every
        phase runs as: range mode (the image's user in the session's own 65,536 ids), else
        one inner id (the image's user, else the sandbox uid) mapped onto the sandbox uid,
        without capabilities."""
        if self.range is not None:
            agent = self.range.users["agent"]
            return {"mode": "range", "user": f"{agent.uid}:{agent.gid}"}
        uid, gid = ((self.image.uid, self.image.gid) if self.image is not None
                    else (self.user.uid, self.user.gid))
        return {"mode": "single", "user": f"{uid}:{gid}"}

    @property
    def _cgroup_procs(self) -> tuple[Path, ...]:
        return self.cgroup.procs if self.cgroup is not None else ()

    @property
    def _nproc(self) -> int:
        """The sandbox user's process rlimit for this session: none (0) when a pids cgroup
        of the session's own holds its processes, else the shared `PROCESS_LIMIT`."""
        return 0 if self.cgroup is not None and "pids" in self.cgroup.held else PROCESS_LIMIT

    def _lay_out(self, workspace: Path | None) -> None:
        self.session_dir = self.root / "home"
        self.host_work = self.root / "work"  # the workdir on the host (none over an image)
        self.stage = self.root / "stage"  # mount points of staged binds, made when needed
        self.session_dir.mkdir()
        if self.image is None:
            self.host_work.mkdir()
        self.private_roots = (str(self.session_dir), PRIVATE)
        if self.overlay:
            for name in ("upper", "overlay-work", "merged"):
                (self.root / name).mkdir()
        copy_to = self.host_work
        if self.image is not None:
            # Over an image the workdir is made in the session's layer (as a container
            # runtime makes it: a WORKDIR need not exist in the image), where the
            # workspace then goes; a workdir behind an image symlink is made where it leads.
            assert self.image.root is not None
            inside = resolve_inside(self.image.root, self.workdir)
            copy_to = self.root / "upper" / inside.lstrip("/")
            if not (self.image.root / inside.lstrip("/")).is_dir():
                copy_to.mkdir(parents=True, exist_ok=True)
        if workspace is not None and workspace.is_dir():
            shutil.copytree(workspace, copy_to, dirs_exist_ok=True, symlinks=True)
        if self.environment.upload is not None:
            # A prebuilt image's environment/, as Harbor uploads it (docs/SPEC.md §15).
            copy_to.mkdir(parents=True, exist_ok=True)
            copy_tree(self.environment.upload, copy_to)
        if self.runs_as.switches:
            # Only bwrap's group may pass (bwrap, as that user, binds the folders below),
            # never list; no other local user reaches the session's files — a setuid file
            # the agent made in its workdir is not theirs to run.
            os.chown(self.root, os.geteuid(), self.runs_as.gid)
            self.root.chmod(0o710)
            for folder in (self.session_dir, self.host_work):
                if folder.exists():
                    _chown_tree(folder, self.agent_owner)
            if self.overlay:
                _chown_tree(self.root / "upper", self.agent_owner)
                os.chown(self.root / "upper", *self._root_owner)  # the image's / is root's
        if self.range is not None:
            (self.root / "lower").mkdir()
        if self.overlay:
            self._check_overlay()

    def limits_record(self) -> dict[str, Any] | None:
        """`agent.launched.limits`: what the task asked for, and whether it holds (also
        when nothing was asked for but the session has no process limit of its own)."""
        if not self.limits and self.limits_reason is None:
            return None
        return {"requested": {key: self.limits.get(key) for key in CONTROLLERS},
                "enforced": self.limits_reason is None, "reason": self.limits_reason}

    @property
    def _lower(self) -> Path:
        """The overlay's lower folder: the image's root, else the session's workdir."""
        if self.image is not None and self.image.root is not None:
            return self.image.root
        return self.host_work

    def _check_overlay(self) -> None:
        """Refuse now, not at launch, when no overlay of this lower folder can be made under
        the session folders' file system: tried once per process and pair of file systems
        (a mount in a private namespace costs a few ms, a third of a sandbox start)."""
        lower = self._lower
        key = (os.stat(lower).st_dev, os.stat(self.root).st_dev, self.range is not None)
        if key not in _overlays_made:
            done = subprocess.run([*self._prefix([]), "true"], capture_output=True,
                                  text=True, check=False,
                                  pass_fds=(self.range.userns_fd,) if self.range else ())
            if done.returncode != 0:
                raise SandboxRefused(
                    "workdir / needs a per-session overlay, and none can be made here "
                    f"(mount -t overlay in a private mount namespace failed: "
                    f"{done.stderr.strip()[-300:]})")
            _overlays_made.add(key)

    # --- paths ------------------------------------------------------------------------------

    @property
    def agent_workdir(self) -> str:
        """The agent's working folder as the agent sees it."""
        return self.workdir if self.isolation == "bwrap" else str(self.host_work)

    @property
    def codex_argv0(self) -> str:
        """How the agent's command names Codex (inside the sandbox, or on the host)."""
        assert self.codex is not None
        return self.codex.inside if self.isolation == "bwrap" else str(self.codex.entrypoint)

    @property
    def codex_path_dir(self) -> str | None:
        """A folder of Codex's helpers (rg) to put on the agent's PATH."""
        if self.codex is None or not self.codex.helpers:
            return None
        if self.isolation == "bwrap":
            return self.codex.path_dir
        return str(next(iter(self.codex.helpers.values())).parent)

    def agent_files(self, folder: Path, role: Role = "agent") -> AgentTree:
        """Safe reads of a folder the agent (or the verifier, `role`) could write, as that
        role's user on the host."""
        return AgentTree(folder, *self.owner(role))

    # --- the bwrap command line -------------------------------------------------------------

    def _overlay(self, lower: Path, layer: str) -> list[str]:
        """`mount -t overlay` options and target for `lower` under `<layer>-upper`."""
        for name in (f"{layer}-upper", f"{layer}-work", f"{layer}-merged"):
            (self.root / name).mkdir(exist_ok=True)
        if self.runs_as.switches:  # the layer's root is inner root's, as the image's is
            os.chown(self.root / f"{layer}-upper", *self._root_owner)
        options = (f"lowerdir={lower},upperdir={self.root / f'{layer}-upper'},"
                   f"workdir={self.root / f'{layer}-work'}")
        if os.geteuid() != 0:
            options += ",userxattr"
        return [options, str(self.root / f"{layer}-merged")]

    def _pristine_view(self, role: Role) -> bool:
        """Whether this sandbox is the verifier's pristine view of an image: a fresh overlay
        of the image with the agent's workdir bound in."""
        return role == "verifier" and self.verifier_root == "pristine" and self.image is not None

    def _prefix(self, staged: Sequence[tuple[Path, Path]], role: Role = "agent") -> list[str]:
        """What runs before bwrap: our static init (`init --stage`) mounts the overlays
        and binds each staged source read-only onto its mount point in a private mount
        namespace, drops to the sandbox user, then execs bwrap. In range mode the image's
        entry is first mounted idmapped onto the slot, and the overlays lie on that."""
        overlays: list[str] = []
        idmap = None
        if self.range is not None:
            assert self.image is not None and self.image.root is not None
            idmap = (self.range.userns_fd, self.image.root, self.root / "lower")
        if self.overlay:
            lower = self.root / "lower" if idmap is not None else self._lower
            options = (f"lowerdir={lower},upperdir={self.root / 'upper'},"
                       f"workdir={self.root / 'overlay-work'}")
            if os.geteuid() != 0:
                options += ",userxattr"
            overlays += [options, str(self.root / "merged")]
        if self._pristine_view(role):
            assert self.image is not None and self.image.root is not None
            overlays += self._overlay(self.root / "lower" if idmap is not None
                                      else self.image.root, f"pristine-{self._verifications}")
        return self.runs_as.staged(self.init, overlays,
                                   [str(p) for pair in staged for p in pair],
                                   self._cgroup_procs, self._nproc, idmap)

    def _stage(self, source: Path, staged: list[tuple[Path, Path]]) -> Path:
        """Where bwrap takes `source` from: itself, or (root) a staged read-only bind."""
        if not self.runs_as.switches:
            return source
        point = self.stage / hashlib.sha256(str(source).encode()).hexdigest()[:16]
        if not point.exists():
            self.stage.mkdir(exist_ok=True)
            if source.is_dir():
                point.mkdir()
            else:
                point.touch()
        staged.append((source, point))
        return point

    def _bwrap(self, command: Sequence[str], *, info_fd: int, role: Role,
               verifier_logs: Path | None = None, block_fd: int | None = None,
               seccomp_fd: int | None = None) -> list[str]:
        """The spawn's whole argv: the staging prefix (root), the drop to the sandbox user,
        then bwrap (whose command line `bwrap.py` builds from what is read here)."""
        spawn = self._spawn_plan(role, info_fd=info_fd, verifier_logs=verifier_logs,
                                 block_fd=block_fd)
        if self.range is not None:
            spawn = dataclasses.replace(spawn, userns_fd=self.range.userns_fd,
                                        seccomp_fd=seccomp_fd, caps=self.caps)
        staged: list[tuple[Path, Path]] = []
        placed = [dataclasses.replace(m, source=str(self._stage(Path(m.source), staged)))
                  if m.staged and m.source is not None else m for m in mounts(spawn)]
        self._clear_mount_points(placed, role)
        return [*self._prefix(staged, role), *bwrap_argv(spawn, placed, command)]

    def _spawn_plan(self, role: Role, *, info_fd: int, verifier_logs: Path | None,
                    block_fd: int | None) -> Spawn:
        # Over an image the agent is the image's User inside (files the sandbox uid owns on
        # the host are that user's); on the host it is always the sandbox uid.
        uid, gid = ((self.image.uid, self.image.gid) if self.image is not None
                    else (self.user.uid, self.user.gid))
        pristine = self._pristine_view(role)
        root = None
        workdir_source = None if self.overlay else str(self.host_work)
        if pristine:  # the image as it was, a fresh layer above (made in _prefix), and the
            # agent's workdir as the agent left it
            assert self.image is not None and self.image.root is not None
            root = str(self.root / f"pristine-{self._verifications}-merged")
            inside = resolve_inside(self.image.root, self.workdir)
            workdir_source = str(self.root / "merged" / inside.lstrip("/"))
        elif self.overlay:
            root = str(self.root / "merged")
        system = [] if self.image is not None else [
            (path, os.readlink(path) if os.path.islink(path) else None)
            for path in SYSTEM_PATHS if os.path.islink(path) or os.path.isdir(path)]
        return Spawn(
            role=role, uid=uid, gid=gid, workdir=self.workdir, init=str(self.init),
            session_dir=str(self.session_dir), root=root, system=system,
            workdir_source=workdir_source,
            codex=[(str(s), i) for s, i in self.codex.mounts()] if self.codex else [],
            readonly=[str(p) for p in self.readonly_paths],
            sees_agent_files=role == "agent" or self.verifier_root == "agent",
            tests=str(self._tests_bound) if self._tests_bound is not None else None,
            verifier_logs=str(verifier_logs) if verifier_logs is not None else None,
            isolated_network=self.network is not None and self.network.isolated,
            block_fd=block_fd, info_fd=info_fd,
            hostname=hostname_of(self.marker) if role == "container" else None)

    def _clear_mount_points(self, placed: Sequence[Mount], role: Role) -> None:
        """Make each mount point bwrap will create in a tree the image or the agent controls
        a real path (mountpoints.py), so no link there leads bwrap out of the sandbox's root
        and `/run/trialledger`, `/tests` and `/logs` are always ours: over the root overlay,
        in its merged view; inside the workdir or the session folder, in that folder. A
        point inside a mount of ours (a tmpfs, `/proc`, a host folder) needs nothing."""
        owner = self._root_owner if self.runs_as.switches else None
        if self._pristine_view(role):  # the agent's workdir is bound in from its layer: a
            # workdir it swapped for a link is put back, never followed as a bind source
            assert self.image is not None and self.image.root is not None
            _clear_planted(self.root / "upper", resolve_inside(self.image.root, self.workdir),
                           whole=False)
        writable = {str(self.host_work): self.host_work, str(self.session_dir): self.session_dir}
        for index, mount in enumerate(placed):
            target = PurePosixPath(mount.target)
            within = next((m for m in reversed(placed[:index])
                           if PurePosixPath(m.target) in (target, *target.parents)), None)
            want: Want = "absent" if mount.kind == "--symlink" else (
                "file" if mount.source is not None and os.path.isfile(mount.source) else "dir")
            if within is None and self.overlay:
                upper, lower = self._root_layers(role)
                make_mount_point(upper, mount.target, want, lower=lower, owner=owner,
                                 shift=self.range.slot.start if self.range else 0)
            elif within is not None and within.kind == "--bind" and within.source in writable:
                make_mount_point(writable[within.source],
                                 str(target.relative_to(within.target)), want, owner=owner)

    def _root_layers(self, role: Role) -> tuple[Path, Path]:
        """The upper and lower folders of the overlay bound as the spawn's root."""
        if self._pristine_view(role):
            assert self.image is not None and self.image.root is not None
            upper = self.root / f"pristine-{self._verifications}-upper"
            upper.mkdir(exist_ok=True)
            return upper, self.image.root
        return self.root / "upper", self._lower

    def _init(self, command: Sequence[str], status_fd: int, role: Role,
              user: InnerUser | None = None, *, deadline: bool = True) -> list[str]:
        init = INIT_INSIDE if self.isolation == "bwrap" else str(self.init)
        argv = [init, "--status-fd", str(status_fd)]
        if self.oom_score_adj is not None:
            argv += ["--oom-score-adj", str(self.oom_score_adj)]
        if self.switch is not None and deadline:
            argv += ["--deadline-fd", str(self.switch.read_fd),
                     "--deadline-ms", str(self.switch.remaining_ms())]
        if user is None and self.range is not None:  # our init, inner root, switches the
            user = self.range.users[role]  # command's user
        if user is not None:
            groups = ",".join(str(g) for g in user.groups) or "-"
            argv += ["--user", str(user.uid), str(user.gid), groups]
        return [*argv, "--", *command]

    # --- the container (verifier_isolation = harbor) -----------------------------------------

    def _container_env(self) -> dict[str, str]:
        """PID 1's environment, as Harbor's compose service gets it: the image's `Env` and
        `HOME`, then `[environment] env`."""
        assert self.image is not None
        env = {**self.base_env(), **dict(self.image.env)}
        env.setdefault("HOME", self.image.home)
        return {**env, **self.task_env}

    async def _ensure_container(self) -> Container:
        """The session's container, started on first use (OSError: it could not be, or
        it has stopped)."""
        if self.container is not None:
            if (why := self.container.lost()) is not None:
                raise OSError(why)
            return self.container
        logs = self.root / "verifier-logs"
        logs.mkdir(mode=0o700)
        if self.runs_as.switches:
            os.chown(logs, *self.owner("verifier"))
        assert self.image is not None  # harbor runs image and rootfs sessions only
        outward = ((self.network is not None and self.network.outward)
                   or self.allowed_hosts is not None)
        self._prepare_layer(resolver=outward)
        run = await self._spawn(entry_command(self.image.entrypoint, INIT_INSIDE),
                                env=self._container_env(),
                                role="container", verifier_logs=logs)
        info = await anyio.to_thread.run_sync(run.info)
        pid, namespace = info.get("child-pid"), info.get("pid-namespace")
        try:
            if not isinstance(pid, int) or not isinstance(namespace, int):
                raise OSError("bwrap reported no container")
            self.container = await Container.attach(run, pid, namespace)
            if outward:
                net = info.get("net-namespace")
                known = net if isinstance(net, int) else None
                try:
                    self.slirp = await start_slirp(pid, net_namespace=known)
                    if self.allowed_hosts is not None:
                        await self._open_egress(pid, known)
                except SandboxRefused as error:  # also a container that stopped meanwhile
                    raise OSError(self.container.lost() or f"the container's network could "
                                                           f"not be set up: {error}") from None
        except BaseException:
            if self.slirp is not None:
                await self.slirp.stop()
                self.slirp = None
            if self.container is not None:
                self.container.release()
                self.container = None
            await run.aclose()
            raise
        return self.container

    async def _open_egress(self, pid: int, net_namespace: int | None) -> None:
        """An allowlist (docs/SPEC.md §15): `ping` opened to every group in the container's
        network, its TCP to non-local addresses redirected by nftables to our egress
        proxy, which listens inside and admits only allowed hosts."""
        assert self.allowed_hosts is not None
        taken = {route.port for route in self.network.routes} if self.network else set()
        port = next(p for p in range(EGRESS_PORT, EGRESS_PORT + 100) if p not in taken)
        await anyio.to_thread.run_sync(functools.partial(open_ping, pid,
                                                         net_namespace=net_namespace))
        await apply_rules(pid, egress_rules(port), net_namespace=net_namespace)
        (listener,) = await anyio.to_thread.run_sync(listen_inside, pid, [port])
        self.egress = EgressProxy(self.allowed_hosts, self._refused)
        await self.egress.start(listener)

    async def _refused(self, detail: str) -> None:
        if self.egress_sink is not None:
            await self.egress_sink(detail)

    def _prepare_layer(self, *, resolver: bool) -> None:
        """The container's start in the session's layer (before anything mounts it):
        `/logs/agent` and `/logs/artifacts` the agent's to write (`/logs/verifier` is
        bound in), and Docker's injected files."""
        assert self.image is not None and self.image.root is not None
        if resolve_inside(self.image.root, "/logs") == "/logs":
            logs = self.root / "upper" / "logs"
            for folder in (logs, logs / "agent", logs / "artifacts"):
                folder.mkdir(mode=0o755, exist_ok=True)
                if self.runs_as.switches:
                    os.chown(folder, *(self._root_owner if folder == logs
                                       else self.agent_owner))
        self._inject_docker_files(resolver=resolver)

    def _inject_docker_files(self, *, resolver: bool) -> None:
        """`/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` as Docker writes them over
        an image, into the session's layer, owned by inner root and writable by it, as
        Docker's are."""
        assert self.image is not None and self.image.root is not None
        if resolve_inside(self.image.root, "/etc") != "/etc":
            return  # an image whose /etc is a link: left as it is
        etc = self.root / "upper" / "etc"
        etc.mkdir(mode=0o755, exist_ok=True)
        owner = self._root_owner if self.runs_as.switches else None
        if owner is not None:
            os.chown(etc, *owner)
        for path, content in injected_files(self.marker, resolver=resolver).items():
            target = self.root / "upper" / path.lstrip("/")
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, content)
                if owner is not None:
                    os.fchown(fd, *owner)
            finally:
                os.close(fd)

    def container_lost(self) -> str | None:
        """Why the session's container is gone (harbor), else None."""
        return self.container.lost() if self.container is not None else None

    def _inner_user(self, role: Role) -> InnerUser:
        """Who a joined process runs as: the role's user (range mode), else the one id."""
        if self.range is not None:
            return self.range.users[role]
        assert self.image is not None
        return InnerUser(self.image.uid, self.image.gid, ())

    async def _spawn_joined(self, command: Sequence[str], *, env: Mapping[str, str],
                            role: Role, stdin: bool = False,
                            copy: tuple[int, str, int, int] | None = None) -> LocalRun:
        """A phase's process in the container (`init --join`); with `copy` (source fd,
        destination, uid, gid) inner root copies a folder in instead."""
        container = await self._ensure_container()
        status_r, status_w = os.pipe()
        seccomp = (os.open(ensure_filter(), os.O_RDONLY | os.O_CLOEXEC)
                   if self.range is not None else None)
        argv = [str(self.init), "--join-fds", container.join_arg()]
        for procs in self._cgroup_procs:
            argv += ["--cgroup", str(procs)]
        if self.range is not None:
            argv += ["--caps", caps_mask(self.caps), "--seccomp-fd", str(seccomp)]
        elif self._nproc:
            argv += ["--nproc", str(self._nproc)]
        argv += ["--chdir", self.workdir]
        user = self._inner_user(role)
        if copy is not None:
            argv += ["--copy-in", *(str(part) for part in copy)]
            user = InnerUser(0, 0, ()) if self.range is not None else user
        # The lease's switch is the container's PID 1's alone: when it fires, the container
        # ends and every process joined into it with it (two readers would split the
        # extensions between them).
        argv += self._init(command, status_w, role, user, deadline=False)[1:]
        try:
            process = await anyio.open_process(
                argv, env={**env, SUPERVISOR_ENV: self.marker},
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                pass_fds=tuple(fd for fd in (status_w, seccomp, copy[0] if copy else None,
                                             *container.fds)
                               if fd is not None),
                start_new_session=True)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            for fd in (status_w, seccomp):
                if fd is not None:
                    os.close(fd)
        return LocalRun(process, status_fd=status_r, info_fd=None, isolation="joined",
                        marker=self.marker)

    async def close(self) -> None:
        """Stop the session's container (harbor): every process in it ends."""
        if self.egress is not None:
            await self.egress.aclose()
            self.egress = None
        if self.slirp is not None:
            await self.slirp.stop()
            self.slirp = None
        if self.container is not None:
            await self.container.stop()

    async def _spawn(self, command: Sequence[str], *, env: Mapping[str, str], role: Role,
                     verifier_logs: Path | None = None, stdin: bool = False,
                     copy: tuple[int, str, int, int] | None = None) -> LocalRun:
        if self.lifetime == "harbor" and role != "container":
            return await self._spawn_joined(command, env=env, role=role, stdin=stdin,
                                            copy=copy)
        bwrap = self.isolation == "bwrap"
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe() if bwrap else (None, None)
        forwarding = (bwrap and role in ("agent", "container") and self.network is not None
                      and self.network.isolated)
        block_r, block_w = os.pipe() if forwarding else (None, None)
        seccomp = (os.open(ensure_filter(), os.O_RDONLY | os.O_CLOEXEC)
                   if self.range is not None else None)
        userns = self.range.userns_fd if self.range is not None else None
        inner = self._init(command, status_w, role)
        argv = (self._bwrap(inner, info_fd=info_w or 0, role=role, verifier_logs=verifier_logs,
                            block_fd=block_r, seccomp_fd=seccomp)
                if bwrap else [*self._prefix([]), *inner])
        env = {**env, SUPERVISOR_ENV: self.marker}
        try:
            quiet = subprocess.DEVNULL if role == "container" else subprocess.PIPE  # PID 1's
            # output: nobody would drain it for the whole session
            process = await anyio.open_process(
                argv, env=env, cwd=None if bwrap else self.host_work,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=quiet, stderr=quiet,
                pass_fds=tuple(fd for fd in (status_w, info_w, block_r, seccomp, userns,
                                             self.switch.read_fd if self.switch else None)
                               if fd is not None),
                start_new_session=True,
            )
        except BaseException:
            for fd in (status_r, info_r, block_w):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (status_w, info_w, block_r, seccomp):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        run = LocalRun(process, status_fd=status_r, info_fd=info_r,
                       isolation=self.isolation, marker=self.marker)
        if block_w is not None:
            await self._open_network(run, block_w)
        return run

    async def _open_network(self, run: LocalRun, block_w: int) -> None:
        """Open the proxies inside the sandbox's network, then let bwrap go on."""
        assert self.network is not None
        try:
            pid = (await anyio.to_thread.run_sync(run.info)).get("child-pid")
            if not isinstance(pid, int):
                raise OSError("bwrap reported no child pid for the network namespace")
            await self.network.open_inside(pid)
            os.write(block_w, b"x")
        except BaseException:
            await run.aclose()
            raise
        finally:
            os.close(block_w)

    # --- the Sandbox protocol ---------------------------------------------------------------

    async def launch(self, argv: Sequence[str], *, env: Mapping[str, str], stdin: bytes
                     ) -> LocalRun:
        """Start the agent with its prompt on stdin (harbor: in the session's container,
        noting what already runs there)."""
        if self.lifetime == "harbor":
            (await self._ensure_container()).mark_agent_start()
        run = await self._spawn(argv, env=env, role="agent", stdin=True)
        self._agent = run
        assert run.process.stdin is not None
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await run.process.stdin.send(stdin)
            await run.process.stdin.aclose()
        return run

    _agent: LocalRun | None = None

    async def confirm_cleanup(self, run: LocalRun, timeout_s: float) -> CleanupReport:
        """Bounded wait until no process of the run is left (structural under bwrap); under
        harbor until the agent's own process group is gone (its detached processes are
        reported as `survivors`)."""
        if run.isolation == "joined":
            with anyio.move_on_after(timeout_s):
                await run.process.wait()
            if run.group_gone is not True:
                return CleanupReport(False, f"the agent's process group was not confirmed "
                                            f"gone within {timeout_s:g} s")
            assert self.container is not None
            return CleanupReport(True, survivors=tuple(self.container.survivors()))
        if self.isolation == "bwrap":
            namespace = run.info().get("pid-namespace")
            if not isinstance(namespace, int):
                return CleanupReport(False, "bwrap reported no PID namespace")
            leftover: list[int] = []
            with anyio.move_on_after(timeout_s):
                while leftover := pids_in_namespace(namespace):
                    await anyio.sleep(0.05)
            if leftover:
                return CleanupReport(False, f"{len(leftover)} processes still in the sandbox's "
                                            f"PID namespace after {timeout_s:g} s")
            return CleanupReport(True)
        return await kill_marked(self.marker, timeout_s)

    async def _agent_gone(self) -> bool:
        """Whether every process of the agent's run is gone (killing any straggler)."""
        if self._agent is None:
            return True
        if self._agent.isolation == "joined":  # its group was killed when it ended
            if self._agent.process.returncode is None:
                await self._agent.stop(0.5)
            return self._agent.group_gone is True
        report = await self.confirm_cleanup(self._agent, 2.0)
        if not report.confirmed and self.isolation == "bwrap":
            namespace = self._agent.info().get("pid-namespace")
            for pid in pids_in_namespace(namespace) if isinstance(namespace, int) else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            report = await self.confirm_cleanup(self._agent, 2.0)
        return report.confirmed

    async def probe(self, timeout_s: float, command: Sequence[str] | None = None
                    ) -> ProbeResult:
        """Alive when a process runs in a fresh sandbox in the workdir within the limit: by
        default our own init (`--probe`), so no program of the environment is needed."""
        if command is None:
            command = [INIT_INSIDE if self.isolation == "bwrap" else str(self.init), "--probe"]
            name = "the init probe"
        else:
            name = f"`{' '.join(command)}`"
        code, timed_out = await self._run_bounded(list(command), timeout_s,
                                                  env=self.base_env(), role="probe")
        if timed_out:
            return ProbeResult(False, f"{name} did not finish within {timeout_s:g} s")
        if code != 0:
            return ProbeResult(False, f"{name} exited with {code}")
        return ProbeResult(True, f"{name} ran in the workdir")

    async def run_check(self, command: Sequence[str], timeout_s: float, *,
                        env: Mapping[str, str]) -> tuple[int | None, str]:
        """A command as the image's user in the session's sandbox (the healthcheck): its
        exit code (None: it timed out) and the end of its output (at most `CHECK_TAIL`
        bytes, stdout and stderr as they came)."""
        run = await self._spawn(list(command), env=env, role="probe")
        tail = bytearray()
        read = [anyio.Event(), anyio.Event()]

        async def keep(stream: Any, done: anyio.Event) -> None:
            try:
                if stream is not None:
                    async for chunk in stream:
                        tail.extend(chunk)
                        del tail[:-CHECK_TAIL]
            finally:
                done.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(keep, run.process.stdout, read[0])
                tg.start_soon(keep, run.process.stderr, read[1])
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                with anyio.move_on_after(0.2):  # a daemon it left may hold the pipes
                    for done in read:
                        await done.wait()
                tg.cancel_scope.cancel()
            code = None if scope.cancelled_caught else status.return_code
            return code, tail.decode("utf-8", errors="replace")
        finally:
            await run.aclose()

    def base_env(self) -> dict[str, str]:
        """The probe's and verifier's environment: PATH (the image's, over an image), LANG
        and LC_ALL."""
        env = _minimal_env()
        if self.image is not None:
            env["PATH"] = self.image.path
        return env

    async def verify(self, timeout_s: float, env: Mapping[str, str] | None = None
                     ) -> VerifierRun:
        """Run the tests as Harbor does, once every agent process is gone: a fresh,
        writable copy of the task's `tests/` at `/tests`, an empty `/logs/verifier`, and
        `/tests/test.sh` executed in the workdir (its shebang honoured; without one the
        shell runs it: bash where there is one, else sh) with `env` over the base
        environment, its stdout and stderr together into `/logs/verifier/test-stdout.txt`."""
        self._verifications += 1
        if self.lifetime == "harbor":
            return await self._verify_in_container(timeout_s, env)
        logs = self.root / f"verifier-{self._verifications}"
        logs.mkdir(mode=0o700)
        if self.runs_as.switches:
            os.chown(logs, *self.owner("verifier"))
        if not await self._agent_gone():
            return VerifierRun(None, False, logs, "agent processes outlived the run")
        run_it = f'exec "$0" > "$1/{VERIFIER_STDOUT}" 2>&1'
        if self.isolation == "bwrap":
            self._tests_bound = self._fresh_tests()
            shell = "bash" if self.image is None or self.image.has("bash") else "sh"
            command = [shell, "-c", run_it, f"{TESTS_INSIDE}/test.sh", VERIFIER_LOGS_INSIDE]
            env = {**self.base_env(), **(env or {}),
                   "TRIALLEDGER_VERIFIER_DIR": VERIFIER_LOGS_INSIDE}
        else:
            tests = self._unconfined_tests()
            command = ["bash", "-c", run_it, str(tests / "test.sh"), str(logs)]
            env = {**_minimal_env(), **(env or {}), "TRIALLEDGER_VERIFIER_DIR": str(logs),
                   "TRIALLEDGER_TESTS_DIR": str(tests)}
        code, timed_out = await self._run_bounded(command, timeout_s, env=env, role="verifier",
                                                  verifier_logs=logs)
        return VerifierRun(code, timed_out, logs)

    async def _verify_in_container(self, timeout_s: float, env: Mapping[str, str] | None
                                   ) -> VerifierRun:
        """The verifier as a process of the session's container (harbor): `/logs/verifier`
        emptied (a folder of ours bound in), a fresh `/tests` copied in by inner root and
        owned by the verifier's user, then `test.sh` as in `verify`."""
        logs = self.root / "verifier-logs"
        if not await self._agent_gone():
            return VerifierRun(None, False, logs, "agent processes outlived the run")
        try:
            await self._ensure_container()
        except OSError as error:
            return VerifierRun(None, False, logs, str(error))
        # What the agent (or a daemon of its) left there, any number of entries: removed by
        # a few `rm` runs, never one per entry.
        left = os.listdir(logs)
        for start in range(0, len(left), REMOVE_BATCH):
            remove_tree(*(logs / name for name in left[start:start + REMOVE_BATCH]))
        base = {**self.base_env(), **(env or {}), "TRIALLEDGER_VERIFIER_DIR": VERIFIER_LOGS_INSIDE}
        if self.tests is not None:
            stage = self.root / f"tests-{self._verifications}"
            self._copy_tests(stage)
            verifier = self._inner_user("verifier")
            source = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                code, _ = await self._run_bounded(
                    [], min(timeout_s, 60.0), env=base, role="verifier",
                    copy=(source, TESTS_INSIDE, verifier.uid, verifier.gid))
            finally:
                os.close(source)
            if code != 0:
                return VerifierRun(None, False, logs, "the tests could not be copied into "
                                                      "the container")
        assert self.image is not None
        shell = "bash" if self.image.has("bash") else "sh"
        run_it = f'exec "$0" > "$1/{VERIFIER_STDOUT}" 2>&1'
        command = [shell, "-c", run_it, f"{TESTS_INSIDE}/test.sh", VERIFIER_LOGS_INSIDE]
        code, timed_out = await self._run_bounded(command, timeout_s, env=base, role="verifier")
        return VerifierRun(code, timed_out, logs)

    def _copy_tests(self, target: Path) -> None:
        """The task's tests copied to `target` (links as links), the sandbox user's, with
        `test.sh` executable (Harbor's `chmod +x`)."""
        assert self.tests is not None
        shutil.copytree(self.tests, target, symlinks=True, dirs_exist_ok=True)
        script = target / "test.sh"
        if script.is_file() and not script.is_symlink():
            script.chmod(script.stat().st_mode | 0o111)
        if self.runs_as.switches:
            _chown_tree(target, self._root_owner if self.range is not None else self.agent_owner)

    def _fresh_tests(self) -> Path | None:
        """The verifier's `/tests`: over an overlay that is its root, a real folder of its
        layer (so a verifier may move it, as in a container), whatever the agent left
        there removed first and the image's own `/tests` merged in below; else a fresh
        copy the sandbox binds (returned)."""
        if self.tests is None:
            return None
        if self.overlay and not self._pristine_view("verifier"):
            _clear_planted(self.root / "upper", TESTS_INSIDE, whole=True)
            layer = self.root / "upper" / TESTS_INSIDE.lstrip("/")
            if os.path.lexists(layer):
                remove_tree(layer)
            self._copy_tests(layer)
            return None
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    def _unconfined_tests(self) -> Path:
        """The tests as a process-group verifier reads them: a copy of its own, made after
        the agent is gone (it runs as the sandbox user)."""
        if self.tests is None:
            return Path("/nonexistent")
        copy = self.root / f"tests-{self._verifications}"
        self._copy_tests(copy)
        return copy

    _tests_bound: Path | None = None

    async def _run_bounded(self, command: list[str], timeout_s: float, *,
                           env: Mapping[str, str], role: Role,
                           verifier_logs: Path | None = None,
                           copy: tuple[int, str, int, int] | None = None
                           ) -> tuple[int | None, bool]:
        run = await self._spawn(command, env=env, role=role, verifier_logs=verifier_logs,
                                copy=copy)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, run.process.stdout)
                tg.start_soon(_drain, run.process.stderr)
                with anyio.move_on_after(timeout_s) as scope:
                    status = await run.wait()
                if scope.cancelled_caught:
                    await run.stop(0.5)
                    if run.isolation != "joined":  # a joined run's group dies with it
                        await kill_marked(self.marker, 2)
                    tg.cancel_scope.cancel()
                    return None, True
            return status.return_code, False
        finally:
            await run.aclose()

    def discard(self) -> None:
        """Remove the session's folders (they hold config.toml with grant tokens), and its
        cgroup with whatever is left in it; then (range mode) free its slot."""
        try:
            if self.container is not None:
                if self.container.run.process.returncode is None:
                    self.container.run.process.kill()  # `close` was not awaited: bwrap's
                    # PID 1 dies with it, and the cgroup's removal below takes what is left
                self.container.release()
            if self.cgroup is not None:
                self.cgroup.remove()
                self.cgroup = None
            try:
                remove_lock_last(self.root)
            finally:
                with contextlib.suppress(OSError):
                    os.close(self._lock)
            forget_session_folder(self.root)
        finally:
            if self.range is not None:  # the slot is free once the folder is gone
                with contextlib.suppress(OSError):
                    os.close(self.range.userns_fd)
                self.range.slot.release()
                self.range = None


def _minimal_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}


async def _drain(stream: Any) -> None:
    if stream is not None:
        async for _ in stream:
            pass
