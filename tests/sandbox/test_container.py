"""An image session's container (SPEC §15 "Container lifetime", `verifier_isolation =
harbor`): one sandbox for every phase, each phase's process joined into it, and — for a
`public` network — a network of its own connected outward by slirp4netns, as Docker's
bridge is: the host's loopback services out of reach, low ports its root's to bind, and
Docker's `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf`.

Every attack here is a real Codex tool call over the tests' Debian rootfs in range mode.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import images
from tests.images import private_storage_fixture  # noqa: F401 (the `private_storage` fixture)
from tests.runs import make_task, read_shell, run_task
from tests.sandbox.test_range_mode import DOCKER_CAP_MASK, _debian_into
from trialledger.adapters.demo.endpoint import message, shell
from trialledger.adapters.images.imagestore import plain_cache
from trialledger.adapters.images.prepare import prepare
from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.local import LocalSandbox
from trialledger.adapters.sandbox.network import Network
from trialledger.adapters.sandbox.slirp import RESOLVER

pytestmark = pytest.mark.anyio


def outside_address() -> str:
    """An address of this machine that is not loopback (where a route out leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: only the route is chosen
        address: str = probe.getsockname()[0]
    assert not address.startswith("127."), address
    return address


@pytest.fixture
def servers() -> Iterator[tuple[int, str, int]]:
    """A host service on loopback only, and one on the machine's outside address."""
    inside_only = socket.create_server(("127.0.0.1", 0))
    outside = outside_address()
    reachable = socket.create_server((outside, 0))
    try:
        yield inside_only.getsockname()[1], outside, reachable.getsockname()[1]
    finally:
        inside_only.close()
        reachable.close()


PROBE = (
    "exec 2>&1; "
    "(echo > /dev/tcp/127.0.0.1/{loop}) 2>/dev/null && echo REACHED-HOST-LOOPBACK; "
    "(echo > /dev/tcp/10.0.2.2/{loop}) 2>/dev/null && echo REACHED-HOST-LOOPBACK-VIA-GATEWAY; "
    "(echo > /dev/tcp/{outside}/{port}) 2>/dev/null && echo REACHED-OUTSIDE; "
    "perl -MIO::Socket::INET -e 'IO::Socket::INET->new(LocalAddr => \"0.0.0.0:80\", "
    "Listen => 1, ReuseAddr => 1) or die; print \"BOUND-80\\n\"'; "
    "echo HOSTNAME $(cat /etc/hostname); grep -q nameserver /etc/resolv.conf && "
    "echo RESOLVER $(awk '/nameserver/ {{print $2}}' /etc/resolv.conf); "
    "grep -qw localhost /etc/hosts && echo HOSTS-LOCALHOST; "
    "grep -E '^Cap(Eff|Bnd)' /proc/self/status; echo done")


async def _rootfs_run(tmp_path: Path, environment: str, command: str, *,
                      test_sh: str = "exit 0\n",
                      settings: dict[str, Any] | None = None,
                      yield_ms: int | None = None) -> tuple[Any, str]:
    """A tool call running `command` over the tests' Debian rootfs (range mode), the task's
    `[environment]` table holding `environment` too; the run and the call's output (Codex
    returns it after `yield_ms`, default 30 s, `read_shell`)."""
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    _debian_into(task_dir)
    task = make_task(task_dir, test_sh=test_sh,
                     toml=f'[environment]\nrootfs = "rootfs.tar"\n{environment}')
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    reply = read_shell(command) if yield_ms is None else shell(command, yield_ms=yield_ms)
    ran = await run_task(str(tmp_path / "t.db"), task, [reply, message()],
                         environment=env, settings=settings)
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert out.strip().endswith("done"), out
    return ran, out


async def test_a_public_network_is_the_containers_own(
        tmp_path: Path, servers: tuple[int, str, int], kept: list[LocalSandbox]) -> None:
    loop, outside, port = servers
    ran, out = await _rootfs_run(tmp_path, "", PROBE.format(loop=loop, outside=outside,
                                                            port=port))
    assert "REACHED-HOST-LOOPBACK" not in out, out  # neither directly nor through slirp
    assert "REACHED-OUTSIDE" in out and "BOUND-80" in out, out
    assert f"HOSTNAME {ran.result.session_id.replace('-', '')[:12]}" in out, out
    assert "RESOLVER 10.0.2.3" in out and "HOSTS-LOCALHOST" in out, out
    assert f"CapEff:\t{DOCKER_CAP_MASK}" in out and f"CapBnd:\t{DOCKER_CAP_MASK}" in out, out
    assert ran.view.decision is not None and ran.view.decision.rule == "completed"
    sandbox = kept[-1]
    assert sandbox.lifetime == "harbor" and sandbox.slirp is None  # stopped with the session


async def test_a_public_network_under_strict_is_each_phases_own(
        tmp_path: Path, servers: tuple[int, str, int], kept: list[LocalSandbox]) -> None:
    """Under `strict` (a sandbox per phase) an image's `public` network is each phase's own,
    connected by slirp4netns as the container's is: the outside reached, the host's
    loopback not, port 80 its root's to bind, slirp's resolver — for the verifier too."""
    loop, outside, port = servers
    reach = f"bash -c 'echo > /dev/tcp/{outside}/{port}' 2>/dev/null"
    ran, out = await _rootfs_run(
        tmp_path, "", PROBE.format(loop=loop, outside=outside, port=port),
        settings={"verifier_isolation": "strict"},
        test_sh=f"{reach} && echo 1 > /logs/verifier/reward.txt || "
                f"echo 0 > /logs/verifier/reward.txt\n")
    assert "REACHED-HOST-LOOPBACK" not in out, out
    assert "REACHED-OUTSIDE" in out and "BOUND-80" in out, out
    assert "RESOLVER 10.0.2.3" in out, out
    assert ran.view.rewards == {"reward": 1.0}
    assert kept[-1].lifetime == "strict" and kept[-1].slirp is None


async def test_no_network_has_no_way_out_and_no_resolver(
        tmp_path: Path, servers: tuple[int, str, int], kept: list[LocalSandbox]) -> None:
    loop, outside, port = servers
    _, out = await _rootfs_run(tmp_path, 'network_mode = "no-network"\n',
                               PROBE.format(loop=loop, outside=outside, port=port))
    assert "REACHED" not in out and "RESOLVER" not in out, out
    assert "BOUND-80" in out and "HOSTS-LOCALHOST" in out, out
    assert kept[-1].slirp is None


@pytest.mark.parametrize("lifetime", ["harbor", "strict"])
@pytest.mark.parametrize(("agent", "verifier"), [("no-network", "public"),
                                                  ("public", "no-network")])
async def test_each_phase_runs_on_its_own_network_mode(
        tmp_path: Path, servers: tuple[int, str, int], kept: list[LocalSandbox],
        agent: str, verifier: str, lifetime: str) -> None:
    """SPEC §15: the agent and the verifier each take their table's `network_mode` — the
    container's network switched between them (slirp4netns started or stopped) as Harbor
    switches its sidecar, or (strict) each phase's sandbox made on its own — an offline
    agent graded by a verifier that installs what it needs, or the reverse; neither phase
    reaches what its mode keeps it from."""
    _, outside, port = servers
    reach = f"bash -c 'echo > /dev/tcp/{outside}/{port}' 2>/dev/null"
    tables = (f'\n[agent]\nnetwork_mode = "{agent}"\n'
              f'[verifier]\nnetwork_mode = "{verifier}"\n')
    ran, out = await _rootfs_run(
        tmp_path, tables, f"exec 2>&1; {reach} && echo REACHED-OUTSIDE; echo done",
        test_sh=f"{reach} && echo 1 > /logs/verifier/reward.txt || "
                f"echo 0 > /logs/verifier/reward.txt\n",
        settings={"verifier_isolation": lifetime})
    assert ("REACHED-OUTSIDE" in out) == (agent == "public"), out
    assert ran.view.rewards == {"reward": 1.0 if verifier == "public" else 0.0}
    assert kept[-1].lifetime == lifetime and kept[-1].slirp is None  # stopped with it


@pytest.mark.parametrize(("agent", "verifier"), [("public", "no-network"),
                                                  ("no-network", "public"),
                                                  ("allowlist", "public")])
async def test_a_host_tasks_phases_each_run_on_their_own_network_mode(
        tmp_path: Path, web_server: tuple[str, int], kept: list[LocalSandbox],
        agent: str, verifier: str) -> None:
    """A host task's phases are sandboxes of their own (SPEC §15): a `public` phase is on
    the host's network, a `no-network` one in a namespace of its own with only the model's
    proxy, an `allowlist` one connected by slirp4netns behind the rules — whatever the
    other phase's mode; the resolver is slirp's only where slirp4netns connects."""
    address, port = web_server
    get = (f"exec 3<>/dev/tcp/{address}/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
           f"&& timeout 10 cat <&3")
    hosts = 'allowed_hosts = ["192.0.2.200"]\n'  # never the web server's address
    task = make_task(
        tmp_path / "task",
        toml=(f'[agent]\nnetwork_mode = "{agent}"\n{hosts if agent == "allowlist" else ""}'
              f'[verifier]\nnetwork_mode = "{verifier}"\n'),
        test_sh=f"#!/bin/bash\n(bash -c \"{get}\") | grep -q ALLOWED-BODY && "
                f"! grep -q {RESOLVER} /etc/resolv.conf && "  # the host's resolver
                f"echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    ran = await run_task(str(tmp_path / "t.db"), task, [
        read_shell(f"exec 2>&1; bash -c \"{get}\"; grep -h nameserver /etc/resolv.conf; echo done"),
        message()])
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert out.strip().endswith("done"), out
    assert ("ALLOWED-BODY" in out) == (agent == "public"), out
    assert ("HTTP/1.1 403 Forbidden" in out) == (agent == "allowlist"), out  # (not a port)
    assert (f"nameserver {RESOLVER}" in out) == (agent == "allowlist"), out
    assert ran.view.rewards == {"reward": 1.0 if verifier == "public" else 0.0}
    assert kept[-1].slirp is None and kept[-1].egress is None  # stopped with the session


