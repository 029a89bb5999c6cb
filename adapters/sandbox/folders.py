"""Session folders (SPEC §11): made, removed and swept so that none outlives its runner.

A session folder holds `config.toml` with grant tokens. It is recorded in a registry in the
runner's cache before it exists (so a sweep finds it wherever TMPDIR pointed), holds its
lock before anything else is written into it, and is removed lock-last (so a removal cut
short leaves a folder the next sweep knows is free). A runner sweeps at its start, and
`recover` sweeps too.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

from trialledger.adapters.places import default_cache_dir
from trialledger.adapters.sandbox.hostside import host_env, program

FOLDER_PREFIX = "trialledger-"
LOCK = ".session-lock"
STALE_S = 10.0


def folder_registry() -> Path:
    """Where a runner records each session folder it makes, wherever TMPDIR points: a file
    per folder named as it and holding its path, written before the folder exists and
    removed once it is gone — so the sweep (a runner's start, `recover`) finds every one."""
    return default_cache_dir() / "session-folders"


def make_session_folder(session_key: str) -> tuple[Path, int]:
    """A new session folder (0700, in TMPDIR), recorded first and holding its lock before
    anything else is in it: (the folder, the lock's descriptor, held)."""
    registry = folder_registry()
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    parent = Path(tempfile.gettempdir())
    while True:
        root = parent / f"{FOLDER_PREFIX}{session_key[:8]}-{secrets.token_hex(4)}"
        try:
            entry = os.open(registry / root.name,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        try:
            os.write(entry, os.fsencode(root))
        finally:
            os.close(entry)
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            (registry / root.name).unlink(missing_ok=True)
            continue
        break
    try:
        lock = take_lock(root, LOCK)
    except BaseException:
        remove_lock_last(root)
        forget_session_folder(root)
        raise
    return root, lock


# A tree at most this deep and with at most this many entries is removed in-process (no
# process start, which a session's start and end pay a few times); anything bigger goes
# to `rm`, which walks without recursion.
IN_PROCESS_DEPTH = 32
IN_PROCESS_ENTRIES = 4096
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(*paths: str | Path, dir_fd: int | None = None) -> None:
    """Remove folders the agent could write, whole, never following a link and never
    leaving the file system each starts on: small ones in-process, the rest with GNU `rm
    -rf --one-file-system`, which walks without recursion — an agent's tree can be nested
    deeper than Python's recursion limit (`shutil.rmtree` recurses per level on 3.11).
    With `dir_fd`, each path is a name in that folder."""
    budget = [IN_PROCESS_ENTRIES]
    left = [p for p in paths if not _removed_in_process(str(p), dir_fd, budget)]
    if not left:
        return
    targets = [str(p) if dir_fd is None else f"/proc/self/fd/{dir_fd}/{p}" for p in left]
    done = subprocess.run([program("rm"), "-rf", "--one-file-system", "--", *targets],
                          env=host_env(), pass_fds=() if dir_fd is None else (dir_fd,),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"rm -rf: {done.stderr.strip()[-300:]}")


def _removed_in_process(path: str, dir_fd: int | None, budget: list[int]) -> bool:
    """Whether `path` (a folder, a link or a file; gone already counts) was removed here;
    False leaves whatever is still there to `rm` (too deep, too many entries, another
    file system below, or any error)."""
    try:
        top = os.open(path, _OPEN_DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:  # not a folder (a link, a file), or unreadable: `rm` says which
        return False
    try:
        if not _emptied(top, os.fstat(top).st_dev, 1, budget):
            return False
    except OSError:
        return False
    finally:
        os.close(top)
    try:
        os.rmdir(path, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def _emptied(folder: int, device: int, depth: int, budget: list[int]) -> bool:
    """Remove everything in the open `folder`; False once a bound is reached or a folder
    on another file system is met (what is left stays)."""
    with os.scandir(folder) as entries:  # never read whole: at most the budget, and one
        names = [(entry.name, entry.is_dir(follow_symlinks=False))  # more to see it is past
                 for entry in itertools.islice(entries, max(budget[0], 0) + 1)]
    if len(names) > budget[0]:
        return False
    for name, is_folder in names:
        budget[0] -= 1
        if budget[0] < 0:  # (the folders below took the rest)
            return False
        if not is_folder:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
            continue
        if depth >= IN_PROCESS_DEPTH:
            return False
        child = os.open(name, _OPEN_DIR, dir_fd=folder)
        try:
            if os.fstat(child).st_dev != device or not _emptied(child, device, depth + 1,
                                                                 budget):
                return False
        finally:
            os.close(child)
        os.rmdir(name, dir_fd=folder)
    return True


def remove_lock_last(root: Path) -> None:
    """Remove a session folder, its lock file last and only once all else is gone: a
    removal cut short leaves the lock (free once its runner is gone) or an empty folder."""
    folders = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if entry.name == LOCK:
                continue
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        remove_tree(*folders)  # (at most one `rm` for them all)
    with contextlib.suppress(OSError):
        if {name for name in os.listdir(root)} <= {LOCK}:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root / LOCK)
            root.rmdir()


def take_lock(folder: Path, name: str) -> int:
    """A new lock file `name` in `folder`, held (its descriptor): made and locked under a
    name of its own, then renamed into place, so a sweep never finds it there and free — it
    would take a folder just being made for a killed run's (`lock_held`)."""
    scratch = folder / f"{name}.{secrets.token_hex(4)}"
    fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(scratch, folder / name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
    return fd


def lock_held(lock: Path) -> bool | None:
    """Whether some process holds the file lock `lock` (a runner, for what it made); None
    when there is no such file. Never follows a link."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def forget_session_folder(root: Path) -> None:
    """Drop a folder's registry entry (once the folder is gone)."""
    with contextlib.suppress(OSError):
        if not root.exists() and not root.is_symlink():
            (folder_registry() / root.name).unlink(missing_ok=True)


def _sweep_folder(folder: Path, *, recorded: bool) -> bool:
    """Remove a session folder no session holds; whether it was removed. A folder without
    its lock counts only when recorded (so ours) and at least `STALE_S` old."""
    try:
        if folder.is_symlink() or not folder.is_dir():
            return False
        lock = os.open(folder / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            if not recorded or time.time() - folder.lstat().st_mtime < STALE_S:
                return False
        except OSError:
            return False
        remove_lock_last(folder)  # (no lock to keep: the folder goes whole)
        return True
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return False  # a live session
    try:
        from trialledger.adapters.sandbox.runc import delete_left  # (runc's state there)

        delete_left(folder)
        remove_lock_last(folder)  # holding the lock: no other sweep takes it meanwhile
    finally:
        os.close(lock)
    return True


def _recorded_folders(within: Path | None) -> list[tuple[Path, Path]]:
    """The registry's (entry, folder) pairs, of folders in `within` if given."""
    registry = folder_registry()
    found = []
    with contextlib.suppress(OSError):
        for entry in registry.iterdir():
            try:
                folder = Path(os.fsdecode(entry.read_bytes()))
            except OSError:
                continue
            if (folder.is_absolute() and folder.name == entry.name
                    and folder.name.startswith(FOLDER_PREFIX)
                    and (within is None or folder.parent == within)):
                found.append((entry, folder))
    return found


def sweep_stale_sessions(parent: Path | None = None) -> int:
    """Remove session folders whose runner is gone; how many. Those the registry records
    (wherever TMPDIR pointed; with `parent`, only those in it) and, made before the
    registry, those in `parent` (default: TMPDIR) with a free lock."""
    removed = 0
    for entry, folder in _recorded_folders(parent):
        if folder.exists() or folder.is_symlink():
            if not _sweep_folder(folder, recorded=True):
                continue
            removed += 1
        else:
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime < STALE_S:
                    continue  # a folder about to be made
        if not folder.exists():
            entry.unlink(missing_ok=True)
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        removed += _sweep_folder(folder, recorded=False)
    return removed
