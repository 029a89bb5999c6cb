"""`trialledger view`: a read-only web view of the store — jobs, a job's grid and figures,
trials, sessions' timelines — served on a loopback port (`server.serve`) or exported as
static pages (`export.export`) (docs/SPEC.md §10). Server-rendered from Jinja2 templates
shipped as package data; a little script of the package's own sorts tables.

Nothing is imported here, so `job diff` (which uses `view.diff`) loads no web server.
"""
