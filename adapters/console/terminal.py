"""When the terminal goes away (docs/SPEC.md §13): a closed terminal (SIGHUP, then EIO on
every write) or a reader that left (EPIPE) never ends a runner with its sessions open.

While a command runs sessions (`watched`), stdout and stderr are `Guarded`: the first write
to one that fails points its descriptor at /dev/null — so nothing later writes there again,
Python's own flush at exit included — and tells whoever waits (`until_lost`, which
`until_signalled` treats as a SIGHUP: the running sessions get the signal's grace, are
closed `cancelled`, and the command exits 129). Writes are made from the event loop, the
live display's thread and logging alike, so a write that fails is told from any thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []
_lost = threading.Event()


def lost() -> bool:
    """Whether stdout or stderr could not be written since `watched` began."""
    return _lost.is_set()


def _tell() -> None:
    """Mark the terminal gone and tell every listener (once each: they unregister)."""
    with _lock:
        _lost.set()
        listeners = list(_listeners)
    for listener in listeners:
        listener()


@contextlib.contextmanager
def until_lost(listener: Callable[[], None]) -> Iterator[None]:
    """Call `listener` (from any thread) if the terminal is lost while inside — at once if it
    is lost already."""
    with _lock:
        _listeners.append(listener)
        already = _lost.is_set()
    try:
        if already:
            listener()
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


class Guarded:
    """A text stream that, once a write or flush fails, stops writing to its descriptor
    (pointed at /dev/null) and says so (`_tell`); every other attribute is the stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.silenced = False

    def write(self, text: str) -> int:
        """Write `text`, or drop it once the stream is gone."""
        if not self.silenced:
            try:
                return self.stream.write(text)
            except OSError:  # EIO (a closed terminal), EPIPE, a full disk: gone
                self._silence()
        return len(text)

    def flush(self) -> None:
        """Flush, or nothing once the stream is gone."""
        if not self.silenced:
            try:
                self.stream.flush()
            except OSError:
                self._silence()

    def _silence(self) -> None:
        self.silenced = True
        # What is still buffered, and Python's flush at exit, go to /dev/null: an exit
        # status is never changed by a flush that fails.
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)
            self.stream.flush()
        _tell()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def watched() -> Iterator[None]:
    """stdout and stderr `Guarded` while inside (then restored, unless replaced meanwhile);
    a descriptor found gone stays pointed at /dev/null."""
    before = sys.stdout, sys.stderr
    _lost.clear()
    sys.stdout, sys.stderr = Guarded(sys.stdout), Guarded(sys.stderr)
    try:
        yield
    finally:
        _lost.clear()  # told only to those waiting inside
        if isinstance(sys.stdout, Guarded):
            sys.stdout = before[0]
        if isinstance(sys.stderr, Guarded):
            sys.stderr = before[1]
