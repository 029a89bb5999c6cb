"""`trialledger`: a thin command line over the library (SPEC §10).

Exit codes: 0 success; 1 the command ran and found something (a broken chain, a
diverging decision); 2 bad input or a refused operation (a malformed line, an illegal
transition, an unknown policy, an out-of-date database), with one line saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
from rich.console import Console

from trialledger.adapters.console import plain, printable, terminal
from trialledger.adapters.console.harbor import print_agreements
from trialledger.adapters.console.jobs import (
    print_job,
    print_job_diff,
    print_jobs,
    tokens,
    trial_printer,
)
from trialledger.adapters.console.live import progress_text as progress_text  # (tests)
from trialledger.adapters.console.live import with_live
from trialledger.adapters.console.render import out as out  # tests set cli.out's width
from trialledger.adapters.console.render import print_json, table
from trialledger.adapters.console.session import kept_files, print_outcomes, show_session
from trialledger.adapters.console.signals import Interrupted, stopper, until_signalled
from trialledger.adapters.console.tasks import warn_fields
from trialledger.core import BadEvent, IllegalTransition, TrialLedgerError, replay
from trialledger.core.machine import STATES
from trialledger.store.defaults import DEFAULT_DB, DEFAULT_TIMEOUT_S, READER_ROLE

T = TypeVar("T")

if TYPE_CHECKING:  # the store (SQLAlchemy, alembic) is imported when a command needs it,
    # so that `--help` and `replay --log` start fast
    from trialledger.store import Ledger

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT = 0, 1, 2
AGENT_NAMES = ("codex", "oracle", "nop")  # adapters.scripted.AGENTS (SPEC §15)
_tokens = tokens  # by this name tests/test_job_show.py and test_job_summary.py import it


class Refused(Exception):
    """A one-line reason to stop with exit 2."""


async def in_store(db: str, work: Callable[[Ledger], Awaitable[T]], *,
                   create: bool = True, lease_s: float | None = None) -> T:
    """`work` on the store at `db`, opened for it and closed after (`create`: build a
    missing database; read-only commands refuse one instead; `lease_s`: a lease holder's
    lease, which bounds each of its PostgreSQL calls, `engine.call_deadline`)."""
    from trialledger.store import Ledger
    from trialledger.store.engine import call_deadline
    from trialledger.store.newfile import removed_if_unused

    with removed_if_unused(db) if create else contextlib.nullcontext():  # refused: no file
        deadline = None if lease_s is None else call_deadline(lease_s)
        async with await Ledger.open(db, create=create, call_timeout_s=deadline) as ledger:
            return await work(ledger)


def on_store(db: str, work: Callable[[Ledger], Awaitable[T]], *, create: bool = True) -> T:
    """`in_store` in a fresh event loop: for a command that does only that."""
    return anyio.run(functools.partial(in_store, db, work, create=create))


def _read_log(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    from trialledger.adapters.logfile import LogUnreadable, read_jsonl

    try:
        numbered = read_jsonl(path)
    except LogUnreadable as error:
        raise Refused(str(error)) from None
    except BadEvent as error:
        raise Refused(f"{path}: {error}") from None
    return [obj for _, obj in numbered], [number for number, _ in numbered]


def _located(path: Path, lines: list[int], error: BadEvent | IllegalTransition) -> Refused:
    where = f"line {lines[error.index]}: " if error.index is not None else ""
    reason = error.reason if isinstance(error, BadEvent) else str(error)
    return Refused(f"{path}: {where}{reason}")


# --- commands ---------------------------------------------------------------------------------


def _load_policy_file(path: str | None) -> None:
    """Register the installed packages' policy versions, then run a Python file that
    registers more (`core.register_policy`)."""
    from trialledger.store.policies import load_installed_policies

    load_installed_policies()
    if path is None:
        return
    import runpy

    try:
        runpy.run_path(path)
    except OSError as error:
        raise Refused(f"--policy-file {path}: {error.strerror}") from None
    except Exception as error:  # the file's own bug: one line, never "decisions differ"
        raise Refused(f"--policy-file {path} raised {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    """Print the re-derived view of one JSONL log, or diff every stored session."""
    _load_policy_file(args.policy_file)
    if args.log:
        path = Path(args.log)
        events, lines = _read_log(path)
        try:
            view = replay(events, policy=args.policy)
        except (BadEvent, IllegalTransition) as error:
            raise _located(path, lines, error) from None
        print_json(view.model_dump(mode="json"))
        return EXIT_OK
    if not (args.all and args.diff):
        raise Refused("replay needs --log FILE, or --db URL --all --diff")
    return _replay_diff(args)


def _replay_diff(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    async def diff(ledger: Ledger) -> tuple[int, list[Any]]:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("re-deriving", total=await ledger.session_count())
            return await ledger.divergences(
                args.policy, jobs=args.jobs, policy_files=[args.policy_file] if
                args.policy_file else [], on_sessions=lambda n: progress.advance(task, n))

    count, differing = on_store(args.db, diff, create=False)
    if args.json:
        print_json([d.__dict__ for d in differing])
    else:
        table(["session_id", "seq", "recorded", "derived"],
              [(d.session_id, d.seq, d.recorded, d.derived) for d in differing])
        under = args.policy or "each session's own policy"
        out.print(f"{len(differing)} of {count} sessions differ under {under}")
    return EXIT_FOUND if differing else EXIT_OK


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Build or migrate a database to the newest schema."""
    from trialledger.store import upgrade_database
    from trialledger.store.engine import shown

    revision = anyio.run(functools.partial(upgrade_database, args.db,
                                           reader_role=args.create_readonly_role))
    out.print(f"{shown(args.db)}: schema at revision {revision}")
    if args.create_readonly_role:
        out.print(f"reader login {args.create_readonly_role}: `sql` connects as it (no other "
                  "role, read-only, its time and memory bounds on the role); its password "
                  "derives from the store URL's, so `sql --db STORE_URL` signs in as it")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """Append one session's JSONL log through the machine, all or nothing."""
    path = Path(args.file)
    events, lines = _read_log(path)
    secrets = []
    for name in args.secret_env or []:
        if name not in os.environ:
            raise Refused(f"--secret-env {name}: no such environment variable")
        secrets.append(os.environ[name])

    _check_store_file(args.db)  # a damaged file is refused, not written into
    try:
        session_id = on_store(args.db, lambda ledger: ledger.import_log(events, secrets=secrets))
    except (BadEvent, IllegalTransition) as error:
        raise _located(path, lines, error) from None
    out.print(plain(session_id))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write a session's log back as JSONL, with every field."""

    async def export(ledger: Ledger) -> list[dict[str, Any]]:
        return await ledger.export(await ledger.resolve(args.session))

    lines = on_store(args.db, export, create=False)
    for line in lines:
        sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    """Verify every session's hash chain and head."""

    report = on_store(args.db, lambda ledger: ledger.audit(), create=False)
    if report.ok:
        out.print(f"ok: {report.sessions} sessions, {report.events} events verified")
        return EXIT_OK
    print(f"trialledger: audit failed: {printable(str(report.fault))}", file=sys.stderr)
    return EXIT_FOUND


