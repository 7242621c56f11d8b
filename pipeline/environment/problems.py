"""The demo's problems in their canonical form: which sums a conversation poses, however they are written.

Every demo item is the addition ``a+b`` in one family's format, and the split is by the unordered pair
(``tasks.split_of``), so a problem's identity is ``("add", min(a, b), max(a, b))``: ``15+42=?``, ``42+15``,
``15 + 42 =``, ``what is 15 plus 42?``, ``fifteen plus forty-two =?``, ``f adds 42 15``, ``timer 15+42``,
``add 15+42 egg``, ``counter 15+42``, ``the sum of 15 and 42``, ``add 15 to 42`` and ``1 5 + 4 2`` are the
same problem. ``problem_keys(messages)`` is the demo task source's ``canonical`` (``pipeline.specs.tasksource``): the
keys of every such problem in any text of any message (content, content parts, tool-call arguments), after
the held-out predicate's normalisation (Unicode NFKC, format characters removed, case folded), with the
number words of 0..99 (``forty-two``, ``forty two``, ``fortytwo``) read as numbers and two single digits
apart read as one number as well as two.

What it recognises is two numbers joined by ``+``, ``plus``, ``and``, ``&`` or ``added to``, or following
``add``/``adds``/``sum``/``total`` (``of``, ``up``, ``together`` between) with at most one of ``+ , and to plus
with &`` between them. A number next to other digits or a decimal point is not taken apart (``115+42`` is
not ``15+42``), but ``15+42.5`` still poses ``15+42`` (a held-out pair is refused rather than missed). Not
recognised: the problem in another language, in other words for addition (``increase 15 by 42``), or
spelled out digit by digit in words. A pure function of its argument, a few microseconds per message.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from pipeline.experience.texts import KEPT_CHARS, KEPT_TEXTS, message_texts, normalise

Key = tuple[str, int, int]

_UNITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = (
    "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
)  # fmt: skip
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_VALUE = {
    **{w: i for i, w in enumerate(_UNITS)},
    **{w: 10 + i for i, w in enumerate(_TEENS)},
    **{w: 20 + 10 * i for i, w in enumerate(_TENS)},
    "fourty": 40,  # a common misspelling reads the same
}
_TENS_WORDS = "|".join((*_TENS, "fourty"))
_UNIT_WORDS = "|".join(_UNITS[1:])
# ``forty-two``, ``forty two``, ``fortytwo`` (any dash NFKC leaves), then teens and units
_NUMBER_WORD = re.compile(
    rf"\b(?:({_TENS_WORDS})(?:[\s\-\u2010-\u2015\u2212]*({_UNIT_WORDS}))?|({'|'.join(_TEENS)})|({'|'.join(_UNITS)}))\b"
)
_SPACED_DIGITS = re.compile(r"(?<![\d.])(\d)\s+(\d)(?!\d)")  # ``1 5`` may be 15
_NUMBER = r"(?<!\d)(\d{1,6})(?!\d)"
_JOIN = r"\s*(?:\+|\u2795|\bplus\b|\band\b|&|\badded\s+to\b)\s*"
# ``A + B``: the first number consumed, the second looked ahead at, so ``10+15+42`` gives both sums
_JOINED = re.compile(rf"{_NUMBER}(?={_JOIN}(\d{{1,6}})(?!\d))")
_ADDED = re.compile(
    r"\b(?:add|adds|added|adding|sum|sums|summing|total)\b(?:\s+(?:of|up|together))?\s*[:=]?\s*"
    rf"{_NUMBER}\s*(?:\+|,|&|\band\b|\bto\b|\bplus\b|\bwith\b)?\s*{_NUMBER}"
)


def _spelled(match: re.Match[str]) -> str:
    tens, unit, teen, single = match.groups()
    if tens:
        return str(_VALUE[tens] + (_VALUE[unit] if unit else 0))
    return str(_VALUE[teen or single])


def text_keys(text: str) -> frozenset[Key]:
    """The addition problems one text poses, as ``("add", low, high)`` (kept for short texts, which every
    trace repeats: tool schemas, system prompts, the demo's prompts)."""
    return _short_text_keys(text) if len(text) <= KEPT_CHARS else _text_keys(text)


@functools.lru_cache(maxsize=KEPT_TEXTS)
def _short_text_keys(text: str) -> frozenset[Key]:
    return _text_keys(text)


def _text_keys(text: str) -> frozenset[Key]:
    text = _NUMBER_WORD.sub(_spelled, normalise(text))
    readings = [text]
    collapsed = _SPACED_DIGITS.sub(r"\1\2", text)
    if collapsed != text:
        readings.append(collapsed)
    keys: set[Key] = set()
    for reading in readings:
        for pattern in (_JOINED, _ADDED):
            for match in pattern.finditer(reading):
                a, b = int(match.group(1)), int(match.group(2))
                keys.add(("add", min(a, b), max(a, b)))
    return frozenset(keys)


def problem_keys(messages: list[dict[str, Any]]) -> frozenset[Key]:
    """Every addition problem posed anywhere in ``messages`` (each text of each message read on its own),
    as ``("add", low, high)``: the demo task source's canonical form."""
    keys: set[Key] = set()
    for message in messages:
        if isinstance(message, dict):
            for text in message_texts(message):
                if text:
                    keys |= text_keys(text)
    return frozenset(keys)
