"""The bwrap command line as a pure function (adapters/sandbox/bwrap.py): tables of what
each kind of spawn sees, and properties every spawn keeps. The containment suite checks
the same promises end to end through real Codex tool calls; these pin the command line."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trialledger.adapters.sandbox.bwrap import INIT_INSIDE, Spawn, bwrap_argv, mounts

SYSTEM = (("/usr", None), ("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/etc", None))
HOST_AGENT = Spawn(
    role="agent", uid=990, gid=990, workdir="/app", init="/var/lib/tl/init",
    session_dir="/tmp/trialledger-ab/home", system=SYSTEM,
    workdir_source="/tmp/trialledger-ab/work",
    codex=(("/opt/codex/bin/codex", "/run/trialledger/codex"),),
    readonly=("/srv/data",), tests="/tmp/trialledger-ab/tests-1")
IMAGE_AGENT = replace(HOST_AGENT, uid=0, gid=0, root="/tmp/trialledger-ab/merged",
                      system=(), workdir_source=None)
SLASH_AGENT = replace(HOST_AGENT, workdir="/", root="/tmp/trialledger-ab/merged",
                      workdir_source=None)  # workdir / on an overlay of the host's system
VERIFIER = replace(HOST_AGENT, role="verifier", verifier_logs="/tmp/trialledger-ab/vlogs")
PRISTINE = replace(IMAGE_AGENT, role="verifier", verifier_logs="/tmp/trialledger-ab/vlogs",
                   root="/tmp/trialledger-ab/pristine-1-merged", sees_agent_files=False,
                   workdir_source="/tmp/trialledger-ab/merged/app")
PROBE = replace(HOST_AGENT, role="probe")

REQUIRED = (  # written out here, not imported: a flag dropped from the code fails this
    "--unshare-user", "--disable-userns", "--cap-drop", "--unshare-pid", "--as-pid-1",
    "--unshare-ipc", "--unshare-uts", "--new-session", "--die-with-parent")

# (spawn, (option, source, target) triples it must have, targets it must not have)
TABLE: dict[str, tuple[Spawn, list[tuple[str, str | None, str]], list[str]]] = {
    "host agent": (HOST_AGENT, [
        ("--ro-bind", "/usr", "/usr"), ("--symlink", "usr/bin", "/bin"),
        ("--ro-bind", "/etc", "/etc"), ("--ro-bind", "/proc/sys", "/proc/sys"),
        ("--ro-bind", "/var/lib/tl/init", INIT_INSIDE),
        ("--ro-bind", "/opt/codex/bin/codex", "/run/trialledger/codex"),
        ("--ro-bind", "/srv/data", "/srv/data"),
        ("--bind", "/tmp/trialledger-ab/home", "/tmp/trialledger-ab/home"),
        ("--tmpfs", None, "/tmp/trialledger-ab/home/skills"),  # Codex's scratch, in memory
        ("--bind", "/tmp/trialledger-ab/work", "/app"),
    ], ["/", "/tests", "/logs/verifier"]),
    "image agent": (IMAGE_AGENT, [
        ("--bind", "/tmp/trialledger-ab/merged", "/"),
        ("--ro-bind", "/opt/codex/bin/codex", "/run/trialledger/codex"),
        ("--bind", "/tmp/trialledger-ab/home", "/tmp/trialledger-ab/home"),
    ], ["/usr", "/bin", "/etc", "/app", "/tests"]),  # nothing of the host's system
    "host agent, workdir /": (SLASH_AGENT, [
        ("--bind", "/tmp/trialledger-ab/merged", "/"), ("--ro-bind", "/usr", "/usr"),
        ("--symlink", "usr/bin", "/bin"), ("--ro-bind", "/etc", "/etc"),
    ], ["/tests", "/app"]),
    "verifier (root agent)": (VERIFIER, [
        ("--bind", "/tmp/trialledger-ab/tests-1", "/tests"),  # a fresh copy, writable
        ("--bind", "/tmp/trialledger-ab/vlogs", "/logs/verifier"),
        ("--bind", "/tmp/trialledger-ab/work", "/app"),
        ("--ro-bind", "/srv/data", "/srv/data"),
    ], ["/run/trialledger/codex"]),  # no Codex for the verifier
    "verifier (root pristine)": (PRISTINE, [
        ("--bind", "/tmp/trialledger-ab/pristine-1-merged", "/"),
        ("--bind", "/tmp/trialledger-ab/merged/app", "/app"),
        ("--bind", "/tmp/trialledger-ab/tests-1", "/tests"),
    ], ["/tmp/trialledger-ab/home", "/srv/data", "/run/trialledger/codex"]),
    "probe": (PROBE, [("--ro-bind", "/var/lib/tl/init", INIT_INSIDE)],
              ["/tests", "/logs/verifier", "/run/trialledger/codex"]),
}


def triples(argv: list[str]) -> list[tuple[str, str | None, str]]:
    """The mounts on a bwrap command line, as (option, source, target)."""
    found: list[tuple[str, str | None, str]] = []
    i = 0
    while argv[i] != "--":
        option = argv[i]
        if option in ("--bind", "--ro-bind", "--symlink", "--dev-bind"):
            found.append((option, argv[i + 1], argv[i + 2]))
            i += 3
        elif option in ("--proc", "--dev", "--tmpfs"):
            found.append((option, None, argv[i + 1]))
            i += 2
        elif option in ("--uid", "--gid", "--block-fd", "--info-fd", "--chdir", "--cap-drop"):
            i += 2
        else:
            i += 1
    return found


def argv_of(spawn: Spawn) -> list[str]:
    return bwrap_argv(spawn, mounts(spawn), ["/run/trialledger/init", "--", "codex", "exec"])


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_kind_of_spawn_sees_what_it_should_and_nothing_else(name: str) -> None:
    spawn, wanted, absent = TABLE[name]
    argv = argv_of(spawn)
    found = triples(argv)
    for mount in wanted:
        assert mount in found, (name, mount)
    targets = {target for _, _, target in found}
    assert not targets & set(absent), (name, targets & set(absent))
    assert argv[-4:] == ["/run/trialledger/init", "--", "codex", "exec"]
    assert argv[argv.index("--chdir") + 1] == spawn.workdir
    assert argv[argv.index("--uid") + 1] == str(spawn.uid)


def test_only_an_isolated_network_unshares_it_and_waits_for_the_proxies() -> None:
    assert "--unshare-net" not in argv_of(HOST_AGENT)
    argv = argv_of(replace(HOST_AGENT, isolated_network=True, block_fd=7))
    assert "--unshare-net" in argv and argv[argv.index("--block-fd") + 1] == "7"


def test_sources_the_runner_stages_are_the_agents_host_reads() -> None:
    """Codex and the grants are staged when the runner is root (the sandbox user may not
    read them); nothing the agent writes is, nor the verifier's copy of the tests."""
    staged = {(m.source, m.target) for m in mounts(VERIFIER) if m.staged}
    assert staged == {("/srv/data", "/srv/data")}
    assert {(m.source, m.target) for m in mounts(HOST_AGENT) if m.staged} == {
        ("/opt/codex/bin/codex", "/run/trialledger/codex"), ("/srv/data", "/srv/data")}


