"""SPEC §15 "Network modes", `public` for image and rootfs tasks: a network namespace of the
session's own, connected outward by slirp4netns (adapters/sandbox/slirp.py).

Real parts only: a real bwrap sandbox with a private network namespace, the real
slirp4netns attached to it, real TCP servers on the host, probes run inside the sandbox.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from trialledger.adapters.sandbox import hostside
from trialledger.adapters.sandbox.slirp import (
    SlirpFailed,
    injected_files,
    slirp_problem,
    start_slirp,
)

pytestmark = pytest.mark.anyio
DEADLINE_S = 60

# Run inside the sandbox once it is connected: connect to each target (a banner answers),
# optionally serve a port of its own first; print what happened as JSON.
PROBE = r"""
import json, socket, sys
probe = json.loads(sys.argv[1])
out = {}
own = None
if probe.get("serve"):
    own = socket.socket()
    try:
        own.bind(("0.0.0.0", probe["serve"]))
        own.listen(4)
        out["serve"] = "bound"
    except OSError as error:
        out["serve"] = f"error: {error}"
        own = None
for host, port in probe["targets"]:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        if own is not None and port == probe["serve"]:
            peer, _ = own.accept()
            peer.sendall(b"inside\n")
            peer.close()
        out[f"{host}:{port}"] = "answered " + s.recv(64).decode().strip()
    except ConnectionRefusedError:
        out[f"{host}:{port}"] = "refused"
    except (TimeoutError, socket.timeout):
        out[f"{host}:{port}"] = "timeout"
    except OSError as error:
        out[f"{host}:{port}"] = f"error: {error}"
    finally:
        s.close()
if probe.get("abstract"):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("\0" + probe["abstract"])
        out["abstract"] = "connected"
    except OSError as error:
        out["abstract"] = f"error: {error.strerror}"
print(json.dumps(out))
"""


@dataclass
class Banner:
    """A TCP server on the host that answers each connection with its name."""

    host: str
    name: str
    listener: socket.socket = field(init=False)
    accepted: int = 0

    def __post_init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind((self.host, 0))
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                peer, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            peer.sendall(f"{self.name}\n".encode())
            peer.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


@contextmanager
def banner(host: str, name: str) -> Iterator[Banner]:
    server = Banner(host, name)
    try:
        yield server
    finally:
        server.close()


def host_address() -> str:
    """An IPv4 address of this host that is not loopback (what another machine reaches)."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                           capture_output=True, text=True, check=True, timeout=10).stdout
    addresses = [line.split()[3].split("/")[0] for line in shown.splitlines()]
    assert addresses, "this host has no non-loopback IPv4 address to test with"
    return addresses[0]


@dataclass
class Sandbox:
    """A bwrap sandbox with a private network namespace, held before its command runs."""

    process: subprocess.Popen[bytes]
    info: dict[str, Any]
    block_w: int

    @property
    def pid(self) -> int:
        return int(self.info["child-pid"])

    def interfaces(self) -> list[str]:
        """The network interfaces of the sandbox's namespace."""
        lines = Path(f"/proc/{self.pid}/net/dev").read_text().splitlines()[2:]
        return [line.split(":")[0].strip() for line in lines]

    async def run(self) -> dict[str, Any]:
        """Let the sandbox's command run; what it printed."""
        os.write(self.block_w, b"x")
        out, _ = await anyio.to_thread.run_sync(
            lambda: self.process.communicate(timeout=DEADLINE_S))
        assert self.process.returncode == 0
        parsed: dict[str, Any] = json.loads(out)
        return parsed


def _read_info(fd: int) -> dict[str, Any]:
    data = b""
    deadline = time.monotonic() + DEADLINE_S
    while not data.rstrip().endswith(b"}"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "bwrap reported no child pid in time"
        chunk = os.read(fd, 4096)
        assert chunk, "bwrap ended before reporting its child"
        data += chunk
    parsed: dict[str, Any] = json.loads(data)
    return parsed


async def settled(pid: int, block_fd: int) -> None:
    """Wait until bwrap's child waits on its block fd: it reports its pid before it brings
    its loopback up, and attaching slirp4netns or loading rules during that setup races it
    ("loopback: Failed RTM_NEWADDR")."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        with suppress(OSError):
            call = Path(f"/proc/{pid}/syscall").read_text().split()
            if call[:2] == ["0", hex(block_fd)]:  # read(block_fd, ...)
                return
        await anyio.sleep(0.01)
    raise AssertionError(f"bwrap's child {pid} did not reach its block fd in time")


@asynccontextmanager
async def sandbox(probe: Any = None, *, script: str = PROBE) -> AsyncIterator[Sandbox]:
    """bwrap with its own user, PID and network namespaces; its command (`script` given
    `probe` as JSON, else a sleep) waits until the test lets it run."""
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    command = ([sys.executable, "-c", script, json.dumps(probe)] if probe is not None
               else ["sleep", str(DEADLINE_S)])
    process = subprocess.Popen(
        ["bwrap", "--unshare-user", "--unshare-net", "--unshare-pid", "--die-with-parent",
         "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
         "--info-fd", str(info_w), "--block-fd", str(block_r), *command],
        stdout=subprocess.PIPE, pass_fds=(info_w, block_r))
    os.close(info_w)
    os.close(block_r)
    info: dict[str, Any] = {}
    try:
        info = _read_info(info_r)
        await settled(int(info["child-pid"]), block_r)
        yield Sandbox(process, info, block_w)
    finally:
        if process.poll() is None:
            if isinstance(info.get("child-pid"), int):
                with suppress(ProcessLookupError):  # its PID namespace ends with it
                    os.kill(info["child-pid"], signal.SIGKILL)
            process.kill()
        process.communicate(timeout=DEADLINE_S)
        os.close(info_r)
        os.close(block_w)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def live_pids() -> dict[int, tuple[str, int, int]]:
    """Each process that is not a zombie: its command name, parent and process group."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            state, parent, group = stat.rsplit(")", 1)[1].split()[:3]
            if state != "Z":
                found[int(entry)] = (name, int(parent), int(group))
    return found


