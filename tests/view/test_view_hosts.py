"""`trialledger view` answers only its own address (docs/SPEC.md §10, "the web view"): a real
server on loopback, asked over raw HTTP with forged `Host` headers — as a page whose name
an attacker rebinds to 127.0.0.1 would ask it (DNS rebinding) — answers 421 with no store
data; loopback's names, the bound address and `--allowed-host` names get the pages; a bind
beyond loopback warns what it exposes; the matching itself under hypothesis."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv6Address
from pathlib import Path
from typing import IO

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.runs import in_process
from tests.scenarios import TOOL_CALL, LogBuilder
from trialledger.adapters.view.hosts import EXPOSED, AllowedHosts, BadAllowedHost, host_form
from trialledger.adapters.view.server import HEADERS
from trialledger.store import Ledger

SECRET = "secret-tool-output-5f1c"  # what the tool printed: the store data a forger wants
DEADLINE_S = 30.0


@dataclass
class Store:
    db: Path
    session_id: str


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: str


@dataclass
class Server:
    port: int
    process: subprocess.Popen[str]


async def _import(db: Path) -> str:
    log = LogBuilder().launched().codex([line.replace("hello-from-tool", SECRET)
                                         for line in TOOL_CALL]).finish(0)
    log.events[0]["data"].update(trial_id="hosts-trial", task="hosts-task")
    log.add("session.closed", {"reason": "normal"})
    async with await Ledger.open(str(db)) as ledger:
        return await ledger.import_log(log.events)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A SQLite store holding one session whose tool printed SECRET."""
    db = tmp_path_factory.mktemp("hosts") / "view.db"
    return Store(db, anyio.run(_import, db))


def _line(stream: IO[str] | None, process: subprocess.Popen[str]) -> str:
    """One line of the server's, within a deadline (a thread reads; the test waits)."""
    got: list[str] = []
    assert stream is not None
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(DEADLINE_S)
    if not got or not got[0]:
        process.kill()
        raise AssertionError(f"no line from the server within {DEADLINE_S} s")
    return got[0]