def cmd_sql(args: argparse.Namespace) -> int:
    """Run one read-only, time-limited query."""
    from trialledger.store.query import run_query

    result = anyio.run(lambda: run_query(args.db, args.query, timeout_s=args.timeout,
                                         role=args.role))
    if args.json:
        print_json(result.records())
    elif args.csv:
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(result.columns)
        writer.writerows(result.rows)
    else:
        table(result.columns, result.rows)
    return EXIT_OK


def cmd_recover(args: argparse.Namespace) -> int:
    """Close out the sessions a runner left open; `--purge-damaged`: remove the damaged
    journals kept on this machine (SPEC §8)."""
    if args.purge_damaged:
        from trialledger.adapters.journal import journal_dir
        from trialledger.adapters.journalfile import purge_damaged

        out.print(f"{purge_damaged(journal_dir())} damaged journals removed")
        if not (args.runner or args.all):
            return EXIT_OK
    if not (args.runner or args.all):
        raise Refused("recover needs --runner ID, or --all for a single-machine store")

    if args.force:
        print("trialledger: --force: recovering even sessions whose runner is alive",
              file=sys.stderr)

    from trialledger.adapters.journal import delivery

    recovered = on_store(args.db, lambda ledger: ledger.recover(  # journals delivered first
        args.runner, all_runners=args.all, force=args.force, deliver=delivery(ledger)))
    from trialledger.adapters.sandbox.folders import sweep_stale_sessions
    from trialledger.adapters.sandbox.leftovers import sweep_builds, sweep_session_cgroups

    cgroups = sweep_session_cgroups()  # (first: a cgroup's owner is known by its folder)
    swept = sweep_stale_sessions()  # this machine's folders of dead runners (grant tokens)
    builds = sweep_builds()
    for sid in recovered:
        out.print(plain(sid))
    out.print(f"{len(recovered)} sessions recovered")
    for count, what in ((swept, "stale session folders"), (cgroups, "stale session cgroups"),
                        (builds, "killed builds' leftovers")):
        if count:
            out.print(f"{count} {what} removed")
    return EXIT_OK


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


def _run_options(args: argparse.Namespace) -> Any:
    """`run`'s options (shared by `job run`): the key, grants, settings and runner."""
    from trialledger.adapters.runner import RunOptions

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
        protected_paths=_store_files(args.db),
        task_mcp_hosts=tuple(getattr(args, "task_mcp_host", None) or ()),
        **({"runner_id": args.runner_id} if args.runner_id else {}),
    )


