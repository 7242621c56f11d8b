"""OpenAI chat messages as Ratchet reads them: the one reader of a message's text.

A message's ``content`` is a string, a list of content parts (``{"type": "text", "text": ...}``; other parts
carry no text), or null. Everything that needs a message's text -- scorers, routing, views, prompts, the
dashboard -- reads it here, so a client's content parts mean the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message: string content, or its content parts' texts run together (as a chat template
    is given them); '' when it has none."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""
