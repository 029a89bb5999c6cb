"""Compose environments (docs/SPEC.md §17 "Compose environments"; adapters/tasks/compose.py,
adapters/sandbox/services.py): a task's `environment/docker-compose.yaml` read as Harbor's
docker environment merges it (each key honoured, warned or refused by name), and its
services run as real runc containers of the session over images built offline
(tests/images.py) — started in `depends_on` order, healthy before `main`, in one network
namespace with the agent's container, stopped with the session."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.images import base_images, module_private_storage  # noqa: F401 (fixtures)
from tests.runs import in_process
from tests.tasks.test_task_artifacts import gaps, session, verification
from trialledger.adapters.sandbox import bridge
from trialledger.adapters.sandbox.idrange import DOCKER_CAPS
from trialledger.adapters.tasks import compose
from trialledger.adapters.tasks.task import Task, TaskInvalid, UnsupportedField

pytestmark = pytest.mark.usefixtures("base_images")  # the images the tasks name
DATASET = Path(__file__).parents[1] / "data" / "features"
TOML = '[environment]\ndocker_image = "localhost/tl-debian:plain"\nworkdir = "/app"\n'


def task_with(folder: Path, yaml: str, toml: str = TOML) -> Path:
    """A task folder with `yaml` as its compose file."""
    (folder / "environment").mkdir(parents=True)
    (folder / "instruction.md").write_text("compose\n")
    (folder / "task.toml").write_text(toml)
    (folder / "environment" / "docker-compose.yaml").write_text(yaml)
    return folder


def load(tmp_path: Path, yaml: str, toml: str = TOML) -> Task:
    return Task.load(task_with(tmp_path / "task", yaml, toml))


# --- reading the file ---------------------------------------------------------------------


def test_services_are_read_in_depends_on_order_with_main_last(tmp_path: Path) -> None:
    task = load(tmp_path, """
services:
  main: {depends_on: {api: {condition: service_healthy}}}
  api:
    image: localhost/tl-busybox:configured
    depends_on: [db]
    command: httpd -f -p "80 80"
    healthcheck: {test: "wget -q localhost", interval: 1m30s, timeout: 500ms}
  db: {build: {context: ./db, args: {V: "1"}}, environment: [A=b, C]}
