"""Docker's seccomp profile as a BPF program our init loads (docs/SPEC.md §16).

A container runc starts gets Docker's default profile from `config.json` (runc compiles
it); the processes the runner joins into that container (`init --join-fds`: the agent,
the verifier, the probe) get the same profile, compiled here by `ocifilter.c` (static
libseccomp) from the same conversion (`ociruntime.host_seccomp`), cached by its digest.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.identity import built_static, cache_dir
from trialledger.adapters.sandbox.oci import Json
from trialledger.adapters.sandbox.ociruntime import host_seccomp

SOURCE = Path(__file__).with_name("ocifilter.c")
BUILD_S = 120.0


def filter_text(seccomp: Json) -> str:
    """`linux.seccomp` (as `oci.docker_seccomp` converts it) in `ocifilter.c`'s line form."""
    def action(rule: Json, errno_key: str) -> str:
        name = str(rule.get("defaultAction" if errno_key == "defaultErrnoRet" else "action"))
        return f"{name.removeprefix('SCMP_ACT_')} {int(rule.get(errno_key) or 1)}"

    lines = [f"default {action(seccomp, 'defaultErrnoRet')}"]
    lines += [f"arch {arch.removeprefix('SCMP_ARCH_').lower()}"
              for arch in seccomp.get("architectures") or ()]
    for rule in seccomp.get("syscalls") or ():
        args = rule.get("args") or ()
        conditions = " ".join(f"{arg['index']} {str(arg['op']).removeprefix('SCMP_CMP_')} "
                              f"{int(arg['value'])} {int(arg.get('valueTwo', 0))}"
                              for arg in args)
        for name in rule["names"]:
            lines.append(f"rule {action(rule, 'errnoRet')} {name} {len(args)} {conditions}"
                         .rstrip())
    return "\n".join(lines) + "\n"


def _compiler() -> Path:
    """`ocifilter.c` built (once per source) beside the init."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return built_static(SOURCE, cache_dir() / f"ocifilter-{digest}",
                        "Docker's seccomp filter", libs=("-lseccomp",))


@functools.lru_cache(maxsize=8)
def _filter_source(caps: tuple[str, ...]) -> tuple[str, str]:
    """The compiler's input for `caps`, and the digest its program is cached by (once per
    process: every joined process of every session would convert it again)."""
    text = filter_text(host_seccomp(caps))
    return text, hashlib.sha256(SOURCE.read_bytes() + text.encode()).hexdigest()[:16]


def docker_filter(caps: Sequence[str]) -> Path:
    """Docker's profile for a container whose capabilities are `caps`, as classic BPF
    (built now if missing)."""
    text, digest = _filter_source(tuple(caps))
    target = cache_dir() / f"oci-seccomp-{digest}.bpf"
    if target.is_file():
        return target
    compiler = _compiler()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / "filter.bpf"
        with built.open("wb") as out:
            done = subprocess.run([str(compiler)], input=text.encode(), stdout=out,
                                  stderr=subprocess.PIPE, check=False, timeout=BUILD_S)
        if done.returncode != 0 or built.stat().st_size == 0:
            raise SandboxRefused(f"compiling Docker's seccomp profile failed: "
                                 f"{done.stderr.decode(errors='replace').strip()[-300:]}")
        built.chmod(0o644)
        os.replace(built, target)
    return target
