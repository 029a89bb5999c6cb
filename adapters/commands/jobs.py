"""Jobs: `job run`, `job show`, `job diff`, `job ls` and `worker` — each one's parser beside
its handler (SPEC §13)."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from trialledger.adapters.commands.common import (
    EXIT_FOUND,
    EXIT_OK,
    Refused,
    command,
    in_store,
    on_store,
    positive,
    with_db,
    with_lease,
)
from trialledger.adapters.commands.running import (
    cache_owner,
    environment_cache,
    range_mode,
    run_options,
    with_run_options,
)
from trialledger.adapters.console import plain, printable
from trialledger.adapters.console.jobs import (
    print_job,
    print_job_diff,
    print_jobs,
    trial_printer,
)
from trialledger.adapters.console.live import with_live
from trialledger.adapters.console.render import out
from trialledger.adapters.console.signals import Interrupted, stopper, until_signalled
from trialledger.adapters.console.tasks import warn_fields
from trialledger.core import TrialLedgerError

if TYPE_CHECKING:
    from trialledger.store import Ledger


def cmd_job_run(args: argparse.Namespace) -> int:
    """Create or resume a job and work its queue here; one line per finished trial, then
    the summary. Exit 0 when every trial ended with a final decision, 1 when one did not."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.jobs.jobform import derived_name, job_form, resume_command
    from trialledger.adapters.jobs.queue import JobRunner, check_inputs, job_config, load_tasks
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.session.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.tasks.files import file_limit
    from trialledger.adapters.tasks.task import TaskInvalid

    options = run_options(args)
    prices = _prices(args.prices)  # before the job exists: a bad table leaves none behind
    said = trial_printer(args.json)
    holder: list[Any] = []
    form = job_form(args.words, path=args.path, job_name=args.job_name)
    name = form.name or derived_name(form.paths, job_config(options, args.k,
                                                            max(1, options.max_attempts)))

    async def job(ledger: Ledger) -> dict[str, Any]:
        runner = JobRunner(
            ledger, name, tasks, options, k=args.k, add=args.add,
            datasets=selection.datasets, skipped=selection.skipped, concurrency=args.n,
            lease_s=args.lease_s, cache=environment_cache(args), engine=args.engine,
            pull=args.pull, force_build=args.force_build, owner=cache_owner(args), on_trial=said,
            prices=prices)
        holder.append(runner)
        await with_live(ledger, name, not args.json, runner.run, waits=runner.waits)
        return await runner.riding_out(functools.partial(_job_summary, ledger, name))

    async def go() -> dict[str, Any]:
        if options.agent == "codex":
            await check_endpoint(args.model_base_url, options.api_key)
        return await in_store(args.db, job, lease_s=args.lease_s)

    try:
        selection = load_tasks(form.paths, args.include or (),
                               args.exclude or (), max_bytes=file_limit(options.overrides),
                               in_range=range_mode(args))
        tasks = selection.tasks
        warn_fields(tasks, selection.skipped, in_range=range_mode(args))
        check_inputs(tasks, options)  # before the job exists: a refusal leaves none behind
        if form.name is None:
            print(f"trialledger: job {name} (resume it with: "
                  f"{resume_command(args.argv, name)})", file=sys.stderr, flush=True)
        summary = anyio.run(lambda: until_signalled(go, stop=stopper(holder, args.grace),
                                                    grace_s=args.grace))
    except (CodexNotFound, SandboxRefused, TaskInvalid, EndpointUnreachable) as error:
        raise Refused(str(error)) from None
    except Interrupted as stopped:
        if holder and not args.json and stopped.signum != signal.SIGHUP:
            _print_partial(args, name, stopped)  # (a hang-up: no terminal left to read it)
        raise
    if not args.json:  # --json: the trials' lines only (`job show --json` has the summary)
        print_job(summary, as_json=False)
    else:  # (what kept a task from running: on stderr, one line each, as any refusal)
        for task, why in summary["environment_failed"].items():
            print(f"trialledger: {task}: environment_failed: {printable(why)}",
                  file=sys.stderr)
    return EXIT_OK if _all_decided(summary) else EXIT_FOUND