""")
    assert task.compose is not None
    assert [s.name for s in task.compose.services] == ["db", "api", "main"]
    db, api, main = task.compose.services
    assert main.depends_on == {"api": "service_healthy"}
    assert api.depends_on == {"db": "service_started"}
    assert api.command == ("httpd", "-f", "-p", "80 80")  # split as a shell would, no shell
    assert api.healthcheck is not None and api.healthcheck.command == "wget -q localhost"
    assert (api.healthcheck.interval_sec, api.healthcheck.timeout_sec) == (90.0, 0.5)
    assert api.healthcheck.retries == 3  # Docker's default
    assert db.source is not None and db.source.context == "environment/db"
    assert dict(db.source.build_args) == {"V": "1"}
    assert db.env == {"A": "b"}  # `C` alone: unset here, as Compose leaves it


@pytest.mark.parametrize(("yaml", "named"), [
    ("services:\n  db: {image: x, volumes: ['/etc:/host']}\n", "never bound in"),
    ("services:\n  db: {image: x, volumes: ['/data']}\n", "SOURCE:TARGET"),
    ("services:\n  db: {image: x, volumes: [{type: tmpfs, target: /t}]}\n", "tmpfs"),
    ("services: {}\nvolumes: {data: {driver: nfs}}\n", "volumes.data"),
    ("services:\n  db: {image: x, privileged: true}\n", "services.db.privileged"),
    ("services:\n  db: {image: x, cap_add: [NET_ADMIN]}\n", "cap_add: NET_ADMIN"),
    ("services:\n  db: {image: x, cap_add: [all]}\n", "cap_add: ALL"),
    ("services:\n  db: {image: x, security_opt: ['seccomp=unconfined']}\n",
     "services.db.security_opt"),
    ("services:\n  db: {image: x, volumes: ['./c:/c:ro,shared']}\n", "(ro, rw; z, Z)"),
    ("services:\n  main: {cap_drop: [ALL]}\n", "services.main.cap_drop: not supported"),
    ("services: {}\nnetworks: {back: {internal: 'yes'}}\n", "networks.back.internal: not"),
    ("services:\n  db: {image: x, tmpfs: ['/t:suid']}\n", "'suid': not supported here"),
    ("services:\n  db: {image: x, tmpfs: ['/t:size=1m;x']}\n", "not supported here"),
    ("services:\n  db: {image: x, tmpfs: /logs/verifier}\n", "harness's own"),
    ("services: {}\nnetworks: {back: {external: true}}\n", "networks.back.external: not"),
    ("services:\n  db: {image: x, networks: {back: {aliases: [d]}}}\nnetworks: {back: }\n",
     "services.db.networks.back: options"),
    ("services:\n  db: {image: x, network_mode: host}\n", "network_mode: 'host': only 'none'"),
    ("services:\n  db: {image: x, network_mode: 'service:web'}\n", "only 'none'"),
    ("services:\n  main: {network_mode: none}\n", "services.main.network_mode: not supported"),
    ("services:\n  db: {build: /etc}\n", "a host path is never built from"),
    ("services:\n  main: {image: other}\n", "services.main.image"),
    ("services:\n  main: {command: [sh]}\n", "services.main.command"),
    ("services:\n  db: {build: {context: ., network: host}}\n", "services.db.build.network"),
    ("services:\n  db: {image: x, depends_on: {main: {}}}\n", "depends on `main`"),
    ("services:\n  main: {volumes: ['v:/logs/verifier']}\nvolumes: {v: }\n", "harness's own"),
    ("services:\n  main: {volumes: ['v:/run']}\nvolumes: {v: }\n", "harness's own"),
    ("services:\n" + "".join(f"  s{i}: {{image: x}}\n" for i in range(65)), "at most 64"),
])
def test_a_key_we_cannot_honour_is_refused_by_name(tmp_path: Path, yaml: str,
                                                   named: str) -> None:
    with pytest.raises(UnsupportedField, match=named.replace(".", r"\.")):
        load(tmp_path, yaml)


@pytest.mark.parametrize(("yaml", "why"), [
    ("services:\n  db: {image: x, depends_on: [web]}\n  web: {image: x, depends_on: [db]}\n",
     "cycle"),
    ("services:\n  db: {image: x, depends_on: [nope]}\n", "no service named 'nope'"),
    ("services:\n  db: {build: ../../..}\n", "inside the task folder"),
    ("services:\n  db: {command: [sh]}\n", "needs an `image` or a `build`"),
    ("services:\n  db: {image: '${NOT_SET_ANYWHERE_42}'}\n", "NOT_SET_ANYWHERE_42"),
    ("services:\n  db: {image: 'a$b$'}\n", "cannot interpolate"),
    ("services: [a]\n", "expected a mapping"),
    ("services:\n  db: {image: x, healthcheck: {test: [CMD]}}\n", "test"),
    ("services:\n  db: {image: x, healthcheck: {test: ls, interval: soon}}\n", "duration"),
    ("services: {db: {image: x}\n", "not YAML"),
    ("services:\n  \"db\\n\": {image: x}\n", "is not a service name"),
    ("services:\n  db: {image: x, volumes: [{type: volume, source: /etc, target: /h}]}\n"
     "volumes: {/etc: }\n", "is not a volume name"),
    ("services:\n  db: {image: x, healthcheck: {test: ls, interval: .inf}}\n", "up to a day"),
    ("services:\n  db: {image: x, healthcheck: {test: ls, retries: 99999999}}\n", "retries"),
    ("services:\n  db: {image: x, environment: {A: \"a\\0b\"}}\n", "NUL"),
    ("services:\n  db: {build: }\n", "services.db.build: expected a path or a mapping"),
    ("services:\n  db: {build: \"a\\0b\"}\n", "a NUL byte"),
    ("services:\n  db: {image: x, user: ''}\n", "names no user"),
    ("services:\n  db: {image: x, user: ':0'}\n", "names no user"),
    ("services:\n  db: {build: {context: ./db, dockerfile: ../Dockerfile}}\n",
     "inside its context"),
    ("services:\n  db: {build: {context: ., dockerfile: /etc/Dockerfile}}\n",
     "inside its context"),
    ("services:\n  db: {build: {context: ., target: 'a b'}}\n", "not a stage name"),
    ("services:\n  db: {image: x, volumes: [{type: volume, 1: x, a: y}]}\n", "not supported"),
    ("services:\n  db: {image: x, volumes: ['data:/d']}\n", "not declared"),
    ("services:\n  db: {image: x, volumes: ['./nope:/d']}\n", "inside the task folder"),
    ("services:\n  db: {image: x, init: 'yes'}\n", "services.db.init: expected true"),
    ("services:\n  db: {image: x, read_only: 'yes'}\n", "read_only: expected true"),
    ("services:\n  db: {image: x, network_mode: none, networks: [default]}\n",
     "`network_mode` and `networks` cannot both be set"),
    ("services:\n  db: {image: x, pids_limit: 1.5}\n", "pids_limit: expected a whole"),
    ("services:\n  db: {image: x, tmpfs: 5}\n", "tmpfs: expected a path"),
    ("services:\n  db: {image: x, tmpfs: [tmp]}\n", "must be an absolute path"),
    ("services:\n  db: {image: x, networks: [back]}\n", "network 'back' is not declared"),
    ("services:\n  db: {image: x, networks: []}\nnetworks: {back: }\n", "names no network"),
    ("services: {}\nnetworks: [back]\n", "networks: expected a mapping"),
    ("services:\n  db: {image: x, cap_drop: ['NET RAW']}\n", "is not a capability"),
    ("services:\n  db: {image: x, cap_drop: [NET_ADMN]}\n", "'CAP_NET_ADMN' is not a capab"),
    ("services:\n  db: {image: x, volumes: ['../../..:/d']}\n", "inside the task folder"),
])
def test_a_file_compose_would_not_read_is_refused_in_one_message(tmp_path: Path, yaml: str,
                                                                 why: str) -> None:
    with pytest.raises(TaskInvalid, match=why) as raised:
        load(tmp_path, yaml)
    assert "docker-compose.yaml" in str(raised.value) and "\n" not in str(raised.value)


def test_a_build_names_its_dockerfile_in_its_context_and_its_target_stage(
        tmp_path: Path) -> None:
    task = load(tmp_path, """
services:
  api: {build: {context: .., dockerfile: environment/api/Dockerfile.api, target: serve}}
  db: {build: ./db}
""")
    assert task.compose is not None
    api, db, _ = task.compose.services
    assert api.source is not None and db.source is not None
    assert (api.source.context, api.source.dockerfile, api.source.target) == (
        ".", "environment/api/Dockerfile.api", "serve")
    assert (db.source.context, db.source.dockerfile, db.source.target) == (
        "environment/db", "Dockerfile", None)


@pytest.mark.parametrize(("keys", "caps"), [
    ("{}", DOCKER_CAPS),
    ("{cap_drop: [NET_RAW, cap_mknod]}",
     tuple(c for c in DOCKER_CAPS if c not in ("CAP_NET_RAW", "CAP_MKNOD"))),
    ("{cap_drop: [ALL], cap_add: [FOWNER, CAP_CHOWN]}", ("CAP_CHOWN", "CAP_FOWNER")),
    ("{cap_drop: [ALL]}", ()),
    ("{cap_drop: [KILL], cap_add: [KILL]}", DOCKER_CAPS),  # (Docker: add wins)
])
def test_a_services_capabilities_are_dockers_defaults_tweaked(tmp_path: Path, keys: str,
                                                               caps: tuple[str, ...]) -> None:
    options = keys[1:-1]
    task = load(tmp_path, f"services:\n  db: {{image: x{', ' if options else ''}{options}}}\n")
    assert task.compose is not None
    assert task.compose.others[0].caps == caps


def test_a_services_tmpfs_read_only_root_and_pids_limit_as_docker_reads_them(
        tmp_path: Path) -> None:
    task = load(tmp_path, """
