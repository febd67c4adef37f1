"""The structured-output fields of an OpenAI-compatible body, read into kvgate.v1's
SamplingParams `constraint` oneof.

Three spellings name the same constraints: OpenAI's `response_format` (`json_object`, or
`json_schema` with its `schema`), vLLM's `structured_outputs` extension (`json`, `regex`,
`choice`, `grammar`, `json_object`) and vLLM's older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. A body sets at most one. The constraint's gRPC field is
mapped back to the body's (`params.json_schema` -> `response_format.json_schema.schema`), so
that a refusal by the compiler names what the client sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.errors import InvalidArgument
from protos.kvgate.v1 import inference_pb2

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs keys -> kvgate.v1's constraint fields.
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED)  # read in this order
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


@dataclass(frozen=True, slots=True)
class BodyConstraint:
    """A constraint as the body gave it."""

    field: str  # kvgate.v1's constraint field: json_schema, json_object, regex, grammar, choice
    value: str | list[str] | None  # the text, the choices, or None (json_object)
    body_name: str  # where the body holds it, e.g. response_format.json_schema.schema


def fill_constraint(
    body: dict, params: inference_pb2.SamplingParams, names: dict[str, str]
) -> None:
    """Set `params`' constraint from the body (none: nothing), and map its gRPC field name
    to the body's in `names`.

    Raises:
        InvalidArgument: a malformed constraint field, or more than one, naming it.
    """
    found = [c for name in CONSTRAINT_FIELDS if (c := _read(body, name)) is not None]
    if len(found) > 1:
        first, second = (c.body_name.partition(".")[0] for c in found[:2])
        raise InvalidArgument(second, f"set one constraint; {first} is set too")
    if not found:
        return
    constraint = found[0]
    if constraint.field == "json_object":
        params.json_object.SetInParent()
    elif constraint.field == "choice":
        params.choice.choices.extend(constraint.value)
    else:
        setattr(params, constraint.field, constraint.value)
    names[f"params.{constraint.field}"] = constraint.body_name


def _read(body: dict, name: str) -> BodyConstraint | None:
    value = body.get(name)
    if value is None:
        return None
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _kind_value(GUIDED[name], value, name)


def _response_format(value: object) -> BodyConstraint | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidArgument(
            "response_format.type", "must be 'text', 'json_object' or 'json_schema'"
        )
    if extra := set(value) - {"type", kind}:
        raise InvalidArgument(f"response_format.{sorted(extra)[0]}", f"not read with {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return BodyConstraint("json_object", None, "response_format")
    return _json_schema(value.get("json_schema"))


def _json_schema(value: object) -> BodyConstraint:
    name = "response_format.json_schema"
    if not isinstance(value, dict):
        raise InvalidArgument(name, "required with type 'json_schema': {name, schema, strict}")
    if extra := set(value) - JSON_SCHEMA_KEYS:
        raise InvalidArgument(f"{name}.{sorted(extra)[0]}", "unknown field")
    for key in ("name", "description"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise InvalidArgument(f"{name}.{key}", "must be a string")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise InvalidArgument(f"{name}.strict", "must be true or false")
    if value.get("schema") is None:
        raise InvalidArgument(f"{name}.schema", "required: the JSON Schema the answer must fit")
    return _kind_value("json_schema", value["schema"], f"{name}.schema")


def _structured_outputs(value: object) -> BodyConstraint:
    name = "structured_outputs"
    if not isinstance(value, dict):
        kinds = ", ".join(STRUCTURED_OUTPUTS)
        raise InvalidArgument(name, f"must be an object with one of {kinds}")
    if extra := set(value) - set(STRUCTURED_OUTPUTS):
        raise InvalidArgument(f"{name}.{sorted(extra)[0]}", "is not supported by kvgate")
    if value.get("json_object") is False:
        raise InvalidArgument(f"{name}.json_object", "must be true when set")
    given = [key for key, kind_value in value.items() if kind_value is not None]
    if len(given) != 1:
        raise InvalidArgument(name, f"set exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    key = given[0]
    return _kind_value(STRUCTURED_OUTPUTS[key], value[key], f"{name}.{key}")


def _kind_value(field: str, value: object, body_name: str) -> BodyConstraint:
    """The value of one constraint kind, checked for its JSON type."""
    if field == "json_object":
        if value is not True:
            raise InvalidArgument(body_name, "must be true")
        return BodyConstraint(field, None, body_name)
    if field == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(body_name, "must be a list of strings")
        return BodyConstraint(field, value, body_name)
    if field == "json_schema" and isinstance(value, dict | bool):
        return BodyConstraint(field, json.dumps(value), body_name)
    if not isinstance(value, str):
        expected = "a JSON Schema (an object or its JSON text)" if field == "json_schema" else ""
        raise InvalidArgument(body_name, f"must be {expected or 'a string'}")
    return BodyConstraint(field, value, body_name)
