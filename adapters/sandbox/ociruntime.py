"""Starting a container with an OCI runtime (SPEC §16): `run_once`, and `runtime_problem`,
`setup`'s check of which runtime can start a container here. `setup` records each runtime
it checked (`record_runtime`; a `--runtime` setup found unable is refused,
`recorded_problem`) and the first able one as range mode's runtime (`choose_runtime`),
which a run without `--runtime` uses (`chosen_runtime`; none: range mode is unavailable).

The probe runs what a range-mode session will: Docker's defaults (`oci.py`) in a user
namespace on a slot of the sandbox user's range (held, so no live session shares its ids),
with a pids cgroup, running `/usr/bin/true` from the host's `/usr` bound read-only (a
merged-/usr system, as Debian 12 is). Any refusal is returned with the runtime's words.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import secrets
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from trialledger.adapters.sandbox.cgroup import V1_PARENT
from trialledger.adapters.sandbox.hostside import SYSTEM_PATH, has_program, host_env, program
from trialledger.adapters.sandbox.identity import SANDBOX_USER, cache_dir
from trialledger.adapters.sandbox.idrange import SLOT, Slot, reserved_range
from trialledger.adapters.sandbox.oci import (
    Bind,
    ContainerSpec,
    Json,
    container_config,
    docker_caps,
    docker_nofile,
    docker_profile,
    docker_seccomp,
)

RUNTIMES = ("runc", "crun")
PROBE_DEADLINE_S = 30.0


def host_kernel() -> tuple[int, int] | None:
    """This kernel's (version, major revision), as moby compares `minKernel`: "6.1-rc3"
    and "6.1.0-amd64" are both (6, 1). None: a release that does not say."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(found[1]), int(found[2])) if found else None


def host_seccomp(caps: Sequence[str]) -> Json:
    """Docker's default profile converted for `caps` on this machine's arch and kernel:
    shared by every container with those capabilities (read it, never change it;
    `oci.container_config` copies it), so a session's start neither parses nor converts
    the profile again."""
    return _host_seccomp(tuple(caps))


@functools.lru_cache(maxsize=8)
def _host_seccomp(caps: tuple[str, ...]) -> Json:
    return docker_seccomp(docker_profile(), caps, os.uname().machine, host_kernel())


