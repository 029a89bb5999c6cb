"""`trialledger view` (docs/SPEC.md §10) in a real browser: Debian's Chromium driven by
Playwright, against a store filled by a real job (the real Codex CLI through a scripted
endpoint: a retry, a failed verification, a tool call whose output is hostile, a task
whose name is) and sessions appended through the public `Ledger` API (a probe, a gap, an
error message carrying script and an OSC 52 escape).

Every page loads with no console error and links navigate; the job page's numbers are
`job show --json`'s; a session page shows its tool calls and decisions explained; the
filters filter; the export opens from `file://` with the same content; hostile text is
shown as text and no script runs; the store is opened read-only and never written.
Screenshots of the job and session pages are written to a temporary folder (printed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.harbor_models import models
from tests.runs import codex_path, in_process, make_task
from tests.scenarios import CLEAN as CLEAN_LINES
from tests.scenarios import THREAD, TURN, LogBuilder, run_of, seed_of
from trialledger import cli
from trialledger.adapters.console import printable
from trialledger.adapters.demo.endpoint import Reply, ScriptedEndpoint, message, shell, status
from trialledger.core import TrialLedgerError
from trialledger.store import Ledger, StoreUnavailable
from trialledger.store.jobs import Jobs

CHROMIUM = "/usr/bin/chromium"  # Debian's; `.ci/run` installs it (the tests never skip)
CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4K\x07"  # OSC 52: "rm -rf ~" into the reader's clipboard
SCRIPT = "<script>alert('script')</script>"
ONERROR = "<img src=x onerror=alert('onerror')>"
HOSTILE_TASK = f"task{ONERROR}{CLIPBOARD}".replace("/", "|")  # a folder's name is the task's
# the tool prints script, an onerror attribute and a real OSC 52 escape into its output
PRINTS = ("printf '%s\\033]52;c;cm0=\\007%s\\n' \"<script>alert('tool')</script>\" "
          "'<img src=x onerror=alert(5)>'; echo hello > out.txt")
TASKS: dict[str, tuple[str, list[Reply], bool]] = {  # name: (test.sh, replies, exit code reward)
    "clean": ("exit 0\n", [message("done")], True),
    "flaky": ("exit 0\n", [status(429), message("after a retry")], True),
    "noreward": ("true\n", [message("done")], False),  # verification.failed no_reward
    "tool": ("grep -q hello out.txt\n", [shell(PRINTS), message("wrote it")], True),
    HOSTILE_TASK: ("exit 1\n", [message(f"said {SCRIPT}{CLIPBOARD}")], True),
}
BY_TURN = {"tool"}
LINE_DEADLINE_S = 30.0


def _marker(name: str) -> str:
    return f"[task {hashlib.sha256(name.encode()).hexdigest()[:8]}]"


@dataclass
class Store:
    """The store the pages show: its file, the job names and the imported sessions."""

    db: Path
    logs: Path
    probed: str
    hostile: str


def _hostile_error_log() -> list[dict[str, Any]]:
    """A session whose turn failed with an error message carrying script and OSC 52."""
    said = json.dumps(f"upstream said {SCRIPT}{ONERROR}{CLIPBOARD}")
    log = LogBuilder().launched().codex([THREAD, TURN, f'{{"type":"error","message":{said}}}',
                                         f'{{"type":"turn.failed","error":{{"message":{said}}}}}'])
    log.finish(1)
    log.events[0]["data"].update(trial_id="imported-hostile", task=f"imported{ONERROR}")
    log.add("session.closed", {"reason": "normal"})
    return log.events


def _probed_log() -> list[dict[str, Any]]:
    """A session killed live, probed and verified, with a gap of its own."""
    events = [{"type": "session.seeded", "at": "2026-11-29T08:00:00Z",
               "data": dict(seed_of("recovered_then_killed_probe"), trial_id="imported-probe",
                            task="probed-task")}, *run_of("recovered_then_killed_probe")]
    at = events[1]["at"]
    events.insert(2, {"type": "gap.recorded", "at": at,
                      "data": {"code": "mcp_server_skipped", "detail": "the grant's server"}})
    events.append({"type": "session.closed", "at": events[-1]["at"],
                   "data": {"reason": "normal"}})
    return events


async def _import(db: Path, data: Path) -> tuple[str, str]:
    async with await Ledger.open(str(db)) as ledger:
        await Jobs(ledger).define("queued", {"agent": "codex", "model": "m", "settings": {},
                                             "grants": [], "k": 1, "max_attempts": 1},
                                  [("clean", str(data / "clean"))])  # never run: open
        return (await ledger.import_log(_probed_log()),
                await ledger.import_log(_hostile_error_log()))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Two real jobs (one to compare with) and two imported sessions, on SQLite."""
    root = tmp_path_factory.mktemp("view")
    data, logs, db = root / "data", root / "kept", root / "view.db"
    logs.mkdir()
    for name, (test_sh, _, by_exit) in TASKS.items():
        make_task(data / name, instruction=f"{_marker(name)} do the task", test_sh=test_sh,
                  exit_code_reward=by_exit)
    routes = {_marker(n): r for n, (_, r, _) in TASKS.items() if n not in BY_TURN}
    turns = {_marker(n): TASKS[n][1] for n in BY_TURN}
    common = ["--db", str(db), "--model", "m", "--codex-bin", codex_path(),
              "--set", "request_max_retries=0", "--set", "stream_max_retries=0",
              "--set", f"sandbox_logs_dir={logs}"]
    with ScriptedEndpoint([message("unrouted")], routes=routes, turns=turns) as endpoint:
        code = cli.main(["job", "run", "bench", str(data), "-k", "2", "-n", "4",
                         "--max-attempts", "2", "--model-base-url", endpoint.url, *common])
        assert code == 1  # noreward's trials end unscored
        prices = root / "prices.toml"
        prices.write_text('[m]\ninput = 2\ncached_input = 0.5\noutput = 8\n')
        assert cli.main(["job", "run", "other", str(data / "clean"), "-k", "1",
                         "--model-base-url", endpoint.url, "--prices", str(prices),
                         *common]) == 0
    probed, hostile = anyio.run(_import, db, data)
    return Store(db, logs, probed, hostile)


