"""Running tasks on this machine: `run`, `setup`, `cache` and `demo` — each one's parser
beside its handler — and the options `run`, `job run` and `worker` share (the endpoint,
grants, settings, the sandbox, the runtime and the environment cache)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from trialledger.adapters.commands.common import (
    EXIT_FOUND,
    EXIT_OK,
    Once,
    Refused,
    command,
    in_store,
    positive,
    store_files,
    with_db,
    with_sandbox_uid,
)
from trialledger.adapters.console.render import out, table
from trialledger.adapters.console.session import print_outcomes, print_trial_reward
from trialledger.adapters.console.signals import until_signalled
from trialledger.adapters.console.tasks import warn_fields

if TYPE_CHECKING:
    from trialledger.store import Ledger

AGENT_NAMES = ("codex", "oracle", "nop")  # adapters.scripted.AGENTS (SPEC §15)


def _parse_set(pairs: Sequence[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise Refused(f"--set {pair!r}: expected KEY=VALUE")
        try:
            settings[key] = json.loads(raw)
        except ValueError:
            settings[key] = raw  # not JSON: taken as a string
    return settings


def run_options(args: argparse.Namespace) -> Any:
    """`run`'s options (shared by `job run`): the key, grants, settings and runner."""
    from trialledger.adapters.session.runner import RunOptions

    api_key = None
    if args.api_key_env:
        if args.api_key_env not in os.environ:
            raise Refused(f"--api-key-env {args.api_key_env}: no such environment variable")
        api_key = os.environ[args.api_key_env]
    grants: list[dict[str, Any]] = []
    if args.grants:
        try:
            grants = json.loads(Path(args.grants).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise Refused(f"--grants {args.grants}: {error}") from None
        if not isinstance(grants, list):
            raise Refused(f"--grants {args.grants}: expected a JSON list of grants")
    agent = getattr(args, "agent", None) or "codex"
    # A worker has no --model (the job's) and learns its agent from the job.
    if agent == "codex" and hasattr(args, "model") and not (args.model_base_url and args.model):
        raise Refused("--agent codex (the default) needs --model-base-url and --model")
    return RunOptions(
        agent=agent, model_base_url=args.model_base_url or "",
        model=getattr(args, "model", None) or "",
        api_key=api_key, grants=grants, overrides=_parse_set(getattr(args, "set", None) or []),
        codex_bin=args.codex_bin, max_attempts=getattr(args, "max_attempts", 1),
        sandbox_uid=args.sandbox_uid, isolation=args.isolation,
        runtime=_runtime(getattr(args, "runtime", None)),
        protected_paths=store_files(args.db),
        task_mcp_hosts=tuple(getattr(args, "task_mcp_host", None) or ()),
        **({"runner_id": args.runner_id} if args.runner_id else {}),
    )


def cmd_run(args: argparse.Namespace) -> int:
    """Run the real Codex CLI on a task in the local sandbox; print each session's outcome."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.images.imagestore import prepared_and_held
    from trialledger.adapters.jobs.queue import check_inputs
    from trialledger.adapters.jobs.trial import Trial, TrialRun
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.session.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.session.runner import SessionResult, SessionRunner
    from trialledger.adapters.session.scripted import solve_script
    from trialledger.adapters.tasks.files import file_limit
    from trialledger.adapters.tasks.task import Task, TaskInvalid, require_verifier
    from trialledger.adapters.tasks.verifiermode import refuse_outside_range

    options = run_options(args)
    api_key = options.api_key

    async def trial(ledger: Ledger) -> TrialRun:
        runner = SessionRunner(ledger, task, options, environment)
        if not args.trial:
            return await Trial.fresh(ledger, task.name).run(runner)
        before = await ledger.sessions(trial_id=args.trial)
        if any(s["task"] != task.name for s in before):
            raise Refused(f"--trial {args.trial} is a trial of task {before[0]['task']}, "
                          f"not {task.name}")
        ran = await Trial(ledger, args.trial).run(runner)  # as a job's trial goes on
        if ran.ran or ran.final is None:
            return ran
        ran.ran = [SessionResult(ran.sessions[-1]["session_id"], ran.final)]  # none ran
        return ran

    async def go() -> TrialRun:
        if options.agent == "codex":
            await check_endpoint(args.model_base_url, api_key)  # before anything is seeded
        return await in_store(args.db, trial)

    try:
        task = require_verifier(Task.load(Path(args.task_dir),  # as Harbor, up front
                                          max_bytes=file_limit(options.overrides)))
        refuse_outside_range(task, in_range=range_mode(args))  # a separate verifier's
        warn_fields([task], in_range=range_mode(args))
        check_inputs([task], options)  # settings, grants, Codex: before anything is seeded
        if options.agent == "oracle":
            solve_script(task)  # NoSolution: refused before anything is seeded
        with contextlib.ExitStack() as held:  # (kept by `cache prune` until the run ends)
            environment = prepared_and_held(  # before anything is seeded (§12)
                functools.partial(_prepared, task, args), held)
            done = anyio.run(until_signalled, go)
    except (CodexNotFound, SandboxRefused, TaskInvalid, EndpointUnreachable) as error:
        raise Refused(str(error)) from None
    results = done.ran
    print_outcomes(results, as_json=args.json)
    if task.steps:  # the trial's reward over its steps (docs/SPEC.md §17)
        print_trial_reward(done.trial_id, task.reward_strategy, done.rewards,
                           len(done.steps or []), as_json=args.json)
        return EXIT_OK if done.rewards is not None else EXIT_FOUND
    final = results[-1].view if results else None
    scored = (final is not None and final.outcome == "verify" and final.decision is not None
              and final.decision.reward_valid)
    return EXIT_OK if scored else EXIT_FOUND  # SPEC §10: 1 when the trial is left unscored


def add_run(commands: Any) -> None:
    p = command(commands, "run", help="run the real Codex CLI on a task in the local sandbox",
                examples=["trialledger run tasks/hello --model-base-url "
                          "http://127.0.0.1:8000/v1 --model gpt-5.1-codex --max-attempts 3"])
    p.add_argument("task_dir", help="instruction.md, task.toml, workspace/, tests/test.sh")
    p.add_argument("--trial", metavar="ID",
                   help="run (or continue) this trial: its sessions a crashed runner left "
                        "open are recovered and its next attempt runs, up to --max-attempts")
    with_run_options(p, json_help="one JSON object per session (outcome, rule, cause, "
                                  "rewards, tokens)")
    p.set_defaults(handler=cmd_run, watched=True)


def _prepared(task: Any, args: argparse.Namespace) -> Any:
    """The task's environment, built and unpacked into the cache (EnvironmentUnavailable:
    one line naming what is missing; nothing seeded)."""
    from trialledger.adapters.images.environment import HOST
    from trialledger.adapters.sandbox.identity import sandbox_user
    from trialledger.adapters.tasks.verifiermode import prepare_task

    if task.source is None:
        return HOST
    owner = sandbox_user(args.sandbox_uid).uid if os.geteuid() == 0 else None
    return prepare_task(task, environment_cache(args), owner=owner, engine=args.engine,
                        pull=args.pull, force_build=args.force_build)


def _runtime(asked: str | None) -> str | None:
    """`--runtime`, refused (one line) where `setup` found it cannot start a container;
    without it, the runtime `setup` found able (None: none can, and range mode is
    unavailable: `range_mode` says why)."""
    from trialledger.adapters.sandbox.ociruntime import recorded_problem
    from trialledger.adapters.sandbox.runc import default_runtime

    if asked is None:
        return default_runtime()
    if asked != "bwrap" and (problem := recorded_problem(asked)) is not None:
        raise Refused(f"--runtime {asked}: {problem}")
    return asked


def range_mode(args: argparse.Namespace) -> bool:
    """Whether image and rootfs sessions run in range mode (docs/SPEC.md §15, §16): a root
    runner after `setup`, the default sandbox user, bwrap, a runtime that can start a
    container here (else single-id mode, said once naming why)."""
    from trialledger.adapters.sandbox.rangemode import range_problem

    return (getattr(args, "sandbox_uid", None) is None
            and getattr(args, "isolation", "bwrap") == "bwrap"
            and range_problem(getattr(args, "runtime", None)) is None)


def environment_cache(args: argparse.Namespace) -> Any:
    """The environment cache sessions read: plain entries for range mode (a root runner
    after `setup`, the default sandbox user, bwrap), else rootless ones (single-id mode)."""
    from trialledger.adapters.images.environment import Cache
    from trialledger.adapters.images.imagestore import plain_cache
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.idrange import check_plain_folder

    plain = range_mode(args)  # plain: images from the session image store
    cache = plain_cache(args.cache_dir) if plain else Cache(args.cache_dir)
    if plain:
        try:
            check_plain_folder(cache.folder)
        except SandboxRefused as error:
            raise Refused(str(error)) from None
    return cache


def cache_owner(args: argparse.Namespace) -> int | None:
    """The uid cache entries are made for: the sandbox user when we are root."""
    from trialledger.adapters.sandbox.identity import sandbox_user

    return sandbox_user(args.sandbox_uid).uid if os.geteuid() == 0 else None


def with_run_options(p: argparse.ArgumentParser, *, json_help: str, of_job: bool = True
                      ) -> None:
    """What `run`, `job run` and `worker` share: the store, the endpoint, grants, the
    sandbox and the environment cache; and (`of_job`, not for a worker, which takes them
    from the job) the model, the settings and the attempts."""
    with_db(p)
    p.add_argument("-a", "--agent", choices=AGENT_NAMES, action=Once,
                   default=None if not of_job else "codex",
                   help="codex (the default), or oracle (runs the task's solution/solve.sh) "
                        "or nop (runs nothing), as Harbor's" + (
                            "" if of_job else "; default: the job's, which any other refuses"))
    p.add_argument("--model-base-url",
                   help="the Responses endpoint's base URL (needed with --agent codex)")
    p.add_argument("--api-key-env", metavar="NAME", help="environment variable with the API key")
    p.add_argument("--grants", metavar="FILE.json", help="a JSON list of tool grants (a "
                   "worker's must match its job's)")
    p.add_argument("--task-mcp-host", action="append", metavar="HOST",
                   help="a host a task's own HTTP MCP servers may be at though it is no "
                        "public address (127.0.0.1, localhost, a private name); repeatable; "
                        "this runner's own, not the job's")
    if of_job:
        p.add_argument("-m", "--model", action=Once,
                       help="the model name to ask for (needed with --agent codex)")
        p.add_argument("--max-attempts", type=positive, default=1,
                       help="sessions per trial at most: a retry decision runs another, up to N")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="a setting (VALUE parsed as JSON, else a string); repeatable")
    p.add_argument("--codex-bin", help="the Codex CLI (default: TRIALLEDGER_CODEX_BIN or PATH)")
    p.add_argument("--runner-id", help="this runner's id (default: host-pid)")
    p.add_argument("--json", action="store_true", help=json_help)
    with_sandbox_uid(p)
    p.add_argument("--isolation", choices=("bwrap", "process-group"), default="bwrap",
                   help="bwrap (default; a bwrap that cannot sandbox refuses the run) or "
                        "process-group: the agent runs unconfined, as the sandbox uid")
    p.add_argument("--runtime", choices=("runc", "crun", "bwrap"), default=None,
                   help="what starts a range-mode container (image and rootfs tasks under "
                        "verifier_isolation = harbor): the OCI runtime runc or crun, which "
                        "honour setuid files inside, or bwrap, which does not (default: "
                        "the runtime `setup` found able; docs/SPEC.md §16)")
    _with_cache(p)
    p.add_argument("--engine", choices=("podman", "docker"),
                   help="the container engine for docker_image and Dockerfile tasks "
                        "(default: podman when installed, else docker)")
    p.add_argument("--pull", action="store_true",
                   help="pull a docker_image missing from the engine's local storage "
                        "(default: build it from environment/Dockerfile, else refuse), and a "
                        "Dockerfile's FROM image missing from the build storage (default: "
                        "refuse the task, naming it)")
    p.add_argument("--force-build", action="store_true",
                   help="build a docker_image task from its environment/Dockerfile even when "
                        "the image is present")


def _with_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help="unpacked task environments (default $XDG_CACHE_HOME/trialledger, "
                        "else ~/.cache/trialledger)")


def cmd_cache(args: argparse.Namespace) -> int:
    """List or remove unpacked task environments (docs/SPEC.md §12); `ls` also lists the
    session image store's images (range mode, §15)."""
    from trialledger.adapters.images.environment import Cache, EnvironmentUnavailable
    from trialledger.adapters.images.imagestore import ImageStore

    cache = Cache(args.cache_dir)
    if args.cache_command == "ls":  # the cache's entries, then the image store's images
        entries = [*cache.entries(), *ImageStore().entries()]
        if args.json:
            for e in entries:
                print(json.dumps({"digest": e.digest, "kind": e.kind, "ref": e.ref,
                                  "bytes": e.size, "created": e.created}))
        else:
            table(["digest", "kind", "ref", "MB", "created"],
                  [[e.digest, e.kind, e.ref, f"{e.size / 1e6:.1f}", e.created]
                   for e in entries])
        return EXIT_OK
    removed = cache.prune(args.digest or ())
    out.print(f"removed {len(removed)} cache entr{'y' if len(removed) == 1 else 'ies'} "
              f"({sum(e.size for e in removed) / 1e6:.1f} MB) from {cache.folder}")
    if os.geteuid() != 0:
        return EXIT_OK  # the image store and the build storage are root's
    from trialledger.adapters.images.build import no_build_running, prune_build_storage

    with no_build_running() as quiet:
        if not quiet and not args.digest:
            out.print("kept the image store's and the build storage's images: a build is "
                      "running")
            return EXIT_OK
        images, held, failed = ImageStore().prune(args.digest or ())
        out.print(f"removed {len(images)} image{'' if len(images) == 1 else 's'} from the "
                  f"image store" + (f"; kept {len(held)} a session holds" if held else ""))
        for entry, why in failed:
            out.print(f"kept {entry.digest}: {why}")
        if not args.digest:
            try:
                prune_build_storage()
                out.print("removed the build storage's images")
            except EnvironmentUnavailable as error:  # (no build user: nothing was built)
                out.print(f"kept the build storage's images: {error}")
    return EXIT_OK


