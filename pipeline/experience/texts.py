"""How Ratchet reads messages' texts: the one reader of a message's text (``message_text``: what scorers,
routing, views, prompts and the dashboard read, so a client's content parts mean the same everywhere), and,
for comparisons (the held-out predicate, a task source's canonical form), every text a message carries and
each text as normalised words and punctuation marks."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterator, Mapping
from typing import Any

# Short texts recur in every trace (tool schemas, system prompts, the demo's prompts): what a comparison made
# of one may be kept, for at most this many texts of at most this many characters (a bound on the memory held).
KEPT_TEXTS, KEPT_CHARS = 1 << 14, 256
_WORD = re.compile(r"\w+|[^\w\s]")
_PUNCTUATION = re.compile(r"[^\w\s]")


@functools.cache
def _format_characters() -> re.Pattern[str]:
    """Every format character (Unicode category Cf: zero-width spaces and joiners, bidi marks, soft hyphens,
    tags): invisible, so a prompt with one inside reads the same. They live in planes 0, 1 and 14."""
    chars = [
        chr(c)
        for plane in (0x0, 0x10000, 0xE0000)
        for c in range(plane, plane + 0x10000)
        if unicodedata.category(chr(c)) == "Cf"
    ]
    return re.compile("[" + "".join(re.escape(c) for c in chars) + "]")


def normalise(text: str) -> str:
    """``text`` as every comparison reads it: Unicode NFKC, format characters removed, case folded."""
    if text.isascii():  # NFKC leaves ASCII as it is, and no format character is ASCII
        return text.lower()
    return _format_characters().sub("", unicodedata.normalize("NFKC", text)).casefold()


def words(text: str) -> tuple[str, ...]:
    """``text`` as the comparison sees it: normalised (``normalise``) words and punctuation marks."""
    return tuple(_WORD.findall(normalise(text)))


def trimmed(tokens: tuple[str, ...]) -> tuple[str, ...]:
    """``tokens`` without leading and trailing punctuation marks (all of them when nothing else is left)."""
    start, end = 0, len(tokens)
    while start < end and _PUNCTUATION.match(tokens[start]):
        start += 1
    while end > start and _PUNCTUATION.match(tokens[end - 1]):
        end -= 1
    return tokens[start:end] or tokens


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message: string content, or its content parts' texts run together (as a chat template
    is given them); '' when it has none. A message's ``content`` is a string, a list of content parts
    (``{"type": "text", "text": ...}``; other parts carry no text), or null."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def message_texts(message: dict[str, Any]) -> list[str]:
    """Every text a message carries: its content and its tool calls' arguments. Content parts are read both
    run together (as a chat template shows them: ``"progres" + "s 12"``) and apart (``"counter" + "12"``)."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [str(p.get("text", "")) for p in content if isinstance(p, dict)]
        texts = ["".join(parts), " ".join(parts)]
    else:
        texts = [content] if isinstance(content, str) else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            texts.append(f"{fn.get('name', '')} {fn.get('arguments', '')}")
    return texts


def json_strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, object keys included (a tool schema's names, descriptions, enums)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