def cmd_run(args: argparse.Namespace) -> int:
    """Run the real Codex CLI on a task in the local sandbox; print each session's outcome."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.jobs import check_inputs
    from trialledger.adapters.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.runner import SessionResult, SessionRunner
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.scripted import solve_script
    from trialledger.adapters.task import Task, TaskInvalid, require_verifier
    from trialledger.adapters.taskfiles import file_limit
    from trialledger.adapters.trial import Trial

    options = _run_options(args)
    api_key = options.api_key

    async def trial(ledger: Ledger) -> list[Any]:
        runner = SessionRunner(ledger, task, options, environment)
        if not args.trial:
            return (await Trial.fresh(ledger, task.name).run(runner)).ran
        before = await ledger.sessions(trial_id=args.trial)
        if any(s["task"] != task.name for s in before):
            raise Refused(f"--trial {args.trial} is a trial of task {before[0]['task']}, "
                          f"not {task.name}")
        ran = await Trial(ledger, args.trial).run(runner)  # as a job's trial goes on
        if ran.ran or ran.final is None:
            return ran.ran
        return [SessionResult(ran.sessions[-1]["session_id"], ran.final)]  # nothing to run

    async def go() -> list[Any]:
        if options.agent == "codex":
            await check_endpoint(args.model_base_url, api_key)  # before anything is seeded
        return await in_store(args.db, trial)

    try:
        task = require_verifier(Task.load(Path(args.task_dir),  # as Harbor, up front
                                          max_bytes=file_limit(options.overrides)))
        warn_fields([task], in_range=_range_mode(args))
        check_inputs([task], options)  # settings, grants, Codex: before anything is seeded
        if options.agent == "oracle":
            solve_script(task)  # NoSolution: refused before anything is seeded
        environment = _prepared(task, args)  # before anything is seeded (§12)
        results = anyio.run(until_signalled, go)
    except (CodexNotFound, SandboxRefused, TaskInvalid, EndpointUnreachable) as error:
        raise Refused(str(error)) from None
    print_outcomes(results, as_json=args.json)
    final = results[-1].view if results else None
    scored = (final is not None and final.outcome == "verify" and final.decision is not None
              and final.decision.reward_valid)
    return EXIT_OK if scored else EXIT_FOUND  # SPEC §10: 1 when the trial is left unscored


def _check_store_file(db: str) -> None:
    """A damaged SQLite store refused in one line (`store.intact`; loaded only here, so
    `--help` and `replay` stay clear of the database stack)."""
    from trialledger.store.intact import check_store_file

    check_store_file(db)


def _prepared(task: Any, args: argparse.Namespace) -> Any:
    """The task's environment, built and unpacked into the cache (EnvironmentUnavailable:
    one line naming what is missing; nothing seeded)."""
    from trialledger.adapters.environment import HOST, prepare, with_limits
    from trialledger.adapters.sandbox.identity import sandbox_user

    if task.source is None:
        return HOST
    owner = sandbox_user(args.sandbox_uid).uid if os.geteuid() == 0 else None
    return prepare(with_limits(task.source, task.limits), _cache(args), owner=owner,
                   engine=args.engine, pull=args.pull, force_build=args.force_build)


def _runtime(asked: str | None) -> str | None:
    """`--runtime`, refused (one line) where `setup` found it cannot start a container;
    without it, the runtime `setup` found able (None: none can, and range mode is
    unavailable: `_range_mode` says why)."""
    from trialledger.adapters.sandbox.ociruntime import recorded_problem
    from trialledger.adapters.sandbox.runc import default_runtime

    if asked is None:
        return default_runtime()
    if asked != "bwrap" and (problem := recorded_problem(asked)) is not None:
        raise Refused(f"--runtime {asked}: {problem}")
    return asked


def _range_mode(args: argparse.Namespace) -> bool:
    """Whether image and rootfs sessions run in range mode (docs/SPEC.md §15, §16): a root
    runner after `setup`, the default sandbox user, bwrap, a runtime that can start a
    container here (else single-id mode, said once naming why)."""
    from trialledger.adapters.sandbox.idrange import range_problem

    return (getattr(args, "sandbox_uid", None) is None
            and getattr(args, "isolation", "bwrap") == "bwrap"
            and range_problem(getattr(args, "runtime", None)) is None)


def _cache(args: argparse.Namespace) -> Any:
    """The environment cache sessions read: plain entries for range mode (a root runner
    after `setup`, the default sandbox user, bwrap), else rootless ones (single-id mode)."""
    from trialledger.adapters.environment import Cache
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.sandbox.idrange import check_plain_folder

    plain = _range_mode(args)
    cache = Cache(args.cache_dir, plain=plain)
    if plain:
        try:
            check_plain_folder(cache.folder)
        except SandboxRefused as error:
            raise Refused(str(error)) from None
    return cache


def cmd_cache(args: argparse.Namespace) -> int:
    """List or remove unpacked task environments (docs/SPEC.md §12)."""
    from trialledger.adapters.environment import Cache

    cache = Cache(args.cache_dir)
    if args.cache_command == "ls":
        entries = cache.entries()
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
    return EXIT_OK


def cmd_job_run(args: argparse.Namespace) -> int:
    """Create or resume a job and work its queue here; one line per finished trial, then
    the summary. Exit 0 when every trial ended with a final decision, 1 when one did not."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.jobform import derived_name, job_form, resume_command
    from trialledger.adapters.jobs import JobRunner, check_inputs, job_config, load_tasks
    from trialledger.adapters.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.task import TaskInvalid
    from trialledger.adapters.taskfiles import file_limit

    options = _run_options(args)
    said = trial_printer(args.json)
    holder: list[Any] = []
    form = job_form(args.words, path=args.path, job_name=args.job_name)
    name = form.name or derived_name(form.paths, job_config(options, args.k,
                                                            max(1, options.max_attempts)))

    async def job(ledger: Ledger) -> dict[str, Any]:
        runner = JobRunner(
            ledger, name, tasks, options, k=args.k, add=args.add,
            datasets=selection.datasets, skipped=selection.skipped, concurrency=args.n,
            lease_s=args.lease_s, cache=_cache(args), engine=args.engine,
            pull=args.pull, force_build=args.force_build, owner=_owner(args), on_trial=said)
        holder.append(runner)
        await with_live(ledger, name, not args.json, runner.run, waits=runner.waits)
        return await _job_summary(ledger, name)

    async def go() -> dict[str, Any]:
        if options.agent == "codex":
            await check_endpoint(args.model_base_url, options.api_key)
        return await in_store(args.db, job, lease_s=args.lease_s)

    try:
        selection = load_tasks(form.paths, args.include or (),
                               args.exclude or (), max_bytes=file_limit(options.overrides))
        tasks = selection.tasks
        warn_fields(tasks, selection.skipped, in_range=_range_mode(args))
        check_inputs(tasks, options)  # before the job exists: a refusal leaves none behind
        if form.name is None:
            print(f"trialledger: job {name} (resume it with: "
                  f"{resume_command(args.argv, name)})", file=sys.stderr, flush=True)
        summary = anyio.run(lambda: until_signalled(go, stop=stopper(holder, args.grace),
                                                    grace_s=args.grace))
    except (CodexNotFound, SandboxRefused, TaskInvalid, EndpointUnreachable) as error:
        raise Refused(str(error)) from None
    if not args.json:  # --json: the trials' lines only (`job show --json` has the summary)
        print_job(summary, as_json=False)
    return EXIT_OK if _all_decided(summary) else EXIT_FOUND


