"""Grammars for constrained decoding: a JSON schema, any JSON object, or tool calls in a harness's format,
compiled for a tokenizer into per-token masks (``xgrammar``) that the batched decoder applies row by row.

Library chosen by measurement (issue 25; 2026-12-05, this 2-core machine, one thread, xgrammar 0.2.9 vs
llguidance 1.9.1; three schemas: flat with bounds, a pydantic-style model, nested with a pattern; mask
time per row per token = median over 16 rows driven with random allowed tokens):

===================  =================  ==================  ==================  ===================
tokenizer            xgrammar compile   xgrammar mask       llguidance compile  llguidance mask
===================  =================  ==================  ==================  ===================
tiny char (106)      0.5-0.8 ms         1-2 us              refused: its ``Fuse`` decoder ("can't determine
                                                            decoder type"): needs a hand-made byte table
test BPE (400)       0.6-5 ms           1-2 us (max 5)      0.7-2 ms            4-35 us (max 310)
bench BPE (32,768)   4-16 ms            2-20 us (max 480)   0.7-1.2 ms          28-130 us (max 1,450)
===================  =================  ==================  ==================  ===================

xgrammar: masks 5-20x faster (what the >= 0.9x constrained/unconstrained throughput goal turns on when a
decoding step is cheap) and it takes both tokenizers as they are. Its cost: no resource limits of its own
(llguidance's fuel refused every hostile schema below within 0.7 s), measured: an ``anyOf`` of 3,000
objects with ``x{i}`` patterns compiled for over 60 s (300: 1.3 s), 300 nested objects 2 s, 5,000
properties 1 s. So a schema from a client is checked first (``LIMITS``: size, depth, nodes, alternatives,
pattern length and repetitions, all refused with ``GrammarError``), and compiling runs in its own thread
(xgrammar releases the GIL) under a deadline (``COMPILE_SECONDS``), at most ``MAX_COMPILING`` at once (one
past its deadline runs on to its end, counted); a refused spec is remembered, so a client repeating it costs
nothing. Compiled grammars are cached per (tokenizer fingerprint, vocabulary size, spec), least recently
used first out (``CACHE_SIZE``). Two xgrammar 0.2.9 faults are worked around (see ``_LOOSE_CHAR`` and
``_compact_ebnf``): length-bounded strings let control characters through, and a rule repeated ``{m,n}`` is
copied (a parallel compact grammar took 1.8 s on the 32k vocabulary, 15 ms as a chain of rules).

A tool-call grammar may be united with a JSON schema or any JSON object (``or_schema`` / ``or_object``, one
``xgrammar.Grammar.union``; tools under ``tool_choice`` auto with a response format): measured the same day, a
first compile takes 1.4-8 ms on the 32k vocabulary (plain calls: 1.3-2.5 ms), a cached one 8-28 us.

``bench/serve.py --measure grammar`` (same day, 64 rows of 32 tokens, batch 64, best of 5): a JSON-schema
constraint runs at 0.94x (tiny) and 1.00x (real proportions, 32k vocabulary) the unconstrained tokens/s
(wall); a first compile takes 0.6-2.3 ms (tiny) and 4.5-8.9 ms (32k), a cached one 5-40 us.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from pipeline.errors import RatchetError
from pipeline.modeling.templating import tokenizer_fingerprint

KINDS = ("json_schema", "json_object", "tool_calls")
FORMATS = ("json", "openai", "compact")
CACHE_SIZE = 256  # compiled grammars kept (a few MB at most each on a 32k vocabulary)
COMPILE_SECONDS = 10.0  # a compile past this is refused (and its spec remembered as refused)
LIMITS = {
    "bytes": 65_536,  # canonical JSON of a schema or a tools list
    "depth": 32,  # nesting of objects/arrays in the schema document (an object property: 2 levels)
    "nodes": 2_000,  # objects in the schema document
    "alternatives": 256,  # anyOf / oneOf / allOf branches, summed over the schema
    "pattern_chars": 512,  # one regex pattern
    "repeat_total": 2_048,  # {m,n} counts in patterns, summed over the schema
    "tools": 128,  # tools offered to one call
}
COMPACT_VALUE_CHARS = 16  # a compact string value's maxLength up to this is kept (longer: unbounded)
INT_DIGITS = 12  # longest integer the compact grammar writes
MAX_PARALLEL_CALLS = 8  # calls in one parallel reply (a model that repeats itself still finishes)


class GrammarError(RatchetError):
    """A grammar that cannot be used: an invalid or too large schema, or one the library cannot compile."""


class GrammarBusy(GrammarError):
    """Every compile slot (``MAX_COMPILING``) is taken: the spec may be fine, retry shortly."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain a completion to (hashable: the compile cache's key).

    ``kind``: ``json_schema`` (``schema``: its canonical JSON), ``json_object`` (any JSON object) or
    ``tool_calls`` (``tools``: canonical JSON list of ``{"name", "parameters"}``; ``fmt``: the harness's
    ``tool_call_format``; ``parallel``: one call or several; ``schema`` given: or, instead of calls, one
    JSON value valid under it; ``or_object``: or any JSON object)."""

    kind: str
    schema: str = ""
    tools: str = ""
    fmt: str = "json"
    parallel: bool = True
    or_object: bool = False


def _canonical(value: Any, what: str) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if len(text.encode("utf-8")) > LIMITS["bytes"]:
        raise GrammarError(f"{what} is over {LIMITS['bytes']} bytes")
    return text


_COUNTED = {
    "nodes": "schema objects",
    "alternatives": "anyOf/oneOf/allOf branches",
    "repeat_total": "pattern repetitions ({m,n} counts summed)",
}
_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_schema_limits(schema: Any, what: str = "the JSON schema") -> None:
    """Refuse a schema that is too big, deep or branching to compile quickly (``LIMITS``), or invalid."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{what} must be a JSON object")
    totals = {"nodes": 0, "alternatives": 0, "repeat_total": 0}
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > LIMITS["depth"]:
            raise GrammarError(f"{what} is nested deeper than {LIMITS['depth']} levels")
        if isinstance(node, dict):
            totals["nodes"] += 1
            for key in ("anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), list):
                    totals["alternatives"] += len(node[key])
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                if len(pattern) > LIMITS["pattern_chars"]:
                    raise GrammarError(f"{what} has a pattern over {LIMITS['pattern_chars']} characters")
                for low, high in _REPEAT.findall(pattern):
                    totals["repeat_total"] += max(int(low or 0), int(high or 0))
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        else:
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
        for name, count in totals.items():
            if count > LIMITS[name]:
                raise GrammarError(f"{what} is too large to compile: over {LIMITS[name]} {_COUNTED[name]}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"{what} is not a valid JSON schema: {exc.message[:200]}") from None
    except (RecursionError, ValueError, TypeError) as exc:
        raise GrammarError(f"{what} cannot be read: {str(exc)[:200]}") from None


def json_schema_grammar(schema: dict[str, Any]) -> GrammarSpec:
    """Completions that are JSON valid against ``schema`` (checked against ``LIMITS`` here)."""
    check_schema_limits(schema)
    return GrammarSpec("json_schema", schema=_canonical(schema, "the JSON schema"))


def json_object_grammar() -> GrammarSpec:
    """Completions that are one JSON object (OpenAI's ``json_object``)."""
    return GrammarSpec("json_object")


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """``{"name", "parameters"}`` of an OpenAI tool (``{"type": "function", "function": {...}}``) or of a
    bare function definition."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("every tool needs a function name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    check_schema_limits(params, f"the parameters of tool {name!r}")
    return {"name": name, "parameters": params}


def tool_call_grammar(
    tools: Sequence[dict[str, Any]],
    *,
    fmt: str,
    parallel: bool,
    or_schema: dict[str, Any] | None = None,
    or_object: bool = False,
) -> GrammarSpec:
    """Completions that are calls of ``tools`` (one entry: that tool is named) written as
    ``pipeline.experience.toolcalls`` writes format ``fmt``: ``json`` the renderer's JSON (one object, or a
    list of two to ``MAX_PARALLEL_CALLS``), ``openai`` ``<tool_call>`` blocks as chat templates write them, ``compact``
    ``name(key=value,...)`` lines. ``parallel`` false: exactly one call. ``or_schema`` / ``or_object``: or,
    instead, one JSON value valid under that schema / any JSON object (tools under ``tool_choice`` auto with
    a response format: the answer is calls, or the format's JSON)."""
    if or_schema is not None and or_object:
        raise GrammarError("a tool-call grammar takes or_schema or or_object, not both")
    schema = ""
    if or_schema is not None:
        check_schema_limits(or_schema)
        schema = _canonical(or_schema, "the JSON schema")
    if fmt not in FORMATS:
        raise GrammarError(f"unknown tool_call_format {fmt!r}; known: {', '.join(FORMATS)}")
    if not tools:
        raise GrammarError("a tool-call grammar needs at least one tool")
    if len(tools) > LIMITS["tools"]:
        raise GrammarError(f"more than {LIMITS['tools']} tools")
    functions = [_function(t) for t in tools]
    return GrammarSpec(
        "tool_calls",
        schema=schema,
        tools=_canonical(functions, "the tools"),
        fmt=fmt,
        parallel=bool(parallel),
        or_object=bool(or_object),
    )


# ------------------------------------------------------------------------------------------ grammars
def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)  # an EBNF string literal has JSON's escapes


_VALUE_CHARS = r"[^,=()\0-\x1f\x7f\x85\u2028\u2029]"  # what parse_compact_calls reads back as one value


def _compact_value(prop: Any) -> str:
    """EBNF of one compact argument value: what the format can say of the property's schema."""
    prop = prop if isinstance(prop, dict) else {}
    kinds = prop.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    enum = prop.get("enum") if isinstance(prop.get("enum"), list) else None
    if enum is None and "const" in prop:
        enum = [prop["const"]]
    if enum is not None:
        ok = [
            v
            for v in enum
            if (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, str) and v and not v.lstrip("-").isdigit() and not re.search(r"[,=()\s]", v))
        ]
        if ok:
            return "(" + " | ".join(_ebnf_literal(str(v)) for v in ok) + ")"
    if kinds & {"integer", "number"}:
        low, high = prop.get("minimum"), prop.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low <= 256:
            return "(" + " | ".join(_ebnf_literal(str(v)) for v in range(low, high + 1)) + ")"
        return f'("-"? [0-9]{{1,{INT_DIGITS}}})'
    # never all digits (it would read back as an integer): the first character is not a digit nor "-"
    first = r"[^,=()\0-\x1f\x7f\x85\u2028\u2029\-0-9]"
    longest = prop.get("maxLength")
    if not isinstance(longest, int) or longest > COMPACT_VALUE_CHARS:  # a bounded repeat compiles slowly
        return f"({first} {_VALUE_CHARS}*)"
    return f"({first} {_VALUE_CHARS}{{0,{longest - 1}}})" if longest > 1 else first


