"""`trialledger view --export DIR [--job NAME]`: the view's pages written as files that
open from disk (`file://`), for sharing a job's results: the same templates, with the
sessions filters applied in the page instead of by a server."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.view import pages
from trialledger.adapters.view.names import slug
from trialledger.adapters.view.pages import Search
from trialledger.adapters.view.render import STATIC
from trialledger.adapters.view.session import PART_EVENTS
from trialledger.adapters.view.site import Site
from trialledger.adapters.view.store import open_read_only, rows
from trialledger.core.errors import TrialLedgerError

MARK = ".trialledger-view"  # a folder an export wrote, which a later export may overwrite
ALL_SESSIONS = 10**9  # an export lists every session; its page filters them


class ExportRefused(TrialLedgerError):
    """An export folder that holds other files, or a job the store does not hold."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote: its folder, and how many pages of each kind."""

    folder: Path
    jobs: int
    trials: int
    sessions: int

    @property
    def index(self) -> Path:
        return self.folder / "index.html"


def _prepare(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir())
                                                   and not (folder / MARK).is_file())):
        raise ExportRefused(f"{folder} holds other files: export into a new or empty folder")
    for sub in ("job", "trial", "session", "rederive", "diff", "static"):
        if (folder / sub).is_symlink():  # pages are never written through a planted link
            raise ExportRefused(f"{folder / sub} is a link: export into a new or empty folder")
        (folder / sub).mkdir(parents=True, exist_ok=True)
    _write(folder / MARK, "written by trialledger view --export\n")


def _write(path: Path, text: str | bytes) -> None:
    """`text` as the file `path`, replacing one an export wrote, never through a link
    planted in its place (one to a file elsewhere would be overwritten)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        raise ExportRefused(f"{path}: {error.strerror} (a link where a page goes?)") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(text.encode("utf-8") if isinstance(text, str) else text)


async def export(db: str, folder: Path, *, job: str | None = None) -> Exported:
    """Write every page of the store (or of `job`) under `folder`."""
    async with await open_read_only(db) as ledger:
        if job is not None and job not in await pages.job_names(ledger):
            raise ExportRefused(f"no job named {job}")
        _prepare(folder)
        site = Site(ledger, static=True, only_job=job)
        for asset in STATIC.iterdir():
            _write(folder / "static" / asset.name, asset.read_bytes())
        names = await site.job_names()
        _write(folder / "index.html", await site.index())
        _write(folder / "sessions.html", await site.sessions(Search(limit=ALL_SESSIONS)))
        for name in names:
            page = slug(name)
            _write(folder / "job" / f"{page}.html", await site.job(page))
            for other in names:
                if other != name:
                    _write(folder / "diff" / f"{page}~{slug(other)}.html",
                           await site.diff(page, slug(other)))
        scope = "WHERE trial_id IN (SELECT trial_id FROM job_queue WHERE job = :j)" if job \
            else ""
        listed = await rows(ledger, "SELECT session_id, trial_id, head_seq FROM sessions "
                            f"{scope} ORDER BY created_at, session_id", {"j": job} if job else {})
        trials = list(dict.fromkeys(r["trial_id"] for r in listed))
        for trial_id in trials:
            _write(folder / "trial" / f"{slug(trial_id)}.html", await site.trial(slug(trial_id)))
        for r in listed:
            page = slug(r["session_id"])
            _write(folder / "session" / f"{page}.html", await site.session(page))
            for part in range(2, -(-int(r["head_seq"]) // PART_EVENTS) + 1):  # seq from 1
                _write(folder / "session" / f"{page}~{part}.html", await site.session(page, part))
            _write(folder / "rederive" / f"{page}.html", await site.rederive(page))
            _write(folder / "session" / f"{page}.trajectory.json", await site.trajectory(page))
        return Exported(folder, len(names), len(trials), len(listed))
