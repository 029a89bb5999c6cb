"""What every command shares: the exit codes, the one-line refusal, the store opened for a
command, the parser that says a usage error in one line, and the options several commands
take (`--db`, `--sandbox-uid`, `--lease-s`/`--grace`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio

from trialledger.store.defaults import DEFAULT_DB

T = TypeVar("T")

if TYPE_CHECKING:  # the store (SQLAlchemy, alembic) is imported when a command needs it,
    # so that `--help` and `replay --log` start fast
    from trialledger.store import Ledger

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT = 0, 1, 2


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


def check_store_file(db: str) -> None:
    """A damaged SQLite store refused in one line (`store.intact`; loaded only here, so
    `--help` and `replay` stay clear of the database stack)."""
    from trialledger.store import intact

    intact.check_store_file(db)


def store_files(db: str) -> list[Path]:
    """The store's own file (a SQLite path), which no sandbox may mount."""
    return [] if "://" in db and not db.startswith("sqlite") else [
        Path(db.split(":///", 1)[-1]).resolve()]


# --- the parser -------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2 (SPEC §10), like every refusal."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("trialledger").strip()
        where = f"{command}: " if command else ""
        self.exit(EXIT_BAD_INPUT, f"trialledger: {where}{message} (see --help)\n")


def command(group: Any, path: str, *, help: str, examples: Sequence[str]
            ) -> argparse.ArgumentParser:
    """The subcommand `path` of `group`: its --help opens with what it does and ends with
    `examples`, each a command line the parser accepts (tests/cli/test_cli_store.py)."""
    parser: argparse.ArgumentParser = group.add_parser(
        path.split()[-1], help=help, description=help[0].upper() + help[1:] + ".",
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


class Once(argparse.Action):
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


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def grace(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, not {text}")
    return value


def with_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB,
                        help="SQLAlchemy URL (postgresql:// uses asyncpg) or a SQLite file path "
                             f"(default {DEFAULT_DB})")


def with_sandbox_uid(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox-uid", type=int, metavar="UID",
                   help="when run as root: the unprivileged uid the agent runs as "
                        "(default: the trialledger-sandbox user that `setup` creates)")


def with_lease(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lease-s", type=seconds, default=60.0,
                   help="a held trial's lease, renewed every third of it (default 60)")
    p.add_argument("--grace", type=grace, default=30.0,
                   help="on SIGINT/SIGTERM: seconds running trials get before they are "
                        "cancelled (default 30)")
