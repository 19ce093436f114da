"""JSON schemas as the grammars read them: strict by default, written compactly.

Strict (llama.cpp's schema-to-grammar and xgrammar's strict mode read generated JSON this way): an
object schema that lists `properties` and says nothing of `additionalProperties` or
`patternProperties` admits no other keys. Clients such as LangChain's `bind_tools` send parameter
schemas without `additionalProperties`; read leniently, the grammar would let a forced call invent
keys until `max_tokens`. `allOf` members are left as they are (each member closed would refuse the
others' keys). `--lenient-json-schema` reads schemas as JSON Schema does (unstated: any key).

JSON is written as Python's json.dumps writes it: ", " and ": ", no other whitespace (a free
whitespace rule lets a model pad forever; vLLM's `disable-any-whitespace` answers the same).
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
    """A `%json` rule body: the schema (closed where `strict`), JSON written compactly (the
    schema's own x-guidance options win). ValueError where the schema is not an object."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, not {type(schema).__name__}")
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise ValueError(f"x-guidance: expected an object of llguidance's options, not {type(own).__name__}")
    if strict:
        schema = strict_schema(schema)
    options = {**JSON_STYLE, **own}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


REF_LIMIT = 32  # a chain of $refs is followed this far


def resolved(schema: Any, root: Any) -> Any:
    """`schema` with a local `$ref` (`#/$defs/X`, `#/definitions/X`, any `#/...` pointer into
    `root`) followed, the referring schema's other keywords kept over the target's; as it is where
    it has none, or one that points nowhere here."""
    for _ in range(REF_LIMIT):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        target = _pointed(root, ref[1:])
        if not isinstance(target, dict):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _pointed(root: Any, pointer: str) -> Any:
    """What a JSON pointer ("/$defs/Item") names in `root`, or None."""
    node = root
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def with_definitions(schema: Any, root: Any) -> Any:
    """A subschema of `root` made a schema of its own: the root's `$defs` and `definitions` beside
    it, so that its local `$ref`s still point at them."""
    if not isinstance(schema, dict) or not isinstance(root, dict):
        return schema
    shared = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict) and k not in schema}
    return {**schema, **shared} if shared else schema
