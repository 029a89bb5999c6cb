"""The images a Dockerfile builds from (docs/SPEC.md §12 "A build's key").

Its `FROM` lines as the engine reads them: continuation lines joined (the `# escape=`
directive honoured), comments dropped, the global `ARG`s (those before the first `FROM`)
substituted with their defaults and the build's arguments, and the engine's automatic
platform arguments (`BUILDPLATFORM`, `TARGETARCH`, …) as this machine gives them. A `FROM`
naming an earlier stage refers to that stage and `scratch` to no image; every other one is
a base image, with the platform its `--platform` asks for (None: the engine's default).
Pure: nothing here runs a command.
"""

from __future__ import annotations

import platform
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

SUBSTITUTION = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)"
                          r"(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
DIRECTIVE = re.compile(r"#\s*escape\s*=\s*(\S)\s*$", re.IGNORECASE)
ARCHES = {"x86_64": ("amd64", ""), "amd64": ("amd64", ""), "aarch64": ("arm64", ""),
          "arm64": ("arm64", ""), "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"),
          "i686": ("386", ""), "i386": ("386", ""), "ppc64le": ("ppc64le", ""),
          "s390x": ("s390x", ""), "riscv64": ("riscv64", "")}


@dataclass(frozen=True)
class BaseImage:
    """One image a build reads: its name as the `FROM` line resolves, and the platform
    its `--platform` asks for (None when it names none)."""

    ref: str
    platform: str | None = None


def platform_args() -> dict[str, str]:
    """The engine's automatic platform arguments for a build on this machine (the build
    and the target platform are this machine's: the runner never cross-builds)."""
    machine = platform.machine().lower()
    arch, variant = ARCHES.get(machine, (machine, ""))
    whole = f"linux/{arch}" + (f"/{variant}" if variant else "")
    found: dict[str, str] = {}
    for side in ("BUILD", "TARGET"):
        found.update({f"{side}PLATFORM": whole, f"{side}OS": "linux", f"{side}ARCH": arch,
                      f"{side}VARIANT": variant})
    return found


def substitute(text: str, values: Mapping[str, str]) -> str:
    """`$NAME`, `${NAME}`, `${NAME:-word}` and `${NAME:+word}` as a Dockerfile expands them
    (an unset name is empty; `\\$` is a literal `$`)."""
    def one(found: re.Match[str]) -> str:
        if found[0] == "\\$":
            return "$"
        name = found["braced"] or found["bare"]
        value = values.get(name)
        if found["op"] == "-":
            return value if value else substitute(found["word"], values)
        if found["op"] == "+":
            return substitute(found["word"], values) if value else ""
        return value or ""

    return SUBSTITUTION.sub(one, text)


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """Each instruction as (KEYWORD, its arguments), continuation lines joined."""
    lines = dockerfile.splitlines()
    escape = "\\"
    for line in lines:  # parser directives: only at the very top, before anything else
        if not line.strip().startswith("#"):
            break
        if (directive := DIRECTIVE.match(line.strip())) is not None:
            escape = directive[1]
    found: list[tuple[str, str]] = []
    pending = ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue  # a comment or a blank line, even inside a continued instruction
        if stripped.endswith(escape):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        if whole:
            keyword, _, rest = whole.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    if pending.strip():
        keyword, _, rest = pending.strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
    return found


def _arg_pairs(text: str) -> list[tuple[str, str | None]]:
    """`ARG A=1 B` as [(A, 1), (B, None)]."""
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    return [(name, value if sep else None)
            for name, sep, value in (word.partition("=") for word in words)]


def base_images(dockerfile: str, build_args: Mapping[str, str] | None = None
                ) -> list[BaseImage]:
    """The images a Dockerfile's `FROM` lines read, in order, each once: names resolved
    with the global `ARG`s (their defaults, overridden by `build_args`) and the automatic
    platform arguments; not `scratch`, not an earlier stage."""
    given = dict(build_args or {})
    values = platform_args()
    stages: set[str] = set()
    found: list[BaseImage] = []
    seen_from = False
    for keyword, rest in instructions(dockerfile):
        if keyword == "ARG" and not seen_from:
            for name, default in _arg_pairs(rest):
                if name in given:
                    values[name] = given[name]
                elif default is not None:
                    values[name] = substitute(default, values)
            continue
        if keyword != "FROM":
            continue
        seen_from = True
        words = rest.split()
        asked: str | None = None
        while words and words[0].startswith("--"):
            option, _, value = words.pop(0).partition("=")
            if option == "--platform":
                asked = substitute(value, values) or None
        if not words:
            continue
        image = substitute(words[0], values)
        stage = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else None
        if image.lower() not in stages and image.lower() != "scratch" and image:
            base = BaseImage(image, asked)
            if base not in found:
                found.append(base)
        if stage is not None:
            stages.add(stage)
    return found
