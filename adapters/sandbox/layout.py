"""A session folder's layout (SPEC §11): what the sandbox's mounts are made of.

The folder holds the agent's home (`home`), its workdir on the host (`work`), and for
workdir `/` or an image a per-session kernel overlay (lower: the copied workspace or the
image's root, in range mode mounted idmapped onto the session's slot at `lower`; upper:
the session's changes). Our static init mounts the overlays before bwrap runs; when the
runner is root, every mount source that is not world-readable (the Codex binary, the
tests, granted paths) is first bound read-only onto a staging folder (`stage`) in that
private mount namespace, so the sandbox user can bind it without reading the host. Before
every launch each mount point bwrap will create in a tree the image or the agent controls
is made a real path, and whatever the agent planted there (a symbolic link, a file, a
whiteout) is cleared, so bwrap never follows the agent's link out of the sandbox's root.

`SessionLayout` is the part of `LocalSandbox` (local.py) that lays the folder out and
names its layers; local.py sets the attributes declared here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from trialledger.adapters.images.environment import Environment, copy_tree, resolve_inside
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.bwrap import PRIVATE, Mount, Role
from trialledger.adapters.sandbox.folders import remove_tree
from trialledger.adapters.sandbox.hostside import host_env, program
from trialledger.adapters.sandbox.identity import SandboxUser
from trialledger.adapters.sandbox.idrange import SLOT, RangeIds
from trialledger.adapters.sandbox.mountpoints import Want, make_mount_point

_overlays_made: set[tuple[int, int, bool]] = set()  # (lower's device, upper's,
# range mode): overlays work


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


def chown_tree(top: Path, owner: tuple[int, int]) -> None:
    """Give a tree we created to host ids `owner` (links themselves, never followed)."""
    os.lchown(top, *owner)
    for folder, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(folder, name), *owner)


NOBODY = 65_534


def chown_like(source: Path, target: Path, shift: int) -> None:
    """Give each entry of `target` (a copy of the image's `source`) its original's owner
    on the slot starting at host id `shift` (links themselves, never followed; an id
    outside the slot's range becomes its `nobody`)."""
    def onto(inner: int) -> int:
        return shift + (inner if inner < SLOT else NOBODY)  # (65534, as the image's)

    def give(made: str) -> None:
        held = os.lstat(source / os.path.relpath(made, target))
        os.lchown(made, onto(held.st_uid), onto(held.st_gid))

    give(str(target))
    for folder, dirs, files in os.walk(target):
        for name in [*dirs, *files]:
            give(os.path.join(folder, name))


def clear_planted(layer: Path, relative: str, *, whole: bool) -> None:
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


class SessionLayout:
    """The session folder's layers, mount points and staged binds (a part of
    `LocalSandbox`)."""

    # Set by LocalSandbox's construction
    root: Path  # the session folder
    workdir: str
    environment: Environment
    image: Environment | None  # the environment, when it has a root (image or rootfs)
    overlay: bool  # whether the root is a per-session overlay (workdir / or an image)
    verifier_root: str
    init: Path
    range: RangeIds | None
    _verifications: int

    if TYPE_CHECKING:  # LocalSandbox's: who owns what, and the session's process limits
        @property
        def runs_as(self) -> SandboxUser: ...

        @property
        def agent_owner(self) -> tuple[int, int]: ...

        @property
        def _root_owner(self) -> tuple[int, int]: ...

        @property
        def _cgroup_procs(self) -> tuple[Path, ...]: ...

        @property
        def _nproc(self) -> int: ...

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
                    chown_tree(folder, self.agent_owner)
            if self.overlay:
                chown_tree(self.root / "upper", self.agent_owner)
                os.chown(self.root / "upper", *self._root_owner)  # the image's / is root's
        if self.range is not None:
            for point in self._lower_points:
                point.mkdir()
        if self.overlay:
            self._check_overlay()

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
            done = subprocess.run([*self._prefix([]), program("true")], capture_output=True,
                                  text=True, check=False, env=host_env(),
                                  pass_fds=(self.range.userns_fd,) if self.range else ())
            if done.returncode != 0:
                raise SandboxRefused(
                    "workdir / needs a per-session overlay, and none can be made here "
                    f"(mount -t overlay in a private mount namespace failed: "
                    f"{done.stderr.strip()[-300:]})")
            _overlays_made.add(key)

    def _overlay(self, lower: str, layer: str) -> list[str]:
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
        overlays, idmap = self._stage_mounts(role)
        return self.runs_as.staged(self.init, overlays,
                                   [str(p) for pair in staged for p in pair],
                                   self._cgroup_procs, self._nproc, idmap)

    @property
    def _lower_points(self) -> list[Path]:
        """(range mode) Where the image is mounted idmapped: one point per layer of the
        session image store, top first, else one for the cache entry."""
        assert self.image is not None
        if self.image.layers:
            return [self.root / f"lower-{i}" for i in range(len(self.image.layers))]
        return [self.root / "lower"]

    def _stage_mounts(self, role: Role) -> tuple[list[str], list[tuple[int, Path, Path]]]:
        """The overlays (options, target) our init mounts for a spawn of `role`, and (range
        mode) the idmapped mounts of the image they lie on: each layer of the image store
        in place (top first), else the cache entry."""
        overlays: list[str] = []
        idmap: list[tuple[int, Path, Path]] = []
        lowers = str(self._lower)
        if self.range is not None:
            assert self.image is not None and self.image.root is not None
            sources = list(self.image.layers) or [self.image.root]
            points = self._lower_points
            idmap = [(self.range.userns_fd, source, point)
                     for source, point in zip(sources, points, strict=True)]
            lowers = ":".join(str(point) for point in points)
        if self.overlay:
            options = (f"lowerdir={lowers},upperdir={self.root / 'upper'},"
                       f"workdir={self.root / 'overlay-work'}")
            if os.geteuid() != 0:
                options += ",userxattr"
            overlays += [options, str(self.root / "merged")]
        if self._pristine_view(role):
            assert self.image is not None and self.image.root is not None
            overlays += self._overlay(lowers if idmap else str(self.image.root),
                                      f"pristine-{self._verifications}")
        return overlays, idmap

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
            clear_planted(self.root / "upper", resolve_inside(self.image.root, self.workdir),
                           whole=False)
        writable = {str(self.host_work): self.host_work, str(self.session_dir): self.session_dir}
        targets = [PurePosixPath(m.target) for m in placed]
        for index, mount in enumerate(placed):
            target = targets[index]
            holders = {target, *target.parents}
            within = next((placed[i] for i in range(index - 1, -1, -1)
                           if targets[i] in holders), None)
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
