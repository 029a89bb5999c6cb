"""The checks before a session starts, so a run that cannot be recorded never starts.

The endpoint (SPEC §3): a mistyped or dead `--model-base-url` is refused in seconds
instead of burning a whole `timeout_s` per trial. `GET <base_url>/models` with the key,
10 s in all: any HTTP answer (whatever its status) passes; connection refused, a DNS or TLS
failure, or silence refuses.

The store (SPEC §8): a SQLite store whose disk has less than `STORE_ROOM` free could take
the seed and then not Codex's evidence; it is refused before anything is written.
"""

from __future__ import annotations

import http.client
import os
import shutil
import urllib.error
import urllib.request

import anyio

from trialledger.core.errors import TrialLedgerError
from trialledger.store.engine import sqlite_path
from trialledger.store.ledger import StoreUnavailable

PREFLIGHT_LIMIT_S = 10.0
STORE_ROOM = 16 * 1024 * 1024  # a session's events and the write-ahead log's growth


class StoreTooFull(StoreUnavailable):
    """The store's disk has too little room for a session's evidence (nothing started)."""


def check_store_room(db: str, room: int = STORE_ROOM) -> None:
    """Raise `StoreTooFull` when a SQLite store's disk has less than `room` bytes free
    (a PostgreSQL server's disk is its own: the seed's append is its check)."""
    path = sqlite_path(db)
    if not path or path == ":memory:":
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # an unreachable folder: opening the store says so
    if free < room:
        raise StoreTooFull(f"cannot use the database {path}: its disk has {free // 1024} KiB "
                           f"free, and a run needs {room // (1024 * 1024)} MiB; nothing was "
                           "started (free some space, or pass another --db)")


class EndpointUnreachable(TrialLedgerError):
    """The model endpoint gave no HTTP answer (the message says what happened)."""


def _get(url: str, api_key: str | None, timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(urllib.request.Request(url, headers=headers), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # an answer, whatever its status
    except urllib.error.URLError as error:
        raise EndpointUnreachable(f"the model endpoint does not answer {url}: "
                                  f"{error.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as error:
        raise EndpointUnreachable(f"the model endpoint does not answer {url}: "
                                  f"{error}") from None


async def check_endpoint(base_url: str, api_key: str | None,
                         limit_s: float = PREFLIGHT_LIMIT_S) -> None:
    """Raise `EndpointUnreachable` unless `GET <base_url>/models` gets an HTTP answer."""
    url = base_url.rstrip("/") + "/models"
    try:
        with anyio.fail_after(limit_s):
            await anyio.to_thread.run_sync(_get, url, api_key, limit_s,
                                           abandon_on_cancel=True)
    except TimeoutError:
        raise EndpointUnreachable(f"the model endpoint gave no answer to {url} within "
                                  f"{limit_s:g} s") from None
