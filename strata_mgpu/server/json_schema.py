"""JSON schemas as the grammars read them: strict by default, written compactly.

Strict (as llama.cpp's schema-to-grammar and xgrammar's strict mode read them): an object schema
that lists `properties` and says nothing of `additionalProperties` or `patternProperties` admits
no other keys. Clients such as LangChain's `bind_tools` send parameter schemas without
`additionalProperties`; read leniently, a forced call could invent keys until `max_tokens`.
`allOf` members are left as they are (each closed would refuse the others' keys).
`--lenient-json-schema` reads schemas as JSON Schema does.

JSON is written as json.dumps writes it: ", " and ": ", no other whitespace (a free whitespace
rule lets a model pad forever).
"""

from __future__ import annotations

import json
from typing import Any

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# keywords whose value is one subschema, or a mapping / list of them
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_MAPPING = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")


def strict_schema(schema: Any) -> Any:
    """`schema` with every object that lists properties and states no additionalProperties (nor
    patternProperties) closed to other keys; the input is not changed."""
    if isinstance(schema, list):  # draft-04's tuple `items`
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    for key in _MAPPING:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_rule(schema: dict[str, Any], *, strict: bool = True) -> str:
    """A `%json` rule body: the schema (closed where `strict`), JSON written compactly (the schema's
    own x-guidance options win)."""
    if strict:
        schema = strict_schema(schema)
    options = {**JSON_STYLE, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
