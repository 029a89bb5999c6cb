"""A task's compose environment (`environment/docker-compose.yaml`; docs/SPEC.md §17,
docs/tasks.md "Compose environments"), read as Harbor's docker environment merges it over
its own `main` service (the task's image, `sh -c "sleep infinity"`).

Every other service is a container of the session, its image built from its `build`
context (inside the task folder, relative to the file's) or taken from the engine's
storage (`image`); each key is honoured, ignored with a reason (warned), or refused by name
(`UnsupportedField`):
- every service: `environment`, `depends_on` (a list, or conditions `service_started`,
  `service_healthy`, `service_completed_successfully`), `volumes`, `networks` (declared
  at the top level, each a bridge: sandbox/bridge.py; `internal` ones with no way out),
  `init` (ours is every container's
  PID 1 either way), ignored `container_name`,
  `expose`, `tty`, `stdin_open`, `labels`, `pull_policy`, `restart`, `ports` (never
  published on the host);
- a service other than `main`: `image`, `build` (a context, or `context`, `dockerfile`,
  `args` and `target`), `command`, `entrypoint`, `working_dir`, `user`, `healthcheck`
  (Docker's `test` forms, its durations and defaults), `cap_add` (of Docker's default
  set) and `cap_drop`, `security_opt` (`no-new-privileges`), `read_only`, `tmpfs`,
  `pids_limit`, `network_mode: none`;
- `main`: its command, working directory and user are the task's (`[environment]`,
  `[agent] user`), so those keys are refused on it, and so are its capabilities'; its
  `build` (`TASK_MAIN`) builds the task's image in environment/Dockerfile's place. A
  separate verifier's file (`tests/`) may give its `main` an `image`, a `build` and a
  `user` (`VERIFIER_MAIN`).
Values are interpolated as Compose does (`$$`, `$NAME`, `${NAME}`, `${NAME:-default}`,
`${NAME-default}`) from the task's `[environment] env`, then the operator's environment
(Harbor's compose process has both); a value taken from the operator's environment is a
secret. The top level's `services`, `volumes` and `networks` are read; `version`, `name`
and `x-` keys are ignored.

Over 500 lines: one reader of one file format, each key's rule beside the others.
"""

from __future__ import annotations

import math
import os
import re
import reprlib
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from trialledger.adapters.images.environment import BUILD_TIMEOUT_S, Source
from trialledger.adapters.places import plain_file, within
from trialledger.adapters.sandbox.idrange import DOCKER_CAPS
from trialledger.adapters.tasks.config import MAIN_SERVICE, TaskInvalid, UnsupportedField
from trialledger.adapters.tasks.env import SENSITIVE, EnvUnresolved, long_enough
from trialledger.adapters.tasks.files import read_task_text
from trialledger.adapters.tasks.healthcheck import Healthcheck

FILE = "environment/docker-compose.yaml"
Condition = Literal["service_started", "service_healthy", "service_completed_successfully"]
CONDITIONS: tuple[Condition, ...] = ("service_started", "service_healthy",
                                     "service_completed_successfully")
NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")  # Compose's service and volume names
MAX_SERVICES = 64  # a bridge address each, a runc container and a slirp4netns each
MAX_TRIES = 10_000  # a healthcheck's `retries` at most
HARNESS_PATHS = ("/run/trialledger", "/logs", "/tests")  # never covered by a volume
IGNORED = {key: "has no effect on a session's containers here" for key in (
    "container_name", "expose", "tty", "stdin_open", "labels", "pull_policy", "restart")}
# Harbor's Docker publishes them on the host, where no step of a trial reads them (its
# verifier runs in `main`); the session's containers reach each other's ports on its
# own network either way, and nothing of theirs is ever opened to the host here.
IGNORED["ports"] = "not published on the host (the session's containers reach each other)"
MAIN_KEYS = frozenset({"environment", "depends_on", "volumes", "init", "networks", *IGNORED})
TASK_MAIN = frozenset({"build"})  # what the task's compose may set on `main` beside those
VERIFIER_MAIN = frozenset({"image", "build", "user"})  # ... and a separate verifier's
# What `main` has from the task (its image, command, folder and user; its healthcheck)
TASKS_OWN = frozenset({"image", "build", "command", "entrypoint", "working_dir", "user",
                       "healthcheck"})
SERVICE_KEYS = frozenset({*MAIN_KEYS, *TASKS_OWN, "cap_add", "cap_drop", "security_opt",
                          "read_only", "tmpfs", "pids_limit", "network_mode"})
# A `tmpfs` mount's options as Docker takes them (`nosuid`, `nodev` always added: never a
# setuid file or a device inside; `noexec` unless `exec`), each a word or a word=value
TMPFS_WORDS = frozenset({"rw", "ro", "noexec", "exec", "nosuid", "nodev"})
TMPFS_VALUES = {"size": re.compile(r"[0-9]{1,12}[kmgKMG%]?"), "mode": re.compile(r"[0-7]{3,4}"),
                "uid": re.compile(r"[0-9]{1,9}"), "gid": re.compile(r"[0-9]{1,9}")}