@dataclass
class Server:
    url: str
    line: str
    process: subprocess.Popen[str]


@pytest.fixture(scope="module")
def server(store: Store) -> Iterator[Server]:
    """`trialledger view` on a free loopback port, as a person starts it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "view", "--db", str(store.db), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(process)
        found = re.search(r"http://\S+/", line)
        assert found, line
        yield Server(found.group(0), line, process)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _first_line(process: subprocess.Popen[str]) -> str:
    """The server's first line, within a deadline (a thread reads; the test waits)."""
    got: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        got.append(process.stdout.readline())

    import threading

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(LINE_DEADLINE_S)
    if not got or not got[0]:
        process.kill()
        raise AssertionError(f"no start line: {process.stderr.read() if process.stderr else ''}")
    return got[0]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


@dataclass
class Watched:
    """A page with every console message, page error and dialog it produced."""

    page: Page
    console: list[str]
    dialogs: list[str]

    @property
    def errors(self) -> list[str]:
        return [m for m in self.console if m.startswith(("error", "pageerror"))]


@pytest.fixture
def tab(browser: Browser) -> Iterator[Watched]:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(15_000)
    watched = Watched(page, [], [])
    page.on("console", lambda m: watched.console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: watched.console.append(f"pageerror: {e}"))

    def dialog(d: Any) -> None:
        watched.dialogs.append(d.message)
        d.dismiss()

    page.on("dialog", dialog)
    yield watched
    page.close()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`trialledger ARGV` in this process, on a thread of its own: Playwright's sync API
    holds an event loop on the test's thread, and the command runs one of its own."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(in_process, *argv).result(timeout=120)


