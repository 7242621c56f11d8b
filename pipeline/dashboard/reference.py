"""The API reference page (``/api/docs``) from the app's OpenAPI schema: what each route returns, and the fields of
every response model with their types and descriptions, rendered by the app itself (no Swagger UI from a CDN)."""

from __future__ import annotations

from pydantic import Field, JsonValue

from pipeline.dashboard.replies import Reply

__all__ = ["ModelDoc", "models", "returns", "type_text"]


class FieldDoc(Reply):
    name: str = Field(description="The field's JSON key.")
    type: str = Field(description="Its type, in short.")
    description: str = Field(description="What it holds.")


class ModelDoc(Reply):
    name: str = Field(description="The model's name (the page's anchor).")
    description: str = Field(description="Its docstring.")
    fields: list[FieldDoc] = Field(description="Its fields in order.")


def _name(ref: str) -> str:
    return ref.rsplit("/", 1)[1]


def type_text(schema: JsonValue) -> str:
    """A JSON schema as a short type: ``TraceRow``, ``list[int]``, ``dict[str, float]``, ``str | null``."""
    if not isinstance(schema, dict):
        return "any JSON"
    if isinstance(schema.get("$ref"), str):
        return _name(schema["$ref"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(type_text(s) for s in schema[key])
    if "const" in schema:
        return repr(schema["const"])
    if isinstance(schema.get("enum"), list):
        return " | ".join(repr(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        if isinstance(schema.get("prefixItems"), list):
            return f"tuple[{', '.join(type_text(s) for s in schema['prefixItems'])}]"
        return f"list[{type_text(schema.get('items', {}))}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"dict[str, {type_text(schema['additionalProperties'])}]"
    return str(kind) if isinstance(kind, str) else "any JSON"


def returns(operation: dict[str, JsonValue]) -> str | None:
    """The model a route answers 200 with (None: not JSON, or no model)."""
    ok = (operation.get("responses") or {}).get("200") or {}  # type: ignore[union-attr]
    schema = ((ok.get("content") or {}).get("application/json") or {}).get("schema") or {}
    return _name(schema["$ref"]) if isinstance(schema.get("$ref"), str) else None


def models(spec: dict[str, JsonValue]) -> list[ModelDoc]:
    """Every object model of ``spec``'s components with fields (request and error models included), by name."""
    out = []
    for name, schema in sorted(((spec.get("components") or {}).get("schemas") or {}).items()):  # type: ignore[union-attr]
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            continue
        fields = [
            FieldDoc(name=key, type=type_text(field), description=str(field.get("description") or ""))
            for key, field in properties.items()
            if isinstance(field, dict)
        ]
        out.append(ModelDoc(name=name, description=str(schema.get("description") or ""), fields=fields))
    return out
