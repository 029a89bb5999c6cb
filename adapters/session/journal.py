"""The evidence journal (SPEC §8 "Delivery"): what a runner captured but the store has not
yet taken, kept on the runner's own disk until the store takes it.

One file per session, `<session id>.jsonl` in the runner's journal folder (0700, the
runner's uid, in its cache: never mounted into a sandbox). Its first line names the head
the session's log had when an append first failed; each further line is one append (a
batch, all or nothing), scrubbed and fsynced before the runner goes on. It is delivered in
order — by its runner when the store returns, else by `recover` or a job's next holder on
the same machine — and removed once the store holds all of it. A batch whose append failed
may still have committed (its answer lost, or abandoned): its events carry their ids, so
delivering it again is a no-op (SPEC §2). Lines carry their place and sha256; a damaged
part becomes a gap (the format and its checks: journalfile.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trialledger.adapters.places import default_cache_dir
from trialledger.adapters.session.journalfile import (
    FORMAT,
    Batch,
    Damage,
    JournalRefused,
    already_stored,
    damaged_gap,
    digest,
    keep_damaged,
    read_journal,
)
from trialledger.core.errors import ConcurrencyConflict, EventIdConflict
from trialledger.core.redact import scrub_data
from trialledger.store import Ledger, StoredEvent
from trialledger.store.ledger import Deliver
from trialledger.store.writer import Fence, now

__all__ = ["Batch", "Journal", "JournalRefused", "deliver_journal", "delivery",
           "journal_dir", "journal_path", "journal_record", "read_journal"]


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
        self.batches = 0  # lines written after its header: the next one's `n` follows

    def begin(self, after_seq: int) -> None:
        """Start the journal: the store's head (`after_seq`) before the first failed append."""
        _own_folder()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _line({"format": FORMAT, "session_id": self.session_id,
                                "after_seq": after_seq}))
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.pending, self.batches = True, 0

    def add(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Append one batch (scrubbed), with its place and sha256, on disk before this
        returns."""
        batch = [scrub_data(dict(event), self.secrets) for event in events]
        line = _line({"n": self.batches + 1, "sha256": digest(batch), "events": batch})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, "the journal line was written only in part")
            os.fsync(fd)
        finally:
            os.close(fd)
        self.batches += 1

    def delivered(self) -> None:
        """The store holds all of it: the file goes."""
        self.pending = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _line(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def deliver_journal(ledger: Ledger, session_id: str, path: Path, *,
                          fence: Fence | None = None) -> list[StoredEvent] | None:
    """Append what a journal holds and the store does not, in order — a damaged part as
    gap `evidence_damaged` in its place — then remove it (a damaged one is kept, renamed
    `.damaged`); return the session's stored events after its head (None: no journal)."""
    found = read_journal(path, session_id)
    if found is None:
        return None
    stored = await ledger.events(session_id, after_seq=found.after_seq or 0)
    head = (stored[-1].event.seq or 0) if stored else (found.after_seq or 0)
    skip = already_stored(stored, found)
    for item in found.items:
        if isinstance(item, Damage):
            events = [damaged_gap(session_id, path, item)]
        elif skip:
            skip -= 1
            continue
        else:
            events = item
        got = await _append(ledger, session_id, events, head, fence)
        stored += got
        head = max([head, *(s.event.seq or 0 for s in got)])
    if found.damaged:
        keep_damaged(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return stored


async def _append(ledger: Ledger, session_id: str, events: Batch, head: int,
                  fence: Fence | None) -> list[StoredEvent]:
    """One journalled batch appended after `head`. A batch whose events all carry their
    ids is idempotent (SPEC §2): the log moving on meanwhile (an abandoned append that did
    commit) is followed, once; a damage gap stored before is stored already."""
    try:
        return await ledger.append(session_id, events, expected_seq=head, fence=fence)
    except EventIdConflict:
        if events[0].get("type") == "gap.recorded":  # the same gap, from an earlier delivery
            return []
        raise
    except ConcurrencyConflict:
        if not all(e.get("event_id") for e in events):
            raise
        later = await ledger.events(session_id, after_seq=head)
        head = (later[-1].event.seq or head) if later else head
        return later + await ledger.append(session_id, events, expected_seq=head, fence=fence)


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
