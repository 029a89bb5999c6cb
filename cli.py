"""`trialledger`: a thin command line over the library (SPEC §10).

Exit codes: 0 success; 1 the command ran and found a difference or a fault; 2 bad input
(a malformed line, an illegal transition, an unknown policy), with one line saying why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from core import BadEvent, IllegalTransition, TrialLedgerError, parse_jsonl, replay

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT = 0, 1, 2


def _fail(message: str) -> int:
    print(f"trialledger: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_replay(args: argparse.Namespace) -> int:
    """Print the re-derived view of one JSONL log as JSON."""
    path = Path(args.log)
    try:
        with path.open(encoding="utf-8") as lines:
            numbered = list(parse_jsonl(lines))
    except OSError as error:
        return _fail(f"cannot read {path}: {error.strerror}")
    except BadEvent as error:
        return _fail(f"{path}: {error}")
    line_of = [number for number, _ in numbered]
    try:
        view = replay([obj for _, obj in numbered], policy=args.policy)
    except (BadEvent, IllegalTransition) as error:
        index = error.index
        where = f"line {line_of[index]}: " if index is not None else ""
        reason = error.reason if isinstance(error, BadEvent) else str(error)
        return _fail(f"{path}: {where}{reason}")
    except TrialLedgerError as error:
        return _fail(str(error))
    print(json.dumps(view.model_dump(mode="json"), indent=2, ensure_ascii=False))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one subcommand per SPEC §10 command."""
    parser = argparse.ArgumentParser(
        prog="trialledger", description="Record and judge sandboxed coding-agent trials."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p_replay = commands.add_parser("replay", help="re-derive a session's outcome from its log")
    p_replay.add_argument("--log", required=True, help="a session's JSONL event log")
    p_replay.add_argument("--policy", default="v1", help="decision policy version (default v1)")
    p_replay.set_defaults(handler=cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trialledger` console script."""
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
