"""The model proxy (docs/SPEC.md §11 network, §14): what stands between a sandbox and
the model endpoint or an MCP grant.

    server.py    `SessionProxy`: one streaming reverse proxy per session and upstream, on
                 aiohttp — the token swapped for the key, every call recorded, routes,
                 sizes, concurrency and a call's deadline enforced
    upstream.py  `Upstream` and `MODEL_ROUTES`: where a proxy forwards, named without
                 importing aiohttp (the runner and the sandbox's network use these)

Nothing is imported here: each module is imported by name.
"""
