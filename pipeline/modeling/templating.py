"""Chat templates with inert content: the one place a conversation is rendered and becomes token ids.

Everything a client or the model supplied -- message text, tool-call names, ids and arguments, tool schemas --
reaches the model as literal text: a special token's text inside it (``<|im_start|>``, ``[INST]``,
``<|eot_id|>``) encodes as the ordinary tokens of those characters, never as that special token. Only the
chat template's own scaffolding yields special tokens. Serving, collection, evaluation, SFT, DPO and GRPO all
encode here (``encode_prompt``, ``packing.encode_chat``), so they agree on every id.

How (``Shield``): before rendering, every occurrence of a special added token's text in those strings is
swapped for a per-call random sentinel of private-use characters; after rendering, every special-token text
left is the template's own. That text is encoded by a private copy of the tokenizer that parses no special
token (``tokenizers``' ``encode_special_tokens``) in which the scaffolding is written as private marker
tokens, the sentinels restored to their literal text first; the markers' ids are then mapped back to the
special ids. A marker is added with its special token's own matching flags (``lstrip``, ``rstrip``,
``single_word``, ``normalized``), so the text between the scaffolding splits and pre-tokenizes exactly as in
one ordinary encode (Metaspace's "first" prepend scheme included): a conversation without special-token text
encodes to the same ids either way (tested on four template families), and it takes the ordinary encode
directly (no copy, no sentinel).

Why not transformers' ``split_special_tokens``: it switches special-token parsing off for the whole text, the
template's scaffolding included, and on a fast tokenizer it does so by setting the shared Rust tokenizer's
flag, which encodes running at the same time (serving) would see. (A tokenizer without a Rust backend takes it
per piece between the scaffolding.) Added tokens that are not special (Qwen's ``<tool_call>``, ``<think>``)
are no role markers and still encode as themselves, in training and serving alike.

Tool-call ids are rendered as templates accept them (``toolcalls.template_call_id``): 9 alphanumerics pass
unchanged (what Ratchet writes, ``toolcalls.call_id``); any other id (an ingested ``call_...``) becomes 9
alphanumerics from its hash, the same for the assistant's call and the tool result answering it (Mistral's
templates refuse anything else).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import jinja2

from pipeline.experience.texts import message_text
from pipeline.experience.toolcalls import from_openai, render_tool_calls, template_call_id

TemplateError = jinja2.TemplateError  # what a chat template's ``raise_exception`` raises
IGNORE = -100  # the label of a token that is not trained on
# Sentinels and markers are made of Unicode plane-15 private-use characters, which no special token and no
# template contains: a delimiter each (so neither is ever part of the other), 64 random bits (a per-call nonce
# for sentinels, a per-process salt for markers: nothing a client sends can forge one) and the index in hex.
_PRIVATE = 0xF0000
_SENTINEL, _MARK = chr(_PRIVATE + 0x10), chr(_PRIVATE + 0x11)
_LOCK = threading.Lock()


def _random_private() -> str:
    return "".join(chr(_PRIVATE + 0x1000 + secrets.randbelow(0xE000)) for _ in range(4))


def _digits(n: int) -> str:
    return "".join(chr(_PRIVATE + int(d, 16)) for d in f"{n:x}")


def model_messages(messages: list[dict[str, Any]], fmt: str = "compact") -> list[dict[str, Any]]:
    """Messages as the chat template takes them, tool calls in the contract's ``tool_call_format``:

    - ``openai``: assistant ``tool_calls`` stay structured (arguments as objects, as Hugging Face chat
      templates expect them; the template writes them, e.g. ``<tool_call>{json}</tool_call>``) and tool
      results keep their ``tool_call_id``;
    - ``json`` / ``compact``: the calls become the assistant's text in that format (``pipeline.experience.toolcalls``).

    Content parts are read by ``texts.message_text``; tool-call ids by ``toolcalls.template_call_id``;
    fields a template does not know are left out."""
    out = []
    for m in messages:
        role = m["role"]
        msg: dict[str, Any] = {"role": role, "content": message_text(m)}
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls and fmt == "openai":
            msg["tool_calls"] = [
                {"id": template_call_id(tc.get("id")), "type": "function", "function": dict(call)}
                for tc, call in zip(calls, from_openai(calls), strict=True)
            ]
        elif calls:
            text = render_tool_calls(from_openai(calls), fmt)
            msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = template_call_id(m["tool_call_id"])
        if m.get("name") and role == "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return out


@dataclass(frozen=True)
class _Specials:
    """A tokenizer's special added tokens: text -> id, and a pattern finding them (longest first, as the
    tokenizer's own leftmost-longest matching)."""

    ids: dict[str, int]
    pattern: re.Pattern[str] | None
    size: int


