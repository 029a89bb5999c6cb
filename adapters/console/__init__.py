"""What the command line shows people (docs/SPEC.md §10), and how it stops on a signal.

`plain` (stored text made safe to print), `render` (the console, tables, JSON), `session`
(`show` and `run`'s lines), `jobs` (`job run|show|diff|ls`), `harbor` (`import-harbor`'s
comparison), `tasks` (warnings about the tasks given), `live` (a job's live display),
`signals` (SIGINT, SIGTERM, SIGHUP) and `terminal` (stdout and stderr going away). The
command bodies in `cli.py` call these; nothing here imports `cli`.
"""

from trialledger.adapters.console.plain import plain, printable

__all__ = ["plain", "printable"]