def cmd_worker(args: argparse.Namespace) -> int:
    """Work queued trials of any job (or `--job`) from this machine until none is left."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.jobs import check_inputs, worker_runner
    from trialledger.adapters.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.task import TaskInvalid
    from trialledger.store.jobs import Jobs

    options = _run_options(args)  # model, settings and attempts: the job's (worker_runner)
    said = trial_printer(args.json)
    holder: list[Any] = []

    async def work(ledger: Ledger) -> int:
        names = [args.job] if args.job else await Jobs(ledger).pending()
        for name in names:
            runner = await worker_runner(
                ledger, name, options, agent=args.agent, concurrency=args.n,
                lease_s=args.lease_s,
                cache=_cache(args), engine=args.engine, pull=args.pull,
                force_build=args.force_build, owner=_owner(args), on_trial=said)
            check_inputs(runner.tasks, runner.options)  # e.g. no Codex here: one line
            holder[:] = [runner]
            await with_live(ledger, name, not args.json,
                            functools.partial(runner.run, define=False),
                            waits=runner.waits)
        return len(names)

    async def go() -> int:
        if args.model_base_url and args.agent in (None, "codex"):
            await check_endpoint(args.model_base_url, options.api_key)
        return await in_store(args.db, work, create=False, lease_s=args.lease_s)

    try:
        worked = anyio.run(lambda: until_signalled(go, stop=stopper(holder, args.grace),
                                                   grace_s=args.grace))
    except (CodexNotFound, SandboxRefused, TaskInvalid, EndpointUnreachable) as error:
        raise Refused(str(error)) from None
    print(f"trialledger: worker done: {worked} job{'s' * (worked != 1)} without queued "
          f"trials left", file=sys.stderr)
    return EXIT_OK


def _owner(args: argparse.Namespace) -> int | None:
    """The uid cache entries are made for: the sandbox user when we are root."""
    from trialledger.adapters.sandbox.identity import sandbox_user

    return sandbox_user(args.sandbox_uid).uid if os.geteuid() == 0 else None


async def _job_summary(ledger: Ledger, name: str) -> dict[str, Any]:
    from trialledger.store.jobs import Jobs

    return await Jobs(ledger).summary(name)


def _all_decided(summary: Mapping[str, Any]) -> bool:
    """Every trial ended scored or with a final decision (none unscored, none failed)."""
    return all(t["scored"] == 1 or (t["state"] == "done" and t["outcome"] == "verify")
               for t in summary["trials"]) and not summary["environment_failed"]


def cmd_job_diff(args: argparse.Namespace) -> int:
    """Two jobs side by side, task by task and overall: mean, passed, pass@k, tokens."""
    from trialledger.adapters.view.diff import job_diff

    async def both(ledger: Ledger) -> tuple[dict[str, Any], dict[str, Any]]:
        return await _job_summary(ledger, args.a), await _job_summary(ledger, args.b)

    sa, sb = on_store(args.db, both, create=False)
    result = job_diff(args.a, sa, args.b, sb)
    print_job_diff(result, as_json=args.json)
    return EXIT_OK


def cmd_job_show(args: argparse.Namespace) -> int:
    """A job's summary from the store: per task and overall, who holds its open trials, its
    skipped and failed tasks; each trial with --trials (and in --json)."""

    summary = on_store(args.db, lambda ledger: _job_summary(ledger, args.name), create=False)
    print_job(summary, as_json=args.json, trials=args.trials)
    return EXIT_OK


def cmd_job_ls(args: argparse.Namespace) -> int:
    """Every job with its trials by queue state."""
    from trialledger.store.jobs import Jobs

    rows = on_store(args.db, lambda ledger: Jobs(ledger).names(), create=False)
    print_jobs(rows, as_json=args.json)
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """List sessions with state, outcome, rule, cause and tokens."""
    _check_store_file(args.db)  # header and schema; `audit` reads it whole
    rows = on_store(args.db, lambda ledger: ledger.listing(
        task=args.task, state=args.state, cause=args.cause), create=False)
    if args.json:
        print_json(rows)
        return EXIT_OK
    columns = ["session_id", "task", "attempt", "state", "outcome", "rule", "cause_kind",
               "total_tokens"]
    table(columns, [[r[c] for c in columns] for r in rows])
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    """A session's timeline with durations, and each decision explained."""

    async def view_of(ledger: Ledger) -> Any:
        return await ledger.view(await ledger.resolve(args.session))

    _check_store_file(args.db)
    view = on_store(args.db, view_of, create=False)
    if args.atif:
        from trialledger.core.atif import trajectory

        print_json(trajectory(view))
        return EXIT_OK
    if args.json:
        print_json(view.model_dump(mode="json"))
        return EXIT_OK
    show_session(view)
    return EXIT_OK


