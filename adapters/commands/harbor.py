"""Harbor's job folders both ways: `import-harbor` and `export-harbor` (SPEC §15, §18) —
each one's parser beside its handler."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trialledger.adapters.commands.common import (
    EXIT_FOUND,
    EXIT_OK,
    Refused,
    command,
    on_store,
    with_db,
)
from trialledger.adapters.console import plain
from trialledger.adapters.console.harbor import print_agreements
from trialledger.adapters.console.render import out


def cmd_import_harbor(args: argparse.Namespace) -> int:
    """Import a Harbor job folder; print how each trial's verdict compares with ours."""
    from trialledger.adapters.jobs.harbor import import_job
    from trialledger.adapters.jobs.harborexport import ROWS_FILE, import_export

    job = Path(args.job_dir)
    if not job.is_dir():
        raise Refused(f"{job}: not a folder")
    # A folder `export-harbor` wrote carries our own logs: imported as they are.
    importing = import_export if os.path.lexists(job / ROWS_FILE) else import_job
    agreements = on_store(args.db, lambda ledger: importing(ledger, job))
    print_agreements(agreements, as_json=args.json)
    return EXIT_FOUND if any(not a.agrees for a in agreements) else EXIT_OK


def add_import_harbor(commands: Any) -> None:
    p = command(commands, "import-harbor", help="import a Harbor job folder, one session "
                                                 "per trial, and compare verdicts",
                examples=["trialledger import-harbor --db trials.db jobs/2026-10-20__14-03-05"])
    with_db(p)
    p.add_argument("job_dir", help="a Harbor job folder (jobs/<job_name>)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_import_harbor)


def cmd_export_harbor(args: argparse.Namespace) -> int:
    """Write a job as Harbor 0.26's job folder (SPEC §18)."""
    from trialledger.adapters.jobs.harborexport import export_job

    done = on_store(args.db, lambda ledger: export_job(ledger, args.job, Path(args.dir)),
                    create=False)
    out.print(plain(f"wrote {done.trials} trial(s) and {done.earlier_attempts} earlier "
                    f"attempt(s) to {done.folder}"))
    if done.files_missing:
        print(f"trialledger: {done.files_missing} kept file(s) are not on this machine (or "
              "changed since) and were left out", file=sys.stderr)
    return EXIT_OK


def add_export_harbor(commands: Any) -> None:
    p = command(commands, "export-harbor", help="write a job as Harbor 0.26's job folder, "
                                                 "an ATIF trajectory per trial",
                examples=["trialledger export-harbor nightly jobs/nightly",
                          "trialledger export-harbor --db postgresql://trials@db/trials "
                          "nightly out/"])
    with_db(p)
    p.add_argument("job", help="the job's name")
    p.add_argument("dir", help="the folder to write (absent or empty)")
    p.set_defaults(handler=cmd_export_harbor)
