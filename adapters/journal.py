"""The evidence journal (SPEC §8 "Delivery"): what a runner captured but the store has not
yet taken, kept on the runner's own disk until the store takes it.

One file per session, `<session id>.jsonl` in the runner's journal folder (0700, the
runner's uid, in its cache: never mounted into a sandbox). Its first line names the head
the session's log had when an append first failed; each further line is one append (a
batch, all or nothing), scrubbed and fsynced before the runner goes on. It is delivered in
order — by its runner when the store returns, else by `recover` or a job's next holder on
the same machine — and removed once the store holds all of it. A batch whose append failed
may still have committed (its answer lost): delivery skips what the log already holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trialledger.adapters.environment import default_cache_dir
from trialledger.core.errors import TrialLedgerError
from trialledger.core.parsing import parse_events
from trialledger.core.redact import scrub_data
from trialledger.store import Ledger, StoredEvent
from trialledger.store.ledger import Deliver
from trialledger.store.writer import Fence, now

Batch = list[dict[str, Any]]


class JournalRefused(TrialLedgerError):
    """A journal folder or file that is not this user's own (a link, another owner, open
    to others): never read, never written."""


def journal_dir() -> Path:
    """The runner's journal folder, in its own cache (wherever TMPDIR points)."""
    return default_cache_dir() / "journals"


def journal_path(session_id: str) -> Path:
    """Where a session's journal lives on this machine."""
    return journal_dir() / f"{session_id}.jsonl"


def journal_record(session_id: str) -> dict[str, str]:
    """`agent.launched.journal` (schema 4): this machine and the journal's path."""
    return {"host": socket.gethostname(), "path": str(journal_path(session_id))}


def _own_folder() -> Path:
    folder = journal_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise JournalRefused(f"{folder} is not a folder of this user: no journal is kept there")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


class Journal:
    """One session's journal, as its runner writes it."""

    def __init__(self, session_id: str, secrets: Sequence[str] = ()) -> None:
        self.session_id = session_id
        self.path = journal_path(session_id)
        self.secrets = tuple(secrets)
        self.pending = False  # it holds batches the store has not been seen to take

    def begin(self, after_seq: int) -> None:
        """Start the journal: the store's head (`after_seq`) before the first failed append."""
        _own_folder()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _line({"session_id": self.session_id, "after_seq": after_seq}))
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.pending = True

    def add(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Append one batch (scrubbed), on disk before this returns."""
        batch = [scrub_data(dict(event), self.secrets) for event in events]
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, _line({"events": batch}))
            os.fsync(fd)
        finally:
            os.close(fd)

    def delivered(self) -> None:
        """The store holds all of it: the file goes."""
        self.pending = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _line(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def read_journal(path: Path) -> tuple[int, list[Batch]] | None:
    """A journal's head and batches, or None when there is none. A last line cut short (a
    crash while writing it) was never acknowledged to anyone: it is left out."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                or info.st_mode & 0o077):
            raise JournalRefused(f"journal {path} is not this user's own 0600 file")
        lines = handle.read().split(b"\n")
    try:
        header = json.loads(lines[0])
        after_seq = int(header["after_seq"])
    except (ValueError, KeyError, TypeError):
        return None  # cut before its header was whole: nothing in it was written
    batches: list[Batch] = []
    for raw in lines[1:]:
        try:
            batches.append(list(json.loads(raw)["events"]))
        except (ValueError, KeyError, TypeError):
            break
    return after_seq, batches


def _undelivered(stored: Sequence[StoredEvent], batches: Sequence[Batch]) -> list[Batch]:
    """The batches the log does not hold yet: the log after the journal's head holds a
    prefix of them (in order, with the machine's decisions between)."""
    ours = [(e.type, e.at) for e in (s.event for s in stored) if e.type != "outcome.decided"]
    taken = 0
    for count, batch in enumerate(batches):
        keys = [(e.type, e.at) for e in parse_events(batch)]
        if ours[taken:taken + len(keys)] != keys:
            return list(batches[count:])
        taken += len(keys)
    return []


async def deliver_journal(ledger: Ledger, session_id: str, path: Path, *,
                          fence: Fence | None = None) -> list[StoredEvent] | None:
    """Append what a journal holds and the store does not, in order, then remove it;
    return the session's stored events after the journal's head (None: no journal)."""
    found = read_journal(path)
    if found is None:
        return None
    after_seq, batches = found
    stored = await ledger.events(session_id, after_seq=after_seq)
    head = stored[-1].event.seq or after_seq if stored else after_seq
    for batch in _undelivered(stored, batches):
        got = await ledger.append(session_id, batch, expected_seq=head, fence=fence)
        stored += got
        head = got[-1].event.seq or head
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return stored


def delivery(ledger: Ledger) -> Deliver:
    """For `recover` and a job's next holder: before a session is closed out, its journal
    is delivered (on this machine), or — kept on another machine, or not readable here —
    gap `evidence_undelivered` is recorded and the session closed `recovered` without a
    decision from part of its evidence. Returns the session's state after."""

    async def deliver(session_id: str, fence: Fence | None) -> str:
        recorded = await _recorded_journal(ledger, session_id) or {}
        host, path = recorded.get("host"), Path(recorded.get("path") or "")
        if host in (None, socket.gethostname()):
            if path.name != f"{session_id}.jsonl":
                path = journal_path(session_id)
            try:
                await deliver_journal(ledger, session_id, path, fence=fence)
            except JournalRefused as error:
                why = str(error)
            else:
                rows = await ledger.sessions(session_id=session_id)
                return str(rows[0]["state"]) if rows else "closed"
        else:
            why = f"the journal {path} is on {host}, not on this machine"
        await ledger.append(session_id, [
            {"type": "gap.recorded", "at": now(),
             "data": {"code": "evidence_undelivered", "detail": why}},
            {"type": "session.closed", "at": now(), "data": {"reason": "recovered"}}],
            fence=fence)
        return "closed"

    return deliver


async def _recorded_journal(ledger: Ledger, session_id: str) -> dict[str, str] | None:
    """`agent.launched.journal` of the session, if stored."""
    for stored in await ledger.events(session_id):
        if stored.event.type == "agent.launched":
            journal = getattr(stored.event.data, "journal", None)
            return dict(journal) if journal else None
    return None
