"""Request limits of the server: a body is counted and timed while it is read, a bounded number of chat
turns is admitted at once (after their bodies were read: a slow client holds no turn's place), a client that
leaves is noticed without polling, and no client holds the server with slow or many connections.

- ``read_body(request, limit, timeout_s=, idle_s=)``: the body, or ``413`` as soon as the declared
  ``Content-Length`` or the bytes received pass ``limit`` (a huge or endless chunked body is never
  buffered), or ``408`` when it takes longer than ``timeout_s`` in all or ``idle_s`` without a byte; the
  connection is closed after either answer.
- ``Admission``: turns admitted and not yet decoded (or feedback being handled); beyond ``limit`` a request
  gets ``429`` (``503`` while the server stops or loads a new generation) with ``Retry-After``, at once.
- ``watch_disconnect(request, abort)``: waits for the ASGI ``http.disconnect`` that follows the body and
  sets ``abort`` (``disconnected``), so the turn's row leaves its batch.
- ``KeyLimit``: ASGI middleware, at most ``limit`` requests in flight per API key (429 before the body).
- ``guarded_h11(...)``: uvicorn's HTTP/1.1 protocol with a deadline on a request's headers and a bound on
  the connections of one client address (uvicorn has neither).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.serving.access import bearer_token
from pipeline.serving.protocol import ApiError
from pipeline.serving.runtime import Abort
from pipeline.serving.served import ServeConfig


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},  # stop reading whatever else the client sends
    )


def too_slow(message: str) -> ApiError:
    return ApiError(408, message, code="request_timeout", headers={"Connection": "close"})


async def read_body(
    request: Any,
    limit: int,
    *,
    timeout_s: float = ServeConfig.body_timeout_s,
    idle_s: float = ServeConfig.body_idle_s,
) -> bytes:
    """The request body, refused (``ApiError`` 413) once it passes ``limit`` bytes (0: no limit), or (408)
    when it is not complete within ``timeout_s`` or no byte comes for ``idle_s`` (0: no such limit): a
    client trickling a body is dropped, not waited for."""
    declared = request.headers.get("content-length", "")
    if limit and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        left = deadline - time.monotonic()
        wait = min(left, idle_s or math.inf)
        if wait <= 0:
            raise too_slow(f"the request body was not complete within {timeout_s:g} s (--body-timeout-s)")
        try:
            chunk = await asyncio.wait_for(anext(stream), None if wait == math.inf else wait)
        except StopAsyncIteration:
            break
        except TimeoutError:
            if wait < left:
                raise too_slow(f"no byte of the request body came for {idle_s:g} s (--body-idle-s)") from None
            raise too_slow(
                f"the request body was not complete within {timeout_s:g} s (--body-timeout-s)"
            ) from None
        size += len(chunk)
        if limit and size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class Slot:
    """One admitted turn; ``release()`` (idempotent) when its decoding ended."""

    admission: Admission
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.inflight -= 1


class Admission:
    """Counts chat turns from admission until their decoding ends (``limit`` 0: no limit)."""

    def __init__(self, limit: int, *, option: str = "--max-queue"):
        self.limit = limit
        self.option = option  # named in the 429's message
        self.inflight = 0
        self.refused = 0

    def admit(self, *, busy: str | None = None, seconds_per_turn: float = 0.0) -> Slot:
        """A slot, or ``ApiError`` 429 when ``limit`` turns are in flight (503 with ``busy``, the reason
        the server cannot take more now even below the limit, or while it is at the limit)."""
        full = bool(self.limit) and self.inflight >= self.limit
        if busy is not None and (full or busy == "stopping"):
            self.refused += 1
            raise ApiError(
                503,
                f"the server is {busy}; retry shortly",
                type="server_error",
                code="service_unavailable",
                headers={"Retry-After": str(self.retry_after(seconds_per_turn))},
            )
        if full:
            self.refused += 1
            raise ApiError(
                429,
                f"the server has {self.inflight} requests in flight, its limit ({self.option}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after(seconds_per_turn))},
            )
        self.inflight += 1
        return Slot(self)

    def retry_after(self, seconds_per_turn: float) -> int:
        """Whole seconds until the turns in flight are likely done (1 to 60)."""
        return max(1, min(60, math.ceil(self.inflight * seconds_per_turn)))


async def watch_disconnect(request: Any, abort: Abort) -> None:
    """Set ``abort`` when the client disconnects (call after the body was read; cancel when done)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            abort.set("disconnected")
            return