def processes_in_group(group: int) -> list[int]:
    """Live processes whose process group is `group` (slirp4netns and its child)."""
    return [pid for pid, (_, _, of) in live_pids().items() if of == group]


def slirps_since(before: dict[int, tuple[str, int, int]]) -> list[int]:
    """This test's slirp4netns processes (children of this process, or theirs) alive now
    that were not in `before` (other tests may run slirp4netns at the same time)."""
    now = live_pids()
    ours = {pid for pid, (_, parent, _) in now.items() if parent == os.getpid()}
    return [pid for pid, (name, parent, _) in now.items()
            if name == "slirp4netns" and pid not in before and (pid in ours or parent in ours)]


@pytest.fixture(autouse=True)
def _slirp_usable() -> None:
    assert slirp_problem() is None, slirp_problem()  # .ci/run installs it: never a skip


async def test_the_session_reaches_the_host_as_another_machine_would() -> None:
    """The host's network address answers; its loopback services do not, neither as
    127.0.0.1 (the namespace's own) nor through slirp's gateway 10.0.2.2, and neither do
    its abstract Unix sockets (they belong to the network namespace)."""
    name = f"trialledger-test-{os.getpid()}"
    with (socket.socket(socket.AF_UNIX) as abstract, banner(host_address(), "outside") as outside,
          banner("127.0.0.1", "loopback") as lo):
        abstract.bind("\0" + name)
        abstract.listen(1)
        targets = [(outside.host, outside.port), ("127.0.0.1", lo.port), ("10.0.2.2", lo.port)]
        async with sandbox({"targets": targets, "abstract": name}) as box:
            slirp = await start_slirp(box.pid, net_namespace=box.info["net-namespace"])
            try:
                seen = await box.run()
            finally:
                await slirp.stop()
        assert seen[f"{outside.host}:{outside.port}"] == "answered outside"
        assert seen[f"127.0.0.1:{lo.port}"] == "refused"  # the namespace's own loopback
        assert not seen[f"10.0.2.2:{lo.port}"].startswith("answered")  # slirp: unreachable
        assert lo.accepted == 0
        assert seen["abstract"] == "error: Connection refused"


async def test_ports_are_the_sessions_own() -> None:
    """A port the host already serves on 127.0.0.1 is free inside, and the session's server
    on it answers at the namespace's own address."""
    with banner("127.0.0.1", "host") as taken:
        port = taken.port
        probe = {"serve": port, "targets": [("10.0.2.100", port)]}
        async with sandbox(probe) as box:
            slirp = await start_slirp(box.pid)
            try:
                seen = await box.run()
            finally:
                await slirp.stop()
        assert seen == {"serve": "bound", f"10.0.2.100:{port}": "answered inside"}
        assert taken.accepted == 0


async def test_stop_ends_slirp_and_the_link_and_can_be_started_again() -> None:
    async with sandbox() as box:
        fds = open_fds()
        assert "tap0" not in box.interfaces()
        first = await start_slirp(box.pid)
        assert first.running and "tap0" in box.interfaces()
        await first.stop()
        await first.stop()  # idempotent
        assert not first.running and processes_in_group(first.pid) == []
        assert "tap0" not in box.interfaces()
        again = await start_slirp(box.pid)  # as before another phase (SPEC §15)
        assert "tap0" in box.interfaces()
        await again.stop()
        assert processes_in_group(again.pid) == []
        assert open_fds() == fds



async def test_kill_ends_slirp_without_awaiting_it() -> None:
    """A sandbox discarded whose `close` was never awaited (its loop gone) ends its
    slirp4netns, and a compose service's, with the synchronous `kill`."""
    async with sandbox() as box:
        fds = open_fds()
        slirp = await start_slirp(box.pid)
        slirp.kill()
        slirp.kill()  # idempotent
        assert not slirp.running and processes_in_group(slirp.pid) == []
        assert "tap0" not in box.interfaces()
        await slirp.stop()  # and `close` after it does nothing more
        assert open_fds() == fds