paths = st.sampled_from(["/srv/a", "/srv/b", "/opt/x", "/home/u/data"])
spawns = st.builds(
    Spawn,
    role=st.sampled_from(["agent", "probe", "verifier"]),
    uid=st.integers(0, 70000), gid=st.integers(0, 70000),
    workdir=st.sampled_from(["/app", "/", "/work/deep", "/tmp/w"]),
    init=st.just("/var/lib/tl/init"), session_dir=st.just("/tmp/trialledger-x/home"),
    root=st.none() | st.just("/tmp/trialledger-x/merged"),
    system=st.sampled_from([SYSTEM, ()]),
    workdir_source=st.none() | st.just("/tmp/trialledger-x/work"),
    codex=st.just((("/opt/codex/codex", "/run/trialledger/codex"),)),
    readonly=st.lists(paths, max_size=3).map(tuple),
    sees_agent_files=st.booleans(),
    tests=st.none() | st.just("/tmp/trialledger-x/tests-1"),
    verifier_logs=st.none() | st.just("/tmp/trialledger-x/vlogs"),
    isolated_network=st.booleans(),
    block_fd=st.none() | st.integers(3, 50), info_fd=st.integers(3, 50))


@given(spawn=spawns)
def test_every_spawn_keeps_the_sandbox_promises(spawn: Spawn) -> None:
    argv = argv_of(spawn)
    options = argv[:argv.index("--chdir")]
    assert argv[0] == spawn.bwrap and argv[0].startswith("/")  # never a PATH search
    for flag in REQUIRED:
        assert flag in options
    assert options[options.index("--cap-drop") + 1] == "ALL"
    found = triples(argv)
    assert not any(option == "--dev-bind" for option, _, _ in found)
    writable = {(source, target) for option, source, target in found if option == "--bind"}
    allowed = {(spawn.session_dir, spawn.session_dir), (spawn.root, "/"),
               (spawn.workdir_source, spawn.workdir), (spawn.verifier_logs, "/logs/verifier"),
               (spawn.tests, "/tests")}
    assert writable <= allowed  # the agent writes only its layers, never a host folder
    assert all(source != "/" for _, source, _ in found)  # the host's root is never mounted
    targets = [target for _, _, target in found]
    if spawn.role != "verifier":
        assert "/tests" not in targets and "/logs/verifier" not in targets
    if spawn.role != "agent":
        assert "/run/trialledger/codex" not in targets
    for path in spawn.readonly:
        assert ("--bind", path, path) not in found  # a grant is read-only, always
    if not spawn.system:  # over an image, nothing of the host's system folders
        assert not {"/usr", "/bin", "/etc"} & set(targets)
    for option, _, target in found:  # the host's system folders: read-only or host links
        if target in {path for path, _ in SYSTEM}:
            assert option in ("--ro-bind", "--symlink")
