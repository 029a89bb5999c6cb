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

Answers are kept for the processes that follow too — a job's first task on a base asks
nothing a job before it asked — in root's own folder (`/var/lib/trialledger/image-ids`,
0700; one file per storage and name, holding the token and the answer), read only when
that folder is root's and nobody else's, and used only while the token is the same.
`peek` gives a kept answer without asking at all, so a warm build is found with no build
box made (adapters/images/build.py).

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

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trialledger.adapters.images.environment import _tool
from trialledger.adapters.places import read_small

CONFS = ("/etc/containers/storage.conf", "/usr/share/containers/storage.conf")
GRAPHROOT = Path("/var/lib/containers/storage")  # containers/storage's default for root
TOKEN_BYTES = 64  # containers/storage's lock file: its last writer's token
KEPT = Path("/var/lib/trialledger/image-ids")  # root's: answers kept for later processes
ANSWER_MAX_BYTES = 4096  # a kept answer: a token and an id or three
T = TypeVar("T")

_lock = threading.Lock()
_tokens: dict[tuple[str | None, ...], Path | None] = {}  # its configuration → token file
_known: dict[tuple[str, str], tuple[bytes, object]] = {}  # (token file, ref) → (token, answer)


def remembered(token_file: Path | None, ref: str, look: Callable[[], T],
               keep: Callable[[T], bool] = lambda _: True,
               load: Callable[[Any], T] = lambda answer: answer) -> T:
    """`look()`'s answer about `ref` in the storage whose write token is `token_file`,
    given again while the token is unchanged (by this process or a later one: `load`
    makes the answer again from its JSON); an answer `keep` refuses (and any answer when
    the token cannot be read) is not remembered."""
    token = _read_token(token_file) if token_file is not None else None
    if token is not None and (kept := _recall(str(token_file), ref, token, load)) is not None:
        return kept[0]
    answer = look()
    if token is not None and keep(answer):
        _keep(str(token_file), ref, token, answer)
    return answer


def peek(token_file: Path | None, ref: str,
         load: Callable[[Any], T] = lambda answer: answer) -> T | None:
    """The answer kept about `ref` while the storage is unchanged, without asking the
    engine; None when none is kept (or its token is another)."""
    token = _read_token(token_file) if token_file is not None else None
    if token is None:
        return None
    kept = _recall(str(token_file), ref, token, load)
    return kept[0] if kept is not None else None


def _recall(tokens: str, ref: str, token: bytes, load: Callable[[Any], T]
            ) -> tuple[T] | None:
    """The answer kept under `token`, from memory, else from root's folder."""
    with _lock:
        kept = _known.get((tokens, ref))
    if kept is not None and kept[0] == token:
        return (kept[1],)  # type: ignore[return-value]  # (stored by `remembered` as T)
    folder = _kept_folder()
    data = read_small(folder / _name(tokens, ref), ANSWER_MAX_BYTES) if folder else None
    try:
        record = json.loads(data or b"null")
        if not isinstance(record, dict) or bytes.fromhex(record["token"]) != token:
            return None
        answer = load(record["answer"])
    except (ValueError, KeyError, TypeError):
        return None
    with _lock:
        _known[(tokens, ref)] = (token, answer)
    return (answer,)


def _keep(tokens: str, ref: str, token: bytes, answer: object) -> None:
    """Keep an answer in memory and, for later processes, in root's folder (when this is
    root; a write that fails is only a look-up asked again)."""
    with _lock:
        _known[(tokens, ref)] = (token, answer)
    folder = _kept_folder(make=True)
    if folder is None:
        return
    try:
        fd, scratch = tempfile.mkstemp(prefix=".answer-", dir=folder)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump({"token": token.hex(), "answer": answer}, handle)
        os.replace(scratch, folder / _name(tokens, ref))
    except (OSError, TypeError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(scratch)


def _kept_folder(make: bool = False) -> Path | None:
    """Root's folder of kept answers: a real folder of root's no one else may write, else
    None (never trusted otherwise)."""
    if os.geteuid() != 0:
        return None
    try:
        if make:
            with contextlib.suppress(FileExistsError):
                KEPT.mkdir(mode=0o700, parents=True)
        info = os.lstat(KEPT)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        return None
    return KEPT


def _name(tokens: str, ref: str) -> str:
    return hashlib.sha256(f"{tokens}\0{ref}".encode()).hexdigest()


def token_file(graphroot: Path, driver: str) -> Path:
    """Where containers/storage keeps the write token of a storage's image store."""
    return graphroot / f"{driver}-images" / "images.lock"


def operator_image_id(engine: str, ref: str, what: str) -> str:
    """`engine image inspect --format {{.Id}} ref` in the operator's storage, as
    `sha256:…` (EnvironmentUnavailable when it has no such image), from memory while the
    storage is unchanged."""
    tokens = operator_token_file(engine)

    def look() -> str:
        ident = _tool([engine, "image", "inspect", "--format", "{{.Id}}", ref], what,
                      operator=True).strip()
        return ident if ident.startswith("sha256:") else f"sha256:{ident}"

    return remembered(tokens, ref, look,
                      keep=lambda ident: tokens is not None and _holds(tokens, ident))


def operator_token_file(engine: str) -> Path | None:
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
