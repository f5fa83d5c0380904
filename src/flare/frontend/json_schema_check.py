"""Which JSON Schemas a grammar can enforce: the keywords xgrammar's converter would otherwise skip.

xgrammar turns a schema into a grammar, but some keywords it only warns about and leaves out (`not`,
`if`/`then`/`else`, `uniqueItems`, `contains`, dependencies, `allOf` with several parts, an unknown
`format`, `multipleOf` on numbers), and of `$ref`, `const`, `enum`, `anyOf`, `oneOf`, `allOf` and
`type` it reads only the first present, dropping the others' siblings. A reply constrained by such a
grammar could break the schema the client relies on, so these schemas are refused here, naming the
place (a JSON pointer) and the keyword; annotations (`title`, `description`, `default`, ...) are fine.
The converter's own errors (a `$ref` that points nowhere, an impossible range) come from xgrammar.
"""

from __future__ import annotations

from typing import Any

UNSUPPORTED = {
    "not": "negation",
    "if": "conditional schemas", "then": "conditional schemas", "else": "conditional schemas",
    "dependentRequired": "dependencies", "dependentSchemas": "dependencies", "dependencies": "dependencies",
    "contains": "array containment", "minContains": "array containment", "maxContains": "array containment",
    "$dynamicRef": "dynamic references", "$recursiveRef": "dynamic references",
}
# xgrammar's known string formats (each becomes a regular expression)
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Of these, the converter reads the first one present and nothing else of the others.
BRANCHES = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties"},
    "array": {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"},
    "string": {"pattern", "format", "minLength", "maxLength"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}
CONSTRAINING = set().union(*TYPE_KEYWORDS.values()) | set(BRANCHES) | {"type"}
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "unevaluatedItems")


class UnsupportedSchema(ValueError):
    """A schema no grammar here enforces; the message names the place and the keyword."""


def check_schema(schema: Any, where: str = "#") -> None:
    """Raise UnsupportedSchema if any part of `schema` cannot be enforced as written."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{where}: a schema must be a JSON object or a boolean, got {_kind(schema)}")
    for keyword, what in UNSUPPORTED.items():
        if keyword in schema:
            raise UnsupportedSchema(f"{where}: `{keyword}` ({what}) cannot be enforced by a grammar; remove it")
    _check_values(schema, where)
    _check_siblings(schema, where)
    for name in SUBSCHEMA_MAPS:
        for key, sub in _mapping(schema, name, where).items():
            check_schema(sub, f"{where}/{name}/{key}")
    for name in SUBSCHEMA_LISTS:
        for index, sub in enumerate(_listing(schema, name, where)):
            check_schema(sub, f"{where}/{name}/{index}")
    for name in SUBSCHEMAS:
        if name in schema:
            check_schema(schema[name], f"{where}/{name}")


def _check_values(schema: dict, where: str) -> None:
    if schema.get("uniqueItems") is True:
        raise UnsupportedSchema(f"{where}: `uniqueItems` cannot be enforced by a grammar; remove it")
    if "format" in schema and schema["format"] not in FORMATS:
        raise UnsupportedSchema(f"{where}: string format {schema['format']!r} cannot be enforced; known formats: "
                                f"{', '.join(sorted(FORMATS))} (or use `pattern`)")
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise UnsupportedSchema(f"{where}: `multipleOf` is enforced on integers only; drop it or make the "
                                f"type \"integer\"")
    if len(schema.get("allOf") or ()) > 1:
        raise UnsupportedSchema(f"{where}: `allOf` with several schemas cannot be enforced by a grammar; "
                                f"merge them into one schema")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise UnsupportedSchema(f"{where}: `$ref` {ref!r} is not a reference inside this schema (\"#/...\")")


def _check_siblings(schema: dict, where: str) -> None:
    """Keywords the converter would drop because another one decides the schema."""
    first = next((name for name in BRANCHES if name in schema), None)
    if first is None:
        types = schema.get("type", _implied_type(schema))
        allowed = _type_keywords(types)
        extra = sorted(name for name in CONSTRAINING - {"type"} if name in schema and name not in allowed)
        if extra:
            raise UnsupportedSchema(f"{where}: {', '.join(f'`{n}`' for n in extra)} do not apply to "
                                    + (f"type {types!r}" if types else "a schema without `type`")
                                    + "; remove them or set the type they belong to")
        return
    allowed = {"type"} | _type_keywords(schema.get("type")) if first in ("const", "enum") else set()
    dropped = sorted(name for name in CONSTRAINING if name in schema and name != first and name not in allowed)
    if dropped:
        raise UnsupportedSchema(f"{where}: beside `{first}`, {', '.join(f'`{n}`' for n in dropped)} would be "
                                f"ignored; move them into the schema `{first}` selects")


def _type_keywords(types: Any) -> set[str]:
    """The keywords that constrain values of these types (`type` may be one name or a list)."""
    names = types if isinstance(types, list) else [types]
    return set().union(*(TYPE_KEYWORDS.get(name, set()) for name in names if isinstance(name, str)))


def _implied_type(schema: dict) -> str | None:
    """The type the converter assumes for a schema without `type`."""
    if any(name in schema for name in ("properties", "additionalProperties", "unevaluatedProperties")):
        return "object"
    if any(name in schema for name in ("items", "prefixItems", "unevaluatedItems")):
        return "array"
    return None


def _mapping(schema: dict, name: str, where: str) -> dict:
    value = schema.get(name, {})
    if not isinstance(value, dict):
        raise UnsupportedSchema(f"{where}/{name}: must be an object of schemas, got {_kind(value)}")
    return value


def _listing(schema: dict, name: str, where: str) -> list:
    value = schema.get(name, [])
    if not isinstance(value, list):
        raise UnsupportedSchema(f"{where}/{name}: must be a list of schemas, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), type(value).__name__)
