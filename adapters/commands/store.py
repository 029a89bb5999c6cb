"""The commands on the store and its sessions: `replay`, `db upgrade`, `import`, `export`,
`audit`, `sql`, `ls`, `show`, `artifacts` and `recover` — each one's parser beside its
handler."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console

from trialledger.adapters.commands.common import (
    EXIT_FOUND,
    EXIT_OK,
    Refused,
    check_store_file,
    command,
    on_store,
    positive,
    with_db,
)
from trialledger.adapters.console import plain, printable
from trialledger.adapters.console.render import out, print_json, table
from trialledger.adapters.console.session import kept_files, show_session
from trialledger.core import BadEvent, IllegalTransition, replay
from trialledger.core.machine import STATES
from trialledger.store.defaults import DEFAULT_TIMEOUT_S, READER_ROLE

if TYPE_CHECKING:
    from trialledger.store import Ledger


def _read_log(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    from trialledger.adapters.session.logfile import LogUnreadable, read_jsonl

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


def add_replay(commands: Any) -> None:
    p = command(commands, "replay", help="re-derive outcomes from a log or a whole store",
                examples=["trialledger replay --log session.jsonl",
                          "trialledger replay --db trials.db --all --diff --policy v3"])
    p.add_argument("--log", help="a session's JSONL event log")
    with_db(p)
    p.add_argument("--all", action="store_true", help="every session in --db")
    p.add_argument("--diff", action="store_true", help="list sessions whose decisions differ")
    p.add_argument("--jobs", type=positive, default=os.cpu_count() or 1, metavar="N",
                   help="--all: processes that re-derive in parallel (default: the core count, "
                        f"{os.cpu_count() or 1} here); the output is the same for any N")
    p.add_argument("--policy", help="decision policy version (default: each session's own, "
                                    "as its seed names it)")
    p.add_argument("--policy-file", metavar="FILE.py",
                   help="a Python file that registers more policy versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_replay)


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


def add_db(commands: Any) -> None:
    p = command(commands, "db", help="database maintenance", examples=[
        "trialledger db upgrade --db postgresql://trials@db.internal/trials"])
    db_commands = p.add_subparsers(dest="db_command", required=True)
    up = command(db_commands, "db upgrade", help="build or migrate a database", examples=[
        "trialledger db upgrade --db trials.db",
        "trialledger db upgrade --db postgresql://admin@db/trials --create-readonly-role"])
    with_db(up)
    up.add_argument("--create-readonly-role", metavar="NAME", nargs="?", const=READER_ROLE,
                    help=f"PostgreSQL: also create a role that can only read the store "
                         f"(default name {READER_ROLE}); `sql` connects as it")
    up.set_defaults(handler=cmd_db_upgrade)


def cmd_import(args: argparse.Namespace) -> int:
    """Append one session's JSONL log through the machine, all or nothing."""
    path = Path(args.file)
    events, lines = _read_log(path)
    secrets = []
    for name in args.secret_env or []:
        if name not in os.environ:
            raise Refused(f"--secret-env {name}: no such environment variable")
        secrets.append(os.environ[name])

    check_store_file(args.db)  # a damaged file is refused, not written into
    try:
        session_id = on_store(args.db, lambda ledger: ledger.import_log(events, secrets=secrets))
    except (BadEvent, IllegalTransition) as error:
        raise _located(path, lines, error) from None
    out.print(plain(session_id))
    return EXIT_OK


def add_import(commands: Any) -> None:
    p = command(commands, "import", help="append one session's JSONL log", examples=[
        "trialledger import --db trials.db session.jsonl --secret-env OPENAI_API_KEY"])
    with_db(p)
    p.add_argument("file", help="the session's JSONL log")
    p.add_argument("--secret-env", action="append", metavar="NAME",
                   help="scrub the value of this environment variable (repeatable)")
    p.set_defaults(handler=cmd_import)


def cmd_export(args: argparse.Namespace) -> int:
    """Write a session's log back as JSONL, with every field."""

    async def export(ledger: Ledger) -> list[dict[str, Any]]:
        return await ledger.export(await ledger.resolve(args.session))

    lines = on_store(args.db, export, create=False)
    for line in lines:
        sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
    return EXIT_OK


def add_export(commands: Any) -> None:
    p = command(commands, "export", help="write a session's log as JSONL", examples=[
        "trialledger export --db trials.db --session 3f2a > session.jsonl"])
    with_db(p)
    p.add_argument("--session", required=True,
                   help="the session id, or a prefix only it starts with")
    p.set_defaults(handler=cmd_export)


def cmd_audit(args: argparse.Namespace) -> int:
    """Verify every session's hash chain and head."""

    report = on_store(args.db, lambda ledger: ledger.audit(), create=False)
    if report.ok:
        out.print(f"ok: {report.sessions} sessions, {report.events} events verified")
        return EXIT_OK
    print(f"trialledger: audit failed: {printable(str(report.fault))}", file=sys.stderr)
    return EXIT_FOUND


def add_audit(commands: Any) -> None:
    p = command(commands, "audit", help="verify every hash chain and head",
                examples=["trialledger audit --db trials.db"])
    with_db(p)
    p.set_defaults(handler=cmd_audit)


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


def add_sql(commands: Any) -> None:
    p = command(commands, "sql", help="run one read-only, time-limited query", examples=[
        "trialledger sql --db trials.db \"SELECT outcome, COUNT(*) FROM sessions "
        "GROUP BY outcome\"",
        "trialledger sql --db trials.db --csv \"SELECT * FROM outcomes\" > outcomes.csv"])
    with_db(p)
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