def _compact_ebnf(functions: list[dict[str, Any]], parallel: bool) -> str:
    """``name(key=value,...)`` per tool: properties in the schema's order, the required ones always."""
    # up to MAX_PARALLEL_CALLS calls as a chain of rules (xgrammar copies a rule repeated with {m,n})
    rules = ["root ::= call more1" if parallel else "root ::= call"]
    rules += [f'more{k} ::= "" | ("\\n" call more{k + 1})' for k in range(1, MAX_PARALLEL_CALLS - 1)]
    rules.append(f'more{MAX_PARALLEL_CALLS - 1} ::= "" | ("\\n" call)')
    rules.append("call ::= " + " | ".join(f"tool{i}" for i in range(len(functions))))
    values: dict[str, str] = {}  # a value's EBNF -> its rule, shared (xgrammar's compile time is per rule)
    for i, fn in enumerate(functions):
        params = fn["parameters"] if isinstance(fn["parameters"], dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or [])
        items = [(k, v, k in required) for k, v in props.items() if str(k).isidentifier()]
        rules.append(f"tool{i} ::= {_ebnf_literal(fn['name'] + '(')} t{i}a0f {_ebnf_literal(')')}")
        for j, (key, prop, needed) in enumerate(items):
            value = values.setdefault(_compact_value(prop), f"value{len(values)}")
            for first in (True, False):
                name = f"t{i}a{j}{'f' if first else 'n'}"
                sep = "" if first else ","
                this = f"{_ebnf_literal(sep + key + '=')} {value} t{i}a{j + 1}n"
                skip = f" | t{i}a{j + 1}{'f' if first else 'n'}" if not needed else ""
                rules.append(f"{name} ::= ({this}){skip}")
        for first in (True, False):
            rules.append(f't{i}a{len(items)}{"f" if first else "n"} ::= ""')
    rules += [f"{name} ::= {body}" for body, name in values.items()]
    return "\n".join(rules)