def _sql(store: Store, sql: str) -> list[dict[str, Any]]:
    done = _cli("sql", "--db", str(store.db), "--json", sql)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def _session_of(store: Store, task: str, outcome: str = "verify") -> str:
    rows = _sql(store, f"SELECT session_id FROM sessions WHERE task = '{task}' "
                f"AND outcome = '{outcome}' ORDER BY created_at")
    assert rows, (task, outcome)
    return str(rows[0]["session_id"])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the tests --------------------------------------------------------------------------------

def test_the_server_says_it_is_read_only_binds_loopback_and_sends_a_strict_policy(
        store: Store, server: Server) -> None:
    assert "read-only" in server.line and server.url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server.url, timeout=30) as response:
        policy = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy

    class Kept(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *_: Any) -> None:
            return None  # see the redirect itself

    for moved in ("favicon.ico", f"session/{store.probed[:8]}.html"):  # a prefix of an id
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.build_opener(Kept).open(f"{server.url}{moved}", timeout=30)
        assert answer.value.code == 302
        assert answer.value.headers["Content-Security-Policy"] == policy, moved


def test_every_page_loads_without_a_console_error_and_the_store_is_not_written(
        store: Store, server: Server, tab: Watched, tmp_path_factory: pytest.TempPathFactory
) -> None:
    before = _digest(store.db)
    seen: set[str] = set()
    queue = [server.url]
    kinds: set[str] = set()
    while queue and len(seen) < 120:
        url = queue.pop(0)
        if url in seen:
            continue
        seen.add(url)
        response = tab.page.goto(url)
        assert response is not None and response.status == 200, url
        kinds.add(url[len(server.url):].split("/")[0])
        for href in tab.page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)"):
            href = href.split("#")[0]
            if href.startswith(server.url) and href not in seen:
                queue.append(href)
    assert tab.errors == [] and tab.dialogs == []
    assert {"job", "trial", "session", "rederive", "diff", "sessions.html"} <= kinds, kinds
    assert _digest(store.db) == before  # nothing written
    shots = tmp_path_factory.mktemp("view-screenshots")
    tab.page.goto(f"{server.url}job/bench.html")
    tab.page.screenshot(path=str(shots / "job.png"), full_page=True)
    tab.page.goto(f"{server.url}session/{_session_of(store, 'tool')}.html")
    tab.page.screenshot(path=str(shots / "session.png"), full_page=True)
    print(f"screenshots: {shots}")


def test_links_navigate_from_the_jobs_to_a_trial_to_its_session(
        server: Server, tab: Watched) -> None:
    page = tab.page
    page.goto(server.url)
    page.click("a[href='job/bench.html']")
    assert page.inner_text("#job-name") == "bench"
    page.click("td.cell[data-task='flaky'][data-k='0'] a")
    assert page.inner_text("#trial-task") == "flaky"
    attempts = page.locator("#attempts tbody tr")
    if attempts.count() == 2:  # the trial that was retried says why
        assert "decided retry by rule" in attempts.nth(1).inner_text()
    attempts.first.locator("a").click()
    assert page.inner_text("#session-task") == "flaky"
    page.click("#rederive-link")
    assert page.locator("#rederived tbody tr").count() >= 2
    page.goto(f"{server.url}job/bench.html")
    page.click("a.compare")
    assert page.locator("#diff tr[data-figure='clean']").count() == 1
    assert tab.errors == []


def _cells(page: Page, row: Any, headers: list[str]) -> dict[str, Any]:
    values = {}
    for name, cell in zip(headers, row.locator("td").all(), strict=True):
        raw = cell.get_attribute("data-value")
        values[name] = json.loads(raw) if raw is not None else cell.inner_text()
    return values


