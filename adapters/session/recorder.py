"""The session runner's recorder: one session's events appended in order, riding out a
store that blinks (SPEC §8).

An append waits out an unavailable store for up to `store_retry_s` (`STORE_RETRY_S` by
default), retrying with backoff; what the store cannot take yet goes, in order, to the
session's evidence journal (adapters/session/journal.py), delivered ahead of anything appended
after it. Captured evidence is stored if the store takes it now, else journalled, never
waited for: its append is given `CAPTURE_APPEND_S`, then abandoned (its connection cut, its
transaction rolled back) while reading goes on. Every event offered gets its own id first,
so a batch stored twice (an abandoned append that did commit) is stored once. A journal
that cannot be written is gap `evidence_unjournalled` once the store is back. The recorder
follows the session's head, its last decision and whether it is closed, and folds the
closed session's view from what it appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from trialledger.adapters.session.journal import Journal, JournalRefused, deliver_journal
from trialledger.core import SessionView
from trialledger.core.errors import BadEvent, ConcurrencyConflict, EventIdConflict
from trialledger.core.machine import Session
from trialledger.core.replay import view_of
from trialledger.store import Ledger, StoredEvent
from trialledger.store.ledger import Seeded, StoreUnavailable
from trialledger.store.writer import Fence, now

STORE_RETRY_S = 120.0  # how long appends wait out a store that is unavailable
CAPTURE_APPEND_S = 5.0  # an append of captured evidence not answered by then is abandoned
UNJOURNALLED_MAX_EVENTS = 100_000  # held in memory while the journal cannot be written
T = TypeVar("T")


def refused_gap(events: Sequence[Mapping[str, Any]], refused: BadEvent) -> dict[str, Any]:
    """Gap `evidence_refused` in place of events the store refused as invalid: what they
    were and why (the store's one line, which names a field, never its value)."""
    kinds = ", ".join(dict.fromkeys(str(e.get("type")) for e in events))
    return {"type": "gap.recorded", "at": now(), "data": {
        "code": "evidence_refused",
        "detail": f"{len(events)} event(s) ({kinds}) the store refused: {refused}"[:2000]}}


class Unjournalled:
    """A journal that could not be written (disk full, a read-only folder): what is captured
    from then on is held in memory, in order, and gap `evidence_unjournalled` is stored
    before it once the store is back (past `UNJOURNALLED_MAX_EVENTS` held, later batches
    are dropped and counted in it)."""

    def __init__(self, why: OSError | JournalRefused) -> None:
        self.why = error_line(why)
        self.lost: Counter[str] = Counter()
        self.event_id, self.at = str(uuid.uuid4()), now()  # one gap, however often offered

    def cap(self, held: list[list[dict[str, Any]]]) -> None:
        """Drop the newest batches past the cap (never the last one left)."""
        while len(held) > 1 and sum(len(batch) for batch in held) > UNJOURNALLED_MAX_EVENTS:
            self.lost.update(str(e.get("type")) for e in held.pop())

    def gap(self, held: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
        """The gap, stored before the batches `held`."""
        kinds = Counter(str(e.get("type")) for batch in held for e in batch)
        detail = (f"the journal could not be written ({self.why}): {kinds.total()} event(s) "
                  f"captured while the store was away were held in memory only "
                  f"({_counted(kinds)})")
        if self.lost:
            detail += (f"; {self.lost.total()} more over the cap of "
                       f"{UNJOURNALLED_MAX_EVENTS} were dropped ({_counted(self.lost)})")
        return {"type": "gap.recorded", "at": self.at, "event_id": self.event_id, "data": {
            "code": "evidence_unjournalled", "detail": detail[:2000]}}


def _counted(kinds: Counter[str]) -> str:
    return ", ".join(f"{kind} x{count}" for kind, count in kinds.items())


def error_line(error: BaseException) -> str:
    """An OS error as one line (its path named, as the OS gave it)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _retrieved(task: asyncio.Future[Any]) -> None:
    """An abandoned append's outcome is nobody's to wait for: taken, so never reported."""
    if not task.cancelled():
        task.exception()


class Recorder:
    """Appends one session's events in order, tracking its head and last decision; what
    the store cannot take yet goes to the session's evidence journal (SPEC §8)."""

    def __init__(self, ledger: Ledger, seeded: Seeded, *,
                 store_retry_s: float = STORE_RETRY_S, fence: Fence | None = None) -> None:
        self.ledger, self.session_id, self.head = ledger, seeded.session_id, seeded.head_seq
        self.log = list(seeded.events)  # every event of the session, as the store returned it
        self.store_retry_s = store_retry_s
        self.fence = fence  # a job trial's lease: every append checks it
        self.action: str | None = None
        self.closed = False
        self._lock = anyio.Lock()  # Codex's stdout and the model proxy append concurrently
        self.capture_deadline = math.inf  # set when the agent ends (SPEC §8's budget)
        self.captured = False  # stderr and usage were taken (normally, or after a stop)
        self.journal = Journal(seeded.session_id, seeded.secrets)
        self._queue: list[list[dict[str, Any]]] = []  # captured, not yet stored or journalled
        self._retry_at, self._pause = 0.0, 0.25  # when the journal is next offered, backoff
        self._gave_up = False  # an append waited out `store_retry_s`: later ones do not
        self._refused: BadEvent | None = None  # a batch the store refused, now its gap
        self._unjournalled: Unjournalled | None = None  # after the journal, before the queue
        self.capture_append_s = CAPTURE_APPEND_S
        self._abandoned = False  # an append was abandoned: captures journal until delivered

    def left(self) -> float:
        """Seconds of this session's capture budget left."""
        return max(0.0, self.capture_deadline - anyio.current_time())

    async def append(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Append after the journal is drained, riding out a store that blinks: retried
        with backoff for up to `store_retry_s`, then left journalled (`StoreUnavailable`)."""
        await self._offer(events, wait=True)

    async def capture(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Captured evidence: stored if the store takes it now, else journalled — never
        waiting out the store (the capture budget bounds reads, not delivery)."""
        await self._offer(events, wait=False)

    async def _offer(self, events: Sequence[Mapping[str, Any]], *, wait: bool) -> None:
        if not events:
            return
        # Each event has its id before any attempt: stored twice, it is stored once (§2).
        self._queue.append([{**e, "event_id": e.get("event_id") or str(uuid.uuid4())}
                            for e in events])  # held before any wait: a caller
        since = anyio.current_time()
        async with self._lock:  # cancelled while it waits loses nothing
            try:
                await self._flush(wait=wait, since=since)
                if (refused := self._refused) is not None:
                    # Its gap is stored in its place; the session must not be decided from
                    # the rest (SPEC §8): the caller ends it as it ends any unforeseen error.
                    self._refused = None
                    raise refused
            except BaseException:  # cancelled, or the store gave up: all goes to the journal
                self._spill()
                raise

    def _behind(self) -> bool:
        """Whether something older than the queue waits for the store."""
        return self.journal.pending or self._unjournalled is not None

    def _spill(self) -> None:
        """Everything queued into the journal, in order (on disk when this returns); once
        a journal line cannot be written, the rest is held in memory for the store."""
        while self._queue and self._unjournalled is None:
            try:
                if not self.journal.pending:
                    self.journal.begin(self.head)
                self.journal.add(self._queue[0])
            except (OSError, JournalRefused) as error:
                self._unjournalled = Unjournalled(error)
            else:
                del self._queue[0]
        if self._unjournalled is not None:
            self._unjournalled.cap(self._queue)

    async def _flush(self, *, wait: bool, since: float) -> None:
        deadline = anyio.current_time() + (0.0 if self._gave_up else self.store_retry_s)
        while self._behind() or self._queue:
            if not self._behind():
                try:
                    self._took(await self._attempt(self._queue[0], bounded=not wait))
                    del self._queue[0]
                except StoreUnavailable:
                    self._spill()  # it may have committed: delivery skips what is stored
                    self._retry_at = anyio.current_time() + self._pause
                except BadEvent as refused:  # never storable: journalled, it would refuse
                    self._queue[0] = [refused_gap(self._queue[0], refused)]  # all after it
                    self._refused = refused
                continue
            self._spill()  # behind the journal, in order
            if not wait and (self._abandoned or anyio.current_time() < self._retry_at):
                return  # reading goes on; a later append delivers
            try:
                await self._catch_up(bounded=not wait)
                self._pause, self._abandoned = 0.25, False
                # The budget bounds reads, not delivery: the time this append waited
                # (for the lock too) is not taken from the reads after it (cleanup's check).
                self.capture_deadline += anyio.current_time() - since
            except StoreUnavailable:
                self._retry_at = anyio.current_time() + self._pause
                if not wait:
                    self._pause = min(self._pause * 2, 5.0)
                    return
                if anyio.current_time() + self._pause > deadline:
                    self._gave_up = True
                    raise
                await anyio.sleep(self._pause)
                self._pause = min(self._pause * 2, 5.0)

    async def _catch_up(self, *, bounded: bool) -> None:
        """Deliver the journal, then the gap of what could not be journalled."""
        if self.journal.pending:
            delivering = deliver_journal(self.ledger, self.session_id, self.journal.path,
                                         fence=self.fence)
            got = await (self._within(delivering) if bounded else delivering)
            self._took(got or [])
            self.journal.delivered()
        if self._unjournalled is not None:
            with contextlib.suppress(EventIdConflict):  # stored by an abandoned attempt
                gap = self._unjournalled.gap(self._queue)
                self._took(await self._attempt([gap], bounded=bounded))
            self._unjournalled = None

    async def _attempt(self, events: Sequence[Mapping[str, Any]], *,
                       bounded: bool = False) -> list[StoredEvent]:
        """One append; `bounded`: given `capture_append_s`, then abandoned."""
        return await (self._within(self._append(events)) if bounded else self._append(events))

    async def _append(self, events: Sequence[Mapping[str, Any]]) -> list[StoredEvent]:
        try:
            return await self.ledger.append(self.session_id, events, expected_seq=self.head,
                                             fence=self.fence)
        except ConcurrencyConflict:
            return await self._committed(events)  # acknowledged in a blink, or not

    async def _within(self, work: Awaitable[T]) -> T:
        """`work` (a store call) in a task of its own, waited for `capture_append_s`: past
        that it is abandoned — the store's write connections cut, so its transaction rolls
        back — and `StoreUnavailable` raised, while it ends on its own. (The store commits
        shielded from cancellation: only a task apart can be left behind.)"""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_retrieved)
        done, _ = await asyncio.wait({task}, timeout=self.capture_append_s)
        if task not in done:
            self.ledger.abandon()
            self._abandoned = True
            raise StoreUnavailable(f"the store did not answer within {self.capture_append_s:g}"
                                   f" s: the append was abandoned and journalled")
        return task.result()

    def _took(self, stored: Sequence[StoredEvent]) -> None:
        """Follow what the store now holds: head, log, last decision, closed."""
        fresh = [item for item in stored if (item.event.seq or 0) > self.head]
        if fresh:
            self.head = fresh[-1].event.seq or self.head
        self.log += fresh
        for item in fresh:
            if item.event.type == "outcome.decided":
                self.action = item.event.data.action
            elif item.event.type == "session.closed":
                self.closed = True

    async def _committed(self, events: Sequence[Mapping[str, Any]]) -> list[StoredEvent]:
        """After a lost acknowledgement: the events, if the store holds them after our head
        (a commit that landed while its answer did not); else the conflict stands."""
        after = await self.ledger.events(self.session_id, after_seq=self.head)
        if [s.event.type for s in after[:len(events)]] != [e["type"] for e in events]:
            raise ConcurrencyConflict(self.session_id, self.head,
                                      after[-1].event.seq or self.head if after else self.head)
        return after

    async def add(self, kind: str, data: Mapping[str, Any]) -> None:
        await self.append([{"type": kind, "at": now(), "data": dict(data)}])

    async def view(self) -> SessionView:
        """The session's view: folded from the events this recorder appended when they are
        the whole closed session (seq 1 … head, closed by us: nothing can follow), else
        read back from the store."""
        if self.closed and [s.event.seq for s in self.log] == list(range(1, self.head + 1)):
            session = Session(self.session_id)
            for stored in self.log:
                session.load(stored.event)
            return view_of(session)
        return await self.ledger.view(self.session_id)
