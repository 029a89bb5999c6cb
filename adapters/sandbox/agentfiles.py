"""Host-side reads of files the agent controls (SPEC §11), as hostile input.

Every path is opened one component at a time with `openat(O_NOFOLLOW | O_NONBLOCK)` from
a folder the harness created, so no symbolic link the agent planted is followed (not even
in a parent folder); only regular files are read (a FIFO neither blocks nor counts, a
device or folder is refused), and every read is capped. When the runner is root, the
opens (where the kernel checks permissions) run with the calling thread's fs uid and gid
set to the sandbox user's (per-thread credentials on Linux), so a hard link to a file
the agent could not read itself gives nothing either (the tree's own folder, which the
harness made or was named, is opened with the runner's rights). Given a `seen` map, a
read takes each inode once: another name of it raises `AlreadyRead`, so hard links cannot
multiply what a caller copies. A file that breaks a rule raises
`UnsafeAgentFile`, which callers turn into gap `unsafe_agent_file` (its path and the
rule, never its content).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.sandbox.identity import libc
from trialledger.core.boundedjson import LONE_SURROGATE, as_text
from trialledger.core.errors import TrialLedgerError

ROLLOUT_LINE_LIMIT = 1024 * 1024
ROLLOUT_FILE_LIMIT = 256 * 1024 * 1024
MAX_DEPTH = 16
MAX_ENTRIES = 10_000

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnsafeAgentFile(TrialLedgerError):
    """A file the agent controls broke a reading rule (the message: its path and the rule)."""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"{path}: {rule}")
        self.path, self.rule = path, rule

    def gap(self) -> dict[str, str]:
        """The `gap.recorded` data for this violation."""
        return {"code": "unsafe_agent_file", "detail": str(self)}


Seen = dict[tuple[int, int], str]  # (st_dev, st_ino) → the first name read


def is_text(name: str) -> bool:
    """Whether a name read from the sandbox is text an event can hold: `os.scandir` gives
    each byte that is not UTF-8 as a lone surrogate (`surrogateescape`)."""
    return not LONE_SURROGATE.search(name)


class AlreadyRead(TrialLedgerError):
    """Another name (a hard link) of a file already read through the same `seen` map: its
    bytes are not read again, so 24 names of one big file cost one read and one copy."""

    def __init__(self, path: str, first: str) -> None:
        super().__init__(f"{path}: the same file as {first} (a hard link)")
        self.path, self.first = path, first


@dataclass(frozen=True)
class LongLine:
    """A line over the cap: only its length is kept."""

    size: int


@dataclass(frozen=True)
class Folder:
    """A folder's entries as `AgentTree.listing` found them."""

    entries: dict[str, os.stat_result]  # name → its lstat (never followed)
    more: bool = False  # over `MAX_ENTRIES`: the rest not listed


