"""A dataset's rows as training examples: each row's token ids and labels, and the rows left out by reason.

A row the chat template refuses, that does not fit ``max_seq_len`` even with its oldest turns cut, or that
has nothing to train on is left out and counted by reason (``encode_dataset``, the jobs' ``dropped`` and
their runs' ``rows_dropped_*`` metrics): a job never stops on one row. A row whose reply the server decoded
with this tokenizer trains on exactly the ids served (its ``served_tokens`` column, ``packing.encode_reply``);
the others are re-rendered, and both are counted (``token_ids``, the runs' ``token_ids_*`` metrics). Shared by
the SFT job (``job``), DPO (``dpo``) and GRPO (``grpo``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from pipeline.modeling.packing import SERVED, encode_reply
from pipeline.modeling.templating import TEMPLATE_ERROR, RowSkipped

log = logging.getLogger(__name__)

NO_TARGET = "no assistant turn"  # a row with nothing to train on
UNENCODABLE = "cannot be encoded"  # the template or tokenizer refuses its data (tools that are no schema)
# What encoding one row may raise because of that row's data: ``templating.RowSkipped`` (a ValueError, with
# its reason), a chat template's error, transformers' ValueError for tools it cannot read, a TypeError from a
# field of an unexpected type. The row is left out and counted by reason; the job goes on.
ROW_ERRORS = (ValueError, TypeError, TemplateError)


def skip_reason(exc: BaseException) -> str:
    """The reason a row that raised one of ``ROW_ERRORS`` is counted under."""

    if isinstance(exc, RowSkipped):
        return exc.reason
    return TEMPLATE_ERROR if isinstance(exc, TemplateError) else UNENCODABLE


SERVED_COLUMNS = {"messages": "served_tokens", "rejected": "rejected_served_tokens"}  # a dataset's served ids


def served_of(row: dict[str, Any], side: str = "messages") -> dict[str, Any] | None:
    """The served ids of ``row``'s ``side`` (``SERVED_COLUMNS``: JSON text of ``documents.ServedTokens``,
    written by curation; empty or absent: none). Text that is no JSON object reads as an object without a
    tokenizer, which ``packing.served_example`` finds unreadable: the reply is re-rendered and counted."""
    text = row.get(SERVED_COLUMNS[side]) or ""
    if not text:
        return None
    try:
        served = json.loads(text)
    except ValueError:
        served = None
    return served if isinstance(served, dict) and served else {"unreadable": text}


def encode_row(
    tokenizer: Any, row: dict[str, Any], max_len: int, *, fmt: str, side: str = "messages"
) -> tuple[list[int], list[int], str]:
    """``(ids, labels, how)`` of one dataset row's conversation ``side``: on the ids it was served, else
    re-rendered (``packing.encode_reply``; raises ``ROW_ERRORS`` as ``templating.encode_chat``)."""
    tools = json.loads(row.get("tools") or "[]") or None
    return encode_reply(tokenizer, row[side], max_len, fmt=fmt, tools=tools, served=served_of(row, side))


def count(counts: dict[str, int], key: str) -> None:
    """Add one to ``counts[key]``."""
    counts[key] = counts.get(key, 0) + 1


@dataclass(frozen=True)
class EncodedRows:
    """A dataset's rows as examples: ``examples`` (ids, labels), the rows left out by reason (``dropped``)
    and the examples by where their ids came from (``token_ids``: ``TrainResult.token_ids``)."""

    examples: list[tuple[list[int], list[int]]]
    dropped: dict[str, int]
    token_ids: dict[str, int]


def encode_dataset(
    tokenizer: Any, rows: list[dict[str, Any]], max_len: int, *, fmt: str, where: str
) -> EncodedRows:
    """Each row's ids and labels: the ids its reply was served with when this tokenizer served it and they
    fit (``packing.encode_reply``), else ``templating.encode_chat``'s (content inert, the oldest context cut
    to fit ``max_len``, never the target's end); and the rows left out by reason -- the chat template refuses
    the row, it does not fit, the template rewrites the trained turn, nothing to train on. A job never stops
    on one row."""

    examples: list[tuple[list[int], list[int]]] = []
    dropped: dict[str, int] = {}
    token_ids: dict[str, int] = {}
    for r in rows:
        try:
            ids, labels, how = encode_row(tokenizer, r, max_len, fmt=fmt)
        except ROW_ERRORS as exc:
            log.warning("%s: a row is left out: %s", where, exc)
            count(dropped, skip_reason(exc))
            continue
        if not any(label != -100 for label in labels):
            count(dropped, NO_TARGET)
            continue
        examples.append((ids, labels))
        count(token_ids, how)
    return EncodedRows(examples, dropped, token_ids)


def encode_rows(
    tokenizer: Any, rows: list[dict[str, Any]], max_len: int, *, fmt: str, where: str
) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:
    """``(examples, dropped)`` of ``encode_dataset``."""
    encoded = encode_dataset(tokenizer, rows, max_len, fmt=fmt, where=where)
    return encoded.examples, encoded.dropped


def log_token_ids(tracker: Any, token_ids: dict[str, int], where: str) -> None:
    """Log (and record in the job's MLflow run, ``token_ids_<how>``) how many examples trained on the ids
    served and how many were re-rendered."""
    served = sum(n for how, n in token_ids.items() if how.endswith(SERVED))
    log.info("%s: %d examples on the ids served, %d re-rendered (%s)", where, served,
             sum(token_ids.values()) - served, dropped_text(token_ids))  # fmt: skip
    if tracker:
        for how, n in sorted(token_ids.items()):
            key = "".join(c if c.isalnum() else "_" for c in how)
            tracker.log_metric(f"token_ids_{key}", float(n), step=0)


def dropped_text(dropped: dict[str, int]) -> str:
    """``dropped`` as one line: ``<n> <reason>, ...`` (``no row`` when empty)."""
    return ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items())) or "no row"


def log_dropped(tracker: Any, dropped: dict[str, int], step: int = 0) -> None:
    """Record the rows left out, by reason, in the job's MLflow run (``rows_dropped_<reason>``)."""
    for reason, n in sorted(dropped.items()):
        tracker.log_metric(f"rows_dropped_{reason.replace(' ', '_')}", float(n), step=step)
