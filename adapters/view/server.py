"""`trialledger view`: the pages served by aiohttp on a loopback port (by default), from a
store opened read-only; only GET and HEAD, only the package's own files besides the pages,
each response under a strict Content-Security-Policy, and only to a request whose `Host` is
one of its own (`hosts`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from aiohttp import web
from aiohttp.typedefs import Middleware

from trialledger.adapters.view.hosts import EXPOSED, AllowedHosts, is_loopback
from trialledger.adapters.view.names import is_plain, slug
from trialledger.adapters.view.pages import NotFound, Search
from trialledger.adapters.view.render import CSP_HEADER, STATIC
from trialledger.adapters.view.site import Site
from trialledger.adapters.view.store import open_read_only
from trialledger.store import AmbiguousSession, NoSession
from trialledger.store.engine import shown

HEADERS = {"Content-Security-Policy": CSP_HEADER, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
           "Cache-Control": "no-store", "Cross-Origin-Opener-Policy": "same-origin"}
STATIC_FILES = {"view.css": "text/css", "view.js": "text/javascript",
                "favicon.svg": "image/svg+xml"}

MISDIRECTED = ("421 Misdirected Request: this server answers only its own address "
               "(localhost, 127.0.0.1, [::1], the one it is bound to, or an --allowed-host)\n")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _own_host(hosts: AllowedHosts) -> Middleware:
    """A middleware answering 421, before anything reads the store, to a request whose
    `Host` is not one of `hosts` (absent, or sent twice, is not one)."""

    @web.middleware
    async def own_host(request: web.Request, handler: Handler) -> web.StreamResponse:
        sent = request.headers.getall("Host", [])
        if len(sent) == 1 and hosts.allows(sent[0]):
            return await handler(request)
        return web.Response(text=MISDIRECTED, status=421, headers=HEADERS)

    return own_host


@web.middleware
async def _guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every response with the security headers; a missing page as a page saying so."""
    site: Site = request.app["site"]
    root = "../" if request.path.count("/") > 1 else ""
    try:
        response = await handler(request)
    except NotFound as error:
        response = _page(site.error(404, str(error), root=root), status=404)
    except web.HTTPException as error:
        if error.status < 400:  # a redirect: with the headers too
            error.headers.update(HEADERS)
            raise
        response = _page(site.error(error.status, error.reason, root=root), status=error.status)
    response.headers.update(HEADERS)
    return response


def _page(html: str, status: int = 200) -> web.Response:
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def _id(request: web.Request) -> str:
    return request.match_info["id"]


def _routes(site: Site) -> list[web.RouteDef]:
    async def index(_: web.Request) -> web.StreamResponse:
        return _page(await site.index())

    async def sessions(request: web.Request) -> web.StreamResponse:
        return _page(await site.sessions(Search.of(request.query)))

    async def job(request: web.Request) -> web.StreamResponse:
        return _page(await site.job(request.match_info["slug"]))

    async def trial(request: web.Request) -> web.StreamResponse:
        return _page(await site.trial(_id(request)))

    async def session(request: web.Request) -> web.StreamResponse:
        wanted = _id(request)
        if is_plain(wanted):
            try:
                full = await site.ledger.resolve(wanted)  # an id, or a prefix only it has
            except (NoSession, AmbiguousSession) as error:
                raise NotFound(str(error)) from None
            if full != wanted:
                raise web.HTTPFound(f"{slug(full)}.html")
        return _page(await site.session(wanted))

    async def session_part(request: web.Request) -> web.StreamResponse:
        return _page(await site.session(_id(request), int(request.match_info["part"])))

    async def atif(request: web.Request) -> web.StreamResponse:
        return web.Response(text=await site.trajectory(_id(request)),
                            content_type="application/json", charset="utf-8")

    async def rederive(request: web.Request) -> web.StreamResponse:
        return _page(await site.rederive(_id(request)))

    async def diff(request: web.Request) -> web.StreamResponse:
        return _page(await site.diff(request.match_info["a"], request.match_info["b"]))

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise NotFound(f"no file {name}")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=STATIC_FILES[name])

    async def favicon(_: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/static/favicon.svg")

    return [web.get("/", index), web.get("/index.html", index),
            web.get("/sessions.html", sessions), web.get(r"/job/{slug:[^/]+}.html", job),
            web.get(r"/trial/{id:[^/]+}.html", trial),
            web.get(r"/session/{id:[^/~]+}.html", session),
            web.get(r"/session/{id:[^/~]+}~{part:[1-9][0-9]{0,6}}.html", session_part),
            web.get(r"/session/{id:[^/~]+}.trajectory.json", atif),
            web.get(r"/rederive/{id:[^/]+}.html", rederive),
            web.get(r"/diff/{a:[^/~]+}~{b:[^/~]+}.html", diff),
            web.get("/static/{name}", static), web.get("/favicon.ico", favicon)]


def application(site: Site, hosts: AllowedHosts) -> web.Application:
    """The aiohttp application serving `site` to requests for `hosts`."""
    app = web.Application(middlewares=[_own_host(hosts), _guarded])
    app["site"] = site
    app.add_routes(_routes(site))
    return app


async def serve(db: str, *, host: str, port: int, allowed: Sequence[str] = (),
                say: Callable[[str], Any], warn: Callable[[str], Any]) -> None:
    """Serve the store at `db` read-only until cancelled, to requests for its own address or
    an `allowed` name; `say` gets the one line that says where, and that nothing is written,
    `warn` the one that says what a bind beyond loopback exposes."""
    hosts = AllowedHosts(allowed)  # a bad name is refused before the store is opened
    async with await open_read_only(db) as ledger:
        runner = web.AppRunner(application(Site(ledger), hosts), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = [(str(a[0]), int(a[1])) for a in runner.addresses]
            hosts.listening(host, [a for a, _ in bound], [p for _, p in bound])
            shown_host = f"[{bound[0][0]}]" if ":" in bound[0][0] else bound[0][0]
            if beyond := sorted({a for a, _ in bound if not is_loopback(a)}):
                warn(f"trialledger view: warning: listening on {', '.join(beyond)}, beyond "
                     f"loopback: {EXPOSED}")
            say(f"trialledger view: serving {shown(db)} read-only (nothing is written to the "
                f"store) at http://{shown_host}:{bound[0][1]}/")
            await anyio.sleep_forever()
        finally:
            await runner.cleanup()