# xgrammar 0.2.9 writes a length-bounded string's characters as this class, control characters (a tab)
# included, which no JSON parser reads; the grammar's text is given the JSON string class instead
_LOOSE_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _schema_grammar(schema: Any, separators: tuple[str, str]) -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    grammar = xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=separators)
    text = str(grammar)
    return xg.Grammar.from_ebnf(text.replace(_LOOSE_CHAR, _JSON_CHAR)) if _LOOSE_CHAR in text else grammar


def _grammar(spec: GrammarSpec) -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    if spec.kind == "json_schema":
        return _schema_grammar(json.loads(spec.schema), (",", ":"))
    if spec.kind == "json_object":
        return _object_grammar()
    if spec.kind != "tool_calls":
        raise GrammarError(f"unknown grammar kind {spec.kind!r}; known: {', '.join(KINDS)}")
    calls = _calls_grammar(spec)
    if spec.schema:  # the union: xgrammar renames the two grammars' rules apart
        return xg.Grammar.union(calls, _schema_grammar(json.loads(spec.schema), (",", ":")))
    return xg.Grammar.union(calls, _object_grammar()) if spec.or_object else calls


def _object_grammar() -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    return xg.Grammar.from_json_schema(
        '{"type":"object"}', any_whitespace=False, separators=(",", ":"), strict_mode=False
    )


