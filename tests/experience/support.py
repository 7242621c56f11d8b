"""Helpers for the importers' tests: the tools the served agent offers, and what the registry holds."""

from __future__ import annotations

from serving.support import HARNESS
from sqlalchemy import select

from pipeline.registry import Experience, Quarantine, get_engine, session_scope

TOOLS = HARNESS["tools"]  # the tools the served agent offers


def stored_rows() -> list[Experience]:
    with session_scope(get_engine()) as s:
        return list(s.scalars(select(Experience).order_by(Experience.id)))


def quarantined() -> list[Quarantine]:
    with session_scope(get_engine()) as s:
        return list(s.scalars(select(Quarantine).order_by(Quarantine.id)))


def by_origin(rows: list[Experience]) -> dict[str, list[Experience]]:
    out: dict[str, list[Experience]] = {}
    for r in rows:
        out.setdefault(r.meta["origin"]["trace"], []).append(r)
    return out
