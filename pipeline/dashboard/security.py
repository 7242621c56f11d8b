"""The dashboard's safety: who may act, forgery protection, response headers, and the artifact store's fence.

- Reading needs nothing. Acting (promote, rollback, re-score) needs ``RATCHET_ADMIN_TOKEN``: as a bearer
  token, or through the login form, which sets a signed session cookie (``Secure``, ``HttpOnly``,
  ``SameSite=Strict``; signed with a key drawn at start-up, so a restart or a new token ends every session).
- A form posted with the session cookie must carry the page's CSRF token (an HMAC of the session) and, when
  the browser says where it comes from, an ``Origin`` of this very server. A bearer token is never sent by
  a browser on its own, so a bearer request needs no CSRF token.
- Every response says ``Content-Security-Policy: default-src 'none'`` with styles and images from the
  app only and no script at all: whatever a trace holds renders as escaped text and cannot run.
- ``artifact_file`` resolves a requested path inside the artifact store or refuses it (``..``, absolute,
  encoded variants, links that lead outside).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote

from fastapi import Path as PathParam
from fastapi import Request

from pipeline.errors import NotFoundError, RatchetError

__all__ = ["CSP", "MAX_ID", "Access", "ForbiddenError", "Id", "artifact_file", "client_key"]

MAX_ID = 2**63 - 1  # the largest id either database stores: a larger number in a URL is a 422, not a crash
Id = Annotated[int, PathParam(ge=0, le=MAX_ID)]

log = logging.getLogger(__name__)

COOKIE = "ratchet_session"
SESSION_SECONDS = 8 * 3600
CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
}


class ForbiddenError(RatchetError):
    """An action without valid credentials (HTTP 401/403; 429 while wrong tokens are throttled)."""

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


class Access:
    """The admin token, its sessions and CSRF tokens. ``enabled`` is False without a token: read-only.

    Wrong tokens are throttled per client (``client_key``: its address, an IPv6 client by its /64 network),
    whatever path they come by (login form or bearer header): after ``MAX_FAILURES`` in
    ``FAILURE_WINDOW_S`` every token check from that client fails for the rest of the window, and each
    failure is logged. Other clients are not affected, so nobody's guesses lock the admin out. The table
    of clients holds at most ``MAX_CLIENTS`` (those whose failures expired go first, then the least
    recently failed). A client is the connection's peer (``request.client.host``); ``X-Forwarded-For`` is
    believed only from a ``trusted_proxies`` peer (addresses or networks). Signing out revokes the session
    (kept in memory: a restart ends every session)."""

    MAX_FAILURES = 20
    FAILURE_WINDOW_S = 60.0
    MIN_TOKEN_CHARS = 16
    MAX_CLIENTS = 4096

    def __init__(self, token: str | None, *, trusted_proxies: Sequence[str] = ()):
        if token and len(token) < self.MIN_TOKEN_CHARS:
            raise RatchetError(
                f"RATCHET_ADMIN_TOKEN has {len(token)} characters: use at least {self.MIN_TOKEN_CHARS} "
                "(e.g. `openssl rand -hex 16`)"
            )
        self.token = token or None
        self._key = secrets.token_bytes(32) + (token or "").encode()
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # client -> times, least recent first
        self._revoked: set[str] = set()
        self._lock = threading.Lock()
        try:
            self._proxies = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]
        except ValueError as exc:
            raise RatchetError(f"trusted proxy: {exc}") from None

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def client(self, request: Request) -> str:
        """The throttling key of the client behind ``request`` (see the class doc)."""
        peer = request.client.host if request.client else ""
        if self._trusted(peer):
            hops = [h.strip() for h in ",".join(request.headers.getlist("x-forwarded-for")).split(",")]
            for hop in reversed([h for h in hops if h]):  # the nearest hop a trusted proxy saw
                if not self._trusted(hop):
                    return client_key(hop)
        return client_key(peer)

    def _trusted(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self._proxies)

    def _recent(self, client: str, now: float) -> deque[float]:
        times = self._failures.get(client, deque())
        while times and times[0] < now - self.FAILURE_WINDOW_S:
            times.popleft()
        return times

    def throttled(self, client: str) -> bool:
        with self._lock:
            return len(self._recent(client, time.monotonic())) >= self.MAX_FAILURES

    def _failed(self, how: str, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._recent(client, now)
            times.append(now)
            self._failures[client] = times
            self._failures.move_to_end(client)
            if len(self._failures) > self.MAX_CLIENTS:
                for other in [c for c, t in self._failures.items() if not self._recent(c, now)]:
                    del self._failures[other]
            while len(self._failures) > self.MAX_CLIENTS:
                self._failures.popitem(last=False)
        log.warning("dashboard: wrong admin token (%s) from %s", how, client)

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str | None, how: str = "login", *, client: str) -> bool:
        """Whether ``candidate`` is the admin token; ``ForbiddenError`` (429) while ``client`` is throttled."""
        if not self.enabled or not candidate:
            return False
        if self.throttled(client):
            raise ForbiddenError("too many wrong tokens: try again in a minute", status=429)
        if hmac.compare_digest(candidate.encode(), self.token.encode()):  # type: ignore[union-attr]
            return True
        self._failed(how, client)
        return False

    def bearer(self, authorization: str | None, *, client: str) -> bool:
        """Whether an ``Authorization`` header carries the admin token."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return False
        return self.token_matches(authorization[7:].strip(), "bearer", client=client)

    def new_session(self) -> str:
        payload = f"{int(time.time()) + SESSION_SECONDS}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._sign('session:' + payload)}"

    def session_valid(self, cookie: str | None) -> bool:
        if not self.enabled or not cookie or cookie.count(".") != 2:
            return False
        payload, signature = cookie.rsplit(".", 1)
        if not hmac.compare_digest(signature, self._sign("session:" + payload)) or payload in self._revoked:
            return False
        expiry = payload.split(".", 1)[0]
        return expiry.isdigit() and int(expiry) > time.time()

    def revoke(self, cookie: str | None) -> None:
        """End a session (sign-out): its cookie is refused from now on."""
        if self.session_valid(cookie):
            self._revoked.add(cookie.rsplit(".", 1)[0])  # type: ignore[union-attr]

    def csrf_token(self, cookie: str | None) -> str:
        return self._sign("csrf:" + cookie) if self.session_valid(cookie) else ""

    def require(
        self,
        *,
        authorization: str | None,
        cookie: str | None,
        csrf: str | None,
        origin: str | None,
        own_origin: str,
        client: str,
    ) -> str:
        """The actor of an allowed action, or ``ForbiddenError`` saying what is missing."""
        if not self.enabled:
            raise ForbiddenError(
                "actions are disabled: start the dashboard with RATCHET_ADMIN_TOKEN set to allow them"
            )
        if self.bearer(authorization, client=client):
            return "dashboard:bearer"
        if not self.session_valid(cookie):
            raise ForbiddenError(
                "sign in first (the admin token, as a bearer token or on /login)", status=401
            )
        if origin and origin != "null" and origin.rstrip("/") != own_origin.rstrip("/"):
            raise ForbiddenError(f"cross-site request refused (origin {origin!r})")
        expected = self.csrf_token(cookie)
        if not csrf or not hmac.compare_digest(csrf, expected):
            raise ForbiddenError("missing or wrong CSRF token: reload the page and try again")
        return "dashboard:session"


