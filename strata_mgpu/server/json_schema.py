"""JSON schemas as the grammars read them: strict by default, written compactly.

Strict (llama.cpp's schema-to-grammar and xgrammar's strict mode read generated JSON this way): an
object schema that lists `properties` and says nothing of `additionalProperties`,
`patternProperties` or `unevaluatedProperties` admits no other keys. Clients such as LangChain's
`bind_tools` send parameter schemas without `additionalProperties`; read leniently, the grammar
would let a forced call invent keys until `max_tokens`. Members that describe the same object
are not closed at their own level where that would refuse what the object allows: an `anyOf` /
`oneOf` member only where it says `type: object` itself, an `allOf` member never (each closed
would refuse the others' keys; the objects inside them are closed), `not`, `if`/`then`/`else` and
`dependentSchemas` left as they are; and an object whose members list keys it does not is left
to them. `--lenient-json-schema` reads schemas as JSON Schema does (unstated: any key).

JSON is written as json.dumps writes it: ", " and ": ", no other whitespace (a free whitespace
rule lets a model pad forever).
"""

from __future__ import annotations

import json
from typing import Any

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# keywords whose subschemas describe other instances (a property's value, an item, ...): each is
# closed at its own level
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems")
_MAPPING = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("prefixItems",)
# keywords whose members describe the same instance: anyOf / oneOf members closed only where they
# are objects of their own (`type: object`), allOf members never at their own level; not, if, then,
# else and dependentSchemas are conditions on it, left as they are
_ALTERNATIVES = ("anyOf", "oneOf")
_CONJUNCTS = ("allOf",)
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any, own_level: bool = True) -> Any:
    """`schema` with every object that lists properties and states none of additionalProperties,
    patternProperties and unevaluatedProperties closed to other keys; the input is not changed.
    `own_level` false: the schema is a member describing the same instance as its parent (its
    subschemas are still closed)."""
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
    for key in _ALTERNATIVES:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s, own_level=_is_object(s)) for s in out[key]]
    for key in _CONJUNCTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s, own_level=False) for s in out[key]]
    if own_level and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS) \
            and not _members_add_keys(out):
        out["additionalProperties"] = False
    return out


def _is_object(schema: Any) -> bool:
    """Whether a member is an object schema of its own: it says `type: object`."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "object" or isinstance(kind, list) and "object" in kind


def _members_add_keys(schema: dict[str, Any]) -> bool:
    """Whether a member of its anyOf / oneOf / allOf lists a property the schema itself does not
    (the schema closed would refuse it: the members decide then)."""
    own = schema["properties"]
    for key in (*_ALTERNATIVES, *_CONJUNCTS):
        members = schema.get(key)
        for member in members if isinstance(members, list) else []:
            listed = member.get("properties") if isinstance(member, dict) else None
            if isinstance(listed, dict) and any(k not in own for k in listed):
                return True
    return False


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