def test_the_job_page_numbers_are_job_show_json(store: Store, server: Server,
                                                tab: Watched) -> None:
    done = _cli("job", "show", "bench", "--db", str(store.db), "--json")
    shown = json.loads(done.stdout)
    page = tab.page
    page.goto(f"{server.url}job/bench.html")
    headers = page.eval_on_selector_all("#tasks thead th", "hs => hs.map(h => h.textContent)")
    figures = ("trials", "open", "scored", "unscored", "passed", "mean", "mean scored",
               "retries", "interrupted", "tokens", "wall s")
    columns = {"mean scored": "mean_scored", "tokens": "total_tokens", "wall s": "wall_s"}
    rows = page.locator("#tasks tbody tr").all()
    expected = [t for t in shown["tasks"] if t["task"] is not None]
    assert len(rows) == len(expected) == len(TASKS)
    for row in rows:
        got = _cells(page, row, headers)
        want = next(t for t in expected if printable(t["task"]) == row.get_attribute("data-task"))
        for name in figures:
            assert got[name] == want[columns.get(name, name)], (want["task"], name)
    overall = next(t for t in shown["tasks"] if t["task"] is None and t["dataset"] is None)
    got = _cells(page, page.locator("#overall-table tbody tr[data-figure='(all)']"),
                 page.eval_on_selector_all("#overall-table thead th",
                                           "hs => hs.map(h => h.textContent)"))
    for name in figures:
        assert got[name] == overall[columns.get(name, name)], name
    shown_passk = {p["k"]: p["pass_at_k"] for p in shown["passk"]
                   if p["task"] is None and p["dataset"] is None}
    page_passk = {int(str(s.get_attribute("data-k"))): json.loads(str(s.get_attribute(
        "data-value"))) for s in page.locator("#overall-table .passk").all()}
    assert page_passk == shown_passk and shown_passk
    causes: dict[str, int] = {}
    for r in shown["retries"]:
        causes[r["cause_kind"]] = causes.get(r["cause_kind"], 0) + r["sessions"]
    assert {s.get_attribute("data-cause"): int(str(s.get_attribute("data-value")))
            for s in page.locator("#retries .cause").all()} == causes and causes
    cells = page.locator("#grid td.cell[data-k]")
    assert cells.count() == len(shown["trials"])
    for trial in shown["trials"]:
        cell = page.locator(f"#grid td.cell[data-k='{trial['k_index']}']").filter(
            has=page.locator(f"a[href='../trial/{trial['trial_id']}.html']"))
        assert json.loads(str(cell.get_attribute("data-reward"))) == trial["reward"]
    bars = {b.get_attribute("data-label"): json.loads(str(b.get_attribute("data-value")))
            for b in page.locator("#reward-chart .bar").all()}
    assert bars == {printable(t["task"]): t["mean"] for t in expected}
    tokens = page.locator("#tokens-chart .bar").all()
    unknown = sum(1 for t in shown["trials"] if t["unknown_usage"])
    assert sum(json.loads(str(b.get_attribute("data-value"))) for b in tokens) \
        == len(shown["trials"]) - unknown
    assert int(str(page.get_attribute("#tokens-unknown", "data-value"))) == unknown
    assert json.loads(str(page.get_attribute("#job-cost", "data-value"))) is None
    assert page.text_content("#job-cost") == "unknown (no price table: job run --prices FILE)"
    other = json.loads(_cli("job", "show", "other", "--db", str(store.db), "--json").stdout)
    assert other["cost_usd"] is not None and other["cost_usd"] > 0  # SPEC §18, priced
    page.goto(f"{server.url}job/other.html")
    assert json.loads(str(page.get_attribute("#job-cost", "data-value"))) == other["cost_usd"]
    assert page.text_content("#job-cost") == f"${other['cost_usd']:.4f}"
    page.goto(f"{server.url}job/bench.html")
    page.click("#tasks thead th:has-text('mean')")  # sortable: ascending by mean
    means = [json.loads(str(r.locator("td").nth(headers.index("mean")).get_attribute(
        "data-value"))) for r in page.locator("#tasks tbody tr").all()]
    assert means == sorted(means, key=lambda m: -1 if m is None else m)