def host_nofile() -> tuple[int, int] | None:
    """Docker 25's RLIMIT_NOFILE, if this process's hard limit lets the runtime set it."""
    return docker_nofile(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def run_once(runtime: str, bundle: Path, config: Json,
             deadline_s: float) -> subprocess.CompletedProcess[str]:
    """Write `config` into `bundle` (its rootfs ready) and run it with `runtime` to its
    end, output captured, a state folder of its own; the container is gone afterwards,
    also when the deadline passes (subprocess.TimeoutExpired)."""
    binary = program(runtime)
    fd = os.open(bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as handle:  # resolved values may be secrets
        handle.write(json.dumps(config))
    name = f"trialledger-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="trialledger-oci-state-") as state:
        base = [binary, "--root", state]
        try:
            return subprocess.run([*base, "run", "--bundle", str(bundle), name],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  env=host_env(), timeout=deadline_s, check=False)
        finally:  # a runtime killed at the deadline leaves its container running
            subprocess.run([*base, "delete", "--force", name], capture_output=True,
                           env=host_env(), timeout=deadline_s, check=False)


def _probe_bundle(scratch: Path, owner: int) -> Path:
    """A rootfs of the host's merged-/usr links, owned by the slot's root."""
    rootfs = scratch / "rootfs"
    (rootfs / "usr").mkdir(parents=True)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink(f"/{name}"):
            (rootfs / name).symlink_to(os.readlink(f"/{name}"))
    for path in (scratch, rootfs, *rootfs.iterdir()):
        os.lchown(path, owner, owner)
    return rootfs


def runtime_problem(runtime: str) -> str | None:
    """Why `runtime` cannot start a range-mode container here (None: it can)."""
    if runtime not in RUNTIMES:
        return f"unknown OCI runtime {runtime!r} (expected one of {', '.join(RUNTIMES)})"
    if os.geteuid() != 0:
        return "the runner is not root"
    if not has_program(runtime):
        return f"{runtime} is not installed in {SYSTEM_PATH} (Debian package {runtime})"
    ids = reserved_range()
    if ids is None:
        return f"{SANDBOX_USER} has no subordinate range: run `trialledger setup`"
    slot = Slot.acquire(ids)
    try:
        with tempfile.TemporaryDirectory(prefix="trialledger-oci-probe-") as scratch:
            rootfs = _probe_bundle(Path(scratch), slot.start)
            caps = docker_caps(allowlist=False)
            spec = ContainerSpec(
                root=str(rootfs), args=("/usr/bin/true",), env={"PATH": SYSTEM_PATH},
                seccomp=host_seccomp(caps), caps=tuple(caps), ids=(slot.start, SLOT),
                binds=(Bind("/usr", "/usr", read_only=True),), nofile=host_nofile(),
                cgroups_path=f"/{V1_PARENT}/probe-{secrets.token_hex(6)}",
                limits={"pids": 16})
            try:
                done = run_once(runtime, Path(scratch), container_config(spec),
                                PROBE_DEADLINE_S)
            except subprocess.TimeoutExpired:
                return f"{runtime} did not finish a container in {PROBE_DEADLINE_S:.0f} s"
    finally:
        slot.release()
    if done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}"
        return f"{runtime} cannot start a container here: {said}"
    return None


def records_dir() -> Path:
    """Where `setup` records what it found about the runtimes (root's cache folder)."""
    return cache_dir()


def _record_path(runtime: str) -> Path:
    return records_dir() / f"runtime-{runtime}.json"


def _choice_path() -> Path:
    return records_dir() / "runtime.json"


def _write_record(path: Path, record: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    scratch = path.with_suffix(f".{secrets.token_hex(4)}")
    scratch.write_text(json.dumps(record), encoding="utf-8")
    os.replace(scratch, path)


def record_runtime(runtime: str) -> str | None:
    """`setup`'s check of `runtime`, recorded for later runs; why it cannot start a
    container here (None: it can)."""
    problem = runtime_problem(runtime)
    _write_record(_record_path(runtime), {"runtime": runtime, "problem": problem})
    return problem


def choose_runtime(asked: str | None) -> dict[str, str | None]:
    """`setup`'s choice of range mode's runtime: `asked` (else runc, then crun) checked
    and recorded, the first able one recorded as the runtime of runs without `--runtime`
    (none: why, for them to say). Each runtime checked → why it cannot (None: it can)."""
    found = {runtime: record_runtime(runtime) for runtime in ((asked,) if asked else RUNTIMES)}
    chosen = next((runtime for runtime, problem in found.items() if problem is None), None)
    _write_record(_choice_path(), {"runtime": chosen, "problem": None if chosen else
                                   "; ".join(str(problem) for problem in found.values())})
    return found


def chosen_runtime() -> tuple[str | None, str | None]:
    """Range mode's runtime when a run names none: (the one `setup` chose, None), or
    (None, why no runtime can start a container here). A `setup` from before the choice
    was recorded: the first runtime not recorded unable."""
    try:
        recorded = json.loads(_choice_path().read_text(encoding="utf-8"))
        runtime, problem = recorded["runtime"], recorded["problem"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    else:
        if runtime in RUNTIMES:
            return str(runtime), None
        if runtime is None and isinstance(problem, str) and problem:
            return None, problem
    problems = {runtime: recorded_problem(runtime) for runtime in RUNTIMES}
    able = [runtime for runtime, problem in problems.items() if problem is None]
    return (able[0], None) if able else (None, "; ".join(str(p) for p in problems.values()))


def recorded_problem(runtime: str) -> str | None:
    """Why `setup` found `runtime` unable to start a container here (None: it found it
    able, or never checked it: the session then says why if it fails)."""
    try:
        recorded = json.loads(_record_path(runtime).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    problem = recorded.get("problem") if isinstance(recorded, dict) else None
    return str(problem) if problem else None
