"""Here-documents in a Dockerfile (BuildKit's syntax, which Docker builds by default), which
this machine's engine cannot parse: each shell-form `RUN` that has them is given to the
engine as the exec form of what BuildKit hands its shell (adapters/images/dockerfile.py),
then built for real from the tests' Debian image; BuildKit's flags the engine refuses and
the image never shows (`COPY --link`, `RUN --network=default`) are left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import images
from tests.images import module_private_storage  # noqa: F401 (every engine call: the tests' storage)
from trialledger.adapters.images.dockerfile import (
    BaseImage,
    HeredocUnsupported,
    base_images,
    for_engine,
    heredocs,
)
from trialledger.adapters.images.environment import Cache, EnvironmentUnavailable, Source
from trialledger.adapters.images.prepare import prepare


def _run(line: str) -> list[str]:
    """The exec form a rewritten `RUN` line holds (its flags before it)."""
    assert line.startswith("RUN ")
    return [str(word) for word in json.loads(line[line.index("["):])]


@pytest.mark.parametrize(("dockerfile", "runs"), [
    # a command with a here-document: the line, the body and its delimiter, to the shell
    ("RUN cat > /f <<'EOF'\n---\nname: $HOME\nEOF\n",
     ["/bin/sh", "-c", "cat > /f <<'EOF'\n---\nname: $HOME\nEOF"]),
    ("RUN python3 - <<PY\nprint(1)\nPY\n", ["/bin/sh", "-c", "python3 - <<PY\nprint(1)\nPY"]),
    # two of them, in order
    ("RUN cat <<A > /a && cat <<B > /b\na\nA\nb\nB\n",
     ["/bin/sh", "-c", "cat <<A > /a && cat <<B > /b\na\nA\nb\nB"]),
    # a here-document alone: its body is the script
    ("RUN <<EOF\nset -e\necho one\nEOF\n", ["/bin/sh", "-c", "set -e\necho one\n"]),
    # `<<-`: the body's leading tabs go (the delimiter may be indented by tabs too)
    ("RUN <<-EOF\n\techo a\n\t\techo b\n\tEOF\n", ["/bin/sh", "-c", "echo a\necho b\n"]),
    # a here-document fed to a command named after it
    ("RUN <<EOT bash\necho $BASH_VERSION\nEOT\n",
     ["/bin/sh", "-c", "<<EOT bash\necho $BASH_VERSION\nEOT"]),
    # the stage's SHELL is the one it runs under
    ('SHELL ["/bin/bash", "-eu", "-c"]\nRUN <<EOF\necho a\nEOF\n',
     ["/bin/bash", "-eu", "-c", "echo a\n"]),
])
def test_a_run_with_here_documents_is_what_buildkit_gives_its_shell(
        dockerfile: str, runs: list[str]) -> None:
    rewritten = heredocs("FROM debian\n" + dockerfile + "RUN echo after\n").splitlines()
    assert rewritten[0] == "FROM debian" and rewritten[-1] == "RUN echo after"
    assert _run(next(line for line in rewritten if line.startswith("RUN "))) == runs


@pytest.mark.parametrize(("dockerfile", "runs"), [
    # a delimiter as the shell unquotes it: a backslash, quotes inside the word
    ("RUN cat <<\\EOF > /f\n$X\nEOF\n", ["/bin/sh", "-c", "cat <<\\EOF > /f\n$X\nEOF"]),
    ('RUN cat <<E"OF" > /f\nx\nEOF\n', ["/bin/sh", "-c", 'cat <<E"OF" > /f\nx\nEOF']),
    # a line that starts with `[` but is no JSON array is a shell form
    ("RUN [ -d /x ] || cat <<EOF > /f\nx\nEOF\n",
     ["/bin/sh", "-c", "[ -d /x ] || cat <<EOF > /f\nx\nEOF"]),
    # continuation lines joined as BuildKit joins them: nothing added, nothing taken
    ("RUN cat <<EOF > /etc/con\\\nfig\nx\nEOF\n",
     ["/bin/sh", "-c", "cat <<EOF > /etc/config\nx\nEOF"]),
    ("RUN\tcat <<EOF > /f\nx\nEOF\n", ["/bin/sh", "-c", "cat <<EOF > /f\nx\nEOF"]),
    # `<<-` over a tab-indented `#!`: BuildKit looks for the `#!` before taking the tabs
    ("RUN <<-EOF\n\t#!/usr/bin/env python3\n\tprint(1)\n\tEOF\n",
     ["/bin/sh", "-c", "#!/usr/bin/env python3\nprint(1)\n"]),
    # a stage built on an earlier one keeps its SHELL; a SHELL that is no list of strings
    # is the default
    ('SHELL ["/bin/bash", "-c"]\nFROM build AS next\nRUN <<EOF\necho a\nEOF\n',
     ["/bin/bash", "-c", "echo a\n"]),
    ("SHELL " + "[" * 5000 + "\nRUN <<EOF\necho a\nEOF\n", ["/bin/sh", "-c", "echo a\n"]),
])
def test_the_cases_a_review_found_are_read_as_buildkit_reads_them(
        dockerfile: str, runs: list[str]) -> None:
    rewritten = heredocs("FROM debian AS build\n" + dockerfile).splitlines()
    assert _run(next(line for line in rewritten if line.startswith("RUN "))) == runs


@given(st.lists(st.sampled_from(["a", " ", "\t", "\n", "\r", "\x0c", "\u2028", "\\", "'",
                                  '"', "#", "[", "RUN ", "FROM x\n", "SHELL [", "<", "é"]))
       .map("".join))
def test_a_dockerfile_without_here_documents_is_given_as_it_is(text: str) -> None:
    """Byte for byte: no line ends the rewrite adds or takes (a form feed, a carriage
    return, a line separator are the file's own)."""
    if "<<" not in text:
        assert heredocs(text) == text


def test_an_escape_directive_counts_only_at_the_very_top() -> None:
    late = "# a comment\n# escape=`\nFROM debian\nRUN cat <<EOF > /f `\nx\nEOF\n"
    assert _run(heredocs(late).splitlines()[3])[-1] == "cat <<EOF > /f `\nx\nEOF"
    top = "\ufeff# escape=`\nFROM debian\nRUN cat <<EOF `\n > /f\nx\nEOF\n"
    assert _run(heredocs(top).splitlines()[2])[-1] == "cat <<EOF  > /f\nx\nEOF"


@pytest.mark.parametrize(("line", "given"), [
    ("COPY --link a /b", "COPY a /b"),
    ("COPY --chown=1:1 --link=true --chmod=755 a /b", "COPY --chown=1:1 --chmod=755 a /b"),
    ('ADD --link=false ["a b", "/c"]', 'ADD ["a b", "/c"]'),
    ("RUN --network=default --mount=type=cache,target=/c make",
     "RUN --mount=type=cache,target=/c make"),
    ("RUN --network=none true", "RUN --network=none true"),  # (the engine says why not)
    ("COPY a /--link", "COPY a /--link"),
])
def test_flags_the_engine_refuses_and_the_image_never_shows_are_left_out(
        line: str, given: str) -> None:
    assert heredocs(f"FROM debian\n{line}\n").splitlines()[1] == given


def test_a_here_document_that_is_a_program_runs_as_one_and_leaves_nothing() -> None:
    line = heredocs("RUN <<EOF\n#!/usr/bin/env python3\nprint(1)\nEOF\n").strip()
    shell, flag, script = _run(line)
    assert [shell, flag] == ["/bin/sh", "-c"]
    assert "#!/usr/bin/env python3\nprint(1)\n" in script
    assert 'chmod 755 "$f" && "$f"' in script and 'rm -f "$f"' in script


def test_flags_stay_before_the_exec_form_and_the_rest_is_untouched() -> None:
    dockerfile = ("# escape=`\nFROM debian AS build\nRUN --mount=type=cache,target=/c `\n"
                  "    <<EOF\necho $X\nEOF\nRUN echo \"<<EOF\" && echo plain\n"
                  'RUN ["cat", "<<EOF"]\nCOPY a /b\n')
    lines = heredocs(dockerfile).splitlines()
    assert lines[:2] == ["# escape=`", "FROM debian AS build"]
    assert lines[2].startswith("RUN --mount=type=cache,target=/c [")
    assert _run(lines[2]) == ["/bin/sh", "-c", "echo $X\n"]
    assert lines[3:] == ['RUN echo "<<EOF" && echo plain', 'RUN ["cat", "<<EOF"]', "COPY a /b"]
    unchanged = "FROM debian\nRUN echo a \\\n  && echo b\n# a comment\n"
    assert heredocs(unchanged) == unchanged


def test_a_body_is_never_read_as_instructions() -> None:
    """A `FROM` inside a here-document is the body's text, not a base image of the build."""
    dockerfile = "FROM debian\nRUN cat > /Dockerfile <<'EOF'\nFROM evil:latest\nEOF\n"
    assert base_images(heredocs(dockerfile)) == [BaseImage("debian")]


@pytest.mark.parametrize(("dockerfile", "line", "files"), [
    ("COPY <<EOF /etc/motd\nhi\nEOF\n", "COPY --from=trialledger-heredocs 0/EOF /etc/motd",
     {"0/EOF": "hi\n"}),
    # several, named as BuildKit names them (their delimiters), flags kept, --link not
    ("COPY --link --chmod=755 <<'run.sh' <<b.txt /opt/\n#!/bin/sh\nrun.sh\nb\nb.txt\n",
     "COPY --from=trialledger-heredocs --chmod=755 0/run.sh 1/b.txt /opt/",
     {"0/run.sh": "#!/bin/sh\n", "1/b.txt": "b\n"}),
    # ADD of a here-document is a COPY of it; `<<-` takes the tabs; a quoted one is as
    # written, `$` and all
    ("ADD <<-'EOF' /x\n\t$HOME\n\tEOF\n", "COPY --from=trialledger-heredocs 0/EOF /x",
     {"0/EOF": "$HOME\n"}),
    # a body keeps its line ends (a CRLF file's too) and tabs not at a line's start
    ("COPY <<'EOF' /x\r\nhi\r\nEOF\r\n", "COPY --from=trialledger-heredocs 0/EOF /x",
     {"0/EOF": "hi\r\n"}),
    ("COPY <<-'EOF' /x\n\ta\x0b\tb\nEOF\n", "COPY --from=trialledger-heredocs 0/EOF /x",
     {"0/EOF": "a\x0b\tb\n"}),
])
def test_a_copy_of_here_documents_is_a_copy_of_files_made_from_them(
        dockerfile: str, line: str, files: dict[str, str]) -> None:
    given = for_engine("FROM debian\n" + dockerfile + "RUN true\n")
    assert given.text.splitlines() == ["FROM debian", line, "RUN true"]
    assert given.files == files


@pytest.mark.parametrize(("dockerfile", "said"), [
    ("FROM debian\nCOPY <<EOF /etc/motd\n$HOME\nEOF\n", "quote its delimiter"),
    ("FROM debian\nCOPY <<EOF a.txt /opt/\nx\nEOF\n", "mixed with other sources"),
    ("FROM debian\nCOPY --from=build <<'EOF' /x\nx\nEOF\n", "mixed with other sources"),
    ("FROM debian\nCOPY a.txt <<'EOF'\nx\nEOF\n", "mixed with other sources"),
    # a backslash is no quote: BuildKit expands `<<\\EOF` too
    ("FROM debian\nCOPY <<\\EOF /x\n$HOME\nEOF\n", "quote its delimiter"),
    ("FROM debian\nCOPY <<" + "a" * 300 + " /x\nx\n" + "a" * 300 + "\n", "not a file name"),
    ("FROM debian AS trialledger-heredocs\nCOPY <<'EOF' /x\nx\nEOF\n", "rewrite's own"),
    ("FROM debian\nRUN cat <<EOF > /f\nno end\n", "has no line EOF"),
])
def test_what_cannot_be_rewritten_is_refused_by_name(dockerfile: str, said: str) -> None:
    with pytest.raises(HeredocUnsupported, match=said):
        heredocs(dockerfile)


BUILT = """FROM {base}
USER root
RUN cat > /skill.md <<'EOF'
---
name: $HOME
FROM nothing
EOF
RUN cat > /expanded <<EOF
$HOME
EOF
RUN <<EOF
set -e
echo one > /one
EOF
RUN <<'EOT' bash
echo "bash $BASH_VERSION" > /bash
EOT
RUN <<-EOF
\techo chomped > /chomped
\tEOF
RUN <<EOF
#!/bin/sh
echo "$0" > /script
EOF
RUN echo "<<EOF" > /quoted
COPY --link --chmod=640 data.txt /data.txt
RUN --network=default echo linked > /linked
COPY <<'EOF' /etc/motd
hello $X
EOF
COPY --chmod=755 <<run.sh /opt/
#!/bin/sh
echo ran
run.sh
RUN /opt/run.sh > /ran
COPY . /context/
"""


def test_a_dockerfile_with_here_documents_builds_as_docker_builds_it(tmp_path: Path) -> None:
    folder = tmp_path / "task"
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text(
        BUILT.format(base=images.podman_image(images.DEBIAN_REF)))
    (folder / "environment" / "data.txt").write_text("data\n")
    env = prepare(Source("dockerfile", "Dockerfile", folder, 600), Cache(tmp_path / "cache"),
                  owner=None)
    assert env.root is not None
    read = {name: (env.root / name).read_text()
            for name in ("skill.md", "expanded", "one", "bash", "chomped", "script", "quoted")}
    assert read["skill.md"] == "---\nname: $HOME\nFROM nothing\n"  # quoted: as written
    assert read["expanded"] == "/root\n"  # not quoted: the shell expanded it
    assert read["one"] == "one\n" and read["chomped"] == "chomped\n"
    assert read["bash"].startswith("bash 5.")  # bash read the body (quoted: unexpanded)
    assert read["quoted"] == "<<EOF\n"
    ran = read["script"].strip()  # the program ran from a file of its own, since removed
    assert ran.startswith("/") and not (env.root / ran.lstrip("/")).exists()
    assert (env.root / "data.txt").read_text() == "data\n"  # `COPY --link`, as BuildKit's
    assert (env.root / "data.txt").stat().st_mode & 0o777 == 0o640
    assert (env.root / "linked").read_text() == "linked\n"
    assert (env.root / "etc/motd").read_text() == "hello $X\n"  # `COPY <<'EOF'`, as written
    assert (env.root / "opt/run.sh").stat().st_mode & 0o777 == 0o755
    assert (env.root / "ran").read_text() == "ran\n"
    assert sorted(p.name for p in (env.root / "context").iterdir()) == ["Dockerfile",
                                                                       "data.txt"]


def test_a_copy_of_an_unquoted_here_document_to_expand_refuses_the_task(tmp_path: Path) -> None:
    folder = tmp_path / "task"
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text(
        f"FROM {images.podman_image(images.DEBIAN_REF)}\nCOPY <<EOF /etc/motd\n$X\nEOF\n")
    with pytest.raises(EnvironmentUnavailable, match="COPY <<EOF: BuildKit expands"):
        prepare(Source("dockerfile", "Dockerfile", folder, 600), Cache(tmp_path / "cache"),
                owner=None)
