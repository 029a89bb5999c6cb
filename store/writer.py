"""The single writer behind a `Ledger`: group commit over folded open sessions.

Appends from concurrent callers are **group-committed** (`group.py`): whoever finds no
commit in flight commits everything queued so far in one transaction, while each caller
awaits its own result. Open sessions stay folded in memory (so an append never re-reads history).
A commit folds its batch before it takes the writers' lock, while other processes write
theirs; under the lock it compares the log's last position with the last one this writer
wrote, forgets any session another process appended to since, and folds the batch again
if what it folded moved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
from sqlalchemy import Connection, delete, func, select, text

from trialledger.core import Event, TrialLedgerError
from trialledger.core.canonical import GENESIS, canonical_text, chain_hash
from trialledger.core.errors import ConcurrencyConflict, EventIdConflict
from trialledger.core.machine import Session
from trialledger.core.parsing import event_dict, parse_stored
from trialledger.store.engine import Engines
from trialledger.store.errors import LeaseLost as LeaseLost  # raised here before
from trialledger.store.group import GroupCommit, Waiter
from trialledger.store.log import (
    CATCH_UP_PG,
    CATCH_UP_ROWS,
    EVENT_COLUMNS,
    EVENTS,
    EVENTS_AND_SESSIONS_PG,
    MOVED_SINCE_SQLITE,
    columns,
    in_slices,
)
from trialledger.store.projections import SESSION_CHANGES, TABLE_OF, TABLES, Changes, Projected


def now() -> str:
    """The current time as an RFC 3339 UTC timestamp with microseconds."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class StoredEvent:
    """An event as the store holds it: the event plus its global position, time and hash.

    (Mutable only so the store can fill in `position` when its insert returns.)
    """

    event: Event
    position: int
    recorded_at: str
    hash: str
    canonical: str = field(default="", repr=False, compare=False)  # the stored text

    def jsonl(self) -> dict[str, Any]:
        """The export form: every field of the event and of the store."""
        return {**event_dict(self.event), "position": self.position,
                "recorded_at": self.recorded_at, "hash": self.hash}

    @classmethod
    def from_row(cls, position: int, recorded_at: str, digest: str, data: str) -> StoredEvent:
        """A stored row back as an event (its canonical text parsed)."""
        return cls(parse_stored(data), position, recorded_at, digest)


@dataclass
class OpenSession:
    """A folded open session and what the store keeps beside it.

    Its stored events are not kept (the session's fold holds the events, and the ids say
    where each is): every object cached per event is one more for each of the garbage
    collector's full passes to walk, and an idempotent repeat, the only reader, is rare.
    """

    session: Session
    head_hash: str = GENESIS
    ids: dict[str, int] = field(default_factory=dict)  # event_id → seq
    projected: Projected = field(default_factory=Projected)
    fresh: list[StoredEvent] = field(default_factory=list)  # appended in the commit under way

    def remember(self, event: Event, digest: str) -> None:
        assert event.event_id is not None and event.seq is not None  # numbered events
        self.ids[event.event_id] = event.seq
        self.head_hash = digest


@dataclass
class Moved:
    """What other processes appended since a writer last looked."""

    sessions: set[str]
    ids: set[str] | None  # the event ids they stored (None: not known, any may be)

    def took_any(self, ids: Iterable[str | None]) -> bool:
        """Whether another process stored one of `ids` (the ones given) meanwhile."""
        given = (i for i in ids if i)
        return any(given) if self.ids is None else any(i in self.ids for i in given)


Rendered = tuple[list[StoredEvent], Changes]  # a batch's events to insert, and its rows
Prepared = tuple[Rendered, dict[str, str] | None]  # … and the fenced trials' leases it saw
Fence = tuple[str, str]  # (trial_id, lease token): appends only while the lease is this one


@dataclass(eq=False)
class Request(Waiter):
    """One caller's append, waiting for the commit that carries it."""

    session_id: str
    events: list[Event]
    expected_seq: int | None
    secrets: tuple[str, ...] | None = None  # set when the request seeds the session
    new_id: bool = False  # the session id was just made up: nothing to load
    folded: Session | None = None  # a whole log the machine just folded, decisions derived
    fence: Fence | None = None  # a job trial's lease, checked in the commit's transaction
    result: list[StoredEvent] | None = None


def _same_content(a: Event, b: Event) -> bool:
    keys = {"type", "at", "data", "schema_"}
    return a.model_dump(include=keys) == b.model_dump(include=keys)