def _refusal(exc: ApiError, reason: str) -> bytes:
    """``exc`` as a whole HTTP/1.1 answer that closes the connection, written before any request was read."""
    body = json.dumps(exc.body())
    head = (
        f"HTTP/1.1 {exc.status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return (head + body).encode()


class KeyLimit:
    """ASGI middleware: at most ``limit`` requests in flight per API key (the ``Authorization`` header, kept
    as its hash); one more is answered 429 with ``Retry-After`` before its body is read. Requests without a
    key are bounded per address by ``guarded_h11``. ``limit`` 0: no limit."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit
        self.inflight: Counter[bytes] = Counter()
        self.refused = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        key = bearer_token(header.decode("latin-1")) if header is not None else None
        if scope["type"] != "http" or not self.limit or not key:
            await self.app(scope, receive, send)
            return
        digest = hashlib.sha256(key.encode()).digest()  # the key as access reads it, however it is spelled
        if self.inflight[digest] >= self.limit:
            self.refused += 1
            exc = ApiError(
                429,
                f"this key has {self.limit} requests in flight, its limit (--max-requests-per-key); "
                "retry later",
                type="rate_limit_error",
                code="key_busy",
            )
            await _send_error(send, exc, {"retry-after": "1", "connection": "close"})
            return
        self.inflight[digest] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight[digest] -= 1
            if not self.inflight[digest]:
                del self.inflight[digest]


async def _send_error(send: Any, exc: ApiError, headers: dict[str, str]) -> None:
    body = json.dumps(exc.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def guarded_h11(*, header_timeout_s: float, max_per_client: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol (``uvicorn.run(app, http=...)``) with what uvicorn lacks:

    - a deadline on the request's headers: ``header_timeout_s`` from the connection, or from the previous
      answer on a kept-alive connection, to the end of the headers. uvicorn's ``timeout_keep_alive`` only
      runs between requests and is cancelled by the first byte, so a client sending one byte, or a header
      line now and then, holds its connection forever. A connection past the deadline is closed, with a
      408 when part of a request came;
    - at most ``max_per_client`` open connections from one client address: one more is answered 429 and
      closed at once (behind a reverse proxy every client shares its address: raise it or set 0, no limit).

    Each call makes a new class with its own count of connections per address (one per server)."""
    per_address: Counter[str] = Counter()

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else ""
            self._header_timer: asyncio.TimerHandle | None = None
            self._counted = not max_per_client or per_address[self._address] < max_per_client
            if not self._counted:
                self.logger.warning("%s has %d connections open, its limit", self._address, max_per_client)
                busy = ApiError(
                    429,
                    f"{max_per_client} connections from your address are open, the server's limit "
                    "(--max-connections-per-client); retry later",
                    type="rate_limit_error",
                    code="too_many_connections",
                )
                transport.write(_refusal(busy, "Too Many Requests"))
                transport.close()
                return
            per_address[self._address] += 1
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted:
                self._counted = False
                per_address[self._address] -= 1
                if not per_address[self._address]:
                    del per_address[self._address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self.transport.is_closing():  # nothing more of a refused or timed-out connection
                super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in (or the connection failed)
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:
                self._arm()  # waiting for the next request's headers on a kept-alive connection
            elif self.conn.their_state is h11.SEND_BODY:  # answered before its body was read (401, 404,
                self.transport.close()  # 429...): nothing would time out a body trickled after it

        def _arm(self) -> None:
            self._disarm()
            if header_timeout_s:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # part of a request came: say why it is dropped
                late = ApiError(
                    408,
                    f"the request headers did not arrive within {header_timeout_s:g} s (--header-timeout-s)",
                    code="request_timeout",
                )
                self.transport.write(_refusal(late, "Request Timeout"))
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """How ``ratchet serve`` runs uvicorn for ``config`` (``uvicorn.run(app, **uvicorn_options(config))``):
    the guarded protocol, keep-alive 5 s (uvicorn's default, said here), headers of at most 16 KiB (h11's)."""
    return {
        "http": guarded_h11(
            header_timeout_s=config.header_timeout_s, max_per_client=config.max_connections_per_client
        ),
        "timeout_keep_alive": 5,
        "h11_max_incomplete_event_size": 16 << 10,
    }
