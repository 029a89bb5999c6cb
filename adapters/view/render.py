"""The view's pages as HTML (Jinja2 templates shipped as package data, docs/SPEC.md §10).

Every value on a page came from the agent, a task's author or the store and is hostile:
the environment autoescapes everything, and its `finalize` strips terminal escapes and
control characters (`adapters.console.printable`) from every string it prints, so no
OSC 52 or bidi override reaches a copy-paste either. Pages load only the package's own
script and style (the Content-Security-Policy forbids anything else, inline script too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import markupsafe

from trialledger.adapters.console import printable
from trialledger.adapters.view.names import slug

HERE = Path(__file__).resolve().parent
TEMPLATES, STATIC = HERE / "templates", HERE / "static"
# No script but the package's own file, no style but its own sheet, nothing else fetched;
# `meta` gives it to an exported page (frame-ancestors is only honoured as a header).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "form-action 'self'; base-uri 'none'")
CSP_HEADER = CSP + "; frame-ancestors 'none'"


def _plain(text: str) -> str:
    """`printable(text)`, without its two expressions when there is nothing to strip:
    every character it strips or that starts a sequence it strips is a control or format
    character (Unicode Cc or Cf), and `str.isprintable` is false for any of them."""
    return text if text.isprintable() else printable(text)


def _finalize(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, markupsafe.Markup):  # a macro's output: its values were finalized
        return value
    return _plain(value) if isinstance(value, str) else value


def number(value: Any, digits: int = 3) -> str:
    """A figure, or blank when there is none (never a mean over nothing shown as 0)."""
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _tokens(row: dict[str, Any]) -> str:
    """The known token sum, and how many sessions' usage is unknown (never `0` for it)."""
    known, unknown = row.get("total_tokens"), row.get("unknown_usage") or 0
    if not unknown:
        return str(known or 0)
    return f"unknown ({unknown})" if known is None else f"{known} + {unknown} unknown"


def _raw(value: Any) -> str:
    """A value as the `data-value` a table sorts by and a test compares (JSON)."""
    if value is None or type(value) in (bool, int, float):  # most cells: nothing to strip
        return json.dumps(value)
    return json.dumps(plain_data(value), default=str)


def _json(value: Any) -> str:
    """`value` as JSON to read, terminal escapes stripped from its strings first (JSON would
    keep them as `\\u001b` text)."""
    return json.dumps(plain_data(value), ensure_ascii=False, default=str)


def plain_data(value: Any) -> Any:
    """`value` with terminal escapes stripped from every string in it."""
    if isinstance(value, str):
        return _plain(value)
    if isinstance(value, dict):
        return {_plain(str(k)): plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v) for v in value]
    return value


def _signed(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:+.3f}" if isinstance(value, float) else f"{value:+d}"


def environment() -> jinja2.Environment:
    """The templates' environment: autoescaped, strict, terminal escapes stripped."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, finalize=_finalize,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(number=number, tokens=_tokens, raw=_raw, signed=_signed, page=slug,
                       json=_json)
    env.globals["csp"] = CSP
    return env


class Pages:
    """Renders each page; `static`: for an export (no live refresh; filters in the page)."""

    def __init__(self, *, static: bool = False) -> None:
        self.env = environment()
        self.static = static

    def render(self, template: str, *, root: str, title: str, **context: Any) -> str:
        """The page `template` with `context`; `root` leads from the page to the top."""
        return self.env.get_template(template).render(root=root, title=title,
                                                      static=self.static, **context)