# Per tokenizer (weakly held): its specials, and its inert copy (built from those specials) once needed.
_SPECIALS: weakref.WeakKeyDictionary[Any, _Specials] = weakref.WeakKeyDictionary()
_INERT: weakref.WeakKeyDictionary[Any, tuple[_Specials, Any, dict[str, str], dict[int, int]]] = (
    weakref.WeakKeyDictionary()
)


def _specials(tokenizer: Any) -> _Specials:
    size = len(tokenizer)  # a token added since: built again
    found = _SPECIALS.get(tokenizer)
    if found is not None and found.size == size:
        return found
    ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content}
    texts = sorted(ids, key=len, reverse=True)
    found = _Specials(ids, re.compile("|".join(map(re.escape, texts))) if texts else None, size)
    with _LOCK:
        _SPECIALS[tokenizer] = found
    return found


def ordinary_encode(tokenizer: Any, text: str) -> list[int]:
    """The tokenizer's own encode of ``text`` (special-token texts parsed), no extra special tokens."""
    if not text:
        return []
    # Fast tokenizers: the Rust tokenizer itself (~5x less overhead per call), unless its saved state would
    # truncate, pad or split special tokens (transformers' own call switches those off first).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and not backend.encode_special_tokens
    ):
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _inert_core(tokenizer: Any, specials: _Specials) -> tuple[Any, dict[str, str], dict[int, int]] | None:
    """A private copy of a fast tokenizer that parses no special token, with one marker token per special
    token (same matching flags): ``(core, marker by special text, special id by marker id)``; None for a
    tokenizer without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _LOCK:
        found = _INERT.get(tokenizer)
        if found is not None and found[0] is specials:
            return found[1:]
        from tokenizers import AddedToken, Tokenizer

        core = Tokenizer.from_str(backend.to_str())
        core.no_truncation()
        core.no_padding()
        core.encode_special_tokens = True
        salt = _random_private()
        markers, added = {}, []
        decoder = tokenizer.added_tokens_decoder
        for n, (text, i) in enumerate(specials.ids.items()):
            markers[text] = f"{_MARK}{salt}{_digits(n)}{_MARK}"
            f = decoder[i]
            added.append(
                AddedToken(markers[text], single_word=f.single_word, lstrip=f.lstrip, rstrip=f.rstrip,
                           normalized=f.normalized, special=False)
            )  # fmt: skip
        core.add_tokens(added)
        back = {core.token_to_id(markers[text]): i for text, i in specials.ids.items()}
        _INERT[tokenizer] = (specials, core, markers, back)
        return core, markers, back


class Shield:
    """One rendering's protection: the special-token texts of supplied strings swapped for sentinels
    (``protect``), and rendered text encoded with only the scaffolding special (``encode``)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.specials = _specials(tokenizer)
        self.sentinels: dict[str, str] = {}  # sentinel -> the literal text it stands for
        self._by_text: dict[str, str] = {}
        self._nonce = ""

    def protect(self, value: Any) -> Any:
        """``value`` (strings, dicts -- keys too -- and lists, nested) with every special-token text swapped
        for this shield's sentinel of it."""
        if isinstance(value, str):
            pattern = self.specials.pattern
            return value if pattern is None else pattern.sub(lambda m: self._sentinel(m.group(0)), value)
        if isinstance(value, dict):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        return value

    def _sentinel(self, text: str) -> str:
        if text not in self._by_text:
            if not self._nonce:
                self._nonce = _random_private()
            sentinel = f"{_SENTINEL}{self._nonce}{_digits(len(self._by_text))}{_SENTINEL}"
            self._by_text[text] = sentinel
            self.sentinels[sentinel] = text
        return self._by_text[text]

    def restore(self, text: str) -> str:
        """``text`` with every sentinel back to the literal text it stands for."""
        for sentinel, literal in self.sentinels.items():
            text = text.replace(sentinel, literal)
        return text

    def safe_split(self, text: str, at: int) -> int:
        """``at`` moved back to the start of a sentinel or a special-token text it would cut."""
        moved = True
        while moved:
            moved = False
            found = self.specials.pattern.finditer(text) if self.specials.pattern else ()
            spans = [(m.start(), m.end()) for m in found]
            for sentinel in self.sentinels:
                start = text.find(sentinel, max(0, at - len(sentinel) + 1))
                if start >= 0:
                    spans.append((start, start + len(sentinel)))
            for start, end in spans:
                if start < at < end:
                    at, moved = start, True
        return at

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered ``text``: each special-token text in it (the template's scaffolding) is
        that special token; sentinels encode as the literal text they stand for, special parsing off."""
        if not text:
            return []
        if not self.sentinels:
            return ordinary_encode(self.tokenizer, text)
        pattern = self.specials.pattern
        assert pattern is not None  # a sentinel exists only for a special-token text
        inert = _inert_core(self.tokenizer, self.specials)
        if inert is not None:
            core, markers, back = inert
            marked = self.restore(pattern.sub(lambda m: markers[m.group(0)], text))
            return [back.get(i, i) for i in core.encode(marked, add_special_tokens=False).ids]
        ids: list[int] = []  # a tokenizer without a Rust backend: the pieces between the scaffolding
        at = 0
        for m in [*pattern.finditer(text), None]:
            piece = self.restore(text[at : m.start() if m else len(text)])
            if piece:
                ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if m is not None:
                ids.append(self.specials.ids[m.group(0)])
                at = m.end()
        return ids

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kw: Any) -> str:
        """The chat template's text of already protected ``messages`` and ``tools`` (sentinels in place)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **kw)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt as text, to read (logs, tests): the conversation so far (tool calls in ``fmt``, the
    offered tools' schemas given to the template) plus the assistant header. Never tokenize it: its
    content's special-token texts would parse as special tokens; ``encode_prompt`` gives the ids."""
    shield = Shield(tokenizer)
    text = shield.render(
        shield.protect(model_messages(messages, fmt)), shield.protect(tools), add_generation_prompt=True
    )
    return shield.restore(text)


def encode_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Prompt token ids for generation: ``render_prompt``'s conversation with only the template's
    scaffolding as special tokens. ``TemplateError`` when the template rejects the conversation."""
    shield = Shield(tokenizer)
    text = shield.render(
        shield.protect(model_messages(messages, fmt)), shield.protect(tools), add_generation_prompt=True
    )
    return shield.encode(text)


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a conversation's token ids: the tokenizer's own definition (vocabulary, merges,
    normalizer, pre-tokenizer, added and special tokens) and its chat template. Two tokenizers with the same
    fingerprint give the same ids for the same conversation, so stored served ids may stand for a re-rendering.
    Cached per tokenizer object."""
    try:
        return _FINGERPRINTS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole serialised definition
        definition = backend.to_str()
    else:  # a slow one: what its vocabulary and special tokens say
        definition = json.dumps(
            {
                "vocab": sorted(tokenizer.get_vocab().items()),
                "special": sorted(map(str, tokenizer.all_special_tokens)),
            },
            ensure_ascii=False,
        )
    template = getattr(tokenizer, "chat_template", None) or ""
    digest = hashlib.sha256(definition.encode("utf-8"))
    digest.update(b"\x1e" + json.dumps(template, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    fingerprint = digest.hexdigest()
    try:
        _FINGERPRINTS[tokenizer] = fingerprint
    except TypeError:  # not weakly referenceable: computed each time
        pass
    return fingerprint


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as literal text: no special-token text in it is parsed as a special token."""
    shield = Shield(tokenizer)
    return shield.encode(shield.protect(text))


TEMPLATE_ERROR = "template error"
TOO_LONG = "too long"
REWRITES = "template rewrites the final turn"


class RowSkipped(ValueError):
    """A conversation that cannot become a training example, and why (``reason``: ``TEMPLATE_ERROR``,
    ``TOO_LONG`` or ``REWRITES``); the caller leaves the row out and counts it."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _context_turns(msgs: list[dict[str, Any]], last: int) -> tuple[list[int], list[list[int]]]:
    """``(system, turns)``: the index of a leading system message, and the indices of the messages before
    the final assistant turn grouped in turns (a turn starts at a user message), oldest first."""
    system = [0] if msgs and msgs[0]["role"] == "system" and last > 0 else []
    turns: list[list[int]] = []
    for i in range(len(system), last):
        if msgs[i]["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(i)
    return system, turns


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _encode_turn(
    tokenizer: Any, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[int]]:
    """Ids and labels of ``msgs``, whose last message is the assistant turn trained on."""
    shield = Shield(tokenizer)
    protected, shown = shield.protect(msgs), shield.protect(tools)
    try:
        prefix = shield.render(protected[:-1], shown, add_generation_prompt=True)
        full = shield.render(protected, shown)
    except TemplateError as exc:
        raise RowSkipped(TEMPLATE_ERROR, _first_line(exc)) from exc
    stable = full.startswith(prefix)
    split = len(prefix)
    if not stable:  # the history ends in ``full`` where a render with a stand-in reply starts to differ
        stand_in = {"role": "assistant", "content": _random_private()}
        try:
            split = _common_prefix(shield.render([*protected[:-1], stand_in], shown), full)
        except TemplateError:
            split = _common_prefix(prefix, full)
        while split > 0 and full[split - 1] == " ":  # "[/INST] answer": the space is the reply's
            split -= 1
    answer = protected[-1]["content"].strip()
    if not stable and answer and answer not in full[split:]:
        raise RowSkipped(
            REWRITES, "the chat template rewrites the final assistant turn; cannot locate its tokens"
        )
    split = shield.safe_split(full, split)
    context, turn = shield.encode(full[:split]), shield.encode(full[split:])
    return context + turn, [IGNORE] * len(context) + turn


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_len: int,
    *,
    fmt: str = "compact",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and labels for a conversation; labels are -100 except on the final assistant turn (its
    content and the template's end marker). Content is inert (``Shield``): a role marker the model did not
    write never becomes a label or a role.

    Two renders: the conversation before the final assistant turn with the generation prompt (the prompt,
    tokenized as at generation time: ``encode_prompt`` gives the same ids), then the conversation through it
    (the rest is the turn, trained on). Messages after it carry no label and are left out. A template that is
    not prefix-stable -- it rewrites history (drops earlier reasoning), opens the generation prompt with text
    the stored turn lacks (a forced ``<think>``) or moves the system prompt (Mistral v0.3: into the last user
    message only) -- is handled: the labels start where a render with a stand-in reply first differs from
    the conversation's, and only if what follows still holds the turn's own text.

    Longer than ``max_len``: the oldest context turns go (a turn starts at a user message; the system prompt
    and the turn that asks for the reply stay) until it fits; the end is never cut. ``RowSkipped`` (a
    ``ValueError``) when it cannot be encoded: ``TOO_LONG`` (it still does not fit), ``TEMPLATE_ERROR``
    (the template refuses it: ``raise_exception``), ``REWRITES`` (the turn's own text cannot be found).
    A conversation without an assistant turn is all prompt (cut to ``max_len``; nothing is trained on it).
    """
    msgs = model_messages(messages, fmt)
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        shield = Shield(tokenizer)
        try:
            text = shield.render(shield.protect(msgs), shield.protect(tools))
        except TemplateError as exc:
            raise RowSkipped(TEMPLATE_ERROR, _first_line(exc)) from exc
        ids = shield.encode(text)[:max_len]
        return ids, [IGNORE] * len(ids)
    system, turns = _context_turns(msgs, last)
    while True:
        kept = [msgs[i] for i in system] + [msgs[i] for turn in turns for i in turn] + [msgs[last]]
        ids, labels = _encode_turn(tokenizer, kept, tools)
        if len(ids) <= max_len:
            return ids, labels
        if len(turns) <= 1:
            raise RowSkipped(TOO_LONG, f"{len(ids)} tokens with only the system prompt and the final turn, "
                             f"over max_seq_len {max_len}")  # fmt: skip
        turns = turns[1:]
