"""Request limits of the server: a body is counted while it is read, a bounded number of chat turns is
admitted at once, and a client that leaves is noticed without polling.

- ``read_body(request, limit)``: the body, or ``413`` as soon as the declared ``Content-Length`` or the
  bytes received pass ``limit`` (a huge or endless chunked body is never buffered; the connection is
  closed after the answer).
- ``Admission``: turns admitted and not yet decoded; beyond ``limit`` a request gets ``429`` (``503``
  while the server stops or loads a new generation) with ``Retry-After``, at once.
- ``watch_disconnect(request, abort)``: waits for the ASGI ``http.disconnect`` that follows the body and
  sets ``abort`` (``disconnected``), so the turn's row leaves its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.serving.protocol import ApiError
from pipeline.serving.runtime import Abort


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
        headers={"Connection": "close"},  # stop reading whatever else the client sends
    )


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (``ApiError`` 413) once it passes ``limit`` bytes (0: no limit)."""
    declared = request.headers.get("content-length", "")
    if limit and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
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

    def __init__(self, limit: int):
        self.limit = limit
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
                f"the server has {self.inflight} requests in flight, its limit (--max-queue); retry later",
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