def _calls_grammar(spec: GrammarSpec) -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    functions = json.loads(spec.tools)
    if spec.fmt == "compact":
        return xg.Grammar.from_ebnf(_compact_ebnf(functions, spec.parallel))
    calls = {"anyOf": [_call_schema(fn) for fn in functions]}
    if spec.fmt == "json":  # the renderer: one object, or a list of two or more
        schema = (
            {
                "anyOf": [
                    calls,
                    {"type": "array", "items": calls, "minItems": 2, "maxItems": MAX_PARALLEL_CALLS},
                ]
            }
            if spec.parallel
            else calls
        )
        return _schema_grammar(schema, (",", ":"))
    # openai: the chat template writes the calls, `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
    body = str(_schema_grammar(calls, (", ", ": ")))
    block = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "<tool_call>\n"},
            {"type": "grammar", "grammar": body},
            {"type": "const_string", "value": "\n</tool_call>"},
        ],
    }
    more = {
        "type": "repeat",
        "min": 0,
        "max": MAX_PARALLEL_CALLS - 1,
        "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, block]},
    }
    fmt = {"type": "sequence", "elements": [block, more]} if spec.parallel else block
    return xg.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


# ------------------------------------------------------------------------------------------ compiling
_lock = threading.Lock()
_infos: OrderedDict[tuple[str, int], Any] = OrderedDict()
_bytes: dict[tuple[str, int], list[bytes]] = {}
_compiled: OrderedDict[tuple[str, int, GrammarSpec], Any] = OrderedDict()  # value: CompiledGrammar | str
MAX_COMPILING = 4  # compiles running at once, those past their deadline included (they run to their end)
_running = threading.BoundedSemaphore(MAX_COMPILING)
stats = {"compiles": 0, "hits": 0, "refused": 0}


def _vocab(tokenizer: Any, vocab_size: int | None) -> int:
    return int(vocab_size or len(tokenizer))


def _info(tokenizer: Any, vocab_size: int) -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    key = (tokenizer_fingerprint(tokenizer), vocab_size)
    with _lock:
        if key in _infos:
            _infos.move_to_end(key)
            return _infos[key]
    info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    with _lock:
        _infos[key] = info
        while len(_infos) > 8:
            _infos.popitem(last=False)
    return info