def kind(mode: int) -> str:
    """What a file that is not a regular one is, in a refusal's words."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _is_link(name: str, folder: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _refusal(error: OSError, shown: str) -> UnsafeAgentFile:
    if error.errno in (errno.ELOOP, errno.EMLINK):
        return UnsafeAgentFile(shown, "a symbolic link (not followed)")
    if error.errno == errno.ENOTDIR:
        return UnsafeAgentFile(shown, "a component is not a folder")
    if error.errno == errno.ENOENT:
        return UnsafeAgentFile(shown, "missing")
    return UnsafeAgentFile(shown, f"cannot be opened ({os.strerror(error.errno or 0)})")


@dataclass(frozen=True)
class AgentTree:
    """A folder the harness made whose contents the agent controls."""

    root: Path
    uid: int | None = None  # read as this fs uid/gid (None: as we are)
    gid: int | None = None

    # --- opening ----------------------------------------------------------------------------

    def _open(self, relative: str, *, directory: bool) -> int:
        top = self._open_root()
        with self._identity():
            return self._descend(top, relative, directory=directory)

    def _open_root(self) -> int:
        """The tree's own folder, opened with our rights: the harness made or named it, and
        its ancestors may be closed to the sandbox user (a Harbor job under /root)."""
        try:
            return os.open(self.root, _OPEN_DIR)
        except OSError as error:
            raise _refusal(error, ".") from None

    def _descend(self, fd: int, relative: str, *, directory: bool) -> int:
        """From the folder `fd` (taken over) down to `relative`, one component at a time."""
        parts = [p for p in relative.split("/") if p not in ("", ".")]
        try:
            if ".." in parts:
                raise UnsafeAgentFile(relative, "'..' in the path")
            for index, part in enumerate(parts):
                last = index == len(parts) - 1
                flags = _OPEN_DIR if (directory or not last) else _OPEN_FILE
                try:
                    child = os.open(part, flags, dir_fd=fd)
                except OSError as error:
                    shown = "/".join(parts[:index + 1])
                    if error.errno == errno.ENOTDIR and _is_link(part, fd):
                        raise UnsafeAgentFile(shown, "a symbolic link (not followed)") from None
                    raise _refusal(error, shown) from None
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open_regular(self, relative: str, limit: int, seen: Seen | None = None) -> int:
        fd = self._open(relative, directory=False)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise UnsafeAgentFile(relative, kind(info.st_mode))
        if info.st_size > limit:
            os.close(fd)
            raise UnsafeAgentFile(relative, f"{info.st_size} bytes, over the {limit}-byte cap")
        if seen is not None:  # the inode of the file opened, so no swap between look and read
            first = seen.setdefault((info.st_dev, info.st_ino), relative)
            if first != relative:
                os.close(fd)
                raise AlreadyRead(relative, first)
        return fd

    # --- reads (call these through `run`) ---------------------------------------------------

    def read(self, relative: str, limit: int, *, seen: Seen | None = None) -> bytes:
        """A whole regular file of at most `limit` bytes (`seen`: see `AlreadyRead`)."""
        return self.read_with_mode(relative, limit, seen=seen)[0]

    def read_with_mode(self, relative: str, limit: int, *, seen: Seen | None = None
                       ) -> tuple[bytes, int]:
        """`read`, and the permission bits of the very file read (taken from its open
        descriptor: never another file put in its place meanwhile)."""
        fd = self._open_regular(relative, limit, seen)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            chunks: list[bytes] = []  # joined once: linear in the file's size
            size = 0
            while size <= limit and (chunk := os.read(fd, 65536)):
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > limit:  # it grew after fstat
            raise UnsafeAgentFile(relative, f"over the {limit}-byte cap")
        return b"".join(chunks), mode

    def tail(self, relative: str, limit: int) -> bytes:
        """The last `limit` bytes of a regular file of any size."""
        fd = self._open(relative, directory=False)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeAgentFile(relative, kind(info.st_mode))
            return os.pread(fd, limit, max(0, info.st_size - limit))
        finally:
            os.close(fd)

    def chunks(self, relative: str, *, file_limit: int = ROLLOUT_FILE_LIMIT,
               seen: Seen | None = None) -> Iterator[bytes]:
        """A regular file's bytes, streamed in chunks of at most 64 KiB; stops at
        `file_limit` bytes even if the file grows while read."""
        fd = self._open_regular(relative, file_limit, seen)
        try:
            total = 0
            while total < file_limit and (chunk := os.read(fd, min(65536,
                                                                   file_limit - total))):
                total += len(chunk)
                yield chunk
        finally:
            os.close(fd)

    def lines(self, relative: str, *, line_limit: int = ROLLOUT_LINE_LIMIT,
              file_limit: int = ROLLOUT_FILE_LIMIT, seen: Seen | None = None
              ) -> Iterator[bytes | LongLine]:
        """A regular file's lines (without newlines), streamed; a line over the cap is a
        `LongLine`. Stops at `file_limit` bytes even if the file grows while read."""
        return split_lines(self.chunks(relative, file_limit=file_limit, seen=seen), line_limit)

    def lstat(self, relative: str) -> os.stat_result | None:
        """What a path is, its last component not followed (None: missing); a link or a
        non-folder on the way raises `UnsafeAgentFile`."""
        parent, _, name = relative.strip("/").rpartition("/")
        if name in ("", ".", ".."):
            raise UnsafeAgentFile(relative, "not a name in the folder")
        try:
            fd = self._open(parent, directory=True)
        except UnsafeAgentFile as error:
            if error.rule == "missing":
                return None
            raise
        try:
            with self._identity():
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise _refusal(error, relative) from None
        finally:
            os.close(fd)

    def listing(self, relative: str) -> Folder:
        """A folder's entries, none followed: at most `MAX_ENTRIES`."""
        fd = self._open(relative, directory=True)
        entries: dict[str, os.stat_result] = {}
        try:
            with self._identity(), os.scandir(fd) as found:
                for entry in found:
                    if len(entries) >= MAX_ENTRIES:
                        return Folder(entries, more=True)
                    with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                        entries[entry.name] = entry.stat(follow_symlinks=False)
        finally:
            os.close(fd)
        return Folder(entries)

    def xattr(self, relative: str, name: str) -> bytes | None:
        """A folder's extended attribute `name` (None: it has none)."""
        fd = self._open(relative, directory=True)
        try:
            return os.getxattr(fd, name)
        except OSError:  # absent, or not supported by the file system
            return None
        finally:
            os.close(fd)

    def find(self, relative: str, pattern: str) -> tuple[list[str], list[UnsafeAgentFile]]:
        """Regular files named like `pattern` under a folder, sorted, and what was refused
        on the way (symbolic links, FIFOs, devices). Links are never followed."""
        found: list[str] = []
        refused: list[UnsafeAgentFile] = []
        try:
            top = self._open(relative, directory=True)
        except UnsafeAgentFile as error:
            if error.rule != "missing":
                refused.append(error)
            return found, refused
        with self._identity():
            self._walk(top, relative.strip("/"), pattern, 0, found, refused)
        return sorted(found), refused

    def _walk(self, fd: int, shown: str, pattern: str, depth: int, found: list[str],
              refused: list[UnsafeAgentFile]) -> None:
        try:
            with os.scandir(fd) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_ENTRIES:
                        refused.append(UnsafeAgentFile(shown, f"over {MAX_ENTRIES} entries"))
                        break
                    if not is_text(entry.name):
                        refused.append(UnsafeAgentFile(f"{shown}/{as_text(entry.name)}",
                                                       "a name that is not UTF-8"))
                        continue
                    path = f"{shown}/{entry.name}"
                    try:
                        mode = entry.stat(follow_symlinks=False).st_mode
                    except OSError:  # gone meanwhile
                        continue
                    if stat.S_ISDIR(mode):
                        if depth >= MAX_DEPTH:
                            refused.append(UnsafeAgentFile(path, "nested too deep"))
                            continue
                        try:
                            child = os.open(entry.name, _OPEN_DIR, dir_fd=fd)
                        except OSError as error:
                            refused.append(_refusal(error, path))
                            continue
                        self._walk(child, path, pattern, depth + 1, found, refused)
                    elif fnmatch.fnmatch(entry.name, pattern):
                        if stat.S_ISREG(mode):
                            found.append(path)
                        else:
                            refused.append(UnsafeAgentFile(path, kind(mode)))
        finally:
            os.close(fd)

    # --- credentials ------------------------------------------------------------------------

    def _identity(self) -> contextlib.AbstractContextManager[None]:
        """Opens (where permissions are checked) run with the sandbox user's fs ids."""
        if self.uid is None or os.geteuid() != 0 or self.uid == 0:
            return contextlib.nullcontext()
        return _fs_identity(self.uid, self.gid if self.gid is not None else self.uid)


