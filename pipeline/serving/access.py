"""Who a request to ``ratchet serve`` comes from, and whether they may do what they ask.

``Access.principal(request)`` reads the bearer key: ``RATCHET_API_KEY`` is the operator (every scope); a key
created with ``ratchet keys create`` is its name with the scopes it was granted (``pipeline.experience.principals``);
anything else is ``anonymous`` with the ``chat`` scope only -- allowed while no key exists (the CLI refuses
to serve off loopback then), or always with ``--allow-anonymous``; otherwise refused (401). A key that is not
one of the server's is anonymous too where anonymous requests are served (SDKs insist on sending some key,
e.g. ``api_key="unused"``): it gains nothing, and what its client sends is stored as ``claimed``.
``Access.require(request, scope)`` answers 403 for a principal without the scope.

Keys are read from the registry at most every ``refresh_s`` seconds (off the event loop), so a new or revoked
key takes effect within that time without a restart.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import Request

from pipeline.experience.principals import ANONYMOUS_PRINCIPAL, OPERATOR_PRINCIPAL, Principal, key_digest
from pipeline.registry import active_principals, session_scope
from pipeline.serving.protocol import ApiError

log = logging.getLogger(__name__)


def bearer(request: Request) -> str | None:
    """The request's bearer token, or None when it sent no Authorization header."""
    return bearer_token(request.headers.get("authorization"))


def bearer_token(header: str | None) -> str | None:
    """The key in an ``Authorization`` header value: None without the header, "" when it is no bearer key."""
    if header is None:
        return None
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


class Access:
    """Authenticates requests against ``RATCHET_API_KEY`` and the registry's keys (see the module doc)."""

    def __init__(
        self,
        *,
        db: Any = None,
        api_key: str | None = None,
        allow_anonymous: bool = False,
        refresh_s: float = 2.0,
    ):
        self.db = db  # the registry's engine; None: RATCHET_API_KEY only
        self.api_key = api_key
        self.allow_anonymous = allow_anonymous
        self.refresh_s = refresh_s
        self._keys: dict[str, Principal] = {}
        self._read_at = -1e9
        self._loaded = False  # keys were read from the registry at least once
        self._lock = asyncio.Lock()

    async def keys(self) -> dict[str, Principal]:
        """sha256 of each active key -> its principal (read again when older than ``refresh_s``)."""
        if self.db is None or time.monotonic() - self._read_at < self.refresh_s:
            return self._keys
        async with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                try:
                    self._keys = await asyncio.to_thread(_read_keys, self.db)
                    self._loaded = True
                except Exception as exc:  # the registry is down or locked: serve on the keys known
                    if not self._loaded:  # fail closed: no key was ever read, so none can be told apart
                        raise ApiError(
                            503,
                            "the server cannot read its API keys from the registry now; retry shortly",
                            type="server_error",
                            code="service_unavailable",
                            headers={"Retry-After": str(max(1, round(self.refresh_s)))},
                        ) from None
                    log.warning(
                        "reading API keys failed (%s); using the %d keys read before", exc, len(self._keys)
                    )
                self._read_at = time.monotonic()
        return self._keys

    def forget(self) -> None:
        """Read the keys again at the next request (a key was created or revoked here)."""
        self._read_at = -1e9

    async def anonymous_allowed(self) -> bool:
        return self.allow_anonymous or (not self.api_key and not await self.keys())

    async def principal(self, request: Request) -> Principal:
        """Who sent ``request``; 401 for a wrong key, or for no key where a key is required."""
        given = bearer(request)
        if given and self.api_key and hmac.compare_digest(given.encode(), self.api_key.encode()):
            return OPERATOR_PRINCIPAL
        found = (await self.keys()).get(key_digest(given)) if given else None
        if found is not None:
            return found
        if await self.anonymous_allowed():
            return ANONYMOUS_PRINCIPAL
        if given is None:
            raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
        raise ApiError(401, "wrong API key: it is not one of this server's keys", code="invalid_api_key")

    async def require(self, request: Request, scope: str) -> Principal:
        """The request's principal, when it holds ``scope``; else 403 naming the scope."""
        who = await self.principal(request)
        if not who.may(scope):
            raise ApiError(
                403,
                f"the key {who.name!r} lacks the `{scope}` scope (ratchet keys create --scope ... grants it)",
                code="forbidden",
            )
        return who


def _read_keys(db: Any) -> dict[str, Principal]:

    with session_scope(db) as session:
        return active_principals(session=session)
