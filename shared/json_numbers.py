"""JSON numbers a grammar lets a model write: bounded, never endless digits.

llguidance's JSON number is `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`: at temperature
1 a small model wrote a 300-digit number until max_tokens. `bound_numbers` rewrites a schema
so every place a number may appear carries bounds llguidance turns into a finite regex:
integers within +-(10**17 - 1) (float64's 17 significant digits), other numbers within
+-10**17 with at most 10 decimals (`multipleOf` 1e-10, the finest llguidance takes). No
exponent can be written (a bounded range has none). A schema's own bounds and `multipleOf`
are kept, narrowed to these. Places where any value may stand (`{}`, `true`, an object's
unlisted members, an array's unlisted items) become a bounded "any JSON value".
"""

from __future__ import annotations

from typing import Any

INT_LIMIT = 10**17 - 1
NUMBER_LIMIT = 1e17
DECIMALS = 1e-10
ANY_REF = "#/$defs/ladle_bounded_any"

# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# a node with one of these is defined elsewhere or enumerated: left to its parts
_DEFINED = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")


def bound_numbers(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every number bounded (see the module doc); the input is unchanged."""
    bounded = _node(schema)
    defs = dict(bounded.get("$defs") or {})
    defs["ladle_bounded_any"] = _node({})
    return {**bounded, "$defs": defs}


def _node(schema: Any) -> Any:
    if schema is True:
        return {"$ref": ANY_REF}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _node(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_node(item) for item in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _node(value) for name, value in out[key].items()}
    if any(key in out for key in _DEFINED):
        return out
    types = _types(out)
    if "integer" in types or "number" in types:
        _bound(out, integer="number" not in types)
    if "array" in types and "items" not in out:
        out["items"] = {"$ref": ANY_REF}
    if "object" in types and "additionalProperties" not in out:
        out["additionalProperties"] = {"$ref": ANY_REF}
    return out


def _types(schema: dict[str, Any]) -> set[str]:
    declared = schema.get("type")
    if declared is None:  # any type: the keywords of each apply to values of that type
        return {"number", "array", "object"}
    return set(declared) if isinstance(declared, list) else {declared}


def _bound(schema: dict[str, Any], integer: bool) -> None:
    """Narrow the numeric bounds in place to the limits."""
    limit = INT_LIMIT if integer else NUMBER_LIMIT
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    low = low if isinstance(low, (int, float)) and not isinstance(low, bool) else None
    high = high if isinstance(high, (int, float)) and not isinstance(high, bool) else None
    if low is None or low < -limit:
        schema.pop("exclusiveMinimum", None)
        schema["minimum"] = -limit if high is None or high > -limit else high * 10
    if high is None or high > limit:
        schema.pop("exclusiveMaximum", None)
        schema["maximum"] = limit if low is None or low < limit else low * 10
    if not integer and "multipleOf" not in schema:
        schema["multipleOf"] = DECIMALS
