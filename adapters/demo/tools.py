"""A real MCP server (the `mcp` package, streamable HTTP, or legacy SSE) on loopback, for
Codex to call (the demo and the tests; `pip install trialledger[demo]`).

It serves one tool, `lookup`, and keeps the headers of every HTTP request it received so
a test can check that the session token of a grant arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

from trialledger.adapters.demo import free_port


class ToolServer:
    """`with ToolServer() as server:` — `server.url` is the MCP endpoint."""

    def __init__(self, transport: str = "streamable-http") -> None:
        self.headers: list[dict[str, str]] = []
        self.calls: list[str] = []
        mcp = MCPServer(name="gym", log_level="WARNING")

        @mcp.tool()
        def lookup(query: str) -> str:
            """Look a word up in the gym's dictionary."""
            self.calls.append(query)
            return f"definition of {query}: a scripted answer"

        # `sse`: the legacy HTTP+SSE transport alone (Harbor's default name for a task's)
        self.path = "/sse" if transport == "sse" else "/mcp"
        app = (mcp.sse_app(host="127.0.0.1") if transport == "sse"
               else mcp.streamable_http_app(host="127.0.0.1"))
        recorder = self

        async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                recorder.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        self.port = free_port()
        config = uvicorn.Config(recording, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def __enter__(self) -> ToolServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