services:
  db: {image: x, read_only: true, pids_limit: 32, tmpfs: [/run/db, "/tmp:exec,size=64m,mode=1777"]}
  web: {image: x, tmpfs: /cache, pids_limit: -1}
""")
    assert task.compose is not None
    db, web = task.compose.others
    assert (db.read_only, db.pids_limit, web.read_only, web.pids_limit) == (True, 32, False, None)
    assert db.tmpfs == (("/run/db", ("nosuid", "nodev", "noexec")),
                        ("/tmp", ("nosuid", "nodev", "size=64m", "mode=1777")))
    assert web.tmpfs == (("/cache", ("nosuid", "nodev", "noexec")),)


@pytest.mark.parametrize(("options", "wanted"), [
    ("[no-new-privileges]", True), ("['no-new-privileges:true']", True),
    ("['no-new-privileges=true']", True), ("['no-new-privileges:false']", False), ("[]", False),
    ("['no-new-privileges:1']", True), ("['no-new-privileges=False']", False),
])
def test_no_new_privileges_is_the_one_security_option(tmp_path: Path, options: str,
                                                      wanted: bool) -> None:
    task = load(tmp_path, f"services:\n  db: {{image: x, init: true, security_opt: {options}}}\n")
    assert task.compose is not None
    assert task.compose.others[0].no_new_privileges is wanted


def test_networks_are_read_in_the_order_first_named(tmp_path: Path) -> None:
    task = load(tmp_path, """
services:
  db: {image: x, networks: [back]}
  api: {image: x, networks: {front: , back: {}}, depends_on: [db]}
  main: {networks: [front]}
  cache: {image: x}
networks: {front: {driver: bridge}, back: {internal: false}}
""")
    assert task.compose is not None
    assert [(s.name, s.networks) for s in task.compose.services] == [
        ("db", ("back",)), ("api", ("front", "back")), ("cache", ("default",)),
        ("main", ("front",))]
    assert task.compose.networks == ("back", "front", "default")


def test_a_container_on_internal_networks_alone_is_walled(tmp_path: Path) -> None:
    """Docker's `internal: true`: a container on such networks alone has no way out; one
    network with a way out among its networks gives it one; `network_mode: none` is
    not on a network at all."""
    task = load(tmp_path, """
services:
  world: {image: x, networks: [inner]}
  relay: {image: x, networks: [inner, out]}
  sealed: {image: x, network_mode: none}
  plain: {image: x}
  main: {networks: [inner, vault]}
