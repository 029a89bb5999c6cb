"""A task's own HTTP MCP server never leads the sandbox to the host's services (docs/SPEC.md
§15, docs/security.md): a task-declared server is forwarded only to globally routable
addresses — an address literal or `localhost` that is not is left out at seed time (gap
`mcp_server_skipped`), a name is checked where the forwarder resolves it — unless the
operator allows its host (`--task-mcp-host`)."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.runs import make_task, run_task
from tests.views import seeded
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.proxy.server import SessionProxy, Upstream
from trialledger.adapters.sandbox.allowlist import routable
from trialledger.adapters.tasks.mcpservers import refused_host
from trialledger.adapters.tasks.task import Task

pytestmark = pytest.mark.anyio

# The agent's attack: every MCP URL of its Codex config (the forwarder, in a private
# network), fetched at another path of the host service behind it.
ATTACK = r'''python3 - <<'EOF'
import os, tomllib, urllib.request
with open(os.path.join(os.environ["CODEX_HOME"], "config.toml"), "rb") as f:
    servers = tomllib.load(f).get("mcp_servers", {})
for name, server in servers.items():
    url = server.get("url", "").rsplit("/mcp", 1)[0] + "/admin/anything?from=sandbox"
    try:
        print(name, urllib.request.urlopen(url, timeout=10).read().decode())
    except Exception as error:
        print(name, "failed", type(error).__name__)
print("attack done")
EOF'''


@contextmanager
def host_service(address: str = "127.0.0.1") -> Iterator[tuple[int, list[str]]]:
    """A plain HTTP service of the host on loopback (no MCP server): its port and the paths
    it was asked for."""
    paths: list[str] = []

    class Recording(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def _answer(self) -> None:
            paths.append(self.path)
            body = b"host secret"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((address, 0), Recording)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], paths
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _task_with_server(folder: Path, url: str) -> Task:
    return make_task(folder, test_sh="exit 0\n", toml=(
        f'[[environment.mcp_servers]]\nname = "admin"\ntransport = "http"\nurl = "{url}"\n'
        '[environment]\nnetwork_mode = "no-network"\n'))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2"])
async def test_a_task_mcp_url_on_the_hosts_loopback_reaches_nothing(tmp_path: Path,
                                                                    host: str) -> None:
    with host_service("127.0.0.2" if host == "127.0.0.2" else "127.0.0.1") as (port, paths):
        task = _task_with_server(tmp_path / "task", f"http://{host}:{port}/mcp")
        ran = await run_task(str(tmp_path / "trials.db"), task,
                             [shell(ATTACK), message("ok")])
    assert paths == []  # the host's service was asked for nothing
    assert seeded(ran.view).grants == []
    gaps = {g.code: g.detail for g in ran.view.observations.gaps}
    assert f"--task-mcp-host {host}" in gaps["mcp_server_skipped"]
    (attack,) = ran.view.observations.tool_calls
    assert "attack done" in attack.output and "host secret" not in attack.output


@pytest.mark.parametrize("name", ["127.1", "2130706433"])
async def test_a_name_resolving_to_loopback_is_not_forwarded(tmp_path: Path, name: str
                                                            ) -> None:
    """A host no address parser takes for one, but the resolver does (`127.1`, a decimal
    number: both 127.0.0.1 to getaddrinfo), passes the seed's check; the forwarder
    resolves it, finds no public address and connects to nothing."""
    found = {str(info[4][0]) for info in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
    assert found == {"127.0.0.1"}  # (what an attacker counts on)
    with host_service("127.0.0.1") as (port, paths):
        task = _task_with_server(tmp_path / "task", f"http://{name}:{port}/mcp")
        ran = await run_task(str(tmp_path / "trials.db"), task,
                             [shell(ATTACK), message("ok")])
    assert [g.name for g in seeded(ran.view).grants] == ["admin"]  # seeded, forwarded...
    assert paths == []  # ...yet never connected
    (attack,) = ran.view.observations.tool_calls
    assert "admin failed" in attack.output and "host secret" not in attack.output


async def test_the_operator_may_allow_a_loopback_host(tmp_path: Path) -> None:
    """The same attack with `--task-mcp-host 127.0.0.1`: the operator's choice, honoured
    (and proof that the attack above is a real one)."""
    with host_service() as (port, paths):
        task = _task_with_server(tmp_path / "task", f"http://127.0.0.1:{port}/mcp")
        ran = await run_task(str(tmp_path / "trials.db"), task,
                             [shell(ATTACK), message("ok")], task_mcp_hosts=["127.0.0.1"])
    assert "/admin/anything?from=sandbox" in paths
    (attack,) = ran.view.observations.tool_calls
    assert "admin host secret" in attack.output


@pytest.mark.parametrize("host", ["localhost", "127.0.0.2"])
async def test_the_forwarder_connects_only_to_public_addresses(host: str) -> None:
    """The forwarder's own check, whatever the seed let through: a name resolved to
    loopback, or a loopback literal, is never connected to; unguarded, it is."""
    with host_service("127.0.0.2" if host == "127.0.0.2" else "127.0.0.1") as (port, paths):
        for public_only in (True, False):
            proxy = SessionProxy(Upstream(f"http://{host}:{port}", public_only=public_only))
            listening = await proxy.start()
            try:
                async with aiohttp.ClientSession() as client:
                    try:
                        async with client.get(f"http://127.0.0.1:{listening}/x") as answer:
                            status = answer.status
                    except aiohttp.ClientError:
                        status = None
            finally:
                await proxy.aclose()
            assert (status == 200) is (not public_only)
            assert paths == ([] if public_only else ["/x"])


_REFUSED = ["127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
            "fc00::/7", "169.254.0.0/16", "fe80::/10", "0.0.0.0/8", "::/128", "224.0.0.0/4",
            "ff00::/8", "240.0.0.0/4", "100.64.0.0/10", "::ffff:127.0.0.0/104"]


@given(st.sampled_from(_REFUSED).flatmap(lambda net: st.ip_addresses(network=net)))
def test_no_local_private_link_local_multicast_or_reserved_address_is_routable(
        address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert not routable(address)
    host = f"[{address}]" if address.version == 6 else str(address)
    assert refused_host(f"http://{host}:8080/mcp") is not None
    assert refused_host(f"http://{host}:8080/mcp", [str(address)]) is None


_LOCAL = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                            "100.64.0.0/10", "fc00::/7")]


@given(st.ip_addresses())
def test_routable_is_every_global_address_and_no_local_one(
        address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    plain = mapped or address  # an IPv4-mapped address is the IPv4 address it holds
    if plain.is_global and not (plain.is_multicast or plain.is_reserved):
        assert routable(address)
    if routable(address):
        assert not (plain.is_loopback or plain.is_link_local or plain.is_unspecified
                    or plain.is_multicast or plain.is_reserved)
        assert not any(plain in net for net in _LOCAL if net.version == plain.version)


@pytest.mark.parametrize("url", ["http://93.184.215.14/mcp", "https://mcp.example.com/mcp",
                                 "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]:8/mcp"])
def test_a_public_address_or_a_name_passes_the_seed(url: str) -> None:
    assert refused_host(url) is None


@pytest.mark.parametrize("url", ["http://LOCALHOST./mcp", "http://api.localhost:9/mcp",
                                 "http://[::1]/mcp", "http://[::ffff:127.0.0.1]/mcp",
                                 "http://169.254.169.254/latest", "http://0.0.0.0:80/"])
def test_loopback_and_metadata_urls_are_refused_at_seed(url: str) -> None:
    assert refused_host(url) is not None


@pytest.mark.parametrize("command", [["run", "TASK"], ["job", "run", "J", "TASK"], ["worker"]])
def test_run_job_run_and_worker_take_task_mcp_hosts(tmp_path: Path, command: list[str]) -> None:
    from trialledger.adapters.commands.running import run_options
    from trialledger.cli import build_parser

    args = build_parser().parse_args([
        *command, "--db", str(tmp_path / "t.db"), "--agent", "nop",
        "--task-mcp-host", "127.0.0.1", "--task-mcp-host", "mcp.internal"])
    assert run_options(args).task_mcp_hosts == ("127.0.0.1", "mcp.internal")