def add_cache(commands: Any) -> None:
    p = command(commands, "cache", help="list or remove unpacked task environments",
                examples=["trialledger cache ls", "trialledger cache prune"])
    cache_commands = p.add_subparsers(dest="cache_command", required=True)
    ls = command(cache_commands, "cache ls", help="every unpacked environment",
                 examples=["trialledger cache ls --json"])
    _with_cache(ls)
    ls.add_argument("--json", action="store_true", help="one JSON object per entry")
    ls.set_defaults(handler=cmd_cache)
    prune = command(cache_commands, "cache prune", help="remove entries (all, or those named)",
                    examples=["trialledger cache prune sha256:9a1f"])
    _with_cache(prune)
    prune.add_argument("digest", nargs="*", help="digests (or unique prefixes) to remove")
    prune.set_defaults(handler=cmd_cache)


def cmd_setup(args: argparse.Namespace) -> int:
    """Prepare this machine for sandboxed runs: the sandbox user and the build user (as
    root), the static init, a check that bwrap can sandbox here, and (as root) which OCI
    runtime can start a range-mode container, recorded."""
    from trialledger.adapters.images.builder import BUILD_USER, create_build_user
    from trialledger.adapters.images.environment import EnvironmentUnavailable
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.identity import (
        SANDBOX_USER,
        create_sandbox_user,
        ensure_init,
        sandbox_user,
    )
    from trialledger.adapters.sandbox.idrange import ensure_filter, reserve_range
    from trialledger.adapters.sandbox.local import bwrap_problem

    try:
        if os.geteuid() == 0 and args.sandbox_uid is None:
            user, created = create_sandbox_user()
            out.print(f"sandbox user {SANDBOX_USER} (uid {user.uid}) "
                      f"{'created' if created else 'already exists'}")
            ids, reserved = reserve_range(args.subids)
            out.print(f"session slots: {ids.slots} of 65536 ids from {ids.start} "
                      f"{'reserved' if reserved else 'already reserved'} (range mode)")
        else:
            user = sandbox_user(args.sandbox_uid)
            out.print(f"sandbox uid {user.uid}")
        out.print(f"sandbox init: {ensure_init()}")
        if os.geteuid() == 0:
            out.print(f"seccomp filter: {ensure_filter()}")
            builder, made = create_build_user()
            out.print(f"build user {BUILD_USER} (uid {builder.uid}, storage "
                      f"{builder.storage}) {'created' if made else 'already exists'}")
    except (SandboxRefused, EnvironmentUnavailable) as error:
        raise Refused(str(error)) from None
    if os.geteuid() == 0 and args.sandbox_uid is None:
        from trialledger.adapters.sandbox.ociruntime import choose_runtime

        found = choose_runtime(args.runtime)
        for runtime, said in found.items():
            out.print(f"oci runtime: {said}" if said is not None
                      else f"oci runtime: {runtime} can start range-mode containers")
        chosen = next((runtime for runtime, said in found.items() if said is None), None)
        out.print(f"range mode runs on {chosen}" if chosen is not None else
                  "range mode is unavailable: no OCI runtime can start a container here; "
                  "image and rootfs sessions run in single-id mode")
    problem = bwrap_problem(user)
    if problem is not None:
        out.print(f"isolation: bwrap cannot sandbox here ({problem}); runs are refused "
                  f"unless --isolation process-group")
        return EXIT_FOUND
    out.print("isolation: bwrap")
    return EXIT_OK


