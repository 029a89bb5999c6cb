"""Finding the Codex CLI, and which files of its install the sandbox mounts (SPEC §11): the
native binary alone.

`find_codex` takes `--codex-bin`, else `TRIALLEDGER_CODEX_BIN`, else `codex` on PATH;
`codex_version` is what the seed records of it.

The npm `codex` is a Node script that execs the native binary of its platform package
(`@openai/codex-<platform>/vendor/<triple>/bin/codex`, with `codex-path/rg` beside it);
the sandbox mounts just those two files at private paths, never the folder that holds
them (which may hold the store, the task or a home). A standalone native binary is
mounted alone. Anything else (a wrapper script) is mounted alone too; what it needs
besides must be granted explicitly as a read-only path.

The native binary is mounted from an **execute-only** copy (mode 0111, in the runner's
cache): a process whose program its user may not read is made non-dumpable by the kernel
at exec, so Codex's tools — the same uid, no capabilities — cannot open its
`/proc/<pid>/environ`, `fd/` or `mem`, ptrace it or take its descriptors with
`pidfd_getfd` (its stdout and the session token stay Codex's). A wrapper script must be
readable to run, so it gets no such protection.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trialledger.core.errors import TrialLedgerError

TRIPLES = {"x86_64": "x86_64-unknown-linux-musl", "aarch64": "aarch64-unknown-linux-musl"}
PLATFORM_PACKAGES = {"x86_64": "codex-linux-x64", "aarch64": "codex-linux-arm64"}
INSIDE = "/run/trialledger/codex"


@dataclass(frozen=True)
class CodexInstall:
    """The host files to mount for Codex, and where each appears inside the sandbox."""

    entrypoint: Path  # the file the sandbox runs
    helpers: dict[str, Path] = field(default_factory=dict)  # name → file, put on PATH
    native: bool = True  # False: a wrapper script

    @property
    def inside(self) -> str:
        """The entrypoint's path inside the sandbox."""
        return f"{INSIDE}/{self.entrypoint.name if not self.native else 'codex'}"

    @property
    def path_dir(self) -> str:
        """The folder inside the sandbox that holds the helpers (prepended to PATH)."""
        return f"{INSIDE}/path"

    def mounts(self) -> list[tuple[Path, str]]:
        """(host file, path inside) for every file to mount read-only."""
        found = [(self.entrypoint, self.inside)]
        found += [(path, f"{self.path_dir}/{name}") for name, path in self.helpers.items()]
        return found


def _is_elf(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == b"\x7fELF"


def _vendor_roots(script: Path) -> list[Path]:
    package = script.parent.parent  # …/@openai/codex
    machine = platform.machine()
    roots = [package / "vendor"]
    if machine in PLATFORM_PACKAGES:
        roots.insert(0, package.parent / PLATFORM_PACKAGES[machine] / "vendor")
    return roots


def _from_npm(script: Path) -> CodexInstall | None:
    triple = TRIPLES.get(platform.machine())
    if triple is None:
        return None
    for root in _vendor_roots(script):
        vendor = root / triple
        binary = vendor / "bin" / "codex"
        if not binary.is_file():
            continue
        path_dir = "codex-path"
        layout = vendor / "codex-package.json"
        if layout.is_file():
            path_dir = str(json.loads(layout.read_text(encoding="utf-8")).get("pathDir",
                                                                             path_dir))
        helpers = {p.name: p for p in (vendor / path_dir).glob("*") if p.is_file()}
        return CodexInstall(binary, helpers)
    return None


def codex_install(codex: str) -> CodexInstall:
    """Resolve `--codex-bin` (npm script, native binary or wrapper) to what is mounted."""
    real = Path(os.path.realpath(codex))
    if _is_elf(real):
        return CodexInstall(real)
    if real.name == "codex.js" and real.parent.name == "bin":
        found = _from_npm(real)
        if found is not None:
            return found
    return CodexInstall(real, native=False)


def execute_only(install: CodexInstall, cache: Path) -> CodexInstall:
    """The same install with its native binary replaced by an execute-only copy in
    `cache` (made once per binary: its path, size and modification time name the copy)."""
    if not install.native:
        return install
    info = install.entrypoint.stat()
    key = hashlib.sha256(f"{install.entrypoint}\0{info.st_size}\0{info.st_mtime_ns}"
                         .encode()).hexdigest()[:16]
    folder = cache / "codex"
    copy = folder / f"codex-{key}"
    if not copy.is_file():
        folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            made = Path(scratch) / "codex"
            shutil.copyfile(install.entrypoint, made)
            made.chmod(0o111)
            os.replace(made, copy)  # atomic: concurrent runners agree
    return dataclasses.replace(install, entrypoint=copy)


class CodexNotFound(TrialLedgerError):
    """No Codex CLI to run (the message says how to install it)."""


def find_codex(explicit: str | None = None) -> str:
    """`--codex-bin`, else `TRIALLEDGER_CODEX_BIN`, else `codex` on PATH."""
    candidate = explicit or os.environ.get("TRIALLEDGER_CODEX_BIN") or shutil.which("codex")
    if not candidate or not os.access(candidate, os.X_OK):
        raise CodexNotFound(
            "no Codex CLI found: pass --codex-bin, set TRIALLEDGER_CODEX_BIN, or put codex on "
            "PATH (npm install @openai/codex@0.171.0)")
    return os.path.abspath(candidate)


def codex_version(codex: str) -> str:
    """The version `codex --version` prints (`codex-cli 0.171.0` → `0.171.0`), asked once
    per binary (its path and modification time): asking costs a process start."""
    try:
        stamp = os.stat(os.path.realpath(codex)).st_mtime_ns
    except OSError:
        return "unknown"
    return _asked_version(codex, stamp)


@functools.lru_cache(maxsize=16)
def _asked_version(codex: str, _stamp: int) -> str:
    try:
        done = subprocess.run([codex, "--version"], capture_output=True, check=False,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = done.stdout.decode("utf-8", errors="replace").splitlines()
    words = next((line.split() for line in lines if line.startswith("codex-cli ")), [])
    return words[-1][:40] if done.returncode == 0 and len(words) == 2 else "unknown"


def install_paths(codex: str) -> list[Path]:
    """The npm install tree a wrapper script around the npm `codex` needs read-only (the
    runner itself mounts only the native binary; see `codex_install`)."""
    real = Path(os.path.realpath(codex))
    for parent in real.parents:
        if parent.name == "node_modules":
            return [parent]
    return [real.parent]
