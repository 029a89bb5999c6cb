"""The images a Dockerfile builds from (docs/SPEC.md §12 "A build's key").

Its `FROM` lines as the engine reads them: continuation lines joined (the `# escape=`
directive honoured), comments dropped, the global `ARG`s (those before the first `FROM`)
substituted with their defaults and the build's arguments, and the engine's automatic
platform arguments (`BUILDPLATFORM`, `TARGETARCH`, …) as this machine gives them. A `FROM`
naming an earlier stage refers to that stage and `scratch` to no image; every other one is
a base image, with the platform its `--platform` asks for (None: the engine's default).

Here-documents (`RUN <<EOF`, `RUN cat > f <<'EOF'`, BuildKit's Dockerfile syntax 1.4, which
Docker builds by default) are rewritten for the engine here, whose Dockerfile parser
(buildah 1.28) has none: each such `RUN` becomes the exec form of what BuildKit hands its
shell, each such `COPY` a copy of files made from them (`for_engine`); `COPY --link` and
`RUN --network=default`, which it refuses and whose leaving out changes nothing the image
holds, lose those flags. Pure: nothing here runs a command.
"""

from __future__ import annotations

import itertools
import json
import platform
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

SUBSTITUTION = re.compile(r"\\\$|\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)"
                          r"(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
DIRECTIVE = re.compile(r"#\s*([a-z][a-z0-9]*)\s*=\s*(\S+)\s*$", re.IGNORECASE)
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


def _escape(lines: list[str]) -> str:
    """The line-continuation character: `\\`, unless an `# escape=` parser directive names
    another (directives are read only while every line so far is one, as BuildKit reads
    them; a byte-order mark before the first is ignored)."""
    escape = "\\"
    for index, line in enumerate(lines):
        directive = DIRECTIVE.match(line.lstrip("\ufeff" if index == 0 else "").strip())
        if directive is None:
            break
        if directive[1].lower() == "escape" and len(directive[2]) == 1:
            escape = directive[2]
    return escape


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """Each instruction as (KEYWORD, its arguments), continuation lines joined."""
    lines = dockerfile.splitlines()
    escape = _escape(lines)
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
            keyword, *rest = whole.split(None, 1)
            found.append((keyword.upper(), rest[0].strip() if rest else ""))
    if pending.strip():
        keyword, *rest = pending.split(None, 1)
        found.append((keyword.upper(), rest[0].strip() if rest else ""))
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


# --- here-documents ----------------------------------------------------------------------

HEREDOC = re.compile(r"^(\d*)<<(-?)([^<]+)$")  # a word of the instruction (BuildKit's test)
SHELL = ("/bin/sh", "-c")  # what a shell-form RUN runs under, unless a SHELL says otherwise
INLINE = "trialledger-heredocs"  # the build context `COPY <<EOF` files are copied from
# Flags BuildKit takes that the engine refuses, and whose leaving out changes nothing the
# image holds: `RUN --network=default` is the network a RUN has anyway; `COPY --link` and
# `ADD --link` (any value) change only how BuildKit caches the layer.
DROPPED = {"RUN": ("--network=default",)}


class HeredocUnsupported(ValueError):
    """A here-document the rewrite cannot give the engine (`_copied`'s refusals, or a body
    with no end)."""


@dataclass(frozen=True)
class _Heredoc:
    name: str
    chomp: bool  # `<<-`: leading tabs removed from each line


def _words(text: str) -> list[str]:
    """`text` split at blanks outside quotes, the quotes kept (BuildKit's raw words)."""
    words: list[str] = []
    current, quote, escaped = "", "", False
    for char in text:
        if escaped:
            current, escaped = current + char, False
        elif char == "\\" and quote != "'":
            current, escaped = current + char, True
        elif quote:
            current += char
            quote = "" if char == quote else quote
        elif char in "'\"":
            current, quote = current + char, char
        elif char.isspace():
            if current:
                words.append(current)
            current = ""
        else:
            current += char
    return [*words, current] if current else words


def _unquoted(word: str) -> str:
    """A delimiter as the shell reads it: quotes removed, a backslash taking the next
    character as it is (`'EOF'`, `"EOF"`, `\\EOF` and `E"OF"` all end at `EOF`)."""
    try:
        return "".join(shlex.split(word))
    except ValueError:  # (a quote left open: the word as it is)
        return word


def _heredoc(word: str) -> _Heredoc | None:
    """The here-document a word opens (`<<EOF`, `<<-'EOF'`, `2<<"EOF"`), else None."""
    if (found := HEREDOC.match(word)) is None:
        return None
    name = _unquoted(found[3])
    return _Heredoc(name, found[2] == "-") if name else None


def _chomped(data: str) -> str:
    """`<<-`: the tabs that begin each line (a line begins after a newline only) taken."""
    return re.sub(r"(?m)^\t+", "", data)


def _strings(text: str) -> list[str] | None:
    """A JSON array of strings (an exec form, a SHELL), else None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) \
        else None


def _shell_text(command: str, docs: Sequence[_Heredoc], bodies: Sequence[str]) -> str:
    """What BuildKit's `dispatchRun` gives the shell for a shell-form RUN with
    here-documents: a command that is one here-document alone runs its body (one starting
    `#!` as a program of its own, made executable); any other is the command line, each
    body and its delimiter after it, for the shell to read as here-documents."""
    if len(docs) == 1 and len(_words(command)) == 1 and _heredoc(command) is not None:
        body = _chomped(bodies[0]) if docs[0].chomp else bodies[0]
        if not bodies[0].startswith("#!"):  # (BuildKit looks before chomping)
            return body
        end = "TRIALLEDGER_HEREDOC"
        while end in body.splitlines():
            end += "_"
        return (f'f=$(mktemp) && cat > "$f" <<\'{end}\'\n{body}{end}\n'
                f'chmod 755 "$f" && "$f"; s=$?; rm -f "$f"; exit $s')
    return command + "".join(f"\n{body}{doc.name}" for doc, body in zip(docs, bodies,
                                                                         strict=True))


def _bodies(lines: list[str], index: int, docs: Sequence[_Heredoc]) -> tuple[list[str], int]:
    """Each here-document's body (its lines, each ending in a newline) read from
    `lines[index:]`, and the index after the last delimiter."""
    bodies = []
    for doc in docs:
        body = []
        while True:
            if index >= len(lines):
                raise HeredocUnsupported(f"the here-document <<{doc.name} has no line "
                                         f"{doc.name} to end it")
            raw, index = lines[index], index + 1
            line = raw.rstrip("\r")  # (compared without its line end; kept with it)
            if (line.lstrip("\t") if doc.chomp else line) == doc.name:
                break
            body.append(raw + "\n")
        bodies.append("".join(body))
    return bodies, index


def _after(rest: str, flags: Sequence[str]) -> str:
    """An instruction's arguments after its leading flags."""
    command = rest.lstrip()
    for flag in flags:
        command = command[len(flag):].lstrip()
    return command


class ForEngine(NamedTuple):
    """A Dockerfile as the engine can build it, and the files its `COPY` here-documents
    became (path in the `INLINE` build context → content)."""

    text: str
    files: dict[str, str]


def heredocs(dockerfile: str) -> str:
    """`for_engine(dockerfile).text`."""
    return for_engine(dockerfile).text


def _copied(keyword: str, flags: list[str], words: list[str], docs: Sequence[_Heredoc],
            bodies: Sequence[str], files: dict[str, str]) -> str:
    """A `COPY`/`ADD` whose sources are here-documents as a `COPY` from the `INLINE` build
    context, each body a file there named as BuildKit names it (its delimiter; 0644 before
    `--chmod`), chomped for `<<-`; an unquoted one that BuildKit would expand (a `$` or a
    `\\` in it) is refused, as is mixing them with other sources or another `--from`."""
    sources = words[len(flags):-1]
    if (len(sources) != len(docs) or any(_heredoc(word) is None for word in sources)
            or any(f.startswith("--from=") for f in flags)):
        raise HeredocUnsupported(f"{keyword} <<{docs[0].name}: here-documents mixed with "
                                 f"other sources or --from are not supported here")
    named = []
    for word, doc, body in zip(sources, docs, bodies, strict=True):
        if (not re.fullmatch(r"[A-Za-z0-9._-]{1,255}", doc.name)
                or doc.name in (".", "..")):
            raise HeredocUnsupported(f"{keyword} <<{doc.name[:64]}: not a file name")
        quoted = "'" in word or '"' in word  # (BuildKit's test: `<<\\EOF` is expanded)
        if not quoted and ("$" in body or "\\" in body):
            raise HeredocUnsupported(
                f"{keyword} <<{doc.name}: BuildKit expands an unquoted here-document with "
                f"the stage's ARG and ENV values, which are not known here; quote its "
                f"delimiter (<<'{doc.name}') to copy it as written")
        path = f"{len(files)}/{doc.name}"
        files[path] = _chomped(body) if doc.chomp else body
        named.append(path)
    kept = [f for f in flags if f.split("=", 1)[0] != "--link"]
    return " ".join(["COPY", f"--from={INLINE}", *kept, *named, words[-1]])


def for_engine(dockerfile: str) -> ForEngine:
    """`dockerfile` as the engine can build it: every shell-form `RUN` that has
    here-documents (and their bodies) rewritten as the exec form of what BuildKit runs for
    it, under the stage's `SHELL` (an earlier stage's when it builds on one; else
    `/bin/sh -c`); every `COPY`/`ADD` of here-documents a `COPY` of files made from them
    (`_copied`); the `DROPPED` flags left out; the rest as it was, byte for byte (the text
    itself when nothing is rewritten). HeredocUnsupported for what cannot be given so, or
    a body whose delimiter never comes."""
    files: dict[str, str] = {}
    lines = dockerfile.split("\n")
    escape = _escape(lines)
    continued = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[str] = []
    shell, stage, shells = list(SHELL), "", {}
    held: list[str] = []  # the raw lines of the instruction being read
    joined = ""  # its text so far, as BuildKit joins it
    index, rewritten = 0, False
    while index < len(lines):
        line = lines[index]
        index += 1
        held.append(line)
        text = line.removesuffix("\r")
        if not text.strip() or text.lstrip().startswith("#"):
            if len(held) == 1:
                out.append(held.pop())
            continue  # (inside a continued instruction: skipped, as BuildKit skips it)
        text = text if joined else text.lstrip()
        if (cut := continued.search(text)) is not None:
            joined += text[:cut.start()]
            continue
        whole, joined = joined + text, ""
        keyword, *after = whole.split(None, 1)
        keyword, rest = keyword.upper(), after[0] if after else ""
        if keyword == "FROM":
            shells[stage] = shell
            words = rest.split()
            while words and words[0].startswith("--"):
                words.pop(0)
            base = words[0].lower() if words else ""
            stage = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else ""
            shell = list(shells.get(base, SHELL)) if base else list(SHELL)
        elif keyword == "SHELL":
            shell = _strings(rest) or list(SHELL)
        words = _words(rest)
        docs = [doc for word in words if (doc := _heredoc(word)) is not None]
        flags = list(itertools.takewhile(lambda word: word.startswith("--"), words))
        dropped = [f for f in flags if f in DROPPED.get(keyword, ())
                   or (f.split("=", 1)[0] == "--link" and keyword in ("COPY", "ADD"))]
        if dropped and not docs:  # a flag the engine refuses and BuildKit's result lacks
            out.append(" ".join([keyword, *(f for f in flags if f not in dropped),
                                 _after(rest, flags)]))
            held, rewritten = [], True
            continue
        if not docs or keyword not in ("RUN", "COPY", "ADD") or _strings(rest) is not None:
            out.extend(held)
            held = []
            continue
        bodies, index = _bodies(lines, index, docs)
        if keyword != "RUN":
            out.append(_copied(keyword, flags, words, docs, bodies, files))
            held, rewritten = [], True
            continue
        text = _shell_text(_after(rest, flags), docs, bodies)
        out.append(" ".join(["RUN", *(f for f in flags if f not in dropped),
                             json.dumps([*shell, text])]))
        held, rewritten = [], True
    out.extend(held)
    if files and INLINE in dockerfile:  # (a stage or mount of that name would shadow it)
        raise HeredocUnsupported(f"the name {INLINE} is the rewrite's own: a Dockerfile "
                                 f"that copies here-documents cannot use it")
    return ForEngine("\n".join(out) if rewritten else dockerfile, files)
