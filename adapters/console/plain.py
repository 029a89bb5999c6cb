"""Stored text shown to a person, never obeyed by their terminal (docs/SPEC.md §10).

Task names, agent messages, tool output, error details and verifier tails are written by
the agent or a task's author. Printed raw, an escape sequence in them drives the reader's
terminal (OSC 52 writes the clipboard, CSI moves the cursor and rewrites what was shown,
OSC 8 hides a link), a bidi override reorders a line, and rich would render `[link=…]`,
`[red]` or `:emoji:` in them. So every human-readable output of the command line prints
stored text through `plain` — escape sequences and control characters removed, as a rich
`Text`, which rich never parses as markup — and a line printed without rich through
`printable`. `export`, `--json` and `replay` print the data as stored.
"""

from __future__ import annotations

import re

from rich.text import Text

# Whole sequences first, so no payload (a clipboard's base64, a title) is left as text:
# OSC … BEL or ST; DCS, SOS, PM, APC … ST; CSI; any other ESC sequence. Each in its 7-bit
# form and its C1 form. An unterminated string runs to the end, as a terminal would take it.
_SEQUENCE = re.compile(
    "(?:\x1b\\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x9c|\x1b\\\\)?"
    "|(?:\x1b[PX^_]|[\x90\x98\x9e\x9f])[^\x1b\x9c]*(?:\x9c|\x1b\\\\)?"
    "|(?:\x1b\\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    "|\x1b[\x20-\x2f]*[\x30-\x7e]?"
)
# What is left of control: C0 but newline and tab, DEL, C1, and the bidi controls
# (the embeddings, overrides and isolates, and the marks).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` without terminal escape sequences or control characters (newlines and tabs
    stay): `printable("a\\x1b]52;c;aGk=\\x07b")` is `"ab"`."""
    return _CONTROL.sub("", _SEQUENCE.sub("", text))


def plain(value: object) -> Text:
    """`value` as text rich prints as it is: `printable`, and never markup or emoji
    (`plain("[red]x[/red]")` shows the brackets); None is empty."""
    return Text(printable("" if value is None else str(value)))
