"""A checker for the part of JSON Schema draft-07 that portcullis.sections writes.

The `jsonschema` package is not a dependency of this project; this helper evaluates the
keywords the generator uses, with their draft-07 meaning, and refuses any schema holding a
keyword it does not know, so that a generator writing a new keyword cannot pass unchecked.
Patterns are matched with Python's `re.search`: the generator writes only patterns that
mean the same in ECMA-262 (which editors use) and Python.
"""

from __future__ import annotations

import re
from typing import Any

ANNOTATIONS = {"$schema", "$id", "title", "description", "default"}
KEYWORDS = {
    "type",
    "enum",
    "anyOf",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def check_schema(schema: Any, where: str = "#") -> None:
    """Raise AssertionError where `schema` is not a well-formed draft-07 schema of our subset."""
    assert isinstance(schema, dict), f"{where}: a schema is an object"
    unknown = set(schema) - KEYWORDS - ANNOTATIONS
    assert not unknown, f"{where}: keywords outside the subset: {sorted(unknown)}"
    if "type" in schema:
        assert schema["type"] in TYPES, f"{where}: type {schema['type']!r}"
    if "enum" in schema:
        assert isinstance(schema["enum"], list) and schema["enum"], f"{where}: enum"
    if "pattern" in schema:
        re.compile(schema["pattern"])
    for key in ("minimum", "maximum", "exclusiveMinimum"):
        if key in schema:
            value = schema[key]
            assert isinstance(value, int | float) and not isinstance(value, bool), where
    if "minItems" in schema:
        assert isinstance(schema["minItems"], int) and schema["minItems"] >= 0, where
    properties = set(schema.get("properties", {}))
    for index, member in enumerate(schema.get("anyOf", [])):
        if set(member) == {"required"}:
            # A member that only requires keys: the keys of the object around it (a value
            # given as KEY or as KEY_file).
            assert set(member["required"]) <= properties, f"{where}/anyOf/{index}: required"
            continue
        check_schema(member, f"{where}/anyOf/{index}")
    for name, member in schema.get("properties", {}).items():
        check_schema(member, f"{where}/properties/{name}")
    if "required" in schema:
        required = schema["required"]
        assert isinstance(required, list) and len(set(required)) == len(required), where
        assert set(required) <= properties, f"{where}: required"
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, bool):
        check_schema(extra, f"{where}/additionalProperties")
    if "items" in schema:
        check_schema(schema["items"], f"{where}/items")


def errors(schema: dict[str, Any], value: Any, where: str = "") -> list[str]:
    """Why `value` does not match `schema`: empty when it does."""
    found: list[str] = []
    if "type" in schema and not _is_type(value, schema["type"]):
        return [f"{where or '/'}: not {schema['type']}"]
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"]):
        found.append(f"{where or '/'}: not one of {schema['enum']}")
    if "anyOf" in schema and all(errors(m, value, where) for m in schema["anyOf"]):
        found.append(f"{where or '/'}: matches none of anyOf")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        found.append(f"{where or '/'}: does not match {schema['pattern']}")
    if _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            found.append(f"{where or '/'}: below minimum")
        if "maximum" in schema and value > schema["maximum"]:
            found.append(f"{where or '/'}: above maximum")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            found.append(f"{where or '/'}: not above exclusiveMinimum")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        found += [f"{where}/{k}: required" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                found += errors(properties[key], item, f"{where}/{key}")
            elif extra is False:
                found.append(f"{where}/{key}: not allowed")
            elif isinstance(extra, dict):
                found += errors(extra, item, f"{where}/{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            found.append(f"{where or '/'}: too few items")
        if "items" in schema:
            for index, item in enumerate(value):
                found += errors(schema["items"], item, f"{where}/{index}")
    return found


def _is_type(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "integer":  # draft-06 on: a number with no fractional part
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if name == "string":
        return isinstance(value, str)
    if name == "array":
        return isinstance(value, list)
    return isinstance(value, dict)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: a boolean is never a number, 1 equals 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)
