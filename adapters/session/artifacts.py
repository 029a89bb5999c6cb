"""The session's artifact folder (SPEC §15, "What is kept"): where it is, and reading back
what a verification event lists in it.

The folder is `<sandbox_logs_dir>/<session>` when the session's settings name
`sandbox_logs_dir`, else `<cache>/artifacts/<session>`, where `<cache>` is the default
cache folder (`$XDG_CACHE_HOME/trialledger`, else `~/.cache/trialledger`;
`places.default_cache_dir`). Only the machine that ran the session has it. Reading
back trusts nothing on disk: a path must be one the event lists, is opened without
following any link, and its bytes must still have the event's sha256.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from trialledger.adapters.places import default_cache_dir
from trialledger.adapters.sandbox.agentfiles import AgentTree, UnsafeAgentFile
from trialledger.adapters.session.capture import MAX_KEPT_BYTES, write_private
from trialledger.core.errors import TrialLedgerError
from trialledger.core.events import KeptFile

VERIFIER = "verifier"  # the verifier's files, in the folder


class ArtifactRefused(TrialLedgerError):
    """A kept file that cannot be given back: not listed, a link, or changed since."""


def session_folder(sandbox_logs_dir: str | None, session_id: str) -> Path:
    """The session's artifact folder (which may not exist on this machine)."""
    root = Path(sandbox_logs_dir) if sandbox_logs_dir else default_cache_dir() / "artifacts"
    return root / session_id


def on_this_machine(folder: Path, session_id: str) -> bool:
    """Whether `folder` is an artifact folder the runner made here: a session id that is
    one plain name (an imported log's may be `/etc` or `../..`), and a real folder, no
    link, of this user's, no one else's to read (0700, as the runner makes it) — so a log
    cannot point the readers at another folder of the host."""
    if session_id in ("", ".", "..") or "/" in session_id or "\0" in session_id:
        return False
    try:
        info = os.lstat(folder)
    except (OSError, ValueError):
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and info.st_mode & 0o077 == 0)


def listed(files: Sequence[KeptFile], path: str) -> KeptFile:
    """The entry of `path` (as listed, `verifier/…`), or `ArtifactRefused`."""
    wanted = path.strip("/")
    for entry in files:
        if entry.path == wanted:
            return entry
    raise ArtifactRefused(f"{path}: not a file the session kept (see `trialledger "
                          f"artifacts SESSION` for the list)")


def read_kept(folder: Path, entry: KeptFile) -> bytes:
    """The bytes of a kept file, opened without following links (regular files only),
    refused when they no longer have the sha256 the event records."""
    changed = ArtifactRefused(f"{entry.path}: changed since it was kept (its sha256 is not "
                              f"the recorded one)")
    if entry.size > MAX_KEPT_BYTES:  # no file was kept so large: an imported log's claim
        raise changed
    try:
        data = AgentTree(folder).read(entry.path, entry.size)
    except UnsafeAgentFile as error:
        if error.rule.endswith("-byte cap"):  # longer than it was kept
            raise changed from None
        raise ArtifactRefused(f"{entry.path}: {error.rule}") from None
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise changed
    return data


def copy_kept(folder: Path, files: Sequence[KeptFile], out: Path) -> list[Path]:
    """Each kept file, checked as `read_kept` checks it, copied under `out` (files 0600,
    new folders 0700, as kept); the copies written. Every file is checked first, so a
    refusal copies nothing."""
    contents = [(entry, read_kept(folder, entry)) for entry in files]
    for entry, data in contents:
        write_private(out / entry.path, data)
    return [out / entry.path for entry, _ in contents]
