"""Mount points bwrap creates over a root it does not own (docs/SPEC.md §11).

bwrap makes each mount point (`mkdir -p`, or an empty file for a file's bind) with plain
path resolution before it enters the sandbox's root, so a symbolic link on the way — one an
image ships (`/logs -> /oldroot/tmp/x`, `/run -> /`) or one the agent planted in its layer —
sends the folder, and the mount, somewhere else: onto the host, or out of the agent's and
the verifier's sight (a verifier that then runs an image's own `/tests`). Before every
spawn the runner makes each such path real in the view bwrap will see — the session's
upper layer over the image's (or workspace's) lower folder — replacing, in the upper layer
only, whatever component is not a real folder. A folder in the upper layer hides a lower
entry of any other kind, so the image itself is never touched.

Every step is taken relative to an open folder (`O_NOFOLLOW`), never through a path the
agent could swap for a link while the runner works.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trialledger.adapters.sandbox.folders import remove_tree

Want = Literal["dir", "file", "absent"]  # what the last component must be for the mount
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")  # root's overlay, userxattr's


@dataclass
class _Level:
    """One folder of the walk: its upper folder (None: not made in the upper layer yet) and
    the lower folder that shows through it (None: none does)."""

    upper: int | None
    lower: int | None
    pending: list[tuple[str, os.stat_result]]  # lower folders to copy up to reach `upper`


def _entry(fd: int | None, name: str) -> os.stat_result | None:
    if fd is None:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _whiteout(info: os.stat_result) -> bool:
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == 0


def _opaque(fd: int) -> bool:
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(fd, name) == b"y":
                return True
    return False


def _fits(info: os.stat_result, want: Want) -> bool:
    return (want == "dir" and stat.S_ISDIR(info.st_mode)) or (
        want == "file" and stat.S_ISREG(info.st_mode))


class _Walk:
    """The walk down one path in the merged view of `upper` over `lower`."""

    def __init__(self, upper: Path, lower: Path | None, owner: tuple[int, int] | None,
                 shift: int = 0) -> None:
        self.owner = owner
        self.shift = shift
        self.opened: list[int] = []
        top = _DIR_FLAGS & ~os.O_NOFOLLOW  # the layers themselves are ours
        self.level = _Level(self._open(None, str(upper), top),
                            self._open(None, str(lower), top) if lower is not None else None,
                            [])

    def _open(self, fd: int | None, name: str, flags: int = _DIR_FLAGS) -> int:
        opened = os.open(name, flags, dir_fd=fd)
        self.opened.append(opened)
        return opened

    def close(self) -> None:
        for fd in self.opened:
            os.close(fd)

    def _own(self, fd: int, name: str, like: os.stat_result | None) -> None:
        """Give a made entry the lower entry's owner (a copy-up), else the sandbox user's."""
        owner = ((like.st_uid + self.shift, like.st_gid + self.shift)
                 if like is not None and max(like.st_uid, like.st_gid) < 65_536
                 else self.owner)  # an id no slot maps: the made folder is ours
        if owner is not None:
            with contextlib.suppress(PermissionError):  # not root: ours is the only owner
                os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)

    def upper(self) -> int:
        """The current folder in the upper layer, its lower folders copied up first."""
        level = self.level
        for name, like in level.pending:
            assert level.upper is not None
            os.mkdir(name, stat.S_IMODE(like.st_mode), dir_fd=level.upper)
            os.chmod(name, stat.S_IMODE(like.st_mode), dir_fd=level.upper)
            self._own(level.upper, name, like)
            level.upper = self._open(level.upper, name)
        level.pending = []
        assert level.upper is not None
        return level.upper

    def step(self, name: str, want: Want) -> bool:
        """Make `name` (in the current folder) what `want` says; whether to go on below."""
        level = self.level
        up = None if level.pending else _entry(level.upper, name)
        low = _entry(level.lower, name) if up is None or stat.S_ISDIR(up.st_mode) else None
        if up is not None and _whiteout(up):
            up = low = None  # nothing here in the merged view: bwrap makes it afresh
        seen = up or low
        if seen is None:  # made here, 0755 and `owner`'s, not by bwrap (whose folders are
            # 0700 root's: an image's non-root user could not pass them)
            if want != "absent":
                self._replace(name, None, None, want)
            return want == "dir"
        if _fits(seen, want):
            if want == "dir":
                self._descend(name, up, low)
            return want == "dir"
        self._replace(name, up, low, want)
        return want == "dir"

    def _descend(self, name: str, up: os.stat_result | None, low: os.stat_result | None
                 ) -> None:
        level = self.level
        lower = None
        if low is not None and stat.S_ISDIR(low.st_mode):
            assert level.lower is not None
            lower = self._open(level.lower, name)
        if up is not None:
            assert level.upper is not None
            upper = self._open(level.upper, name)
            self.level = _Level(upper, None if _opaque(upper) else lower, [])
        else:
            assert low is not None
            self.level = _Level(level.upper, lower, [*level.pending, (name, low)])

    def _replace(self, name: str, up: os.stat_result | None, low: os.stat_result | None,
                 want: Want) -> None:
        fd = self.upper()
        if up is not None and stat.S_ISDIR(up.st_mode):
            remove_tree(name, dir_fd=fd)
        elif up is not None:
            os.unlink(name, dir_fd=fd)
        if want == "dir":
            os.mkdir(name, 0o755, dir_fd=fd)
            self._own(fd, name, None)
            lower = None  # a lower folder shows through a plain upper one; nothing else does
            if low is not None and stat.S_ISDIR(low.st_mode) and self.level.lower is not None:
                lower = self._open(self.level.lower, name)
            self.level = _Level(self._open(fd, name), lower, [])
        elif want == "file":
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644, dir_fd=fd))
            self._own(fd, name, None)
        elif low is not None:  # absent: a whiteout hides the lower entry
            os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=fd)


def make_mount_point(upper: Path, relative: str, want: Want, *, lower: Path | None = None,
                     owner: tuple[int, int] | None = None, shift: int = 0) -> None:
    """Make `relative` safe for bwrap to mount on in the view of `upper` over `lower` (an
    overlay's merged view; `lower` None: `upper` alone): every component a real folder and
    the last one `want` — a real folder, a regular file, or nothing (bwrap makes a symlink
    there) — or missing, which bwrap then creates through real folders. What is not is
    replaced in `upper`; a folder made there is `owner`'s (the sandbox user, who makes the
    rest), one copied up on the way keeps the lower folder's owner (plus `shift`: range
    mode's slot start, as the idmapped lower shows it) and mode."""
    parts = [part for part in relative.split("/") if part and part != "."]
    if not parts or ".." in parts:
        return
    walk = _Walk(upper, lower, owner, shift)
    try:
        for index, part in enumerate(parts):
            if not walk.step(part, want if index == len(parts) - 1 else "dir"):
                return
    finally:
        walk.close()