def _build(info: Any, spec: GrammarSpec) -> Any:
    import xgrammar as xg  # lazy: xgrammar imports torch

    grammar = _grammar(spec)
    return xg.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)


def compile_grammar(tokenizer: Any, spec: GrammarSpec, *, vocab_size: int | None = None) -> Any:
    """The ``xgrammar.CompiledGrammar`` of ``spec`` for ``tokenizer`` (cached; ``vocab_size``: the model's
    logits width when it is larger than the tokenizer). Raises ``GrammarError``."""
    vocab = _vocab(tokenizer, vocab_size)
    key = (tokenizer_fingerprint(tokenizer), vocab, spec)
    with _lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            stats["hits"] += 1
            found = _compiled[key]
            if isinstance(found, str):
                raise GrammarError(found)
            return found
    info = _info(tokenizer, vocab)
    if not _running.acquire(blocking=False):  # not remembered: the spec itself may be fine
        raise GrammarBusy(f"{MAX_COMPILING} grammars are compiling now: retry in a few seconds")
    done: list[Any] = []

    def build() -> None:
        try:
            done.append(_build(info, spec))
        except GrammarError as exc:
            done.append(str(exc))
        except Exception as exc:  # the library's own refusal (an unsupported or contradictory schema)
            done.append(f"the grammar cannot be compiled: {str(exc).strip().splitlines()[-1][:300]}")
        finally:
            _running.release()

    worker = threading.Thread(target=build, name="grammar-compile", daemon=True)
    worker.start()
    worker.join(COMPILE_SECONDS)  # xgrammar releases the GIL while it compiles
    compiled: Any = (
        done[0] if done else f"the grammar did not compile within {COMPILE_SECONDS:g} s: simplify the schema"
    )
    with _lock:
        _compiled[key] = compiled
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
        if isinstance(compiled, str):
            stats["refused"] += 1
            raise GrammarError(compiled)
        stats["compiles"] += 1
    return compiled


def check_grammar(tokenizer: Any, spec: GrammarSpec, *, vocab_size: int | None = None) -> None:
    """Compile ``spec`` for ``tokenizer`` now (cached), raising ``GrammarError`` when it cannot be used."""
    compile_grammar(tokenizer, spec, vocab_size=vocab_size)


def clear_cache() -> None:
    """Forget every compiled grammar (benchmarks measure a first compile)."""
    with _lock:
        _compiled.clear()


def new_matcher(tokenizer: Any, spec: GrammarSpec, *, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """A fresh ``xgrammar.GrammarMatcher`` for one row: ``stop_ids`` are allowed only where the grammar is
    complete, and accepting one ends it."""
    import xgrammar as xg  # lazy: xgrammar imports torch

    compiled = compile_grammar(tokenizer, spec, vocab_size=vocab_size)
    return xg.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids) or None)


def allocate_bitmask(rows: int, vocab_size: int) -> Any:
    """An int32 bitmask of ``rows`` x ceil(vocab / 32) words, every token allowed."""
    import xgrammar as xg  # lazy: xgrammar imports torch

    return xg.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens that ``bitmask`` forbids, on ``rows`` of ``logits`` (float32,
    any device; the other rows are left alone)."""
    import xgrammar as xg  # lazy: xgrammar imports torch

    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    width = bitmask.shape[-1] * 32
    if logits.shape[-1] > width:  # ids past the tokenizer's table are never grammatical
        logits[rows, width:] = float("-inf")
    backend = "auto" if logits.device.type in ("cpu", "cuda") else "torch_native"  # C++ / triton, else torch
    xg.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=min(width, logits.shape[-1]), indices=rows, backend=backend
    )


def token_bytes(tokenizer: Any, vocab_size: int | None = None) -> list[bytes]:
    """Each token id's bytes as the tokenizer decodes it (byte-level and byte-fallback tokens included)."""
    key = (tokenizer_fingerprint(tokenizer), _vocab(tokenizer, vocab_size))
    with _lock:
        found = _bytes.get(key)
    if found is None:
        found = _info(tokenizer, key[1]).decoded_vocab
        with _lock:
            _bytes[key] = found
            while len(_bytes) > 8:
                _bytes.pop(next(iter(_bytes)))
    return found