# A short volume's options: read-only or not; SELinux relabelling (no labels here: nothing)
VOLUME_OPTIONS = frozenset({"ro", "rw", "z", "Z"})
# Docker reads `no-new-privileges[:=]VALUE` with Go's ParseBool
TRUE, FALSE = ("1", "t", "T", "TRUE", "true", "True"), ("0", "f", "F", "FALSE", "false", "False")
NO_NEW_PRIVILEGES = ("no-new-privileges", *(f"no-new-privileges{sep}{value}"
                                             for sep in ":=" for value in TRUE))
NOTHING_MORE = tuple(f"no-new-privileges{sep}{value}" for sep in ":=" for value in FALSE)
# Every capability Linux names (linux/capability.h), which `cap_drop` may name
CAPABILITIES = frozenset(f"CAP_{name}" for name in (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE",
    "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
    "PERFMON", "BPF", "CHECKPOINT_RESTORE"))
TOP_KEYS = frozenset({"services", "volumes", "networks", "version", "name"})
DEFAULT_NETWORK = "default"  # Compose's network of every service that names none
MAX_NETWORKS = 16  # each a bridge of the session's, on a /24 of its own
# Docker's healthcheck defaults (seconds), as Compose passes them on
DOCKER_CHECK = {"interval": 30.0, "timeout": 30.0, "start_period": 0.0, "start_interval": 5.0}
DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us|ns)")
MAX_DURATION_S = 86_400.0
UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
VARIABLE = re.compile(r"\$(?:(\$)|([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)"
                      r"(?:(:?-)([^}]*))?\})")


@dataclass(frozen=True)
class Volume:
    """One entry of a service's `volumes`: a named volume of the session (shared by every
    service that names it), or a folder of the task bound in (a copy: never written)."""

    kind: Literal["volume", "bind"]
    source: str  # the volume's name, or the task folder's path (resolved, inside it)
    target: str  # an absolute path in the container
    read_only: bool = False


@dataclass(frozen=True)
class Service:
    """One compose service as the session runs it (`main`: the task's own container)."""

    name: str
    source: Source | None = None  # its image (None: main, the task's environment)
    env: dict[str, str] = field(default_factory=dict)  # `environment`, over the image's
    command: tuple[str, ...] | None = None  # None: the image's CMD
    entrypoint: tuple[str, ...] | None = None  # None: the image's ENTRYPOINT
    working_dir: str | None = None  # None: the image's WorkingDir
    user: str | None = None  # None: the image's User
    depends_on: dict[str, Condition] = field(default_factory=dict)
    healthcheck: Healthcheck | None = None  # `service_healthy` waits on it
    volumes: tuple[Volume, ...] = ()
    caps: tuple[str, ...] = DOCKER_CAPS  # `cap_add` / `cap_drop` over Docker's default set
    networks: tuple[str, ...] = (DEFAULT_NETWORK,)  # the networks it is on (`networks`)
    isolated: bool = False  # `network_mode: none`: a network of its own, loopback alone
    walled: bool = False  # on `internal` networks alone: no way out (as Docker's, none)
    read_only: bool = False  # `read_only`: its root file system mounted read-only
    tmpfs: tuple[tuple[str, tuple[str, ...]], ...] = ()  # `tmpfs`: (target, mount options)
    pids_limit: int | None = None  # `pids_limit`: its own container's (None: the session's)
    no_new_privileges: bool = False  # `security_opt: [no-new-privileges:true]`

    def argv(self, entrypoint: tuple[str, ...], cmd: tuple[str, ...]) -> list[str]:
        """PID 1's command as Docker makes it: the entrypoint (the service's, else the
        image's), then the command (the service's, else the image's CMD — dropped when
        the service sets its own entrypoint, as Docker does)."""
        first = self.entrypoint if self.entrypoint is not None else entrypoint
        rest = self.command if self.command is not None else (
            () if self.entrypoint is not None else cmd)
        return [*first, *rest]


@dataclass(frozen=True)
class Compose:
    """A task's compose file: its services (`main` among them) in the order they start."""

    services: tuple[Service, ...]  # started in this order (depends_on first), main last
    secrets: tuple[str, ...] = ()  # values interpolated from the operator's environment
    ignored: dict[str, str] = field(default_factory=dict)  # warned keys → why

    @property
    def networks(self) -> tuple[str, ...]:
        """Every network some container of it is on, in the order its services (in start
        order, `main` last) first name them (each a bridge of the session's when every
        phase is public: sandbox/bridge.py)."""
        return tuple(dict.fromkeys(n for service in self.services for n in service.networks))

    @property
    def main(self) -> Service:
        return next(s for s in self.services if s.name == MAIN_SERVICE)

    @property
    def others(self) -> tuple[Service, ...]:
        return tuple(s for s in self.services if s.name != MAIN_SERVICE)