@contextmanager
def _serving(store: Store, *argv: str) -> Iterator[tuple[Server, str]]:
    """`trialledger view ARGV` on a free port, as a person starts it: the server and the
    first line it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trialledger.cli", "view", "--db", str(store.db), "--port", "0",
         *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _line(process.stdout, process)
        yield Server(int(line.rsplit(":", 1)[1].strip().strip("/")), process), line
    finally:
        process.terminate()
        process.wait(timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def server(store: Store) -> Iterator[Server]:
    with _serving(store) as (started, _):
        yield started


def _ask(port: int, *hosts: str, path: str = "/", version: str = "1.1") -> Answer:
    """GET `path` from 127.0.0.1:`port` with these `Host` headers (none: no header)."""
    head = "".join(f"Host: {h}\r\n" for h in hosts)
    request = f"GET {path} HTTP/{version}\r\n{head}Connection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as conn:
        conn.sendall(request.encode())
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    raw_head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return Answer(int(status_line.split()[1]), headers, body.decode("utf-8", "replace"))


FORGED = ["evil.example", "evil.example:{port}", "localhost.evil.example:{port}",
          "127.0.0.1.nip.io:{port}", "LOCALHOST.evil.example", "localhost:{other}",
          "127.0.0.1:{other}", "[::1]:{other}", "localhost.:{port}", "0.0.0.0:{port}",
          "2130706433:{port}", "127.1:{port}", "::1", "localhost:{port}.evil.example",
          "127.0.0.1@evil.example", "localhost:{port}:{port}", ""]


def _paths(store: Store) -> list[str]:
    """Pages with store data, a redirect (an id's prefix), the package's files, a missing
    page."""
    sid = store.session_id
    return ["/", "/sessions.html", f"/session/{sid}.html", f"/session/{sid[:8]}.html",
            f"/rederive/{sid}.html", "/trial/hosts-trial.html", "/favicon.ico",
            "/static/view.js", "/nothing-here"]


@pytest.mark.parametrize("forged", FORGED)
def test_a_forged_host_gets_421_and_no_store_data(store: Store, server: Server,
                                                  forged: str) -> None:
    host = forged.format(port=server.port, other=server.port + 1)
    for path in _paths(store):
        answer = _ask(server.port, host, path=path)
        assert answer.status == 421, (host, path, answer.status)
        assert answer.body.startswith("421 Misdirected Request")
        assert SECRET not in answer.body and store.session_id[:8] not in answer.body
        assert answer.headers["Content-Type"].startswith("text/plain")
        assert HEADERS.items() <= answer.headers.items()


def test_no_host_or_two_hosts_get_no_store_data(store: Store, server: Server) -> None:
    page = f"/session/{store.session_id}.html"
    without = _ask(server.port, path=page, version="1.0")  # HTTP/1.0 needs no Host
    assert without.status == 421 and SECRET not in without.body
    for twice in (("evil.example", f"localhost:{server.port}"),
                  (f"localhost:{server.port}", f"localhost:{server.port}")):
        answer = _ask(server.port, *twice, path=page)
        assert answer.status in (400, 421) and SECRET not in answer.body, twice


@pytest.mark.parametrize("host", ["localhost:{port}", "LocalHost:{port}", "127.0.0.1:{port}",
                                  "[::1]:{port}", "localhost", "127.0.0.1", "[::1]"])
def test_loopback_names_with_the_port_or_none_are_answered(store: Store, server: Server,
                                                           host: str) -> None:
    asked = host.format(port=server.port)
    page = _ask(server.port, asked, path=f"/session/{store.session_id}.html")
    assert page.status == 200 and SECRET in page.body, asked
    moved = _ask(server.port, asked, path=f"/session/{store.session_id[:8]}.html")
    assert moved.status == 302 and HEADERS.items() <= moved.headers.items()
    missing = _ask(server.port, asked, path="/nothing-here")
    assert missing.status == 404 and HEADERS.items() <= missing.headers.items()
    old = _ask(server.port, asked, path="/", version="1.0")  # HTTP/1.0 with a Host
    assert old.status == 200


def test_allowed_host_names_are_answered_through_the_cli(store: Store) -> None:
    page = f"/session/{store.session_id}.html"
    with _serving(store, "--allowed-host", "View.LAN", "--allowed-host", "192.168.7.5",
                  "--allowed-host", "fd00:0::7") as (started, _):
        port = started.port
        for host in (f"view.lan:{port}", "VIEW.lan", f"192.168.7.5:{port}",
                     f"[fd00::7]:{port}", f"localhost:{port}"):
            answer = _ask(port, host, path=page)
            assert answer.status == 200 and SECRET in answer.body, host
        for host in (f"other.lan:{port}", f"view.lan.evil.example:{port}",
                     f"view.lan:{port + 1}", f"192.168.7.6:{port}", "evil.example"):
            answer = _ask(port, host, path=page)
            assert answer.status == 421 and SECRET not in answer.body, host


@pytest.mark.parametrize("given_name", ["box.lan:8765", "*.lan", "", "http://box.lan",
                                        "box.lan.", "box lan", "[box.lan]", "[127.0.0.1]"])
def test_a_bad_allowed_host_is_refused_in_one_line(tmp_path: Path, given_name: str) -> None:
    db = tmp_path / "none.db"
    done = in_process("view", "--db", str(db), "--port", "0", "--allowed-host", given_name)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "is not a host name or an address" in done.stderr
    assert "Traceback" not in done.stderr and not db.exists()


def test_allowed_host_with_an_export_is_refused(store: Store, tmp_path: Path) -> None:
    done = in_process("view", "--db", str(store.db), "--export", str(tmp_path / "site"),
                      "--allowed-host", "box.lan")
    assert done.returncode == 2 and "an export serves nothing" in done.stderr
    assert not (tmp_path / "site").exists()


def test_a_bind_beyond_loopback_warns_what_it_exposes(store: Store) -> None:
    with _serving(store, "--host", "0.0.0.0") as (started, _):
        warning = _line(started.process.stderr, started.process)
        assert "0.0.0.0" in warning and EXPOSED in warning
        assert "every job, session and tool output" in warning
        page = f"/session/{store.session_id}.html"
        bound = _ask(started.port, f"0.0.0.0:{started.port}", path=page)  # its own address
        assert bound.status == 200 and SECRET in bound.body
        lan = _ask(started.port, f"192.168.7.5:{started.port}", path=page)  # not allowed
        assert lan.status == 421 and SECRET not in lan.body


def test_a_loopback_bind_prints_no_warning(store: Store) -> None:
    with _serving(store) as (started, line):
        assert "read-only" in line
        assert _ask(started.port, f"localhost:{started.port}").status == 200
        started.process.terminate()
        _, err = started.process.communicate(timeout=DEADLINE_S)
    assert "warning" not in err and EXPOSED not in err


# -- the matching, under hypothesis ------------------------------------------------------------

PORT = 8765
HOSTS = AllowedHosts(["Kiosk.LAN", "10.0.0.7", "FD00:0:0::7"])
HOSTS.listening("0.0.0.0", ["0.0.0.0"], [PORT])
NAMES = ["localhost", "127.0.0.1", "[::1]", "kiosk.lan", "10.0.0.7", "[fd00::7]", "0.0.0.0"]
ACCEPTED = {*NAMES, *(f"{n}:{PORT}" for n in NAMES)}
# the first st.text of a fresh machine builds Hypothesis's character tables: slow, once
unhurried = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFUSABLES = ["\u0130", "\u0131", "\uff4c", "\u017f", ".", ":", "@", "%00"]
KELVIN = "\u212a"  # lower() makes it "k"


@st.composite
def _near_misses(draw: st.DrawFn) -> str:
    """An accepted Host, its letters' case flipped, then perhaps changed at either end,
    given another port, with a confusable letter in it or a Kelvin sign for its k."""
    host = draw(st.sampled_from(sorted(ACCEPTED)))
    host = "".join(c.upper() if draw(st.booleans()) else c for c in host)
    change = draw(st.sampled_from(["none", "before", "after", "port", "confusable", "kelvin"]))
    if change == "before":
        host = draw(st.text(min_size=1, max_size=8)) + host
    elif change == "after":
        host += draw(st.text(min_size=1, max_size=8))
    elif change == "port":
        name = host.split("]")[0] + "]" if host.startswith("[") else host.split(":")[0]
        host = f"{name}:{draw(st.integers(0, 99999))}"
    elif change == "confusable":
        at = draw(st.integers(0, len(host)))
        host = host[:at] + draw(st.sampled_from(CONFUSABLES)) + host[at:]
    elif change == "kelvin":
        host = host.replace("k", KELVIN).replace("K", KELVIN)
    return host


@unhurried
@given(_near_misses())
@example(f"{KELVIN}iosk.lan:{PORT}")  # so the one lookalike lower() folds is always tried
def test_a_host_is_answered_exactly_when_it_is_an_allowed_name_bare_or_with_the_port(
        host: str) -> None:
    assert HOSTS.allows(host) == (host.isascii() and host.lower() in ACCEPTED)


@unhurried
@given(st.text(max_size=40))
def test_any_other_text_is_refused(host: str) -> None:
    assert HOSTS.allows(host) == (host.isascii() and host.lower() in ACCEPTED)


@given(st.ip_addresses(v=6))
def test_an_allowed_ipv6_address_is_matched_as_browsers_write_it(address: IPv6Address) -> None:
    hosts = AllowedHosts([address.exploded])
    hosts.listening("127.0.0.1", ["127.0.0.1"], [PORT])
    written = f"[{address.compressed}]"
    assert host_form(f"[{address.exploded}]") == written
    assert hosts.allows(f"{written}:{PORT}") and hosts.allows(written)


def test_nothing_is_answered_before_the_port_is_known() -> None:
    assert not AllowedHosts([]).allows("localhost")


def test_a_wildcard_or_a_port_is_not_a_host_name() -> None:
    for bad in ("*", "box.lan:80", "http://box.lan/", "box..lan", "-box.lan", "b\u212ax.lan"):
        with pytest.raises(BadAllowedHost):
            AllowedHosts([bad])
