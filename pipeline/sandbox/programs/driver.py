# The test driver (trusted side): ``drive(tests, to_fd, from_fd, result_fd)`` runs the test code, in which
# the solution's names are stand-ins (``Remote``) whose every use is a request to the solution's process,
# answered with plain data or another stand-in: the driver never runs the model's code. Each test's verdict
# goes to the host over ``result_fd``, which the solution's process does not have.
import builtins
import os
import sys

_to = _from = _result = None


class RemoteError(Exception):
    """The solution raised an exception that is not a builtin one, or stopped answering."""


def _raise(op, name, message):
    """Raise the solution's exception in the test as the builtin exception of that name (so a test may
    expect it), or as RemoteError. StopIteration only ends an iteration the test itself drives (``next``):
    raised from a call it would silently end the test's ``map``/``all`` loops."""
    found = getattr(builtins, name, None) if type(name) is str else None
    if name in ("StopIteration", "StopAsyncIteration") and op != "next":
        found = None
    if isinstance(found, type) and issubclass(found, Exception) and type(message) is str:
        raise found(message)
    raise RemoteError(str(name)[:100] + ": " + str(message)[:300])


def _handle(value):
    if type(value) is Remote:
        return object.__getattribute__(value, "_h")
    raise TypeError("cannot pass " + type(value).__name__ + " to the solution (plain data only)")


def _rpc(op, target, args=(), kwargs=None):
    request = {"op": op, "h": target, "a": [to_wire(a, _handle) for a in args]}  # noqa: F821
    if kwargs:
        request["k"] = [[k, to_wire(v, _handle)] for k, v in kwargs.items()]  # noqa: F821
    try:
        write_message(_to, request)  # noqa: F821
        reply = read_message(_from)  # noqa: F821
    except (OSError, ValueError, WireError) as exc:  # noqa: F821
        raise RemoteError("the solution stopped answering (" + type(exc).__name__ + ")") from None
    if reply is None:
        raise RemoteError("the solution exited")
    if type(reply) is not dict:
        raise RemoteError("malformed reply")
    if "x" in reply:
        error = reply["x"]
        if type(error) is not list or len(error) != 2:
            raise RemoteError("malformed error reply")
        _raise(op, error[0], error[1])
    if "v" not in reply:
        raise RemoteError("malformed reply")
    try:
        return from_wire(reply["v"], Remote)  # noqa: F821
    except WireError as exc:  # noqa: F821
        raise RemoteError("malformed value: " + str(exc)) from None


class Remote:
    """A stand-in for an object that lives in the solution's process. Equality is identity of the handle:
    the solution can never decide that a stand-in equals the expected value."""

    __slots__ = ("_h",)

    def __init__(self, handle):
        object.__setattr__(self, "_h", handle)

    def __getattr__(self, name):
        return _rpc("getattr", object.__getattribute__(self, "_h"), (name,))

    def __setattr__(self, name, value):
        _rpc("setattr", object.__getattribute__(self, "_h"), (name, value))

    def __call__(self, *args, **kwargs):
        return _rpc("call", object.__getattribute__(self, "_h"), args, kwargs)

    def __getitem__(self, key):
        return _rpc("getitem", object.__getattribute__(self, "_h"), (key,))

    def __setitem__(self, key, value):
        _rpc("setitem", object.__getattribute__(self, "_h"), (key, value))

    def __delitem__(self, key):
        _rpc("delitem", object.__getattribute__(self, "_h"), (key,))

    def __contains__(self, item):
        return _rpc("contains", object.__getattribute__(self, "_h"), (item,)) is True

    def __len__(self):
        return _rpc("len", object.__getattribute__(self, "_h"))

    def __iter__(self):
        found = _rpc("iter", object.__getattribute__(self, "_h"))
        return found if type(found) is Remote else iter(found)

    def __next__(self):
        return _rpc("next", object.__getattribute__(self, "_h"))

    def __bool__(self):
        return _rpc("bool", object.__getattribute__(self, "_h")) is True

    def __repr__(self):
        text = _rpc("repr", object.__getattribute__(self, "_h"))
        return text if type(text) is str else "<remote>"

    def __str__(self):
        text = _rpc("str", object.__getattribute__(self, "_h"))
        return text if type(text) is str else "<remote>"

    def __eq__(self, other):
        return type(other) is Remote and object.__getattribute__(other, "_h") == object.__getattribute__(
            self, "_h"
        )

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(("remote", object.__getattribute__(self, "_h")))


def _report(data):
    _result.write((dumps(data) + "\n").encode("utf-8"))  # noqa: F821
    _result.flush()


def _failure(exc):
    return exception_text(exc)  # noqa: F821


def drive(tests_source, to_fd, from_fd, result_fd):
    global _to, _from, _result
    _to, _from, _result = os.fdopen(to_fd, "wb"), os.fdopen(from_fd, "rb"), os.fdopen(result_fd, "wb")
    try:
        _run_tests(tests_source)
    finally:
        _report({"done": True})


def _run_tests(_tests_source):
    try:
        hello = read_message(_from)  # noqa: F821
    except WireError as exc:  # noqa: F821
        hello = {"x": ["ImportError", "solution: " + str(exc)]}
    if type(hello) is not dict or "names" not in hello:
        error = hello.get("x") if type(hello) is dict else None
        why = error[1] if type(error) is list and len(error) == 2 and type(error[1]) is str else "exited"
        _report({"total": 1})
        _report({"test": "solution", "ok": False, "error": why[:300]})
        return
    module = type(sys)("solution")
    names = {}
    for entry in hello["names"] if type(hello["names"]) is list else []:
        if type(entry) is list and len(entry) == 2 and type(entry[0]) is str and entry[0].isidentifier():
            if entry[0].startswith("__"):
                continue  # never a dunder (``__builtins__``, ``__all__``...): they would rewire the tests
            try:
                names[entry[0]] = from_wire(entry[1], Remote)  # noqa: F821
            except WireError:  # noqa: F821
                continue
    # The test code sees the solution's public names, except any that would shadow a builtin: a solution
    # could otherwise replace the ``range``, ``len`` or ``abs`` the tests themselves rely on. A function
    # that is meant to be called like a builtin is reached as ``solution.<name>``.
    public = sorted(k for k in names if not k.startswith("_") and k not in builtins.__dict__)
    for key, value in names.items():
        setattr(module, key, value)
    module.__all__ = public
    sys.modules["solution"] = module
    namespace = {"__builtins__": builtins, "__name__": "tests"}
    namespace.update((key, names[key]) for key in public)
    try:
        exec(compile(_tests_source, "tests.py", "exec"), namespace)
        top_error = None
    except BaseException as exc:  # noqa: BLE001 - a failing top-level assert is a failed test
        top_error = _failure(exc)
    function = type(_run_tests)
    tests = [
        (key, value)
        for key, value in namespace.items()
        if key.startswith("test") and type(value) is function and value.__code__.co_filename == "tests.py"
    ]
    if top_error is not None or not tests:  # the whole source is one test
        _report({"total": 1})
        _report({"test": "tests.py", "ok": top_error is None, "error": top_error})
        return
    _report({"total": len(tests)})
    for key, fn in tests:
        try:
            fn()
            _report({"test": key, "ok": True})
        except BaseException as exc:  # noqa: BLE001 - any exception fails that test
            _report({"test": key, "ok": False, "error": _failure(exc)})
