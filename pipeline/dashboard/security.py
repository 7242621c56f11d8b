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
import secrets
import time
from pathlib import Path
from urllib.parse import unquote

from pipeline.errors import NotFoundError, RatchetError

__all__ = ["CSP", "Access", "ForbiddenError", "artifact_file"]

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
    """An action without valid credentials (HTTP 401/403)."""

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


class Access:
    """The admin token, its sessions and CSRF tokens. ``enabled`` is False without a token: read-only."""

    def __init__(self, token: str | None):
        self.token = token or None
        self._key = secrets.token_bytes(32) + (token or "").encode()

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str | None) -> bool:
        if not self.enabled or not candidate:
            return False
        return hmac.compare_digest(candidate.encode(), self.token.encode())  # type: ignore[union-attr]

    def bearer(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header carries the admin token."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return False
        return self.token_matches(authorization[7:].strip())

    def new_session(self) -> str:
        payload = f"{int(time.time()) + SESSION_SECONDS}.{secrets.token_urlsafe(16)}"
        return f"{payload}.{self._sign('session:' + payload)}"

    def session_valid(self, cookie: str | None) -> bool:
        if not self.enabled or not cookie or cookie.count(".") != 2:
            return False
        payload, signature = cookie.rsplit(".", 1)
        if not hmac.compare_digest(signature, self._sign("session:" + payload)):
            return False
        expiry = payload.split(".", 1)[0]
        return expiry.isdigit() and int(expiry) > time.time()

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
    ) -> str:
        """The actor of an allowed action, or ``ForbiddenError`` saying what is missing."""
        if not self.enabled:
            raise ForbiddenError(
                "actions are disabled: start the dashboard with RATCHET_ADMIN_TOKEN set to allow them"
            )
        if self.bearer(authorization):
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
