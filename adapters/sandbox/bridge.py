"""A compose session's private bridge (docs/SPEC.md §17 "Compose environments"): when every
phase of the session is `public`, each service has a network namespace of its own, as
under Harbor's docker environment, joined to the others on one bridge.

The bridge `tlbr0` lives in the session's own network namespace (the agent's container's,
`10.89.0.1/24`); each service's namespace gets a veth pair whose inner end is its `eth1`
(`10.89.0.<2 + index>/24`) and whose outer end is a port of the bridge. Both ends are in
namespaces of the session's user namespace: nothing of it is on the host's network. Each
service is connected outward by a slirp4netns of its own (its `tap0`, the default route),
as the session's container is. The links are made with iproute2 run by the runner in that
namespace (`nsenter --net`), one `ip -batch` per namespace.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from trialledger.adapters.sandbox.base import SandboxRefused
from trialledger.adapters.sandbox.hostside import host_env, program

SUBNET = "10.89.0"
BRIDGE = "tlbr0"
MAIN_ADDRESS = f"{SUBNET}.1"
IP_TIMEOUT_S = 10.0


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


def attach(session_netns: int, service_netns: int, index: int, *, first: bool) -> None:
    """Put the service whose network namespace is `service_netns` (a descriptor held since
    its container started: never a pid that may have been reused) on the session's bridge
    (made with the `first` service): its `eth1` at `address(index)`."""
    outer = f"tlv{index}"
    _ip(session_netns, [
        *([f"link add {BRIDGE} type bridge", f"addr add {MAIN_ADDRESS}/24 dev {BRIDGE}",
           f"link set {BRIDGE} up"] if first else []),
        f"link add {outer} type veth peer name eth1 netns /proc/self/fd/{service_netns}",
        f"link set {outer} master {BRIDGE}", f"link set {outer} up"], other=service_netns)
    _ip(service_netns, [f"addr add {address(index)}/24 dev eth1", "link set eth1 up"])
