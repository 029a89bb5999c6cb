"""`trialledger view --export DIR [--job NAME]`: the view's pages written as files that
open from disk (`file://`), for sharing a job's results: the same templates, with the
sessions filters applied in the page instead of by a server."""

from __future__ import annotations

import shutil
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
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / MARK).write_text("written by trialledger view --export\n")


async def export(db: str, folder: Path, *, job: str | None = None) -> Exported:
    """Write every page of the store (or of `job`) under `folder`."""
    async with await open_read_only(db) as ledger:
        if job is not None and job not in await pages.job_names(ledger):
            raise ExportRefused(f"no job named {job}")
        _prepare(folder)
        site = Site(ledger, static=True, only_job=job)
        for asset in STATIC.iterdir():
            shutil.copyfile(asset, folder / "static" / asset.name)
        names = await site.job_names()
        (folder / "index.html").write_text(await site.index(), encoding="utf-8")
        (folder / "sessions.html").write_text(
            await site.sessions(Search(limit=ALL_SESSIONS)), encoding="utf-8")
        for name in names:
            page = slug(name)
            (folder / "job" / f"{page}.html").write_text(await site.job(page), encoding="utf-8")
            for other in names:
                if other != name:
                    (folder / "diff" / f"{page}~{slug(other)}.html").write_text(
                        await site.diff(page, slug(other)), encoding="utf-8")
        scope = "WHERE trial_id IN (SELECT trial_id FROM job_queue WHERE job = :j)" if job \
            else ""
        listed = await rows(ledger, "SELECT session_id, trial_id, head_seq FROM sessions "
                            f"{scope} ORDER BY created_at, session_id", {"j": job} if job else {})
        trials = list(dict.fromkeys(r["trial_id"] for r in listed))
        for trial_id in trials:
            (folder / "trial" / f"{slug(trial_id)}.html").write_text(
                await site.trial(slug(trial_id)), encoding="utf-8")
        for r in listed:
            page = slug(r["session_id"])
            (folder / "session" / f"{page}.html").write_text(await site.session(page),
                                                             encoding="utf-8")
            for part in range(2, -(-int(r["head_seq"]) // PART_EVENTS) + 1):  # seq from 1
                (folder / "session" / f"{page}~{part}.html").write_text(
                    await site.session(page, part), encoding="utf-8")
            (folder / "rederive" / f"{page}.html").write_text(await site.rederive(page),
                                                              encoding="utf-8")
        return Exported(folder, len(names), len(trials), len(listed))
