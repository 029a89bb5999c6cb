"""`trialledger`: a thin command line over the library (SPEC §10). Each command's parser and
handler live in `adapters/commands/`; this module assembles the parser and runs one command.

Exit codes: 0 success; 1 the command ran and found something (a broken chain, a
diverging decision); 2 bad input or a refused operation (a malformed line, an illegal
transition, an unknown policy, an out-of-date database), with one line saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

from trialledger.adapters.commands import harbor, jobs, running, store, view
from trialledger.adapters.commands.common import EXIT_BAD_INPUT, Parser, Refused
from trialledger.adapters.console import printable, terminal
from trialledger.adapters.console.signals import Interrupted
from trialledger.core import TrialLedgerError

COMMANDS = (  # in the order `trialledger --help` lists them
    store.add_replay, store.add_db, store.add_import, store.add_export, store.add_audit,
    store.add_sql, running.add_run, jobs.add_job, jobs.add_worker, running.add_cache,
    running.add_setup, store.add_ls, store.add_show, store.add_artifacts, view.add_view,
    running.add_demo, harbor.add_import_harbor, harbor.add_export_harbor, store.add_recover)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trialledger")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per SPEC §10 command."""
    parser = Parser(
        prog="trialledger", description="Record and judge sandboxed coding-agent trials.",
        epilog="examples:\n  trialledger demo\n  trialledger run tasks/hello "
               "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex\n"
               "  trialledger ls\n\nEach command's --help has more.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trialledger {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trialledger` console script."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (`job run`'s resume command)
    if not getattr(args, "watched", False):  # (set by the commands that run sessions)
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