networks: {inner: {internal: true}, vault: {internal: true, driver: bridge}, out: }
""")
    assert task.compose is not None
    assert {s.name: s.walled for s in task.compose.services} == {
        "world": True, "relay": False, "sealed": False, "plain": False, "main": True}


@given(st.lists(st.sets(st.integers(0, 3)), min_size=1, max_size=6), st.data())
def test_a_container_names_those_sharing_a_network_with_it(
        membership: list[set[int]], data: st.DataObject) -> None:
    """Each container sharing a network with `me` once, at its address on the first
    network (in `me`'s order) they share; no other."""
    networks = [sorted(on) for on in membership]
    me = data.draw(st.sampled_from([None, *range(len(networks) - 1)]))
    mine = networks[0 if me is None else me + 1]
    found = dict((member, where) for where, member in bridge.hosts(networks, me))
    expected = {}
    for position, theirs in enumerate(networks):
        shared = [n for n in mine if n in theirs]
        if shared:
            member = None if position == 0 else position - 1
            expected[member] = bridge.address(shared[0], member)
    assert found == expected
    assert (me in found) is bool(mine)


def test_a_separate_verifiers_main_is_refused_what_is_the_verifiers_own(
        tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "docker-compose.yaml").write_text(
        "services:\n  main: {command: [sh], user: root}\n")
    with pytest.raises(UnsupportedField, match=r"services\.main\.command: is the verifier's"):
        compose.load(tmp_path, 1 << 20, {}, base="tests", main_may=compose.VERIFIER_MAIN)


def test_volumes_are_named_volumes_or_task_folders(tmp_path: Path) -> None:
    folder = task_with(tmp_path / "task", """
services:
  db:
    image: x
    volumes: ["data:/var/lib/db", "./conf:/etc/db:ro,z",
              {type: bind, source: ../tests, target: /t, read_only: true}]
  main: {volumes: ["data:/mnt/data:ro"]}
volumes: {data: }
""")
    (folder / "environment" / "conf").mkdir()
    (folder / "tests").mkdir()
    task = Task.load(folder)
    assert task.compose is not None
    db, main = task.compose.services
    real = folder.resolve()
    assert db.volumes == (
        compose.Volume("volume", "data", "/var/lib/db"),
        compose.Volume("bind", f"{real}/environment/conf", "/etc/db", read_only=True),
        compose.Volume("bind", f"{real}/tests", "/t", read_only=True))
    assert main.volumes == (compose.Volume("volume", "data", "/mnt/data", read_only=True),)


@pytest.mark.parametrize("how", ["link", "folder"])
def test_a_build_dockerfile_must_be_a_file_of_its_context_reached_through_no_link(
        tmp_path: Path, how: str) -> None:
    folder = task_with(tmp_path / "task", "services:\n  db: {build: {context: ./db, "
                                          "dockerfile: Dockerfile.db}}\n")
    (folder / "environment" / "db").mkdir()
    (folder / "environment" / "other").write_text("FROM scratch\n")
    if how == "link":  # (inside the task: staged as a link, it could lead anywhere)
        (folder / "environment" / "db" / "Dockerfile.db").symlink_to("../other")
    elif how == "folder":
        (folder / "environment" / "db" / "Dockerfile.db").mkdir()
    with pytest.raises(TaskInvalid, match="must be a file inside its context"):
        Task.load(folder)


def test_a_build_context_that_is_a_link_out_of_the_task_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = task_with(tmp_path / "task", "services:\n  db: {build: ./db}\n")
    (folder / "environment" / "db").symlink_to(outside)
    with pytest.raises(TaskInvalid, match="inside the task folder"):
        Task.load(folder)


def test_values_are_interpolated_as_compose_does(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TL_COMPOSE_OPERATOR", "from-the-operator")
    monkeypatch.setenv("TL_COMPOSE_TOKEN", "operator-token-7Hq2")
    task = load(tmp_path, """
services:
  db:
    image: localhost/tl-busybox:configured
    environment:
      A: "${WORD}-$WORD-${NOPE:-dflt}-${EMPTY:-dflt}-${EMPTY-kept}-$$WORD"
      B: ${TL_COMPOSE_OPERATOR}
      C: ${TL_COMPOSE_TOKEN}
  web:
    image: x
    environment: [TL_COMPOSE_TOKEN, TL_COMPOSE_OPERATOR]
""", TOML + '[environment.env]\nWORD = "w"\nEMPTY = ""\n')
    assert task.compose is not None
    db, web = task.compose.others
    assert db.env == {"A": "w-w-dflt-dflt--$WORD", "B": "from-the-operator",
                      "C": "operator-token-7Hq2"}
    assert web.env == {"TL_COMPOSE_TOKEN": "operator-token-7Hq2",
                       "TL_COMPOSE_OPERATOR": "from-the-operator"}
    # the operator's values under a secret's name are scrubbed (as [environment] env's)
    assert "operator-token-7Hq2" in task.secrets and "from-the-operator" not in task.secrets


def test_an_operators_secret_too_short_to_scrub_refuses_the_task(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TL_COMPOSE_TOKEN", "short")
    with pytest.raises(TaskInvalid, match="TL_COMPOSE_TOKEN"):
        load(tmp_path, "services:\n  db: {image: x, environment: [TL_COMPOSE_TOKEN]}\n")
    monkeypatch.setenv("TL_COMPOSE_TOKEN", "")  # (empty: shorter still)
    with pytest.raises(TaskInvalid, match="TL_COMPOSE_TOKEN"):
        load(tmp_path / "empty",
             "services:\n  db: {image: x, environment: [TL_COMPOSE_TOKEN]}\n")


def test_a_yaml_alias_bomb_is_refused_in_a_short_message(tmp_path: Path) -> None:
    """Each alias level multiplies the value tenfold; the file stays a few hundred bytes,
    and the refusal quotes the value bounded."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    yaml = "x-bomb:\n" + "".join(f"  {line}\n" for line in levels)
    yaml += "services:\n  db: {image: *a6}\n"
    with pytest.raises(TaskInvalid) as raised:
        load(tmp_path, yaml)
    assert len(str(raised.value)) < 1000


def test_ignored_keys_are_warned_and_a_host_task_is_refused(tmp_path: Path) -> None:
    task = load(tmp_path, "version: '3'\nservices:\n  db: {image: x, container_name: d, "
                          "ports: ['5432:5432']}\n  main: {ports: [{target: 80}]}\n")
    assert set(task.ignored_fields) >= {"environment/docker-compose.yaml version",
                                        "environment/docker-compose.yaml "
                                        "services.db.container_name"}
    published = {key: why for key, why in task.ignored_fields.items() if key.endswith("ports")}
    assert list(published) == [f"environment/docker-compose.yaml services.{name}.ports"
                               for name in ("db", "main")]
    assert all("not published on the host" in why for why in published.values())
    with pytest.raises(UnsupportedField, match="needs the task's image"):
        load(tmp_path / "host", "services: {}\n", toml="")


@given(st.lists(st.tuples(st.integers(0, 500), st.sampled_from(list(compose.UNITS))),
                min_size=1, max_size=4))
def test_a_duration_is_the_sum_of_its_parts_up_to_a_day(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    expected = sum(n * compose.UNITS[unit] for n, unit in parts)
    if expected > compose.MAX_DURATION_S:  # a day at most: a check never waits forever
        with pytest.raises(TaskInvalid, match="up to a day"):
            compose._duration(text, "here")
    else:
        assert compose._duration(text, "here") == pytest.approx(expected)


# --- running the services ---------------------------------------------------------------


def variant(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(DATASET / name, target, symlinks=True)
    return target


def oracle_run(task: Path, db: Path, *extra: str) -> tuple[Any, str]:
    """`run TASK --agent oracle`: its session's view and what the CLI printed (with why
    its sandbox was lost, if it was)."""
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(db),
                      "--cache-dir", str(db.parent / "cache"), *extra)
    view = session(db)
    lost = [e.data.detail for e in view.events if e.type == "sandbox.lost"]
    return view, done.stdout + done.stderr + "".join(f"\nlost: {why}" for why in lost)


def test_a_service_that_never_becomes_healthy_loses_the_session_naming_it(
        tmp_path: Path) -> None:
    task = variant(tmp_path, "compose-web")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace("http://127.0.0.1:8080/", "http://127.0.0.1:1/")
                    .replace("retries: 20", "retries: 2"))
    view, printed = oracle_run(task, tmp_path / "t.db")
    (lost,) = [e for e in view.events if e.type == "sandbox.lost"]
    assert "compose service web did not become healthy" in lost.data.detail, printed
    assert "Traceback" not in printed


def test_a_service_that_exits_while_the_agent_runs_is_a_gap(tmp_path: Path) -> None:
    """The oracle stops the greeter (one PID namespace per container: it cannot, so the
    greeter's own command ends itself after the first answer): gap `service_exited`."""
    task = variant(tmp_path, "compose-order")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace("exec httpd -f -p 9000 -h /srv/www",
                                             "timeout 2 httpd -f -p 9000 -h /srv/www; exit 3"))
    (task / "solution" / "solve.sh").write_text(
        (task / "solution" / "solve.sh").read_text().replace("exit 0\n", "sleep 4; exit 0\n",
                                                              1))
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert gaps(view, "service_exited") == ["compose service greeter exited with 3"], printed
    assert not [e for e in view.events if e.type == "sandbox.lost"]


def test_with_a_phase_not_public_the_services_share_the_agents_one_network(
        tmp_path: Path) -> None:
    """compose-order's agent phase is `no-network`: main and the services share one
    namespace (one policy), so `localhost` reaches the greeter — and that namespace has
    nothing but loopback while the agent runs (no slirp4netns, no bridge)."""
    task = variant(tmp_path, "compose-order")
    solve = task / "solution" / "solve.sh"
    solve.write_text(solve.read_text().replace(
        "\n", "\n[ \"$(ls /sys/class/net)\" = lo ] || "
              "{ echo \"escaped: $(ls /sys/class/net)\" > /app/greeting.txt; exit 0; }\n", 1))
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed


def test_with_every_phase_public_each_service_has_its_own_network_on_a_bridge(
        tmp_path: Path) -> None:
    """compose-web's phases are all public: web and mirror both listen on 8080 (each in a
    namespace of its own; in main's one the second bind would fail), each reached by its
    name at its bridge address; main's namespace holds its way out and its link to the
    bridge (the bridge is in a namespace of its own) — nothing of it is on the host's
    network."""
    task = variant(tmp_path, "compose-web")
    solve = task / "solution" / "solve.sh"
    solve.write_text(solve.read_text() + "ls /sys/class/net | tr '\\n' ' ' > /app/nets\n"
                                          "getent hosts web mirror main | tr -s ' ' > /app/hosts\n")
    test = task / "tests" / "test.sh"
    test.write_text(
        "#!/bin/bash\n"
        "hosts=$(printf '10.89.0.2 web\\n10.89.0.3 mirror\\n10.89.0.1 main')\n"
        "if grep -qx compose-page-4711 /app/page.txt && grep -qx mirror-page-0815 "
        "/app/mirror.txt && [ \"$(cat /app/nets)\" = 'eth1 lo tap0 ' ] "
        "&& [ \"$(cat /app/hosts)\" = \"$hosts\" ]; then echo 1; else echo 0; fi "
        "> /logs/verifier/reward.txt\n")
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed + test.read_text()


NETWORKS = """
services:
  web:
    build: ./web
    networks: [front]
  backend:
    image: localhost/tl-busybox:configured
    user: root
    networks: [back]
    entrypoint: ["sh", "-c"]
    command:
      - >-
        mkdir -p /tmp/b && echo backend-secret-9 > /tmp/b/index.html
        && exec httpd -f -p 8080 -h /tmp/b
  gateway:
    image: localhost/tl-busybox:configured
    user: root
    networks: {front: , back: {}}
    depends_on: [backend]
    entrypoint: ["sh", "-c"]
    command:
      - >-
        mkdir -p /tmp/g && until wget -q -O /tmp/raw http://backend:8080/; do sleep 0.2;
        done && sed 's/^/via-gateway:/' /tmp/raw > /tmp/g/index.html
        && exec httpd -f -p 8080 -h /tmp/g
    healthcheck: {test: "test -s /tmp/g/index.html", interval: 1s, retries: 30}
  main:
    networks: [front]
    depends_on: {gateway: {condition: service_healthy}, web: {condition: service_started}}
networks:
  front: {driver: bridge}
  back:
"""
PROBE = r"""
probe() {  # $1 host; the body of its page on 8080, or nothing in 2 s
    timeout 2 bash -c "exec 3<>/dev/tcp/$1/8080 && printf 'GET / HTTP/1.0\r\n\r\n' >&3 \
        && sed '1,/^\r$/d' <&3" 2>/dev/null
}
for _ in $(seq 50); do [ -n "$(probe web)" ] && break; sleep 0.2; done
probe web > /app/page.txt; probe gateway > /app/gateway.txt
getent hosts backend > /app/named 2>&1 || echo unnamed > /app/named
for n in 0 1; do for h in 1 2 3 4 5; do probe 10.89.$n.$h; done; done \
    | grep -cx backend-secret-9 > /app/reached
ls /sys/class/net | tr '\n' ' ' > /app/nets
"""


def test_named_networks_keep_a_backend_from_main(tmp_path: Path) -> None:
    """Compose networks as Harbor's docker environment keeps them, each a bridge of the
    session's: `main` (on `front`) reaches `web` and `gateway` but never `backend` (on
    `back` alone) — neither by its name nor at any bridge address — while `gateway`, on
    both, reaches `backend` and serves what it got."""
    task = variant(tmp_path, "compose-web")
    (task / "environment" / "docker-compose.yaml").write_text(NETWORKS)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + PROBE)
    oracle_scores_1(task, tmp_path, (
        "grep -qx compose-page-4711 /app/page.txt && grep -qx via-gateway:backend-secret-9 "
        "/app/gateway.txt && grep -qx unnamed /app/named && grep -qx 0 /app/reached "
        "&& [ \"$(cat /app/nets)\" = 'eth1 lo tap0 ' ]"),
        "head -c 300 /app/*.txt /app/named /app/reached /app/nets")


INTERNAL = """
services:
  web:
    build: ./web
    networks: [inner]
  walled:
    image: localhost/tl-busybox:configured
    user: root
    networks: [inner]
    command: [sh, -c, "ls /sys/class/net | tr '\\n' ' ' > /seen/walled; exec sleep 1000"]
    volumes: ["seen:/seen"]
    healthcheck: {test: test -s /seen/walled, interval: 1s}
  relay:
    image: localhost/tl-busybox:configured
    user: root
    networks: [inner, out]
    command: [sh, -c, "ls /sys/class/net | tr '\\n' ' ' > /seen/relay; exec sleep 1000"]
    volumes: ["seen:/seen"]
    healthcheck: {test: test -s /seen/relay, interval: 1s}
  main:
    networks: [inner]
    volumes: ["seen:/mnt/seen"]
    depends_on:
      walled: {condition: service_healthy}
      relay: {condition: service_healthy}
networks: {inner: {internal: true}, out: }
volumes: {seen: }
"""


def test_a_container_on_internal_networks_alone_has_no_way_out(tmp_path: Path) -> None:
    """Docker's `internal: true` network (every phase public: bridged): `main` and
    `walled`, on it alone, have their links to the bridge and nothing else — no way out —
    while `relay`, on a network with a way out too, has one; `main` still reaches `web` on
    the internal network by its name, and its resolv.conf names no resolver (there is none
    to ask). Each service's command, as its first act, finds its links made (as Docker
    makes them before it starts the command)."""
    task = variant(tmp_path, "compose-web")
    (task / "environment" / "docker-compose.yaml").write_text(INTERNAL)
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\n" + PROBE + 'for f in /mnt/seen/*; do cat "$f"; echo; done > /app/theirs\n'
        "wc -c < /etc/resolv.conf > /app/resolv\n")
    oracle_scores_1(task, tmp_path, (
        "grep -qx compose-page-4711 /app/page.txt && [ \"$(cat /app/nets)\" = 'eth1 lo ' ] "
        "&& [ \"$(ls /mnt/seen | wc -l)\" = 2 ] && grep -qx 'eth1 lo ' /app/theirs "
        "&& grep -qx 'eth1 eth2 lo tap0 ' /app/theirs && grep -qx 0 /app/resolv"),
        "head -c 300 /app/page.txt /app/nets /app/theirs /app/resolv")


