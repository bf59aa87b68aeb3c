"""What holds for every request and every response, whatever route or error produced it: the body limit counted on
the bytes read, a deadline for reading them, and the security headers.

It wraps the whole ASGI app (``RateApp.__call__``), outside Starlette's error middleware, which answers a 500
outside any middleware added with ``add_middleware``: a 413, a 404 from the router and a 500 carry the same headers
as a page. The body is read here, before authentication and before any route, at most ``MAX_BODY`` bytes: a body
that passes the limit (declared by ``Content-Length`` or found while reading a chunked one) is answered 413 and not
read further. The bytes read are kept in ``scope["difftrain.body"]`` for the routes, which are then plain
functions run in the thread pool (password hashing and database work never block the event loop). Before any of
it, ``serve`` runs uvicorn with ``HeadDeadlineH11``: a request's line and headers must arrive within
``--header-timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import os

import h11
from fastapi import FastAPI
from starlette.datastructures import MutableHeaders
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY = 64 * 1024
BODY_SECONDS = 30.0
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                    "Referrer-Policy": "same-origin"}
BODY_KEY = "difftrain.body"


def with_headers(send):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            headers = MutableHeaders(raw=list(message.get("headers", [])))
            for k, v in SECURITY_HEADERS.items():
                headers[k] = v
            if "cache-control" not in headers:
                headers["Cache-Control"] = "no-store"
            message = {**message, "headers": headers.raw}
        await send(message)
    return wrapped


async def refuse(send, status: int, error: str) -> None:
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def read_body(scope, receive, send) -> bytes | None:
    """The request's body, at most MAX_BODY bytes; None when the request was refused here (413, 408) or the client
    went away."""
    declared = dict(scope.get("headers") or []).get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
        await refuse(send, 413, f"request body over {MAX_BODY} bytes")
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_SECONDS
    chunks, total = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            await refuse(send, 408, f"the request body took over {BODY_SECONDS:g} s")
            return None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > MAX_BODY:
            await refuse(send, 413, f"request body over {MAX_BODY} bytes")
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class RateApp(FastAPI):
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        send = with_headers(send)
        body = await read_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()           # after the body: the disconnect, when it comes
        await super().__call__({**scope, BODY_KEY: body}, replay, send)


# ---- a deadline on each request's head ------------------------------------------------------------------------
HEADER_SECONDS = 10.0
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeadDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline from a connection's opening, or a request's first byte, to the end of
    that request's headers: ``serve --header-timeout`` (``DIFFTRAIN_RATE_HEADER_TIMEOUT``). Past it the connection
    gets 408 and is closed, however slowly the bytes came (uvicorn times out idle keep-alive connections, never a
    head sent a byte at a time, and has no option for it)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.head_seconds = float(os.environ.get("DIFFTRAIN_RATE_HEADER_TIMEOUT", HEADER_SECONDS))
        self.head_deadline: asyncio.TimerHandle | None = None

    def _reading_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm(self) -> None:
        if self.head_deadline is None:
            self.head_deadline = self.loop.call_later(self.head_seconds, self._head_timeout)

    def _disarm(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()                           # a connection that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        if self._reading_head():
            self._arm()
        super().data_received(data)
        if not self._reading_head():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()                        # idle keep-alive: uvicorn's own timeout holds until the next byte

    def _head_timeout(self) -> None:
        self.head_deadline = None
        if self._reading_head() and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_408)
            self.transport.close()