def test_a_session_page_shows_its_tool_calls_model_calls_decision_and_verifier(
        store: Store, server: Server, tab: Watched) -> None:
    page = tab.page
    page.goto(f"{server.url}session/{_session_of(store, 'tool')}.html")
    tool = page.locator("#timeline .tool").filter(has_text="echo hello > out.txt").last
    assert "exec_command" in tool.inner_text()
    assert "<script>alert('tool')</script>" in tool.locator(".output").inner_text()
    assert re.search(r"→ 200 in \d+ ms", page.locator(".modelcall").first.inner_text())
    assert re.match(r"decision at seq \d+: policy \w+ rule completed fired on seq \d+ "
                    r"\(cleanup.reported|agent.exited\)",
                    page.locator("#decisions .explained").first.inner_text())
    assert page.locator("#timeline tr.t-outcome-decided .explained").count() >= 1
    assert "tokens" in page.inner_text("#usage") and page.locator("#environment").count() == 1
    page.goto(f"{server.url}session/{_session_of(store, 'noreward', 'unverified')}.html")
    assert "no_reward" in page.inner_text("#verifier")
    # the files the event lists, read back from the artifact folder (on this machine)
    assert page.locator("#files tbody tr td.mono").first.inner_text().startswith("verifier/")
    assert page.locator("#files-elsewhere").count() == 0
    assert page.locator("#files pre.file").count() >= 1
    page.goto(f"{server.url}session/{store.probed}.html")
    explained = page.inner_text("#decisions")
    assert "rule probe fired" in explained and "rule probed fired" in explained
    assert page.locator("#timeline tr.gap").count() >= 1
    assert "mcp_server_skipped" in page.inner_text("#gaps")
    assert tab.errors == []


def _listed(page: Page) -> list[str]:
    return [str(r.get_attribute("data-id")).split()[0]
            for r in page.locator("#sessions tbody tr:not([hidden])").all()]


def _filter(page: Page, **chosen: str) -> list[str]:
    for name, value in chosen.items():
        if name == "id":
            page.fill("#f-id", value)
        else:
            page.select_option(f"#f-{name}", value)
    with page.expect_navigation():
        page.click("#f-go")
    return _listed(page)


def test_the_filters_filter(store: Store, server: Server, tab: Watched) -> None:
    everything = _sql(store, "SELECT session_id, task, outcome FROM sessions")
    page = tab.page
    page.goto(f"{server.url}sessions.html")
    assert sorted(_listed(page)) == sorted(r["session_id"] for r in everything)
    retried = sorted(r["session_id"] for r in everything if r["outcome"] == "retry")
    assert retried and sorted(_filter(page, outcome="retry")) == retried
    page.goto(f"{server.url}sessions.html")
    assert _filter(page, gap="mcp_server_skipped") == [store.probed]
    page.goto(f"{server.url}sessions.html")
    assert _filter(page, rule="probed") == [store.probed]
    page.goto(f"{server.url}sessions.html")
    assert sorted(_filter(page, task="clean")) == sorted(
        r["session_id"] for r in everything if r["task"] == "clean")
    page.goto(f"{server.url}sessions.html")
    assert _filter(page, id=store.hostile[:10]) == [store.hostile]
    page.goto(f"{server.url}session/{store.hostile[:10]}.html")  # an id by its prefix
    assert page.inner_text("#session-id") == store.hostile
    assert tab.errors == []


