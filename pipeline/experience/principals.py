"""Principals and scopes: who sent what Ratchet stores, and what each may make count.

Every trace, rating and correction is stored with its *principal*: the name of the API key it came with,
``anonymous`` (no key), ``operator`` (``ratchet ingest`` without ``--principal``, or ``RATCHET_API_KEY``) or
``ratchet`` (the loop's own practice: collection, discovery, evaluation). A key carries *scopes*, granted by
the operator (``ratchet keys create --name crm-backend --scope chat,certify``):

- ``chat``: ask (chat completions; feedback is stored and shown, never counted);
- ``certify``: the verification material a client attaches to its turn counts (``metadata``: ``expected``,
  ``tests``, ``schema``, ``expected_call``, ``split``, ``tools``); without it the client's metadata is kept
  apart as ``claimed`` and no scorer reads it;
- ``rate``: a rating the contract's ``feedback`` scorer may count;
- ``correct``: a correction that may be learned (when the contract's scorers verify it);
- ``admin``: reload, runtime adapter loading, key management.

Keys are 256-bit random tokens; the registry stores only their sha256 (a slow password hash buys nothing
for a secret that cannot be guessed) and shows them by name, never by value.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from pipeline.errors import RatchetError

SCOPES = ("chat", "certify", "rate", "correct", "admin")
ANONYMOUS = "anonymous"  # a request without a key
OPERATOR = "operator"  # the operator's own trusted paths: `ratchet ingest`, RATCHET_API_KEY
LOOP = "ratchet"  # the loop's own practice on task sources (collection, discovery, evaluation)
RESERVED = (ANONYMOUS, OPERATOR, LOOP)
# Principals whose experience is not an outside party's: the share cap per principal does not apply to them.
INSIDE = frozenset({OPERATOR, LOOP})
KEY_PREFIX = "rk_"
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class Principal:
    """Who sent a request, and the scopes the operator granted them."""

    name: str
    scopes: frozenset[str]

    def may(self, scope: str) -> bool:
        return scope in self.scopes


EVERYTHING = frozenset(SCOPES)
ANONYMOUS_PRINCIPAL = Principal(ANONYMOUS, frozenset({"chat"}))
OPERATOR_PRINCIPAL = Principal(OPERATOR, EVERYTHING)


def parse_scopes(text: str | list[str]) -> frozenset[str]:
    """Scopes from ``chat,certify`` (or a list); ``RatchetError`` naming an unknown one."""
    items = text.split(",") if isinstance(text, str) else text
    scopes = [s.strip() for s in items if s.strip()]
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise RatchetError(f"unknown scope {unknown[0]!r}: scopes are {', '.join(SCOPES)}")
    if not scopes:
        raise RatchetError(f"give at least one scope ({', '.join(SCOPES)})")
    return frozenset(scopes)


def check_key_name(name: str) -> str:
    """A key's name as principals are named: letters, digits, ``_ . -``, not a reserved name."""
    if not NAME.match(name):
        raise RatchetError(
            f"key name {name!r}: expected a letter, then letters, digits, _ . - (at most 100 characters)"
        )
    if name in RESERVED:
        raise RatchetError(f"key name {name!r} is reserved ({', '.join(RESERVED)})")
    return name


def new_key() -> str:
    """A fresh key value (shown once, when it is created)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What the registry stores of a key: its sha256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def ordered(scopes: frozenset[str] | set[str]) -> list[str]:
    """Scopes in their documented order."""
    return [s for s in SCOPES if s in scopes]