def _print_partial(args: argparse.Namespace, name: str, stopped: Interrupted) -> None:
    """After SIGINT or SIGTERM stopped `job run` (its grace over, its running trials
    cancelled and released): the summary of the trials that finished, read again from the
    store, marked partial; a store that cannot be read is one line on stderr."""
    try:
        summary = anyio.run(functools.partial(
            in_store, args.db, lambda ledger: _job_summary(ledger, name), create=False,
            lease_s=args.lease_s))
    except (TrialLedgerError, OSError) as error:
        print(f"trialledger: no partial summary: {printable(str(error))}", file=sys.stderr)
        return
    open_trials = len(summary["open_trials"])
    out.print(plain(f"partial summary (interrupted by {stopped}): the trials that finished; "
                    f"{open_trials} trial{'s' * (open_trials != 1)} left for a resume"
                    if summary["partial"] else
                    f"summary (interrupted by {stopped} once every trial had finished)"),
              soft_wrap=False)
    print_job(summary, as_json=False)


async def _job_summary(ledger: Ledger, name: str, prices: Any = None) -> dict[str, Any]:
    from trialledger.store.jobs import Jobs

    return await Jobs(ledger).summary(name, prices)


def _prices(path: str | None) -> Any:
    """The price table `--prices FILE` names (SPEC §18), read before anything is written;
    None without one. A file that cannot be read or parsed is refused in one line."""
    if path is None:
        return None
    from trialledger.core.cost import PricesInvalid, parse_prices

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PricesInvalid(f"prices: cannot read {path}: "
                            f"{getattr(error, 'strerror', None) or error}") from None
    return parse_prices(text)


def _all_decided(summary: Mapping[str, Any]) -> bool:
    """Every trial ended scored or with a final decision (none unscored, none failed)."""
    return all(t["scored"] == 1 or (t["state"] == "done" and t["outcome"] == "verify")
               for t in summary["trials"]) and not summary["environment_failed"]


def add_job(commands: Any) -> None:
    p = command(commands, "job", help="run a benchmark: tasks × k trials, resumable", examples=[
        "trialledger job run nightly datasets/tb -k 3 -n 8 "
        "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex",
        "trialledger job show nightly"])
    job_commands = p.add_subparsers(dest="job_command", required=True)
    jr = command(job_commands, "job run", help="create or resume a job and work its queue here",
                 examples=[
                     "trialledger job run nightly datasets/tb -k 3 -n 8 --max-attempts 3 "
                     "--model-base-url http://127.0.0.1:8000/v1 --model gpt-5.1-codex "
                     "--exclude 'slow-*'",
                     "trialledger job run -p datasets/tb -a oracle",
                     "trialledger job run -p datasets/tb -a codex -m gpt-5.1-codex "
                     "--model-base-url http://127.0.0.1:8000/v1 --job-name nightly"])
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
    jr.add_argument("-k", type=positive, default=1, help="trials per task (default 1)")
    jr.add_argument("-n", type=positive, default=1, help="sessions at once (default 1)")
    jr.add_argument("--include", action="append", metavar="GLOB", help="task names to run")
    jr.add_argument("--exclude", action="append", metavar="GLOB", help="task names to skip")
    jr.add_argument("--add", action="store_true",
                    help="resuming: add the tasks named here that the job does not have yet "
                         "(without it, other task names are refused)")
    jr.add_argument("--prices", metavar="FILE",
                    help="a TOML price table, one [MODEL] table of USD per million input, "
                         "cached_input, output and reasoning tokens: the job's cost_usd "
                         "(stored with the job; a resume may give another)")
    with_lease(jr)
    with_run_options(jr, json_help="one JSON object per finished trial")
    jr.set_defaults(handler=cmd_job_run, watched=True)
    js = command(job_commands, "job show", help="a job's summary: per task, trials with --json",
                 examples=["trialledger job show nightly --json"])
    js.add_argument("name")
    with_db(js)
    js.add_argument("--json", action="store_true", help="tasks, trials and failures as JSON")
    js.add_argument("--trials", action="store_true",
                    help="also one line per trial: how it ended, its reward, its duration")
    js.add_argument("--wide", action="store_true",
                    help="every column, however narrow the terminal (by default only the "
                         "columns that fit: task, trials, scored, passed, mean, pass@ of the "
                         "smallest k first)")
    js.add_argument("--prices", metavar="FILE",
                    help="cost_usd by this TOML price table instead of the job's own")
    js.set_defaults(handler=cmd_job_show)
    jd = command(job_commands, "job diff", help="two jobs side by side: per task and overall",
                 examples=["trialledger job diff gpt-baseline gpt-new-prompt --json"])
    jd.add_argument("a", help="the job compared against")
    jd.add_argument("b", help="the job compared (differences are B − A)")
    with_db(jd)
    jd.add_argument("--json", action="store_true", help="the comparison as one JSON document")
    jd.set_defaults(handler=cmd_job_diff)
    jl = command(job_commands, "job ls", help="every job with its agent, model, trials by "
                                              "state and mean",
                 examples=["trialledger job ls --db postgresql://trials@db.internal/trials"])
    with_db(jl)
    jl.add_argument("--json", action="store_true", help="one JSON object per job")
    jl.set_defaults(handler=cmd_job_ls)


