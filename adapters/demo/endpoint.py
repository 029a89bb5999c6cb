"""A scripted OpenAI Responses endpoint on loopback: drives the real Codex CLI offline
(the demo and the tests).

Each `POST /v1/responses` takes the next reply of the script (the last one repeats):
a streamed assistant message, a `function_call` (so Codex runs a real shell command), an
HTTP error status, a stream cut before `response.completed`, a reply that hangs (before
its headers, or after them: a stall), one that drips a byte a second and never ends; a
request with `"stream": false` gets the reply as one whole response object instead.
Every request body is kept in `requests`, and every request's method and path in `seen`
(any other method is answered 501, as the standard library's server does).
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted answer."""

    kind: str  # message | function_call | status | cut | hang | stall | drip
    text: str = ""
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    usage: tuple[int, int, int, int] = (12, 2, 10, 3)  # input, cached, output, reasoning
    arguments: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    name: str = "exec_command"
    namespace: str | None = None


def message(text: str = "hi there", usage: tuple[int, int, int, int] = (12, 2, 10, 3)) -> Reply:
    """An assistant message that ends the turn."""
    return Reply("message", text=text, usage=usage)


def shell(cmd: str, usage: tuple[int, int, int, int] = (10, 0, 5, 0), *,
          yield_ms: int | None = None) -> Reply:
    """A function_call of Codex's `exec_command` tool. Codex returns the call's output when the
    command ends or after `yield_ms` (its own default 10 s, which a container's first call on
    a loaded machine can outlast, so tests that read the output give 30 s)."""
    arguments: dict[str, Any] = {"cmd": cmd}
    if yield_ms is not None:
        arguments["yield_time_ms"] = yield_ms
    return Reply("function_call", arguments=arguments, usage=usage)


def tool(name: str, arguments: dict[str, Any], *, namespace: str | None = None) -> Reply:
    """A function_call of any tool (an MCP tool lives in the namespace `mcp__<server>`)."""
    return Reply("function_call", arguments=arguments, name=name, namespace=namespace,
                 usage=(10, 0, 5, 0))


def status(code: int, body: dict[str, Any] | None = None) -> Reply:
    """An HTTP error."""
    return Reply("status", status=code, body=body or {"error": {"message": "scripted"}})


def cut(text: str = "hi there") -> Reply:
    """A stream that ends before `response.completed`."""
    return Reply("cut", text=text)


def hang(seconds: float) -> Reply:
    """A reply that sends nothing for a while (for timeouts)."""
    return Reply("hang", seconds=seconds)


def stall(seconds: float) -> Reply:
    """A streamed reply that sends its headers and `response.created`, then nothing for a
    while (an endpoint hung mid-answer), then ends without `response.completed`."""
    return Reply("stall", seconds=seconds)


def drip(seconds: float) -> Reply:
    """A streamed reply that sends its headers and `response.created`, then one byte (a
    blank line, which no SSE reader acts on) a second for `seconds`, then ends without
    `response.completed`: never silent, never done."""
    return Reply("drip", seconds=seconds)


def _usage(u: tuple[int, int, int, int]) -> dict[str, Any]:
    return {"input_tokens": u[0], "input_tokens_details": {"cached_tokens": u[1]},
            "output_tokens": u[2], "output_tokens_details": {"reasoning_tokens": u[3]},
            "total_tokens": u[0] + u[2]}


