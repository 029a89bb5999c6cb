"""A compose session's private bridge (docs/SPEC.md §17 "Compose environments"): when every
phase of the session is `public`, each service has a network namespace of its own, as
under Harbor's docker environment, joined to the others on one bridge.

The bridge `tlbr0` lives in a network namespace of its own, made in the session's user
namespace when the first service starts (as Docker's bridge is outside every container:
the agent, holding CAP_NET_RAW, sees on its link only what is sent to it, never what the
services send each other). `main` and each service get a veth pair whose inner end is
their `eth1` (`main` at `10.89.0.1/24`, a service at `10.89.0.<2 + index>/24`) and whose
outer end is a port of the bridge. Every end is in a namespace of the session's user
namespace: nothing of it is on the host's network. Each service is connected outward by
a slirp4netns of its own (its `tap0`, the default route), as the session's container is.
The links are made with iproute2 run by the runner in those namespaces (`nsenter --net`),
one `ip -batch` per namespace.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.hostside import host_env, program

SUBNET = "10.89.0"
BRIDGE = "tlbr0"
MAIN_ADDRESS = f"{SUBNET}.1"
IP_TIMEOUT_S = 10.0
MAIN_PORT = "tlvm"  # the bridge's port to main (a service's is `tlv<index>`)


def address(index: int) -> str:
    """The bridge address of the compose service at `index` (in start order)."""
    return f"{SUBNET}.{index + 2}"


def _ip(netns_fd: int, commands: Sequence[str], other: int | None = None) -> None:
    """`commands` run by `ip -batch` in the network namespace `netns_fd`, with the
    descriptor `other` open in it too (SandboxRefused quoting iproute2 when it refuses
    one)."""
    try:
        done = subprocess.run(
            [program("nsenter"), f"--net=/proc/self/fd/{netns_fd}", "--", program("ip"),
             "-batch", "-"], input="".join(f"{line}\n" for line in commands).encode(),
            capture_output=True, env=host_env(),
            pass_fds=(netns_fd, *([other] if other is not None else [])), timeout=IP_TIMEOUT_S,
            check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxRefused(f"the compose bridge could not be set up: {error}") from None
    if done.returncode != 0:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise SandboxRefused(f"the compose bridge could not be set up: "
                             f"{why[-1] if why else f'ip exited {done.returncode}'}")


def make(userns_fd: int, init: Path) -> int:
    """The bridge's network namespace (a descriptor), made by our init (`--netns`) entered
    into the session's user namespace `userns_fd` by nsenter, held until opened."""
    try:
        holder = subprocess.Popen(
            [program("nsenter"), f"--user=/proc/self/fd/{userns_fd}", "--", str(init),
             "--netns"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=host_env(), pass_fds=(userns_fd,))
    except OSError as error:
        raise SandboxRefused(f"the compose bridge could not be set up: {error}") from None
    try:
        assert holder.stdout is not None and holder.stderr is not None
        if holder.stdout.readline() != b"ready\n":
            holder.kill()
            why = holder.stderr.read(4096).decode("utf-8", "replace").strip()
            raise SandboxRefused(f"the compose bridge could not be set up: "
                                 f"{why or 'its network namespace was not made'}")
        return os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()


def _link(bridge_netns: int, port: str, inner_netns: int, inner_address: str) -> None:
    """A veth pair from the bridge (its port `port`) to `eth1` at `inner_address` in the
    namespace `inner_netns` (a descriptor held since it was made: never a pid that may
    have been reused)."""
    _ip(bridge_netns, [
        f"link add {port} type veth peer name eth1 netns /proc/self/fd/{inner_netns}",
        f"link set {port} master {BRIDGE}", f"link set {port} up"], other=inner_netns)
    _ip(inner_netns, [f"addr add {inner_address}/24 dev eth1", "link set eth1 up"])


def start(bridge_netns: int, main_netns: int) -> None:
    """The bridge made in `bridge_netns`, and `main` (its namespace `main_netns`) on it."""
    _ip(bridge_netns, [f"link add {BRIDGE} type bridge", f"link set {BRIDGE} up"])
    _link(bridge_netns, MAIN_PORT, main_netns, MAIN_ADDRESS)


def attach(bridge_netns: int, service_netns: int, index: int) -> None:
    """Put the service at `index` (its network namespace `service_netns`) on the bridge."""
    _link(bridge_netns, f"tlv{index}", service_netns, address(index))
