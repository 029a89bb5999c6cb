"""`view`: the read-only web view, served or exported — its parser beside its handler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio

from trialledger.adapters.commands.common import EXIT_OK, Refused, command, with_db
from trialledger.adapters.console import plain, printable
from trialledger.adapters.console.render import out


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


def add_view(commands: Any) -> None:
    p = command(commands, "view", help="a read-only web view of jobs, trials and sessions",
                examples=["trialledger view --db trials.db", "trialledger view --port 9000",
                          "trialledger view --host 0.0.0.0 --allowed-host box.lan",
                          "trialledger view --export site/ --job nightly"])
    with_db(p)
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