def load(folder: Path, max_bytes: int, task_env: Mapping[str, str],
         build_timeout_s: float = BUILD_TIMEOUT_S, *, base: str = "environment",
         main_may: frozenset[str] = frozenset()) -> Compose | None:
    """The task's compose file in `base` (`environment/`, or a separate verifier's
    `tests/`) read (None: it has none); `TaskInvalid` when it is not one Compose would
    read, `UnsupportedField` naming a key we cannot honour. Build contexts and binds are
    relative to `base`. `main_may`: the keys `main` may set besides `MAIN_KEYS`, as
    Compose merges them over Harbor's base file — the task's `build` (`Compose.main.source`:
    another context or Dockerfile than environment/'s), a separate verifier's `image`,
    `build` and `user` (the verifier's, without `[verifier] user`)."""
    file = f"{base}/docker-compose.yaml"
    if not os.path.lexists(folder / file):
        return None
    where = str(folder / file)
    try:
        document = yaml.safe_load(read_task_text(folder, file, max_bytes))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise TaskInvalid(f"{where}: not YAML{at}") from None
    except RecursionError:
        raise TaskInvalid(f"{where}: nested too deeply to read") from None
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        raise TaskInvalid(f"{where}: expected a mapping with `services`")
    ignored: dict[str, str] = {}
    for key in document:
        if not isinstance(key, str) or not (key in TOP_KEYS or key.startswith("x-")):
            raise UnsupportedField(f"{where}: {key}: not supported here (only `services`, "
                                   f"`volumes` and `networks`)")
        if key not in ("services", "volumes", "networks"):
            ignored[f"{file} {key}"] = "has no effect here"
    reader = _Reader(where, folder, base, task_env, build_timeout_s,
                     _declared_volumes(document.get("volumes"), where),
                     *_declared_networks(document.get("networks"), where), main_may)
    services = {MAIN_SERVICE: Service(MAIN_SERVICE)}
    if len(document["services"]) > MAX_SERVICES:
        raise UnsupportedField(f"{where}: services: {len(document['services'])} services (at "
                               f"most {MAX_SERVICES} here)")
    for name, raw in document["services"].items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise TaskInvalid(f"{where}: services: {shown(name)} is not a service name")
        services[name] = reader.service(name, raw, ignored, file)
    return Compose(_ordered(services, where), tuple(dict.fromkeys(reader.secrets)),
                   dict(sorted(ignored.items())))


