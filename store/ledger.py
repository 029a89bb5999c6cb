"""The `Ledger`: a durable, concurrent, auditable event log of sessions (async, anyio).

>>> async def main() -> None:                                # doctest: +SKIP
...     async with await Ledger.open("trials.db") as ledger:
...         seeded = await ledger.seed(seed, secrets=[token])
...         await ledger.append(seeded.session_id, events, expected_seq=seeded.head_seq)
...         view = await ledger.view(seeded.session_id)

Every append runs through the core machine (its `outcome.decided` lands in the same
transaction) after every string of its data is scrubbed with the session's secrets.
Appends from concurrent callers are **group-committed**: whoever finds no commit in flight
commits everything queued so far in one transaction, while each caller awaits its own
result. Open sessions stay folded in memory; a session another process appended to is
re-read from the log before the next append (its head is checked inside the write lock).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    Table,
    Text,
    column,
    delete,
    insert,
    select,
    table,
    text,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from core import (
    BadEvent,
    ConcurrencyConflict,
    Event,
    EventIdConflict,
    IllegalTransition,
    Policy,
    Session,
    SessionView,
    TrialLedgerError,
    ValidSeed,
    event_dict,
    get_policy,
    parse_event,
    replay,
    scrub_data,
    validate_seed,
)
from core.canonical import GENESIS, canonical_text, chain_hash, first_broken_link
from core.replay import view_of
from store.engine import DEFAULT_DB, Engines, Synchronous, make_engines
from store.migrate import ensure_current
from store.projections import PROJECTION_TABLES, projection_rows

EVENT_COLUMNS = ("position", "session_id", "seq", "event_id", "type", "at", "recorded_at",
                 "schema", "data", "hash")
# A full Table (not a bare `table()`): RETURNING rows in parameter order needs its key.
EVENTS = Table(
    "events", MetaData(),
    Column("position", Integer, primary_key=True, autoincrement=True),
    *(Column(name, Integer if name in ("seq", "schema") else Text)
      for name in EVENT_COLUMNS[1:]),
)
SESSIONS = table("sessions", column("session_id"), column("head_seq"), column("head_hash"),
                 column("state"), column("runner_id"))
SESSION_COLUMNS = ("session_id", "trial_id", "attempt", "retry_of", "task", "agent_name",
                   "agent_version", "model", "runner_id", "state", "outcome", "close_reason",
                   "created_at", "closed_at", "head_seq", "head_hash")
PROJECTIONS = {name: table(name, column("session_id")) for name in PROJECTION_TABLES}
MAX_BATCH = 2000  # events per group commit
LIVE_STATES = ("seeded", "starting", "running", "failed-live")


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

    def jsonl(self) -> dict[str, Any]:
        """The export form: every field of the event and of the store."""
        return {**event_dict(self.event), "position": self.position,
                "recorded_at": self.recorded_at, "hash": self.hash}


@dataclass(frozen=True)
class Seeded:
    """A new session: its id, and the events its seed appended (seed, skipped-grant gaps)."""

    session_id: str
    events: list[StoredEvent]
    secrets: tuple[str, ...] = ()  # in memory only: for the harness's own redaction

    @property
    def head_seq(self) -> int:
        """The seq to pass as `expected_seq` for the next append."""
        return len(self.events)


@dataclass(frozen=True)
class AuditReport:
    """What `audit` found: the number of sessions and events checked, and the first fault."""

    sessions: int
    events: int
    fault: str | None

    @property
    def ok(self) -> bool:
        """Whether every chain and head verified."""
        return self.fault is None


@dataclass
class _Open:
    """A folded open session and what the store keeps beside it."""

    session: Session
    stored: list[StoredEvent] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)  # event_id → index in `stored`

    @property
    def head_hash(self) -> str:
        return self.stored[-1].hash if self.stored else GENESIS


@dataclass(eq=False)
class _Request:
    session_id: str
    events: list[Event]
    expected_seq: int | None
    secrets: tuple[str, ...] | None = None  # set when the request seeds the session
    result: list[StoredEvent] | None = None
    error: BaseException | None = None
    done: bool = False


def _same_content(a: Event, b: Event) -> bool:
    keys = {"type", "at", "data", "schema_"}
    return a.model_dump(include=keys) == b.model_dump(include=keys)


class Ledger:
    """The event store. Open with `await Ledger.open(db)`; use as an async context manager."""

    def __init__(self, engines: Engines, *, db: str, policy: Policy) -> None:
        self._engines = engines
        self.db = db
        self.policy = policy
        self._open: dict[str, _Open] = {}
        self._secrets: dict[str, tuple[str, ...]] = {}
        self._pending: list[_Request] = []
        self._write_lock = anyio.Lock()

    @classmethod
    async def open(
        cls,
        db: str = DEFAULT_DB,
        *,
        policy: str | Policy = "v1",
        sqlite_synchronous: Synchronous = "FULL",
    ) -> Ledger:
        """Open (building a fresh database) a store; refuse one whose schema is out of date."""
        engines = make_engines(db, sqlite_synchronous=sqlite_synchronous)
        try:
            await ensure_current(engines.writer, db=db)
        except BaseException:
            await engines.dispose()
            raise
        return cls(engines, db=db, policy=get_policy(policy))

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the database connections (sessions stay open in the log)."""
        await self._engines.dispose()

    @property
    def dialect(self) -> str:
        """`sqlite` or `postgresql`."""
        return self._engines.dialect

    # --- writing ---------------------------------------------------------------------------

    async def seed(
        self,
        seed: Mapping[str, Any],
        *,
        session_id: str | None = None,
        secrets: Iterable[str] = (),
        private_roots: Iterable[str] = (),
        configured_grants: Sequence[Mapping[str, Any]] = (),
        api_key: str | None = None,
        at: str | None = None,
    ) -> Seeded:
        """Validate a seed (SPEC §5–6) and start a session; skipped grants become gaps.

        The session's secrets (grant header values, the API key, `secrets`) are kept in
        memory only, for this session's life, and scrub every later append.
        """
        valid = validate_seed(seed, private_roots=private_roots,
                              configured_grants=configured_grants, api_key=api_key)
        return await self.start(valid, session_id=session_id, secrets=secrets, at=at)

    async def start(self, valid: ValidSeed, *, session_id: str | None = None,
                    secrets: Iterable[str] = (), at: str | None = None) -> Seeded:
        """Start a session from an already validated seed (see `seed`)."""
        all_secrets = tuple(dict.fromkeys([*valid.secrets, *(s for s in secrets if s)]))
        at = at or now()
        raw = [{"type": "session.seeded", "at": at, "data": valid.data.model_dump(mode="json")}]
        raw += [{"type": "gap.recorded", "at": at, "data": s.gap} for s in valid.skipped]
        sid = session_id or str(uuid.uuid4())
        events = self._prepare(raw, all_secrets)
        stored = await self._submit(_Request(sid, events, 0, secrets=all_secrets))
        return Seeded(sid, stored, all_secrets)

    async def append(
        self,
        session_id: str,
        events: Sequence[Mapping[str, Any] | Event],
        *,
        expected_seq: int | None = None,
    ) -> list[StoredEvent]:
        """Append events to a session, all or nothing; return them and any decision they caused.

        `expected_seq` is the head seq the caller last saw: a stale one raises
        `ConcurrencyConflict`. An event whose `event_id` is already stored with the same
        content is a no-op returning the original; with other content, `EventIdConflict`.
        """
        prepared = self._prepare(events, self._secrets.get(session_id, ()))
        return await self._submit(_Request(session_id, prepared, expected_seq))

    async def close(self, session_id: str, reason: str = "normal", *,
                    at: str | None = None) -> list[StoredEvent]:
        """Append `session.closed`."""
        closed = {"type": "session.closed", "at": at or now(), "data": {"reason": reason}}
        return await self.append(session_id, [closed])

    async def recover(self, runner_id: str | None, *, all_runners: bool = False) -> list[str]:
        """Close out the sessions a runner left open (SPEC: `recover`); return their ids.

        Live ones get `sandbox.lost` {detail: "harness restarted"} (so they are retried),
        then every one gets `session.closed` {reason: "recovered"}. Only `runner_id`'s
        sessions are touched unless `all_runners` (a single-machine store).
        """
        if runner_id is None and not all_runners:
            raise ValueError("recover needs a runner_id, or all_runners=True")
        query = select(SESSIONS.c.session_id, SESSIONS.c.state).where(
            SESSIONS.c.state != "closed")
        if not all_runners:
            query = query.where(SESSIONS.c.runner_id == runner_id)
        async with self._engines.reader.connect() as conn:
            rows = (await conn.execute(query.order_by(SESSIONS.c.session_id))).all()
        for sid, state in rows:
            at = now()
            events: list[dict[str, Any]] = []
            if state in LIVE_STATES:
                events.append({"type": "sandbox.lost", "at": at,
                               "data": {"detail": "harness restarted"}})
            events.append({"type": "session.closed", "at": at, "data": {"reason": "recovered"}})
            await self.append(sid, events)
        return [sid for sid, _ in rows]

    async def import_log(self, events: Iterable[Mapping[str, Any]],
                         *, secrets: Iterable[str] = ()) -> str:
        """Append one session's recorded log through the machine, all or nothing.

        Recorded decisions are re-derived, not copied; a log whose recorded decisions the
        machine does not reproduce is refused (importing it would drop evidence).
        """
        secret_list = tuple(s for s in secrets if s)
        raw = [scrub_data(dict(e), secret_list) for e in events]
        view = replay(raw, policy=self.policy)
        if view.diverged_at is not None:
            d = view.diverged_at
            raise IllegalTransition(
                view.state, "outcome.decided", (),
                f"recorded decision at seq {d.seq} ({d.recorded.rule}) is not what policy "
                f"{self.policy.name} derives ({d.derived.rule if d.derived else 'none'})",
            )
        harness = [e.model_copy(update={"seq": None}) for e in view.events
                   if e.type != "outcome.decided"]
        await self._submit(_Request(view.session_id, harness, 0))
        return view.session_id

    def _prepare(self, events: Iterable[Mapping[str, Any] | Event],
                 secrets: Sequence[str]) -> list[Event]:
        prepared = []
        for index, raw in enumerate(events):
            if secrets:
                raw = scrub_data(event_dict(raw) if not isinstance(raw, Mapping) else dict(raw),
                                 secrets)
            try:
                prepared.append(parse_event(raw))
            except BadEvent as error:
                raise error.at(index=index) from None
        return prepared

    async def _submit(self, request: _Request) -> list[StoredEvent]:
        self._pending.append(request)
        async with self._write_lock:
            if not request.done:
                batch, self._pending = self._pending, []
                with anyio.CancelScope(shield=True):  # a cancelled caller never aborts others
                    await self._commit(batch)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    async def _commit(self, batch: list[_Request]) -> None:
        touched: dict[str, _Open] = {}
        try:
            async with self._engines.writer.begin() as conn:
                await self._engines.lock_writers(conn)
                await self._refresh(conn, {r.session_id for r in batch})
                foreign = await self._foreign_ids(conn, batch)
                recorded_at = now()
                new_rows: list[tuple[StoredEvent, dict[str, Any]]] = []
                for request in batch:
                    try:
                        request.result = self._apply(request, recorded_at, foreign, new_rows,
                                                     touched)
                    except TrialLedgerError as error:
                        request.error = error
                await self._write(conn, new_rows, touched)
        except BaseException as error:
            for sid in touched:  # their in-memory folds hold what was not committed
                self._open.pop(sid, None)
            for request in batch:
                if request.error is None:
                    request.error, request.result = error, None
            if not isinstance(error, Exception):
                raise
        finally:
            for request in batch:
                request.done = True
        for sid, open_ in touched.items():
            if open_.session.state == "closed":
                self._open.pop(sid, None)
                self._secrets.pop(sid, None)

    async def _refresh(self, conn: AsyncConnection, session_ids: set[str]) -> None:
        heads = dict((await conn.execute(
            select(SESSIONS.c.session_id, SESSIONS.c.head_seq).where(
                SESSIONS.c.session_id.in_(session_ids))
        )).all())
        for sid in session_ids:
            cached = self._open.get(sid)
            if sid not in heads:
                self._open.pop(sid, None)
            elif cached is None or cached.session.head_seq != heads[sid]:
                self._open[sid] = await self._load(conn, sid)

    async def _load(self, conn: AsyncConnection, session_id: str) -> _Open:
        rows = (await conn.execute(
            select(EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash, EVENTS.c.data)
            .where(EVENTS.c.session_id == session_id).order_by(EVENTS.c.seq)
        )).all()
        open_ = _Open(Session(session_id, self.policy))
        for position, recorded_at, digest, data in rows:
            event = parse_event(json.loads(data))
            open_.session.load(event)
            self._remember(open_, StoredEvent(event, position, recorded_at, digest))
        return open_

    @staticmethod
    def _remember(open_: _Open, stored: StoredEvent) -> None:
        if stored.event.event_id:
            open_.ids[stored.event.event_id] = len(open_.stored)
        open_.stored.append(stored)

    async def _foreign_ids(self, conn: AsyncConnection, batch: list[_Request]) -> dict[str, str]:
        """Caller-given event ids already stored in *other* sessions (id → session)."""
        wanted = {
            e.event_id for r in batch for e in r.events
            if e.event_id and not (r.session_id in self._open
                                   and e.event_id in self._open[r.session_id].ids)
        }
        if not wanted:
            return {}
        rows = await conn.execute(
            select(EVENTS.c.event_id, EVENTS.c.session_id).where(EVENTS.c.event_id.in_(wanted)))
        return dict(rows.all())

    def _apply(
        self,
        request: _Request,
        recorded_at: str,
        foreign: dict[str, str],
        new_rows: list[tuple[StoredEvent, dict[str, Any]]],
        touched: dict[str, _Open],
    ) -> list[StoredEvent]:
        sid = request.session_id
        open_ = self._open.get(sid) or _Open(Session(sid, self.policy))
        originals: list[StoredEvent] = []
        fresh: list[Event] = []
        for event in request.events:
            if event.event_id in foreign and foreign[event.event_id] != sid:
                raise EventIdConflict(event.event_id)
            index = open_.ids.get(event.event_id or "")
            if index is None:
                fresh.append(event)
                continue
            original = open_.stored[index]
            if not _same_content(original.event, event):
                raise EventIdConflict(event.event_id or "")
            originals.append(original)
        if not fresh:
            return originals  # every event already stored: an idempotent no-op
        session = open_.session
        if request.expected_seq is not None and request.expected_seq != session.head_seq:
            raise ConcurrencyConflict(sid, request.expected_seq, session.head_seq)
        mark = session.mark()
        try:
            appended = [numbered for event in fresh for numbered in session.apply(event)]
        except TrialLedgerError:
            session.rollback(mark)
            raise
        prev = open_.head_hash
        results = []
        for event in appended:
            canonical = canonical_text(event_dict(event))
            prev = chain_hash(prev, canonical)
            stored = StoredEvent(event, 0, recorded_at, prev)
            self._remember(open_, stored)
            new_rows.append((stored, {
                "session_id": sid, "seq": event.seq, "event_id": event.event_id,
                "type": event.type, "at": event.at, "recorded_at": recorded_at,
                "schema": event.schema_, "data": canonical, "hash": prev,
            }))
            results.append(stored)
        self._open[sid] = touched[sid] = open_
        if request.secrets is not None:
            self._secrets[sid] = request.secrets
        return originals + results

    async def _write(
        self,
        conn: AsyncConnection,
        new_rows: list[tuple[StoredEvent, dict[str, Any]]],
        touched: dict[str, _Open],
    ) -> None:
        if not new_rows:
            return
        result = await conn.execute(
            insert(EVENTS).returning(EVENTS.c.position, sort_by_parameter_order=True),
            [row for _, row in new_rows],
        )
        for (stored, _), (position,) in zip(new_rows, result.all(), strict=True):
            stored.position = position
        await self._project(conn, touched)

    async def _project(self, conn: AsyncConnection, sessions: Mapping[str, _Open]) -> None:
        if not sessions:
            return
        ids = list(sessions)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in PROJECTION_TABLES}
        for open_ in sessions.values():
            view = view_of(open_.session)
            for name, table_rows in projection_rows(view, head_hash=open_.head_hash).items():
                rows[name].extend(table_rows)
        for name in PROJECTION_TABLES:
            projection = PROJECTIONS[name]
            await conn.execute(delete(projection).where(projection.c.session_id.in_(ids)))
            if rows[name]:
                columns = rows[name][0].keys()
                target = table(name, *(column(c) for c in columns))
                await conn.execute(insert(target), rows[name])

    # --- reading ---------------------------------------------------------------------------

    async def events(self, session_id: str, *, after_seq: int = 0) -> list[StoredEvent]:
        """A session's stored events after `after_seq`, in order."""
        async with self._engines.reader.begin() as conn:
            rows = (await conn.execute(
                select(EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash, EVENTS.c.data)
                .where(EVENTS.c.session_id == session_id, EVENTS.c.seq > after_seq)
                .order_by(EVENTS.c.seq)
            )).all()
        return [StoredEvent(parse_event(json.loads(d)), p, r, h) for p, r, h, d in rows]

    async def view(self, session_id: str, *, policy: str | Policy | None = None) -> SessionView:
        """The session's view: as recorded, or re-derived under `policy` when given."""
        stored = await self.events(session_id)
        if not stored:
            raise KeyError(f"no session {session_id}")
        if policy is not None:
            return replay([s.event for s in stored], policy=policy)
        session = Session(session_id, self.policy)
        for s in stored:
            session.load(s.event)
        return view_of(session)

    async def tail(self, after_position: int = 0, *, limit: int = 1000) -> list[StoredEvent]:
        """Events of every session after a global position, in position order."""
        async with self._engines.reader.begin() as conn:
            rows = (await conn.execute(
                select(EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash, EVENTS.c.data)
                .where(EVENTS.c.position > after_position)
                .order_by(EVENTS.c.position).limit(limit)
            )).all()
        return [StoredEvent(parse_event(json.loads(d)), p, r, h) for p, r, h, d in rows]

    async def sessions(self, **where: Any) -> list[dict[str, Any]]:
        """Rows of the `sessions` view, filtered by equal columns (e.g. `state="running"`)."""
        unknown = set(where) - set(SESSION_COLUMNS)
        if unknown:
            raise ValueError(f"sessions has no column {', '.join(sorted(unknown))}")
        clauses = " AND ".join(f"{name} = :{name}" for name in where) or "1 = 1"
        async with self._engines.reader.begin() as conn:
            result = await conn.execute(
                text(f"SELECT * FROM sessions WHERE {clauses} ORDER BY created_at, session_id"),
                where,
            )
            return [dict(row._mapping) for row in result]

    async def listing(self, *, task: str | None = None, state: str | None = None,
                      cause: str | None = None) -> list[dict[str, Any]]:
        """Sessions with their last decision and tokens (`trialledger ls`), oldest first."""
        where, params = [], {}
        for name, column_name, value in (("task", "s.task", task), ("state", "s.state", state),
                                          ("cause", "o.cause_kind", cause)):
            if value is not None:
                where.append(f"{column_name} = :{name}")
                params[name] = value
        sql = ("SELECT s.session_id, s.task, s.trial_id, s.attempt, s.state, s.outcome, o.rule,"
               " o.cause_kind, o.total_tokens, s.created_at FROM sessions s"
               " LEFT JOIN outcomes o ON o.session_id = s.session_id"
               f" WHERE {' AND '.join(where) or '1 = 1'} ORDER BY s.created_at, s.session_id")
        async with self._engines.reader.begin() as conn:
            return [dict(row._mapping) for row in await conn.execute(text(sql), params)]

    async def export(self, session_id: str) -> list[dict[str, Any]]:
        """A session's log with every field (event fields plus position, recorded_at, hash)."""
        return [s.jsonl() for s in await self.events(session_id)]

    async def audit(self) -> AuditReport:
        """Verify every session's hash chain and head; report the first fault."""
        async with self._engines.reader.begin() as conn:
            heads = {sid: (seq, digest) for sid, seq, digest in (await conn.execute(
                select(SESSIONS.c.session_id, SESSIONS.c.head_seq, SESSIONS.c.head_hash)
                .order_by(SESSIONS.c.session_id))).all()}
            rows = (await conn.execute(
                select(EVENTS.c.session_id, EVENTS.c.seq, EVENTS.c.data, EVENTS.c.hash)
                .order_by(EVENTS.c.session_id, EVENTS.c.seq))).all()
        by_session: dict[str, list[tuple[int, str, str]]] = {}
        for sid, seq, data, digest in rows:
            by_session.setdefault(sid, []).append((seq, data, digest))
        for sid in sorted(set(by_session) | set(heads)):
            if sid not in heads:
                return AuditReport(len(heads), len(rows),
                                   f"session {sid}: events without a session head")
            head_seq, head_hash = heads[sid]
            fault = first_broken_link(by_session.get(sid, []), head_seq=head_seq,
                                      head_hash=head_hash)
            if fault:
                return AuditReport(len(heads), len(rows), f"session {sid}: {fault}")
        return AuditReport(len(heads), len(rows), None)

    async def rebuild_projections(self) -> int:
        """Recompute every projection row from the log; return the number of sessions."""
        async with self._engines.writer.begin() as conn:
            await self._engines.lock_writers(conn)
            sids = [sid for (sid,) in (await conn.execute(
                select(EVENTS.c.session_id).distinct())).all()]
            for name in PROJECTION_TABLES:
                await conn.execute(delete(PROJECTIONS[name]))
            for sid in sids:
                await self._project(conn, {sid: await self._load(conn, sid)})
        self._open.clear()
        return len(sids)

