"""JSON Schemas of mixed shape for the constrained-decoding tests and bench (imported by name from both).

Nested objects, arrays with minItems/maxItems, enums, const, optional fields,
bounded integers and numbers, $ref/$defs, anyOf, nullable types, string
patterns and formats. Strings carry maxLength so a small model's output ends
within a bounded number of tokens.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SHORT = {"type": "string", "minLength": 1, "maxLength": 12}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
         "y": {"type": "number", "minimum": -100, "maximum": 100}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"name": NAME, "address": obj({"street": {"type": "string", "maxLength": 30}, "city": NAME,
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 1, "maxItems": 5}}),
    obj({"title": NAME, "subtitle": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
        required=["title"]),
    obj({"done": {"type": "boolean"}, "priority": {"type": "integer", "minimum": 1, "maximum": 5}}),
    {"$defs": {"point": obj({"x": {"type": "integer", "minimum": 0, "maximum": 99},
                              "y": {"type": "integer", "minimum": 0, "maximum": 99}})},
     **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, SHORT]}}),
    obj({"version": {"const": 2}, "name": NAME}),
    obj({"items": {"type": "array", "maxItems": 3,
                   "items": obj({"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 10}})}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"date": {"type": "string", "format": "date"}, "event": NAME}),
    {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 4},
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
         "currency": {"enum": ["USD", "EUR", "GBP"]}}),
    obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    obj({"level": {"enum": [1, 2, 3]}, "label": SHORT}),
    obj({"first": NAME, "middle": {"anyOf": [SHORT, {"type": "null"}]}, "last": NAME}),
    obj({"id": {"type": ["integer", "null"], "minimum": 1, "maximum": 9999}}),
    obj({"title": NAME, "ingredients": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 4},
         "servings": {"type": "integer", "minimum": 1, "maximum": 12}}),
    obj({"title": NAME, "author": obj({"first": SHORT, "last": SHORT}),
         "isbn": {"type": "string", "pattern": "^[0-9]{10}$"}}),
    obj({"city": NAME, "temperature": {"type": "number", "minimum": -50, "maximum": 60},
         "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}}),
    obj({"event": NAME, "attendees": {"type": "array", "maxItems": 2,
                                      "items": obj({"name": SHORT, "rsvp": {"type": "boolean"}})}}),
    {"$defs": {"person": obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 99}})},
     **obj({"people": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2}})},
    obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
         "month": {"type": "integer", "minimum": 1, "maximum": 12},
         "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
    obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                 "minItems": 3, "maxItems": 3}}),
    obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}, required=[]),
    {"anyOf": [obj({"cat": SHORT}), obj({"dog": SHORT, "barks": {"type": "boolean"}})]},
    {"enum": ["alpha", "beta", "gamma"]},
    obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
         "price": {"type": "number", "minimum": 0, "maximum": 10000},
         "in_stock": {"type": "boolean"},
         "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "maxItems": 3}}),
    obj({"id": {"type": "string", "format": "uuid"}, "ok": {"type": "boolean"}}),
    obj({"user": obj({"name": NAME, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                                               "minItems": 1, "maxItems": 3}}),
         "active": {"type": "boolean"}}),
]