class _Reader:
    """One compose file's services read (`where` names it in errors)."""

    def __init__(self, where: str, folder: Path, base: str, task_env: Mapping[str, str],
                 build_timeout_s: float, volumes: frozenset[str],
                 networks: frozenset[str], internal: frozenset[str],
                 main_may: frozenset[str] = frozenset()) -> None:
        self.where, self.folder, self.base = where, folder, base
        self.volumes = volumes  # the top level's named volumes
        self.networks = networks  # ... and networks (`default` among them)
        self.internal = internal  # ... those of them `internal` (no way out)
        self.main_keys = MAIN_KEYS | main_may
        self.task_env = task_env
        self.build_timeout_s = build_timeout_s
        self.secrets: list[str] = []

    def service(self, name: str, raw: Any, ignored: dict[str, str], file: str) -> Service:
        if not isinstance(raw, dict):
            raise TaskInvalid(f"{self.where}: services.{name}: expected a mapping")
        allowed = self.main_keys if name == MAIN_SERVICE else SERVICE_KEYS
        for key in raw:
            if key not in allowed:
                why = ("not supported here" if name != MAIN_SERVICE or key not in TASKS_OWN
                       else "is the task's own ([environment], [agent] user)"
                       if self.base == "environment" else
                       "is the verifier's own ([verifier.environment] workdir, its image's "
                       "command)")
                raise UnsupportedField(f"{self.where}: services.{name}.{key}: {why}")
            if key in IGNORED:
                ignored[f"{file} services.{name}.{key}"] = IGNORED[key]
        at = f"services.{name}"
        if name != MAIN_SERVICE and "image" not in raw and "build" not in raw:
            raise TaskInvalid(f"{self.where}: {at}: needs an `image` or a `build`")
        isolated = self._network_mode(raw, at)
        networks = () if isolated else self._networks(raw.get("networks"), f"{at}.networks")
        if not isinstance(raw.get("init", False), bool):  # (either way, our init is every
            # container's PID 1: it reaps orphans and passes signals on, as `--init` does)
            raise TaskInvalid(f"{self.where}: {at}.init: expected true or false")
        return Service(
            name=name,
            source=(self._source(raw, at) if name != MAIN_SERVICE or "image" in raw
                    or "build" in raw else None),
            env=self._environment(raw.get("environment", {}), f"{at}.environment"),
            command=self._words(raw.get("command"), f"{at}.command"),
            entrypoint=self._words(raw.get("entrypoint"), f"{at}.entrypoint"),
            working_dir=self._path(raw.get("working_dir"), f"{at}.working_dir"),
            user=self._user(raw["user"], f"{at}.user") if "user" in raw else None,
            depends_on=self._depends_on(raw.get("depends_on", {}), f"{at}.depends_on"),
            healthcheck=self._healthcheck(raw.get("healthcheck"), f"{at}.healthcheck"),
            volumes=self._volumes(raw.get("volumes", []), f"{at}.volumes"),
            caps=self._caps(raw.get("cap_add", []), raw.get("cap_drop", []), at),
            no_new_privileges=self._no_new_privileges(raw.get("security_opt", []), at),
            networks=networks,
            isolated=isolated,
            # (Docker's: on `internal` networks alone, a container has no way out)
            walled=bool(networks) and all(name in self.internal for name in networks),
            read_only=self._flag(raw.get("read_only", False), f"{at}.read_only"),
            tmpfs=self._tmpfs(raw.get("tmpfs", []), f"{at}.tmpfs"),
            pids_limit=self._pids_limit(raw.get("pids_limit"), f"{at}.pids_limit"))

    def _user(self, value: Any, at: str) -> str:
        """`user`: a name or id, then optionally `:` a group (looked up in the image when it
        starts); empty is refused, as `[verifier] user = ""` is."""
        user = self._text(value, at)
        if not user or user.startswith(":"):
            raise TaskInvalid(f"{self.where}: {at}: {shown(user)} names no user")
        return user

    def _flag(self, value: Any, at: str) -> bool:
        if not isinstance(value, bool):
            raise TaskInvalid(f"{self.where}: {at}: expected true or false")
        return value

    def _tmpfs(self, value: Any, at: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """`tmpfs`: `TARGET[:OPTIONS]`, one or a list, as Docker mounts it: `nosuid` and
        `nodev` always, `noexec` unless `exec`; an option other than `TMPFS_WORDS` and
        `TMPFS_VALUES` is refused by name, as is a target over the harness's own paths."""
        found = []
        for item in [value] if isinstance(value, str) else value if isinstance(
                value, list) else [None]:
            if not isinstance(item, str):
                raise TaskInvalid(f"{self.where}: {at}: expected a path or a list of paths")
            target, _, written = self._text(item, at).partition(":")
            options = [option for option in written.split(",") if option]
            for option in options:
                word, equals, given = option.partition("=")
                if not (option in TMPFS_WORDS if not equals else
                        word in TMPFS_VALUES and TMPFS_VALUES[word].fullmatch(given)):
                    raise UnsupportedField(f"{self.where}: {at}: {shown(option)}: not "
                                           f"supported here (rw, ro, exec, noexec, nosuid, "
                                           f"nodev, size, mode, uid, gid)")
            self._target(target, at)
            kept = [o for o in options if o not in ("exec", "noexec", "nosuid", "nodev")]
            found.append((os.path.normpath(target), (
                "nosuid", "nodev", *(() if "exec" in options else ("noexec",)), *kept)))
        return tuple(found)

    def _target(self, target: str, at: str) -> None:
        """A mount's target: an absolute path, never over the harness's own."""
        if not target.startswith("/"):
            raise TaskInvalid(f"{self.where}: {at}: {shown(target)}: the target must be an "
                              f"absolute path")
        normal = os.path.normpath(target)
        if any(normal == p or normal.startswith(f"{p}/") or p.startswith(f"{normal}/")
               or normal == "/" for p in HARNESS_PATHS):
            raise UnsupportedField(f"{self.where}: {at}: {shown(target)}: a mount over "
                                   f"the harness's own paths ({', '.join(HARNESS_PATHS)})")

    def _pids_limit(self, value: Any, at: str) -> int | None:
        """`pids_limit`: the container's own process limit (0 or -1: none, as Docker's)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise TaskInvalid(f"{self.where}: {at}: expected a whole number")
        return value if value > 0 else None

    def _network_mode(self, raw: Mapping[str, Any], at: str) -> bool:
        """`network_mode`: `none` alone (a network namespace of its own with nothing but
        loopback, in no network, named in nobody's /etc/hosts); `host`, `bridge`,
        `service:…` and `container:…` are refused by name, and so is `networks` beside it."""
        if "network_mode" not in raw:
            return False
        mode = self._text(raw["network_mode"], f"{at}.network_mode")
        if mode != "none":
            raise UnsupportedField(f"{self.where}: {at}.network_mode: {shown(mode)}: only "
                                   f"'none' is supported here")
        if "networks" in raw:
            raise TaskInvalid(f"{self.where}: {at}: `network_mode` and `networks` cannot "
                              f"both be set")
        return True

    def _networks(self, value: Any, at: str) -> tuple[str, ...]:
        """`networks`: declared networks' names, a list or a mapping (each without options:
        aliases and fixed addresses are refused by name); none named: `default`."""
        if value is None:
            return (DEFAULT_NETWORK,)
        if isinstance(value, dict):
            for name, spec in value.items():
                if spec not in (None, {}):
                    raise UnsupportedField(f"{self.where}: {at}.{_label(name)}: options "
                                           f"(aliases, addresses) are not supported here")
        elif not isinstance(value, list):
            raise TaskInvalid(f"{self.where}: {at}: expected a list or a mapping")
        found = [self._text(name, at) for name in value]
        for name in found:
            if name not in self.networks:
                raise TaskInvalid(f"{self.where}: {at}: network {shown(name)} is not declared "
                                  f"in the top-level `networks`")
        if not found:
            raise TaskInvalid(f"{self.where}: {at}: names no network")
        return tuple(dict.fromkeys(found))

    def _caps(self, add: Any, drop: Any, at: str) -> tuple[str, ...]:
        """The container's capabilities as Docker's `TweakCapabilities` makes them: its
        default set (none with `ALL` dropped), less `cap_drop`, plus `cap_add` — which may
        only name capabilities of the default set: one Docker does not grant by default
        (`NET_ADMIN`, `SYS_ADMIN`, `ALL`, …) is refused by name."""
        added, dropped = (self._cap_names(add, f"{at}.cap_add"),
                          self._cap_names(drop, f"{at}.cap_drop"))
        beyond = [cap for cap in added if cap not in DOCKER_CAPS]
        if beyond:
            raise UnsupportedField(f"{self.where}: {at}.cap_add: {beyond[0].removeprefix('CAP_')}"
                                   f" is not one of Docker's default capabilities: not granted "
                                   f"here")
        kept = () if "CAP_ALL" in dropped else tuple(c for c in DOCKER_CAPS if c not in dropped)
        return tuple(c for c in DOCKER_CAPS if c in kept or c in added)

    def _cap_names(self, value: Any, at: str) -> list[str]:
        """Capability names as Docker reads them: any case, `CAP_` optional."""
        if not isinstance(value, list):
            raise TaskInvalid(f"{self.where}: {at}: expected a list")
        names = [self._text(item, at).upper() for item in value]
        names = [name if name.startswith("CAP_") else f"CAP_{name}" for name in names]
        bad = [name for name in names if name not in CAPABILITIES | {"CAP_ALL"}]
        if bad:  # (as Docker: a misspelt drop must not leave what it meant to drop)
            raise TaskInvalid(f"{self.where}: {at}: {shown(bad[0])} is not a capability")
        return names

    def _no_new_privileges(self, value: Any, at: str) -> bool:
        """`security_opt`: `no-new-privileges` (`:true`, `=true`) honoured, its `false`
        the default; any other option (seccomp, apparmor, label, …) refused by name."""
        if not isinstance(value, list):
            raise TaskInvalid(f"{self.where}: {at}.security_opt: expected a list")
        wanted = False
        for item in value:
            option = self._text(item, f"{at}.security_opt")
            if option not in (*NO_NEW_PRIVILEGES, *NOTHING_MORE):
                raise UnsupportedField(f"{self.where}: {at}.security_opt: {shown(option)}: "
                                       f"only no-new-privileges is supported here")
            wanted = wanted or option in NO_NEW_PRIVILEGES
        return wanted

    def _volumes(self, value: Any, at: str) -> tuple[Volume, ...]:
        """`volumes`: `SOURCE:TARGET[:ro|rw]` (a declared volume's name, or a path starting
        `.` relative to the file's folder), or the long form's `type` (`volume`, `bind`),
        `source`, `target`, `read_only`. An anonymous volume or a host path is refused."""
        if not isinstance(value, list):
            raise TaskInvalid(f"{self.where}: {at}: expected a list")
        volumes = []
        for item in value:
            if isinstance(item, dict):
                unknown = set(item) - {"type", "source", "target", "read_only"}
                if unknown or item.get("type") not in ("volume", "bind"):
                    what = (shown(sorted(map(str, unknown))[0]) if unknown
                            else f"type = {shown(item.get('type'))}")
                    raise UnsupportedField(f"{self.where}: {at}: {what}: not supported here")
                source = self._text(item.get("source", ""), at)
                target = self._text(item.get("target", ""), at)
                read_only = item.get("read_only", False) is True
                bind = item["type"] == "bind"
            else:
                parts = self._text(item, at).split(":")
                options = parts[2].split(",") if len(parts) == 3 else []
                if len(parts) not in (2, 3) or not set(options) <= VOLUME_OPTIONS:
                    raise UnsupportedField(f"{self.where}: {at}: {shown(item)}: only SOURCE:TARGET "
                                           f"or SOURCE:TARGET:OPTIONS (ro, rw; z, Z) is "
                                           f"supported here")
                source, target = parts[0], parts[1]
                read_only = "ro" in options
                bind = source.startswith((".", "/", "~"))
            self._target(target, at)
            if bind:
                volumes.append(Volume("bind", self._bind_source(source, at), target,
                                      read_only))
            elif source not in self.volumes:
                raise TaskInvalid(f"{self.where}: {at}: volume {shown(source)} is not declared in "
                                  f"the top-level `volumes`")
            else:
                volumes.append(Volume("volume", source, target, read_only))
        return tuple(volumes)

    def _bind_source(self, source: str, at: str) -> str:
        """A bind's source: a path relative to the file's folder, inside the task folder."""
        if not source.startswith("."):
            raise UnsupportedField(f"{self.where}: {at}: {shown(source)}: a host path outside the "
                                   f"task folder is never bound in")
        relative = os.path.normpath(f"{self.base}/{source}")
        real = within(self.folder, relative)
        if relative.startswith("..") or real is None or not os.path.exists(real):
            raise TaskInvalid(f"{self.where}: {at}: {shown(source)}: must be a file or folder "
                              f"inside the task folder")
        return str(real)

    def _text(self, value: Any, at: str) -> str:
        """A scalar as Compose reads it, interpolated (a NUL byte, which no path, word or
        name can hold, refused)."""
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TaskInvalid(f"{self.where}: {at}: expected a string, not {shown(value)}")
        text = self._interpolate(str(value), at)
        if "\0" in text:
            raise TaskInvalid(f"{self.where}: {at}: a NUL byte")
        return text

    def _interpolate(self, text: str, at: str) -> str:
        def one(found: re.Match[str]) -> str:
            if found[1]:
                return "$"
            variable = found[2] or found[3]
            if variable in self.task_env:
                value: str | None = self.task_env[variable]
            elif variable in os.environ:
                value = self._operators(variable, at)
            else:
                value = None
            if found[4] == ":-" and not value:
                return found[5]
            if found[4] == "-" and value is None:
                return found[5]
            if value is None:
                raise TaskInvalid(f"{self.where}: {at}: ${{{variable}}} is not set (neither "
                                  f"in [environment] env nor in this environment)")
            return value
        if "$" in VARIABLE.sub("", text):
            raise TaskInvalid(f"{self.where}: {at}: {shown(text)}: a `$` Compose cannot "
                              f"interpolate (`$$` writes one)")
        return VARIABLE.sub(one, text)

    def _words(self, value: Any, at: str) -> tuple[str, ...] | None:
        """`command`/`entrypoint`: a list, or a string split as a shell would (no shell)."""
        if value is None:
            return None
        if isinstance(value, list):
            return tuple(self._text(word, at) for word in value)
        try:
            return tuple(shlex.split(self._text(value, at)))
        except ValueError as error:
            raise TaskInvalid(f"{self.where}: {at}: {error}") from None

    def _path(self, value: Any, at: str) -> str | None:
        if value is None:
            return None
        path = self._text(value, at)
        if not path.startswith("/"):
            raise TaskInvalid(f"{self.where}: {at}: {shown(path)}: an absolute path is needed")
        return path

    def _environment(self, value: Any, at: str) -> dict[str, str]:
        """`environment`: a mapping, or a list of `NAME=value` (`NAME` alone: the
        operator's value, as Compose takes it from its own environment)."""
        pairs: list[tuple[str, Any]]
        if isinstance(value, dict):
            pairs = list(value.items())
        elif isinstance(value, list):
            pairs = []
            for item in value:
                text = self._text(item, at)
                name, equals, rest = text.partition("=")
                if equals:
                    pairs.append((name, rest))
                elif name in os.environ:  # the operator's, taken as it is (no interpolation)
                    pairs.append((name, _Taken(self._operators(name, at))))
        else:
            raise TaskInvalid(f"{self.where}: {at}: expected a mapping or a list")
        env: dict[str, str] = {}
        for name, raw in pairs:
            if not isinstance(name, str) or not re.fullmatch(r"[^=\0]+", name):
                raise TaskInvalid(f"{self.where}: {at}: {shown(name)} is not a variable name")
            if raw is None:
                continue  # unset, as Compose leaves it
            env[name] = (raw.value if isinstance(raw, _Taken)
                         else str(raw).lower() if isinstance(raw, bool)
                         else self._text(raw, f"{at}.{name}"))
            if "\0" in env[name]:
                raise TaskInvalid(f"{self.where}: {at}.{name}: a NUL byte, which no process "
                                  f"can hold")
        return env

    def _operators(self, variable: str, at: str) -> str:
        """The operator's value of `variable`, a secret when its name says so (as
        `[environment] env`'s are)."""
        value = os.environ[variable]
        if SENSITIVE.search(variable):
            try:
                self.secrets.append(long_enough(value, f"{self.where}: {at} ${variable}"))
            except EnvUnresolved as error:
                raise TaskInvalid(str(error)) from None
        return value

    def _depends_on(self, value: Any, at: str) -> dict[str, Condition]:
        if isinstance(value, list):
            return {self._text(name, at): "service_started" for name in value}
        if not isinstance(value, dict):
            raise TaskInvalid(f"{self.where}: {at}: expected a list or a mapping")
        wanted: dict[str, Condition] = {}
        for name, spec in value.items():
            spec = spec if spec is not None else {}
            if not isinstance(spec, dict) or set(spec) - {"condition", "required", "restart"}:
                raise UnsupportedField(f"{self.where}: {at}.{name}: only `condition` is "
                                       f"supported here")
            condition = spec.get("condition", "service_started")
            if condition not in CONDITIONS:
                raise TaskInvalid(f"{self.where}: {at}.{name}.condition: {shown(condition)}: "
                                  f"expected one of {', '.join(CONDITIONS)}")
            wanted[str(name)] = cast(Condition, condition)
        return wanted

    def _source(self, raw: Mapping[str, Any], at: str) -> Source:
        """The service's image: `build` (a context inside the task folder, its `dockerfile`
        inside that context, `args`, a `target` stage), else `image` from the engine's
        storage."""
        build = raw.get("build")
        if "build" not in raw:
            return Source("docker_image", self._text(raw.get("image"), f"{at}.image"),
                          self.folder, self.build_timeout_s)
        spec = {"context": build} if isinstance(build, str) else build
        if not isinstance(spec, dict):
            raise TaskInvalid(f"{self.where}: {at}.build: expected a path or a mapping")
        for key in spec:
            if key not in ("context", "args", "dockerfile", "target"):
                raise UnsupportedField(f"{self.where}: {at}.build.{key}: not supported here")
        written = self._text(spec.get("context", "."), f"{at}.build.context")
        if written.startswith("/"):  # (Compose would build from the host's folder)
            raise UnsupportedField(f"{self.where}: {at}.build.context: {shown(written)}: a "
                                   f"host path is never built from")
        relative = os.path.normpath(f"{self.base}/{written}")
        if (relative.startswith("..") or os.path.isabs(relative)
                or within(self.folder, relative) is None):
            raise TaskInvalid(f"{self.where}: {at}.build.context: must be a folder inside "
                              f"the task folder")
        dockerfile = os.path.normpath(self._text(spec.get("dockerfile", "Dockerfile"),
                                                 f"{at}.build.dockerfile"))
        if dockerfile.startswith("..") or os.path.isabs(dockerfile) or (
                os.path.lexists(self.folder / relative / dockerfile)  # (a missing one: its
                and plain_file(self.folder / relative, dockerfile) is None):  # build says so)
            raise TaskInvalid(f"{self.where}: {at}.build.dockerfile: {shown(dockerfile)} must "
                              f"be a file inside its context ({relative}), no link on the way")
        target = None
        if "target" in spec:
            target = self._text(spec["target"], f"{at}.build.target")
            if not NAME.fullmatch(target):
                raise TaskInvalid(f"{self.where}: {at}.build.target: {shown(target)} is not "
                                  f"a stage name")
        args = self._environment(spec.get("args", {}), f"{at}.build.args")
        return Source("dockerfile", os.path.normpath(f"{relative}/{dockerfile}"), self.folder,
                      self.build_timeout_s, context=relative, build_args=args,
                      dockerfile=dockerfile, target=target)

    def _healthcheck(self, value: Any, at: str) -> Healthcheck | None:
        """Docker's healthcheck as our healthcheck's tries: `test` as `CMD`, `CMD-SHELL`
        or a string (run by `sh -c`); `NONE` or `disable: true` none."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise TaskInvalid(f"{self.where}: {at}: expected a mapping")
        unknown = set(value) - {"test", "disable", *DOCKER_CHECK, "retries"}
        if unknown:
            first = shown(sorted(map(str, unknown))[0])
            raise UnsupportedField(f"{self.where}: {at}.{first}: not supported here")
        test = value.get("test")
        if value.get("disable") is True or test in (["NONE"], "NONE"):
            return None
        if isinstance(test, str):
            command = self._text(test, f"{at}.test")
        elif isinstance(test, list) and len(test) >= 2 and test[0] in ("CMD", "CMD-SHELL"):
            words = [self._text(word, f"{at}.test") for word in test[1:]]
            command = shlex.join(words) if test[0] == "CMD" else " ".join(words)
        else:
            raise TaskInvalid(f"{self.where}: {at}.test: expected a string or "
                              f"[\"CMD\", ...] / [\"CMD-SHELL\", ...]")
        times = {key: _duration(value[key], f"{self.where}: {at}.{key}")
                 if key in value else default for key, default in DOCKER_CHECK.items()}
        retries = value.get("retries", 3)
        if (isinstance(retries, bool) or not isinstance(retries, int)
                or not 1 <= retries <= MAX_TRIES):
            raise TaskInvalid(f"{self.where}: {at}.retries: a whole number from 1 to "
                              f"{MAX_TRIES} is needed")
        if "\0" in command:
            raise TaskInvalid(f"{self.where}: {at}.test: a NUL byte, which no process can hold")
        return Healthcheck(command, interval_sec=times["interval"],
                           timeout_sec=times["timeout"],
                           start_period_sec=times["start_period"],
                           start_interval_sec=times["start_interval"], retries=retries)


@dataclass(frozen=True)
class _Taken:
    """A value taken whole from the operator's environment (never interpolated)."""

    value: str


def shown(value: Any) -> str:
    """`value` for a message, bounded (a YAML alias can make a small file's value huge)."""
    return _SHOWN.repr(value)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2


def _declared_volumes(value: Any, where: str) -> frozenset[str]:
    """The top level's `volumes`: names, each with no options (a driver is refused)."""
    if value is None:
        return frozenset()
    if not isinstance(value, dict):
        raise TaskInvalid(f"{where}: volumes: expected a mapping of names")
    for name, spec in value.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise TaskInvalid(f"{where}: volumes: {shown(name)} is not a volume name")
        if spec not in (None, {}):
            raise UnsupportedField(f"{where}: volumes.{name}: options (a driver, an external "
                                   f"volume) are not supported here")
    return frozenset(str(name) for name in value)


def _label(key: Any) -> str:
    """A key as a refusal names it: as written when it is a plain name, else quoted."""
    return key if isinstance(key, str) and NAME.fullmatch(key) else shown(key)


def _declared_networks(value: Any, where: str) -> tuple[frozenset[str], frozenset[str]]:
    """The top level's `networks` and `default`: names, each a bridge of the session's
    (`driver: bridge` or none), and those of them `internal: true` (Docker's network with
    no way out: a container on such networks alone has none); an external network and
    other options are refused by name."""
    if value is None:
        return frozenset({DEFAULT_NETWORK}), frozenset()
    if not isinstance(value, dict):
        raise TaskInvalid(f"{where}: networks: expected a mapping of names")
    if len(value) > MAX_NETWORKS:
        raise UnsupportedField(f"{where}: networks: {len(value)} networks (at most "
                               f"{MAX_NETWORKS} here)")
    for name, spec in value.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise TaskInvalid(f"{where}: networks: {shown(name)} is not a network name")
        if not isinstance(spec, (dict, type(None))):
            raise TaskInvalid(f"{where}: networks.{name}: expected a mapping")
        for key, option in (spec or {}).items():
            if (key, option) not in (("driver", "bridge"), ("internal", False),
                                     ("internal", True)):
                raise UnsupportedField(f"{where}: networks.{name}.{_label(key)}: not "
                                       f"supported here (each network is a bridge of the "
                                       f"session's)")
    internal = {str(name) for name, spec in value.items() if (spec or {}).get("internal")}
    return frozenset({DEFAULT_NETWORK, *map(str, value)}), frozenset(internal)


def _duration(value: Any, where: str) -> float:
    """A Compose duration (`1m30s`, `500ms`; a bare number is seconds) in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip() if isinstance(value, str) else ""
        if not text or DURATION.sub("", text):
            raise TaskInvalid(f"{where}: {shown(value)}: expected a duration such as 10s or "
                              f"1m30s")
        seconds = sum(float(n) * UNITS[unit] for n, unit in DURATION.findall(text))
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DURATION_S:
        raise TaskInvalid(f"{where}: {shown(value)}: a duration up to a day is needed")
    return seconds


def _ordered(services: Mapping[str, Service], where: str) -> tuple[Service, ...]:
    """The services in a start order where each comes after what it depends on (`main`
    as late as it can: the agent's container starts last), or `TaskInvalid` naming an
    unknown service or a cycle."""
    for service in services.values():
        for name in service.depends_on:
            if name not in services:
                raise TaskInvalid(f"{where}: services.{service.name}.depends_on: no service "
                                  f"named {shown(name)}")
    order: list[Service] = []
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise TaskInvalid(f"{where}: depends_on makes a cycle: "
                              f"{' -> '.join((*path, name))}")
        state[name] = "visiting"
        for needed in services[name].depends_on:
            visit(needed, (*path, name))
        state[name] = "done"
        order.append(services[name])

    for name in sorted(services, key=lambda n: n == MAIN_SERVICE):
        visit(name, ())
    main = next(s for s in order if s.name == MAIN_SERVICE)
    needed_by_others = {n for s in services.values() if s.name != MAIN_SERVICE
                        for n in s.depends_on}
    if MAIN_SERVICE in needed_by_others:
        raise UnsupportedField(f"{where}: a service that depends on `main` is not supported "
                               f"here (main, the agent's container, starts last)")
    return (*(s for s in order if s is not main), main)