def test_a_process_group_refuses_a_phase_off_the_hosts_network() -> None:
    """Without bwrap there is no namespace of a phase's own: a phase whose mode is not
    `public` is refused by name, never run on the host's network."""
    network = Network(None)
    with pytest.raises(SandboxRefused, match="network_mode = 'no-network'"):
        LocalSandbox(session_key="group-modes", workdir="/work", isolation="process-group",
                     network=network, network_modes={"agent": "public",
                                                     "verifier": "no-network"})


ENTRY = ('ENTRYPOINT ["/bin/sh", "-c", "id -u > /entry-ran; exec \\"$@\\"", "entry"]')


def entry_image(ref: str, entrypoint: str) -> str:
    """The tests' busybox root as an image whose ENTRYPOINT is `entrypoint` (root's)."""
    if images._podman("image", "exists", ref).returncode == 0:
        return ref
    tarball = images.IMAGES / f"busybox-{images._key(images.busybox_root())}.tar"
    if not tarball.exists():  # (podman_image makes it only with the image: its name
        # follows the folder's path, so a clone elsewhere sharing .images has none)
        images._run(["tar", "-C", str(images.busybox_root()), "-cf", str(tarball), "."])
    done = images._podman("import", "--change", entrypoint, str(tarball), ref)
    assert done.returncode == 0, done.stderr
    return ref