def test_a_walled_main_has_no_way_out_in_phases_of_their_own_either(tmp_path: Path) -> None:
    """Under `verifier_isolation = strict` each phase is a sandbox of its own, connected
    outward on its own (slirp4netns): a `main` on an `internal` network alone gets no way
    out there either — the agent's phase and the verifier's see loopback alone."""
    task = variant(tmp_path, "compose-web")
    (task / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    networks: [inner]\nnetworks: {inner: {internal: true}}\n")
    links = "sed -n 's/^ *\\([a-z0-9]*\\):.*/\\1/p' /proc/net/dev | sort | tr '\\n' ' '"
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{links} > /app/nets\n")
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\nif [ \"$(cat /app/nets)\" = 'lo ' ] && [ \"$({links})\" = 'lo ' ]; "
        f"then echo 1; else echo 0; fi > /logs/verifier/reward.txt\ncat /app/nets; {links}\n")
    view, printed = oracle_run(task, tmp_path / "t.db", "--set", "verifier_isolation=strict")
    assert verification(view).data.rewards == {"reward": 1.0}, (
        printed + verification(view).data.stdout_tail)


def oracle_scores_1(task: Path, tmp_path: Path, holds: str, shows: str) -> None:
    """The oracle's run of `task` whose verifier gives 1 when the shell test `holds` holds,
    and prints what `shows` prints (in the failure's message)."""
    (task / "tests" / "test.sh").write_text(
        f"#!/bin/bash\nif {holds}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt"
        f"\n{shows}\n")
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, (
        printed + verification(view).data.stdout_tail)


def test_named_networks_with_a_phase_not_public_are_refused_naming_them(
        tmp_path: Path) -> None:
    task = variant(tmp_path, "compose-web")
    (task / "environment" / "docker-compose.yaml").write_text(NETWORKS)
    with (task / "task.toml").open("a") as toml:
        toml.write("[agent]\nnetwork_mode = 'no-network'\n")
    done = in_process("run", str(task), "--agent", "oracle", "--db", str(tmp_path / "t.db"),
                      "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode != 0 and "compose networks" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr



@pytest.mark.parametrize(("internal", "links"), [(False, "lo tap0 "), (True, "lo ")])
def test_one_named_network_for_every_container_is_the_default_with_a_phase_not_public(
        tmp_path: Path, internal: bool, links: str) -> None:
    """compose-order (its agent phase `no-network`) with every container on one named
    network: it keeps nobody from anybody, so it runs as the default does — and its
    verifier (public, as `[environment]`) has the way out the network gives: one, or none
    on an `internal` network."""
    task = variant(tmp_path, "compose-order")
    yaml = task / "environment" / "docker-compose.yaml"
    text = yaml.read_text()
    for service in ("prepare", "greeter", "main"):
        text = text.replace(f"  {service}:\n", f"  {service}:\n    networks: [shared]\n", 1)
    yaml.write_text(text + f"networks:\n  shared: {{internal: {str(internal).lower()}}}\n")
    test = task / "tests" / "test.sh"
    test.write_text(test.read_text().replace(
        "; then\n", f" && [ \"$(ls /sys/class/net | tr '\\n' ' ')\" = '{links}' ]; then\n", 1))
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed + test.read_text()


def test_a_service_with_network_mode_none_has_loopback_alone_beside_bridged_ones(
        tmp_path: Path) -> None:
    """compose-web (every phase public: bridged) with a service of `network_mode: none`:
    nothing but loopback in its namespace, nobody in its /etc/hosts, and it is in nobody's
    (compose-order checks the same beside services sharing main's namespace)."""
    task = variant(tmp_path, "compose-web")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace("  main:\n    depends_on:\n", """  sealed:
    image: localhost/tl-busybox:configured
    user: root
    network_mode: none
    entrypoint: ["sh", "-c"]
    command:
      - >-
        echo "links: $$(ls /sys/class/net | tr '\\n' ' ')" > /seen/sealed
        && { grep -q web /etc/hosts && echo named-web || echo names-nobody; } >> /seen/sealed
    volumes: ["seen:/seen"]
  main:
    volumes: ["seen:/mnt/seen"]
    depends_on:
      sealed:
        condition: service_completed_successfully
""") + "volumes:\n  seen:\n")
    oracle_scores_1(task, tmp_path, (
        "grep -qx 'links: lo ' /mnt/seen/sealed && grep -qx names-nobody /mnt/seen/sealed "
        "&& ! grep -q sealed /etc/hosts && grep -q web /etc/hosts"),
        "cat /mnt/seen/sealed /etc/hosts")


SNIFF = (  # perl (in every Debian image): a raw socket on every link of the namespace, 6 s
    # from when it is open (it says so in /app/sniffing; the solution waits for that)
    "perl -e 'socket(S, 17, 3, 768) or die \"socket: $!\\n\"; my ($own, $between) = (0, 0);"
    " open(my $ready, \">\", \"/app/sniffing\"); close($ready);"
    " my $end = time + 6; while (time < $end) { my $r = \"\"; vec($r, fileno(S), 1) = 1;"
    " next unless select($r, undef, undef, 0.5); recv(S, my $frame, 65535, 0);"
    " $own = 1 if $frame =~ /compose-page-4711/;"
    " $between = 1 if $frame =~ /between-services-5150/ }"
    " print \"own:$own between:$between\\n\"' > /app/sniffed 2>&1 &\n")


def test_the_agent_cannot_observe_what_the_services_send_each_other(tmp_path: Path) -> None:
    """An agent holds CAP_NET_RAW, as under Docker: it sniffs every link of its namespace
    while `mirror` keeps asking `web` for a marked page. It sees its own exchange with
    `web` (the sniffer works), never the services' (the bridge is not in its namespace)."""
    task = variant(tmp_path, "compose-web")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace(
        '["sh", "-c", "mkdir', '["sh", "-c", "(while :; do wget -q -O /dev/null '
        'http://web:8080/between-services-5150; sleep 0.2; done) & mkdir'))
    solve = task / "solution" / "solve.sh"
    body = solve.read_text().split("\n", 1)[1]
    solve.write_text(f"#!/bin/bash\n{SNIFF}sniffer=$!\n"
                     "for _ in $(seq 300); do [ -e /app/sniffing ] && break; sleep 0.1; done\n"
                     f"{body}wait $sniffer\n")
    with (task / "task.toml").open("a") as toml:
        toml.write('[[verifier.collect]]\ncommand = "cat /app/sniffed"\n')
    view, printed = oracle_run(task, tmp_path / "t.db", "--set",
                               f"sandbox_logs_dir={tmp_path / 'kept'}")
    kept = tmp_path / "kept" / view.session_id / "collect" / "1.txt"
    assert kept.read_text() == "own:1 between:0\n", printed