def split_lines(chunks: Iterable[bytes], line_limit: int = ROLLOUT_LINE_LIMIT
                ) -> Iterator[bytes | LongLine]:
    """The lines (without newlines) of a stream of chunks; a line over `line_limit` bytes is
    a `LongLine`, never held whole."""
    pending, skipping = bytearray(), 0
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            piece = chunk[start:end]
            if skipping or len(pending) + len(piece) > line_limit:
                yield LongLine(skipping + len(pending) + len(piece))
            else:
                yield bytes(pending + piece)
            pending.clear()
            skipping, start = 0, end + 1
        rest = chunk[start:]
        if skipping or len(pending) + len(rest) > line_limit:
            skipping += len(pending) + len(rest)
            pending.clear()
        else:
            pending += rest
    if skipping:
        yield LongLine(skipping)
    elif pending:
        yield bytes(pending)


@contextlib.contextmanager
def _fs_identity(uid: int, gid: int) -> Iterator[None]:
    """This thread's fs uid/gid for the block (the kernel drops the fs capabilities with
    them, and restores them when fs uid 0 comes back)."""
    c = libc()
    before_uid, before_gid = c.setfsuid(-1), c.setfsgid(-1)
    c.setfsgid(gid)
    c.setfsuid(uid)
    if c.setfsuid(-1) != uid or c.setfsgid(-1) != gid:
        c.setfsuid(before_uid)
        c.setfsgid(before_gid)
        raise PermissionError(f"cannot take fs uid {uid} for reading the agent's files")
    try:
        yield
    finally:
        c.setfsuid(before_uid)
        c.setfsgid(before_gid)
        if c.setfsuid(-1) != before_uid:  # never leave a thread with the agent's rights
            raise SystemExit("could not restore the fs uid after reading the agent's files")