def sse_events(reply: Reply, n: int) -> list[dict[str, Any]]:
    """The server-sent events of a streamed reply."""
    rid = f"resp_{n}"
    events: list[dict[str, Any]] = [{"type": "response.created", "response": {"id": rid}}]
    if reply.kind == "function_call":
        item = {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}",
                "name": reply.name, "arguments": json.dumps(reply.arguments)}
        if reply.namespace:
            item["namespace"] = reply.namespace
        events += [{"type": "response.output_item.added", "output_index": 0, "item": item},
                   {"type": "response.output_item.done", "output_index": 0, "item": item}]
    else:
        mid = f"msg_{n}"
        events += [
            {"type": "response.output_item.added", "output_index": 0,
             "item": {"type": "message", "id": mid, "role": "assistant", "content": []}},
            {"type": "response.output_text.delta", "item_id": mid, "output_index": 0,
             "content_index": 0, "delta": reply.text},
            {"type": "response.output_item.done", "output_index": 0,
             "item": {"type": "message", "id": mid, "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.text}]}},
        ]
    if reply.kind != "cut":
        events.append({"type": "response.completed",
                       "response": {"id": rid, "usage": _usage(reply.usage)}})
    return events


def whole_response(reply: Reply, n: int, model: object) -> dict[str, Any]:
    """A reply as a non-streamed answer: the whole response object."""
    items = [e["item"] for e in sse_events(reply, n) if e["type"] == "response.output_item.done"]
    return {"id": f"resp_{n}", "object": "response", "model": model, "output": items,
            "status": "incomplete" if reply.kind == "cut" else "completed",
            "usage": _usage(reply.usage)}


class ScriptedEndpoint:
    """The endpoint; use as a context manager. `url` is the provider's base URL."""

    def __init__(self, script: list[Reply], *, tls: ssl.SSLContext | None = None,
                 routes: dict[str, list[Reply]] | None = None,
                 turns: dict[str, list[Reply]] | None = None) -> None:
        """`tls`: serve https with this server context (the URL then names `localhost`).
        `routes`: a request whose body contains a marker gets that marker's script, in the
        order such requests arrive (the last reply repeats); `turns`: by the number of tool
        results the request carries (each session walks the script from its start, however
        sessions interleave); others get `script`."""
        self.turns = {marker: list(replies) for marker, replies in (turns or {}).items()}
        self.script = list(script)
        self.routes = {marker: list(replies) for marker, replies in (routes or {}).items()}
        self.routed: dict[str, list[Reply]] = {marker: [] for marker in self.routes}
        self.tls = tls
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.seen: list[tuple[str, str]] = []  # every request's (method, path)
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with endpoint._lock:
                    endpoint.seen.append((self.command, self.path))
                    try:
                        endpoint.requests.append(json.loads(body or b"{}"))
                    except ValueError:
                        endpoint.requests.append({"raw": body.decode(errors="replace")})
                    endpoint.headers.append(dict(self.headers))
                    n = len(endpoint.requests)
                    reply = endpoint._reply(body, n)
                    asked = endpoint.requests[-1]
                endpoint._answer(self, reply, n, asked)

            def do_other(self) -> None:
                with endpoint._lock:
                    endpoint.seen.append((self.command, self.path))
                self.send_error(501, f"Unsupported method ({self.command!r})")

            do_GET = do_DELETE = do_PUT = do_PATCH = do_HEAD = do_OPTIONS = do_other

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _reply(self, body: bytes, n: int) -> Reply:
        for marker, replies in self.turns.items():
            if marker.encode() in body:
                return replies[min(body.count(b'"function_call_output"'), len(replies) - 1)]
        for marker, replies in self.routes.items():
            if marker.encode() in body:
                served = self.routed[marker]
                served.append(replies[min(len(served), len(replies) - 1)])
                return served[-1]
        return self.script[min(n, len(self.script)) - 1]

    @property
    def url(self) -> str:
        port = self._server.server_address[1]
        if self.tls is not None:
            return f"https://localhost:{port}/v1"
        return f"http://127.0.0.1:{port}/v1"

    def _answer(self, handler: BaseHTTPRequestHandler, reply: Reply, n: int,
                asked: dict[str, Any]) -> None:
        if reply.kind == "hang":
            time.sleep(reply.seconds)
        whole = reply.kind != "status" and asked.get("stream") is False
        if reply.kind == "status" or whole:
            payload = json.dumps(whole_response(reply, n, asked.get("model")) if whole
                                 else reply.body).encode()
            handler.send_response(200 if whole else reply.status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Connection", "close")
        handler.end_headers()
        try:
            for event in sse_events(reply, n):
                frame = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
                handler.wfile.write(frame.encode())
                handler.wfile.flush()
                if reply.kind == "stall":  # after response.created: silence, then an end
                    time.sleep(reply.seconds)
                    break
                if reply.kind == "drip":  # after response.created: a byte a second
                    for _ in range(int(reply.seconds)):
                        handler.wfile.write(b"\n")
                        handler.wfile.flush()
                        time.sleep(1.0)
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        handler.close_connection = True

    def __enter__(self) -> ScriptedEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