def test_a_services_hooks_and_artifacts_are_taken_from_its_container(tmp_path: Path
                                                                      ) -> None:
    """Hooks of `greeter` run in its container, as its user, with its environment, after
    main's; one in `prepare` (ended: it completed) is gap `collect_failed`; outputs are
    numbered main's first, then the services' in their start order (prepare, greeter).
    An artifact of `greeter` is read from its container."""
    task = variant(tmp_path, "compose-order")
    toml_text = (task / "task.toml").read_text()
    (task / "task.toml").write_text(
        'artifacts = [{source = "/srv/www/index.html", service = "greeter", '
        'destination = "greeting.html"}]\n' + toml_text)
    with (task / "task.toml").open("a") as toml:
        toml.write('[[verifier.collect]]\nservice = "greeter"\n'
                   'command = "echo $GREETING; cat www/index.html; ls /app; true"\n'
                   '[[verifier.collect]]\ncommand = "echo main; ls /srv/www; true"\n'
                   '[[verifier.collect]]\nservice = "prepare"\ncommand = "true"\n')
    view, printed = oracle_run(task, tmp_path / "t.db", "--set",
                               f"sandbox_logs_dir={tmp_path / 'kept'}")
    kept = tmp_path / "kept" / view.session_id / "collect"
    assert (kept / "1.txt").read_text().startswith("main\nls: "), printed  # no /srv in main
    assert (kept / "3.txt").read_text().startswith(
        "hello-ordered-compose\nhello-ordered-compose from /srv as 0, prepared, templated\n"
        "ls: ")  # and no /app in greeter
    (failed,) = gaps(view, "collect_failed")
    assert failed == "`true`: it could not start: its container exited with 0", failed
    assert verification(view).data.rewards == {"reward": 1.0}
    assert (kept.parent / "artifacts" / "greeting.html").read_text() == \
        "hello-ordered-compose from /srv as 0, prepared, templated\n"


