"""The view says why (docs/SPEC.md §10, "view"): each session's result (pass, fail,
unscored) by its reward, never by its decision, and the reason it did not pass — in the
Sessions list (columns and a server-side filter), on trial pages, in the job grid's cells
(a title and a short label) and on the session page, where a transcript tab reads the
session as a conversation. Also `show`'s result line.

The store is a job of imported sessions (no Codex): a pass, a verified reward 0 whose
verifier printed why, a verification that found no reward, a run retried for a 429, and a
session whose tool output and message carry script and markup. A browser test (Debian's
Chromium) finds a failed trial's reason from the job page in one click and reads a
transcript; the rest render the pages server-side.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from playwright.sync_api import sync_playwright
from sqlalchemy import text

from tests.runs import in_process
from tests.scenarios import CLEAN, HTTP_429, THREAD, TURN, LogBuilder, run
from trialledger.adapters.view import results
from trialledger.adapters.view.pages import Search
from trialledger.adapters.view.site import Site
from trialledger.adapters.view.store import open_read_only
from trialledger.core import why
from trialledger.core.replay import ending
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs, trial_id

CHROMIUM = "/usr/bin/chromium"  # Debian's, as tests/view/test_view.py drives it
JOB = "why"
SCRIPT = "<script>alert('x')</script>"
BREAKOUT = '"><img src=x onerror=alert(1)>'
COMMAND = "cat answer.txt"
VERIFIER_SAID = "expected 4, got 5"
NO_REWARD = "the verifier wrote neither reward.json nor reward.txt"


def _tool_lines(output: str, message: str) -> list[str]:
    item = {"id": "item_1", "type": "command_execution", "command": COMMAND,
            "aggregated_output": "", "exit_code": None, "status": "in_progress"}
    return [THREAD, TURN, json.dumps({"type": "item.started", "item": item}),
            json.dumps({"type": "item.completed", "item": dict(
                item, aggregated_output=output, exit_code=0, status="completed")}),
            json.dumps({"type": "item.completed", "item": {
                "id": "item_2", "type": "agent_message", "text": message}}),
            CLEAN[-1]]


def _verified(log: LogBuilder, kind: str, data: dict[str, Any]) -> LogBuilder:
    return log.add(kind, data).add("session.closed", {"reason": "normal"})


LOGS: dict[str, Any] = {  # task: its one session's log
    "passes": lambda: _verified(run(CLEAN, 0), "verification.recorded",
                                {"rewards": {"reward": 1.0}, "detail": None}),
    "zero": lambda: _verified(run(CLEAN, 0), "verification.recorded", {
        "rewards": {"reward": 0.0}, "detail": None,
        "stdout_tail": f"test_sum FAILED\n{VERIFIER_SAID}\n\n"}),
    "silent": lambda: _verified(run(CLEAN, 0), "verification.failed",
                                {"reason": "no_reward", "detail": NO_REWARD}),
    "limited": lambda: run(HTTP_429, 1).add("session.closed", {"reason": "normal"}),
    "hostile": lambda: _verified(
        LogBuilder(instruction=f"do it {SCRIPT}").launched().codex(
            _tool_lines(f"{SCRIPT}\n{BREAKOUT}\n", f"done {SCRIPT} {BREAKOUT}")).finish(0),
        "verification.recorded", {"rewards": {"reward": 1.0}, "detail": None}),
}
RESULTS = {"passes": "pass", "zero": "fail", "silent": "unscored", "limited": "unscored",
           "hostile": "pass"}


@dataclass
class Store:
    db: Path
    sessions: dict[str, str]  # task: session id


def _in_thread(work: Any, *args: Any) -> Any:
    """An async function run on a thread of its own (Playwright's sync API holds a loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, work, *args).result(timeout=120)


async def _fill(db: Path | str) -> dict[str, str]:
    sessions = {}
    async with await Ledger.open(str(db)) as ledger:
        await Jobs(ledger).define(JOB, {"agent": "codex", "model": "m", "settings": {},
                                        "grants": [], "k": 1, "max_attempts": 1},
                                  [(task, f"/tasks/{task}") for task in LOGS])
        for task, log in LOGS.items():
            events = log().events
            events[0]["data"].update(trial_id=trial_id(JOB, task, 0), task=task)
            sessions[task] = await ledger.import_log(events)
        async with ledger._engines.writer.begin() as conn:  # as a finished job's runner left it
            await conn.execute(text("UPDATE job_queue SET state = 'done' WHERE job = :j"),
                               {"j": JOB})
    return sessions


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    db = tmp_path_factory.mktemp("why") / "why.db"
    return Store(db, _in_thread(_fill, db))


async def _site(db: Path | str, page: str, *args: Any) -> Any:
    async with await open_read_only(str(db)) as ledger:
        site = Site(ledger)
        return await getattr(site, page)(*args)


def _page(store: Store, page: str, *args: Any) -> str:
    html: str = _in_thread(_site, store.db, page, *args)
    return html


def _rows(html: str) -> dict[str, str]:
    """The sessions table's rows by session id (the row's HTML)."""
    body = html.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return {m.group(1): m.group(0) for m in re.finditer(
        r'<tr [^>]*data-id="(\S+) [^"]*">.*?</tr>', body, re.S)}


# -- server-side -----------------------------------------------------------------------------

def test_the_fold_and_the_store_give_the_same_result_and_reason(store: Store) -> None:
    """`core.why` over the projections (the lists, the grid) says what it says over the
    fold (`show`, the session page), for every kind of ending here."""
    async def both() -> list[tuple[Any, Any]]:
        async with await open_read_only(str(store.db)) as ledger:
            stored = await results.endings(ledger, "SELECT session_id FROM sessions")
            return [(stored[s], ending(await ledger.view(s))) for s in store.sessions.values()]

    for task, (stored, folded) in zip(store.sessions, _in_thread(both), strict=True):
        assert why.result(stored) == why.result(folded) == RESULTS[task], task
        assert why.reason(stored) == why.reason(folded), task
        assert why.label(stored) == why.label(folded), task


def test_the_sessions_list_has_reward_result_and_reason_columns(store: Store) -> None:
    html = _page(store, "sessions", Search())
    assert "<th>reward</th><th>result</th><th>reason</th>" in html
    rows = _rows(html)
    assert set(rows) == set(store.sessions.values())
    for task, session in store.sessions.items():
        assert f'data-result="{RESULTS[task]}"' in rows[session], task
        assert f'class="result res-{RESULTS[task]}"' in rows[session], task
    assert f"reward 0 · the verifier said: {VERIFIER_SAID}" in rows[store.sessions["zero"]]
    assert '<td class="num reward" data-value="0.0">0.00</td>' in rows[store.sessions["zero"]]
    assert f"no_reward: {NO_REWARD}" in rows[store.sessions["silent"]]
    assert "decided retry by rule" in rows[store.sessions["limited"]]
    # a verified reward 0 is not coloured as a pass by its `verify` decision
    assert "res-pass" not in rows[store.sessions["zero"]]


@pytest.mark.parametrize(("wanted", "tasks"), [
    ("pass", {"passes", "hostile"}), ("fail", {"zero"}), ("unscored", {"silent", "limited"}),
    ("nonsense", set()), ("", set(LOGS)),
])
def test_the_result_filter_is_applied_by_the_server(store: Store, wanted: str,
                                                    tasks: set[str]) -> None:
    html = _page(store, "sessions", Search.of({"result": wanted}))
    assert set(_rows(html)) == {store.sessions[t] for t in tasks}
    if wanted in why.RESULTS:
        assert f'<option value="{wanted}" selected>' in html
        assert f'<span id="shown">{len(tasks)}</span>' in html


def test_the_result_filter_combines_with_the_others(store: Store) -> None:
    html = _page(store, "sessions", Search.of({"result": "unscored", "task": "silent"}))
    assert set(_rows(html)) == {store.sessions["silent"]}


def test_the_grid_cells_say_why_in_a_title_and_a_label(store: Store) -> None:
    html = _page(store, "job", JOB)
    cells = {m.group(1): m.group(0) for m in re.finditer(
        r'<td class="cell [^"]*" title="[^"]*" data-task="(\w+)".*?</td>', html, re.S)}
    assert set(cells) == set(LOGS)
    assert f"no_reward: {NO_REWARD}" in cells["silent"] and ">no_reward</a>" in cells["silent"]
    assert f"the verifier said: {VERIFIER_SAID}" in cells["zero"] and ">0.00</a>" in cells["zero"]
    assert ">retry model_endpoint</a>" in cells["limited"]
    assert 'data-result="pass"' in cells["passes"] and "·  " not in cells["passes"]


def test_a_trial_page_says_why_its_trial_failed(store: Store) -> None:
    html = _page(store, "trial", trial_id(JOB, "silent", 0))
    assert f'<span class="reason" id="trial-reason">no_reward: {NO_REWARD}</span>' in html
    assert 'class="result res-unscored"' in html
    zero = _page(store, "trial", trial_id(JOB, "zero", 0))
    assert f"reward 0 · the verifier said: {VERIFIER_SAID}" in zero
    assert 'class="result res-fail"' in zero


def test_the_session_page_has_a_transcript(store: Store) -> None:
    html = _page(store, "session", store.sessions["zero"])
    transcript = html.split('<section id="transcript"', 1)[1].split("</section>", 1)[0]
    kinds = re.findall(r'class="said k-(\w+)"', transcript)
    assert kinds[0] == "instruction" and "message" in kinds and kinds[-1] == "verifier"
    assert "decision" in kinds
    assert VERIFIER_SAID in transcript and "hi there" in transcript
    assert re.search(r"\d+ tokens", transcript) is None  # no proxy: no model call here
    assert f'<span class="reason" id="reason">reward 0 · the verifier said: {VERIFIER_SAID}' \
        in html


def test_hostile_text_in_the_transcript_stays_text(store: Store) -> None:
    """Script and an attribute breakout in a tool's output and in the agent's message are
    escaped on the page (autoescape): no element is made of them."""
    html = _page(store, "session", store.sessions["hostile"])
    transcript = html.split('<section id="transcript"', 1)[1].split("</section>", 1)[0]
    assert f'<pre class="command">{COMMAND}</pre>' in transcript
    escaped_script = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
    escaped_breakout = "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;"
    output = re.search(r'<pre class="output">(.*?)</pre>', transcript, re.S)
    assert output is not None and output.group(1) == f"{escaped_script}\n{escaped_breakout}\n"
    message = re.search(r'k-message".*?<pre class="text">(.*?)</pre>', transcript, re.S)
    assert message is not None
    assert message.group(1) == f"done {escaped_script} {escaped_breakout}"
    for raw in (SCRIPT, BREAKOUT, "<img", "<script>"):
        assert raw not in html


def test_show_prints_the_result_and_the_reason(store: Store) -> None:
    def lines(task: str) -> list[str]:
        done = in_process("show", store.sessions[task], "--db", str(store.db))
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines()
                if line.startswith(("result:", "verification failed", "unscored:"))]

    assert lines("zero") == [f"result: fail (reward 0 · the verifier said: {VERIFIER_SAID})"]
    assert lines("passes") == ["result: pass"]
    silent = lines("silent")
    assert silent[0].startswith("verification failed at seq ")
    assert silent[0].endswith(f": no_reward: {NO_REWARD}")
    assert silent[1:] == ["unscored: no reward: the verification failed (no_reward)",
                          f"result: unscored (no_reward: {NO_REWARD})"]


