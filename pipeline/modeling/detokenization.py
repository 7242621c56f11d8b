"""Exact incremental detokenization: the text of a reply, grown one generated token at a time.

Decoding each token on its own is wrong for real tokenizers: byte-level BPE splits a multi-byte UTF-8
character (an emoji, most CJK, often an accented letter) across tokens, each of which decodes to U+FFFD
alone, and Metaspace/SentencePiece decoders turn the word marker into a space only in context. The
streamed text must equal ``tokenizer.decode(ids, skip_special_tokens=True)`` at every point where it
ends on a whole character. ``tokenizers``' ``DecodeStream`` does exactly that for fast tokenizers (the
only kind transformers 5 loads); a tokenizer without a Rust backend gets the same result by decoding the
whole prefix each step, which is quadratic but correct.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class TextStream:
    """One reply's text: ``push`` each generated token id, read ``text``; special tokens add nothing."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token_id)
        if self._backend is not None:
            chunk = self._stream.step(self._backend, token_id) or ""
        else:
            full = self._tokenizer.decode(self.ids, skip_special_tokens=True)
            if full.endswith(REPLACEMENT) or not full.startswith(self.text):
                return ""  # a character still incomplete: wait for the token that finishes it
            chunk = full[len(self.text) :]
        self.text += chunk
        return chunk

    def final(self) -> str:
        """The whole reply as ``tokenizer.decode`` gives it (an incomplete last character included)."""
        if not self.ids:
            return ""
        return self._tokenizer.decode(self.ids, skip_special_tokens=True)