def add_setup(commands: Any) -> None:
    p = command(commands, "setup", help="create the sandbox and build users (as root), "
                                         "build the sandbox init, check that bwrap can "
                                         "sandbox and which OCI runtime can start a "
                                         "range-mode container",
                examples=["sudo trialledger setup"])
    with_sandbox_uid(p)
    p.add_argument("--subids", metavar="START:COUNT",
                   help="the sandbox user's subordinate ids for range mode (COUNT a multiple "
                        "of 65536; default 64 slots from the first free start at or above "
                        "2^20); an existing range is kept")
    p.add_argument("--runtime", choices=("runc", "crun"), default=None,
                   help="the OCI runtime to check and record for range mode (default: "
                        "runc, else crun: the first that can start a container here)")
    p.set_defaults(handler=cmd_setup)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the real Codex CLI through the sample tasks, offline; show outcomes and answers."""
    from trialledger.adapters.codex.install import CodexNotFound, find_codex
    from trialledger.adapters.demo.samples import QUESTIONS, outcome_rows, run_demo
    from trialledger.adapters.sandbox.base import SandboxRefused

    try:
        codex = find_codex(args.codex_bin)
    except CodexNotFound as error:
        raise Refused(str(error)) from None

    async def go() -> list[Any]:
        return await in_store(args.db, lambda ledger: run_demo(
            ledger, codex=codex, progress=lambda name: out.print(f"running sample {name} …")))

    try:
        results = anyio.run(until_signalled, go)
    except SandboxRefused as error:
        raise Refused(str(error)) from None
    out.print(f"\n[bold]Outcomes[/bold] ({len(results)} sessions in {args.db})")
    table(["task", "attempt", "outcome", "decisions", "cause", "tokens", "reward"],
          outcome_rows(results))
    for question, sql in QUESTIONS.items():
        from trialledger.store.query import run_query

        result = anyio.run(functools.partial(run_query, args.db, sql, role=None))  # ours
        out.print(f"\n[bold]{question}[/bold]\n[dim]{' '.join(sql.split())}[/dim]")
        table(result.columns, result.rows)
    out.print(f"\nExplore: trialledger ls --db {args.db}; trialledger show --db {args.db} ID")
    return EXIT_OK


def add_demo(commands: Any) -> None:
    p = command(commands, "demo", help="run real Codex through sample tasks, offline",
                examples=["trialledger demo --db demo.db"])
    with_db(p)
    p.add_argument("--codex-bin", help="the Codex CLI (default: TRIALLEDGER_CODEX_BIN or PATH)")
    p.set_defaults(handler=cmd_demo, watched=True)
