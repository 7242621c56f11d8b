# The wire format between the sandboxed test driver and the solution: one JSON document per line.
#
# Values cross as JSON: null, booleans, numbers (NaN and infinities allowed) and strings as themselves;
# containers and other builtins as objects with one tag key: {"l": [...]} list, {"t": [...]} tuple,
# {"s": [...]} set, {"f": [...]} frozenset, {"d": [[key, value], ...]} dict, {"b": "latin-1"} bytes,
# {"c": [real, imag]} complex, {"h": id} a handle to an object that stays in the solution's process.
# Decoding builds builtins only, whatever the other side sent: a value from the solution can never be an
# object with behaviour of its own (an ``__eq__`` that always says yes). Imports: the C parts of ``json``
# only (importing ``json`` itself doubles the interpreter's start).
try:
    import _json

    class _Ctx:
        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int

        @staticmethod
        def parse_constant(name):
            return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}[name]

    _scan = _json.make_scanner(_Ctx())
    _quote = _json.encode_basestring_ascii
except (ImportError, AttributeError):  # pragma: no cover - an interpreter without the C accelerator
    import json as _json_module

    _scan = None
    _quote = _json_module.dumps

MAX_LINE = 16 << 20  # bytes of one message
MAX_DEPTH = 64  # nesting of one value
_FLOAT_TEXT = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


class WireError(Exception):
    """A message that is not valid wire data (too long, too deep, malformed)."""


def dumps(data):
    """JSON text of ``data`` (dicts with str keys, lists, str, int, float, bool, None)."""
    kind = type(data)
    if data is None:
        return "null"
    if kind is bool:
        return "true" if data else "false"
    if kind is int:
        return int.__repr__(data)
    if kind is float:
        if data != data:
            return "NaN"
        return _FLOAT_TEXT.get(data) or float.__repr__(data)
    if kind is str:
        return _quote(data)
    if kind is list:
        return "[" + ",".join(dumps(x) for x in data) + "]"
    if kind is dict:
        return "{" + ",".join(_quote(k) + ":" + dumps(v) for k, v in data.items()) + "}"
    raise WireError("cannot write " + kind.__name__)


def loads(text):
    """The JSON document in ``text`` (one line)."""
    text = text.strip()
    if _scan is None:  # pragma: no cover
        return _json_module.loads(text)
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        raise WireError("not JSON") from None
    except (ValueError, RecursionError) as exc:
        raise WireError("not JSON: " + str(exc)[:100]) from None
    if end != len(text):
        raise WireError("extra data after the JSON document")
    return value


def to_wire(value, handle, depth=0):
    """``value`` as wire data; objects that are not plain data become ``{"h": handle(value)}``."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int) and kind.__eq__ is int.__eq__:
        return int(value)
    if isinstance(value, float) and kind.__eq__ is float.__eq__:
        return float(value)
    if isinstance(value, str) and kind.__eq__ is str.__eq__:
        return str(value)
    nested = depth + 1
    if isinstance(value, (list, tuple, set, frozenset)) and kind.__eq__ in (
        list.__eq__,
        tuple.__eq__,
        set.__eq__,
        frozenset.__eq__,
    ):
        tag = (
            "t"
            if isinstance(value, tuple)
            else "f"
            if isinstance(value, frozenset)
            else "s"
            if isinstance(value, set)
            else "l"
        )
        return {tag: [to_wire(x, handle, nested) for x in value]}
    if isinstance(value, dict) and kind.__eq__ is dict.__eq__:
        return {"d": [[to_wire(k, handle, nested), to_wire(v, handle, nested)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).decode("latin-1")}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    return {"h": handle(value)}


def from_wire(data, remote, depth=0):
    """The builtin value ``data`` describes; ``remote(id)`` gives the stand-in for a handle."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deep")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is not dict or len(data) != 1:
        raise WireError("not a wire value")
    ((tag, body),) = data.items()
    nested = depth + 1
    if tag == "h" and type(body) is int:
        return remote(body)
    if tag == "b" and type(body) is str:
        return body.encode("latin-1")
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    if type(body) is not list:
        raise WireError("not a wire value")
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("not a wire dict")
            key = from_wire(pair[0], remote, nested)
            try:
                out[key] = from_wire(pair[1], remote, nested)
            except TypeError:
                raise WireError("unhashable dict key") from None
        return out
    items = [from_wire(x, remote, nested) for x in body]
    try:
        if tag == "l":
            return items
        if tag == "t":
            return tuple(items)
        if tag == "s":
            return set(items)
        if tag == "f":
            return frozenset(items)
    except TypeError:
        raise WireError("unhashable set member") from None
    raise WireError("unknown wire tag")


def read_message(stream):
    """The next message of a binary stream, or None at its end."""
    line = stream.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise WireError("message too long or cut off")
    try:
        return loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise WireError("message is not UTF-8") from None


def write_message(stream, data):
    stream.write((dumps(data) + "\n").encode("utf-8"))
    stream.flush()


def set_limits(memory, cpu, processes):
    """Resource limits of this process and its children, set before any code that is not ours runs."""
    import resource

    limits = [
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, 16 << 20),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, 64),
    ]
    if processes:
        limits.append((resource.RLIMIT_NPROC, processes))
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def exception_message(exc):
    try:
        return str(exc)[:300]
    except BaseException:  # noqa: BLE001 - a hostile __str__
        return "?"


def exception_text(exc):
    message = exception_message(exc)
    return type(exc).__name__ + (": " + message if message else "")
