"""Programs the runner starts on the host side (docs/SPEC.md §11 "The host side").

A task's `env` tables are written by whoever wrote the task: `LD_PRELOAD`, `LD_AUDIT`,
`GCONV_PATH` or a `PATH` of the task's choosing would run the task's code in the host's
namespaces if they reached bwrap, slirp4netns, nft or any other dynamic program we start
before the sandbox exists. So every such program is found by absolute path in the
system's own folders, and runs with an environment built here from scratch; what the
task declares reaches only the process inside the sandbox, through `env_file` (read by
our static init there), never on a command line (`/proc/*/cmdline` is world-readable).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

# The system's folders only: never the runner's inherited PATH, never a task's.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_FILE_MAX_BYTES = 4 * 1024 * 1024  # init refuses more (init.c, ENV_MAX)


class ProgramMissing(OSError):
    """A host-side program is not installed in the system's folders."""


def find(name: str) -> str | None:
    """The absolute path of the system's `name`, or None."""
    found = shutil.which(name, path=SYSTEM_PATH)
    return os.path.abspath(found) if found is not None else None


def program(name: str) -> str:
    """The absolute path of the system's `name` (ProgramMissing: there is none)."""
    if (found := find(name)) is None:
        raise ProgramMissing(f"{name} is not installed in {SYSTEM_PATH}")
    return found


def has_program(name: str) -> bool:
    """Whether the system's folders hold `name`."""
    return find(name) is not None


def host_env(**extra: str) -> dict[str, str]:
    """The environment of a host-side program: the system PATH, a C locale, `extra`;
    nothing inherited, nothing of a task."""
    return {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", **extra}


def env_file(env: Mapping[str, str], first: str = "") -> int:
    """A 0600 anonymous file holding `env` as NUL-separated `NAME=VALUE` entries (`first`'s
    first: a reader of /proc/PID/environ's head finds it), rewound, for our init inside
    the sandbox to read (`--env-fd`); the caller closes it. Names with `=` or NUL and
    values with NUL are refused (ValueError): no process could hold them, and a NUL would
    split one entry into two. (Task.load refuses them first.)"""
    entries = []
    for name, value in sorted(env.items(), key=lambda item: item[0] != first):
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"an environment variable no process can hold: {name!r}")
        entries.append(f"{name}={value}\0".encode("utf-8", "surrogateescape"))
    data = b"".join(entries)
    if len(data) > ENV_FILE_MAX_BYTES:
        raise ValueError(f"the environment is {len(data)} bytes, past "
                         f"{ENV_FILE_MAX_BYTES} (the sandbox's init takes no more)")
    fd = os.memfd_create("trialledger-env", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