def cmd_job_show(args: argparse.Namespace) -> int:
    """A job's summary from the store: per task and overall, who holds its open trials, its
    skipped and failed tasks; each trial with --trials (and in --json)."""

    prices = _prices(args.prices)
    summary = on_store(args.db, lambda ledger: _job_summary(ledger, args.name, prices),
                       create=False)
    print_job(summary, as_json=args.json, trials=args.trials, wide=args.wide)
    return EXIT_OK


def cmd_job_diff(args: argparse.Namespace) -> int:
    """Two jobs side by side, task by task and overall: mean, passed, pass@k, tokens."""
    from trialledger.adapters.view.diff import job_diff

    async def both(ledger: Ledger) -> tuple[dict[str, Any], dict[str, Any]]:
        return await _job_summary(ledger, args.a), await _job_summary(ledger, args.b)

    sa, sb = on_store(args.db, both, create=False)
    result = job_diff(args.a, sa, args.b, sb)
    print_job_diff(result, as_json=args.json)
    return EXIT_OK


def cmd_job_ls(args: argparse.Namespace) -> int:
    """Every job with its agent, model, trials by queue state and headline mean."""
    from trialledger.store.jobs import Jobs

    rows = on_store(args.db, lambda ledger: Jobs(ledger).overview(), create=False)
    print_jobs(rows, as_json=args.json)
    return EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    """Work queued trials of any job (or `--job`) from this machine until none is left."""
    from trialledger.adapters.codex.install import CodexNotFound
    from trialledger.adapters.jobs.queue import check_inputs, worker_runner
    from trialledger.adapters.sandbox.base import SandboxRefused
    from trialledger.adapters.session.preflight import EndpointUnreachable, check_endpoint
    from trialledger.adapters.tasks.task import TaskInvalid
    from trialledger.store.jobs import Jobs

    options = run_options(args)  # model, settings and attempts: the job's (worker_runner)
    said = trial_printer(args.json)
    holder: list[Any] = []

    async def work(ledger: Ledger) -> int:
        names = [args.job] if args.job else await Jobs(ledger).pending()
        for name in names:
            runner = await worker_runner(
                ledger, name, options, agent=args.agent, concurrency=args.n,
                lease_s=args.lease_s,
                cache=environment_cache(args), engine=args.engine, pull=args.pull,
                force_build=args.force_build, owner=cache_owner(args), on_trial=said)
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


def add_worker(commands: Any) -> None:
    p = command(commands, "worker", help="work queued trials of jobs (any machine; "
                                         "PostgreSQL for several)",
                examples=["trialledger worker --db postgresql://trials@db.internal/trials "
                          "--job nightly -n 4 --model-base-url http://127.0.0.1:8000/v1"])
    p.add_argument("--job", help="only this job (default: every job with queued trials)")
    p.add_argument("-n", type=positive, default=1, help="sessions at once (default 1)")
    with_lease(p)
    # The model, settings and attempts are the job's own; the endpoint and secrets ours.
    with_run_options(p, json_help="one JSON object per finished trial", of_job=False)
    p.set_defaults(handler=cmd_worker, watched=True)