async def _entry_run(tmp_path: Path, ref: str, test_sh: str) -> Any:
    task = make_task(tmp_path / "task", test_sh=test_sh,
                     toml=f'[environment]\ndocker_image = "{ref}"\n')
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    return await run_task(str(tmp_path / "t.db"), task, [message()], environment=env)


async def test_the_images_entrypoint_runs_as_pid_1s_command(
        tmp_path: Path, private_storage: None) -> None:
    """As Harbor's compose service runs the image: its ENTRYPOINT with `sh -c "sleep
    infinity"`, so what it starts is there for the agent and the verifier."""
    ref = entry_image("localhost/tl-busybox:entrypoint", ENTRY)
    ran = await _entry_run(tmp_path, ref, "[ \"$(cat /entry-ran)\" = 0 ] && "
                                         "echo 1 > /logs/verifier/reward.txt || "
                                         "echo 0 > /logs/verifier/reward.txt\n")
    assert ran.view.rewards == {"reward": 1.0}


async def test_a_container_whose_entrypoint_ends_is_lost(
        tmp_path: Path, private_storage: None) -> None:
    """An ENTRYPOINT that exits stops the container, as Docker's would: nothing is graded."""
    ref = entry_image("localhost/tl-busybox:entrypoint-exits", 'ENTRYPOINT ["/bin/false"]')
    ran = await _entry_run(tmp_path, ref, "echo 1 > /logs/verifier/reward.txt\n")
    kinds = [event.type for event in ran.view.events]
    assert "verification.recorded" not in kinds and "sandbox.lost" in kinds, kinds
    lost = next(e for e in ran.view.events if e.type == "sandbox.lost")
    assert "container" in lost.data.detail, lost.data.detail


