"""The evidence journal's file format and its integrity (SPEC §8, "the journal's integrity").

Format 2: a header `{"format": 2, "session_id", "after_seq"}`, then one line per batch
`{"n": its place in the session's journal, 1 on, "sha256": of its events, "events": [...]}`.
A line that fails its check, a cut line, a header that is not this session's, or batches
missing from the sequence are never delivered and never silently dropped: gap
`evidence_damaged` {detail: the line numbers} takes their place, the good lines around them
are delivered, and the file is kept as `<name>.damaged` until `recover --purge-damaged`.
Format 1 (a header without `format`, lines `{"events": [...]}`) is read as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trialledger.core.canonical import NS
from trialledger.core.errors import TrialLedgerError
from trialledger.core.parsing import parse_events
from trialledger.store import StoredEvent
from trialledger.store.writer import now

FORMAT = 2
DAMAGED = ".damaged"
Batch = list[dict[str, Any]]


class JournalRefused(TrialLedgerError):
    """A journal folder or file that is not this user's own (a link, another owner, open
    to others): never read, never written."""


def digest(batch: Sequence[Any]) -> str:
    """A batch's sha256, over its canonical JSON (keys sorted): what a line's check is."""
    text = json.dumps(batch, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Damage:
    """Consecutive lines that cannot be delivered (1-based line numbers), and why."""

    lines: list[int] = field(default_factory=list)
    why: list[str] = field(default_factory=list)


@dataclass
class JournalRead:
    """A journal as read: its head (None: its header is damaged), format, and in order its
    good batches and damaged parts."""

    after_seq: int | None
    format: int
    items: list[Batch | Damage] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        """Whether any of it is damaged."""
        return any(isinstance(item, Damage) for item in self.items)

    def batches(self) -> list[Batch]:
        return [item for item in self.items if not isinstance(item, Damage)]

    def damage(self, line: int | None, why: str) -> None:
        """Line `line` (None: lines missing, not one there) is damaged, for `why`."""
        if not (self.items and isinstance(last := self.items[-1], Damage)):
            self.items.append(last := Damage())
        if line is not None:
            last.lines.append(line)
        if why not in last.why:
            last.why.append(why)


def read_journal(path: Path, session_id: str | None = None) -> JournalRead | None:
    """A journal's head, batches and damage, or None when there is none."""
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
    if lines[-1] == b"":  # the newline that ends the last line (or an empty file)
        lines.pop()
    session_id = session_id or path.name.removesuffix(".jsonl")
    found = _header(lines[0], session_id) if lines else JournalRead(0, FORMAT)
    if found is None:
        found = JournalRead(None, 0)  # each line read in its own format
        found.damage(1, "a header that is not this session's journal's")
    expected = 1  # the next batch's place (format 2)
    for number, raw in enumerate(lines[1:], start=2):
        try:
            obj = json.loads(raw)
            if found.format == 1 or (found.format == 0 and "sha256" not in obj):
                found.items.append(list(obj["events"]))  # format 1: no check to make
                continue
            batch, place = list(obj["events"]), int(obj["n"])
            if digest(batch) != obj["sha256"]:
                raise ValueError("its sha256 does not match")
        except (ValueError, KeyError, TypeError) as error:
            why = str(error) if "sha256" in str(error) else "cut or not a journal line"
            found.damage(number, why)
            expected += 1
            continue
        if place < expected:
            found.damage(number, f"batch {place} out of sequence")
            continue
        if place > expected:
            found.damage(None, f"batch(es) {expected}-{place - 1} missing before line "
                               f"{number}")
        found.items.append(batch)
        expected = place + 1
    return found


def _header(raw: bytes, session_id: str) -> JournalRead | None:
    try:
        header = json.loads(raw)
        version, after_seq = int(header.get("format", 1)), int(header["after_seq"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if header.get("session_id") != session_id or version not in (1, FORMAT) or after_seq < 0:
        return None
    return JournalRead(after_seq, version)


def already_stored(stored: Sequence[StoredEvent], found: JournalRead) -> int:
    """How many of a journal's first batches the log after its head holds already (in
    order, with the machine's decisions between: matched by type and time) — for format 1
    and events without ids; a runner's format-2 events carry ids, so appending them again
    is a no-op anyway. (A journal whose header is damaged: none.)"""
    if found.after_seq is None:
        return 0
    ours = [(e.type, e.at) for e in (s.event for s in stored) if e.type != "outcome.decided"]
    taken = 0
    for count, batch in enumerate(found.batches()):
        keys = [(e.type, e.at) for e in parse_events(batch)]
        if ours[taken:taken + len(keys)] != keys:
            return count
        taken += len(keys)
    return len(found.batches())


def damaged_gap(session_id: str, path: Path, damage: Damage) -> dict[str, Any]:
    """Gap `evidence_damaged` in place of damaged lines; its id is fixed by them, so a
    delivery tried again stores it once."""
    lines = ", ".join(str(n) for n in damage.lines) or "none"
    name = uuid.uuid5(NS, f"{session_id}:{path.name}:evidence_damaged:{lines}")
    return {"type": "gap.recorded", "at": now(), "event_id": str(name), "data": {
        "code": "evidence_damaged",
        "detail": (f"journal {path} line(s) {lines} not delivered "
                   f"({'; '.join(damage.why)}); the file is kept as {path.name}{DAMAGED}"
                   )[:2000]}}


def keep_damaged(path: Path) -> Path:
    """A delivered journal that had damage, renamed `<name>.damaged` (never over another)."""
    target, count = path.with_name(path.name + DAMAGED), 1
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}.{count}{DAMAGED}")
    os.rename(path, target)
    return target


def purge_damaged(folder: Path) -> int:
    """Remove the kept damaged journals in `folder` (only this user's own files, never
    through a link); how many."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for path in folder.iterdir():
            if not path.name.endswith(DAMAGED):
                continue
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                path.unlink()
                removed += 1
    return removed
