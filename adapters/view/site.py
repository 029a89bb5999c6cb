"""The pages of `trialledger view` by address, the same for the server and an export: every
page at most one folder deep (`job/`, `trial/`, `session/`, `rederive/`, `diff/`), every
link relative, so the pages open from disk as they are served."""

from __future__ import annotations

import json

from trialledger.adapters.view import pages
from trialledger.adapters.view.names import is_plain, slug
from trialledger.adapters.view.pages import NotFound, Search
from trialledger.adapters.view.render import Pages
from trialledger.adapters.view.session import Folds, rederived, session
from trialledger.adapters.view.store import rows
from trialledger.core.atif import trajectory
from trialledger.store import Ledger
from trialledger.store.jobs import Jobs

REFRESH_S = 5  # how often a served page of a running job reloads from the store


class Site:
    """The view's pages over one store; `static`: rendered for an export; `only_job`: the
    export of that job alone (its pages, sessions and trials)."""

    def __init__(self, ledger: Ledger, *, static: bool = False,
                 only_job: str | None = None) -> None:
        self.ledger = ledger
        self.pages = Pages(static=static)
        self.only_job = only_job
        self.folds = Folds(ledger)  # a session's fold, shared by its parts and pages

    async def job_names(self) -> list[str]:
        """The jobs shown: every job, or the exported one."""
        names = await pages.job_names(self.ledger)
        return [n for n in names if self.only_job in (None, n)]

    async def name_of(self, page_name: str) -> str:
        """The job a page address names."""
        for name in await self.job_names():
            if slug(name) == page_name:
                return name
        raise NotFound(f"no job {page_name}")

    async def index(self) -> str:
        found = [j for j in await pages.jobs(self.ledger) if j["name"] in await self.job_names()]
        running = any(j["state"] != "done" for j in found)
        return self.pages.render("jobs.html", root="", title="Jobs", jobs=found,
                                 refresh=REFRESH_S if running else None)

    async def sessions(self, search: Search) -> str:
        if self.only_job:
            search.job = self.only_job
        result = await pages.sessions(self.ledger, search)
        return self.pages.render("sessions.html", root="", title="Sessions", result=result,
                                 refresh=None)

    async def job(self, page_name: str) -> str:
        shown = [e for e in await Jobs(self.ledger).names() if self.only_job in (None, e["job"])]
        name = next((e["job"] for e in shown if slug(e["job"]) == page_name), None)
        if name is None:
            raise NotFound(f"no job {page_name}")
        page = await pages.job(self.ledger, name, others=shown)
        return self.pages.render("job.html", root="../", title=f"job {name}", job=page,
                                 refresh=REFRESH_S if page["state"] != "done" else None)

    async def _id_of(self, name: str, column: str) -> str:
        """The trial or session id a page name stands for: the id itself, or the one whose
        page name it is (an id that is not plain)."""
        if is_plain(name) and await rows(self.ledger, f"SELECT 1 FROM sessions WHERE "
                                         f"{column} = :v", {"v": name}):
            return name
        for found in await rows(self.ledger, f"SELECT DISTINCT {column} AS v FROM sessions"):
            if slug(str(found["v"])) == name:
                return str(found["v"])
        raise NotFound(f"no page {name}")

    async def trial(self, name: str) -> str:
        trial_id = await self._id_of(name, "trial_id")
        page = await pages.trial(self.ledger, trial_id)
        return self.pages.render("trial.html", root="../", title=f"trial {trial_id[:12]}",
                                 trial=page, refresh=None)

    async def session(self, name: str, part: int = 1) -> str:
        session_id = await self._id_of(name, "session_id")
        page = await session(self.ledger, session_id, part,
                             view=await self.folds.view(session_id))
        return self.pages.render("session.html", root="../", title=f"session {session_id[:12]}",
                                 page=page, refresh=None)

    async def trajectory(self, name: str) -> str:
        """The session as an ATIF trajectory (Harbor's `trajectory.json`, SPEC §18)."""
        session_id = await self._id_of(name, "session_id")
        return json.dumps(trajectory(await self.folds.view(session_id)), indent=2,
                          ensure_ascii=False) + "\n"

    async def rederive(self, name: str) -> str:
        session_id = await self._id_of(name, "session_id")
        page = await rederived(self.ledger, session_id, view=await self.folds.view(session_id))
        return self.pages.render("rederive.html", root="../",
                                 title=f"re-derived {session_id[:12]}", r=page, refresh=None)

    async def diff(self, slug_a: str, slug_b: str) -> str:
        a, b = await self.name_of(slug_a), await self.name_of(slug_b)
        page = await pages.diff(self.ledger, a, b)
        return self.pages.render("diff.html", root="../", title=f"{a} vs {b}", diff=page,
                                 refresh=None)

    def error(self, status: int, message: str, *, root: str) -> str:
        """A page saying why there is no page."""
        return self.pages.render("error.html", root=root, title=str(status), status=status,
                                 message=message, refresh=None)