@pytest.fixture
def web_server() -> Iterator[tuple[str, int]]:
    """An HTTP server on this machine's outside address that answers every request."""
    import threading

    server = socket.create_server((outside_address(), 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                continue
            with client:
                client.settimeout(5)
                with contextlib.suppress(OSError):
                    client.recv(4096)
                    client.sendall(b"HTTP/1.0 200 OK\r\n\r\nALLOWED-BODY\n")

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        yield server.getsockname()[0], server.getsockname()[1]
    finally:
        stop.set()
        worker.join(5)
        server.close()


ALLOWLIST_PROBE = (
    "exec 2>&1; "
    "get() {{ exec 3<>/dev/tcp/$1/$2 && printf 'GET / HTTP/1.0\\r\\nHost: %s\\r\\n\\r\\n' $3 >&3 "
    "&& timeout 10 cat <&3; exec 3<&-; }}; "
    "get {address} {port} allowed.invalid; "
    "get 192.0.2.77 80 blocked.invalid | head -1; "
    "for n in $(seq 1 21); do get 192.0.2.77 80 blocked-$n.invalid >/dev/null; done; "
    "grep -E '^CapEff' /proc/self/status; echo done")


async def test_an_allowlist_admits_its_hosts_and_refuses_the_rest(
        tmp_path: Path, web_server: tuple[str, int], kept: list[LocalSandbox]) -> None:
    """`network_mode = "allowlist"` (SPEC §15): the container's TCP goes through the egress
    proxy, which admits an allowed address and refuses (403, gap `egress_refused`) what is
    not; its root holds Docker's capabilities less NET_RAW."""
    address, port = web_server
    ran, out = await _rootfs_run(
        tmp_path, f'network_mode = "allowlist"\nallowed_hosts = ["{address}"]\n',
        ALLOWLIST_PROBE.format(address=address, port=port))
    assert "ALLOWED-BODY" in out and "HTTP/1.1 403 Forbidden" in out, out
    assert f"CapEff:\t{int(DOCKER_CAP_MASK, 16) & ~(1 << 13):016x}" in out, out
    refused = [e.data.detail for e in ran.view.events
               if e.type == "gap.recorded" and e.data.code == "egress_refused"]
    # the first 20 of a session one by one, then one gap that says more were refused
    assert refused[:20] == ["blocked.invalid", *(f"blocked-{n}.invalid" for n in range(1, 20))]
    assert len(refused) == 21 and refused[20].startswith("more connections were refused")
    assert ran.view.decision is not None and ran.view.decision.rule == "completed"
    assert kept[-1].egress is None  # stopped with the session


async def test_an_allowlist_admits_a_host_by_name(
        tmp_path: Path, kept: list[LocalSandbox]) -> None:
    """A name entry (SPEC §15): the container resolves deb.debian.org through slirp's
    resolver (these machines reach Debian's mirror) and its request, `Host:` the allowed
    name, is admitted — the proxy connecting to the address it resolved itself; the same
    address asked for another name is refused (403, gap `egress_refused` naming it)."""
    get = ('exec 3<>/dev/tcp/deb.debian.org/80 && printf "HEAD /debian/ HTTP/1.1\\r\\n'
           'Connection: close\\r\\nHost: %s\\r\\n\\r\\n" "$0" >&3 && head -1 <&3')
    # The mirror can be slow: each request has 12 s, and the tool call waits up to 30 s for
    # the output (exec_command's default, 10 s, once returned an empty output in CI).
    ran, out = await _rootfs_run(
        tmp_path, 'network_mode = "allowlist"\nallowed_hosts = ["deb.debian.org"]\n',
        f"exec 2>&1; timeout 12 bash -c '{get}' deb.debian.org; "
        f"timeout 12 bash -c '{get}' example.com; echo done", yield_ms=30_000)
    lines = [line for line in out.splitlines() if line.startswith("HTTP/")]
    assert len(lines) == 2 and " 200 " in lines[0] and " 403 " in lines[1], out
    refused = [e.data.detail for e in ran.view.events
               if e.type == "gap.recorded" and e.data.code == "egress_refused"]
    assert refused == ["example.com"]


@pytest.mark.parametrize("lifetime", ["harbor", "strict"])
@pytest.mark.parametrize(("agent", "verifier"), [("allowlist", "public"),
                                                  ("public", "allowlist")])
async def test_an_allowlist_phase_beside_a_public_one(
        tmp_path: Path, web_server: tuple[str, int], kept: list[LocalSandbox],
        agent: str, verifier: str, lifetime: str) -> None:
    """SPEC §15: before each phase the runner loads or removes the allowlist's rules and
    proxy in the container, or (strict) connects each phase's own sandbox with or without
    them (slirp4netns for both modes): the same request is refused (403, gap
    `egress_refused`) in the allowlist's phase and answered in the public one."""
    address, port = web_server
    get = (f"exec 3<>/dev/tcp/{address}/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
           f"&& timeout 10 cat <&3")
    hosts = 'allowed_hosts = ["192.0.2.200"]\n'  # never the web server's address
    tables = (f'[agent]\nnetwork_mode = "{agent}"\n{hosts if agent == "allowlist" else ""}'
              f'[verifier]\nnetwork_mode = "{verifier}"\n'
              f'{hosts if verifier == "allowlist" else ""}')
    ran, out = await _rootfs_run(
        tmp_path, f'\n{tables}',
        f"exec 2>&1; bash -c \"{get}\"; echo done",
        test_sh=f"bash -c \"{get}\" | grep -q ALLOWED-BODY && "
                f"echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        settings={"verifier_isolation": lifetime})
    assert ("ALLOWED-BODY" in out) == (agent == "public"), out
    assert ("HTTP/1.1 403 Forbidden" in out) == (agent == "allowlist"), out  # (not a port)
    assert ran.view.rewards == {"reward": 1.0 if verifier == "public" else 0.0}
    refused = [e.data.detail for e in ran.view.events
               if e.type == "gap.recorded" and e.data.code == "egress_refused"]
    assert refused == [address]  # (no Host: the address names it), from one phase only
    assert kept[-1].slirp is None and kept[-1].egress is None


async def test_a_host_tasks_allowlist_holds_in_each_phase(
        tmp_path: Path, web_server: tuple[str, int], kept: list[LocalSandbox]) -> None:
    """A host task's `allowlist` (SPEC §15: "for host-environment tasks too"): each phase's
    sandbox gets a namespace of its own connected by slirp4netns, the rules and the egress
    proxy — the agent reaches the allowed address and is refused the rest, and so is the
    verifier, in a sandbox of its own."""
    address, port = web_server
    reach = (f"exec 3<>/dev/tcp/{address}/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
             f"&& timeout 10 cat <&3")
    blocked = "exec 4<>/dev/tcp/192.0.2.77/80 && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&4 && " \
              "timeout 10 cat <&4"
    task = make_task(
        tmp_path / "task",
        toml=f'[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["{address}"]\n',
        test_sh=f"#!/bin/bash\nok=0; ({reach}) | grep -q ALLOWED-BODY && ok=1\n"
                f"({blocked}) | grep -q ' 200 ' && ok=0\n"
                f"echo $ok > /logs/verifier/reward.txt\n")
    ran = await run_task(str(tmp_path / "t.db"), task,
                         [read_shell(ALLOWLIST_PROBE.format(address=address, port=port)),
                          read_shell("grep nameserver /etc/resolv.conf"), message()])
    out = "\n".join(call.output for call in ran.view.observations.tool_calls)
    assert "ALLOWED-BODY" in out and "HTTP/1.1 403 Forbidden" in out, out
    assert "nameserver 10.0.2.3" in out, out  # slirp's resolver, not the host's
    assert ran.view.rewards == {"reward": 1.0}
    refused = [e.data.detail for e in ran.view.events
               if e.type == "gap.recorded" and e.data.code == "egress_refused"]
    assert refused[:2] == ["blocked.invalid", "blocked-1.invalid"], refused
    assert kept[-1].slirp is None and kept[-1].egress is None  # stopped with the session


async def test_what_the_agent_left_in_the_verifiers_logs_is_gone_before_it_runs(
        tmp_path: Path) -> None:
    """`/logs/verifier` is bound into the container for the whole session, so the agent
    can write there: a planted reward (and thousands of files beside it) are removed
    before the verifier runs, so a verifier that writes none gives no reward."""
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    _debian_into(task_dir)
    task = make_task(task_dir, test_sh="exit 0\n", exit_code_reward=False,
                     toml='[environment]\nrootfs = "rootfs.tar"\n')
    env = prepare(task.source, plain_cache(tmp_path / "cache"), owner=None)
    plant = ("cd /logs/verifier && echo 1 > reward.txt && "
             "for n in $(seq 1 3000); do : > f$n; done; ls | wc -l; echo done")
    ran = await run_task(str(tmp_path / "t.db"), task, [read_shell(plant), message()],
                         environment=env)
    out = ran.view.observations.tool_calls[0].output
    assert "3001" in out, out  # the agent could write there
    failed = [e.data for e in ran.view.events if e.type == "verification.failed"]
    assert [f.reason for f in failed] == ["no_reward"], ran.view.events
    assert ran.view.rewards is None or ran.view.rewards == {}


def _kill_our_slirp(stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the first slirp4netns this process starts (as an OOM killer might) once it
    has run a second — mid-session, while the agent sleeps, not while the runner is still
    setting it up (a kill then is a network that could not be set up: the session lost)."""
    seen: dict[int, float] = {}
    while not stop.wait(0.05) and not killed:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == os.getpid() and \
                        Path(f"/proc/{pid}/comm").read_text().strip() == "slirp4netns":
                    first = seen.setdefault(int(pid), time.monotonic())
                    if time.monotonic() - first >= 1.0:
                        os.kill(int(pid), signal.SIGKILL)
                        killed.append(int(pid))


async def test_a_slirp4netns_that_dies_mid_session_is_recorded_and_replaced(
        tmp_path: Path, servers: tuple[int, str, int]) -> None:
    _, outside, port = servers
    stop, killed = threading.Event(), list[int]()
    killer = threading.Thread(target=_kill_our_slirp, args=(stop, killed))
    killer.start()
    try:
        ran, _ = await _rootfs_run(  # the verifier needs its way out again
            tmp_path, "", "sleep 4; echo done",
            test_sh=f"bash -c 'echo > /dev/tcp/{outside}/{port}'\n")
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "no slirp4netns was seen to kill"
    (gap,) = [e.data for e in ran.view.events
              if e.type == "gap.recorded" and e.data.code == "network_lost"]
    assert gap.detail.startswith("slirp4netns exited during the session")
    assert ran.view.rewards == {"reward": 1.0}