def test_the_export_opens_from_file_with_the_same_content(
        store: Store, server: Server, tab: Watched, tmp_path: Path) -> None:
    done = _cli("view", "--db", str(store.db), "--export", str(tmp_path / "site"),
                      "--job", "bench")
    assert done.returncode == 0, done.stderr
    page = tab.page
    tool_session = _session_of(store, "tool")
    served = {}
    for path, selector in (("job/bench.html", "#tasks"), ("job/bench.html", "#grid"),
                           (f"session/{tool_session}.html", "#timeline"),
                           (f"session/{tool_session}.html", "#decisions")):
        page.goto(server.url + path)
        served[path, selector] = page.inner_text(selector)
    page.goto((tmp_path / "site" / "index.html").as_uri())
    page.click("a[href='job/bench.html']")
    assert page.url.startswith("file://")
    for (path, selector), text in served.items():
        page.goto((tmp_path / "site" / path).as_uri())
        assert page.inner_text(selector) == text, (path, selector)
    page.goto((tmp_path / "site" / "sessions.html").as_uri())
    retried = _sql(store, "SELECT session_id FROM sessions WHERE outcome = 'retry' AND trial_id "
                   "IN (SELECT trial_id FROM job_queue WHERE job = 'bench')")
    assert sorted(_filter(page, outcome="retry")) == sorted(r["session_id"] for r in retried)
    assert retried
    assert page.url.startswith("file://") and "outcome=retry" in page.url
    assert store.probed not in _listed(page)  # another job's (none's) sessions are left out
    assert tab.errors == [] and tab.dialogs == []


