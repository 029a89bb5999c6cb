"""The `Ledger`: a durable, concurrent, auditable event log of sessions (async, anyio).

>>> async def main() -> None:                                # doctest: +SKIP
...     async with await Ledger.open("trials.db") as ledger:
...         seeded = await ledger.seed(seed, secrets=[token])
...         await ledger.append(seeded.session_id, events, expected_seq=seeded.head_seq)
...         view = await ledger.view(seeded.session_id)

Every append runs through the core machine (its `outcome.decided` lands in the same
transaction) after every string of its data is scrubbed with the session's secrets.
Writes go through one `store.writer.Writer`, which group-commits concurrent appends.

Over 500 lines on purpose: it is the store's public surface (SPEC §10), one method per
operation, each a few lines over the writer, the reads and the projections it delegates to.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy import LargeBinary, column, select, table, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from trialledger.core import Event, IllegalTransition, Policy, SessionView, replay
from trialledger.core.canonical import (
    COPIED_KEYS,
    copy_fault,
    first_broken_link,
    session_id_for_seed,
)
from trialledger.core.machine import Session
from trialledger.core.parsing import event_dict, parse_events, parse_stored
from trialledger.core.policy import DEFAULT_POLICY, get_policy
from trialledger.core.redact import scrub_data
from trialledger.core.replay import rederive, view_of
from trialledger.core.seed import ValidSeed, seal_seed, validate_seed
from trialledger.store.defaults import DEFAULT_DB
from trialledger.store.engine import Engines, Synchronous, make_engines, sqlite_path
from trialledger.store.errors import AmbiguousSession as AmbiguousSession  # as before
from trialledger.store.errors import NoDatabase as NoDatabase
from trialledger.store.errors import NoSession as NoSession
from trialledger.store.errors import RunnerAlive as RunnerAlive
from trialledger.store.errors import StoreUnavailable as StoreUnavailable
from trialledger.store.errors import disk_full as disk_full
from trialledger.store.errors import guarded, store_error
from trialledger.store.log import EVENTS
from trialledger.store.migrate import ensure_current
from trialledger.store.policies import load_installed_policies
from trialledger.store.projections import SESSION_COLUMNS
from trialledger.store.rederive import Difference
from trialledger.store.rederive import divergences as every_divergence
from trialledger.store.writer import Fence, Request, StoredEvent, Writer, now

SESSIONS = table("sessions", *(column(c) for c in SESSION_COLUMNS))
LIVE_STATES = ("seeded", "starting", "running", "failed-live")
# Run before a session is closed out (`recover`): (session id, fence) → its state after.
Deliver = Callable[[str, Fence | None], Awaitable[str]]
HEARTBEAT_S = 10.0  # how often a running runner says it is alive
RUNNER_ALIVE_S = 3 * HEARTBEAT_S  # a heartbeat younger than this: the runner is alive
# Seconds since the epoch in the database server's own clock.
_DB_NOW = {"sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
           "postgresql": "extract(epoch from clock_timestamp())"}


async def _storage_fault(conn: Any, dialect: str) -> str | None:
    """The database's own check of its file (SQLite `integrity_check`); on PostgreSQL every
    table of the store must still be readable through its catalog."""
    if dialect == "sqlite":
        found = [row[0] for row in (await conn.execute(
            text("PRAGMA integrity_check(20)"))).all()]
        return None if found == ["ok"] else "the database file is damaged: " + "; ".join(
            str(line) for line in found[:3])
    for name in ("events", "sessions", "decision_log", "outcomes", "model_calls"):
        try:
            await conn.execute(text(f"SELECT count(*) FROM {name}"))
        except DBAPIError as error:
            return f"table {name} cannot be read: {str(error.orig).splitlines()[0]}"
    return None


def gone_from_this_host(runner_id: str) -> bool:
    """Whether a default runner id (`<host>-<pid>`) names a process of this host that no
    longer exists: its heartbeat may still look fresh, but it is dead."""
    prefix, _, pid = runner_id.rpartition("-")
    if prefix != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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


class Ledger:
    """The event store. Open with `await Ledger.open(db)`; use as an async context manager."""

    def __init__(self, engines: Engines, *, db: str, policy: Policy) -> None:
        self._engines = engines
        self.db = db
        self.policy = policy
        self._writer = Writer(engines)

    @classmethod
    async def open(
        cls,
        db: str = DEFAULT_DB,
        *,
        policy: str | Policy = DEFAULT_POLICY,
        sqlite_synchronous: Synchronous = "FULL",
        create: bool = True,
        call_timeout_s: float | None = None,
    ) -> Ledger:
        """Open (building a fresh database) a store; refuse one whose schema is out of date.

        `create=False` refuses a SQLite path with no file (read-only callers).
        `policy` is written into every seed that names none (SPEC §3 "Which policy"); each
        session is then decided under its seed's policy, whatever store reads it later.
        `call_timeout_s`: on PostgreSQL, the deadline of each connect and statement (a lease
        holder's, `engine.call_deadline`); a call past it fails as `StoreUnavailable`.
        """
        load_installed_policies()  # before any seed or fold names one of them
        path = sqlite_path(db)
        if not create and path is not None and not os.path.isfile(path):
            raise NoDatabase(f"no database at {path} (a new one is made by `trialledger db "
                             "upgrade` or by a command that writes)")
        if path is not None and os.path.lexists(path) and not os.path.isfile(path):
            raise StoreUnavailable.of(db, OSError(f"{path} is not a regular file"))
        engines = make_engines(db, sqlite_synchronous=sqlite_synchronous,
                               call_timeout_s=call_timeout_s)
        try:
            await ensure_current(engines.writer, db=db)
        except BaseException as error:
            await engines.dispose()
            if isinstance(error, SQLAlchemyError | OSError):
                if path is not None:  # aiosqlite's thread delivers a failed connect's stop
                    await anyio.sleep(0.05)  # to this loop: let it (omnilib/aiosqlite#389)
                raise store_error(db, error) from error
            raise
        return cls(engines, db=db, policy=get_policy(policy))

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the database connections (sessions stay open in the log); runs to the
        end even when its caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            await self._engines.dispose()

    @property
    def dialect(self) -> str:
        """`sqlite` or `postgresql`."""
        return self._engines.dialect

    def abandon(self) -> int:
        """Cut the write connections in use: an append that stalled (a server stopped, not
        gone) fails now, its transaction rolled back; what it carried is the caller's to
        journal (SPEC §8). Returns how many were cut."""
        return self._engines.abandon_writes()

    # --- writing ---------------------------------------------------------------------------

    @guarded
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

    @guarded
    async def start(self, valid: ValidSeed, *, session_id: str | None = None,
                    secrets: Iterable[str] = (), at: str | None = None,
                    fence: Fence | None = None) -> Seeded:
        """Start a session from an already validated seed (see `seed`); `fence`: only
        while that job trial's lease is the caller's (else `LeaseLost`)."""
        all_secrets = tuple(dict.fromkeys([*valid.secrets, *(s for s in secrets if s)]))
        at = at or now()
        data = valid.data.model_dump(mode="json")
        if data["settings"].get("policy") is None:
            data["settings"]["policy"] = self.policy.name
        get_policy(data["settings"]["policy"])  # an unknown name is refused before storing
        raw = [{"type": "session.seeded", "at": at, "data": data,
                "schema": valid.data.schema_version}]
        raw += [{"type": "gap.recorded", "at": at, "data": s.gap} for s in valid.skipped]
        sid = session_id or str(uuid.uuid4())
        events = self._prepare(raw, all_secrets)
        stored = await self._writer.submit(Request(sid, events, 0, secrets=all_secrets,
                                                   new_id=session_id is None, fence=fence))
        return Seeded(sid, stored, all_secrets)

    @guarded
    async def append(
        self,
        session_id: str,
        events: Sequence[Mapping[str, Any] | Event],
        *,
        expected_seq: int | None = None,
        fence: Fence | None = None,
    ) -> list[StoredEvent]:
        """Append events to a session, all or nothing; return them and any decision they caused.

        `expected_seq` is the head seq the caller last saw: a stale one raises
        `ConcurrencyConflict`. An event whose `event_id` is already stored with the same
        content is a no-op returning the original; with other content, `EventIdConflict`.
        `fence` (trial id, lease token): the append commits only while that job trial's
        lease is this token, checked in the same transaction (else `LeaseLost`).
        """
        prepared = self._prepare(events, self._writer.secrets.get(session_id, ()))
        return await self._writer.submit(Request(session_id, prepared, expected_seq,
                                                 fence=fence))

    @guarded
    async def close(self, session_id: str, reason: str = "normal", *,
                    at: str | None = None) -> list[StoredEvent]:
        """Append `session.closed`."""
        closed = {"type": "session.closed", "at": at or now(), "data": {"reason": reason}}
        return await self.append(session_id, [closed])

    @guarded
    async def heartbeat(self, runner_id: str) -> None:
        """Say that `runner_id` is alive now (in the database's clock)."""
        db_now = _DB_NOW[self.dialect]
        await self._engines.transaction(lambda conn: conn.execute(text(
            f"INSERT INTO runners (runner_id, heartbeat, host, pid) "
            f"VALUES (:r, {db_now}, :h, :p) ON CONFLICT (runner_id) "
            f"DO UPDATE SET heartbeat = {db_now}, host = :h, pid = :p"),
            {"r": runner_id, "h": socket.gethostname(), "p": os.getpid()}))

    @guarded
    async def clear_heartbeat(self, runner_id: str) -> None:
        """Say that `runner_id` has exited: `recover --runner` need not wait for its
        heartbeat to age."""
        await self._engines.transaction(lambda conn: conn.execute(
            text("DELETE FROM runners WHERE runner_id = :r"), {"r": runner_id}))

    @guarded
    async def live_runners(self, within_s: float = RUNNER_ALIVE_S) -> dict[str, float]:
        """Runners whose heartbeat is younger than `within_s`: id → its age in seconds."""
        async with self._engines.reader.begin() as conn:
            rows = (await conn.execute(text(
                f"SELECT runner_id, {_DB_NOW[self.dialect]} - heartbeat FROM runners"))).all()
        return {rid: float(age) for rid, age in rows if float(age) < within_s}

    @guarded
    async def recover(self, runner_id: str | None, *, all_runners: bool = False,
                      force: bool = False, deliver: Deliver | None = None) -> list[str]:
        """Close out the sessions a runner left open (SPEC: `recover`); return their ids.

        Live ones get `sandbox.lost` {detail: "harness restarted"} (so they are retried),
        then every one gets `session.closed` {reason: "recovered"}. Only `runner_id`'s
        sessions are touched unless `all_runners` (a single-machine store). A runner whose
        heartbeat is fresh is alive: its id is refused (`RunnerAlive`) and `all_runners`
        leaves its sessions alone, unless `force`. `deliver(session_id, fence)`, when
        given, runs first for each session and returns its state after (the runner's
        evidence journal delivered, SPEC §8; `closed` when it closed the session itself).
        """
        if runner_id is None and not all_runners:
            raise ValueError("recover needs a runner_id, or all_runners=True")
        alive = {} if force else {runner: age for runner, age in
                                  (await self.live_runners()).items()
                                  if not gone_from_this_host(runner)}
        if runner_id is not None and not all_runners and runner_id in alive:
            raise RunnerAlive(f"runner {runner_id} is alive (its heartbeat is "
                              f"{alive[runner_id]:.0f} s old); pass --force to recover "
                              "its sessions anyway")
        query = select(SESSIONS.c.session_id, SESSIONS.c.state).where(
            SESSIONS.c.state != "closed")
        if not all_runners:
            query = query.where(SESSIONS.c.runner_id == runner_id)
        elif alive:
            query = query.where(SESSIONS.c.runner_id.not_in(list(alive)))
        async with self._engines.reader.connect() as conn:
            rows = (await conn.execute(query.order_by(SESSIONS.c.session_id))).all()
        await self._close_out([(sid, state) for sid, state in rows], deliver=deliver)
        return [sid for sid, _ in rows]

    @guarded
    async def recover_sessions(self, session_ids: Sequence[str], *,
                               fence: Fence | None = None,
                               deliver: Deliver | None = None) -> list[str]:
        """Close out these sessions where still open, as `recover` does (a job's new owner
        of a trial whose lease expired; `fence`: its lease, checked by every append, else
        `LeaseLost`); return those it closed."""
        if not session_ids:
            return []
        query = select(SESSIONS.c.session_id, SESSIONS.c.state).where(
            SESSIONS.c.state != "closed", SESSIONS.c.session_id.in_(list(session_ids)))
        async with self._engines.reader.connect() as conn:
            rows = (await conn.execute(query.order_by(SESSIONS.c.session_id))).all()
        await self._close_out([(sid, state) for sid, state in rows], fence=fence,
                              deliver=deliver)
        return [sid for sid, _ in rows]

    @guarded
    async def verified(self, session_id: str) -> bool:
        """Whether a verification of the session (its result or its failure) is stored:
        what finishes a trial (docs/SPEC.md §13)."""
        query = select(EVENTS.c.seq).where(
            EVENTS.c.session_id == session_id,
            EVENTS.c.type.in_(["verification.recorded", "verification.failed"])).limit(1)
        async with self._engines.reader.connect() as conn:
            return (await conn.execute(query)).first() is not None

    async def _close_out(self, rows: Sequence[tuple[str, str]], *,
                         fence: Fence | None = None, deliver: Deliver | None = None) -> None:
        for sid, state in rows:
            if deliver is not None and (state := await deliver(sid, fence)) == "closed":
                continue
            at = now()
            events: list[dict[str, Any]] = []
            if state in LIVE_STATES:
                events.append({"type": "sandbox.lost", "at": at,
                               "data": {"detail": "harness restarted"}})
            elif state == "graded" and not await self.verified(sid):  # decided gradable,
                # but no verdict was recorded (one stored: only the close is missing)
                events.append({"type": "gap.recorded", "at": at, "data": {
                    "code": "verification_interrupted",
                    "detail": "the runner stopped before the verifier's result was recorded; "
                              "the trial needs another attempt"}})
            events.append({"type": "session.closed", "at": at, "data": {"reason": "recovered"}})
            await self.append(sid, events, fence=fence)

    @guarded
    async def import_log(self, events: Iterable[Mapping[str, Any]],
                         *, secrets: Iterable[str] = ()) -> str:
        """Append one session's recorded log through the machine, all or nothing.

        Recorded decisions are re-derived, not copied; a log whose recorded decisions the
        machine does not reproduce is refused (importing it would drop evidence).
        """
        given = list(events)
        raw, sealed = seal_seed(given)  # a seed with raw header values
        if sealed and not raw[0].get("session_id"):  # named as replay names it: as written
            raw[0] = {**raw[0], "session_id": session_id_for_seed(given[0]["data"])}
        secret_list = tuple(s for s in (*secrets, *sealed) if s)
        raw = [scrub_data(dict(e), secret_list) for e in raw]
        folded = rederive(raw)  # under the seed's own policy
        session = folded.session
        if folded.diverged_at is not None:
            d = folded.diverged_at
            raise IllegalTransition(
                session.state, "outcome.decided", (),
                f"recorded decision at seq {d.seq} "
                f"({d.recorded.rule if d.recorded else 'none'}) is not what policy "
                f"{session.policy.name} derives ({d.derived.rule if d.derived else 'none'})",
            )
        await self._writer.submit(Request(session.session_id, list(session.events), 0,
                                          folded=session))
        return session.session_id

    def _prepare(self, events: Iterable[Mapping[str, Any] | Event],
                 secrets: Sequence[str]) -> list[Event]:
        if not secrets:
            return parse_events(events)
        return parse_events(
            scrub_data(dict(raw) if isinstance(raw, Mapping) else event_dict(raw), secrets)
            for raw in events)

    # --- reading ---------------------------------------------------------------------------

    @guarded
    async def events(self, session_id: str, *, after_seq: int = 0) -> list[StoredEvent]:
        """A session's stored events after `after_seq`, in order."""
        rows = await self._engines.read(lambda conn: conn.execute(
            select(EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash, EVENTS.c.data)
            .where(EVENTS.c.session_id == session_id, EVENTS.c.seq > after_seq)
            .order_by(EVENTS.c.seq)).all())
        return [StoredEvent.from_row(*row) for row in rows]

    @guarded
    async def view(self, session_id: str, *, policy: str | Policy | None = None) -> SessionView:
        """The session's view: as recorded, or re-derived under `policy` when given."""
        # Only the events' text: a view needs no position, time or hash of the store (a
        # tenth of a long session's read).
        texts = await self._engines.read(lambda conn: conn.execute(
            select(EVENTS.c.data).where(EVENTS.c.session_id == session_id)
            .order_by(EVENTS.c.seq)).scalars().all())
        if not texts:
            raise NoSession(session_id)
        events = [parse_stored(text) for text in texts]
        if policy is not None:
            return replay(events, policy=policy)
        session = Session(session_id)  # the seed names its policy (none: v1, from before)
        for event in events:
            session.load(event)
        return view_of(session)

    @guarded
    async def tail(self, after_position: int = 0, *, limit: int = 1000) -> list[StoredEvent]:
        """Events of every session after a global position, in position order."""
        async with self._engines.reader.begin() as conn:
            rows = (await conn.execute(
                select(EVENTS.c.position, EVENTS.c.recorded_at, EVENTS.c.hash, EVENTS.c.data)
                .where(EVENTS.c.position > after_position)
                .order_by(EVENTS.c.position).limit(limit)
            )).all()
        return [StoredEvent.from_row(*row) for row in rows]

    @guarded
    async def sessions(self, /, **where: Any) -> list[dict[str, Any]]:
        """Rows of the `sessions` view, filtered by equal columns (e.g. `state="running"`)."""
        unknown = set(where) - set(SESSION_COLUMNS)
        if unknown:
            raise ValueError(f"sessions has no column {', '.join(sorted(unknown))}")
        clauses = " AND ".join(f"{name} = :{name}" for name in where) or "1 = 1"
        sql = text(f"SELECT * FROM sessions WHERE {clauses} ORDER BY created_at, session_id")
        return await self._engines.read(
            lambda conn: [dict(row._mapping) for row in conn.execute(sql, where)])

    @guarded
    async def session_count(self) -> int:
        """How many sessions the store holds."""
        return int(await self._engines.read(
            lambda conn: conn.execute(text("SELECT count(*) FROM sessions")).scalar_one()))

    @guarded
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
               " o.cause_kind, o.total_tokens, s.created_at, s.runner_id FROM sessions s"
               " LEFT JOIN outcomes o ON o.session_id = s.session_id"
               f" WHERE {' AND '.join(where) or '1 = 1'} ORDER BY s.created_at, s.session_id")
        async with self._engines.reader.begin() as conn:
            return [dict(row._mapping) for row in await conn.execute(text(sql), params)]

    @guarded
    async def resolve(self, prefix: str) -> str:
        """The one session id that starts with `prefix` (`NoSession`, `AmbiguousSession`)."""
        pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        async with self._engines.reader.begin() as conn:
            found = [sid for (sid,) in (await conn.execute(text(
                "SELECT session_id FROM sessions WHERE session_id LIKE :p ESCAPE '\\' "
                "ORDER BY session_id LIMIT 6"), {"p": pattern})).all()]
        if prefix in found or len(found) == 1:
            return prefix if prefix in found else found[0]
        if not found:
            raise NoSession(prefix)
        raise AmbiguousSession(prefix, found)

    @guarded
    async def export(self, session_id: str) -> list[dict[str, Any]]:
        """A session's log with every field (event fields plus position, recorded_at, hash)."""
        return [s.jsonl() for s in await self.events(session_id)]

    @guarded
    async def audit(self) -> AuditReport:
        """Check the database's own structure, then every session's hash chain and head;
        report the first fault (a damaged event is named by its session and seq)."""
        async with self._engines.reader.begin() as conn:
            fault = await _storage_fault(conn, self.dialect)
            if fault is not None:
                return AuditReport(0, 0, fault)
            heads = {sid: (seq, digest) for sid, seq, digest in (await conn.execute(
                select(SESSIONS.c.session_id, SESSIONS.c.head_seq, SESSIONS.c.head_hash)
                .order_by(SESSIONS.c.session_id))).all()}
            data_column = (EVENTS.c.data if self.dialect != "sqlite"  # bytes: decoded below
                           else EVENTS.c.data.cast(LargeBinary))
            copies = [EVENTS.c[key] for key in COPIED_KEYS if key not in ("session_id", "seq")]
            rows = (await conn.execute(
                select(EVENTS.c.session_id, EVENTS.c.seq, data_column, EVENTS.c.hash, *copies)
                .order_by(EVENTS.c.session_id, EVENTS.c.seq))).all()
        by_session: dict[str, list[tuple[int, str, str]]] = {}
        altered = None  # the first row whose column copies disagree with its text
        for sid, seq, data, digest, *copied in rows:
            if isinstance(data, bytes):
                try:
                    data = data.decode("utf-8")
                except UnicodeDecodeError:
                    return AuditReport(len(heads), len(rows), f"session {sid}: event at seq "
                                       f"{seq} is damaged (its stored text is not UTF-8)")
            by_session.setdefault(sid, []).append((seq, data, digest))
            if altered is None and (fault := copy_fault(data, dict(
                    zip(COPIED_KEYS, (sid, seq, *copied), strict=True)))):
                altered = f"session {sid}: event at seq {seq}: {fault}"
        for sid in sorted(set(by_session) | set(heads)):
            if sid not in heads:
                return AuditReport(len(heads), len(rows),
                                   f"session {sid}: events without a session head")
            head_seq, head_hash = heads[sid]
            fault = first_broken_link(by_session.get(sid, []), head_seq=head_seq,
                                      head_hash=head_hash)
            if fault:
                return AuditReport(len(heads), len(rows), f"session {sid}: {fault}")
        return AuditReport(len(heads), len(rows), altered)

    @guarded
    async def divergences(self, policy: str | None = None, *, jobs: int = 1,
                          policy_files: Sequence[str] = (),
                          on_sessions: Callable[[int], object] | None = None
                          ) -> tuple[int, list[Difference]]:
        """Re-derive every stored session (under the policy named `policy`, else each one's
        own) and return how many there are and those whose recorded decisions differ, at
        their first difference, by session id. `jobs` processes share the work (each loads
        `policy_files`, which register policies, first); `on_sessions(n)` reports progress."""
        return await every_divergence(self._engines, self.db, policy, jobs=jobs,
                                      policy_files=policy_files, on_sessions=on_sessions)

    @guarded
    async def rebuild_projections(self) -> int:
        """Recompute every projection row from the log; return the number of sessions."""
        async with self._engines.reader.begin() as conn:
            sids = [sid for (sid,) in (await conn.execute(
                select(EVENTS.c.session_id).distinct().order_by(EVENTS.c.session_id))).all()]
        return await self._writer.rebuild(sids)