def _folded_as_reloaded(session: Session) -> bool:
    """Whether `session` has the policy a fold of its stored log gives (the seed's, else
    v1): an import re-derives a log without one under its recorded decisions' policy."""
    seed = session.seed
    named = seed.data.settings.policy if seed is not None else None
    return session.policy.name == (named or "v1")


class Writer:
    """Commits appends, keeps open sessions folded, and writes their projection rows."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.open: dict[str, OpenSession] = {}
        self.secrets: dict[str, tuple[str, ...]] = {}
        self.queue: GroupCommit[Request] = GroupCommit(self._commit)
        self._lock = anyio.Lock()  # held by `rebuild` against concurrent commits
        self._last_position: int | None = None  # the log's end after our last commit
        self._insert_event = engines.driver_sql("events", EVENT_COLUMNS)
        self._postgres = engines.dialect == "postgresql"

    async def submit(self, request: Request) -> list[StoredEvent]:
        """Queue an append and wait for the commit that carries it (`GroupCommit`)."""
        await self.queue.submit(request)
        assert request.result is not None
        return request.result

    async def _commit(self, batch: list[Request]) -> None:
        touched: dict[str, OpenSession] = {}
        try:
            await self.engines.prepared_transaction(
                lambda conn: self._prepare(conn, batch, touched),
                lambda conn, prepared: self._finish(conn, batch, touched, prepared))
        except BaseException as error:
            for sid in touched:  # their in-memory folds hold what was not committed
                self.open.pop(sid, None)
            self._last_position = None
            for request in batch:
                if request.error is None:
                    request.error, request.result = error, None
            if not isinstance(error, Exception):
                raise
        finally:
            for request in batch:
                request.done = True
        for sid, open_ in touched.items():
            open_.fresh = []
            if open_.session.state == "closed":
                self.open.pop(sid, None)
                self.secrets.pop(sid, None)

    def _prepare(self, conn: Connection, batch: list[Request],
                 touched: dict[str, OpenSession]) -> Prepared:
        """Fold, hash and render the batch before the writers' lock, while other processes
        commit theirs. (What moved since our last commit is asked once, under the lock.)"""
        held = self._fold(conn, batch, touched, catch_up=self._last_position is None)
        return self._render(touched), held

    def _finish(self, conn: Connection, batch: list[Request],
                touched: dict[str, OpenSession], prepared: Prepared) -> None:
        """Under the writers' lock: if another process appended meanwhile to a session the
        batch touched, or stored an event under an id the batch gives, or (SQLite,
        where the fold read an earlier snapshot) a fenced trial's lease changed hands, fold
        the batch again here; then write it."""
        rendered, held = prepared
        moved = self._catch_up(conn, len(rendered[0]))
        sequence_kept = True
        if moved.sessions & touched.keys() or moved.took_any(
                e.event_id for r in batch for e in r.events) or (
                held is not None and not self._postgres and self._leases(conn, batch) != held):
            sequence_kept = False  # the batch folded again may hold more events
            for sid in touched:
                self.open.pop(sid, None)
            touched.clear()
            for request in batch:
                request.result = request.error = None
            self._fold(conn, batch, touched)
            rendered = self._render(touched)
        self._write(conn, rendered, sequence_kept=sequence_kept)

    def _fold(self, conn: Connection, batch: list[Request],
              touched: dict[str, OpenSession], *, catch_up: bool = True
              ) -> dict[str, str] | None:
        """Apply each request to its folded session, in memory (a failed one keeps its
        error and leaves its session as it was); return the fenced trials' leases as read
        (None: no request is fenced)."""
        if catch_up:
            self._catch_up(conn)
        self._load_missing(conn, batch)
        foreign = self._foreign_ids(conn, batch)
        held = self._leases(conn, batch)
        recorded_at = now()
        for request in batch:
            try:
                if request.fence is not None and held.get(request.fence[0]) != \
                        request.fence[1]:
                    raise LeaseLost(f"trial {request.fence[0]} is no longer held by "
                                    f"this runner (its lease was taken over)")
                request.result = self._apply(conn, request, recorded_at, foreign, touched)
            except TrialLedgerError as error:
                request.error = error
        return held if any(r.fence is not None for r in batch) else None

    def _catch_up(self, conn: Connection, positions: int = 0) -> Moved:
        """Forget every cached session another process appended to since our last commit
        (or look); say which, and which event ids it stored. Past `CATCH_UP_ROWS` events
        (a writer idle while others wrote on) it reads none of them and forgets every
        cached session instead. (PostgreSQL, optimistic: also keep the position sequence
        past the `positions` about to be given.)"""
        last, moved = self._last_position, None
        if self._postgres and last is not None:  # one round trip
            end, sessions, ids, _ = conn.exec_driver_sql(
                CATCH_UP_PG, (last, positions, CATCH_UP_ROWS)).one()
            end = end or 0
            if end - last <= CATCH_UP_ROWS:
                moved = Moved(set(sessions or ()), set(ids or ()))
        else:
            end = conn.execute(select(func.max(EVENTS.c.position))).scalar() or 0
            if end == last:
                return Moved(set(), set())
            if last is not None and end - last <= CATCH_UP_ROWS:
                rows = conn.exec_driver_sql(MOVED_SINCE_SQLITE, (last,)).all()
                moved = Moved({sid for sid, _ in rows}, {eid for _, eid in rows})
        if moved is None:  # never looked, or too much moved to list: anything may have
            moved = Moved(set(self.open), None)
            self.open.clear()
        for sid in moved.sessions:
            self.open.pop(sid, None)
        self._last_position = end
        return moved

    def _load_missing(self, conn: Connection, batch: list[Request]) -> None:
        missing = list({r.session_id: None for r in batch
                        if r.session_id not in self.open and not r.new_id})
        if not missing:
            return
        rows: list[Any] = []
        for part in in_slices(missing):
            rows += conn.execute(
                select(EVENTS.c.session_id, EVENTS.c.hash, EVENTS.c.data)
                .where(EVENTS.c.session_id.in_(part))
                .order_by(EVENTS.c.session_id, EVENTS.c.seq)).all()
        for sid, digest, data in rows:
            open_ = self.open.get(sid) or self.open.setdefault(
                sid, OpenSession(Session(sid)))
            event = parse_stored(data)
            open_.session.load(event)
            open_.projected.tools.feed(event)
            open_.remember(event, digest)
        for known in (self.open.get(sid) for sid in missing):
            if known is not None:
                known.projected.gaps_at = known.session.transition_seq

    @staticmethod
    def load(conn: Connection, session_id: str) -> OpenSession:
        """A session folded from its stored log (for rebuilding)."""
        rows = conn.execute(
            select(EVENTS.c.hash, EVENTS.c.data)
            .where(EVENTS.c.session_id == session_id).order_by(EVENTS.c.seq))
        open_ = OpenSession(Session(session_id))
        for digest, data in rows.all():
            event = parse_stored(data)
            open_.session.load(event)
            open_.remember(event, digest)
        return open_

    def _leases(self, conn: Connection, batch: list[Request]) -> dict[str, str]:
        """The lease token each fenced trial holds now, read in the commit's transaction
        (PostgreSQL: `FOR SHARE`, so a takeover waits for this commit)."""
        trials = sorted({r.fence[0] for r in batch if r.fence is not None})
        if not trials:
            return {}
        names = ", ".join(f":t{i}" for i in range(len(trials)))
        sql = f"SELECT trial_id, lease_token FROM job_queue WHERE trial_id IN ({names})"
        if conn.dialect.name == "postgresql":
            sql += " FOR SHARE"
        rows = conn.execute(text(sql), {f"t{i}": t for i, t in enumerate(trials)})
        return {tid: token for tid, token in rows.all() if token is not None}

    def _foreign_ids(self, conn: Connection, batch: list[Request]) -> dict[str, str]:
        """Caller-given event ids already stored in *other* sessions (id → session)."""
        wanted = {
            e.event_id for r in batch for e in r.events
            if e.event_id and not (r.session_id in self.open
                                   and e.event_id in self.open[r.session_id].ids)
        }
        found: dict[str, str] = {}
        for part in in_slices(sorted(wanted)):
            rows = conn.execute(
                select(EVENTS.c.event_id, EVENTS.c.session_id).where(EVENTS.c.event_id.in_(part)))
            found.update(rows.all())
        return found

    def _apply(self, conn: Connection, request: Request, recorded_at: str,
               foreign: dict[str, str], touched: dict[str, OpenSession]) -> list[StoredEvent]:
        sid = request.session_id
        open_ = self.open.get(sid) or OpenSession(Session(sid))
        originals: list[int] = []  # the seqs of events already in the log
        fresh: list[Event] = []
        for event in request.events:
            if event.event_id in foreign and foreign[event.event_id] != sid:
                raise EventIdConflict(event.event_id)
            seq = open_.ids.get(event.event_id or "")
            if seq is None:
                fresh.append(event)
                continue
            if not _same_content(open_.session.events[seq - 1], event):
                raise EventIdConflict(event.event_id or "")
            originals.append(seq)
        if not fresh:
            return self._stored(conn, open_, originals)  # an idempotent no-op
        session = open_.session
        if request.expected_seq is not None and request.expected_seq != session.head_seq:
            raise ConcurrencyConflict(sid, request.expected_seq, session.head_seq)
        # `apply` changes nothing when it refuses an event: a mark to roll back to is only
        # needed across several.
        mark = session.mark() if len(fresh) > 1 or request.folded is not None else None
        try:
            if request.folded is not None and session.head_seq == 0:
                if _folded_as_reloaded(request.folded):  # folded once already: taken
                    open_.session = request.folded
                else:
                    for event in fresh:
                        session.load(event)
                appended = fresh
            else:  # the machine derives any decision again (a harness never writes one)
                appended = [numbered for event in fresh if event.type != "outcome.decided"
                            for numbered in session.apply(event)]
        except TrialLedgerError:
            if mark is not None:
                session.rollback(mark)
            raise
        prev = open_.head_hash
        results = []
        for event in appended:
            canonical = canonical_text(event_dict(event))
            prev = chain_hash(prev, canonical)
            open_.remember(event, prev)
            results.append(StoredEvent(event, 0, recorded_at, prev, canonical))
        open_.fresh += results
        self.open[sid] = touched[sid] = open_
        if request.secrets is not None:
            self.secrets[sid] = request.secrets
        return self._stored(conn, open_, originals) + results if originals else results

    @staticmethod
    def _stored(conn: Connection, open_: OpenSession, seqs: list[int]) -> list[StoredEvent]:
        """The stored events at `seqs` of an open session, in that order: those of the
        commit under way as they are (their positions are given when it writes), the
        others read back."""
        if not seqs:
            return []
        first_fresh = open_.session.head_seq - len(open_.fresh) + 1
        found = dict(enumerate(open_.fresh, start=first_fresh))
        older = sorted({seq for seq in seqs if seq < first_fresh})
        for part in in_slices(older):
            rows = conn.execute(
                select(EVENTS.c.seq, EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash,
                       EVENTS.c.data)
                .where(EVENTS.c.session_id == open_.session.session_id,
                       EVENTS.c.seq.in_(part)))
            found.update((seq, StoredEvent.from_row(*row)) for seq, *row in rows.all())
        return [found[seq] for seq in seqs]

    @staticmethod
    def _render(touched: dict[str, OpenSession]) -> Rendered:
        """The events to insert and the projection rows, from the folded batch (nothing
        here needs the log's order: positions are given in `_write`)."""
        new = [s for open_ in touched.values() for s in open_.fresh]
        changes = Changes()
        for open_ in touched.values():
            if open_.fresh:
                changes.session(open_.session, open_.projected,
                                [s.event for s in open_.fresh], head_hash=open_.head_hash)
        return new, changes

    def _write(self, conn: Connection, rendered: Rendered, *,
               sequence_kept: bool = False) -> None:
        new, changes = rendered
        if not new:
            return
        # Positions are given here, under the write lock, after the log's current end:
        # commit order is position order, and no RETURNING round trip is needed.
        start = self._last_position or 0
        rows = []
        for offset, stored in enumerate(new, start=1):
            stored.position = start + offset
            event = stored.event
            rows.append((stored.position, event.session_id, event.seq, event.event_id,
                         event.type, event.at, stored.recorded_at, event.schema_,
                         stored.canonical, stored.hash))
        if self._postgres:  # one round trip less under the writers' lock
            sessions = [tuple(r[c] for c in SESSION_CHANGES) for r in changes.session_updates]
            conn.exec_driver_sql(EVENTS_AND_SESSIONS_PG, (
                *columns(rows, len(EVENT_COLUMNS)), *columns(sessions, len(SESSION_CHANGES))))
        else:
            conn.exec_driver_sql(self._insert_event, rows)
        self._last_position = start + len(new)
        if not sequence_kept:
            self.engines.positions_taken(conn, self._last_position)
        changes.write(conn, sessions_updated=self._postgres)

    async def rebuild(self, session_ids: Iterable[str]) -> int:
        """Recompute every projection row from the log."""
        def work(conn: Connection) -> int:
            for name in TABLES:
                conn.execute(delete(TABLE_OF[name]))
            count = 0
            for sid in session_ids:
                open_ = self.load(conn, sid)
                changes = Changes()
                changes.session(open_.session, open_.projected, open_.session.events,
                                head_hash=open_.head_hash)
                changes.write(conn)
                count += 1
            return count

        async with self._lock:
            count = await self.engines.transaction(work, serialize=True)
        self.open.clear()
        self._last_position = None
        return count