def test_on_postgresql_the_results_and_the_filter_are_the_same(postgres: Any) -> None:
    """The filter's SQL and the endings' queries run on PostgreSQL and say what SQLite's do."""
    db = postgres.create_database()
    made = in_process("db", "upgrade", "--db", db, "--create-readonly-role")
    assert made.returncode == 0, made.stderr
    sessions = _in_thread(_fill, db)
    for wanted in why.RESULTS:
        html = _in_thread(_site, db, "sessions", Search.of({"result": wanted}))
        assert set(_rows(html)) == {sessions[t] for t, r in RESULTS.items() if r == wanted}
    zero = _in_thread(_site, db, "trial", trial_id(JOB, "zero", 0))
    assert f"reward 0 · the verifier said: {VERIFIER_SAID}" in zero
    assert ">no_reward</a>" in _in_thread(_site, db, "job", JOB)


# -- in a browser ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(store: Store, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("why-site") / "site"
    done = in_process("view", "--db", str(store.db), "--export", str(folder))
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


def test_in_a_browser_the_reason_is_one_click_from_the_job_and_a_transcript_reads(
        store: Store, exported: Path, chromium: Any) -> None:
    page = chromium.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def dialog(d: Any) -> None:
        errors.append(f"dialog {d.message}")
        d.dismiss()

    page.on("dialog", dialog)
    page.goto((exported / "job" / f"{JOB}.html").as_uri())
    cell = page.locator("#grid td.cell[data-task='silent']")
    assert cell.inner_text() == "no_reward"  # the short label
    assert f"no_reward: {NO_REWARD}" in str(cell.get_attribute("title"))  # on hover
    cell.locator("a").click()  # the one click
    assert page.locator("#trial-reason").is_visible()
    assert page.inner_text("#trial-reason") == f"no_reward: {NO_REWARD}"
    page.goto((exported / "session" / f"{store.sessions['hostile']}.html").as_uri())
    assert page.locator("#timeline").is_visible() and not page.locator("#transcript").is_visible()
    page.click("#tab-transcript")
    tool = page.locator("#transcript .k-tool")
    assert tool.locator(".command").is_visible() and tool.locator(".output").is_visible()
    assert tool.locator(".command").inner_text() == COMMAND
    assert tool.locator(".output").inner_text() == f"{SCRIPT}\n{BREAKOUT}\n"
    assert not page.locator("#timeline").is_visible()
    assert page.locator("img").count() == 0 and page.locator("script:not([src])").count() == 0
    page.goto((exported / "sessions.html").as_uri() + "?result=fail")  # the export filters
    shown = page.locator("#sessions tbody tr:not([hidden])")
    assert shown.count() == 1 and str(shown.get_attribute("data-id")).startswith(
        store.sessions["zero"])
    assert errors == []
    page.close()
