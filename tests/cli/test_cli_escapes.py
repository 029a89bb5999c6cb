"""SPEC §10: terminal escapes and markup are stripped from human-readable output only.

A real session (the real Codex CLI, a scripted endpoint, bwrap) of a task whose name and
whose agent's message carry an OSC 52 clipboard write, CSI sequences, C1 and bidi controls
and rich markup: `ls` and `show` print none of them (and render no markup), while
`--json` and `export` keep them byte for byte.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.runs import in_process, make_task, run_task
from trialledger.adapters.console import printable, render
from trialledger.adapters.demo.endpoint import message, shell

CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4K\x07"  # OSC 52: "rm -rf ~" into the clipboard
HOSTILE = (f"{CLIPBOARD}[red]x[/red]\x1b[2J\x1b[31m:smile:\x9b1A\u202eevil"
           "[link=https://evil.example]y[/link]\x1b]8;;https://evil.example\x1b\\z")
NAME = f"task{HOSTILE}".replace("/", "|")  # a task's name is its folder's (SPEC §13)
SAID = f"done {HOSTILE} \x1bP+q\x1b\\ \r"
# the tool prints the same through the shell: real escapes in the captured output
PRINTED = ("printf 'out \\033]52;c;cm0=\\007[red]x[/red]\\033[2J\\302\\2331A"
           "\\342\\200\\256evil\\r\\n'")
CONTROLS = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON document."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """One real session, shared by the tests: its store and id."""
    folder = tmp_path_factory.mktemp("escapes")
    task = make_task(folder / NAME, test_sh="exit 0\n")
    db = str(folder / "t.db")
    ran = anyio.run(functools.partial(
        run_task, db, task, [shell(PRINTED), message(SAID)]))
    return db, ran.result.session_id


def human(*argv: str) -> str:
    done = in_process(*argv)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("command", ["ls", "show"])
def test_human_output_shows_stored_text_and_obeys_none_of_it(
        session: tuple[str, str], command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db, session_id = session
    monkeypatch.setattr(render.out, "width", 2000)  # no cell folded: each text stays whole
    shown = human(command, "--db", db, *([session_id] if command == "show" else []))
    assert not [c for c in CONTROLS if c in shown], repr(shown)
    # (the task's name is a folder's: its '/' are '|')
    assert "[red]x[|red]" in shown and "[link=https:||evil.example]y[|link]" in shown
    assert ":smile:" in shown and "😄" not in shown  # neither markup nor emoji rendered
    if command == "show":  # the header line names the task as a person reads it
        assert f"task {printable(NAME)}  attempt" in shown
        assert "52;c;" not in printable(NAME)  # no payload left behind


def test_json_and_export_keep_the_data_as_stored(session: tuple[str, str]) -> None:
    db, session_id = session
    listed = json.loads(human("ls", "--db", db, "--json"))
    assert [row["task"] for row in listed] == [NAME]
    view = json.loads(human("show", "--db", db, session_id, "--json"))
    assert NAME in strings(view) and SAID in strings(view)
    assert any(text.startswith("out \x1b]52;c;cm0=\x07[red]x[/red]\x1b[2J\x9b1A\u202eevil")
               for text in strings(view))  # what the tool printed, as it printed it
    exported = [json.loads(line) for line in
                human("export", "--db", db, "--session", session_id).splitlines()]
    assert NAME in strings(exported) and SAID in strings(exported)


def test_printable_removes_sequences_whole_and_keeps_text() -> None:
    assert printable("a\x1b]52;c;aGk=\x07b") == "ab"  # OSC ended by BEL
    assert printable("a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\b") == "alinkb"  # by ST
    assert printable("\x1b[1;31mred\x1b[0m \x9b2Jc1") == "red c1"  # CSI, 7-bit and C1
    assert printable("\x1bP+q544e\x1b\\dcs") == "dcs"  # DCS
    assert printable("\x1b7\x1b(Bsaved") == "saved"  # other ESC sequences
    assert printable("tab\tnew\nline\r\x00\x7f\u202eok\u2066") == "tab\tnew\nlineok"
    assert printable("[red]x[/red] :smile: café") == "[red]x[/red] :smile: café"