def test_a_named_volume_starts_with_what_the_image_holds_there(tmp_path: Path) -> None:
    """As Docker's: a named volume first mounted over a folder of the image starts as a
    copy of it, owners kept (`_apt`'s folder is still `_apt`'s, mode 0700)."""
    task = variant(tmp_path, "compose-order")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace(
        "        read_only: true\n", "        read_only: true\n      - apt:/var/lib/apt\n")
        .replace("  notes: {}\n", "  notes: {}\n  apt: {}\n"))
    with (task / "task.toml").open("a") as toml:
        toml.write('[[verifier.collect]]\ncommand = "stat -c \'%u %a\' '
                   '/var/lib/apt/lists/partial; ls /var/lib/apt"\n')
    view, printed = oracle_run(task, tmp_path / "t.db", "--set",
                               f"sandbox_logs_dir={tmp_path / 'kept'}")
    kept = tmp_path / "kept" / view.session_id / "collect" / "1.txt"
    assert kept.read_text() == "42 700\nextended_states\nlists\nmirrors\nperiodic\n", printed
    assert verification(view).data.rewards == {"reward": 1.0}


def test_a_separate_verifiers_services_are_never_the_agents(tmp_path: Path) -> None:
    """separate-tests-compose's `answers` service is the verifier's: the agent's container
    neither resolves nor reaches it (the oracle writes its answer only if it cannot; any
    TCP connection may open here, through the machine's proxy, so the answer is what
    counts), and the verifier does (reward 1)."""
    task = variant(tmp_path, "separate-tests-compose")
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\ngetent hosts answers && exit 0\n"
        "timeout 5 bash -c 'exec 3<>/dev/tcp/10.89.0.2/8080; printf \"GET /answer "
        "HTTP/1.0\\r\\n\\r\\n\" >&3; cat <&3' 2>/dev/null | grep -qx 42 && exit 0\n"
        "echo 42 > /srv/out.txt\n")
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed


