"""The task's collect hooks, run as Harbor 0.26 runs them (docs/SPEC.md §17 "Collect hooks").

task.toml's `[[verifier.collect]]` lists shell commands that snapshot the environment's
state into files after the agent and before the artifacts are collected, so an artifact
entry can then keep those files for the verifier. Each entry is read and validated as
Harbor's `VerifierCollectConfig` is: `command` (required), `service` (default `main`, else
one of the task's compose services: `check_services`), `timeout_sec` (default 60),
`user` (default the image's user). A key Harbor's model does not have is warned by name.

`run_hooks` runs a list of hooks in order (the task's; a step's are appended to them by
its caller) in the session's sandbox or a compose service's (adapters/session/verifying.py: `main`'s
first, then the artifacts, then each service's), each as its user (honoured in range mode; warned
elsewhere, as phase users are), under its timeout, with `bash -c` (`sh` without bash) in
the workdir and the environment a healthcheck gets. Each one's output (stdout and stderr
as they came, the last `OUTPUT_KEPT` bytes, scrubbed) is kept in the session's artifact
folder as `collect/<n>.txt` and listed on the verification event. A hook that exits
non-zero, times out or cannot start never ends the session: gap `collect_failed`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trialledger.adapters.session import artifacts, capture
from trialledger.adapters.tasks.config import (
    MAIN_SERVICE,
    TaskInvalid,
    UnsupportedField,
    wrong_type,
)
from trialledger.core import redact
from trialledger.store.writer import now

if TYPE_CHECKING:
    from trialledger.adapters.sandbox.local import LocalSandbox
    from trialledger.adapters.tasks.artifacts import Recording
    from trialledger.core.settings import Settings

NAME = "[[verifier.collect]]"  # how an entry is named in messages
TABLE_KEYS = ("command", "service", "timeout_sec", "user")  # Harbor's VerifierCollectConfig
DEFAULT_TIMEOUT_S = 60.0  # Harbor's default timeout_sec
SERVICE_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")  # Harbor's compose service names
FOLDER = "collect"  # the hooks' outputs, in the session's artifact folder
OUTPUT_KEPT = 256 * 1024  # bytes of a hook's output kept (its end)
SHOWN = 200  # characters of a hook's command in a gap's detail


@dataclass(frozen=True)
class CollectHook:
    """One `[[verifier.collect]]` entry."""

    command: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    user: str | None = None  # None: the image's user
    service: str = MAIN_SERVICE  # a compose service's name (task.py checks it is one)


def parse_collect(value: Any, where: str) -> tuple[tuple[CollectHook, ...], dict[str, str]]:
    """`[verifier] collect` as Harbor's model reads it, and the warned keys (name → why).
    A value Harbor refuses is `TaskInvalid` (one line); whether a hook's `service` exists
    is the task's to check (`check_services`)."""
    if not isinstance(value, list):
        raise wrong_type(where, "[verifier] collect", value, f"an array of tables ({NAME})")
    warned: dict[str, str] = {}
    return tuple(_hook(raw, index, where, warned) for index, raw in enumerate(value)), warned


def _hook(raw: Any, index: int, where: str, warned: dict[str, str]) -> CollectHook:
    named = f"{NAME} {index + 1}"
    if not isinstance(raw, dict):
        raise wrong_type(where, named, raw, "a table with a command")
    for key in sorted(raw.keys() - set(TABLE_KEYS)):
        warned[f"{NAME} {key}"] = "is not a field of Harbor 0.26's collect hook: ignored"
    command = raw.get("command")
    if not isinstance(command, str):
        raise wrong_type(where, f"{named} command", command, "a shell command (a string)")
    if "\0" in command:
        raise TaskInvalid(f"{where}: {named} command: a NUL byte, which no process can hold")
    service = raw.get("service", MAIN_SERVICE)
    if not isinstance(service, str) or not SERVICE_NAME.match(service.strip()):
        raise TaskInvalid(f"{where}: {named} service = {service!r}: expected a compose "
                          f"service name (letters, digits, '_', '.', '-')")
    timeout = raw.get("timeout_sec", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise wrong_type(where, f"{named} timeout_sec", timeout, "a positive number")
    user = raw.get("user")
    if user is not None and (isinstance(user, bool) or not isinstance(user, (str, int))
                             or str(user) == "" or "\0" in str(user)):
        raise wrong_type(where, f"{named} user", user,
                         "a user name, a uid, uid:gid or name:group")
    return CollectHook(command, float(timeout), None if user is None else str(user),
                       service.strip())


def check_services(hooks: Sequence[CollectHook], artifacts: Sequence[Any],
                   services: Sequence[str], where: str) -> None:
    """`UnsupportedField` naming the first hook or artifact whose `service` is neither
    `main` nor one of the task's compose `services`."""
    for index, hook in enumerate(hooks):
        if hook.service != MAIN_SERVICE and hook.service not in services:
            raise UnsupportedField(f"{where}: {NAME} {index + 1} service = {hook.service!r}: "
                                   f"the task has no such compose service")
    for artifact in artifacts:
        if artifact.service != MAIN_SERVICE and artifact.service not in services:
            raise UnsupportedField(f"{where}: artifacts: {artifact.source!r} from service "
                                   f"{artifact.service!r}: the task has no such compose "
                                   f"service")


async def run_hooks(rec: Recording, hooks: Sequence[CollectHook], sandbox: LocalSandbox,
                    settings: Settings, secrets: Sequence[str], env: Mapping[str, str],
                    first: int = 1) -> list[dict[str, Any]]:
    """Run `hooks` in order in `sandbox` (the session's, or a compose service's; none when
    the session's is lost), each one's output kept as `collect/<n>.txt` (n from `first`);
    a failure is gap `collect_failed`, never the session's end. The `files` entries of the
    outputs, for the verification event."""
    if not hooks or any(s.event.type == "sandbox.lost" for s in rec.log):
        return []
    image = sandbox.image
    shell = "bash" if image is None or image.has("bash") else "sh"
    folder = artifacts.session_folder(settings.sandbox_logs_dir, rec.session_id)
    files: list[dict[str, Any]] = []
    for number, hook in enumerate(hooks, start=first):
        try:
            ran = await sandbox.run_command([shell, "-c", hook.command], hook.timeout_s,
                                            env=env, user=hook.user, keep=OUTPUT_KEPT)
        except OSError as error:  # the user is not the image's, the container is gone
            await rec.append([_failed(hook, f"it could not start: {error}", secrets)])
            continue
        entry = capture.keep_text(folder, f"{FOLDER}/{number}.txt", ran.output,
                                  ran.left_out, secrets)
        if entry is not None:
            files.append(entry)
        if ran.code is None:
            await rec.append([_failed(hook, f"timeout after {hook.timeout_s:g} s", secrets)])
        elif ran.code != 0:
            await rec.append([_failed(hook, f"exit code {ran.code}", secrets)])
    return files


def _failed(hook: CollectHook, why: str, secrets: Sequence[str]) -> dict[str, Any]:
    """Gap `collect_failed` {detail: the hook's command (redacted, cut), and why}."""
    shown = redact(hook.command, secrets).replace("\n", " ")
    shown = shown if len(shown) <= SHOWN else f"{shown[:SHOWN - 1]}…"
    return {"type": "gap.recorded", "at": now(),
            "data": {"code": "collect_failed", "detail": f"`{shown}`: {why}"}}
