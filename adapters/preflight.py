"""The endpoint check before the first session (SPEC §3): a mistyped or dead
`--model-base-url` is refused in seconds instead of burning a whole `timeout_s` per trial.

`GET <base_url>/models` with the key, 10 s in all: any HTTP answer (whatever its status)
passes; connection refused, a DNS or TLS failure, or silence refuses.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

import anyio

from trialledger.core.errors import TrialLedgerError

PREFLIGHT_LIMIT_S = 10.0


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