def test_a_separate_verifiers_compose_may_build_its_own_main(tmp_path: Path) -> None:
    """As Harbor composes tests/: without tests/Dockerfile, the compose file's `main` names
    the verifier's image (`build` here, a Dockerfile of another name and a stage of it),
    the tests in it as tests/Dockerfile would have put them, and its `user` the verifier's
    (there is no `[verifier] user`)."""
    task = variant(tmp_path, "separate-tests-compose")
    check = task / "tests" / "check.sh"
    check.write_text(check.read_text().replace(
        'if [ -n "$expected" ]', 'if [ "$(id -un)" = nobody ] && [ -n "$expected" ]'))
    (task / "tests" / "Dockerfile").rename(task / "tests" / "grader.Dockerfile")
    with (task / "tests" / "grader.Dockerfile").open("a") as appended:
        appended.write("FROM localhost/tl-debian:plain AS unused\nRUN false\n")
    yaml = task / "tests" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace(
        "  main:\n", "  main:\n    build: {context: ., dockerfile: grader.Dockerfile, "
                     "target: grader}\n    user: nobody\n"))
    dockerfile = task / "tests" / "grader.Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace(
        "FROM localhost/tl-debian:plain\n", "FROM localhost/tl-debian:plain AS grader\n", 1))
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed
    environment = task / "environment" / "docker-compose.yaml"
    environment.parent.mkdir()
    environment.write_text("services:\n  main: {user: root}\n")  # (the agent's: the task's)
    with pytest.raises(UnsupportedField, match=r"services\.main\.user: is the task's own"):
        Task.load(task)


def test_the_tasks_compose_may_build_main_from_another_context(tmp_path: Path) -> None:
    """Compose merges the task's `main: build` over Harbor's base file: the task's image is
    built from that context and Dockerfile (here the task's folder, so a file outside
    environment/ can be copied in) — refused beside a docker_image, which names it too."""
    task = variant(tmp_path, "compose-web")
    (task / "environment" / "main").mkdir()
    (task / "environment" / "main" / "Dockerfile").write_text(
        "FROM localhost/tl-debian:plain\nCOPY instruction.md /srv/copied.md\n")
    yaml = task / "environment" / "docker-compose.yaml"
    yaml.write_text(yaml.read_text().replace("  main:\n", "  main:\n    build: {context: .., "
                                             "dockerfile: environment/main/Dockerfile}\n"))
    with pytest.raises(UnsupportedField, match="beside \\[environment\\] docker_image"):
        Task.load(task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('docker_image = "localhost/tl-debian:plain"\n', ""))
    test = task / "tests" / "test.sh"
    test.write_text(test.read_text().replace("if grep", "if cmp -s /srv/copied.md "
                                             "/tests/instruction.md && grep", 1))
    (task / "tests" / "instruction.md").write_text((task / "instruction.md").read_text())
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed


def test_the_agent_cannot_see_or_touch_a_services_files(tmp_path: Path) -> None:
    """The service's root is its own overlay: the agent's container does not hold its
    files, and what the agent writes never appears in it (the page it serves is its own)."""
    task = variant(tmp_path, "compose-web")
    (task / "solution" / "solve.sh").write_text(
        "#!/bin/bash\n"
        "ls /www/index.html 2>/dev/null && exit 1\n"
        "mkdir -p /www && echo forged > /www/index.html\n"
        + (DATASET / "compose-web" / "solution" / "solve.sh").read_text().split("\n", 1)[1])
    view, printed = oracle_run(task, tmp_path / "t.db")
    assert verification(view).data.rewards == {"reward": 1.0}, printed


def test_a_refused_compose_key_is_one_line_and_exit_2(tmp_path: Path) -> None:
    folder = task_with(tmp_path / "task", "services:\n  db: {image: x, privileged: true}\n")
    done = in_process("run", str(folder), "--agent", "oracle", "--db", str(tmp_path / "t.db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "services.db.privileged" in done.stderr
