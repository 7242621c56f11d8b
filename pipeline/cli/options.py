"""Command options generated from a config class: one option per field, the field's description its help,
the field's default its default, the field's bounds its ``min``/``max`` -- so a setting is declared once,
on its class, and the command line cannot drift from it.

``with_config(Config)`` decorates a command whose parameter ``config: Config`` is replaced, in the
signature Typer reads, by those options; the command is called with ``config=Config(**values)``. The
class is a dataclass with fields from ``pipeline.knobs.described`` (a description and bounds in the
field's metadata) or a pydantic model (``Field(description=..., ge=...)``). Typer builds its options from a
function's signature, so the decorator gives the command an ``inspect.Signature`` of ``typer.Option``
annotations (how Typer documents ``Annotated`` parameters) -- no second declaration of any option.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, get_args, get_origin

import typer

from pipeline.errors import RatchetError


@dataclasses.dataclass(frozen=True)
class Knob:
    """One field of a config class, as a command option sees it."""

    name: str
    annotation: Any
    default: Any
    description: str
    ge: float | None = None
    le: float | None = None

    @property
    def repeated(self) -> bool:
        """A ``tuple[X, ...]`` field: a repeatable option."""
        return get_origin(self.annotation) is tuple

    def option_type(self) -> Any:
        if self.repeated:
            return list[get_args(self.annotation)[0]] | None  # type: ignore[misc]
        return self.annotation

    def option_default(self) -> Any:
        if self.repeated:
            return list(self.default) or None
        return self.default

    def value(self, given: Any) -> Any:
        """The field's value from what the option gave."""
        if self.repeated:
            return self.default if given is None else tuple(given)
        return given


def knobs(cls: type) -> list[Knob]:
    """The fields of a dataclass (``pipeline.knobs.described``) or a pydantic model, in order."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{f.name} has no default: a command option needs one")
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meta = f.metadata
            if "description" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name} has no description (pipeline.knobs.described)")
            out.append(
                Knob(f.name, hints[f.name], default, meta["description"], meta.get("ge"), meta.get("le"))
            )
        return out
    fields = getattr(cls, "model_fields", None)
    if fields is None:
        raise TypeError(f"{cls.__name__} is neither a dataclass nor a pydantic model")
    out = []
    for name, info in fields.items():
        if not info.description:
            raise TypeError(f"{cls.__name__}.{name} has no description")
        bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "le") if hasattr(m, k)}
        default = info.get_default(call_default_factory=True)
        out.append(Knob(name, info.annotation, default, info.description, bounds.get("ge"), bounds.get("le")))
    return out


def flag(field: str, names: Mapping[str, str] | None = None) -> str:
    """The option of ``field``: ``--field-name`` unless ``names`` gives another."""
    return (names or {}).get(field) or "--" + field.replace("_", "-")


def options(
    cls: type, *, names: Mapping[str, str] | None = None, skip: Collection[str] = ()
) -> list[inspect.Parameter]:
    """Keyword-only parameters, one ``typer.Option`` per field of ``cls`` not in ``skip``; ``names`` maps a
    field to its option's flag when it is not ``--field-name``."""
    names = names or {}
    params = []
    for knob in knobs(cls):
        if knob.name in skip:
            continue
        decls = (names[knob.name],) if knob.name in names else ()
        option = typer.Option(*decls, help=knob.description, min=knob.ge, max=knob.le)
        params.append(
            inspect.Parameter(
                knob.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=knob.option_default(),
                annotation=Annotated[knob.option_type(), option],
            )
        )
    return params


def with_config(
    cls: type,
    *,
    param: str = "config",
    names: Mapping[str, str] | None = None,
    skip: Collection[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the options of ``cls`` (``options``) in place of its parameter ``param``, and call it
    with ``cls`` built from their values (fields in ``skip`` keep the class default: the command sets them)."""
    fields = {k.name: k for k in knobs(cls) if k.name not in skip}

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn, localns={cls.__name__: cls}, include_extras=True)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(fn).parameters.values()
            if p.name != param
        ]
        if clash := sorted({p.name for p in own} & set(fields)):
            raise TypeError(f"{fn.__name__}: parameters {clash} are also fields of {cls.__name__}")
        params = [*own, *options(cls, names=names, skip=skip)]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {name: knob.value(kwargs.pop(name)) for name, knob in fields.items()}
            try:
                config = cls(**values)
            except ValueError as exc:  # a pydantic class's own check (a dataclass's __post_init__): one line
                errors = exc.errors() if callable(getattr(exc, "errors", None)) else None  # pydantic's
                if errors:
                    said = [
                        f"{flag(str(e['loc'][0]) if e['loc'] else '', names)}: {e['msg']}" for e in errors
                    ]
                    raise RatchetError("; ".join(said)) from None
                raise RatchetError(" ".join(str(exc).split())) from None
            return fn(**kwargs, **{param: config})

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