def test_a_session_offers_its_atif_trajectory_served_and_exported(
        store: Store, server: Server, tab: Watched, tmp_path: Path) -> None:
    """The session page links its ATIF trajectory (SPEC §18): served and in an export it
    is `show --atif`'s, and Harbor's own `Trajectory` model accepts it."""
    session = _session_of(store, "tool")
    tab.page.goto(f"{server.url}session/{session}.html")
    link = tab.page.get_attribute("#atif-link", "href")
    assert link == f"{session}.trajectory.json"
    with urllib.request.urlopen(f"{server.url}session/{link}", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        served = json.loads(response.read())
    shown = _cli("show", "--db", str(store.db), session, "--atif")
    assert shown.returncode == 0, shown.stderr
    assert served == json.loads(shown.stdout)
    assert any(step.get("tool_calls") for step in served["steps"])
    models()["trajectory"].Trajectory.model_validate(served)
    done = _cli("view", "--db", str(store.db), "--export", str(tmp_path / "site"),
                "--job", "bench")
    assert done.returncode == 0, done.stderr
    exported = tmp_path / "site" / "session" / link
    assert json.loads(exported.read_text(encoding="utf-8")) == served


def test_hostile_text_is_shown_as_text_and_no_script_runs(
        store: Store, server: Server, tab: Watched) -> None:
    page = tab.page
    hostile_trial = _sql(store, "SELECT session_id FROM sessions WHERE task LIKE 'task<img%'")
    pages = [f"session/{store.hostile}.html", f"session/{_session_of(store, 'tool')}.html",
             f"session/{hostile_trial[0]['session_id']}.html", "job/bench.html",
             "sessions.html", "index.html", f"rederive/{store.hostile}.html"]
    for path in pages:
        page.goto(server.url + path)
        html = page.content()
        for control in ("\x1b", "\x07", "\x9b", "\\u001b"):
            assert control not in html, (path, control)
        assert page.locator("script:not([src])").count() == 0
        assert page.locator("img").count() == 0, path  # no element made from the data
    page.goto(f"{server.url}session/{store.hostile}.html")
    assert "]52;" not in page.content()  # the whole sequence is gone, its payload too
    assert f"upstream said {SCRIPT}{ONERROR}" in page.inner_text("#decisions")
    assert f"imported{ONERROR}" in page.inner_text("#session-task")
    page.goto(f"{server.url}job/bench.html")
    assert "task<img src=x onerror=alert('onerror')>" in page.inner_text("#tasks")
    assert tab.dialogs == [] and tab.errors == []


def _long_open_log(calls: int) -> list[dict[str, Any]]:
    """A decided session, not closed, of two events per tool call and a dozen others."""
    lines = [THREAD, TURN]
    for i in range(calls):
        item = {"id": f"item_{i}", "type": "command_execution", "command": f"ls {i}",
                "aggregated_output": "", "exit_code": None, "status": "in_progress"}
        lines.append(json.dumps({"type": "item.started", "item": item}))
        lines.append(json.dumps({"type": "item.completed", "item": dict(
            item, aggregated_output=f"file-{i}\n", exit_code=0, status="completed")}))
    lines.append('{"type":"turn.completed","usage":{"input_tokens":1,"cached_input_tokens":0,'
                 '"output_tokens":1}}')
    return LogBuilder().launched().codex(lines).finish(0).events


def test_a_session_is_folded_once_for_its_pages_and_again_once_it_grew(tmp_path: Path) -> None:
    """A long session's first part, its second part and its re-derivation page read its
    events once (one fold); a session appended to since is read and folded again."""
    from sqlalchemy import event

    from trialledger.adapters.view.session import PART_EVENTS
    from trialledger.adapters.view.site import Site
    from trialledger.adapters.view.store import open_read_only

    db = str(tmp_path / "long.db")

    async def pages() -> tuple[int, int, str, str]:
        async with await Ledger.open(db) as ledger:
            session_id = await ledger.import_log(_long_open_log(PART_EVENTS // 2 + 10))
        async with await open_read_only(db) as reader:
            site, reads = Site(reader), []

            def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
                reads.extend(["events"] if "FROM events" in statement else [])

            for engine in (reader._engines.reader.sync_engine, reader._engines.sync_reader):
                if engine is not None:
                    event.listen(engine, "before_cursor_execute", count)
            first = await site.session(session_id)
            await site.session(session_id, 2)
            await site.rederive(session_id)
            assert await site.session(session_id) == first
            once = len(reads)
            async with await Ledger.open(db) as writer:  # its runner closes it meanwhile
                await writer.close(session_id)
            grown = await site.session(session_id, 2)
            return once, len(reads), first, grown

    with ThreadPoolExecutor(1) as pool:
        once, twice, first, grown = pool.submit(anyio.run, pages).result(timeout=120)
    assert (once, twice) == (1, 2)
    assert "t-session-closed" not in first and "part 1 of 2" in first
    assert "t-session-closed" in grown and "part 2 of 2" in grown


def test_the_store_is_opened_read_only(store: Store, tmp_path: Path) -> None:
    from trialledger.adapters.view.store import open_read_only

    async def write() -> None:
        ledger = await open_read_only(str(store.db))
        async with ledger:
            with pytest.raises(StoreUnavailable):
                await ledger.import_log(_probed_log()[:1])

    before = _digest(store.db)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(anyio.run, write).result(timeout=60)
    assert _digest(store.db) == before
    missing = _cli("view", "--db", str(tmp_path / "none.db"), "--export",
                         str(tmp_path / "out"))
    assert missing.returncode == 2 and "no database" in missing.stderr
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--job", "bench"], "--job chooses the pages of an export"),
    (["--export", "{tmp}/out", "--job", "nosuch"], "no job named nosuch"),
    (["--export", "{tmp}/full"], "holds other files"),
])
def test_bad_input_is_one_line_and_exit_2(store: Store, tmp_path: Path, argv: list[str],
                                          said: str) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("not an export")
    done = _cli("view", "--db", str(store.db), *(a.format(tmp=tmp_path) for a in argv))
    assert done.returncode == 2 and said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path / "full") == ["mine.txt"]


@pytest.mark.parametrize("planted", ["index.html", "session"])
def test_an_export_never_writes_through_a_planted_link(store: Store, tmp_path: Path,
                                                       planted: str) -> None:
    """A folder an export wrote (its mark) where someone planted a link in a page's place
    or a folder's: the file the link names was overwritten with a page."""
    folder, victim = tmp_path / "shared", tmp_path / "victim"
    folder.mkdir()
    victim.mkdir()
    (victim / "index.html").write_text("not a page")
    (folder / ".trialledger-view").write_text("written by trialledger view --export\n")
    os.symlink(victim / "index.html" if planted == "index.html" else victim, folder / planted)
    done = _cli("view", "--db", str(store.db), "--export", str(folder))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert os.listdir(victim) == ["index.html"]
    assert (victim / "index.html").read_text() == "not a page"