def client_key(host: str) -> str:
    """A client's throttling key: its IP address (an IPv4-mapped IPv6 address as IPv4), an IPv6 client by
    its /64 network (one host usually holds a whole /64), anything else as given."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


TEXT_SUFFIXES = {".json", ".jsonl", ".txt", ".yaml", ".yml", ".md", ".jinja", ".csv", ".log"}
MAX_BYTES = 2 * 1024 * 1024


def artifact_file(root: Path, requested: str) -> Path:
    """The file or directory ``requested`` names inside ``root``, or ``NotFoundError``/``RatchetError``
    (a 4xx): no ``..``, no absolute path, no encoded variant of either, nothing a link leads outside to."""
    text = requested
    for _ in range(3):  # percent-encoding applied more than once still decodes to what it hides
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    if "\x00" in text or "\\" in text or "%" in text:
        raise RatchetError(f"refused artifact path {requested!r}: unexpected characters")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if text.startswith("/") or any(p == ".." for p in parts) or (parts and ":" in parts[0]):
        raise RatchetError(f"refused artifact path {requested!r}: it must stay inside the artifact store")
    base = root.resolve()
    target = base.joinpath(*parts) if parts else base
    try:
        resolved = target.resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError):
        raise NotFoundError(f"no artifact {requested!r}") from None
    if not resolved.is_relative_to(base):
        raise RatchetError(f"refused artifact path {requested!r}: it leads outside the artifact store")
    return resolved
