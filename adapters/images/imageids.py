"""Image ids of an engine storage, asked once per change of it (docs/SPEC.md §16).

A warm job asks, for every task, the operator's storage for the id of its `FROM` images
(is there a newer pull to copy into the build storage?) or of its `docker_image`, and the
build storage for the id its build key names: a `podman image inspect` each, ≈ 0.1–0.2 s
(more as a storage fills). An answer only changes when the storage's image store is
written, and containers/storage records every such write in a token of its own (the 64
bytes of `<graphroot>/<driver>-images/images.lock`, which podman itself reads to know
whether to reload). So an answer is kept with the token it was read under (read before the
look-up: a write meanwhile changes it) and given again while the token is the same: a
pull, a tag, a removal or a load in between changes it and the next look-up asks again.

The build storage's token file is where the runner configured that storage. The
operator's is placed from its configuration as podman reads it (for root, as the runner
runs: `CONTAINERS_STORAGE_CONF`, else /etc/containers/storage.conf, else
/usr/share/containers/storage.conf; `graphroot` default /var/lib/containers/storage;
`driver` the one image store there when the file names none) and trusted only once an
image the engine named is seen in it (its folder in that image store). Anything else — the
driver or options set by the environment, docker, a storage that cannot be placed — is
never remembered: every look-up asks the engine. The build storage is the build user's: a
hostile build could keep its token while re-tagging, but it could as well rewrite a
layer under an unchanged id, so its ids were never more than the build user's word
(docs/security.md); the token is read without following a link and only compared.
"""

from __future__ import annotations

import os
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from trialledger.adapters.images.environment import _tool
from trialledger.adapters.places import read_small

CONFS = ("/etc/containers/storage.conf", "/usr/share/containers/storage.conf")
GRAPHROOT = Path("/var/lib/containers/storage")  # containers/storage's default for root
TOKEN_BYTES = 64  # containers/storage's lock file: its last writer's token
T = TypeVar("T")

_lock = threading.Lock()
_tokens: dict[tuple[str | None, ...], Path | None] = {}  # its configuration → token file
_known: dict[tuple[str, str], tuple[bytes, object]] = {}  # (token file, ref) → (token, answer)


def remembered(token_file: Path | None, ref: str, look: Callable[[], T],
               keep: Callable[[T], bool] = lambda _: True) -> T:
    """`look()`'s answer about `ref` in the storage whose write token is `token_file`,
    given again while the token is unchanged; an answer `keep` refuses (and any answer
    when the token cannot be read) is not remembered."""
    token = _read_token(token_file) if token_file is not None else None
    if token is not None:
        with _lock:
            kept = _known.get((str(token_file), ref))
        if kept is not None and kept[0] == token:
            return kept[1]  # type: ignore[return-value]  # (stored by this function as T)
    answer = look()
    if token is not None and keep(answer):
        with _lock:
            _known[(str(token_file), ref)] = (token, answer)
    return answer


def token_file(graphroot: Path, driver: str) -> Path:
    """Where containers/storage keeps the write token of a storage's image store."""
    return graphroot / f"{driver}-images" / "images.lock"


def operator_image_id(engine: str, ref: str, what: str) -> str:
    """`engine image inspect --format {{.Id}} ref` in the operator's storage, as
    `sha256:…` (EnvironmentUnavailable when it has no such image), from memory while the
    storage is unchanged."""
    tokens = _operator_token_file(engine)

    def look() -> str:
        ident = _tool([engine, "image", "inspect", "--format", "{{.Id}}", ref], what,
                      operator=True).strip()
        return ident if ident.startswith("sha256:") else f"sha256:{ident}"

    return remembered(tokens, ref, look,
                      keep=lambda ident: tokens is not None and _holds(tokens, ident))


def _operator_token_file(engine: str) -> Path | None:
    """The write token of the image store `engine` reads, as its configuration places
    it; None when it cannot be placed (then nothing is remembered)."""
    if engine != "podman" or os.geteuid() != 0 or {"STORAGE_DRIVER", "STORAGE_OPTS"} & set(
            os.environ):
        return None
    key = (os.environ.get("CONTAINERS_STORAGE_CONF"),)
    with _lock:
        if key in _tokens:
            return _tokens[key]
    found = _place(key[0])
    with _lock:
        _tokens[key] = found
    return found


def _place(conf: str | None) -> Path | None:
    path = conf or next((c for c in CONFS if os.path.isfile(c)), None)
    storage: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                table = tomllib.load(handle).get("storage", {})
        except (OSError, tomllib.TOMLDecodeError):
            return None
        storage = table if isinstance(table, dict) else {}
    root = Path(str(storage.get("graphroot") or GRAPHROOT))
    driver = storage.get("driver")
    if not driver:
        stores = [p for p in root.glob("*-images") if (p / "images.lock").is_file()]
        return stores[0] / "images.lock" if len(stores) == 1 else None
    return token_file(root, str(driver))


def _read_token(path: Path) -> bytes | None:
    token = read_small(path, TOKEN_BYTES)
    return token if token is not None and len(token) == TOKEN_BYTES else None


def _holds(path: Path, ident: str) -> bool:
    """Whether the image store beside the token file `path` is the one that answered: it
    has the image's own folder."""
    return (path.parent / ident.removeprefix("sha256:")).is_dir()