def cmd_artifacts(args: argparse.Namespace) -> int:
    """A session's kept files (SPEC §15): listed with their folder, one printed, or copied
    (`--out`); a file is given back only when the event lists it, it is no link and its
    bytes still have the recorded sha256."""
    from trialledger.adapters import artifacts

    async def view_of(ledger: Ledger) -> Any:
        return await ledger.view(await ledger.resolve(args.session))

    view = on_store(args.db, view_of, create=False)
    kept = kept_files(view)
    chosen = [artifacts.listed(kept, args.path)] if args.path else kept
    folder = artifacts.session_folder(view.events[0].data.settings.sandbox_logs_dir,
                                      view.session_id)
    if not args.path and not args.out:
        table(["path", "size", "sha256"], [[e.path, e.size, e.sha256] for e in kept])
    if not artifacts.on_this_machine(folder, view.session_id):
        print(f"trialledger: the artifact folder is not on this machine: it would be "
              f"{printable(str(folder))} (on the machine of runner "
              f"{printable(view.events[0].data.runner_id)})", file=sys.stderr)
        return EXIT_FOUND
    if args.out:
        for written in artifacts.copy_kept(folder, chosen, args.out):
            out.print(plain(str(written)))
    elif args.path:
        data = artifacts.read_kept(folder, chosen[0])
        if sys.stdout.isatty():  # the agent's bytes: no escape of theirs reaches a terminal
            sys.stdout.write(printable(data.decode("utf-8", errors="replace")))
        elif (raw := getattr(sys.stdout, "buffer", None)) is not None:
            raw.write(data)
            raw.flush()
        else:  # a text stream (a test's, say)
            sys.stdout.write(data.decode("utf-8", errors="replace"))
    else:
        out.print(plain(f"folder: {folder}"))
    return EXIT_OK


def cmd_view(args: argparse.Namespace) -> int:
    """A read-only web view of the store, served (loopback by default) or exported."""
    if args.job is not None and args.export is None:
        raise Refused("--job chooses the pages of an export: give --export DIR with it")
    if args.allowed_host and args.export is not None:
        raise Refused("--allowed-host names who may ask a served view: an export serves nothing")
    if args.export is None:
        from trialledger.adapters.view.server import serve

        anyio.run(lambda: serve(
            args.db, host=args.host, port=args.port, allowed=args.allowed_host,
            say=lambda line: print(printable(line), flush=True),
            warn=lambda line: print(printable(line), file=sys.stderr, flush=True)))
        return EXIT_OK
    from trialledger.adapters.view.export import export

    done = anyio.run(lambda: export(args.db, args.export, job=args.job))
    out.print(plain(f"wrote {done.jobs} job(s), {done.trials} trial(s) and {done.sessions} "
                    f"session(s): open {done.index}"))
    return EXIT_OK


def _store_files(db: str) -> list[Path]:
    """The store's own file (a SQLite path), which no sandbox may mount."""
    return [] if "://" in db and not db.startswith("sqlite") else [
        Path(db.split(":///", 1)[-1]).resolve()]


def cmd_setup(args: argparse.Namespace) -> int:
    """Prepare this machine for sandboxed runs: the sandbox user and the build user (as
    root), the static init, a check that bwrap can sandbox here, and (as root) which OCI
    runtime can start a range-mode container, recorded."""
    from trialledger.adapters.builder import BUILD_USER, create_build_user
    from trialledger.adapters.environment import EnvironmentUnavailable
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


def cmd_import_harbor(args: argparse.Namespace) -> int:
    """Import a Harbor job folder; print how each trial's verdict compares with ours."""
    from trialledger.adapters.harbor import import_job

    job = Path(args.job_dir)
    if not job.is_dir():
        raise Refused(f"{job}: not a folder")

    agreements = on_store(args.db, lambda ledger: import_job(ledger, job))
    print_agreements(agreements, as_json=args.json)
    return EXIT_FOUND if any(not a.agrees for a in agreements) else EXIT_OK


def cmd_export_harbor(args: argparse.Namespace) -> int:
    """Write a job as Harbor 0.26's job folder (SPEC §18)."""
    from trialledger.adapters.harborexport import export_job

    done = on_store(args.db, lambda ledger: export_job(ledger, args.job, Path(args.dir)),
                    create=False)
    out.print(plain(f"wrote {done.trials} trial(s) and {done.earlier_attempts} earlier "
                    f"attempt(s) to {done.folder}"))
    if done.files_missing:
        print(f"trialledger: {done.files_missing} kept file(s) are not on this machine (or "
              "changed since) and were left out", file=sys.stderr)
    return EXIT_OK


# --- the parser -------------------------------------------------------------------------------


def _with_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB,
                        help="SQLAlchemy URL (postgresql:// uses asyncpg) or a SQLite file path "
                             f"(default {DEFAULT_DB})")


def _with_sandbox_uid(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox-uid", type=int, metavar="UID",
                   help="when run as root: the unprivileged uid the agent runs as "
                        "(default: the trialledger-sandbox user that `setup` creates)")


def _with_lease(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lease-s", type=_seconds, default=60.0,
                   help="a held trial's lease, renewed every third of it (default 60)")
    p.add_argument("--grace", type=_grace, default=30.0,
                   help="on SIGINT/SIGTERM: seconds running trials get before they are "
                        "cancelled (default 30)")


def _with_run_options(p: argparse.ArgumentParser, *, json_help: str, of_job: bool = True
                      ) -> None:
    """What `run`, `job run` and `worker` share: the store, the endpoint, grants, the
    sandbox and the environment cache; and (`of_job`, not for a worker, which takes them
    from the job) the model, the settings and the attempts."""
    _with_db(p)
    p.add_argument("-a", "--agent", choices=AGENT_NAMES, action=_Once,
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
        p.add_argument("-m", "--model", action=_Once,
                       help="the model name to ask for (needed with --agent codex)")
        p.add_argument("--max-attempts", type=_positive, default=1,
                       help="sessions per trial at most: a retry decision runs another, up to N")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="a setting (VALUE parsed as JSON, else a string); repeatable")
    p.add_argument("--codex-bin", help="the Codex CLI (default: TRIALLEDGER_CODEX_BIN or PATH)")
    p.add_argument("--runner-id", help="this runner's id (default: host-pid)")
    p.add_argument("--json", action="store_true", help=json_help)
    _with_sandbox_uid(p)
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