def test_a_page_name_is_never_another_sessions_id(tmp_path: Path) -> None:
    """A session whose id is not plain (`a:b`) is shown under a page name of its letters and
    a digest; an imported session whose id was exactly that name took over its page (in
    the server and in an export), and the server could not show the first at all."""
    from trialledger.adapters.view.names import slug
    from trialledger.adapters.view.site import Site
    from trialledger.adapters.view.store import open_read_only

    db = str(tmp_path / "names.db")

    async def pages() -> tuple[str, str]:
        first = LogBuilder(instruction="THE-REAL-ONE").launched().codex(CLEAN_LINES).finish(0)
        first.events[0]["session_id"] = "a:b"
        async with await Ledger.open(db) as ledger:
            await ledger.import_log(first.events)
            other = LogBuilder(instruction="AN-IMPOSTOR").launched().codex(CLEAN_LINES)
            other.events[0]["session_id"] = slug("a:b")
            await ledger.import_log(other.finish(0).events)
        async with await open_read_only(db) as reader:
            site = Site(reader)
            return await site.session(slug("a:b")), await site.session(slug(slug("a:b")))

    with ThreadPoolExecutor(1) as pool:
        real, impostor = pool.submit(anyio.run, pages).result(timeout=60)
    assert "THE-REAL-ONE" in real and "AN-IMPOSTOR" not in real
    assert "AN-IMPOSTOR" in impostor
    done = _cli("view", "--db", db, "--export", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    written = os.listdir(tmp_path / "out" / "session")  # each page and its trajectory
    assert sorted(n for n in written if n.endswith(".html")) == sorted(
        f"{slug(name)}.html" for name in ("a:b", slug("a:b")))
    assert len(written) == 4


def test_a_job_with_open_trials_reloads_from_the_store(server: Server, tab: Watched) -> None:
    """The served page of a job still open refreshes itself from the store (no script)."""
    page = tab.page
    page.goto(f"{server.url}job/queued.html")
    assert page.inner_text("#job-state") == "queued" and "partial" in page.inner_text("main")
    assert page.locator("meta[http-equiv='refresh']").count() == 1
    page.goto(f"{server.url}job/bench.html")
    assert page.inner_text("#job-state") == "done"
    assert page.locator("meta[http-equiv='refresh']").count() == 0


def test_on_postgresql_it_reads_as_the_reader_login(postgres: Any, tmp_path: Path) -> None:
    """A PostgreSQL store is read through the reader login `sql` uses: the pages come out,
    and a write through the view's store is refused by the server."""
    from trialledger.adapters.view.store import open_read_only
    from trialledger.adapters.view.store import rows as rows_of

    db = postgres.create_database()
    assert _cli("db", "upgrade", "--db", db, "--create-readonly-role").returncode == 0

    async def fill_then_write() -> tuple[str, str]:
        async with await Ledger.open(db) as ledger:
            probed = await ledger.import_log(_probed_log())
        async with await open_read_only(db) as ledger:
            user = (await rows_of(ledger, "SELECT current_user AS u"))[0]["u"]
            with pytest.raises(TrialLedgerError, match=r"permission denied|read-only"):
                await ledger.import_log(_hostile_error_log())
        return probed, str(user)

    with ThreadPoolExecutor(1) as pool:
        probed, user = pool.submit(anyio.run, fill_then_write).result(timeout=120)
    assert user == "trialledger_reader"
    done = _cli("view", "--db", db, "--export", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "site" / "session" / f"{probed}.html").read_text()
    assert "rule probed fired" in page and "mcp_server_skipped" in page
