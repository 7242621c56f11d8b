# The solution server (untrusted side): ``serve(code, in_fd, out_fd)`` runs the model's code as the module
# ``solution``, sends the module's public names, then answers the driver's requests (call, attribute,
# item, iteration...) until the driver hangs up. Whatever this process does -- including code that rewrites
# this loop -- it can only choose the answers it sends; the test code and its expected values are never in
# this process.


def serve(code, in_fd, out_fd):
    import os
    import sys

    stream_in = os.fdopen(in_fd, "rb")
    stream_out = os.fdopen(out_fd, "wb")
    handles = {}

    def handle(value):
        handles[id(value)] = value
        return id(value)

    def resolve(key):
        if key not in handles:
            raise LookupError("unknown handle")
        return handles[key]

    def answer(request):
        op, target = request["op"], resolve(request["h"])
        args = [from_wire(a, resolve) for a in request.get("a", [])]  # noqa: F821 - from wire.py
        if op == "call":
            kwargs = {k: from_wire(v, resolve) for k, v in request.get("k", [])}  # noqa: F821
            return target(*args, **kwargs)
        if op == "getattr":
            return getattr(target, args[0])
        if op == "setattr":
            return setattr(target, args[0], args[1])
        if op == "getitem":
            return target[args[0]]
        if op == "setitem":
            target[args[0]] = args[1]
            return None
        if op == "delitem":
            del target[args[0]]
            return None
        if op == "contains":
            return args[0] in target
        if op == "len":
            return len(target)
        if op == "iter":
            return iter(target)
        if op == "next":
            return next(target)
        if op == "bool":
            return bool(target)
        if op == "repr":
            return repr(target)
        if op == "str":
            return str(target)
        raise ValueError("unknown request " + repr(op))

    module = type(sys)("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    try:
        exec(compile(code, "solution.py", "exec"), module.__dict__)
        names = [[k, to_wire(v, handle)] for k, v in list(module.__dict__.items()) if not k.startswith("__")]  # noqa: F821
        write_message(stream_out, {"names": names})  # noqa: F821
    except BaseException as exc:  # noqa: BLE001 - the model's code failed to load: say why and stop
        write_message(stream_out, {"x": ["ImportError", "solution: " + exception_text(exc)]})  # noqa: F821
        return
    while True:
        try:
            request = read_message(stream_in)  # noqa: F821
        except WireError:  # noqa: F821
            return
        if request is None:
            return
        try:
            reply = {"v": to_wire(answer(request), handle)}  # noqa: F821
        except BaseException as exc:  # noqa: BLE001 - the model's exception is the answer
            reply = {"x": [type(exc).__name__, exception_message(exc)]}  # noqa: F821
        try:
            write_message(stream_out, reply)  # noqa: F821
        except (BrokenPipeError, ValueError):
            return
