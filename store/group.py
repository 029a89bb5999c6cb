"""Group commit: appends from concurrent callers queued and committed together.

Whoever finds no commit in flight leads: it commits everything queued so far, in batches,
until its own request is done, while every other caller sleeps on its own request and is
woken by the commit that served it. One transaction and one fsync serve a whole batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio


@dataclass(eq=False, kw_only=True)
class Waiter:
    """What the queue needs of a request: whether a commit carried it, and how it ended."""

    done: bool = False
    error: BaseException | None = None
    wake: asyncio.Future[None] | None = None  # made when the request waits for a leader


R = TypeVar("R", bound=Waiter)


# A waiting caller sleeps on a bare asyncio future, not an `anyio.Event` (which builds an
# asyncio event and looks up the running library per request): the store runs on asyncio
# only (its drivers do), and a wake-up per appended event is on the hot path.
def _wake(request: Waiter) -> None:
    if request.wake is not None and not request.wake.done():  # (done: it was cancelled)
        request.wake.set_result(None)


def _woken(request: Waiter) -> bool:
    return request.wake is not None and request.wake.done() and not request.wake.cancelled()


class GroupCommit(Generic[R]):
    """The queue of requests, and the lead that commits them with `commit(batch)` (which
    marks each request of the batch done, with its result or error)."""

    def __init__(self, commit: Callable[[list[R]], Awaitable[None]]) -> None:
        self.pending: list[R] = []
        self.leading = False  # a caller is committing the queue
        self._commit = commit

    async def submit(self, request: R) -> None:
        """Queue `request` and return once a commit has carried it (or raise what ended it).

        One caller at a time leads: it commits everything queued, in batches, until its own
        request is done, then hands the lead to the oldest waiting request. A caller
        cancelled while its request is still queued takes it back out (nothing of it is
        written), and passes the lead on if it had been handed it.
        """
        self.pending.append(request)
        if self.leading:
            request.wake = asyncio.get_running_loop().create_future()
            try:
                await request.wake
            except BaseException:
                if self._withdraw(request) and _woken(request):  # it was to lead next
                    self._hand_off()
                raise
        if not request.done:
            self.leading = True
            try:
                while not request.done:
                    await self._gather()
                    batch, self.pending = self.pending, []
                    with anyio.CancelScope(shield=True):  # a cancelled leader never aborts others
                        await self._commit(batch)
                    for served in batch:
                        if served is not request:
                            _wake(served)
            except BaseException:
                self._withdraw(request)  # cancelled while gathering: it would lead itself next
                raise
            finally:
                self._hand_off()
        if request.error is not None:
            raise request.error

    async def _gather(self) -> None:
        """Let the callers a commit just woke queue their next appends (the group commit)."""
        queued = -1
        while queued != len(self.pending):
            queued = len(self.pending)
            await anyio.sleep(0)

    def _withdraw(self, request: R) -> bool:
        """Take a request not yet in a commit back out of the queue; whether it was there."""
        if request in self.pending:
            self.pending.remove(request)
            return True
        return False

    def _hand_off(self) -> None:
        if self.pending:
            _wake(self.pending[0])  # it finds its request not done, and leads
        else:
            self.leading = False