RUNNER = """
import anyio, sys
from trialledger.adapters.sandbox.slirp import start_slirp
async def main():
    slirp = await start_slirp(int(sys.argv[1]))
    print(slirp.pid, flush=True)
    await anyio.sleep(60)
anyio.run(main)
"""


async def test_slirp4netns_never_outlives_its_runner() -> None:
    """A runner killed outright closes the exit fd with its other files: slirp4netns ends."""
    async with sandbox() as box:
        runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(box.pid)],
                                  stdout=subprocess.PIPE)
        try:
            assert runner.stdout is not None
            with anyio.fail_after(DEADLINE_S):
                line = await anyio.to_thread.run_sync(runner.stdout.readline,
                                                      abandon_on_cancel=True)
            slirp = int(line)
            assert "tap0" in box.interfaces()
        finally:
            runner.kill()
            runner.communicate(timeout=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while slirp in live_pids() and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        assert slirp not in live_pids()
        assert "tap0" not in box.interfaces()


async def _refused(pid: int, **options: Any) -> SlirpFailed:
    fds = open_fds()
    with pytest.raises(SlirpFailed) as caught:
        await start_slirp(pid, **options)
    assert open_fds() - fds == set()  # none left open (others' may have closed meanwhile)
    error = caught.value
    assert "\n" not in str(error) and error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__  # no chained traceback
    return error


async def test_a_pid_without_a_namespace_is_refused_in_one_line() -> None:
    absent = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    error = await _refused(absent)
    assert str(error) == (f"cannot open the network namespace of pid {absent}: "
                          f"No such file or directory")


async def test_the_hosts_own_network_and_a_reused_pid_are_refused() -> None:
    error = await _refused(os.getpid())
    assert "the runner's own (the host's network)" in str(error)
    async with sandbox() as box:
        error = await _refused(box.pid, net_namespace=box.info["net-namespace"] + 1)
        assert "not the sandbox's" in str(error)
        assert "tap0" not in box.interfaces()


async def test_a_failing_slirp4netns_is_reported_with_its_own_words() -> None:
    """A second slirp4netns on a connected namespace cannot take its tap device: the error
    quotes slirp4netns, and nothing of it is left running."""
    async with sandbox() as box:
        running = await start_slirp(box.pid)
        try:
            before = live_pids()
            error = await _refused(box.pid)
            assert str(error).startswith(f"slirp4netns could not connect the network "
                                         f"namespace of pid {box.pid}: it exited with 1: ")
            assert "TUNSETIFF" in str(error)
            assert slirps_since(before) == []
            assert running.running  # the first link is untouched
        finally:
            await running.stop()


async def test_a_slirp4netns_not_ready_in_time_is_killed() -> None:
    async with sandbox() as box:
        before = live_pids()
        error = await _refused(box.pid, timeout_s=0)
        assert "did not report ready within 0 s" in str(error)
        assert slirps_since(before) == []
        assert "tap0" not in box.interfaces()


async def test_without_slirp4netns_the_reason_names_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostside, "SYSTEM_PATH", str(tmp_path))  # where the runner looks
    assert slirp_problem() == "slirp4netns is not installed (apt-get install slirp4netns)"
    error = await _refused(os.getpid())
    assert str(error) == "slirp4netns is not installed (apt-get install slirp4netns)"


def test_the_injected_files_are_dockers() -> None:
    files = injected_files("3f2a9c1e-77b0-4d2e-9a51-0c6f1e2d3b4a", resolver=True)
    assert files == {
        "/etc/hosts": b"127.0.0.1\tlocalhost\n"
                      b"::1\tlocalhost ip6-localhost ip6-loopback\n"
                      b"fe00::0\tip6-localnet\n"
                      b"ff00::0\tip6-mcastprefix\n"
                      b"ff02::1\tip6-allnodes\n"
                      b"ff02::2\tip6-allrouters\n"
                      b"10.0.2.100\t3f2a9c1e77b0\n",
        "/etc/hostname": b"3f2a9c1e77b0\n",
        "/etc/resolv.conf": b"nameserver 10.0.2.3\n",
    }
    offline = injected_files("3f2a9c1e-77b0-4d2e-9a51-0c6f1e2d3b4a", resolver=False)
    assert offline["/etc/resolv.conf"] == b""
    assert offline["/etc/hosts"].endswith(b"\n127.0.0.1\t3f2a9c1e77b0\n")
    # an id the runner did not make still gives a valid hostname: 12 hex digits
    named = injected_files("my session/../x", resolver=True)["/etc/hostname"].strip()
    assert len(named) == 12 and all(c in b"0123456789abcdef" for c in named)