def cmd_ls(args: argparse.Namespace) -> int:
    """List sessions with state, outcome, rule, cause and tokens."""
    check_store_file(args.db)  # header and schema; `audit` reads it whole
    rows = on_store(args.db, lambda ledger: ledger.listing(
        task=args.task, state=args.state, cause=args.cause), create=False)
    if args.json:
        print_json(rows)
        return EXIT_OK
    columns = ["session_id", "task", "attempt", "state", "outcome", "rule", "cause_kind",
               "total_tokens"]
    table(columns, [[r[c] for c in columns] for r in rows])
    return EXIT_OK


def add_ls(commands: Any) -> None:
    p = command(commands, "ls", help="list sessions with state, outcome and tokens", examples=[
        "trialledger ls --db trials.db --state graded",
        "trialledger ls --cause model_endpoint --json"])
    with_db(p)
    p.add_argument("--task", help="only this task")
    p.add_argument("--state", choices=STATES, help="only this state")
    p.add_argument("--cause", help="only this cause kind (model_endpoint, …)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_ls)


def cmd_show(args: argparse.Namespace) -> int:
    """A session's timeline with durations, and each decision explained."""

    async def view_of(ledger: Ledger) -> Any:
        return await ledger.view(await ledger.resolve(args.session))

    check_store_file(args.db)
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


def add_show(commands: Any) -> None:
    p = command(commands, "show", help="a session's timeline and decisions explained",
                examples=["trialledger show 3f2a",
                          "trialledger show 3f2a --atif > trajectory.json"])
    with_db(p)
    p.add_argument("session", help="the session id, or a prefix only it starts with")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="the whole view as JSON")
    shape.add_argument("--atif", action="store_true",
                       help="the session as an ATIF trajectory (Harbor's trajectory.json)")
    p.set_defaults(handler=cmd_show)


def cmd_artifacts(args: argparse.Namespace) -> int:
    """A session's kept files (SPEC §15): listed with their folder, one printed, or copied
    (`--out`); a file is given back only when the event lists it, it is no link and its
    bytes still have the recorded sha256."""
    from trialledger.adapters.session import artifacts

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


def add_artifacts(commands: Any) -> None:
    p = command(commands, "artifacts", help="list, print or copy the files a session kept",
                examples=["trialledger artifacts 3f2a",
                          "trialledger artifacts 3f2a verifier/test-stdout.txt",
                          "trialledger artifacts 3f2a --out kept/"])
    with_db(p)
    p.add_argument("session", help="the session id, or a prefix only it starts with")
    p.add_argument("path", nargs="?", help="one kept file, as listed (verifier/…): printed")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="copy the files (or PATH) under DIR instead, checked as printing is")
    p.set_defaults(handler=cmd_artifacts)


def cmd_recover(args: argparse.Namespace) -> int:
    """Close out the sessions a runner left open; `--purge-damaged`: remove the damaged
    journals kept on this machine (SPEC §8)."""
    if args.purge_damaged:
        from trialledger.adapters.session.journal import journal_dir
        from trialledger.adapters.session.journalfile import purge_damaged

        out.print(f"{purge_damaged(journal_dir())} damaged journals removed")
        if not (args.runner or args.all):
            return EXIT_OK
    if not (args.runner or args.all):
        raise Refused("recover needs --runner ID, or --all for a single-machine store")

    if args.force:
        print("trialledger: --force: recovering even sessions whose runner is alive",
              file=sys.stderr)

    from trialledger.adapters.session.journal import delivery

    recovered = on_store(args.db, lambda ledger: ledger.recover(  # journals delivered first
        args.runner, all_runners=args.all, force=args.force, deliver=delivery(ledger)))
    from trialledger.adapters.sandbox.folders import sweep_stale_sessions
    from trialledger.adapters.sandbox.leftovers import (
        sweep_builds,
        sweep_image_views,
        sweep_session_cgroups,
    )

    cgroups = sweep_session_cgroups()  # (first: a cgroup's owner is known by its folder)
    swept = sweep_stale_sessions()  # this machine's folders of dead runners (grant tokens)
    views = sweep_image_views()
    builds = sweep_builds()
    for sid in recovered:
        out.print(plain(sid))
    out.print(f"{len(recovered)} sessions recovered")
    for count, what in ((swept, "stale session folders removed"),
                        (cgroups, "stale session cgroups removed"),
                        (views, "image views no session held unmounted"),
                        (builds, "killed builds' leftovers removed")):
        if count:
            out.print(f"{count} {what}")
    return EXIT_OK


def add_recover(commands: Any) -> None:
    p = command(commands, "recover", help="close out sessions a runner left open", examples=[
        "trialledger recover --db trials.db --runner build-7-41233",
        "trialledger recover --db trials.db --all",
        "trialledger recover --purge-damaged"])
    with_db(p)
    p.add_argument("--runner", help="the runner id whose sessions to recover")
    p.add_argument("--all", action="store_true",
                   help="every runner whose heartbeat is not fresh (a single-machine store)")
    p.add_argument("--force", action="store_true",
                   help="also sessions of runners that still beat (they may be running)")
    p.add_argument("--purge-damaged", action="store_true",
                   help="remove the damaged journals this machine kept (*.jsonl.damaged)")
    p.set_defaults(handler=cmd_recover)
