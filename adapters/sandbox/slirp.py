"""A session's own network namespace, connected outward by slirp4netns (docs/SPEC.md §15
"Network modes") — and the files Docker injects into a container's network identity.

slirp4netns gives the namespace a tap device (`10.0.2.100/24`, gateway `10.0.2.2`, resolver
`10.0.2.3`) and carries its traffic out through ordinary sockets of the host, as Docker's
bridge network does: ports inside are the session's own, and `--disable-host-loopback`
keeps the host's loopback services (and the gateway address that would lead to them) out
of reach. It parses every packet the agent sends, so it runs confined, as podman runs it:
`--enable-sandbox` (a mount namespace of its own whose root holds only `/etc` and `/run`,
read-only; every capability dropped but NET_BIND_SERVICE) and `--enable-seccomp` (no
execve, ptrace, mount, setns…). Without NET_RAW its ICMP relay (`ping`) needs the host's
`net.ipv4.ping_group_range` to admit group 0.

The namespace is named by a pid, but slirp4netns is handed the namespace the runner opened
and checked (never the host's own; the sandbox's by inode when the caller knows it), so a
pid reused by another process cannot redirect it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence

import anyio

from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.hostside import find, host_env, program

log = logging.getLogger(__name__)

TAP = "tap0"
MTU = 65520
ADDRESS = "10.0.2.100"  # the namespace's own address (slirp4netns --configure)
GATEWAY = "10.0.2.2"
RESOLVER = "10.0.2.3"  # slirp's DNS forwarder to the host's resolver
TUN = "/dev/net/tun"
CONFINED = ("--enable-sandbox", "--enable-seccomp")
NS_GET_USERNS = 0xB701  # linux/nsfs.h: the user namespace owning a namespace
NEEDED_OPTIONS = ("--configure", "--disable-host-loopback", "--netns-type", "--userns-path",
                  *CONFINED)
STOP_GRACE_S = 2.0
STDERR_KEEP = 8192
# Docker's defaults (libnetwork's etchosts), tab-separated as it writes them.
DOCKER_HOSTS = (("127.0.0.1", "localhost"), ("::1", "localhost ip6-localhost ip6-loopback"),
                ("fe00::0", "ip6-localnet"), ("ff00::0", "ip6-mcastprefix"),
                ("ff02::1", "ip6-allnodes"), ("ff02::2", "ip6-allrouters"))
_said: set[str] = set()
_options_missing: dict[str, str | None] = {}  # binary → an option it lacks (None: none)


class SlirpFailed(SandboxRefused):
    """slirp4netns could not connect a session's network namespace (the message says why,
    with the end of what slirp4netns printed)."""


def slirp_problem() -> str | None:
    """Why slirp4netns cannot connect a session's namespace here (None: it can): it is not
    installed, lacks an option used here, or there is no TUN device. Each problem is
    logged once per process; the check itself runs each time (it is cheap)."""
    problem = _problem()
    if problem is not None and problem not in _said:
        _said.add(problem)
        log.warning("a session's own network cannot be connected: %s", problem)
    return problem


def _problem() -> str | None:
    binary = find("slirp4netns")
    if binary is None:
        return "slirp4netns is not installed (apt-get install slirp4netns)"
    if binary not in _options_missing:
        _options_missing[binary] = _missing_option(binary)
    if (missing := _options_missing[binary]) is not None:
        return f"{binary} has no {missing} option (a newer slirp4netns is needed)"
    try:
        os.close(os.open(TUN, os.O_RDWR | os.O_CLOEXEC))
    except OSError as error:
        return f"slirp4netns needs {TUN}, which cannot be opened here: {error.strerror}"
    return None


def _missing_option(binary: str) -> str | None:
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=5,
                              check=False, env=host_env())
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"working --help ({error})"
    usage = done.stdout + done.stderr
    return next((option for option in NEEDED_OPTIONS if option not in usage), None)


class Slirp:
    """A running slirp4netns that connects one network namespace; `stop()` ends it."""

    def __init__(self, process: subprocess.Popen[bytes], exit_fd: int, target: int) -> None:
        self._process = process
        self._exit_fd: int | None = exit_fd  # slirp4netns exits when this end closes
        self.target = target
        self._tail: deque[bytes] = deque()
        self._tail_size = 0
        self._lock = threading.Lock()
        # slirp4netns may print for as long as it lives: drained, so it never blocks on it
        self._drain = threading.Thread(target=self._read_stderr, name="slirp4netns-stderr",
                                       daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        """slirp4netns's own pid."""
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether slirp4netns still runs."""
        return self._process.poll() is None

    def _read_stderr(self) -> None:
        assert self._process.stderr is not None
        fd = self._process.stderr.fileno()
        while chunk := os.read(fd, 4096):
            with self._lock:
                self._tail.append(chunk)
                self._tail_size += len(chunk)
                while self._tail_size - len(self._tail[0]) >= STDERR_KEEP:
                    self._tail_size -= len(self._tail.popleft())

    def stderr_tail(self, lines: int = 3) -> str:
        """The last `lines` lines slirp4netns printed, on one line."""
        with self._lock:
            text = b"".join(self._tail).decode("utf-8", errors="replace")
        kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        return "; ".join(kept)[-300:] or "it printed nothing"

    async def _ready(self, ready_fd: int, timeout_s: float) -> str | None:
        """Wait for the byte slirp4netns writes once the namespace is configured; None when
        it came, else why not."""
        with anyio.move_on_after(timeout_s):
            await anyio.wait_readable(ready_fd)
            if os.read(ready_fd, 1):
                return None
            code = await self._wait(1.0)  # it closed the pipe: it ended
            return f"exited with {code}" if code is not None else "closed its ready pipe"
        return f"did not report ready within {timeout_s:g} s"

    async def _wait(self, within_s: float) -> int | None:
        """slirp4netns's exit status once it ends, waiting at most `within_s`."""
        deadline = time.monotonic() + within_s
        while (code := self._process.poll()) is None and time.monotonic() < deadline:
            await anyio.sleep(0.02)
        return code

    def kill(self) -> None:
        """End slirp4netns at once, without waiting on an event loop (a sandbox discarded
        whose `close` was never awaited). Idempotent."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(STOP_GRACE_S)

    async def stop(self) -> None:
        """End slirp4netns: close its exit fd, wait up to 2 s, then kill it. Idempotent; the
        namespace is left without an outward link (its tap device goes with slirp4netns)."""
        with anyio.CancelScope(shield=True):
            if self._exit_fd is not None:
                os.close(self._exit_fd)
                self._exit_fd = None
            if await self._wait(STOP_GRACE_S) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._process.pid, signal.SIGKILL)  # and its configuring child
                if await self._wait(STOP_GRACE_S) is None:
                    log.warning("slirp4netns (pid %d) did not end after SIGKILL",
                                self._process.pid)
                    return
            await anyio.to_thread.run_sync(self._drain.join, 1.0)
            if self._process.stderr is not None and not self._drain.is_alive():
                self._process.stderr.close()


def _open_namespaces(pid: int, net_namespace: int | None) -> tuple[int, int]:
    """The network namespace of `pid` and the user namespace that owns it (not always
    `pid`'s own: bwrap's --disable-userns nests one more), opened and checked (fds to
    close)."""
    opened: list[int] = []
    try:
        opened.append(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        opened.append(fcntl.ioctl(opened[0], NS_GET_USERNS))
        inode = os.fstat(opened[0]).st_ino
        if inode == os.stat("/proc/self/ns/net").st_ino:
            raise SlirpFailed(f"refusing to connect the network namespace of pid {pid}: it is "
                              f"the runner's own (the host's network)")
        if net_namespace is not None and inode != net_namespace:
            raise SlirpFailed(f"refusing to connect the network namespace of pid {pid}: it is "
                              f"not the sandbox's (inode {inode}, expected {net_namespace}; "
                              f"was the pid reused?)")
    except OSError as error:
        for fd in opened:
            os.close(fd)
        raise SlirpFailed(f"cannot open the network namespace of pid {pid}: "
                          f"{error.strerror}") from None
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened[0], opened[1]


async def start_slirp(pid: int, *, timeout_s: float = 10,
                      net_namespace: int | None = None) -> Slirp:
    """Connect the network namespace of `pid` outward (`tap0`, 10.0.2.100) and return once
    slirp4netns reports it configured. `net_namespace`: the inode the namespace must have
    (bwrap's `--info-fd` reports it as `net-namespace`). Raises `SlirpFailed` (nothing
    left running or open) when slirp4netns is unusable, fails, or is not ready within
    `timeout_s`."""
    if (problem := slirp_problem()) is not None:
        raise SlirpFailed(problem)
    binary = program("slirp4netns")
    netns, userns = _open_namespaces(pid, net_namespace)
    ready_r, ready_w = os.pipe()
    exit_r, exit_w = os.pipe()
    argv = [binary, "--configure", f"--mtu={MTU}", "--disable-host-loopback", *CONFINED,
            f"--ready-fd={ready_w}", f"--exit-fd={exit_r}", "--netns-type=path",
            f"--userns-path=/proc/self/fd/{userns}", f"/proc/self/fd/{netns}", TAP]
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, env=host_env(),
                                   pass_fds=(ready_w, exit_r, netns, userns),
                                   start_new_session=True)
    except OSError as error:
        os.close(ready_r)
        os.close(exit_w)
        raise SlirpFailed(f"cannot start slirp4netns: {error.strerror}") from None
    finally:
        for fd in (netns, userns, ready_w, exit_r):
            os.close(fd)
    slirp = Slirp(process, exit_w, pid)
    try:
        why = await slirp._ready(ready_r, timeout_s)
    except BaseException:
        await slirp.stop()
        raise
    finally:
        os.close(ready_r)
    if why is not None:
        await slirp.stop()  # its stderr is read to the end before its tail is quoted
        raise SlirpFailed(f"slirp4netns could not connect the network namespace of pid "
                          f"{pid}: it {why}: {slirp.stderr_tail()}")
    return slirp


def hostname_of(session_id: str) -> str:
    """The session's hostname, as Docker's is its container id's: the first 12 hex digits
    of the session id (dashes removed); an id that does not start with 12 of them (not one
    the runner made) gives the first 12 of its SHA-256."""
    digits = session_id.replace("-", "").lower()[:12]
    if len(digits) == 12 and all(c in "0123456789abcdef" for c in digits):
        return digits
    return hashlib.sha256(session_id.encode()).hexdigest()[:12]


def injected_files(session_id: str, *, resolver: bool,
                   neighbours: Sequence[tuple[str, str]] = ()) -> dict[str, bytes]:
    """The files Docker writes over a container's image (SPEC §15 "Container lifetime"):
    `/etc/hosts` (Docker's defaults plus the hostname), `/etc/hostname` and
    `/etc/resolv.conf`. `resolver`: some phase of the session is connected by slirp4netns
    (`public` or `allowlist`): the hostname names its address and slirp's resolver
    answers; otherwise the hostname names 127.0.0.1 (the namespace has no other address)
    and resolv.conf is empty. `neighbours` (a compose task's services and `main`): (address,
    name) lines after those."""
    hostname = hostname_of(session_id)
    hosts = [*DOCKER_HOSTS, (ADDRESS if resolver else "127.0.0.1", hostname)]
    hosts += neighbours
    return {
        "/etc/hosts": "".join(f"{ip}\t{names}\n" for ip, names in hosts).encode(),
        "/etc/hostname": f"{hostname}\n".encode(),
        "/etc/resolv.conf": f"nameserver {RESOLVER}\n".encode() if resolver else b"",
    }