class _Once(argparse.Action):
    """An option with two spellings (Harbor's `-a`, ours `--agent`): given twice, it must
    say the same thing both times (else one line, exit 2)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given: dict[str, tuple[str, Any]] = namespace.__dict__.setdefault("_once", {})
        if self.dest in given and given[self.dest][1] != values:
            said, before = given[self.dest]
            parser.error(f"{said} {before} and {option_string} {values} disagree (give one)")
        given[self.dest] = (str(option_string), values)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2 (SPEC §10), like every refusal."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("trialledger").strip()
        where = f"{command}: " if command else ""
        self.exit(EXIT_BAD_INPUT, f"trialledger: {where}{message} (see --help)\n")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def _grace(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, not {text}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trialledger")
    except PackageNotFoundError:
        return "unknown"

EXAMPLES = {  # each subcommand's --help ends with these
    "replay": ["trialledger replay --log session.jsonl",
               "trialledger replay --db trials.db --all --diff --policy v3"],
    "db": ["trialledger db upgrade --db postgresql://trials@db.internal/trials"],
    "db upgrade": ["trialledger db upgrade --db trials.db",
                   "trialledger db upgrade --db postgresql://admin@db/trials "
                   "--create-readonly-role"],
    "import": ["trialledger import --db trials.db session.jsonl --secret-env OPENAI_API_KEY"],
    "export": ["trialledger export --db trials.db --session 3f2a > session.jsonl"],
    "audit": ["trialledger audit --db trials.db"],
    "sql": ["trialledger sql --db trials.db \"SELECT outcome, COUNT(*) FROM sessions "
            "GROUP BY outcome\"",
            "trialledger sql --db trials.db --csv \"SELECT * FROM outcomes\" > outcomes.csv"],
    "run": ["trialledger run tasks/hello --model-base-url http://127.0.0.1:8000/v1 "
            "--model gpt-5.1-codex --max-attempts 3"],
    "job": ["trialledger job run nightly datasets/tb -k 3 -n 8 "
            "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex",
            "trialledger job show nightly"],
    "job run": ["trialledger job run nightly datasets/tb -k 3 -n 8 --max-attempts 3 "
                "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex "
                "--exclude 'slow-*'",
                "trialledger job run -p datasets/tb -a oracle",
                "trialledger job run -p datasets/tb -a codex -m gpt-5.1-codex "
                "--model-base-url http://127.0.0.1:8000/v1 --job-name nightly"],
    "job show": ["trialledger job show nightly --json"],
    "job ls": ["trialledger job ls --db postgresql://trials@db.internal/trials"],
    "job diff": ["trialledger job diff gpt-baseline gpt-new-prompt --json"],
    "worker": ["trialledger worker --db postgresql://trials@db.internal/trials --job nightly "
               "-n 4 --model-base-url http://127.0.0.1:8000/v1"],
    "cache": ["trialledger cache ls", "trialledger cache prune"],
    "cache ls": ["trialledger cache ls --json"],
    "cache prune": ["trialledger cache prune sha256:9a1f"],
    "setup": ["sudo trialledger setup"],
    "ls": ["trialledger ls --db trials.db --state graded",
           "trialledger ls --cause model_endpoint --json"],
    "show": ["trialledger show 3f2a", "trialledger show 3f2a --atif > trajectory.json"],
    "artifacts": ["trialledger artifacts 3f2a",
                  "trialledger artifacts 3f2a verifier/test-stdout.txt",
                  "trialledger artifacts 3f2a --out kept/"],
    "view": ["trialledger view --db trials.db", "trialledger view --port 9000",
             "trialledger view --host 0.0.0.0 --allowed-host box.lan",
             "trialledger view --export site/ --job nightly"],
    "demo": ["trialledger demo --db demo.db"],
    "import-harbor": ["trialledger import-harbor --db trials.db jobs/2026-10-20__14-03-05"],
    "export-harbor": ["trialledger export-harbor nightly jobs/nightly",
                      "trialledger export-harbor --db postgresql://trials@db/trials nightly out/"],
    "recover": ["trialledger recover --db trials.db --runner build-7-41233",
                "trialledger recover --db trials.db --all",
                "trialledger recover --purge-damaged"],
}


def _command(group: Any, path: str, *, help: str) -> argparse.ArgumentParser:
    """The subcommand `path` of `group`: its --help opens with what it does and ends with
    examples."""
    parser: argparse.ArgumentParser = group.add_parser(
        path.split()[-1], help=help, description=help[0].upper() + help[1:] + ".",
        epilog="examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[path]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per SPEC §10 command."""
    parser = _Parser(
        prog="trialledger", description="Record and judge sandboxed coding-agent trials.",
        epilog="examples:\n  trialledger demo\n  trialledger run tasks/hello "
               "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex\n"
               "  trialledger ls\n\nEach command's --help has more.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trialledger {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = _command(commands, "replay", help="re-derive outcomes from a log or a whole store")
    p.add_argument("--log", help="a session's JSONL event log")
    _with_db(p)
    p.add_argument("--all", action="store_true", help="every session in --db")
    p.add_argument("--diff", action="store_true", help="list sessions whose decisions differ")
    p.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, metavar="N",
                   help="--all: processes that re-derive in parallel (default: the core count, "
                        f"{os.cpu_count() or 1} here); the output is the same for any N")
    p.add_argument("--policy", help="decision policy version (default: each session's own, "
                                    "as its seed names it)")
    p.add_argument("--policy-file", metavar="FILE.py",
                   help="a Python file that registers more policy versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_replay)

    p = _command(commands, "db", help="database maintenance")
    db_commands = p.add_subparsers(dest="db_command", required=True)
    up = _command(db_commands, "db upgrade", help="build or migrate a database")
    _with_db(up)
    up.add_argument("--create-readonly-role", metavar="NAME", nargs="?", const=READER_ROLE,
                    help=f"PostgreSQL: also create a role that can only read the store "
                         f"(default name {READER_ROLE}); `sql` connects as it")
    up.set_defaults(handler=cmd_db_upgrade)

    p = _command(commands, "import", help="append one session's JSONL log")
    _with_db(p)
    p.add_argument("file", help="the session's JSONL log")
    p.add_argument("--secret-env", action="append", metavar="NAME",
                   help="scrub the value of this environment variable (repeatable)")
    p.set_defaults(handler=cmd_import)

    p = _command(commands, "export", help="write a session's log as JSONL")
    _with_db(p)
    p.add_argument("--session", required=True,
                   help="the session id, or a prefix only it starts with")
    p.set_defaults(handler=cmd_export)

    p = _command(commands, "audit", help="verify every hash chain and head")
    _with_db(p)
    p.set_defaults(handler=cmd_audit)

    p = _command(commands, "sql", help="run one read-only, time-limited query")
    _with_db(p)
    p.add_argument("query", help="one SQL statement (SELECT …)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="rows as JSON objects")
    shape.add_argument("--csv", action="store_true", help="rows as CSV with a header")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before the query is stopped (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--role", default=READER_ROLE,
                   help=f"PostgreSQL: the reader login the query connects as (default "
                        f"{READER_ROLE}; `db upgrade --create-readonly-role` makes it)")
    p.set_defaults(handler=cmd_sql)

    p = _command(commands, "run", help="run the real Codex CLI on a task in the local sandbox")
    p.add_argument("task_dir", help="instruction.md, task.toml, workspace/, tests/test.sh")
    p.add_argument("--trial", metavar="ID",
                   help="run (or continue) this trial: its sessions a crashed runner left "
                        "open are recovered and its next attempt runs, up to --max-attempts")
    _with_run_options(p, json_help="one JSON object per session (outcome, rule, cause, "
                                   "rewards, tokens)")
    p.set_defaults(handler=cmd_run)

    p = _command(commands, "job", help="run a benchmark: tasks × k trials, resumable")
    job_commands = p.add_subparsers(dest="job_command", required=True)
    jr = _command(job_commands, "job run", help="create or resume a job and work its queue here")
    jr.add_argument("words", nargs="*", metavar="[NAME] TASK_OR_DATASET",
                    help="the job's name (its identity in the store; a task or dataset folder "
                         "is never read as one), then task folders, or folders whose "
                         "subfolders are tasks")
    jr.add_argument("-p", "--path", metavar="DATASET",
                    help="Harbor's form: the task or dataset folder (instead of "
                         "TASK_OR_DATASET)")
    jr.add_argument("--job-name", metavar="NAME",
                    help="Harbor's form: the job's name (instead of NAME; default: the "
                         "dataset folder's name and 8 hex digits of the configuration's "
                         "hash, printed with the command that resumes the job)")
    jr.add_argument("-k", type=_positive, default=1, help="trials per task (default 1)")
    jr.add_argument("-n", type=_positive, default=1, help="sessions at once (default 1)")
    jr.add_argument("--include", action="append", metavar="GLOB", help="task names to run")
    jr.add_argument("--exclude", action="append", metavar="GLOB", help="task names to skip")
    jr.add_argument("--add", action="store_true",
                    help="resuming: add the tasks named here that the job does not have yet "
                         "(without it, other task names are refused)")
    _with_lease(jr)
    _with_run_options(jr, json_help="one JSON object per finished trial")
    jr.set_defaults(handler=cmd_job_run)
    js = _command(job_commands, "job show", help="a job's summary: per task, trials with --json")
    js.add_argument("name")
    _with_db(js)
    js.add_argument("--json", action="store_true", help="tasks, trials and failures as JSON")
    js.add_argument("--trials", action="store_true",
                    help="also one line per trial: how it ended, its reward, its duration")
    js.set_defaults(handler=cmd_job_show)
    jd = _command(job_commands, "job diff", help="two jobs side by side: per task and overall")
    jd.add_argument("a", help="the job compared against")
    jd.add_argument("b", help="the job compared (differences are B − A)")
    _with_db(jd)
    jd.add_argument("--json", action="store_true", help="the comparison as one JSON document")
    jd.set_defaults(handler=cmd_job_diff)
    p = _command(commands, "worker", help="work queued trials of jobs (any machine; "
                                           "PostgreSQL for several)")
    p.add_argument("--job", help="only this job (default: every job with queued trials)")
    p.add_argument("-n", type=_positive, default=1, help="sessions at once (default 1)")
    _with_lease(p)
    # The model, settings and attempts are the job's own; the endpoint and secrets ours.
    _with_run_options(p, json_help="one JSON object per finished trial", of_job=False)
    p.set_defaults(handler=cmd_worker)

    jl = _command(job_commands, "job ls", help="every job with its trials by state")
    _with_db(jl)
    jl.add_argument("--json", action="store_true", help="one JSON object per job")
    jl.set_defaults(handler=cmd_job_ls)

    p = _command(commands, "cache", help="list or remove unpacked task environments")
    cache_commands = p.add_subparsers(dest="cache_command", required=True)
    ls = _command(cache_commands, "cache ls", help="every unpacked environment")
    _with_cache(ls)
    ls.add_argument("--json", action="store_true", help="one JSON object per entry")
    ls.set_defaults(handler=cmd_cache)
    prune = _command(cache_commands, "cache prune", help="remove entries (all, or those named)")
    _with_cache(prune)
    prune.add_argument("digest", nargs="*", help="digests (or unique prefixes) to remove")
    prune.set_defaults(handler=cmd_cache)

    p = _command(commands, "setup", help="create the sandbox and build users (as root), "
                                          "build the sandbox init, check that bwrap can "
                                          "sandbox and which OCI runtime can start a "
                                          "range-mode container")
    _with_sandbox_uid(p)
    p.add_argument("--subids", metavar="START:COUNT",
                   help="the sandbox user's subordinate ids for range mode (COUNT a multiple "
                        "of 65536; default 64 slots from the first free start at or above "
                        "2^20); an existing range is kept")
    p.add_argument("--runtime", choices=("runc", "crun"), default=None,
                   help="the OCI runtime to check and record for range mode (default: "
                        "runc, else crun: the first that can start a container here)")
    p.set_defaults(handler=cmd_setup)

    p = _command(commands, "ls", help="list sessions with state, outcome and tokens")
    _with_db(p)
    p.add_argument("--task", help="only this task")
    p.add_argument("--state", choices=STATES, help="only this state")
    p.add_argument("--cause", help="only this cause kind (model_endpoint, …)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_ls)

    p = _command(commands, "show", help="a session's timeline and decisions explained")
    _with_db(p)
    p.add_argument("session", help="the session id, or a prefix only it starts with")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="the whole view as JSON")
    shape.add_argument("--atif", action="store_true",
                       help="the session as an ATIF trajectory (Harbor's trajectory.json)")
    p.set_defaults(handler=cmd_show)

    p = _command(commands, "artifacts", help="list, print or copy the files a session kept")
    _with_db(p)
    p.add_argument("session", help="the session id, or a prefix only it starts with")
    p.add_argument("path", nargs="?", help="one kept file, as listed (verifier/…): printed")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="copy the files (or PATH) under DIR instead, checked as printing is")
    p.set_defaults(handler=cmd_artifacts)

    p = _command(commands, "view", help="a read-only web view of jobs, trials and sessions")
    _with_db(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests for this host name or address (repeatable; "
                   "loopback's names and the bound address are always answered, others get "
                   "421)")
    p.add_argument("--export", type=Path, metavar="DIR",
                   help="write the pages as static files under DIR instead of serving them")
    p.add_argument("--job", help="with --export: only this job's pages")
    p.set_defaults(handler=cmd_view)

    p = _command(commands, "demo", help="run real Codex through sample tasks, offline")
    _with_db(p)
    p.add_argument("--codex-bin", help="the Codex CLI (default: TRIALLEDGER_CODEX_BIN or PATH)")
    p.set_defaults(handler=cmd_demo)

    p = _command(commands, "import-harbor", help="import a Harbor job folder, one session "
                                                  "per trial, and compare verdicts")
    _with_db(p)
    p.add_argument("job_dir", help="a Harbor job folder (jobs/<job_name>)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_import_harbor)

    p = _command(commands, "export-harbor", help="write a job as Harbor 0.26's job folder, "
                                                  "an ATIF trajectory per trial")
    _with_db(p)
    p.add_argument("job", help="the job's name")
    p.add_argument("dir", help="the folder to write (absent or empty)")
    p.set_defaults(handler=cmd_export_harbor)

    p = _command(commands, "recover", help="close out sessions a runner left open")
    _with_db(p)
    p.add_argument("--runner", help="the runner id whose sessions to recover")
    p.add_argument("--all", action="store_true",
                   help="every runner whose heartbeat is not fresh (a single-machine store)")
    p.add_argument("--force", action="store_true",
                   help="also sessions of runners that still beat (they may be running)")
    p.add_argument("--purge-damaged", action="store_true",
                   help="remove the damaged journals this machine kept (*.jsonl.damaged)")
    p.set_defaults(handler=cmd_recover)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trialledger` console script."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (`job run`'s resume command)
    if args.handler not in (cmd_run, cmd_job_run, cmd_worker, cmd_demo):
        return _handle(args)
    with terminal.watched():  # a terminal that goes away ends no run with sessions open
        return _handle(args)


def _handle(args: argparse.Namespace) -> int:
    """Run the command; a refusal or an interruption is one line on stderr and its code."""
    handler: Callable[[argparse.Namespace], int | Awaitable[int]] = args.handler
    try:
        code = handler(args)
    except Interrupted as error:
        print(f"trialledger: interrupted by {error}; open sessions were closed cancelled",
              file=sys.stderr)
        return 128 + error.signum
    except KeyboardInterrupt:  # before a command could take the signal itself
        print("trialledger: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Refused as error:  # (a reason may quote a task's or an agent's text)
        print(f"trialledger: {printable(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrialLedgerError as error:
        print(f"trialledger: {printable(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `trialledger export … | head`: the reader left, quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as error:
        from trialledger.store.ledger import disk_full

        print(f"trialledger: {disk_full(getattr(args, 'db', ''), error) or error}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    assert isinstance(code, int)
    return code


def entry() -> int:
    """The `trialledger` command: `main` in a process whose garbage collector is set for
    appending at volume (`store.collector`; a library call of `main` leaves it as is)."""
    from trialledger.store.collector import tune_collector

    tune_collector()
    return main()


if __name__ == "__main__":
    sys.exit(entry())
